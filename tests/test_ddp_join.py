"""Uneven inputs under ``model.join()`` against torch DDP under its ``join()`` (gloo), 2 ranks.

Rank 0 has 5 batches, rank 1 has 3: without join rank 0 would wait in its fourth backward until
the timeout. Both engines train the same model on the same batches in the same ranks.
"""

from __future__ import annotations

import copy
import time
from typing import Dict, List

import torch
import torch.nn as nn
from mp_pool import run_ranks
from test_ddp import MLP, SEED, _init_comm, _params, _rel_diff

FP32_RTOL = 1e-5
BATCHES = (5, 3)  # per rank


def _batches(rank: int) -> List[tuple]:
    gen = torch.Generator().manual_seed(SEED + 31 + rank)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen))
            for _ in range(BATCHES[rank])]  # fmt: skip


def _train_joined(model: nn.Module, batches, **join_kwargs) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join(**join_kwargs):
        for x, y in batches:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model


def _join_cases() -> Dict[str, object]:
    import torch.distributed as dist

    import dist_kernels as dk

    _init_comm()
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    base = MLP(batch_norm=True)  # buffers too: broadcast from the highest active rank
    batches = _batches(rank)
    out: Dict[str, object] = {}
    for name, kwargs in (
        ("initial", {}),
        ("active", {"divide_by_initial_world_size": False}),
    ):
        start = time.monotonic()
        ours = _train_joined(
            dk.DDP(copy.deepcopy(base), bucket_cap_mb=0.004, first_bucket_mb=0.001), batches,
            **kwargs,
        )  # fmt: skip
        out[name + " seconds"] = time.monotonic() - start
        theirs = _train_joined(
            nn.parallel.DistributedDataParallel(copy.deepcopy(base)), batches, **kwargs
        )
        mine = {**_params(ours), **{k: b.clone() for k, b in ours.module.named_buffers()}}
        ref = {**_params(theirs), **{k: b.clone() for k, b in theirs.module.named_buffers()}}
        ref.pop("norm.num_batches_tracked")
        mine.pop("norm.num_batches_tracked")
        out[name] = _rel_diff(mine, ref)
        out[name + " digest"] = hash(tuple(torch.cat([p.reshape(-1) for p in mine.values()])
                                           .tolist()))  # fmt: skip
    # A comm hook under join: joined ranks run it on zero buckets (PowerSGD compresses from
    # step 2, so rank 1 shadows compressed rounds), as torch does.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    ours = dk.DDP(copy.deepcopy(base))
    ours.register_comm_hook(
        dk.ddp_hooks.PowerSGDState(None, start_powerSGD_iter=2), dk.ddp_hooks.powerSGD_hook
    )
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    theirs.register_comm_hook(
        torch_psgd.PowerSGDState(None, start_powerSGD_iter=2), torch_psgd.powerSGD_hook
    )
    _train_joined(ours, batches)
    _train_joined(theirs, batches)
    out["powersgd"] = _rel_diff(_params(ours), _params(theirs))
    # Without join() the same data would leave rank 0 waiting; with throw_on_early_termination
    # every rank raises instead.
    ours = dk.DDP(copy.deepcopy(base))
    try:
        _train_joined(ours, batches, throw_on_early_termination=True)
        out["throw"] = "no error"
    except RuntimeError as e:
        out["throw"] = str(e)
    return out


def test_uneven_inputs_under_join_match_torch_join():
    print(f"seed {SEED}, batches per rank {BATCHES}")
    results = run_ranks(2, _join_cases, timeout=120)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["initial"] < FP32_RTOL, r
        assert r["active"] < FP32_RTOL, r
        assert r["powersgd"] < FP32_RTOL, r
        assert r["initial seconds"] < 30, r  # no rank waited for the 120 s timeout
        assert "exhausted" in r["throw"], r
    # Every rank ends with the same model (the last joiner's).
    assert results[0]["initial digest"] == results[1]["initial digest"]
    assert results[0]["active digest"] == results[1]["active digest"]
    # The two divisions differ (rank 0's last two steps are averaged over 1 rank, not 2).
    assert results[0]["initial digest"] != results[0]["active digest"]
