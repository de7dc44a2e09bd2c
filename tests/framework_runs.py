"""One rank of the framework runs of tests/test_integrations.py (docs/integrations.md).

    python tests/framework_runs.py OUT_DIR RANK WORLD_SIZE PORT FRAMEWORK...

Each rank runs every named framework twice, on gloo and on "dk", in this one process (torch
and the frameworks are imported once), and writes ``OUT_DIR/<framework>-<backend>-<rank>.pt``:
the run's losses and final parameters, or ``{"error": traceback}``, or ``{"skip": reason}``
when the framework is not installed. Every run starts from the same seed and data, so the
test compares the two backends bitwise.

The examples are the ones docs/integrations.md shows, kept to a few steps: the point is the
backend under the framework, not the training.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import dist_kernels as dk

STEPS = 4
TIMEOUT = datetime.timedelta(seconds=120)


def _data(rank: int, n: int = 16):
    """The same batches on every backend; each rank its own shard."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _params(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _teardown() -> None:
    """Ends a run: every rank past its last collective, the framework's objects freed, then
    the group destroyed. Freeing a gloo group while one of its threads still runs a future's
    Python callback deadlocks inside torch (the destructor joins that thread holding the GIL
    it waits for): the barrier lets those callbacks finish first."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _init(backend: str, out_dir: str, run: str, rank: int, world_size: int) -> None:
    """The default group, made before the framework looks (the workaround where the framework
    refuses the name "dk"; for gloo the same path, so the two runs differ in the backend only)."""
    dk.init_process_group(
        backend,
        init_method=f"file://{os.path.join(out_dir, f'{run}-{backend}.store')}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )


# -- PyTorch Lightning -------------------------------------------------------------------------


def lightning(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """DDPStrategy(process_group_backend=...): Lightning makes the group itself (env://).
    Two epochs of two steps with validation (sync_dist); then the same from the epoch-1
    checkpoint: the resumed run must end where the straight one did."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach())
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def loader():
        from torch.utils.data import DataLoader, TensorDataset

        x, y = _data(0, 8 * world_size)  # Lightning's sampler shards it over the ranks
        return DataLoader(TensorDataset(x, y), batch_size=2)

    def trainer(epochs, root):
        return L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=DDPStrategy(process_group_backend=backend, timeout=TIMEOUT),
            max_epochs=epochs,
            limit_train_batches=2,
            limit_val_batches=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            deterministic=True,
        )

    root = os.path.join(out_dir, f"lightning-{backend}")
    first = Module()
    t = trainer(1, root)
    t.fit(first, loader(), loader())
    ckpt = os.path.join(root, "epoch1.ckpt")
    t.save_checkpoint(ckpt)
    straight = Module()
    t2 = trainer(2, root)
    t2.fit(straight, loader(), loader())
    val = float(t2.callback_metrics["val_loss"])
    resumed = Module()
    trainer(2, root).fit(resumed, loader(), loader(), ckpt_path=ckpt)
    group_backend = dist.get_backend()
    _teardown()
    return {
        "losses": torch.stack(straight.losses),
        "params": _params(straight),
        "resumed_params": _params(resumed),
        "val_loss": val,
        "group_backend": group_backend,
    }


def lightning_fsdp2(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """ModelParallelStrategy(process_group_backend=...): FSDP2 (fully_shard over the
    strategy's data-parallel mesh) in configure_model; a few steps."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.losses = []

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = _data(0, 4 * STEPS * world_size)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ModelParallelStrategy(
            data_parallel_size=world_size, tensor_parallel_size=1, process_group_backend=backend
        ),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(out_dir, f"lightning-fsdp2-{backend}"),
    )
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    params = {k: v.full_tensor().detach().clone() for k, v in module.net.state_dict().items()}
    group_backend = dist.get_backend()
    _teardown()
    return {"losses": torch.stack(module.losses), "params": params, "group_backend": group_backend}


# -- HF accelerate -----------------------------------------------------------------------------


def accelerate(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """accelerate refuses backend="dk"; with the group made first, Accelerator(cpu=True)
    uses it and wraps the model in DDP."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from torch.utils.data import DataLoader, TensorDataset

    refusal = ""
    if backend == "dk":
        try:
            PartialState(cpu=True, backend="dk")
        except ValueError as e:
            refusal = str(e)
        PartialState._reset_state()
    _init(backend, out_dir, "accelerate", rank, world_size)
    again = dk.init_process_group(backend) is dist.group.WORLD  # asked twice: no error
    other = "gloo" if backend == "dk" else "dk"
    try:
        dk.init_process_group(other)
        clash = ""
    except RuntimeError as e:
        clash = str(e)
    accelerator = Accelerator(cpu=True)
    model, opt = _net(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(rank)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # this rank's own shard
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for (xb, yb), _ in zip(loader, range(STEPS)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        losses.append(loss.detach())
    wrapped = type(model).__name__
    params = _params(accelerator.unwrap_model(model))
    state_backend = accelerator.state.backend
    AcceleratorState._reset_state(reset_partial_state=True)
    # The trap: without cpu=True on a machine without GPUs, accelerate skips DDP silently.
    no_cpu_flag = type(Accelerator().prepare(_net())).__name__
    AcceleratorState._reset_state(reset_partial_state=True)
    _teardown()
    return {
        "losses": torch.stack(losses),
        "params": params,
        "wrapped": wrapped,
        "refusal": refusal,
        "state_backend": state_backend,
        "wrapped_without_cpu_flag": no_cpu_flag,
        "helper": (again, clash),
    }


# -- transformers Trainer ----------------------------------------------------------------------


def _hf_trainer(backend: str, out_dir: str, rank: int, world_size: int, deepspeed=None) -> dict:
    """transformers' Trainer on the default group made first (``ddp_backend`` unset), with
    a DeepSpeed config (``TrainingArguments(deepspeed=...)``) or without."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, labels):
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    run = "transformers" if deepspeed is None else "transformers_deepspeed"
    if deepspeed is not None:
        _deepspeed_reset()
    _init(backend, out_dir, run, rank, world_size)
    x, y = _data(0, 4 * STEPS * world_size)  # the Trainer's sampler shards it
    dataset = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"{run}-{backend}"),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        deepspeed=deepspeed,
    )
    model = Model()
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = torch.tensor([e["loss"] for e in trainer.state.log_history if "loss" in e])
    wrapped = type(trainer.model_wrapped).__name__
    AcceleratorState._reset_state(reset_partial_state=True)
    _teardown()
    return {"losses": losses, "params": _params(model), "wrapped": wrapped}


def transformers(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """TrainingArguments(ddp_backend="dk") is refused; with the group made first (and
    ddp_backend left unset) Trainer trains on it, in torch DDP."""
    from transformers import TrainingArguments

    refusal = ""
    if backend == "dk":
        try:
            TrainingArguments(output_dir=out_dir, ddp_backend="dk", use_cpu=True)
        except ValueError as e:
            refusal = str(e)
    return {**_hf_trainer(backend, out_dir, rank, world_size), "refusal": refusal}


def transformers_deepspeed(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """Trainer with a DeepSpeed ZeRO-2 config (``--deepspeed ds_config.json``) on the group
    made first: DeepSpeed finds it made and trains on it."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,  # the Trainer's torch SGD
    }
    return _hf_trainer(backend, out_dir, rank, world_size, deepspeed=config)


# -- DeepSpeed ---------------------------------------------------------------------------------


def _deepspeed_reset() -> None:
    """DeepSpeed caches its communication backend and its groups in module globals; they name
    the previous run's (destroyed) groups, so they are dropped first, as a fresh process would
    start."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    for name, value in vars(groups).items():
        if name.isupper() and ("_GROUP" in name or name.startswith("_MPU_")):
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(groups, name, None)


def _deepspeed_init(backend: str) -> None:
    """deepspeed.init_distributed(dist_backend=...), the call a DeepSpeed script makes
    (env://, torchrun's variables)."""
    import deepspeed

    _deepspeed_reset()
    deepspeed.init_distributed(dist_backend=backend, timeout=TIMEOUT)


def _deepspeed_config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "zero_allow_untested_optimizer": True,  # a torch optimizer: no DeepSpeed op to build
        **extra,
    }


def _zero_engine(stage: int, dtype: torch.dtype):
    import deepspeed

    model = _net()
    config = _deepspeed_config(
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        # small buckets: several reduce / gather calls a step, not one
        zero_optimization={
            "stage": stage,
            "reduce_bucket_size": 64,
            "allgather_bucket_size": 64,
            "stage3_prefetch_bucket_size": 64,
            "stage3_param_persistence_threshold": 0,
        },
        bf16={"enabled": dtype == torch.bfloat16},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def _zero_micro_batches(engine, rank: int, dtype: torch.dtype, steps: range) -> list:
    """Two micro-batches per optimizer step, each rank its own shard; the losses."""
    x, y = _data(rank)
    losses = []
    for i in range(2 * steps.start, 2 * steps.stop):
        xb, yb = x[2 * i : 2 * i + 2].to(dtype), y[2 * i : 2 * i + 2].to(dtype)
        loss = nn.functional.mse_loss(engine(xb), yb)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return losses


def _zero_params(engine, stage: int) -> dict:
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return _params(engine.module)


def deepspeed_zero(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """deepspeed.init_distributed(dist_backend="dk"), then ZeRO stages 1, 2 and 3 with
    gradient accumulation and clipping, in FP32 and in BF16, each rank on its own shard; in
    FP32 also the same run stopped halfway, saved (engine.save_checkpoint), loaded into a
    fresh engine and finished."""
    _deepspeed_init(backend)
    out = {"group_backend": dist.get_backend()}
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            engine = _zero_engine(stage, dtype)
            losses = _zero_micro_batches(engine, rank, dtype, range(STEPS))
            key = f"stage{stage}-{str(dtype).split('.')[-1]}"
            out[key] = {"losses": torch.stack(losses), "params": _zero_params(engine, stage)}
            engine.destroy()
        half, ckpt = STEPS // 2, os.path.join(out_dir, f"deepspeed-{backend}-stage{stage}")
        first = _zero_engine(stage, torch.float32)
        _zero_micro_batches(first, rank, torch.float32, range(half))
        first.save_checkpoint(ckpt, tag="half")
        first.destroy()
        resumed = _zero_engine(stage, torch.float32)
        resumed.load_checkpoint(ckpt, tag="half")
        _zero_micro_batches(resumed, rank, torch.float32, range(half, STEPS))
        out[f"stage{stage}-float32"]["resumed_params"] = _zero_params(resumed, stage)
        resumed.destroy()
    _teardown()
    return out


def deepspeed_moe(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """deepspeed.moe.layer.MoE with its experts over an expert-parallel group of every rank
    (the token exchange is all_to_all_single on the group), under ZeRO stage 1 with the
    expert and dense parameters in separate groups, as DeepSpeed's MoE tutorial sets it."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    _deepspeed_init(backend)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 16)
            expert = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            self.moe = MoE(16, expert, num_experts=4, ep_size=world_size, k=2, min_capacity=16)
            self.out = nn.Linear(16, 2)

        def forward(self, x):
            h, aux, _ = self.moe(self.inp(x))
            return self.out(h), aux

    model = Net()
    param_groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"}
    )
    opt = torch.optim.AdamW(param_groups, lr=1e-2)
    config = _deepspeed_config(zero_optimization={"stage": 1})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x, y = _data(rank)
    losses = []
    for i in range(STEPS):
        out, aux = engine(x[4 * i : 4 * i + 4])
        loss = nn.functional.mse_loss(out, y[4 * i : 4 * i + 4]) + 0.01 * aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    params = _params(engine.module)
    engine.destroy()
    _teardown()
    return {"losses": torch.stack(losses), "params": params}


def deepspeed_pipe(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """deepspeed.pipe.PipelineModule over two stages (one a rank): its 1F1B schedule sends
    activations and gradients with torch.distributed send / recv (broadcasts on 2-rank
    groups) on the group given."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    _deepspeed_init(backend)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)]
    net = PipelineModule(layers=layers, num_stages=world_size, loss_fn=nn.MSELoss())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    config = _deepspeed_config(gradient_accumulation_steps=4)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    x, y = _data(0, 16 * STEPS)  # every stage reads the same stream; DeepSpeed uses its ends
    batches = iter([(x[i : i + 4], y[i : i + 4]) for i in range(0, len(x), 4)])
    losses = torch.stack([engine.train_batch(data_iter=batches).detach() for _ in range(STEPS)])
    params = _params(engine.module)
    engine.destroy()
    _teardown()
    return {"losses": losses, "params": params}


def deepspeed_autotp(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """DeepSpeed's AutoTP training ("tensor_parallel": {"autotp_size": 2}) of a small
    transformers Llama built here: its Linear layers sharded over a tensor-parallel group that
    DeepSpeed takes from a DeviceMesh of the dk world, with ZeRO stage 1 over data parallel."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    _deepspeed_init(backend)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(5)  # every tp rank reads the same tokens
    first = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    with torch.no_grad():
        unsharded_first_loss = model(input_ids=first, labels=first).loss
    g.manual_seed(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds_config = _deepspeed_config(
        tensor_parallel={"autotp_size": world_size}, zero_optimization={"stage": 1}
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    params = _params(engine.module)  # this rank's shards
    engine.destroy()
    _teardown()
    return {
        "losses": torch.stack(losses),
        "params": params,
        "unsharded_first_loss": unsharded_first_loss,
    }


def deepspeed_ulysses(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """DeepSpeed-Ulysses sequence parallelism (deepspeed.sequence.layer.DistributedAttention):
    each rank holds a slice of the sequence; all_to_all_single turns it into a slice of the
    heads for attention and back. Forward and backward in float64 against single-process
    attention of the whole sequence."""
    from deepspeed.sequence.layer import DistributedAttention

    _deepspeed_init(backend)

    def attention(q, k, v, *args, **kwargs):  # [seq, batch, heads, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3)

    seed = 3
    g = torch.Generator().manual_seed(seed)
    seq, batch, heads, dim = 16, 2, 4, 8
    full = [
        torch.randn(seq, batch, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    ]
    rows = slice(rank * seq // world_size, (rank + 1) * seq // world_size)
    local = [t.detach()[rows].clone().requires_grad_() for t in full]
    out = DistributedAttention(attention, dist.group.WORLD, scatter_idx=2, gather_idx=0)(
        *local,
        1,  # batch_dim_idx
    )
    out.backward(torch.ones_like(out))
    ref = attention(*full)
    ref.backward(torch.ones_like(ref))
    _teardown()
    return {
        "seed": seed,
        "out": out.detach(),
        "grads": torch.stack([t.grad for t in local]),
        "ref_out": ref.detach()[rows],
        "ref_grads": torch.stack([t.grad[rows] for t in full]),
    }


# -- Megatron-Core ------------------------------------------------------------------------------


def megatron_tp(backend: str, out_dir: str, rank: int, world_size: int) -> dict:
    """Megatron-Core's parallel_state (every group it makes, on the default backend) and its
    tensor-parallel layers: a vocab-parallel embedding, a column- and a row-parallel linear, a
    column-parallel head and the vocab-parallel cross entropy, trained 3 SGD steps at tp = 2.
    Against single-process float64 training of the same unsharded weights. (On CPU only this
    much of Megatron runs: sequence parallelism, its GPT, DDP buffers and pipeline p2p
    allocate on CUDA whatever the backend.)"""
    from megatron.core import parallel_state as ps

    _init(backend, out_dir, "megatron_tp", rank, world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        return _megatron_tp_train(backend, rank, world_size)
    finally:
        ps.destroy_model_parallel()  # Megatron's groups are module globals: gone for the next run
        _teardown()


def _megatron_tp_train(backend: str, rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tp
    from megatron.core.model_parallel_config import ModelParallelConfig

    assert dist.get_backend(ps.get_tensor_model_parallel_group()) == backend
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=world_size,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(0)  # each layer draws its whole weight, then keeps this rank's shard

    def init(t):
        return nn.init.normal_(t, std=0.2)

    vocab, dim, hidden = 32, 16, 32
    layers = nn.ModuleDict(
        {
            "emb": tp.VocabParallelEmbedding(vocab, dim, init_method=init, config=cfg),
            "up": tp.ColumnParallelLinear(dim, hidden, config=cfg, init_method=init, bias=True),
            "down": tp.RowParallelLinear(
                hidden,
                dim,
                config=cfg,
                init_method=init,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            ),
            "head": tp.ColumnParallelLinear(dim, vocab, config=cfg, init_method=init, bias=False),
        }
    )
    # the unsharded weights: the shards of every rank, in float64
    shard_dim = {"emb.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1, "head.weight": 0}
    full = {}
    for name, p in layers.named_parameters():
        if name in shard_dim:
            parts = [torch.empty_like(p.data) for _ in range(world_size)]
            dist.all_gather(parts, p.data.contiguous())
            full[name] = torch.cat(parts, shard_dim[name]).double().requires_grad_()
        else:
            full[name] = p.detach().double().requires_grad_()

    def forward(tok):  # [seq, batch] tokens, Megatron's layout
        h, _ = layers["up"](layers["emb"](tok))
        y, _ = layers["down"](nn.functional.gelu(h))
        logits, _ = layers["head"](y)
        return tp.vocab_parallel_cross_entropy(logits, tok.roll(-1, 0)).mean()

    def reference(tok):
        x = nn.functional.embedding(tok, full["emb.weight"])
        h = nn.functional.gelu(x @ full["up.weight"].T + full["up.bias"])
        y = h @ full["down.weight"].T + full["down.bias"]
        logits = y @ full["head.weight"].T
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), tok.roll(-1, 0).reshape(-1))

    opt = torch.optim.SGD(layers.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(full.values(), lr=0.5)
    g = torch.Generator().manual_seed(5)  # the same tokens on both ranks: tp shares the batch
    losses, ref_losses = [], []
    for _ in range(3):
        tok = torch.randint(0, vocab, (8, 2), generator=g)
        for o, f, out in ((opt, forward, losses), (ref_opt, reference, ref_losses)):
            o.zero_grad()
            loss = f(tok)
            loss.backward()
            o.step()
            out.append(loss.item())
    params = {k: p.detach().clone() for k, p in layers.named_parameters()}
    shards = {
        k: v.detach().chunk(world_size, shard_dim[k])[rank] if k in shard_dim else v.detach()
        for k, v in full.items()
    }
    return {"losses": losses, "ref_losses": ref_losses, "params": params, "ref_params": shards}


FRAMEWORKS = {
    "lightning": ("lightning", lightning),
    "lightning_fsdp2": ("lightning", lightning_fsdp2),
    "accelerate": ("accelerate", accelerate),
    "transformers": ("transformers", transformers),
    "transformers_deepspeed": ("deepspeed", transformers_deepspeed),
    "deepspeed_zero": ("deepspeed", deepspeed_zero),
    "deepspeed_moe": ("deepspeed", deepspeed_moe),
    "deepspeed_pipe": ("deepspeed", deepspeed_pipe),
    "deepspeed_autotp": ("deepspeed", deepspeed_autotp),
    "deepspeed_ulysses": ("deepspeed", deepspeed_ulysses),
    "megatron_tp": ("megatron.core", megatron_tp),
}


def _installed(module: str) -> bool:
    """Whether ``module`` imports; a dotted name whose parent is missing counts as missing."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _run_port(out_dir: str, run: str, rank: int) -> int:
    """A port for one run's env:// rendezvous (Lightning makes its group itself): rank 0 takes
    a free one from the kernel and publishes it in a file the other ranks wait for. Ports at
    fixed offsets from one free base were never checked: a test pool's store held one, rank 0
    failed to listen there, and rank 1 joined that foreign store and waited forever."""
    path = os.path.join(out_dir, f"{run}.port")
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(f"{path}.tmp", "w") as f:
            f.write(str(port))
        os.replace(f"{path}.tmp", path)
        return port
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no port for {run} in {path}")
        time.sleep(0.05)
    with open(path) as f:
        return int(f.read())


def main(out_dir: str, rank: int, world_size: int, names) -> None:
    torch.set_num_threads(1)
    for name in names:
        module, fn = FRAMEWORKS[name]
        for backend in ("gloo", "dk"):
            # torchrun's variables, set anew for each run: a framework may have changed them
            # (one without RANK set sends DeepSpeed to MPI discovery: a world of one)
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_run_port(out_dir, f"{name}-{backend}", rank)),
                OMP_NUM_THREADS="1",
            )
            path = os.path.join(out_dir, f"{name}-{backend}-{rank}.pt")
            if not _installed(module):
                torch.save({"skip": f"{module} is not installed: .[integrations]"}, path)
                continue
            try:
                result = fn(backend, out_dir, rank, world_size)
            except Exception:  # noqa: BLE001 - reported by the test, with the traceback
                result = {"error": traceback.format_exc()}
                if dist.is_initialized():
                    dist.destroy_process_group()
            torch.save(result, path)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
