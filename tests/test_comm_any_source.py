"""Receives from any source (``comm.recv(t)`` without ``src``), on 3 ranks.

Every message carries its sender's rank and a per-sender index in its payload, so the receiver
checks the returned source against what it received (independent of the call that says it).
A peer's collective message must not be taken by a receive; a dead peer fails that receive
alone (the communicator stays usable with the others); closed peers are skipped; ranks that
all went into a collective are a disagreement caught before the timeout; ``set_timeout``
takes effect on the next call, with torch's "Timed out" wording.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
from mp_pool import RankDied, run_ranks, shm_leaks

WORLD = 3
MESSAGES = 3  # per sender


def _payload(sender: int, index: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000 * sender + index


def _gather_from_any(numel: int):
    """Rank 0 receives MESSAGES from each peer in whatever order they come (sync and async
    receives mixed); each peer sends them in index order."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=30)) as comm:
        if rank != 0:
            for index in range(MESSAGES):
                comm.send(_payload(rank, index, numel), 0)
            return None
        seen = {peer: 0 for peer in range(1, WORLD)}
        order = []
        for k in range((WORLD - 1) * MESSAGES):
            t = torch.empty(numel)
            if k % 2:
                work = comm.irecv(t)
                work.wait()
                source = work.source_rank()
            else:
                source = comm.recv(t)
            order.append(source)
            assert torch.equal(t, _payload(source, seen[source], numel)), (source, t[:4])
            seen[source] += 1
        return order


@pytest.mark.parametrize("numel", [5, 300_000])  # one slot; several slots (1.2 MB, 512 KiB slots)
def test_recv_from_any_source_returns_the_sender(numel):
    order = run_ranks(WORLD, _gather_from_any, numel)[0]
    print(order)
    assert sorted(order) == sorted([1, 2] * MESSAGES)


def _collective_message_is_not_taken():
    """Rank 1 goes straight into a one-shot all-reduce (its message reaches rank 0 at once);
    rank 2 first sends rank 0 a message. Rank 0's receive must take rank 2's."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=30)) as comm:
        got = None
        if rank == 0:
            t = torch.empty(4)
            got = (comm.recv(t), t.tolist())
        elif rank == 2:
            time.sleep(0.3)  # rank 1's collective message arrives first
            comm.send(torch.full((4,), 2.0), 0)
        x = torch.full((4,), float(rank + 1))
        comm.all_reduce(x, algorithm="one_shot")
        return got, x.tolist()


def test_a_peers_collective_message_is_not_received():
    results = run_ranks(WORLD, _collective_message_is_not_taken)
    assert results[0][0] == (2, [2.0] * 4)
    assert all(r[1] == [6.0] * 4 for r in results)  # 1 + 2 + 3


def _dead_peer():
    """Rank 2 dies; rank 0 receives rank 1's message from any source, then the next receive
    raises naming rank 2, then rank 0 and 1 go on talking, named and from any source."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    comm = dk.Communicator(timeout=datetime.timedelta(seconds=30))
    if rank == 2:
        # dies once rank 1's message to rank 0 is in place: a receive from any source that
        # found a dead peer before the live one had sent would rightly raise at once
        comm.recv(torch.empty(1), 1)
        os._exit(0)
    if rank == 1:
        comm.send(torch.ones(2), 0)
        comm.send(torch.ones(1), 2)
        comm.recv(torch.empty(2), 0)  # rank 0 carries on with us
        comm.send(torch.ones(2), 0)
        comm.close()
        return None
    first = comm.recv(torch.empty(2))
    with pytest.raises(dk.CommError, match="peer rank 2 died") as raised:
        comm.recv(torch.empty(2))
    dead = comm.dead_peers()
    with pytest.raises(dk.CommError, match="peer rank 2 died"):
        comm.recv(torch.empty(2), 2)  # named: fails alone too
    comm.send(torch.zeros(2), 1)
    last = comm.recv(torch.empty(2))
    comm.close()
    return first, str(raised.value), dead, last


def test_a_dead_peer_fails_the_receive_alone():
    results = run_ranks(WORLD, _dead_peer, expect_death=True, timeout=120)
    assert isinstance(results[2], RankDied), results
    first, message, dead, last = results[0]
    assert (first, dead, last) == (1, [2], 1), results[0]
    assert message.startswith("[rank 0] recv:"), message
    assert shm_leaks() == []


def _closed_peers():
    """Rank 2 closes without sending: rank 0 still hears rank 1; once rank 1 closes too, a
    receive from any source has nobody left and says so (not at the timeout)."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    comm = dk.Communicator(timeout=datetime.timedelta(seconds=30))
    if rank != 0:
        if rank == 1:
            time.sleep(0.3)  # rank 2 has closed by then
            comm.send(torch.ones(2), 0)
        comm.close()
        return None
    source = comm.recv(torch.empty(2))
    start = time.monotonic()
    with pytest.raises(dk.CommError, match="none is left") as raised:
        comm.recv(torch.empty(2))
    comm.close()
    return source, str(raised.value), time.monotonic() - start


def test_closed_peers_are_skipped_and_none_left_is_an_error():
    source, message, seconds = run_ranks(WORLD, _closed_peers)[0]
    print(message, f"{seconds:.2f} s")
    assert source == 1 and "from any rank" in message, message


def _everyone_in_a_collective():
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        try:
            if rank == 0:
                comm.recv(torch.empty(2))
            else:
                comm.all_reduce(torch.ones(2))
        except dk.CommError as e:
            return str(e)
        return "no error"


def test_everyone_else_in_a_collective_is_a_disagreement():
    results = run_ranks(WORLD, _everyone_in_a_collective, timeout=50)  # far below 60 s
    print(results[0])
    assert (
        "ranks disagree" in results[0]
        and "every other rank has started a collective" in (results[0])
    ), results[0]
    assert all(r != "no error" for r in results), results


def _set_timeout():
    """Made with 60 s; set_timeout(1 s): the next receive nobody answers times out after 1 s."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        comm.set_timeout(datetime.timedelta(seconds=1))
        with pytest.raises(ValueError, match="positive"):
            comm.set_timeout(datetime.timedelta(0))
        if rank == 0:
            with pytest.raises(dk.CommError) as raised:
                comm.recv(torch.empty(2))
            return str(raised.value)
        time.sleep(2.5)  # past rank 0's new timeout, alive
        return None


def test_set_timeout_applies_to_the_next_call_with_torch_wording():
    message = run_ranks(WORLD, _set_timeout)[0]
    assert "Timed out after 1.0 s waiting for a message from any rank" in message, message
