"""Ranks that disagree are caught in the default mode (no DK_DEBUG): a fuzz of random
collectives on 2 and 3 ranks, some with one rank calling something else.

Every rank draws the same plan from the seed (printed). A matching call must give the exact
result (integer-valued inputs, compared with a float64 reference computed from every rank's
input); a disagreeing collective must raise CommError on every rank, in that call, before the
timeout; a send / receive pair that disagrees raises on the receiver in the call and on the
sender by the next collective (a send returns once its bytes are in shared memory). After a
failure the test continues on a new communicator.
"""

from __future__ import annotations

import datetime
import os
import random
import time

import pytest
import torch
from mp_pool import run_ranks, shm_leaks

TIMEOUT_S = 20.0
# Elements: small (one slot, one-shot / tree sizes), around a 512 KiB slot of fp32, and zero.
COUNTS = (0, 1, 7, 64, 1000, 131072 + 3)
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
SAME_WIDTH = {
    torch.float32: torch.int32,
    torch.int32: torch.float32,
    torch.float64: torch.int64,
    torch.int64: torch.float64,
    torch.float16: torch.bfloat16,
    torch.bfloat16: torch.float16,
    torch.int8: torch.uint8,
    torch.uint8: torch.int8,
}
OTHER_WIDTH = {d: torch.float64 if d != torch.float64 else torch.float32 for d in DTYPES}
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")
REDUCING = ("all_reduce", "reduce_scatter")
OPS = ("SUM", "MAX", "MIN")
FAULTS = ("count", "dtype-same-width", "dtype-other-width", "op", "kind", "root", "algorithm")


def _draw_call(rng: random.Random, n: int) -> dict:
    kind = rng.choice(KINDS)
    call = {
        "kind": kind,
        "count": rng.choice(COUNTS),
        "dtype": rng.choice(DTYPES),
        "op": rng.choice(OPS),
        "root": rng.randrange(n),
    }
    gather_scatter = kind in ("reduce_scatter", "all_gather")
    call["algorithm"] = rng.choice(("auto", "ring", "one_shot" if gather_scatter else "tree"))
    if kind == "p2p":
        call["peer"] = (call["root"] + rng.randrange(1, n)) % n
    return call


def _perturb(rng: random.Random, call: dict, n: int) -> tuple:
    """One rank's differing call, or None when the fault does not apply to this call."""
    fault = rng.choice(FAULTS)
    odd = dict(call)
    if fault == "count":
        odd["count"] = call["count"] + rng.choice((1, 5, 1000))
    elif fault == "dtype-same-width":
        odd["dtype"] = SAME_WIDTH[call["dtype"]]
    elif fault == "dtype-other-width":
        odd["dtype"] = OTHER_WIDTH[call["dtype"]]
    elif fault == "op" and call["kind"] in REDUCING:
        odd["op"] = rng.choice([o for o in OPS if o != call["op"]])
    elif fault == "kind" and call["kind"] != "p2p":
        odd["kind"] = rng.choice([k for k in KINDS if k not in (call["kind"], "p2p")])
        if odd["kind"] in ("reduce_scatter", "all_gather") and odd["algorithm"] == "tree":
            odd["algorithm"] = "ring"  # they have no tree: a ValueError, not a disagreement
    elif fault == "root" and call["kind"] == "broadcast":
        odd["root"] = (call["root"] + rng.randrange(1, n)) % n
    elif fault == "algorithm" and call["kind"] == "all_reduce" and call["count"] > 0:
        if call["algorithm"] == "auto":
            return None  # auto resolves to some algorithm; which is not ours to guess
        odd["algorithm"] = "tree" if call["algorithm"] == "ring" else "ring"
    elif fault == "algorithm" and call["kind"] in ("reduce_scatter", "all_gather"):
        if call["algorithm"] == "auto" or not _one_shot_fits(call, n):
            return None  # "one_shot" past a slot runs the ring: the ranks would agree
        odd["algorithm"] = "one_shot" if call["algorithm"] == "ring" else "ring"
    else:
        return None
    return fault, odd


def _one_shot_fits(call: dict, n: int) -> bool:
    """A non-empty per-rank chunk of at most one slot (else one_shot runs the ring)."""
    from dist_kernels import _C

    elem = torch.empty((), dtype=call["dtype"]).element_size()
    return 0 < call["count"] * elem <= _C.shm_slot_bytes(n)


def _plan(seed: int, n: int, trials: int) -> list:
    """[(call per rank, fault name or None)], identical on every rank."""
    rng = random.Random(seed)
    plan = []
    for _ in range(trials):
        call = _draw_call(rng, n)
        calls = [call] * n
        fault = None
        if rng.random() < 0.25:
            perturbed = _perturb(rng, call, n)
            if perturbed is not None:
                fault, odd = perturbed
                # For a pair, only the two ranks of the pair can disagree.
                who = rng.choice((call["root"], call["peer"])) if call["kind"] == "p2p" else None
                who = rng.randrange(n) if who is None else who
                calls = [odd if r == who else call for r in range(n)]
        plan.append((calls, fault))
    return plan


def _input(call: dict, rank: int, numel: int, salt: int) -> torch.Tensor:
    # Small non-negative integers: exact in every dtype, sums of 3 fit int8 / fp16 / bf16.
    x = (torch.arange(numel, dtype=torch.int64) * (rank + 3) + salt) % 5
    return x.to(call["dtype"])


def _reference(call: dict, n: int, salt: int) -> torch.Tensor:
    count, kind = call["count"], call["kind"]
    if kind == "all_reduce":
        xs = torch.stack([_input(call, r, count, salt).double() for r in range(n)])
    elif kind == "reduce_scatter":
        xs = torch.stack([_input(call, r, n * count, salt).double() for r in range(n)])
    elif kind == "all_gather":
        return torch.cat([_input(call, r, count, salt) for r in range(n)])
    else:  # broadcast, p2p: the root's / sender's tensor
        return _input(call, call["root"], count, salt)
    red = {"SUM": xs.sum(0), "MAX": xs.max(0).values, "MIN": xs.min(0).values}[call["op"]]
    return red.to(call["dtype"])


def _run(comm, call: dict, rank: int, n: int, salt: int):
    """Runs one call; returns the tensor to compare with _reference (None: nothing to check)."""
    kind, count = call["kind"], call["count"]
    if kind == "all_reduce":
        t = _input(call, rank, count, salt)
        comm.all_reduce(t, op=call["op"], algorithm=call["algorithm"])
        return t
    if kind == "reduce_scatter":
        out = torch.empty(count, dtype=call["dtype"])
        comm.reduce_scatter(
            out, _input(call, rank, n * count, salt), op=call["op"], algorithm=call["algorithm"]
        )
        return out
    if kind == "all_gather":
        out = torch.empty(n * count, dtype=call["dtype"])
        comm.all_gather(out, _input(call, rank, count, salt), algorithm=call["algorithm"])
        return out
    if kind == "broadcast":
        t = _input(call, rank, count, salt) if rank == call["root"] else _zeros(call)
        comm.broadcast(t, call["root"])
        return t
    if rank == call["root"]:
        comm.send(_input(call, rank, count, salt), call["peer"])
        return None
    if rank == call["peer"]:
        t = _zeros(call)
        comm.recv(t, call["root"])
        return t
    return None


def _zeros(call: dict) -> torch.Tensor:
    return torch.zeros(call["count"], dtype=call["dtype"])


def _expected(call: dict, rank: int, n: int, salt: int) -> torch.Tensor:
    ref = _reference(call, n, salt)
    if call["kind"] == "reduce_scatter":
        return ref[rank * call["count"] : (rank + 1) * call["count"]]
    return ref


class _Errors(list):
    """The report's errors, also printed at once (a rank that later hangs still shows them)."""

    def append(self, message: str) -> None:
        import sys

        print(message, file=sys.stderr, flush=True)
        super().append(message)


def _comm():
    import dist_kernels as dk

    return dk.Communicator(timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _fuzz(seed: int, trials: int) -> dict:
    import torch.distributed as dist

    import dist_kernels as dk

    os.environ["DK_DEBUG"] = "0"
    rank, n = dist.get_rank(), dist.get_world_size()
    report = {"exact": 0, "caught": 0, "errors": _Errors()}
    comm = _comm()
    try:
        for i, (calls, fault) in enumerate(_plan(seed, n, trials)):
            call, salt = calls[rank], i
            where = f"trial {i} ({fault or 'matching'}, rank {rank} calls {call})"
            start = time.monotonic()
            try:
                got = _run(comm, call, rank, n, salt)
                if fault is not None and calls[0]["kind"] == "p2p":
                    comm.barrier()  # the sender learns here at the latest
                elif calls[0]["kind"] == "p2p":
                    # A pair does not hold up the other ranks: without this, the next trial's
                    # fault could fail the communicator before the receiver got here.
                    dist.barrier()
            except dk.CommError as e:
                elapsed = time.monotonic() - start
                if fault is None:
                    report["errors"].append(f"{where}: raised {e}")
                elif "disagree" not in str(e) or elapsed >= TIMEOUT_S:
                    report["errors"].append(f"{where}: {elapsed:.1f} s, {e}")
                else:
                    report["caught"] += 1
                comm.close()
                comm = _comm()  # a new communicator works after the failure
                continue
            if fault is not None:
                report["errors"].append(f"{where}: returned without raising")
                comm.close()
                comm = _comm()
            elif got is not None and not torch.equal(got, _expected(call, rank, n, salt)):
                report["errors"].append(f"{where}: wrong result")
            else:
                report["exact"] += 1
        t = torch.full((5,), float(rank))
        comm.all_reduce(t)
        if not torch.equal(t, torch.full((5,), float(sum(range(n))))):
            report["errors"].append("the last communicator gives a wrong all_reduce")
    finally:
        comm.close()
    return report


def test_plan_has_every_fault_and_matching_calls():
    """The plan itself: each fault kind occurs, and the checks reject a wrong answer."""
    plan = _plan(1234, 3, 300)
    faults = {f for _, f in plan}
    assert set(FAULTS) <= faults, faults
    assert sum(f is None for _, f in plan) > 150
    call = {"kind": "all_reduce", "count": 10, "dtype": torch.int32, "op": "SUM", "root": 0}
    ref = _expected(call, 0, 3, salt=1)
    assert not torch.equal(_input(call, 0, 10, 1), ref), "a dropped peer would be caught"
    assert not torch.equal(ref * 2, ref) and ref.abs().sum() > 0, "zeros / doubling caught"


@pytest.mark.parametrize("world_size,trials", [(2, 200), (3, 120)])
def test_fuzz_disagreement_always_caught(world_size, trials):
    seed = int(os.environ.get("DK_FUZZ_SEED", random.randrange(2**31)))
    print(f"fuzz seed {seed} (rerun with DK_FUZZ_SEED={seed})")
    results = run_ranks(world_size, _fuzz, seed, trials, timeout=600)
    for rank, report in enumerate(results):
        assert report["errors"] == [], f"seed {seed}, rank {rank}: " + "\n".join(
            report["errors"][:10]
        )
    faults = sum(f is not None for _, f in _plan(seed, world_size, trials))
    assert all(r["caught"] + r["exact"] == trials for r in results), (seed, results)
    assert all(r["caught"] == faults for r in results), (seed, faults, results)
    assert shm_leaks() == []


def _checks_setting(off_on_rank: int):
    """DK_CHECK_DESCRIPTORS=0 on one rank only: local rank 0's setting holds for every rank."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    os.environ["DK_DEBUG"] = "0"
    if rank == off_on_rank:
        os.environ["DK_CHECK_DESCRIPTORS"] = "0"
    out = {}
    comm = _comm()
    try:
        for count in (1, 1000, 200_000):  # one-shot, and the ring / tree past half a slot
            t = torch.arange(count, dtype=torch.float32) + rank
            comm.all_reduce(t)
            expect = torch.arange(count, dtype=torch.float32) * n + sum(range(n))
            out[f"all_reduce {count}"] = torch.equal(t, expect)
        # A broadcast whose dtype differs in kind but not width: only the descriptor shows it.
        t = torch.zeros(4, dtype=torch.float32 if rank == 0 else torch.int32)
        try:
            comm.broadcast(t, src=0)
            out["broadcast"] = "returned"
        except dk.CommError as e:
            out["broadcast"] = "disagree" if "disagree" in str(e) else str(e)
    finally:
        comm.close()
        os.environ.pop("DK_CHECK_DESCRIPTORS", None)
    return out


@pytest.mark.parametrize("off_on_rank", [0, 1])
def test_descriptor_checks_follow_local_rank_0(off_on_rank):
    """The benchmark's switch (DK_CHECK_DESCRIPTORS=0) is decided by local rank 0, so ranks
    never disagree about it; off, results stay exact and a same-width dtype mix goes unseen
    (which is what the benchmark's unchecked figure leaves out); on, it is caught."""
    results = run_ranks(2, _checks_setting, off_on_rank, timeout=120)
    for rank, out in enumerate(results):
        assert all(v for k, v in out.items() if k.startswith("all_reduce")), (rank, out)
        expected = "returned" if off_on_rank == 0 else "disagree"
        assert out["broadcast"] == expected, (rank, out)
    assert shm_leaks() == []
