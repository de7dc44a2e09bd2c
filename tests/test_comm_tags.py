"""Point-to-point tags: a receive takes the oldest message from its source sent with its tag,
as gloo and MPI match them (torch.distributed's ``tag``), whatever the order of the tags.

Every message's payload is made from (sender, tag, index within that tag), so the receiver
checks what it got against the message the matching rule names, independently of the code
under test: for one (sender, tag) pair messages arrive in the order they were sent. Schedules
are random (seed printed): tags, sizes from empty to several slots (registered and plain
tensors), and the order the receiver names the tags in; sends and receives on both sides,
synchronous and not. Also: receives from any source by tag; a message set aside while a
collective follows; a tag that matches with the wrong size; bad tags.
"""

from __future__ import annotations

import datetime
import os
import random
import threading
import time

import pytest
import torch
from mp_pool import run_ranks, shm_leaks

SLOT_ELEMS = 131_072  # float32 elements in one 512 KiB slot: sizes around it split in slices
SIZES = (0, 1, 7, 4096, SLOT_ELEMS - 1, SLOT_ELEMS + 5, 3 * SLOT_ELEMS)
TAGS = (0, 1, 2, 7, -3, 2**31 - 1)


def _payload(sender: int, tag: int, index: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1e6 * sender + 1e3 * (tag % 97) + index


def _schedule(seed: int, n: int):
    """The messages each sender sends (tag, numel) in order, and the order a receiver names
    them in: a random interleaving that keeps each tag's messages in their sending order."""
    rng = random.Random(seed)
    sends = [(rng.choice(TAGS), rng.choice(SIZES)) for _ in range(n)]
    by_tag = {}
    for i, (tag, _) in enumerate(sends):
        by_tag.setdefault(tag, []).append(i)
    order = []
    while by_tag:
        tag = rng.choice(sorted(by_tag))
        order.append(by_tag[tag].pop(0))
        if not by_tag[tag]:
            del by_tag[tag]
    return sends, order


def _index_within_tag(sends, i: int) -> int:
    return sum(1 for tag, _ in sends[:i] if tag == sends[i][0])


def _exchange(seed: int, n: int, registered: bool):
    """Both ranks send their schedule to the other (all asynchronous), then receive the
    other's in its random order, alternating recv and irecv; returns the mismatches."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    peer = 1 - rank
    mine, _ = _schedule(seed + rank, n)
    theirs, order = _schedule(seed + peer, n)
    wrong = []
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        # registered: every send from its own part of one registered buffer (collective, the
        # same size on both ranks), which the receiver reads in place
        total = max(sum(numel for _, numel in s) for s in (mine, theirs))
        buf = comm.empty(total) if registered else torch.empty(total)
        works, offset = [], 0
        for i, (tag, numel) in enumerate(mine):
            t = buf[offset : offset + numel]
            offset += numel
            t.copy_(_payload(rank, tag, _index_within_tag(mine, i), numel))
            works.append(comm.isend(t, peer, tag=tag))
        for k, i in enumerate(order):
            tag, numel = theirs[i]
            t = torch.empty(numel)
            if k % 2:
                comm.irecv(t, peer, tag=tag).wait()
            else:
                comm.recv(t, peer, tag=tag)
            want = _payload(peer, tag, _index_within_tag(theirs, i), numel)
            if not torch.equal(t, want):
                wrong.append((i, tag, numel))
        for w in works:
            w.wait()
        comm.barrier()
    return wrong


@pytest.mark.parametrize("registered", [False, True])
def test_receives_take_messages_by_tag_in_any_order(registered):
    seed = int(os.environ.get("DK_TAG_SEED", random.randrange(2**31)))
    print(f"tag schedule seed {seed} (rerun with DK_TAG_SEED={seed})")
    assert run_ranks(2, _exchange, seed, 24, registered, timeout=180) == [[], []]
    assert shm_leaks() == []


def _any_source_by_tag():
    """Ranks 1 and 2 each send tags 5, 6, 5 to rank 0; rank 0 receives from any source by
    tag: both 6s first, then the 5s. Each message names its sender and index in its payload."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    sent = [5, 6, 5]
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        if rank != 0:
            for i, tag in enumerate(sent):
                comm.send(_payload(rank, tag, i, 8), 0, tag=tag)
            comm.barrier()
            return None
        got = []
        for tag in (6, 6, 5, 5, 5, 5):
            t = torch.empty(8)
            source = comm.recv(t, tag=tag)
            # the sender's index of that message: 6 is its second; 5s its first, then third
            matches = [i for i in range(3) if torch.equal(t, _payload(source, tag, i, 8))]
            got.append((tag, source, matches))
        comm.barrier()
        return got


def test_receive_from_any_source_takes_the_first_message_with_its_tag():
    got = run_ranks(3, _any_source_by_tag, timeout=120)[0]
    print(got)
    assert [(tag, len(m)) for tag, _, m in got] == [(tag, 1) for tag in (6, 6, 5, 5, 5, 5)]
    assert sorted(s for tag, s, _ in got if tag == 6) == [1, 2]
    for source in (1, 2):  # each sender's 5s in the order it sent them
        assert [m[0] for tag, s, m in got if tag == 5 and s == source] == [0, 2]
        assert [m[0] for tag, s, m in got if tag == 6 and s == source] == [1]


def _set_aside_then_collective():
    """Rank 1 sends tags 1 then 2, then both ranks all-reduce; rank 0 receives tag 2 (tag 1 is
    set aside), all-reduces, then receives tag 1 from what it kept."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        got = {}
        if rank == 1:
            comm.send(torch.full((3,), 1.0), 0, tag=1)
            comm.send(torch.full((3,), 2.0), 0, tag=2)
        else:
            t = torch.empty(3)
            comm.recv(t, 1, tag=2)
            got[2] = t.tolist()
        total = torch.tensor([float(rank + 1)])
        comm.all_reduce(total)
        got["sum"] = total.item()
        if rank == 0:
            t = torch.empty(3)
            comm.recv(t, 1, tag=1)
            got[1] = t.tolist()
        return got


def test_a_message_set_aside_outlives_a_collective():
    got = run_ranks(2, _set_aside_then_collective, timeout=120)
    assert got[0] == {2: [2.0] * 3, "sum": 3.0, 1: [1.0] * 3}
    assert got[1] == {"sum": 3.0}


def _wrong_size_for_its_tag():
    """Rank 1 sends 4 floats with tag 3 then 5 floats with tag 4; rank 0 receives tag 4 (tag
    3 set aside), then asks for tag 3 with 6 floats: the sizes disagree."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=30)) as comm:
        if rank == 1:
            comm.send(torch.ones(4), 0, tag=3)
            comm.send(torch.ones(5), 0, tag=4)
            return None
        comm.recv(torch.empty(5), 1, tag=4)
        try:
            comm.recv(torch.empty(6), 1, tag=3)
        except dk.CommError as e:
            return str(e)
        return "no error"


def test_a_tag_matched_with_the_wrong_size_raises_naming_both_calls():
    message = run_ranks(2, _wrong_size_for_its_tag, timeout=120)[0]
    print(message)
    assert "ranks disagree" in message and "rank 1 sent" in message, message
    assert "count=4" in message and "count=6" in message and "tag=3" in message, message


def _bad_tags():
    import torch.distributed as dist

    import dist_kernels as dk

    errors = []
    with dk.Communicator(timeout=datetime.timedelta(seconds=30)) as comm:
        peer = 1 - dist.get_rank()
        for tag, kind in ((2**31, ValueError), (-(2**31) - 1, ValueError), ("1", TypeError)):
            for call in (comm.send, comm.recv, comm.isend, comm.irecv):
                try:
                    call(torch.ones(2), peer, tag=tag)
                    errors.append(f"{call.__name__}({tag!r}) passed")
                except kind as e:
                    if f"[rank {comm.rank}]" not in str(e) or "tag" not in str(e):
                        errors.append(str(e))
        comm.barrier()  # nothing was sent: the communicator is still in step
    return errors


def test_bad_tags_raise_before_anything_is_sent():
    assert run_ranks(2, _bad_tags, timeout=120) == [[], []]


def _tag_never_sent(kind: str):
    """Rank 1 sends tag 1 and then dies (``died``) or closes (``closed``); rank 0 waits for
    tag 2 from it by name: that raises well before the 30 s timeout. A dead peer fails the
    call alone, so the tag-1 message, set aside meanwhile, is still received; a peer that
    closed while a call needed it fails the communicator (as without tags), and the later
    receive says so. Last, a receive of tag 2 from any source: nobody is left to send it."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    comm = dk.Communicator(timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        comm.send(torch.full((3,), 1.0), 0, tag=1)
        comm.recv(torch.empty(1), 0)  # rank 0 has taken the message aside by then
        if kind == "died":
            os._exit(0)
        comm.close()
        return None
    start = time.monotonic()
    messages = []

    def receive(t, src, tag):
        try:
            comm.recv(t, src, tag=tag)
            messages.append(t.tolist())
        except dk.CommError as e:
            messages.append(str(e))

    waiter = threading.Thread(target=lambda: (time.sleep(0.5), comm.send(torch.ones(1), 1)))
    waiter.start()  # rank 1 goes once this rank is inside the receive for tag 2
    receive(torch.empty(3), 1, 2)
    waiter.join()
    receive(torch.empty(3), 1, 1)
    receive(torch.empty(3), None, 2)
    comm.close()
    return messages, time.monotonic() - start


@pytest.mark.parametrize("kind", ["died", "closed"])
def test_a_tag_its_peer_never_sends_raises_and_what_was_set_aside_stays(kind):
    results = run_ranks(2, _tag_never_sent, kind, expect_death=kind == "died", timeout=120)
    (named, kept, anyone), seconds = results[0]
    print(named, kept, anyone, seconds)
    assert named.startswith("[rank 0] recv:") and anyone.startswith("[rank 0] recv:")
    if kind == "died":
        assert "peer rank 1 died" in named and kept == [1.0] * 3, (named, kept)
        assert "none is left" in anyone and "tag=2" in anyone, anyone
    else:
        assert "peer rank 1 closed" in named and "failed earlier" in kept, (named, kept)
    assert seconds < 20, seconds
    assert shm_leaks() == []
