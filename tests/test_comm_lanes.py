"""Send and receive on two threads at once (the transport's lanes), and close() from one thread
while another is blocked inside the communicator."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
from mp_pool import run_ranks, shm_leaks

TIMEOUT_S = 10.0
# Larger than one FIFO (4 slots of 512 KiB at 2 ranks): a send of this size blocks until the
# peer receives, so two ranks that both send first only finish if their receives run meanwhile.
BIG = 3 << 20


def _comm(timeout_s=TIMEOUT_S):
    import dist_kernels as dk

    return dk.Communicator(timeout=datetime.timedelta(seconds=timeout_s))


def _payload(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-(2**31), 2**31 - 1, (numel,), generator=g, dtype=torch.int32)


def _crossed_sends(seed: int):
    """Both ranks send a message larger than the FIFO to each other while a second thread
    receives the peer's: only possible when a blocked send does not hold up the receive."""
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = 1 - rank
    errors = []
    with _comm() as comm:
        for numel in (BIG // 4, BIG // 4 + 3, 1, 0):
            got = torch.empty(numel, dtype=torch.int32)
            failure = []

            def receive(got=got, failure=failure):
                try:
                    comm.recv(got, peer)
                except Exception as exc:  # noqa: BLE001 - reported below
                    failure.append(exc)

            receiver = threading.Thread(target=receive)
            receiver.start()
            comm.send(_payload(rank, numel, seed), peer)
            receiver.join()
            if failure:
                errors.append(f"numel {numel}: {failure[0]}")
            elif not torch.equal(got, _payload(peer, numel, seed)):
                errors.append(f"numel {numel}: wrong bytes from rank {peer}")
            # Collectives still pair up afterwards (both lanes).
            t = torch.full((5,), float(rank + 1))
            comm.all_reduce(t)
            if not torch.equal(t, torch.full((5,), 3.0)):
                errors.append(f"numel {numel}: all_reduce out of step afterwards")
    return errors


def test_send_and_recv_on_two_threads_overlap():
    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    assert run_ranks(2, _crossed_sends, seed, timeout=120) == [[], []]


def _close_while_receiving():
    """Rank 0 closes its communicator while another of its threads waits in recv(); rank 1
    waits in recv() from rank 0. Both waits must end with CommError well before the timeout."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    comm = _comm()
    outcome = {}

    def receive():
        start = time.monotonic()
        try:
            comm.recv(torch.empty(4), 1 - rank)
            outcome["error"] = "recv returned"
        except dk.CommError as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.monotonic() - start

    receiver = threading.Thread(target=receive)
    receiver.start()
    if rank == 0:
        time.sleep(0.5)  # let the receive block first
        comm.close()
    receiver.join(timeout=3 * TIMEOUT_S)
    alive = receiver.is_alive()
    comm.close()
    return alive, outcome.get("error", ""), outcome.get("seconds", float("inf"))


def test_close_from_another_thread_cancels_a_blocked_recv():
    results = run_ranks(2, _close_while_receiving, timeout=120)
    for rank, (alive, error, seconds) in enumerate(results):
        print(f"rank {rank}: {seconds:.2f} s: {error}")
        assert not alive, f"rank {rank}: recv still blocked after close()"
        assert "closed" in error, f"rank {rank}: {error}"
        assert seconds < TIMEOUT_S / 2, f"rank {rank}: took {seconds:.2f} s"
    assert "[rank 0] recv" in results[0][1]
    assert shm_leaks() == []


def _isend_irecv_any_order(seed: int, registered: bool):
    """Every rank posts its receives before its sends (the order that deadlocks when a
    pending receive holds up the sends), several messages per peer, larger than the FIFO and
    small (copied in on the caller's thread, even from registered memory); then a collective
    issued after them must see them finished."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    # Small ones first: with the send lane quiet and the FIFO free they are copied in at once.
    sizes = [7, 100, 3, BIG // 4 + 5, 0, BIG // 8]
    errors = []
    with _comm() as comm:

        def buffer(numel):
            if not registered:
                return torch.empty(numel, dtype=torch.int32)
            return comm.empty((numel,), dtype=torch.int32)  # collective: same order everywhere

        got = [buffer(numel) for numel in sizes]
        sent = [buffer(numel) for numel in sizes]  # before any irecv: empty() drains the queue
        for i, (numel, t) in enumerate(zip(sizes, sent)):
            t.copy_(_payload(rank, numel, seed + i))
        works = [comm.irecv(t, prev) for t in got]
        first = comm.isend(sent[0], nxt)
        if not first.is_completed():
            errors.append("a small isend on a quiet send lane did not complete at once")
        works += [first] + [comm.isend(t, nxt) for t in sent[1:]]
        total = torch.full((3,), float(rank))
        comm.all_reduce(total)  # issued after the sends and receives: runs after them
        for w in works:
            w.wait()
        for i, (numel, t) in enumerate(zip(sizes, got)):
            if not torch.equal(t, _payload(prev, numel, seed + i)):
                errors.append(f"message {i} ({numel} elements) from rank {prev} differs")
        if not torch.equal(total, torch.full((3,), float(sum(range(n))))):
            errors.append("all_reduce after isend/irecv out of step")
    return errors


@pytest.mark.parametrize("registered", [False, True], ids=["plain", "registered"])
def test_isend_irecv_in_any_order_on_a_ring(registered):
    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    for world_size in (2, 3):
        assert run_ranks(world_size, _isend_irecv_any_order, seed, registered, timeout=120) == [
            [] for _ in range(world_size)
        ]


def _isend_then_sync_recv(seed: int):
    """A synchronous recv on one thread while an isend to the same peer is still pending on
    the queue's send lane: the receive must not wait for the send to finish."""
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = 1 - rank
    with _comm() as comm:
        mine = _payload(rank, BIG // 4, seed)
        work = comm.isend(mine, peer)
        got = torch.empty(BIG // 4, dtype=torch.int32)
        comm.recv(got, peer)
        work.wait()
        return torch.equal(got, _payload(peer, BIG // 4, seed))


def test_sync_recv_runs_beside_a_pending_isend():
    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    assert run_ranks(2, _isend_then_sync_recv, seed, timeout=120) == [True, True]


def _p2p_bad_input():
    import torch.distributed as dist

    rank = dist.get_rank()
    errors = []
    with _comm() as comm:
        for arg, exc_type, call in [
            ("dst", ValueError, lambda: comm.isend(torch.ones(2), rank)),
            ("src", ValueError, lambda: comm.irecv(torch.ones(2), 5)),
            ("tensor", ValueError, lambda: comm.isend(torch.ones(4, 4).t(), 1 - rank)),
        ]:
            try:
                call()
                errors.append(f"no error for {arg}")
            except exc_type as e:
                if arg not in str(e) or f"[rank {rank}]" not in str(e):
                    errors.append(f"{exc_type.__name__} does not name {arg} and rank: {e}")
        comm.barrier()
    return errors


def test_isend_irecv_bad_input_names_rank_and_argument():
    assert run_ranks(2, _p2p_bad_input, timeout=60) == [[], []]


def _irecv_wait_timeout_then_arrives():
    """wait(timeout) on an irecv whose sender is late raises CommError and leaves it pending;
    once the sender sends, a second wait() returns the data."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with _comm() as comm:
        if rank == 0:
            got = torch.zeros(6)
            work = comm.irecv(got, 1)
            try:
                work.wait(timeout=0.2)
                early = "wait(timeout=0.2) returned before the send"
            except dk.CommError as exc:
                early = "" if "[rank 0] recv" in str(exc) else f"unexpected message: {exc}"
            comm.send(torch.ones(1), 1)  # tells rank 1 to send now
            work.wait()
            return early, got.tolist()
        go = torch.zeros(1)
        comm.recv(go, 0)
        comm.send(torch.arange(6.0), 0)
        return "", None


def test_irecv_wait_timeout_leaves_it_pending():
    (early, got), _ = run_ranks(2, _irecv_wait_timeout_then_arrives, timeout=60)
    assert early == ""
    assert got == torch.arange(6.0).tolist()
