"""The MoE GPT: dp x ep = 2 x 2 (4 ranks, ``ProcessMesh(dp=4, ep=2)``) and ep = 2 with tp = 2
inside (``ProcessMesh(dp=2, tp=2, ep=2)``) train 5 steps equal to single-process training of
the same global batch, float64, under ``dk.DDP(model, mesh.dp_comm,
expert_comm=mesh.expert_dp_comm)``: dense gradients averaged over dp; an expert's gradient,
already summed over its ep group's tokens by the all-to-all's backward, summed over its dp / ep
replicas (``expert_dp``) and divided by dp. The same with the reduction written out by hand
shows the DDP route is not what makes the two agree. ZeRO stages 1, 2 and 3
(``dk.ShardedOptimizer`` with ``expert_comm=mesh.expert_dp_comm``: experts sharded over their
replicas, dense parameters over dp) train the same 5 steps, stages 1 and 2 also with two
micro-batches a step (the second reduction accumulates onto the first: the expert's 1 / ep
scale must be applied once)."""

import contextlib

import pytest
import torch
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.models import GPT, GPTConfig

SEED = 20261204
STEPS, PER_RANK, SEQ = 5, 2, 8
# float64: one step's losses and gradients carry ~1e-15 relative rounding; five SGD steps at
# lr 0.1 amplify by well under 1e2, so 1e-11 separates rounding from a wrong reduction (a
# missing 1/ep or a lost expert gradient moves the losses by > 1e-4).
TOL = {torch.float64: 1e-11}
# DDP's buckets take float32 (no float64 wire): rounding ~ 6e-8 relative per operation, a few
# hundred operations deep over 5 steps, parameters O(0.1): ~1e-6. A lost 1/ep or a gradient
# reduced over the wrong group moves expert weights by lr * |grad| / 2 per step, ~1e-4.
TOL[torch.float32] = 2e-6


def _model(dtype):
    torch.manual_seed(SEED)
    cfg = GPTConfig(
        vocab_size=32,
        block_size=SEQ,
        n_layers=2,
        n_heads=2,
        dim=16,
        n_experts=4,
        top_k=2,
        moe_every=2,
        moe_z_loss_coeff=1e-3,
    )
    return GPT(cfg).to(dtype)


def _batches(dp):
    gen = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, 32, (dp * PER_RANK, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _reference(dp, dtype, micro=1):
    """Single process: each step the mean of the dp shards' losses (each shard routes its own
    tokens, as its rank does, in ``micro`` micro-batches), one SGD step."""
    model = _model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in _batches(dp):
        parts = [m for s in batch.chunk(dp) for m in s.chunk(micro)]
        loss = sum(model(m[:, :-1], m[:, 1:]) for m in parts) / (dp * micro)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _sync_gradients(model, mesh):
    for p in model.parameters():
        if getattr(p, "expert_parallel", False):
            mesh.expert_dp_comm.all_reduce(p.grad)  # sum over the shard's replicas
            p.grad /= mesh.dp
        else:
            mesh.dp_comm.all_reduce(p.grad, op=dk.ReduceOp.AVG)


def _rank_train(tp_size, engine):
    import torch.distributed as dist

    dp = dist.get_world_size() // tp_size
    mesh = dk.ProcessMesh(dp=dp, pp=1, tp=tp_size, ep=2)
    dtype = torch.float64 if engine == "manual" else torch.float32
    micro = 2 if engine.endswith("x2") else 1
    reference, ref_losses = _reference(dp, dtype, micro)
    model = _model(dtype)
    if tp_size > 1:
        model.parallelize(mesh.tp_comm)
    model.expert_parallel(mesh.ep_comm)
    run = model
    if engine.startswith("zero"):
        opt = _zero(model, mesh, int(engine[4]))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if engine == "ddp":
        run = dk.DDP(model, mesh.dp_comm, expert_comm=mesh.expert_dp_comm, bucket_cap_mb=0.01)
    losses = []
    for batch in _batches(dp):
        mine = batch.chunk(dp)[mesh.dp_rank]
        opt.zero_grad()
        loss = 0.0
        for part in mine.chunk(micro):
            part_loss = run(part[:, :-1], part[:, 1:]) / micro
            part_loss.backward()
            loss = loss + part_loss
        if engine == "manual":
            _sync_gradients(model, mesh)
        opt.step()
        global_loss = loss.detach().clone()
        mesh.dp_comm.all_reduce(global_loss, op=dk.ReduceOp.AVG)
        losses.append(global_loss.item())
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    stats = model.moe_layers()[0].last_stats
    with opt.full_parameters() if engine == "zero3" else contextlib.nullcontext():
        param_diff = _param_diff(model, reference, mesh)
    return loss_diff, param_diff, stats, TOL[dtype]


def _zero(model, mesh, stage):
    """ZeRO over the right groups: experts over their replicas, dense parameters over dp;
    small buckets so that each group spans several. Stage 3 gathers block by block (the tied
    embedding and head stay in the root unit: one parameter, two modules)."""
    units = list(model.blocks) if stage == 3 else None
    return dk.ShardedOptimizer(
        model.parameters(),
        torch.optim.SGD,
        mesh.dp_comm,
        stage=stage,
        expert_comm=mesh.expert_dp_comm,
        bucket_cap_mb=0.004,
        module=model if stage == 3 else None,
        units=units,
        lr=0.1,
    )


def _param_diff(model, reference, mesh):
    """Largest difference of this rank's parameters from the reference's (tp shards sliced,
    experts by global id)."""
    ref = dict(reference.named_parameters())
    moe = model.moe_layers()[0]
    worst = 0.0
    for name, p in model.named_parameters():
        if ".experts." in name:
            prefix, rest = name.split(".experts.")
            local, tail = rest.split(".", 1)
            name = f"{prefix}.experts.{moe.local_expert_ids[int(local)]}.{tail}"
        want = ref[name].detach()
        if want.shape != p.shape:  # a tp shard: the rows (or columns) of this tp rank
            dim = next(d for d in range(p.dim()) if p.shape[d] != want.shape[d])
            want = want.chunk(mesh.tp, dim)[mesh.tp_rank]
        worst = max(worst, float((p.detach() - want).abs().max()))
    return worst


@pytest.mark.parametrize(
    "tp_size, engine",
    [
        (1, "ddp"),
        (2, "ddp"),
        (1, "manual"),
        (1, "zero1"),
        (1, "zero2"),
        (1, "zero3"),
        (1, "zero1x2"),
        (1, "zero2x2"),
    ],
    ids=[
        "dp4-ep2-ddp",
        "dp2-ep2-tp2-ddp",
        "dp4-ep2-by-hand",
        "dp4-ep2-zero1",
        "dp4-ep2-zero2",
        "dp4-ep2-zero3",
        "dp4-ep2-zero1-2micro",
        "dp4-ep2-zero2-2micro",
    ],
)
def test_moe_gpt_trains_like_single_process(tp_size, engine):
    print("seed", SEED)
    for loss_diff, param_diff, stats, tol in run_ranks(4, _rank_train, tp_size, engine):
        assert loss_diff <= tol, loss_diff
        assert param_diff <= tol, param_diff
        micro = 2 if engine.endswith("x2") else 1  # the stats are the last micro-batch's
        assert sum(stats["tokens_per_expert"]) == 2 * PER_RANK // micro * SEQ * 2  # ep x T x k
        assert stats["dropped"] == 0


def test_moe_blocks_are_placed_by_moe_every():
    cfg = GPTConfig(n_layers=4, n_experts=4, moe_every=2)
    kinds = [type(b.mlp).__name__ for b in GPT(cfg).blocks]
    assert kinds == ["MLP", "MoE", "MLP", "MoE"]
    assert [type(b.mlp).__name__ for b in GPT(GPTConfig(n_layers=2)).blocks] == ["MLP", "MLP"]
    plan = GPT(cfg).tp_plan(2)
    assert "blocks.1.mlp.fc" not in plan and "blocks.0.mlp.fc" in plan
    with pytest.raises(ValueError, match=r"sequence_parallel with MoE blocks is not supported"):
        GPT(cfg).tp_plan(2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"moe_every must be a positive int, got 0"):
        GPTConfig(n_experts=4, moe_every=0)


def _rank_refusals():
    mesh = dk.ProcessMesh(dp=2, pp=1, ep=2)
    model = _model(torch.float32).expert_parallel(mesh.ep_comm)
    messages = []
    for build in (
        lambda: dk.DDP(model, mesh.dp_comm),
        lambda: dk.ShardedOptimizer(model.parameters(), torch.optim.SGD, mesh.dp_comm, lr=0.1),
    ):
        try:
            build()
        except (ValueError, NotImplementedError) as e:
            messages.append(str(e))
    return messages


def test_engines_refuse_sharded_experts_over_one_group():
    """DDP and ZeRO without expert_comm."""
    for rank, (ddp, zero) in enumerate(run_ranks(2, _rank_refusals)):
        assert f"[rank {rank}] DistributedDataParallel" in ddp and "expert_comm" in ddp
        assert f"[rank {rank}] ShardedOptimizer" in zero and "expert-parallel" in zero
