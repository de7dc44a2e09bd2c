"""DDP and ZeRO give the bits they gave before the bucket reducer (recorded at commit a6b875f).

The other engine tests compare against torch or a single process within a tolerance; this one
holds the engines to their own earlier results exactly, for the features whose code moved into
``dist_kernels/buckets/``: several buckets, the bucket re-plan, ``.grad`` bucket views (and
gradients accumulated into them), low-precision wires, the predivide factor, a loss scaler
skipping an inf step, find_unused_parameters, static_graph, no_sync and
set_requires_gradient_sync, comm hooks, join() with uneven inputs; ZeRO stages 1-3 with 16-bit
wires and parameters, accumulation without zero_grad, no_sync and overlap off.

The recorded values must not depend on the machine, so the arithmetic is chosen to round the
same way on every CPU: the models are elementwise (no matmul, no reduction inside backward:
each parameter's gradient is a product of same-shaped tensors), the inputs are dyadic (integers
/ 256, from an integer generator), learning rate, momentum, loss scale and predivide factor are
powers of two (an ``add_(alpha=...)`` is exact whether or not the CPU fuses it), and 2 ranks
(a sum of two values is the same in any algorithm's order). Our kernels round alike everywhere
by design. PowerSGD is left out: its matmuls and QR round differently from one BLAS to another
(``tests/test_ddp_hooks.py`` holds it bitwise to torch's hook instead).

Re-record (only when a change is meant to alter results, and say so):
``python tests/test_engines_recorded.py --record`` (spawns 2 ranks, rewrites the JSON file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn as nn
from mp_pool import run_ranks

SEED = 2025
STEPS = 3
SIZES = (300, 7, 64, 129, 5, 40)  # several buckets under a 1 KiB cap, and a first one of 0.5
LR, MOMENTUM = 2.0**-4, 0.5
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "engines_a6b875f.json")


class Elementwise(nn.Module):
    """``out_k = ((x_k * w_k + b_k) * c_k) * (x_k * w_k + b_k)`` per block: elementwise only."""

    def __init__(self, sizes=SIZES, dtype=torch.float32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(n, k, dtype) for k, n in enumerate(sizes))
        self.skip_last = False  # a rank-dependent unused block

    def forward(self, xs: List[torch.Tensor]) -> List[torch.Tensor]:
        blocks = self.blocks[:-1] if self.skip_last else self.blocks
        return [block(x) for block, x in zip(blocks, xs)]


class _Block(nn.Module):
    def __init__(self, n: int, k: int, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(SEED + k)
        self.w = nn.Parameter(_dyadic((n,), gen).to(dtype))
        self.b = nn.Parameter(_dyadic((n,), gen).to(dtype))
        self.c = nn.Parameter(_dyadic((n,), gen).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w + self.b
        return h * self.c * h


def _dyadic(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-256, 257, shape, generator=gen).float() / 256


def _batch(step: int, rank: int, dtype=torch.float32):
    """(inputs, targets) of one rank's step: per block, one same-shaped tensor each."""
    gen = torch.Generator().manual_seed(SEED * 1000 + step * 10 + rank)
    xs = [_dyadic((n,), gen).to(dtype) for n in SIZES]
    ts = [_dyadic((n,), gen).to(dtype) for n in SIZES]
    return xs, ts


def _loss(outs: List[torch.Tensor], ts: List[torch.Tensor]) -> torch.Tensor:
    return sum((o * t).sum() for o, t in zip(outs, ts))


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().float().cpu().clone().numpy().tobytes())  # a copy: stage 3 frees
    return h.hexdigest()


# ----------------------------------------------------------------------------- DDP


def _ddp_train(
    rank: int, *, scaler=None, micro: int = 1, set_to_none: bool = True, inf_step=None, **options
):
    """STEPS SGD steps of a 2-rank DDP; returns (digest, found_inf per step)."""
    import dist_kernels as dk

    hook = options.pop("hook", None)
    use_switch = options.pop("use_switch", False)
    module = Elementwise()
    module.skip_last = options.pop("skip_last_on_rank1", False) and rank == 1
    model = dk.DDP(module, bucket_cap_mb=1 / 1024, first_bucket_mb=0.5 / 1024, **options)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    flags = []
    for step in range(STEPS):
        xs, ts = _batch(step, rank)
        if inf_step == step and rank == 1:
            xs[2] = xs[2].clone()
            xs[2][3] = float("inf")
        for m in range(micro):
            last = m == micro - 1
            if use_switch:
                model.set_requires_gradient_sync(last)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                loss = _loss(model([x * (m + 1) for x in xs]), ts)
                (scaler.scale(loss) if scaler is not None else loss).backward()
        flags.append(model.found_inf)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    model.close()
    return _digest(module), flags


def _ddp_join(rank: int, divide_by_initial_world_size: bool):
    import dist_kernels as dk

    module = Elementwise()
    model = dk.DDP(module, bucket_cap_mb=1 / 1024, first_bucket_mb=0.5 / 1024)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for step in range(STEPS - rank):  # rank 1 runs out of batches first
            xs, ts = _batch(step, rank)
            _loss(model(xs), ts).backward()
            opt.step()
            opt.zero_grad()
    model.close()
    return _digest(module), []


def _ddp_cases() -> Dict[str, Callable[[int], tuple]]:
    import dist_kernels as dk

    hooks = dk.ddp_hooks
    return {
        "ddp views": lambda r: _ddp_train(r),
        "ddp views accumulated in place": lambda r: _ddp_train(r, set_to_none=False),
        "ddp no views": lambda r: _ddp_train(r, gradient_as_bucket_view=False),
        "ddp bf16 wire": lambda r: _ddp_train(r, grad_dtype=torch.bfloat16),
        "ddp fp16 wire, predivide 2": lambda r: _ddp_train(
            r, grad_dtype=torch.float16, gradient_predivide_factor=2.0
        ),
        "ddp loss scaler, inf step": lambda r: _ddp_train(r, scaler=_scaler(), inf_step=1),
        "ddp loss scaler in DDP, inf step": lambda r: _ddp_scaler_in_ddp(r),
        "ddp find_unused, rank-dependent": lambda r: _ddp_train(
            r, find_unused_parameters=True, skip_last_on_rank1=True
        ),
        "ddp static_graph": lambda r: _ddp_train(r, static_graph=True),
        "ddp no_sync micro-batches": lambda r: _ddp_train(r, micro=2),
        "ddp set_requires_gradient_sync": lambda r: _ddp_train(r, micro=2, use_switch=True),
        "ddp allreduce_hook": lambda r: _ddp_train(r, hook=hooks.allreduce_hook),
        "ddp bf16_compress_hook": lambda r: _ddp_train(r, hook=hooks.bf16_compress_hook),
        "ddp fp16_compress_hook": lambda r: _ddp_train(r, hook=hooks.fp16_compress_hook),
        "ddp join, divide by initial": lambda r: _ddp_join(r, True),
        "ddp join, divide by active": lambda r: _ddp_join(r, False),
    }


def _scaler():
    import dist_kernels as dk

    return dk.LossScaler(init_scale=2.0**6, growth_interval=1)


def _ddp_scaler_in_ddp(rank: int):
    """The scaler handed to DDP: unscaled in the bucket pass, its verdict from the status slot."""
    scaler = _scaler()
    return _ddp_train(rank, scaler=scaler, inf_step=1, loss_scaler=scaler)


# ----------------------------------------------------------------------------- ZeRO


def _zero_train(rank: int, stage: int, *, dtype=torch.float32, accumulate=False, **options):
    """STEPS SGD steps of ShardedOptimizer; ``accumulate``: two synchronised backwards per step
    without zero_grad in between."""
    import dist_kernels as dk

    no_sync = options.pop("no_sync", False)
    module = Elementwise(dtype=dtype)
    extra = {"module": module} if stage == 3 else {}
    opt = dk.ShardedOptimizer(
        module.parameters(), torch.optim.SGD, stage=stage, bucket_cap_mb=1 / 1024,
        lr=LR, momentum=MOMENTUM, **extra, **options,
    )  # fmt: skip
    for step in range(STEPS):
        xs, ts = _batch(step, rank, dtype)
        passes = 2 if accumulate or no_sync else 1
        for m in range(passes):
            ctx = opt.no_sync() if no_sync and m == 0 else contextlib.nullcontext()
            with ctx:
                _loss(module([x * (m + 1) for x in xs]), ts).backward()
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        digest = _digest(module)
    opt.close()
    return digest, []


def _zero_cases() -> Dict[str, Callable[[int], tuple]]:
    bf16 = torch.bfloat16
    return {
        "zero stage 1": lambda r: _zero_train(r, 1),
        "zero stage 1, bf16 wire": lambda r: _zero_train(r, 1, grad_dtype=bf16),
        "zero stage 1, accumulate": lambda r: _zero_train(r, 1, accumulate=True),
        "zero stage 2": lambda r: _zero_train(r, 2),
        "zero stage 2, bf16 wire": lambda r: _zero_train(r, 2, grad_dtype=bf16),
        "zero stage 2, accumulate": lambda r: _zero_train(r, 2, accumulate=True),
        "zero stage 2, no_sync": lambda r: _zero_train(r, 2, no_sync=True),
        "zero stage 2, overlap off": lambda r: _zero_train(r, 2, overlap=False),
        "zero stage 2, bf16 parameters": lambda r: _zero_train(r, 2, dtype=bf16),
        "zero stage 3": lambda r: _zero_train(r, 3),
        "zero stage 3, bf16 wire": lambda r: _zero_train(r, 3, grad_dtype=bf16),
    }


def _run_cases() -> Dict[str, list]:
    import torch.distributed as dist

    import dist_kernels as dk

    dk.init(device="cpu")
    rank = dist.get_rank()
    out = {}
    for name, case in {**_ddp_cases(), **_zero_cases()}.items():
        digest, flags = case(rank)
        out[name] = [digest, flags]
    return out


def test_ddp_and_zero_equal_their_recorded_bits():
    print(f"seed {SEED}; recorded values: {RECORDED}")
    with open(RECORDED) as f:
        recorded = json.load(f)["per_rank"]
    results = run_ranks(2, _run_cases, timeout=300)
    for rank, (got, want) in enumerate(zip(results, recorded)):
        assert sorted(got) == sorted(want), (rank, sorted(set(got) ^ set(want)))
        differing = [name for name in want if got[name] != want[name]]
        for name in differing:
            print(f"rank {rank} {name}: got {got[name]}, recorded {want[name]}")
        assert not differing, f"rank {rank}: results changed for {differing}"
    # Replicas: every rank ends with the same parameters and saw the same found-inf flags.
    assert results[0] == results[1]


def _record() -> None:
    import test_engines_recorded as this  # the workers import the cases by module name

    results = run_ranks(2, this._run_cases, timeout=600)
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    os.makedirs(os.path.dirname(RECORDED), exist_ok=True)
    with open(RECORDED, "w") as f:
        json.dump({"commit": commit, "seed": SEED, "per_rank": results}, f, indent=1)
        f.write("\n")
    print(f"recorded {len(results[0])} cases at {commit} into {RECORDED}")


if __name__ == "__main__":
    if "--record" not in sys.argv:
        sys.exit(pytest.main([__file__, "-q"]))
    _record()
