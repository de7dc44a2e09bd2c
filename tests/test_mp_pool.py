"""The test harness itself: results in rank order, failures and deaths reported, env per rank."""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from mp_pool import RankDied, RanksFailed, run_ranks


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ.get("DK_TEST_VALUE")


def test_results_in_rank_order_with_per_rank_env():
    out = run_ranks(3, _rank_and_sum, env={"DK_TEST_VALUE": ["a", "b", "c"]})
    assert [r[0] for r in out] == [0, 1, 2]
    assert all(r[1] == 3 and r[2] == 6.0 for r in out)
    assert [r[3] for r in out] == ["a", "b", "c"]
    # the variable is restored (here: removed) on the workers after the call
    assert [r[3] for r in run_ranks(3, _rank_and_sum)] == [None, None, None]


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    return "fine"


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RanksFailed, match="boom on one"):
        run_ranks(2, _raise_on_rank_one)
    assert run_ranks(2, _rank_and_sum)[1][2] == 3.0  # the pool survives an exception


def _die_on_last():
    if dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "alive"


def test_a_dead_rank_is_reported_and_the_pool_rebuilt():
    out = run_ranks(2, _die_on_last, expect_death=True)
    assert out[0] == "alive" and isinstance(out[1], RankDied)
    assert run_ranks(2, _rank_and_sum)[0][2] == 3.0


def _sleep_then_mark(seconds):
    import time

    time.sleep(seconds)
    return "late"


def test_an_interrupted_call_leaves_no_late_results_behind():
    """pytest-timeout interrupts a test inside run_ranks (SIGALRM): the ranks' late results
    must not come back as the next call's."""

    class Interrupted(BaseException):  # as pytest-timeout's and Ctrl-C's are
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    run_ranks(2, _rank_and_sum)  # the pool is up: the interrupt lands inside the call
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Interrupted):
            run_ranks(2, _sleep_then_mark, 3.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert [r[0] for r in run_ranks(2, _rank_and_sum)] == [0, 1]  # fresh answers, not "late"
