"""The parallel layouts the driver trains with: one small class per engine family.

Each engine owns its model wrapper and optimizer and runs one optimizer step of the replica's
batch, returning the replica's loss and the step's phase times (``metrics.PHASES``):

``DataParallel``  dp (dk.DDP or torch DDP), ZeRO (dk.ShardedOptimizer or torch FSDP2), or one
                  process; gradient accumulation under the engine's ``no_sync``
``Pipelined``     dk.Pipeline over a ProcessMesh (its micro-batches are the accumulation);
                  forward and backward interleave inside the schedule, so only the step time
                  and the optimizer time are split out

With cp > 1 both take this rank's sequence shard of the replica's samples (zig-zag, as
``GPT.context_parallel`` expects) and average gradients over dp x cp (``mesh.dp_cp_comm``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from .. import lr as dk_lr
from ..comm.groups import sum_over
from .clipping import make_clipper
from .config import TrainConfig
from .data import Sampler
from .loss_scaling import make_scaler, scaled_step
from .metrics import LastGradClock, StepTimes
from .model import lm_loss, pipeline_losses

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ms(seconds: float) -> float:
    return seconds * 1e3


def replica_batch(engine: Any, sampler: Sampler, step: int):
    """The samples of ``engine``'s replica in batch ``step`` of ``sampler`` (micro_batch x
    grad_accum of them); this rank's sequence shard of them when the mesh has cp > 1."""
    cfg, mesh = engine.cfg, engine.mesh
    count = cfg.micro_batch * cfg.grad_accum
    inputs, targets = sampler.replica_batch(step, engine.dp_rank, count)
    if cfg.eod_mask_loss:  # no loss on what follows an end of document (cross entropy's -100)
        targets = targets.masked_fill(inputs == cfg.eod_token, -100)
    if mesh is None or mesh.cp == 1:
        return inputs, targets
    from ..context_parallel import shard_sequence

    return tuple(shard_sequence(t, mesh.cp_comm, dim=1) for t in (inputs, targets))


def first_sample(engine: Any) -> int:
    """The index of ``engine``'s replica's first sample in a step's global batch (what
    :func:`replica_batch` takes)."""
    return engine.dp_rank * engine.cfg.micro_batch * engine.cfg.grad_accum


def dropout_keys(cfg: TrainConfig, step: int, first_sample: Any):
    """With dropout, the context of counter-based masks (``dk.models.dropout``) for a forward
    and backward of samples ``first_sample, ...`` of step ``step``'s global batch: every
    layout, every recomputation and every resume draws the same mask for the same element."""
    if not cfg.model.any_dropout:
        return contextlib.nullcontext()
    from ..models.dropout import dropout_keys as keys

    return keys(cfg.seed, step, first_sample)


def peak_lr(cfg: TrainConfig) -> float:
    return dk_lr.scale_lr(cfg.lr, cfg.global_batch, cfg.lr_base_batch, cfg.lr_scaling)


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """``wsd``'s final decay: ``wsd_decay_steps``, or the last 20% of the schedule."""
    return cfg.wsd_decay_steps or max(1, round(0.2 * cfg.decay_horizon))


def make_scheduler(cfg: TrainConfig, optimizer: Any, updates: int):
    """The schedule, positioned after ``updates`` applied optimizer steps."""
    last, horizon = updates - 1, cfg.decay_horizon
    if cfg.decay == "cosine":
        return dk_lr.warmup_cosine(optimizer, cfg.warmup, horizon, cfg.min_lr_ratio, last)
    if cfg.decay == "linear":
        return dk_lr.warmup_linear(optimizer, cfg.warmup, horizon, cfg.min_lr_ratio, last)
    if cfg.decay == "wsd":
        return dk_lr.warmup_stable_decay(
            optimizer, cfg.warmup, horizon, wsd_decay_steps(cfg), cfg.min_lr_ratio,
            cfg.wsd_decay_style, last,
        )  # fmt: skip
    return dk_lr.warmup_constant(optimizer, cfg.warmup, last_epoch=last)


def _replicas(cfg: TrainConfig, mesh: Any, rank: int) -> Tuple[int, Any]:
    """(this rank's index among the ranks that hold its weights, the Communicator over which
    expert parameters are reduced or None): over dp x cp, but an MoE expert shard's replicas
    are its expert-dp group when ep > 1 (the ep ranks hold different experts)."""
    if mesh is None:  # torch's engine and one process: the world holds the same weights
        return rank, None
    if cfg.ep > 1:
        return mesh.expert_dp_rank, mesh.expert_dp_comm
    return mesh.dp_cp_rank, None


def _adamw(cfg: TrainConfig, engine: str) -> Tuple[type, Dict[str, Any]]:
    """The optimizer class and its arguments. ``--optimizer fused-adamw`` is each engine's
    fused kernel: ``dk.optim.FusedAdamW`` for ours, ``torch.optim.AdamW(fused=True)`` for
    torch's; ``adamw`` is ``torch.optim.AdamW`` as torch chooses (its per-tensor loop on CPU)."""
    kwargs = {
        "lr": peak_lr(cfg),
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_eps,
        "weight_decay": cfg.weight_decay,
    }
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW, kwargs
    if engine == "torch":
        return torch.optim.AdamW, {**kwargs, "fused": True}
    from ..optim import FusedAdamW

    return FusedAdamW, kwargs


def _muon(
    cfg: TrainConfig, module: nn.Module, engine: str, comm: Any, mesh: Any, expert_comm: Any
) -> Any:
    """``--optimizer muon``: dk.optim.Muon over ``module``'s hidden matrices, AdamW (the
    ``--adam-*`` settings) over the rest. Our engines deal Newton-Schulz over the replicas
    ``comm`` (experts: ``expert_comm``) and join tp-split matrices over the mesh's tp group;
    torch's engine (DDP) runs every matrix on every replica, as torch.optim.Muon under DDP."""
    from ..optim import Muon, muon_param_groups

    ours = engine == "dk"
    tp_comm = mesh.tp_comm if ours and mesh is not None and mesh.tp > 1 else None
    return Muon(
        muon_param_groups(module, cfg.weight_decay),
        lr=peak_lr(cfg),
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
        adamw_betas=(cfg.adam_beta1, cfg.adam_beta2),
        adamw_eps=cfg.adam_eps,
        comm=comm if ours else None,
        tp_comm=tp_comm,
        expert_comm=expert_comm if ours else None,
        tp_mode=cfg.muon_tp_mode,
        shard_state=ours and cfg.zero == 1,
        split_qkv=cfg.muon_split_qkv,
        ns_dtype=torch.bfloat16 if cfg.muon_ns_dtype == "bf16" else torch.float32,
    )


def decay_groups(params, weight_decay: float):
    """AdamW's parameters: with weight decay, two param groups, the decay on matrices and
    embeddings (2-D and more) and none on biases and norms' weights (1-D), as nanoGPT and
    Megatron (its default ``no_weight_decay_cond``) decay; without it, the parameters as
    they are (one group, as before groups existed)."""
    params = list(params)
    if not weight_decay:
        return params
    decayed = {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay}
    flat = {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}
    return [g for g in (decayed, flat) if g["params"]]


def _optimizer_step(
    optimizer: Any,
    scheduler: Any,
    times: StepTimes,
    begin: float,
    clip: Optional[Callable],
    scaler: Any = None,
) -> float:
    """Unscales (fp16), clips (``--clip-grad``), steps, zeroes and schedules; records the
    optimizer phase (the clipping in it) and the whole step's time (from ``begin``). Returns
    the rate this step used (read before the scheduler moves it)."""
    t0 = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    if scaler is not None:
        scaler.unscale_(optimizer)
    times.grad_norm = clip() if clip is not None else None
    if scaler is None:
        optimizer.step()
    else:  # skipped on every rank at once when any gradient overflowed
        times.loss_scale, times.skipped = scaled_step(scaler, optimizer)
    optimizer.zero_grad(set_to_none=True)
    if not times.skipped:  # the schedule counts applied updates, as Megatron and DeepSpeed do
        scheduler.step()
    end = time.perf_counter()
    times.add("optimizer", _ms(end - t0))
    times.step_ms = _ms(end - begin)
    return lr


def _balance_experts(cfg: TrainConfig, module: nn.Module, replicas: Any) -> None:
    """--moe-router-enable-expert-bias: each router's bias one step toward balance, from the
    assignments every replica of this rank's layers counted (``dk.moe.update_expert_bias``)."""
    if cfg.model.moe_router_enable_expert_bias:
        from ..moe import update_expert_bias

        update_expert_bias(module, replicas)


class _TokenWeights:
    """--calculate-per-token-loss: each micro-batch's mean loss weighted by its share of the
    step's non-masked targets over every replica, times dp x grad_accum (which the gradient
    average over the replicas and the division by grad_accum take back): the step's gradient
    is then that of the mean over all of the global batch's targets, however it is split."""

    def __init__(self, cfg: TrainConfig, replicas: Any) -> None:
        self.on, self.replicas = cfg.calculate_per_token_loss, replicas
        self.scale = cfg.dp * cfg.grad_accum
        self.total = 0

    def start(self, targets: torch.Tensor) -> None:
        """Counts the step's targets (this replica's batch) over the replicas. Collective."""
        if self.on:
            count = (targets != -100).sum().reshape(1).to(torch.int64)
            sum_over(count, self.replicas)
            self.total = max(int(count), 1)

    def __call__(self, loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return loss
        return loss * (float((targets != -100).sum()) * self.scale / self.total)


def _weighted(loss_fn: Callable, weights: _TokenWeights, output: Any, target: Any):
    return weights(loss_fn(output, target), target)


class _Delay:
    """--simulate-straggler: this rank sleeps ``ms`` in the first forward of every step."""

    def __init__(self, cfg: TrainConfig, rank: int) -> None:
        hit = cfg.simulate_straggler is not None and cfg.simulate_straggler[0] == rank
        self.seconds = cfg.simulate_straggler[1] / 1e3 if hit else 0.0

    def __call__(self) -> None:
        if self.seconds:
            time.sleep(self.seconds)


class DataParallel:
    """Data parallelism (any engine) with gradient accumulation; also the one-process case."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Sequential,
        loss_fn: Callable,
        engine: str,
        mesh: Any,
        rank: int,
        world_comm: Any = None,
    ) -> None:
        self.cfg, self.engine, self.module, self.loss_fn = cfg, engine, model, loss_fn
        # torch's engine (no mesh) runs pp = tp = cp = 1: its data-parallel group is the world
        self.mesh = mesh
        self.dp_rank = mesh.dp_rank if mesh is not None else rank
        self.replica_rank, expert_comm = _replicas(cfg, mesh, rank)
        dp_comm = mesh.dp_cp_comm if mesh is not None else None  # dp x cp hold the same weights
        self.replicas = dp_comm  # (None under torch's engine: its world)
        self.weights = _TokenWeights(cfg, dp_comm)
        self.delay = _Delay(cfg, rank)
        world_size = cfg.dp * cfg.cp
        self.forward, self.optimizer, self._no_sync = self._wrap(
            cfg, model, engine, dp_comm, world_size, expert_comm, mesh
        )
        self.clip = make_clipper(
            cfg.clip_grad, engine, self.optimizer, list(model.parameters()), mesh, world_comm
        )
        self.scaler = make_scaler(cfg, engine, world_comm)
        # FSDP2 hands reduced gradients to its sharded parameters after its reduce-scatter, so
        # a gradient hook there does not mark the end of compute: its comm is not measured.
        self.measures_comm = not (engine == "torch" and cfg.zero and world_size > 1)
        self.clock = LastGradClock(list(model.parameters()))
        self.scheduler = None  # set by start(), once the resume step is known

    @staticmethod
    def _wrap(
        cfg, model, engine, dp_comm, world, expert_comm=None, mesh=None
    ) -> Tuple[Callable, Any, Callable[[bool], Any]]:
        """(forward callable, optimizer, no_sync(last micro-batch?) context factory)."""
        optimizer, kwargs = _adamw(cfg, engine)
        if engine == "dk" and cfg.flat_shards:
            from ..zero import ShardedOptimizer

            opt = ShardedOptimizer(
                decay_groups(model.parameters(), cfg.weight_decay),
                optimizer,
                dp_comm,
                stage=cfg.zero,
                bucket_cap_mb=cfg.bucket_cap_mb,
                expert_comm=expert_comm,
                module=model if cfg.zero == 3 else None,  # stage 3 gathers per block
                **_model_parallel_comms(mesh),
                **kwargs,
            )
            return model, opt, lambda last: contextlib.nullcontext() if last else opt.no_sync()
        if engine == "torch" and cfg.zero and world > 1:
            return _fsdp2(model, optimizer, kwargs)
        if cfg.optimizer == "muon":
            replicas = dp_comm if world > 1 else None
            opt = _muon(cfg, model, engine, replicas, mesh, expert_comm)
        else:
            opt = optimizer(decay_groups(model.parameters(), cfg.weight_decay), **kwargs)
        if world == 1:
            return model, opt, lambda last: contextlib.nullcontext()
        if engine == "dk":
            from ..ddp import DistributedDataParallel

            ddp = DistributedDataParallel(
                model,
                dp_comm,
                bucket_cap_mb=cfg.bucket_cap_mb,
                first_bucket_mb=min(cfg.first_bucket_mb, cfg.bucket_cap_mb),
                expert_comm=expert_comm,
            )
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
        return ddp, opt, lambda last: contextlib.nullcontext() if last else ddp.no_sync()

    def start(self, updates: int) -> None:
        """Positions the learning-rate schedule after ``updates`` applied steps (the resumed
        step less the fp16 steps skipped before it)."""
        self.scheduler = make_scheduler(self.cfg, self.optimizer, updates)

    @property
    def updates(self) -> int:
        """Optimizer steps applied so far (fp16's skipped steps do not count)."""
        return self.scheduler.last_epoch

    @property
    def lr(self) -> float:
        """The learning rate the last step used (the scheduler has moved on since)."""
        return self._last_lr

    def step(self, step: int, sampler: Sampler) -> Tuple[float, StepTimes]:
        cfg, times = self.cfg, StepTimes()
        begin = time.perf_counter()
        inputs, targets = replica_batch(self, sampler, step)
        self.weights.start(targets)
        loss_sum = 0.0
        first = first_sample(self)
        for k in range(cfg.grad_accum):
            part = slice(k * cfg.micro_batch, (k + 1) * cfg.micro_batch)
            keys = dropout_keys(cfg, step, first + part.start)
            with self._no_sync(k == cfg.grad_accum - 1), keys:
                loss_sum += self._micro_step(inputs[part], targets[part], times, k == 0)
        self._last_lr = _optimizer_step(
            self.optimizer, self.scheduler, times, begin, self.clip, self.scaler
        )
        _balance_experts(cfg, self.module, self.replicas)
        return loss_sum, times

    def _micro_step(self, x, y, times: StepTimes, first: bool) -> float:
        t0 = time.perf_counter()
        if first:
            self.delay()
        with _autocast(self.cfg.dtype):
            loss = self.weights(self.loss_fn(self.forward(x), y), y) / self.cfg.grad_accum
        t1 = time.perf_counter()
        self.clock.stamp = None
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        t2 = time.perf_counter()
        last_grad = self.clock.stamp if self.clock.stamp is not None else t2
        if not self.measures_comm:
            last_grad = t2
        times.add("forward", _ms(t1 - t0))
        times.add("backward", _ms(last_grad - t1))
        times.add("comm", _ms(t2 - last_grad) if self.measures_comm else None)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, sampler: Sampler, index: int) -> float:
        """The language-model loss of this replica's share of held-out batch ``index``, in
        micro-batches, in eval mode (collective as a forward is: tp, cp, ep, ZeRO-3)."""
        cfg = self.cfg
        inputs, targets = replica_batch(self, sampler, index)
        loss_fn, total = lm_loss(self.module), 0.0
        self.module.eval()
        try:
            for k in range(cfg.grad_accum):
                part = slice(k * cfg.micro_batch, (k + 1) * cfg.micro_batch)
                with _autocast(cfg.dtype):  # the module, not a DDP wrapper: nothing to reduce
                    total += float(loss_fn(self.module(inputs[part]), targets[part]))
        finally:
            self.module.train()
        return total / cfg.grad_accum

    def final_params(self) -> Dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's names (collective at ZeRO
        stage 3, whose parameters have no storage between steps)."""
        full = getattr(self.optimizer, "full_parameters", None)
        with full() if full is not None else contextlib.nullcontext():
            return stage_state(self.module)

    def close(self) -> None:
        self.clock.close()
        for obj in (self.optimizer, self.forward):
            close = getattr(obj, "close", None) if obj is not self.module else None
            if close is not None:
                close()


def _model_parallel_comms(mesh: Any) -> Dict[str, Any]:
    """ShardedOptimizer's ``tp_comm`` / ``pp_comm``: where the rest of the model's gradient
    norm is (``--clip-grad``)."""
    if mesh is None:
        return {}
    return {f"{k}_comm": getattr(mesh, f"{k}_comm") for k in ("tp", "pp") if getattr(mesh, k) > 1}


def _fsdp2(model: nn.Sequential, optimizer: type, kwargs: Dict[str, Any]):
    """torch FSDP2 over the default (gloo) group: every child sharded, then the root. A tied
    embedding and head are left to the root (FSDP2 manages a parameter in one module only)."""
    from torch.distributed.fsdp import fully_shard

    holders = collections.Counter(id(p) for child in model for p in child.parameters())
    for child in model:
        if all(holders[id(p)] == 1 for p in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    opt = optimizer(decay_groups(model.parameters(), kwargs["weight_decay"]), **kwargs)

    @contextlib.contextmanager
    def sync(last: bool):
        model.set_requires_gradient_sync(last)
        yield

    return model, opt, sync


class Pipelined:
    """dk.Pipeline over ``mesh`` (dp x pp); grad_accum micro-batches per step."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Sequential,
        loss_fn: Callable,
        mesh: Any,
        rank: int,
        world_comm: Any = None,
    ) -> None:
        from ..pipeline import Pipeline

        self.cfg, self.mesh = cfg, mesh
        self.dp_rank = mesh.dp_rank
        self.replica_rank, self.expert_comm = _replicas(cfg, mesh, rank)
        self.delay = _Delay(cfg, rank)
        self.lm_loss = lm_loss(model)
        loss_fn, stage_loss = pipeline_losses(model, loss_fn)  # MoE: aux losses per stage
        self.weights = _TokenWeights(cfg, mesh.dp_cp_comm)
        loss_fn = functools.partial(_weighted, loss_fn, self.weights)
        self.pipe = Pipeline(
            model,
            mesh,
            n_microbatches=cfg.grad_accum,
            schedule=cfg.schedule,
            loss_fn=loss_fn,
            stage_loss=stage_loss,
            print_partition=False,
            reduce_gradients=not cfg.flat_shards,  # ZeRO-1 reduce-scatters them in its step()
        )
        self.module = self.pipe.stage_module
        self.optimizer = self._optimizer(cfg, mesh)
        self.clip = make_clipper(
            cfg.clip_grad, "dk", self.optimizer, list(self.pipe.parameters()), mesh, world_comm
        )
        self.scaler = make_scaler(cfg, "dk", world_comm)
        self.scheduler = None

    def _optimizer(self, cfg: TrainConfig, mesh: Any) -> Any:
        """AdamW over this rank's stages; with ``--zero 1`` sharded over dp x cp."""
        optimizer, kwargs = _adamw(cfg, "dk")
        if cfg.optimizer == "muon":  # the data-parallel replicas of this rank's stages
            replicas = mesh.dp_cp_comm if cfg.dp * cfg.cp > 1 else None
            return _muon(cfg, self.pipe.stage_module, "dk", replicas, mesh, self.expert_comm)
        params = decay_groups(self.pipe.parameters(), cfg.weight_decay)
        if not cfg.flat_shards:
            return optimizer(params, **kwargs)
        from ..zero import ShardedOptimizer

        return ShardedOptimizer(
            params,
            optimizer,
            mesh.dp_cp_comm,
            expert_comm=self.expert_comm,
            stage=cfg.zero,
            bucket_cap_mb=cfg.bucket_cap_mb,
            **_model_parallel_comms(mesh),
            **kwargs,
        )

    start = DataParallel.start
    updates = DataParallel.updates
    lr = DataParallel.lr

    def step(self, step: int, sampler: Sampler) -> Tuple[float, StepTimes]:
        cfg = self.cfg
        times = StepTimes(phases={"forward": None, "backward": None, "comm": None})
        times.phases["optimizer"] = 0.0
        begin = time.perf_counter()
        inputs, targets = replica_batch(self, sampler, step)
        self.weights.start(targets)
        self.delay()
        # ZeRO: the micro-batches' gradients add up locally; the optimizer's step reduces them
        no_sync = self.optimizer.no_sync() if cfg.flat_shards else contextlib.nullcontext()
        first = first_sample(self)
        keys = dropout_keys(
            cfg, step, lambda: first + self.pipe.current_microbatch * cfg.micro_batch
        )
        with _autocast(cfg.dtype), no_sync, keys:
            scale_loss = None if self.scaler is None else self.scaler.scale
            loss = float(self.pipe.step(inputs, targets, scale_loss=scale_loss))
        self._last_lr = _optimizer_step(
            self.optimizer, self.scheduler, times, begin, self.clip, self.scaler
        )
        _balance_experts(cfg, self.module, self.mesh.dp_cp_comm)
        return loss, times

    def evaluate(self, sampler: Sampler, index: int) -> float:
        """The language-model loss of this replica's share of held-out batch ``index``: the
        pipeline's forward-only pass (``Pipeline.evaluate``)."""
        inputs, targets = replica_batch(self, sampler, index)
        with _autocast(self.cfg.dtype):
            return float(self.pipe.evaluate(inputs, targets, loss_fn=self.lm_loss))

    def final_params(self) -> Dict[str, torch.Tensor]:
        return stage_state(self.module)

    def close(self) -> None:
        for ddp in self.pipe.ddp.values():
            ddp.close()
        if self.cfg.flat_shards:
            self.optimizer.close()


def _autocast(dtype: str):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=_AUTOCAST[dtype])


def stage_state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """A copy of ``module``'s state under the whole model's names. A pipeline rank that holds
    several stages (interleaved 1F1B, ZB-V, DualPipeV) has them in an ``nn.ModuleList``, whose
    index would prefix every name ("0.0.wte.weight"); each stage keeps the model's own layer
    names, so their entries are taken as they are ("0.wte.weight", "3.lm_head.weight")."""
    stages = module if isinstance(module, nn.ModuleList) else [module]
    return {k: v.detach().clone() for stage in stages for k, v in stage.state_dict().items()}


def build_engine(
    cfg: TrainConfig,
    model: nn.Sequential,
    loss_fn: Callable,
    engine: str,
    mesh: Optional[Any],
    rank: int,
    world_comm: Any = None,
):
    """The engine of ``cfg``'s layout; ``mesh`` is None for the torch engine and one process;
    ``world_comm`` (our Communicator over every rank) sums the gradient norm of --clip-grad."""
    if cfg.pp > 1:
        return Pipelined(cfg, model, loss_fn, mesh, rank, world_comm)
    return DataParallel(cfg, model, loss_fn, engine, mesh, rank, world_comm)
