"""Ctrl-C: a SIGINT reaching a rank blocked in a collective, a send / receive or Work.wait
raises KeyboardInterrupt there within 0.5 s and fails the communicator, so its peers raise
CommError naming it at once (not at the timeout); nothing is left in /dev/shm."""

from __future__ import annotations

import datetime

import pytest
import torch
from mp_pool import run_ranks, shm_leaks

TIMEOUT_S = 60.0  # far beyond every bound checked below: only the interrupt can end the waits
BOUND_S = 0.5
SIGNAL_AFTER_S = 0.3


def _comm():
    import dist_kernels as dk

    return dk.Communicator(timeout=datetime.timedelta(seconds=TIMEOUT_S))


COUNTERPART = {"all_reduce": "all_reduce", "recv": "send", "send": "recv-big", "wait": "send"}


def _call(comm, how: str, peer: int):
    if how == "all_reduce":
        comm.all_reduce(torch.ones(1000))
    elif how == "recv":
        comm.recv(torch.empty(10), peer)
    elif how == "send":
        comm.send(torch.ones(2**20), peer)  # 4 MiB: more than the FIFO's slots hold
    elif how == "recv-big":
        comm.recv(torch.empty(2**20), peer)
    elif how == "wait":
        comm.irecv(torch.empty(10), peer).wait()
    elif how == "broadcast":
        comm.broadcast(torch.ones(10), peer)


def _interrupt(calls, peers, signalled):
    """Rank r blocks in calls[r] on peers[r]; the ranks in `signalled` get a SIGINT after
    0.3 s (from a timer thread: Python runs the handler on the blocked main thread)."""
    import os
    import signal
    import threading
    import time

    import torch.distributed as dist

    import dist_kernels as dk

    rank, n = dist.get_rank(), dist.get_world_size()
    comm = _comm()
    comm.barrier()
    sent = []
    timer = None
    if rank in signalled:

        def fire():
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(SIGNAL_AFTER_S, fire)
        timer.start()
    call_start = end = time.monotonic()
    outcome = ("CommError, then a late KeyboardInterrupt", "")
    try:
        try:
            if calls[rank].startswith("sleep-then-"):
                time.sleep(1.0)
                call_start = time.monotonic()
                _call(comm, calls[rank][len("sleep-then-") :], peers[rank])
            else:
                _call(comm, calls[rank], peers[rank])
            outcome = ("returned", "")
        except KeyboardInterrupt:
            outcome = ("KeyboardInterrupt", "")
        except dk.CommError as e:
            outcome = ("CommError", str(e))
        end = time.monotonic()
        if timer is not None:  # a peer's interrupt may have ended our call before our own
            timer.join()  # SIGINT came: let that one land here, not in the checks below
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    try:  # the communicator is failed: every later call raises at once
        comm.all_reduce(torch.ones(3))
        poisoned = False
    except dk.CommError:
        poisoned = True
    comm.close()
    with _comm() as fresh:  # and a new one works
        t = torch.ones(4)
        fresh.all_reduce(t)
        fresh_ok = torch.equal(t, torch.full((4,), float(n)))
    latency = end - sent[0] if sent else None
    return outcome, end - call_start, latency, poisoned, fresh_ok


@pytest.mark.parametrize("how", ["all_reduce", "recv", "send", "wait", "broadcast"])
def test_sigint_to_one_blocked_rank(how):
    """Rank 0 blocks in `how`; rank 1 arrives with its matching call after the SIGINT."""
    later = "sleep-then-" + COUNTERPART.get(how, how)
    results = run_ranks(2, _interrupt, [how, later], [1, 0], [0], timeout=120)
    (kind0, _), _, latency, poisoned0, fresh0 = results[0]
    assert kind0 == "KeyboardInterrupt", results[0]
    assert latency is not None and latency < BOUND_S, f"{how}: KeyboardInterrupt after {latency}"
    (kind1, msg1), elapsed1, _, poisoned1, fresh1 = results[1]
    assert kind1 == "CommError", results[1]
    assert "rank 0 was interrupted (SIGINT)" in msg1, msg1
    assert elapsed1 < BOUND_S, f"the peer's call took {elapsed1:.1f} s"
    assert poisoned0 and poisoned1 and fresh0 and fresh1
    assert shm_leaks() == []


@pytest.mark.parametrize("signalled", [[0], [0, 1]], ids=["rank0", "both"])
def test_sigint_to_blocked_ranks_of_three(signalled):
    """Rank 0 in an all-reduce and rank 1 in a receive, both waiting for rank 2 (busy
    elsewhere); SIGINT to rank 0, or to ranks 0 and 1 at once. A blocked rank that is not
    signalled raises CommError naming rank 0 at once; rank 2's late all-reduce fails at once."""
    calls = ["all_reduce", "recv", "sleep-then-all_reduce"]
    results = run_ranks(3, _interrupt, calls, [2, 2, 0], signalled, timeout=120)
    for rank, ((kind, msg), elapsed, latency, poisoned, fresh) in enumerate(results):
        assert poisoned and fresh, (rank, results[rank])
        if rank in signalled:
            # A rank whose peer was interrupted a moment earlier may raise the CommError
            # before its own SIGINT lands; either way it must not wait for the timeout.
            assert kind in ("KeyboardInterrupt", "CommError"), (rank, kind, msg)
            assert latency is not None and latency < BOUND_S, (rank, latency)
        else:
            assert kind == "CommError" and "was interrupted (SIGINT)" in msg, (rank, msg)
            limit = BOUND_S if rank == 2 else SIGNAL_AFTER_S + BOUND_S
            assert elapsed < limit, (rank, elapsed)
    # The interrupt reached Python on a signalled rank (with both signalled at once, the one
    # whose SIGINT landed second may see the first one's CommError instead).
    assert any(results[r][0][0] == "KeyboardInterrupt" for r in signalled), results
    assert shm_leaks() == []


def _exit_with_queued_call():
    """What the interpreter does at exit (atexit): an open communicator with a receive queued
    that no peer will match is failed, not drained."""
    import time

    import torch.distributed as dist

    import dist_kernels as dk
    from dist_kernels.comm.base import _close_open_communicators

    rank = dist.get_rank()
    comm = _comm()
    comm.barrier()
    start = time.monotonic()
    if rank == 0:
        work = comm.irecv(torch.empty(10), 1)
        time.sleep(0.2)
        _close_open_communicators()
        assert comm._closed
        try:
            work.wait()
            return ("returned", time.monotonic() - start)
        except dk.CommError as e:
            return (str(e), time.monotonic() - start)
    try:
        comm.recv(torch.empty(10), 0)
        return ("returned", time.monotonic() - start)
    except dk.CommError as e:
        return (str(e), time.monotonic() - start)
    finally:
        comm.close()


def test_interpreter_exit_fails_open_communicators():
    results = run_ranks(2, _exit_with_queued_call, timeout=120)
    for msg, elapsed in results:
        assert "rank 0 exited with the communicator open" in msg, msg
        assert elapsed < 5.0, elapsed
    assert shm_leaks() == []
