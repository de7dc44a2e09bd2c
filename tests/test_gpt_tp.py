"""The reference GPT sharded by tensor parallelism trains like the unsharded one.

A 4-rank pool: tp=4 over all ranks, and tp=2 as two groups ({0, 1} without sequence
parallelism, {2, 3} with it) running at the same time. Float64, dropout 0: every sharded run
must match single-process training to rounding.
"""

import contextlib
import datetime

import pytest
import torch
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels import tensor_parallel as tp
from dist_kernels.models import GPT, GPTConfig
from dist_kernels.models.dropout import dropout_keys

SEED = 20261201
STEPS = 3
BATCH, SEQ = 2, 8
CONFIG = dict(vocab_size=32, block_size=16, n_layers=2, n_heads=4, dim=16)
TIMEOUT = datetime.timedelta(seconds=60)


def _model(**overrides):
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**{**CONFIG, **overrides})).double()


def _batches(steps=STEPS, batch=BATCH):
    gen = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, CONFIG["vocab_size"], (steps, batch, SEQ + 1), generator=gen)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _train(model, batches):
    """AdamW steps; with dropout, inside ``dropout_keys`` (counter-based masks: the same for
    every element in every layout)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step, (ids, targets) in enumerate(batches):
        opt.zero_grad()
        keys = dropout_keys(SEED, step) if model.config.dropout else contextlib.nullcontext()
        with keys:
            loss = model(ids, targets)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def shard_of(full: torch.Tensor, shard: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The slice of an unsharded parameter that a shard of shape ``shard.shape`` holds."""
    for dim, (a, b) in enumerate(zip(full.shape, shard.shape)):
        if a != b:
            return full.chunk(a // b, dim)[tp_rank]
    return full


def max_param_diff(sharded, reference, tp_rank):
    ref = dict(reference.named_parameters())
    return max(
        (p - shard_of(ref[name], p, tp_rank)).abs().max().item()
        for name, p in sharded.named_parameters()
    )


# The Llama-style options (RMSNorm, SwiGLU with its gate column-parallel too, rotary
# position embedding, 8 query heads in 4 key / value groups: each tp rank of 4 holds one)
LLAMA = dict(
    normalization="rmsnorm", swiglu=True, position_embedding="rope", n_heads=8, n_kv_heads=4
)


# Qwen's options: per-head query / key norms, heads wider than d_model / heads, biases on the
# query / key / value projection only
QWEN = dict(qk_norm=True, kv_channels=4, bias=False, qkv_bias=True)

# Gemma 2 / 3's options: norms of 1 + w and of the branches' outputs, GeGLU, scaled
# embeddings, its own attention scale, every second block windowed with its own rope base, and
# both soft-caps (tight, so that they bite): the capped scores per head, the capped logits per
# vocabulary shard
GEMMA = dict(
    norm_unit_offset=True, post_norms=True, qk_norm=True, bias=False, glu_activation="gelu",
    gelu_approximate="tanh", embedding_multiplier=4.0, softmax_scale=0.3, sliding_window=6,
    global_attention_every=2, rope_local_theta=100.0, attn_logit_softcapping=1.0,
    final_logit_softcapping=2.0,
)  # fmt: skip


# Dropout on the embeddings, the attention probabilities (heads sharded) and both residual
# branches (sequence-sharded under sp), with counter-based masks: the sharded runs must draw
# the unsharded run's masks element for element, recomputed blocks included
DROPOUT = dict(dropout=0.2)


def _rank_train(tie, drop_norm_styles=False, overrides=None):
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: all ranks, in order
    world = dist.new_group([0, 1, 2, 3])
    runs = [(2, pairs[rank // 2], rank >= 2), (4, world, False), (4, world, True)]
    options = dict(tie_embeddings=tie, **(overrides or {}))
    reference = _model(**options)
    batches = _batches()
    ref_losses = _train(reference, batches)
    out = []
    for tp_size, group, sp in runs:
        comm = dk.Communicator(group=group, timeout=TIMEOUT)
        model = _model(**options)
        plan = model.tp_plan(tp_size, sequence_parallel=sp)
        if drop_norm_styles:  # the bug the test must catch: norm gradients not summed
            plan = {k: v for k, v in plan.items() if not isinstance(v, tp.SequenceParallel)}
        tp.shard_module(model, plan, comm)
        if tie:
            assert model.head.lm_head.weight is model.embedding.wte.weight
        if model.config.dropout:  # recomputed blocks must draw the same masks again
            model.recompute_blocks()
        losses = _train(model, batches)
        diff = max_param_diff(model, reference, comm.rank)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        out.append((tp_size, sp, diff, loss_diff))
        comm.close()
    return out


@pytest.mark.parametrize(
    "tie,overrides",
    [
        (True, None),
        (False, None),
        (False, LLAMA),
        (False, {**LLAMA, **QWEN}),
        (True, {**LLAMA, **GEMMA}),
        (False, DROPOUT),
        (True, {**LLAMA, **GEMMA, **DROPOUT}),
    ],
    ids=["tied", "untied", "llama", "llama-qwen-options", "llama-gemma-options", "dropout",
         "llama-gemma-dropout"],
)  # fmt: skip
def test_gpt_tp_trains_like_single_process(tie, overrides):
    print("seed", SEED)
    results = run_ranks(4, _rank_train, tie, False, overrides, timeout=240)
    for rank, runs in enumerate(results):
        for tp_size, sp, diff, loss_diff in runs:
            print(
                f"rank {rank} tp={tp_size} sequence_parallel={sp} tied={tie}: "
                f"max parameter difference {diff:.1e}, max loss difference {loss_diff:.1e}"
            )
            assert diff < 1e-10 and loss_diff < 1e-10


def test_qk_norm_without_grad_reduction_is_caught():
    """QK-norm's weight sees only this rank's heads: without its gradient summed over tp
    (the plan's ReplicatedOverShards dropped) every sharded run drifts, with or without SP."""
    results = run_ranks(4, _rank_train, False, True, {**LLAMA, **QWEN}, timeout=240)
    for runs in results:
        for tp_size, sp, diff, _ in runs:
            assert diff > 1e-4, (tp_size, sp, diff)


def test_sequence_parallel_without_norm_grad_reduction_is_caught():
    """Dropping the norm-gradient all-reduce (the classic bug) moves parameters far apart."""
    results = run_ranks(4, _rank_train, False, True, timeout=240)
    for rank, runs in enumerate(results):
        for tp_size, sp, diff, _ in runs:
            print(f"rank {rank} tp={tp_size} sp={sp} without SequenceParallel styles: {diff:.1e}")
            assert (diff > 1e-4) if sp else (diff < 1e-10)


def _rank_rng():
    import torch.distributed as dist

    comm = dk.Communicator(group=dist.new_group([0, 1, 2, 3]), timeout=TIMEOUT)
    tp.model_parallel_seed(SEED, comm)
    outside = torch.rand(8)
    with tp.get_rng_tracker().fork():
        inside = torch.rand(8)
    after = torch.rand(8)  # the default stream continues as if fork never ran
    torch.manual_seed(SEED)
    plain = torch.rand(16)
    # dropout in the sharded region of a GPT: different masks per tp rank
    model = _model(dropout=0.5).parallelize(comm)
    model.train()
    tp.model_parallel_seed(SEED, comm)
    ids, targets = _batches(1)[0]
    loss = model(ids, targets).item()
    comm.close()
    return outside, inside, after, plain, loss


def test_rng_same_outside_tp_regions_and_per_rank_inside():
    results = run_ranks(4, _rank_rng, timeout=120)
    outside, inside, after, plain, loss = zip(*results)
    for r in range(4):
        assert torch.equal(outside[r], outside[0]) and torch.equal(after[r], after[0])
        assert torch.equal(torch.cat([outside[r], after[r]]), plain[r])
        assert loss[r] == loss[0]  # one loss: the replicated parts drew identical masks
    assert len({tuple(t.tolist()) for t in inside}) == 4, "tp ranks drew the same numbers"


def _rank_errors():
    import torch.distributed as dist

    comm = dk.Communicator(group=dist.new_group([0, 1, 2, 3]), timeout=TIMEOUT)
    messages = []
    for overrides in (dict(n_heads=6, dim=24), dict(vocab_size=30)):
        with pytest.raises(ValueError) as info:
            _model(**overrides).parallelize(comm)
        messages.append(str(info.value))
    # DK_DEBUG=1 (set by the test): ids that differ on one tp rank raise at once, on every rank
    model = _model().parallelize(comm)
    ids, targets = _batches(1)[0]
    model(ids, targets)  # the same ids everywhere: fine
    if dist.get_rank() == 3:
        ids = ids.flip(0)
    with pytest.raises(tp.TensorParallelDesyncError) as info:
        model(ids, targets)
    messages.append(str(info.value))
    # recomputation with dropout: the tracker's masks would not be drawn again alike (the
    # training forward raises); counter-based masks are, and the same forward runs
    model = _model(dropout=0.1).parallelize(comm).recompute_blocks()
    ids, targets = _batches(1)[0]
    with pytest.raises(ValueError) as info:
        model(ids, targets)
    messages.append(str(info.value))
    with dropout_keys(seed=1, step=0):
        model(ids, targets).backward()
    comm.close()
    return messages


def test_gpt_sharding_errors_show_the_arithmetic_and_desync_names_the_layer():
    results = run_ranks(4, _rank_errors, timeout=60, env={"DK_DEBUG": "1"})
    for rank, messages in enumerate(results):
        print(messages)
        assert messages[:2] == [
            "GPT: n_heads(6) % tp(4) != 0",
            "GPT: vocab_size(30) % tp(4) != 0",
        ]
        assert (
            f"[rank {rank}] VocabParallelEmbedding 'embedding.wte': tensor-parallel"
            in (messages[2])
        )
        assert "tp ranks [3] differ" in messages[2]
        assert "GPT.recompute_blocks: dropout > 0 on a tensor-parallel model" in messages[3]


def _rank_zero_clip(stage):
    """dp 2 x tp 2: ZeRO over dp with ``tp_comm``; the norms (2 and inf) of one backward, and
    the parameters after a clipped SGD step, against the unsharded model on the whole batch."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = dk.ProcessMesh(dp=2, tp=2)
    batches = _batches(steps=1, batch=4)
    ids, targets = batches[0]
    reference = _model(tie_embeddings=False).float()
    reference(ids, targets).backward()
    params = list(reference.parameters())
    want = {
        norm: torch.nn.utils.get_total_norm([p.grad for p in params], norm).item()
        for norm in (2.0, float("inf"))
    }
    torch.nn.utils.clip_grad_norm_(params, want[2.0] / 2)
    with torch.no_grad():
        for p in params:
            p -= p.grad

    model = _model(tie_embeddings=False).float()
    tp.shard_module(model, model.tp_plan(2), mesh.tp_comm)
    opt = dk.ShardedOptimizer(
        model.parameters(), torch.optim.SGD, mesh.dp_comm, stage=stage, lr=1.0,
        tp_comm=mesh.tp_comm,
    )  # fmt: skip
    mine = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    model(ids[mine], targets[mine]).backward()
    got = {norm: opt.clip_grad_norm_(1e9, norm).item() for norm in want}
    clipped = opt.clip_grad_norm_(want[2.0] / 2).item()
    opt.step()
    diff = max_param_diff(model, reference, mesh.tp_rank)
    opt.close()
    mesh.close()
    return rank, want, got, clipped, diff


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_clip_norm_over_tensor_parallel_shards_is_the_whole_models(stage):
    """ShardedOptimizer with ``tp_comm`` at dp 2 x tp 2: the 2-norm and the max-norm equal
    the unsharded model's (a parameter every tp rank holds whole counted once), and a clipped
    SGD step lands on the unsharded clipped step's parameters."""
    print("seed", SEED)
    for rank, want, got, clipped, diff in run_ranks(4, _rank_zero_clip, stage, timeout=120):
        print(f"rank {rank} stage {stage}: want {want} got {got}, after clipping {clipped}, "
              f"parameter difference {diff:.1e}")  # fmt: skip
        for norm in want:
            assert got[norm] == pytest.approx(want[norm], rel=1e-5), norm
        assert clipped == pytest.approx(want[2.0], rel=1e-5)
        assert diff < 1e-5
