"""Collectives of dist_kernels.Communicator against torch references, on a shared pool of
ranks (tests/mp_pool.py).

Every rank generates every rank's input from the same seed, so each rank can compute the
reference itself (float64 for floating types, exact int64 arithmetic wrapped to the dtype for
integers) and returns a digest of its result: the test checks the reference and that every
rank holds identical bits.
"""

from __future__ import annotations

import hashlib
import zlib

import pytest
import torch
from mp_pool import run_ranks, shm_leaks

SEED = 1234
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]
OPS = ["SUM", "AVG", "PROD", "MIN", "MAX"]
ALGORITHMS = ["ring", "tree", "auto"]
BIG = 2**20 + 7


def sizes(world_size):
    return sorted({0, 1, max(world_size - 1, 0), 13})


def make_input(rank, count, dtype, op, tag):
    """Rank `rank`'s input, the same on every process (seeded by rank, size, dtype, op)."""
    g = torch.Generator().manual_seed(
        zlib.crc32(repr((SEED, rank, count, dtype, op, tag)).encode())
    )
    if dtype.is_floating_point:
        if op == "PROD":  # near 1: no overflow or underflow in a product of 8
            x = torch.rand(count, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(count, generator=g, dtype=torch.float64) * 4
        return x.to(dtype)
    low, high = (-2, 3) if op == "PROD" else (-50, 50)
    if dtype == torch.uint8:
        low, high = 0, high
    return torch.randint(low, high, (count,), generator=g, dtype=torch.int64).to(dtype)


def reference(inputs, dtype, op):
    """The reduction over ranks, in float64 or exact (wrapping) int64 arithmetic."""
    n = len(inputs)
    wide = torch.stack(
        [x.to(torch.float64 if dtype.is_floating_point else torch.int64) for x in inputs]
    )
    if op in ("SUM", "AVG"):
        out = wide.sum(0)
    elif op == "PROD":
        out = wide.prod(0)
    elif op == "MAX":
        out = wide.max(0).values
    else:
        out = wide.min(0).values
    if op == "AVG":
        if dtype.is_floating_point:
            out = out / n
        else:  # the sum wraps in the dtype first, then divides toward zero
            out = torch.div(wrap(out, dtype).to(torch.int64), n, rounding_mode="trunc")
    return out


def wrap(x, dtype):
    """int64 -> dtype with two's-complement wrap-around (what the kernels do)."""
    bits = torch.iinfo(dtype).bits
    if bits == 64:  # int64 arithmetic already wraps
        return x
    x = x & ((1 << bits) - 1)
    if torch.iinfo(dtype).min < 0:
        x = torch.where(x >= (1 << (bits - 1)), x - (1 << bits), x)
    return x.to(dtype)


# Unit roundoff u of each floating dtype: rounding a real number to the dtype moves it by at most
# u times its magnitude (half an ulp); below the normal range by at most half the smallest
# subnormal instead (the absolute term).
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
HALF_SUBNORMAL = {
    torch.float64: 2.0**-1075,
    torch.float32: 2.0**-150,
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
}


def error_bound(inputs, dtype, op):
    """Per element, the largest |result - reference| the reduction of ``inputs`` may show.

    The arithmetic (design decision 6): every algorithm combines the n inputs in n - 1
    additions (or multiplications); a step computes in FP32 (FP64 for float64) and rounds its
    result to ``dtype`` once, so each addition costs at most a relative ``u``, the unit
    roundoff (16-bit types: ``u_dtype + 2^-24``, the FP32 sum then the rounding to the dtype).
    For SUM every value a step rounds is a partial sum of some of the inputs, bounded by
    ``M = sum_r |x_r|``, so the n - 1 errors, each compounded by the later steps, stay under
    ``gamma * M`` with ``gamma = (n-1) u / (1 - (n-1) u)`` (Higham, Accuracy and Stability of
    Numerical Algorithms, section 4.2). AVG divides the finished sum by n and rounds once:
    ``gamma * M / n + u |avg|``. PROD multiplies factors whose products are exact in FP32, so
    the relative errors compound to ``gamma * |prod|``. Each step may also lose half a
    subnormal. The float64 reference obeys the same rule with u = 2^-53, so its own error is
    added (it matters for float64 only).

    This grows like n (the old tolerance grew like n^2), a few ulps of the terms' magnitude,
    so zeros, one rank's input, a rank dropped, SUM for AVG and a doubled result fall outside
    it (``test_error_bound_accepts_per_step_rounding_and_rejects_wrong_answers``).
    """
    wide = torch.stack([x.to(torch.float64) for x in inputs])
    u = UNIT_ROUNDOFF[dtype] + (2.0**-24 if dtype.itemsize == 2 else 0.0)
    ours = _rounding_bound(wide, op, u, HALF_SUBNORMAL[dtype])
    return ours + _rounding_bound(wide, op, 2.0**-53, HALF_SUBNORMAL[torch.float64])


def _rounding_bound(wide, op, u, half_subnormal):
    n = wide.shape[0]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    floor = n * half_subnormal
    if op == "PROD":
        return gamma * wide.prod(0).abs() + floor
    magnitude = wide.abs().sum(0)
    if op == "AVG":
        return gamma * magnitude / n + u * (wide.sum(0) / n).abs() + floor
    return gamma * magnitude + floor


def check_close(got, ref, dtype, op, what, bound=None):
    """Exact for integers and MIN/MAX; for floats SUM / AVG / PROD within ``bound``, the
    per-element error bound of the reduction (:func:`error_bound`)."""
    if not dtype.is_floating_point:
        expected = wrap(ref, dtype)
        assert torch.equal(got, expected), f"{what}: {got[:8]} != {expected[:8]}"
        return
    if op in ("MIN", "MAX"):
        assert torch.equal(got, ref.to(dtype)), what
        return
    err = (got.double() - ref).abs()
    bad = ~(err <= bound)  # NaN is bad
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} elements outside the rounding bound; "
            f"first at {i}: got {float(got[i])}, expected {float(ref[i])}, "
            f"|error| {float(err[i]):.3g} > bound {float(bound[i]):.3g}"
        )


def digest(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _all_reduce_cases(cases):
    """Runs each (algorithm, dtype, op, count, registered) all-reduce; returns digests."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    digests = []
    with dk.Communicator() as comm:
        for algorithm, dtype, op, count, registered in cases:
            inputs = [make_input(r, count, dtype, op, "ar") for r in range(n)]
            t = comm.empty(count, dtype) if registered else torch.empty(count, dtype=dtype)
            t.copy_(inputs[rank])
            comm.all_reduce(t, op=getattr(dk.ReduceOp, op), algorithm=algorithm)
            what = (
                f"rank {rank}: all_reduce {algorithm} {dtype} {op} count={count} reg={registered}"
            )
            ref = reference(inputs, dtype, op)
            bound = error_bound(inputs, dtype, op) if dtype.is_floating_point else None
            check_close(t, ref, dtype, op, what, bound)
            digests.append(digest(t))
    return digests


def all_reduce_cases(world_size):
    """Every algorithm x dtype x op x size up to 3 ranks; from 4 ranks (slow when ranks
    outnumber cores) every dtype x op at the prime size and float32 / int32 SUM at every size."""
    if world_size <= 3:
        cases = [
            (a, d, op, c, False)
            for a in ALGORITHMS
            for d in DTYPES
            for op in OPS
            for c in sizes(world_size)
        ]
    else:
        cases = [(a, d, op, 13, False) for a in ("ring", "tree") for d in DTYPES for op in OPS]
        cases += [
            (a, d, "SUM", c, False)
            for a in ALGORITHMS
            for d in (torch.float32, torch.int32)
            for c in sizes(world_size)
        ]
    # The big size crosses many slices and chunk boundaries: a few dtype / op pairs suffice.
    cases += [
        (a, d, op, BIG, reg)
        for a in ("ring", "tree")
        for d, op, reg in [(torch.float32, "SUM", False), (torch.bfloat16, "AVG", True)]
    ]
    cases += [("auto", torch.int64, "MAX", BIG, True)]
    return cases


def _check_reduce_scatter(comm, alloc, dtype, op, count):
    """reduce_scatter: out = chunk `rank` of the reduction of the n inputs (ranks differ)."""
    rank, n = comm.rank, comm.world_size
    inputs = [make_input(r, n * count, dtype, op, "rs") for r in range(n)]
    inp, out = alloc(n * count), alloc(count)
    inp.copy_(inputs[rank])
    comm.reduce_scatter(out, inp, op=op)
    mine = slice(rank * count, (rank + 1) * count)
    ref = reference(inputs, dtype, op)[mine]
    bound = error_bound(inputs, dtype, op)[mine] if dtype.is_floating_point else None
    check_close(out, ref, dtype, op, f"rank {rank}: reduce_scatter {dtype} {op} {count}", bound)
    assert torch.equal(inp, inputs[rank]), "reduce_scatter modified its input"


def _reduce_scatter_cases(cases):
    """Runs each (dtype, op, count-per-rank) reduce_scatter on plain tensors."""
    import dist_kernels as dk

    with dk.Communicator() as comm:
        for dtype, op, count in cases:
            _check_reduce_scatter(
                comm, lambda k, d=dtype: torch.empty(k, dtype=d), dtype, op, count
            )


def _scatter_gather_broadcast_cases(cases):
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    digests = []
    with dk.Communicator() as comm:
        for dtype, op, count, registered in cases:

            def alloc(k, dtype=dtype, registered=registered):
                return comm.empty(k, dtype) if registered else torch.empty(k, dtype=dtype)

            _check_reduce_scatter(comm, alloc, dtype, op, count)
            # all_gather: out = concatenation of every rank's input
            pieces = [make_input(r, count, dtype, "SUM", "ag") for r in range(n)]
            inp, out = alloc(count), alloc(n * count)
            inp.copy_(pieces[rank])
            comm.all_gather(out, inp)
            assert torch.equal(out, torch.cat(pieces)), f"rank {rank}: all_gather {dtype} {count}"
            digests.append(digest(out))
            # broadcast from every root
            for root in range(n):
                t = alloc(count)
                t.copy_(make_input(rank, count, dtype, "SUM", "bc"))
                comm.broadcast(t, root)
                assert torch.equal(t, make_input(root, count, dtype, "SUM", "bc")), (
                    f"rank {rank}: broadcast from {root} {dtype} {count}"
                )
    return digests


def _async_reverse_wait(sizes_):
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    with dk.Communicator() as comm:
        tensors = [torch.full((s,), float(rank + 1 + i)) for i, s in enumerate(sizes_)]
        registered = comm.empty(4096)
        registered.fill_(rank)
        works = [
            comm.all_reduce(t, algorithm=("ring", "tree", "auto")[i % 3], async_op=True)
            for i, t in enumerate(tensors)
        ]
        works.append(comm.all_reduce(registered, op=dk.ReduceOp.MAX, async_op=True))
        gathered = torch.empty(n * 3)
        works.append(comm.all_gather(gathered, torch.full((3,), float(rank)), async_op=True))
        works.append(comm.barrier(async_op=True))
        for w in reversed(works):
            assert w.wait() is True
            assert w.is_completed()
        for i, t in enumerate(tensors):
            expected = sum(r + 1 + i for r in range(n))
            assert torch.equal(t, torch.full_like(t, float(expected))), (i, t[:4])
        assert torch.equal(registered, torch.full_like(registered, float(n - 1)))
        assert torch.equal(gathered, torch.arange(n).float().repeat_interleave(3))
        # a synchronous call after async ones runs after them
        t = torch.ones(10)
        w = comm.all_reduce(t, async_op=True)
        comm.all_reduce(t)
        w.wait()
        assert torch.equal(t, torch.full_like(t, float(n * n)))
    return True


def _send_recv_barrier():
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    with dk.Communicator() as comm:
        for count in (0, 1, 2**20 + 7):
            if rank == 0:
                for peer in range(1, n):
                    comm.send(torch.arange(count, dtype=torch.int64) + peer, peer)
            else:
                t = torch.empty(count, dtype=torch.int64)
                comm.recv(t, 0)
                assert torch.equal(t, torch.arange(count, dtype=torch.int64) + rank)
            comm.barrier()
    return True


def _registered_outlives_close():
    import torch.distributed as dist

    import dist_kernels as dk

    comm = dk.Communicator()
    t = comm.empty((3, 5), torch.float64)
    assert t.shape == (3, 5) and t.dtype == torch.float64 and t.is_contiguous()
    t.fill_(dist.get_rank())
    comm.all_reduce(t)
    comm.close()
    t.add_(1)  # the memory stays valid as long as the tensor lives
    return float(t.sum())


def test_registered_buffer_stays_valid_after_close():
    results = run_ranks(2, _registered_outlives_close, timeout=120)
    assert results == [30.0, 30.0]
    assert shm_leaks() == []


def _module_level_api():
    import torch.distributed as dist

    import dist_kernels as dk

    comm = dk.init(device="cpu")
    assert dk.get_default_communicator() is comm
    t = torch.ones(5)
    dk.all_reduce(t, op=dist.ReduceOp.SUM)  # torch's ReduceOp is accepted
    out = torch.empty(2 * 5)
    dk.all_gather(out, t)
    dk.broadcast(t, 1)
    dk.barrier()
    comm.close()
    return float(t.sum()), float(out.sum())


def test_module_level_calls_use_the_default_communicator():
    assert run_ranks(2, _module_level_api, timeout=120) == [(10.0, 20.0), (10.0, 20.0)]


def scatter_gather_cases(world_size):
    ops = ("SUM", "AVG", "MAX") if world_size <= 3 else ("SUM",)
    cases = [(d, op, c, False) for d in DTYPES for op in ops for c in sizes(world_size)]
    cases += [(torch.float32, "SUM", BIG // world_size, reg) for reg in (False, True)]
    cases += [(torch.bfloat16, "PROD", 1000, True), (torch.int8, "MIN", 777, True)]
    return cases


def avg_edge_sizes(dtype, world_size):
    """Counts around the edges AVG's fused last step must get right: the ring's 64-byte chunk
    alignment and, for slots of 512 KiB or any smaller power of two, slice boundaries of the
    ring's chunks (count / n) and of the tree's halves (count / 2)."""
    align = 64 // dtype.itemsize
    slice_elems = (512 << 10) // dtype.itemsize
    n = world_size
    return sorted({n * align - 1, n * align + 1, n * slice_elems + 1, 2 * slice_elems - 1})


def avg_cases(world_size):
    """all_reduce AVG with ring and tree forced: every dtype at the chunk and slice edges."""
    return [
        (a, d, "AVG", c, False)
        for a in ("ring", "tree")
        for d in DTYPES
        for c in avg_edge_sizes(d, world_size)
    ]


def avg_scatter_cases(world_size):
    """reduce_scatter AVG: every dtype, a per-rank count off the 64-byte alignment and one just
    past a slice boundary."""
    return [
        (d, "AVG", c) for d in DTYPES for c in (16 * world_size + 1, (512 << 10) // d.itemsize + 1)
    ]


def _collectives(world_size):
    """Everything for one world size in one round trip to the pool."""
    digests = _all_reduce_cases(all_reduce_cases(world_size))
    digests += _scatter_gather_broadcast_cases(scatter_gather_cases(world_size))
    if world_size <= 4:
        digests += _all_reduce_cases(avg_cases(world_size))
        _reduce_scatter_cases(avg_scatter_cases(world_size))
    if world_size in (2, 3):
        _async_reverse_wait([1, 100, 2**18 + 3, 7, 2**20 + 7, 0])
    if world_size > 1:
        _send_recv_barrier()
    return digests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_collectives_match_reference_and_are_identical_on_every_rank(world_size):
    """all_reduce (ring, tree, auto), reduce_scatter, all_gather, broadcast, async ops waited
    in reverse, send/recv and barrier; plain and registered tensors."""
    print(f"seed {SEED}")
    results = run_ranks(world_size, _collectives, world_size, timeout=900)
    assert all(r == results[0] for r in results), "ranks hold different bits"
    assert shm_leaks() == []


# ------------------------------------------- the checker itself: right answers in, wrong out

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def rounded_per_step(inputs, dtype, op, order):
    """The reduction as an algorithm computes it: one step per input, in ``order``, each in
    FP32 (FP64 for float64) and rounded to ``dtype`` once; AVG divides in the last step."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    acc = inputs[order[0]]
    for i, r in enumerate(order[1:], start=2):
        a, b = acc.to(wide), inputs[r].to(wide)
        out = a * b if op == "PROD" else a + b
        if op == "AVG" and i == len(order):
            out = out / len(inputs)
        acc = out.to(dtype)
    if op == "AVG" and len(order) == 1:
        acc = acc.to(wide).div(1).to(dtype)
    return acc


def wrong_answers(inputs, dtype, op):
    """Answers a broken collective could give, each of which the checker must reject."""
    n = len(inputs)
    ref = reference(inputs, dtype, op)
    wrong = {"zeros": torch.zeros_like(ref), "doubled": 2 * ref}
    if n > 1:
        wrong["rank 0's own input"] = inputs[0].double()
        rest = reference(inputs[:-1], dtype, op)
        wrong["last rank dropped"] = rest * (n - 1) / n if op == "AVG" else rest
        if op == "AVG":
            wrong["SUM instead of AVG"] = ref * n
    return {name: w.to(dtype) for name, w in wrong.items()}


def checker_cases(world_size):
    """Every floating dtype and reducing op at the tests' prime size, and the big bf16 AVG
    of the all-reduce cases."""
    cases = [(d, op, 13) for d in FLOATS for op in ("SUM", "AVG", "PROD")]
    return cases + [(torch.bfloat16, "AVG", BIG)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_error_bound_accepts_per_step_rounding_and_rejects_wrong_answers(world_size):
    """The float checker of the collective tests is tight: for every world size tested, the
    reduction rounded once per step (rank order and reversed) passes, and zeros, a rank's own
    input, the result with the last rank dropped, SUM instead of AVG and a doubled result all
    fail."""
    print(f"seed {SEED}")
    order = list(range(world_size))
    for dtype, op, count in checker_cases(world_size):
        inputs = [make_input(r, count, dtype, op, "ar") for r in range(world_size)]
        ref, bound = reference(inputs, dtype, op), error_bound(inputs, dtype, op)
        what = f"{world_size} ranks {dtype} {op} count={count}"
        for o in (order, order[::-1]):
            check_close(rounded_per_step(inputs, dtype, op, o), ref, dtype, op, what, bound)
        for name, wrong in wrong_answers(inputs, dtype, op).items():
            with pytest.raises(AssertionError, match="outside the rounding bound"):
                check_close(wrong, ref, dtype, op, f"{what}: {name}", bound)
