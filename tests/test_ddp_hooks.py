"""DDP communication hooks (dk.ddp_hooks) against torch's hooks of the same name, on 2 ranks.

Our DDP runs our hook on the Communicator; torch DDP runs torch's hook over gloo; both train the
same model on the same data in the same ranks. PowerSGD is also compared with uncompressed
training (final loss) and its bytes on the wire with what its shapes predict.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.nn as nn
from mp_pool import run_ranks
from test_ddp import MLP, SEED, WIRE_RTOL, _init_comm, _params, _rel_diff

FP32_RTOL = 1e-5
STEPS = 6
START_ITER = 2  # PowerSGD compresses from the third step on (steps 2..5)


def _data(world: int, steps: int, per_rank: int = 8) -> List[List[tuple]]:
    """[step][rank] -> (x, y) with y from a fixed random 'teacher', identical on every rank."""
    gen = torch.Generator().manual_seed(SEED + 21)
    teacher = torch.randn(16, 4, generator=gen)
    out = []
    for _ in range(steps):
        xs = [torch.randn(per_rank, 16, generator=gen) for _ in range(world)]
        out.append([(x, torch.tanh(x @ teacher)) for x in xs])
    return out


def _train(model: nn.Module, data, rank: int, lr: float = 0.1) -> List[float]:
    """SGD; returns each step's loss averaged over ranks (every rank computes all of them)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in data:
        x, y = step[rank]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _loss(model: nn.Module, data) -> float:
    """Mean loss of ``model`` over every rank's batch of the last step (no communication)."""
    inner = getattr(model, "module", model)
    with torch.no_grad():
        return sum(nn.functional.mse_loss(inner(x), y).item() for x, y in data[-1]) / len(data[-1])


def _step_bytes(model, data, rank: int) -> int:
    """bytes_all_reduced of one more step (after the others)."""
    before = model.bytes_all_reduced
    _train(model, data[-1:], rank)
    return model.bytes_all_reduced - before


def _torch_hook(hook):
    """Torch's hook under another name: torch refuses ``bf16_compress_hook`` by name unless
    on NCCL 2.10+, though gloo reduces BF16 (in BF16)."""

    def torch_hook(state, bucket):
        return hook(state, bucket)

    return torch_hook


def _compress_cases() -> Dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

    import dist_kernels as dk

    _init_comm()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    base = MLP()
    data = _data(world, 4)
    out: Dict[str, object] = {}
    final = {}
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        ours = dk.DDP(copy.deepcopy(base), bucket_cap_mb=0.004, first_bucket_mb=0.001)
        ours.register_comm_hook(None, getattr(dk.ddp_hooks, name))
        _train(ours, data, rank)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        theirs.register_comm_hook(None, _torch_hook(getattr(torch_hooks, name)))
        _train(theirs, data, rank)
        out[name] = _rel_diff(_params(ours), _params(theirs))
        final[name] = _params(ours)
        out[name + " bytes"] = _step_bytes(ours, data, rank)
    plain = dk.DDP(copy.deepcopy(base), bucket_cap_mb=0.004, first_bucket_mb=0.001)
    _train(plain, data, rank)
    out["allreduce vs no hook"] = _rel_diff(final["allreduce_hook"], _params(plain))
    out["fp16 vs fp32"] = _rel_diff(final["fp16_compress_hook"], _params(plain))
    # torch's own hook, over torch.distributed, registered on our DDP.
    mixed = dk.DDP(copy.deepcopy(base), bucket_cap_mb=0.004, first_bucket_mb=0.001)
    mixed.register_comm_hook(None, torch_hooks.fp16_compress_hook)
    _train(mixed, data, rank)
    out["torch hook on ours vs ours"] = _rel_diff(_params(mixed), final["fp16_compress_hook"])
    return out


def test_allreduce_fp16_bf16_hooks_match_torch_hooks():
    print(f"seed {SEED}")
    for rank, r in enumerate(run_ranks(2, _compress_cases, timeout=120)):
        print(f"rank {rank}: {r}")
        assert r["allreduce_hook"] < FP32_RTOL, r
        assert r["allreduce vs no hook"] < FP32_RTOL, r
        assert r["fp16_compress_hook"] < WIRE_RTOL[torch.float16], r
        assert r["bf16_compress_hook"] < WIRE_RTOL[torch.bfloat16], r
        assert r["torch hook on ours vs ours"] < WIRE_RTOL[torch.float16], r
        assert r["fp16 vs fp32"] > 0, r  # the hook did run: FP16 rounding shows
        # Half the bytes on the wire (status slots, 12 B, travel in FP32 either way).
        full = r["allreduce_hook bytes"] - 12
        assert r["fp16_compress_hook bytes"] - 12 == full // 2, r
        assert r["bf16_compress_hook bytes"] - 12 == full // 2, r


# ----------------------------------------------------------------------------- PowerSGD


def _powersgd_expected_numel(model: nn.Module, rank: int) -> int:
    """Elements one compressed step sends: (n + m) r per matrix worth it, the rest whole."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * 2 < n * m else p.numel()
    return total


def _powersgd_cases() -> Dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import dist_kernels as dk

    _init_comm()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    base = MLP()
    data = _data(world, STEPS)
    out: Dict[str, object] = {}

    def ours_model(approx_rank, seed=0, start=START_ITER):
        model = dk.DDP(copy.deepcopy(base))  # one bucket, as torch's (the model is < 1 MiB)
        state = dk.ddp_hooks.PowerSGDState(
            None, matrix_approximation_rank=approx_rank, start_powerSGD_iter=start,
            random_seed=seed,
        )  # fmt: skip
        model.register_comm_hook(state, dk.ddp_hooks.powerSGD_hook)
        return model

    for approx_rank in (1, 2):
        ours = ours_model(approx_rank)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        state = torch_powersgd.PowerSGDState(
            None, matrix_approximation_rank=approx_rank, start_powerSGD_iter=START_ITER,
            random_seed=0,
        )  # fmt: skip
        theirs.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        diffs = []
        for step in range(STEPS):  # compare after every step
            _train(ours, data[step : step + 1], rank)
            _train(theirs, data[step : step + 1], rank)
            diffs.append(_rel_diff(_params(ours), _params(theirs)))
        out[f"rank {approx_rank} diffs"] = diffs
        out[f"rank {approx_rank} bytes"] = _step_bytes(ours, data, rank)
        out[f"rank {approx_rank} expected"] = 4 * _powersgd_expected_numel(base, approx_rank)
    # Several buckets: the hooks' chained all-reduces interleave across buckets, in the same
    # order on every rank (torch's hook over gloo issues them from callback threads).
    many = dk.DDP(copy.deepcopy(base), bucket_cap_mb=0.004, first_bucket_mb=0.001)
    many.register_comm_hook(
        dk.ddp_hooks.PowerSGDState(None, start_powerSGD_iter=START_ITER), dk.ddp_hooks.powerSGD_hook
    )
    _train(many, data, rank)
    out["buckets"] = len(many.bucket_layouts)
    out["many bytes"] = _step_bytes(many, data, rank)
    out["many params"] = torch.cat([p.detach().reshape(-1) for p in many.parameters()]).tolist()
    # The comparison has teeth: another seed gives another trajectory.
    other = ours_model(1, seed=1)
    _train(other, data, rank)
    out["other seed vs torch"] = _rel_diff(_params(other), _params(theirs))
    plain = dk.DDP(copy.deepcopy(base))
    _train(plain, data[:1], rank)
    out["uncompressed bytes"] = _step_bytes(plain, data, rank)
    out["uncompressed numel"] = sum(p.numel() for p in base.parameters())
    return out


def test_powersgd_matches_torch_powersgd_hook():
    print(f"seed {SEED}")
    results = run_ranks(2, _powersgd_cases, timeout=120)
    assert results[0]["many params"] == results[1]["many params"]  # identical on every rank
    for rank, r in enumerate(results):
        assert r["buckets"] > 1 and r["many bytes"] == r["rank 1 expected"] + 12, r
        r.pop("many params")
        print(f"rank {rank}: {r}")
        for approx_rank in (1, 2):
            diffs = r[f"rank {approx_rank} diffs"]
            assert max(diffs) < FP32_RTOL, (approx_rank, diffs)
            # Bytes of a compressed step: exactly the factors and the uncompressed tensors,
            # plus the 12-byte status all-reduce.
            sent, expected = r[f"rank {approx_rank} bytes"], r[f"rank {approx_rank} expected"]
            print(
                f"rank {rank}: PowerSGD r={approx_rank}: {sent} B/step against "
                f"{r['uncompressed bytes']} B uncompressed ({r['uncompressed bytes'] / sent:.1f}x)"
            )
            assert sent == expected + 12, (sent, expected)
        assert r["uncompressed bytes"] >= 4 * r["uncompressed numel"], r
        assert r["other seed vs torch"] > 1e-3, r


def _convergence_case() -> Dict[str, float]:
    """PowerSGD rank 2 against uncompressed training: final loss over 250 steps."""
    import torch.distributed as dist

    import dist_kernels as dk

    _init_comm()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    base = MLP()
    data = _data(world, 250)
    plain = dk.DDP(copy.deepcopy(base))
    _train(plain, data, rank, lr=0.3)
    compressed = dk.DDP(copy.deepcopy(base))
    state = dk.ddp_hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=5)
    compressed.register_comm_hook(state, dk.ddp_hooks.powerSGD_hook)
    _train(compressed, data, rank, lr=0.3)
    return {
        "initial": _loss(base, data),
        "plain": _loss(plain, data),
        "powersgd": _loss(compressed, data),
        "rate": state.compression_stats()[0],
    }


#: After 250 SGD steps uncompressed training is at about 5% of the initial loss and PowerSGD
#: rank 2 (error feedback, warm start, from step 5) at about 7% (measured: 0.044 and 0.058 from
#: 0.85). "Same loss" is asserted as: both below 10% of the initial loss, and within 5% of the
#: initial loss of each other (PowerSGD converges a little slower on this small model).
LOSS_FLOOR = 0.10
LOSS_GAP = 0.05


def test_powersgd_reaches_the_uncompressed_loss():
    print(f"seed {SEED}")
    for rank, r in enumerate(run_ranks(2, _convergence_case, timeout=120)):
        print(f"rank {rank}: {r}")
        assert r["plain"] < LOSS_FLOOR * r["initial"], r
        assert r["powersgd"] < LOSS_FLOOR * r["initial"], r
        assert abs(r["powersgd"] - r["plain"]) <= LOSS_GAP * r["initial"], r
        assert r["rate"] > 2, r
