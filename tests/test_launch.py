"""dist_kernels.launch: two launchers at once whose ranks never meet, and a failure that ends a
call. (The test pools of tests/mp_pool.py are LocalRanks too: test_mp_pool.py; the one-shot
``launch.run`` starts the ranks of ``python -m dist_kernels.bench``: test_bench.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dist_kernels import launch


def _identity():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def _one_raises_the_other_waits():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # never completes: rank 1 is gone from the group's calls
    return "unreachable"


def _sum_on_a_communicator(base: int):
    """An all-reduce of ``base + rank`` on a new dist_kernels Communicator of the world group."""
    import torch.distributed as dist

    import dist_kernels as dk

    with dk.Communicator() as comm:
        t = torch.full((4,), float(base + dist.get_rank()))
        for _ in range(50):  # a while, so that both launchers' ranks run at the same time
            u = t.clone()
            comm.all_reduce(u)
        return u[0].item()


def test_two_launchers_at_once_keep_their_ranks_apart_and_a_failure_ends_a_call():
    """Two launchers, each its own store and prefix, rendezvous and all-reduce at the same time:
    each group's sum holds only its own ranks' values (2 ranks of base 1, 2 of base 1000). Then
    a rank that raises while its peer waits ends the call: the peer is killed after the grace."""
    groups = [launch.LocalRanks(2, threads=1), launch.LocalRanks(2, threads=1)]
    results = {}
    try:
        assert groups[0].run(_identity) == [(0, 2, 1), (1, 2, 1)]

        def call(index, base):
            results[index] = groups[index].run(_sum_on_a_communicator, (base,), timeout=120)

        threads = [threading.Thread(target=call, args=(i, b)) for i, b in ((0, 1), (1, 1000))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == {0: [3.0, 3.0], 1: [2001.0, 2001.0]}, results
        start = time.monotonic()
        outcomes = groups[1].run(_one_raises_the_other_waits, grace=2.0, timeout=120)
        elapsed = time.monotonic() - start
    finally:
        for group in groups:
            group.close()
    assert isinstance(outcomes[0], launch.RankDied), outcomes  # killed after the grace period
    assert isinstance(outcomes[1], launch.RankError) and "boom on rank 1" in outcomes[1].traceback
    assert groups[1].broken and elapsed < 60, f"not killed after its grace: {elapsed:.0f} s"


def test_failures_read_as_one_error():
    error = launch.RanksError([launch.RankError(1, "Traceback ...\nValueError: boom"),
                               launch.RankDied(0, -9)])  # fmt: skip
    assert str(error) == (
        "ranks failed:\nrank 1 raised:\nTraceback ...\nValueError: boom\n"
        "rank 0 ended with exit code -9"
    )


def test_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        launch.LocalRanks(0)
