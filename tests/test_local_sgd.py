"""LocalSGD / DiLoCo on 2 CPU ranks against synchronous DDP and a single-process simulation.

Models are float64 so that "equals" can be checked to 1e-12: averaging deltas and averaging
gradients differ only by rounding. Every rank draws every rank's batches from seeded
generators, so each rank can rerun the whole algorithm alone (the simulation) and compare.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from mp_pool import run_ranks

SEED = 2112
WORLD = 2
F64_ATOL = 1e-12


def _model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(dtype)


def _batch(rank: int, step: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(SEED + 1000 * step + rank)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randn(4, 2, generator=g, dtype=torch.float64).to(dtype)


def _train_step(model, opt, rank, step):
    x, y = _batch(rank, step, next(model.parameters()).dtype)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _diloco(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _inner(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _h1_against(engine, dtype, steps):
    """LocalSGD(H=1) and a synchronous DDP engine trained side by side; max |difference|."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    print(f"seed {SEED}")
    with dk.Communicator() as comm:
        local_model, ddp_model, alone = _model(dtype), _model(dtype), _model(dtype)
        local = dk.LocalSGD(local_model, comm, sync_every=1)
        if engine == "dk":
            ddp = dk.DistributedDataParallel(ddp_model, comm)
        else:
            ddp = nn.parallel.DistributedDataParallel(ddp_model)
        runs = [(local_model, local), (ddp, None), (alone, None)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m, _ in runs]
        for step in range(steps):
            for (model, hook), opt in zip(runs, opts):
                _train_step(model, opt, rank, step)
                if hook is not None:
                    hook.step()
        return {
            "vs_ddp": (_flat(local_model) - _flat(ddp_model)).abs().max().item(),
            "unsynced_vs_ddp": (_flat(alone) - _flat(ddp_model)).abs().max().item(),
            "syncs": local.syncs,
        }


def test_h1_averaging_equals_torch_ddp_float64():
    for r in run_ranks(WORLD, _h1_against, "torch", torch.float64, 3, timeout=120):
        assert r["syncs"] == 3
        assert r["vs_ddp"] < F64_ATOL, r
        assert r["unsynced_vs_ddp"] > 1e-6, r  # the check can fail: no sync is far off


def test_h1_averaging_equals_our_ddp_float32():
    # Our DDP buckets FP32/16 only; averaging deltas vs gradients differs by FP32 rounding.
    for r in run_ranks(WORLD, _h1_against, "dk", torch.float32, 3, timeout=120):
        assert r["syncs"] == 3
        assert r["vs_ddp"] < 1e-6, r
        assert r["unsynced_vs_ddp"] > 1e-4, r


def _simulate(world, steps, sync_every, outer_factory):
    """The algorithm in one process: ``world`` replicas stepped one after the other."""
    replicas = [_model() for _ in range(world)]
    opts = [_inner(m.parameters()) for m in replicas]
    anchor = _flat(replicas[0]).clone()
    outer = outer_factory([anchor]) if outer_factory else None
    for step in range(steps):
        for r in range(world):
            _train_step(replicas[r], opts[r], r, step)
        if (step + 1) % sync_every:
            continue
        delta = sum(_flat(m) - anchor for m in replicas) / world
        if outer is None:
            anchor += delta
        else:
            anchor.grad = -delta
            outer.step()
        for m in replicas:
            torch.nn.utils.vector_to_parameters(anchor.clone(), m.parameters())
    return replicas


def _h4_matches_simulation(steps, sync_every, diloco, wire):
    import torch.distributed as dist

    import dist_kernels as dk

    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"seed {SEED}")
    outer = _diloco if diloco else None
    with dk.Communicator() as comm:
        model = _model()
        opt = _inner(model.parameters())
        local = dk.LocalSGD(model, comm, sync_every, outer_optimizer=outer, wire_dtype=wire)
        for step in range(steps):
            _train_step(model, opt, rank, step)
            local.step()
        # Right after a sync every replica holds the same anchor; a wrong average would not.
        same = [torch.empty_like(_flat(model)) for _ in range(world)]
        dist.all_gather(same, _flat(model))
    sim = _simulate(world, steps, sync_every, outer)
    return {
        "vs_sim": (_flat(model) - _flat(sim[rank])).abs().max().item(),
        "vs_unsynced_sim": (_flat(model) - _flat(_simulate(world, steps, 10**6, None)[rank]))
        .abs()
        .max()
        .item(),
        "spread": max((s - same[0]).abs().max().item() for s in same),
        "syncs": local.syncs,
        "scale": _flat(model).abs().max().item(),
    }


def test_h4_averaging_matches_single_process_simulation():
    for r in run_ranks(WORLD, _h4_matches_simulation, 8, 4, False, None, timeout=120):
        assert r["syncs"] == 2 and r["spread"] == 0.0, r
        assert r["vs_sim"] < F64_ATOL, r
        assert r["vs_unsynced_sim"] > 1e-6, r


def test_h4_diloco_nesterov_matches_single_process_simulation():
    for r in run_ranks(WORLD, _h4_matches_simulation, 8, 4, True, None, timeout=120):
        assert r["syncs"] == 2 and r["spread"] == 0.0, r
        assert r["vs_sim"] < F64_ATOL, r


def test_bf16_wire_stays_within_rounding_of_the_simulation():
    # The delta is rounded to BF16 (2^-8 relative) once per sync; two syncs.
    for r in run_ranks(WORLD, _h4_matches_simulation, 8, 4, False, torch.bfloat16, timeout=120):
        assert r["spread"] == 0.0, r
        assert 0.0 < r["vs_sim"] < 2 * 2**-8 * r["scale"], r


def _bad_sync_every():
    import dist_kernels as dk

    with dk.Communicator() as comm:
        try:
            dk.LocalSGD(_model(), comm, sync_every=0)
        except ValueError as e:
            return str(e)
    return "no error"


def test_bad_sync_every_names_rank_and_argument():
    for rank, msg in enumerate(run_ranks(WORLD, _bad_sync_every, timeout=60)):
        assert f"[rank {rank}]" in msg and "sync_every" in msg, msg
