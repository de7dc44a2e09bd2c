"""The one-shot all-reduce (small messages): on 1-8 ranks, every dtype and op, sizes around
the model's switch point and the one-slot limit. Bitwise identical on every rank, exact
against a float64 reference on integer-valued inputs, equal to ring and tree within rounding
on random ones; auto picks it for small messages."""

from __future__ import annotations

import hashlib
import os
import random

import pytest
import torch
from mp_pool import run_ranks, shm_leaks

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
)
OPS = ("SUM", "AVG", "PROD", "MIN", "MAX")
# rounding of one all-reduce of random normals over <= 8 ranks, per dtype (absolute, on
# values of size ~1): fp16 / bf16 round once (FP32 accumulation), the others per add.
ATOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 1.5e-1}


def _oversubscribed(n: int) -> bool:
    return n > len(os.sched_getaffinity(0))


def _switch(n: int, elem: int) -> int:
    """The smallest size (bytes, a multiple of elem) where the model stops choosing one-shot,
    at most auto's limit for it (half a slot): the model's choice is one-shot below a size."""
    from dist_kernels import _C

    lo, hi = 1, _C.shm_slot_bytes(n) // 2 // elem + 1  # in elements: one_shot at lo, not at hi
    if _winner(n, lo * elem) != "one_shot":
        return elem
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _winner(n, mid * elem) == "one_shot" else (lo, mid)
    return hi * elem


def _counts(n: int, elem: int) -> list:
    """Around the model's one-shot / ring-tree switch, and the one-slot limit (+1 falls back)."""
    from dist_kernels import _C

    switch = _switch(n, elem) // elem
    slot = _C.shm_slot_bytes(n) // elem
    return sorted({1, 7, 64, max(1, switch - 1), switch + 1, slot, slot + 1})


def _winner(n: int, nbytes: int) -> str:
    from dist_kernels import _C

    ring, tree, one = _C._shm_all_reduce_cost_us(n, nbytes, _oversubscribed(n))
    return min((one, "one_shot"), (tree, "tree"), (ring, "ring"))[1]


def _auto_choice(n: int, nbytes: int) -> int:
    """The algorithm code auto must pick: one-shot where the message fits the small-message
    boxes, else the model's cheapest, one-shot up to half a slot."""
    from dist_kernels import _C

    if n > 1 and nbytes <= _C.shm_small_message_bytes():
        return 3
    ring, tree, one = _C._shm_all_reduce_cost_us(n, nbytes, _oversubscribed(n))
    if nbytes > _C.shm_slot_bytes(n) // 2:
        one = float("inf")
    return min((one, 3), (tree, 2), (ring, 1))[1]


def _integer_input(rank: int, count: int, dtype, op: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    hi = 2 if op == "PROD" else 4  # products of <= 8 ones and twos stay exact in every dtype
    return torch.randint(1 if op == "PROD" else 0, hi + 1, (count,), generator=g).to(dtype)


def _reference(inputs, dtype, op: str) -> torch.Tensor:
    xs = torch.stack([x.double() for x in inputs])
    n = len(inputs)
    if op == "AVG":
        if dtype.is_floating_point:
            return (xs.sum(0) / n).to(dtype)
        return torch.div(xs.sum(0).long(), n, rounding_mode="trunc").to(dtype)
    red = {"SUM": xs.sum(0), "PROD": xs.prod(0), "MIN": xs.min(0).values, "MAX": xs.max(0).values}
    return red[op].to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _one_shot(seed: int):
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    errors, digests = [], []
    with dk.Communicator() as comm:
        for dtype in DTYPES:
            elem = torch.empty((), dtype=dtype).element_size()
            for count in _counts(n, elem):
                for op in OPS:
                    tag = f"n={n} {dtype} count={count} {op}"
                    # Exact: integer-valued inputs against float64.
                    inputs = [_integer_input(r, count, dtype, op, seed) for r in range(n)]
                    t = inputs[rank].clone()
                    comm.all_reduce(t, op=op, algorithm="one_shot")
                    if not torch.equal(t, _reference(inputs, dtype, op)):
                        errors.append(f"{tag}: differs from the float64 reference")
                    digests.append(_digest(t))
                    if not dtype.is_floating_point or op == "PROD":
                        continue
                    # Rounding: random normals, one-shot against ring and tree.
                    g = torch.Generator().manual_seed(seed + 7 * rank + count)
                    x = torch.randn(count, generator=g).to(dtype)
                    results = {}
                    for algorithm in ("one_shot", "ring", "tree"):
                        y = x.clone()
                        comm.all_reduce(y, op=op, algorithm=algorithm)
                        results[algorithm] = y
                    digests.append(_digest(results["one_shot"]))
                    for other in ("ring", "tree"):
                        if not torch.allclose(
                            results["one_shot"].double(),
                            results[other].double(),
                            rtol=0,
                            atol=ATOL[dtype] * (1 if op in ("MIN", "MAX") else n),
                        ):
                            errors.append(f"{tag}: one_shot and {other} differ beyond rounding")
                        if op in ("MIN", "MAX") and not torch.equal(
                            results["one_shot"], results[other]
                        ):
                            errors.append(f"{tag}: one_shot {op} differs from {other}")
        chosen = {
            nbytes: comm._backend.impl.resolve_all_reduce(nbytes // 4, 0, 0)
            for nbytes in (4, 1024, 8 << 10, 64 << 10, 192 << 10, 320 << 10, 1 << 20)
        }
    return errors, digests, chosen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_one_shot_all_reduce(world_size):
    seed = int(os.environ.get("DK_TEST_SEED", random.randrange(2**31)))
    print(f"seed {seed} (DK_TEST_SEED={seed} reruns it)")
    results = run_ranks(world_size, _one_shot, seed, timeout=600)
    for rank, (errors, _, _) in enumerate(results):
        assert errors == [], f"seed {seed}, rank {rank}: " + "\n".join(errors[:10])
    for rank, (_, digests, _) in enumerate(results):
        assert digests == results[0][1], f"seed {seed}: rank {rank} differs from rank 0 (bits)"
    chosen = results[0][2]
    assert all(r[2] == chosen for r in results)
    if world_size > 1:
        assert chosen[4] == 3, f"auto should pick one_shot for 4 bytes: {chosen}"
        assert chosen[1 << 20] != 3, f"auto should not pick one_shot above a slot: {chosen}"
        expected = {nbytes: _auto_choice(world_size, nbytes) for nbytes in chosen}
        assert chosen == expected, f"auto's choices differ from the cost model's: {chosen}"
    assert shm_leaks() == []


def test_checks_reject_wrong_answers():
    """The reference rejects a dropped rank, zeros and a doubled sum."""
    inputs = [_integer_input(r, 50, torch.float32, "SUM", 3) for r in range(3)]
    ref = _reference(inputs, torch.float32, "SUM")
    assert not torch.equal(_reference(inputs[:2], torch.float32, "SUM"), ref)
    assert not torch.equal(torch.zeros_like(ref), ref)
    assert not torch.equal(2 * ref, ref)
