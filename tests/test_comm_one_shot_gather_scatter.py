"""One-shot all_gather and reduce_scatter (small messages): on 1, 2, 3, 4 and 8 ranks, every
dtype, every op, per-rank chunks around auto's limit (an eighth of a slot) and the one-slot
limit (+1 falls back to the ring). Exact against a float64 reference on integer-valued inputs,
equal to the ring within rounding on random ones; auto's choice is the cost model's; ranks that
call different algorithms fail with CommError on every rank."""

from __future__ import annotations

import datetime
import hashlib
import os
import random

import pytest
import torch
from mp_pool import run_ranks, shm_leaks
from test_comm_one_shot import ATOL, DTYPES, OPS, _integer_input, _oversubscribed, _reference

CODES = {"auto": 0, "ring": 1, "one_shot": 3}
# auto considers one-shot up to this fraction of a slot per rank (CpuCommunicator::resolve).
AUTO_LIMIT = 8


def _counts(n: int, elem: int) -> list:
    """Elements per rank: tiny, around auto's limit (AUTO_LIMIT) and the slot (+1: ring)."""
    from dist_kernels import _C

    limit, slot = _C.shm_slot_bytes(n) // AUTO_LIMIT // elem, _C.shm_slot_bytes(n) // elem
    return sorted({1, 7, 64, limit, limit + 1, slot, slot + 1})


def _auto_choice(collective: str, n: int, count: int, elem: int) -> int:
    """The code auto must pick for `count` elements per rank: one-shot where every rank's
    chunks together fit the small-message boxes, else the cost model's cheaper of ring and
    one-shot (a tie keeps the ring), one-shot only up to 1 / AUTO_LIMIT slot per peer."""
    from dist_kernels import _C

    if n > 1 and n * count * elem <= _C.shm_small_message_bytes():
        return CODES["one_shot"]
    cost = {
        "all_gather": _C._shm_all_gather_cost_us,
        "reduce_scatter": _C._shm_reduce_scatter_cost_us,
    }
    ring, one = cost[collective](n, n * count * elem, _oversubscribed(n))
    if count * elem > _C.shm_slot_bytes(n) // AUTO_LIMIT:
        return CODES["ring"]
    return CODES["one_shot"] if one < ring else CODES["ring"]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _check_all_gather(comm, dtype, count: int, seed: int, errors: list, digests: list) -> None:
    rank, n = comm.rank, comm.world_size
    inputs = [_integer_input(r, count, dtype, "SUM", seed) for r in range(n)]
    expected = torch.cat(inputs)
    out = torch.empty(n * count, dtype=dtype)
    comm.all_gather(out, inputs[rank], algorithm="one_shot")
    if not torch.equal(out, expected):
        errors.append(f"all_gather n={n} {dtype} count={count}: differs from the reference")
    digests.append(_digest(out))
    # In place: the input is this rank's chunk of the output.
    out = torch.zeros(n * count, dtype=dtype)
    out[rank * count : (rank + 1) * count] = inputs[rank]
    comm.all_gather(out, out[rank * count : (rank + 1) * count], algorithm="one_shot")
    if not torch.equal(out, expected):
        errors.append(f"all_gather n={n} {dtype} count={count} in place: differs")


def _check_reduce_scatter(comm, dtype, count: int, op: str, seed: int, errors: list) -> None:
    rank, n = comm.rank, comm.world_size
    tag = f"reduce_scatter n={n} {dtype} count={count} {op}"
    mine = slice(rank * count, (rank + 1) * count)
    # Exact: integer-valued inputs against float64.
    inputs = [_integer_input(r, n * count, dtype, op, seed) for r in range(n)]
    expected = _reference([x[mine] for x in inputs], dtype, op)
    out = torch.empty(count, dtype=dtype)
    comm.reduce_scatter(out, inputs[rank], op=op, algorithm="one_shot")
    if not torch.equal(out, expected):
        errors.append(f"{tag}: differs from the float64 reference")
    if op == "SUM":  # in place: the output is this rank's chunk of the input
        whole = inputs[rank].clone()
        comm.reduce_scatter(whole[mine], whole, op=op, algorithm="one_shot")
        if not torch.equal(whole[mine], expected):
            errors.append(f"{tag} in place: differs from the float64 reference")
    if not dtype.is_floating_point or op == "PROD" or (count > 64 and dtype != torch.float16):
        return
    # Rounding: random normals, one-shot against the ring.
    g = torch.Generator().manual_seed(seed + 7 * rank + count)
    x = torch.randn(n * count, generator=g).to(dtype)
    results = {}
    for algorithm in ("one_shot", "ring"):
        results[algorithm] = torch.empty(count, dtype=dtype)
        comm.reduce_scatter(results[algorithm], x, op=op, algorithm=algorithm)
    atol = ATOL[dtype] * (1 if op in ("MIN", "MAX") else n)
    one, ring = results["one_shot"], results["ring"]
    if not torch.allclose(one.double(), ring.double(), rtol=0, atol=atol):
        errors.append(f"{tag}: one_shot and ring differ beyond rounding")
    if op in ("MIN", "MAX") and not torch.equal(one, ring):
        errors.append(f"{tag}: one_shot {op} differs from the ring")


def _gather_scatter(seed: int):
    import dist_kernels as dk
    from dist_kernels import _C

    errors, digests, chosen = [], [], {}
    with dk.Communicator() as comm:
        n, impl = comm.world_size, comm._backend.impl
        for dtype in DTYPES:
            elem = torch.empty((), dtype=dtype).element_size()
            for count in _counts(n, elem):
                _check_all_gather(comm, dtype, count, seed, errors, digests)
                # Every op on small chunks; the big ones (the limits) cost the most time.
                for op in OPS if count <= 64 else ("SUM", "AVG", "MAX"):
                    _check_reduce_scatter(comm, dtype, count, op, seed, errors)
        slot = _C.shm_slot_bytes(n) // 4
        limit = slot // AUTO_LIMIT
        for count in (1, 256, limit, limit + 1, slot // 2, slot, slot + 1):
            for name in ("auto", "one_shot", "ring"):
                chosen[("all_gather", count, name)] = impl.resolve_all_gather(count, 0, CODES[name])
                chosen[("reduce_scatter", count, name)] = impl.resolve_reduce_scatter(
                    count, 0, CODES[name]
                )
    return errors, digests, chosen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_one_shot_gather_scatter(world_size):
    from dist_kernels import _C

    seed = int(os.environ.get("DK_TEST_SEED", random.randrange(2**31)))
    print(f"seed {seed} (DK_TEST_SEED={seed} reruns it)")
    results = run_ranks(world_size, _gather_scatter, seed, timeout=600)
    for rank, (errors, _, _) in enumerate(results):
        assert errors == [], f"seed {seed}, rank {rank}: " + "\n".join(errors[:10])
    for rank, (_, digests, _) in enumerate(results):
        assert digests == results[0][1], f"seed {seed}: rank {rank}'s all_gather bits differ"
    chosen = results[0][2]
    assert all(r[2] == chosen for r in results), "ranks resolved auto differently"
    slot = _C.shm_slot_bytes(world_size) // 4
    for (collective, count, name), code in chosen.items():
        if name == "ring":
            want = CODES["ring"]
        elif name == "one_shot":  # up to one slot per peer, then the ring
            want = CODES["one_shot"] if count <= slot else CODES["ring"]
        else:
            want = _auto_choice(collective, world_size, count, 4)
        assert code == want, f"{collective} {name} count={count}: chose {code}, not {want}"
    if world_size > 1:  # the small-message boxes, at 2 ranks too
        assert chosen[("all_gather", 1, "auto")] == CODES["one_shot"]
    if world_size > 2:  # at 2 ranks the ring is one exchange too: the model ties, ring stays
        assert chosen[("reduce_scatter", 256, "auto")] == CODES["one_shot"]
    assert chosen[("all_gather", slot // AUTO_LIMIT + 1, "auto")] == CODES["ring"]
    if world_size > 2:
        assert chosen[("reduce_scatter", slot // AUTO_LIMIT, "auto")] == CODES["one_shot"]
    assert shm_leaks() == []


def _mixed_algorithms(collective: str):
    """Rank 0 calls one_shot, every other rank the ring: every rank must raise CommError."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    algorithm = "one_shot" if rank == 0 else "ring"
    count = 100
    comm = dk.Communicator(timeout=datetime.timedelta(seconds=20))
    try:
        if collective == "all_gather":
            comm.all_gather(torch.empty(n * count), torch.ones(count), algorithm=algorithm)
        else:
            comm.reduce_scatter(torch.empty(count), torch.ones(n * count), algorithm=algorithm)
    except dk.CommError as e:
        return str(e)
    finally:
        comm.close()
    return None


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_one_shot_against_ring_raises_on_every_rank(world_size, collective):
    messages = run_ranks(world_size, _mixed_algorithms, collective, timeout=60)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} returned without raising"
        assert "disagree" in message, f"rank {rank}: {message}"
    assert shm_leaks() == []


def _tree_rejected():
    import dist_kernels as dk

    with dk.Communicator() as comm:
        n, raised = comm.world_size, []
        for call in (
            lambda a: comm.all_gather(torch.empty(2 * n), torch.empty(2), algorithm=a),
            lambda a: comm.reduce_scatter(torch.empty(2), torch.empty(2 * n), algorithm=a),
        ):
            try:
                call("tree")
            except ValueError as e:
                raised.append(str(e))
        comm.all_gather(torch.empty(2 * n), torch.ones(2))  # the communicator still works
    return raised


def test_tree_raises_value_error_naming_the_collective():
    raised = run_ranks(2, _tree_rejected)[0]
    assert len(raised) == 2, raised
    assert "all_gather has no tree" in raised[0] and "'tree'" in raised[0]
    assert "reduce_scatter has no tree" in raised[1]


def test_checks_reject_wrong_answers():
    """The references reject a dropped rank, a doubled sum and a swapped gather."""
    n, count = 3, 5
    inputs = [_integer_input(r, n * count, torch.float32, "SUM", 3) for r in range(n)]
    ref = _reference(inputs, torch.float32, "SUM")[:count]
    assert not torch.equal(_reference(inputs[:2], torch.float32, "SUM")[:count], ref)
    assert not torch.equal(2 * ref, ref)
    chunks = [_integer_input(r, count, torch.float32, "SUM", 3) for r in range(n)]
    assert not torch.equal(torch.cat(chunks[::-1]), torch.cat(chunks))
    assert not torch.equal(torch.cat([chunks[0]] * n), torch.cat(chunks))
