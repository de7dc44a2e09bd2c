"""Shared pools of worker processes for multi-rank tests.

Importing torch costs each spawned rank about 3 s, so the tests share one pool of ranks per
world size instead of spawning per test. Every worker has ``torch.distributed`` initialised
(gloo, through a TCPStore that this process hosts) and runs with one torch thread. The pools
are :class:`dist_kernels.launch.LocalRanks`: their ranks meet only each other, never the ranks
of another test run on the same machine.

    from mp_pool import run_ranks

    def _check_sum(count, seed):              # module level, so the workers can import it
        ...                                   # runs on every rank; dist.get_rank() tells which
        return value                          # picklable

    def test_sum():
        results = run_ranks(4, _check_sum, 1000, 7)  # fn's arguments one by one, not a tuple
        # results: the per-rank return values, in rank order

A rank that raises makes ``run_ranks`` raise :class:`RanksFailed` with every failing rank's
traceback. A rank that dies (a test may SIGKILL it on purpose, with ``expect_death=True``) comes
back as a :class:`RankDied` entry, and its pool is rebuilt for the next call. A call that runs
past ``timeout`` kills its pool and raises ``TimeoutError`` naming the ranks still running.

Shared memory: this run's segments carry a tag of their own (``DK_SHM_TAG``, set here for this
process and everything it starts), and :func:`shm_leaks` lists only those, so a leak check does
not see the segments of another run on the same machine.
"""

from __future__ import annotations

import atexit
import collections
import os
import secrets
import sys
from typing import Any, Callable, Dict, List, Optional

from dist_kernels.launch import EnvValue, LocalRanks, RankDied, RankError

__all__ = ["RankDied", "RanksFailed", "run_ranks", "shm_leaks", "shutdown_pools", "EnvValue"]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # the workers import test modules by name (they inherit sys.path)
    sys.path.insert(0, TESTS_DIR)
MAX_LIVE_POOLS = 2  # idle ranks hold ~300 MB each: keep the two most recently used sizes
#: This run's shared-memory tag: its segments are named /dk-<tag>-<hex>.
SHM_TAG = f"t{secrets.token_hex(6)}"
os.environ["DK_SHM_TAG"] = SHM_TAG  # before any pool starts: the workers inherit it
_WORKER_ENV = {"DK_NUM_THREADS": "1"}


class RanksFailed(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


_POOLS: collections.OrderedDict[int, LocalRanks] = collections.OrderedDict()


def _new_pool(world_size: int) -> LocalRanks:
    return LocalRanks(
        world_size,
        group_timeout=120.0,
        start_timeout=180.0,
        env=_WORKER_ENV,
        threads=1,
        name="dk-test-rank{rank}-of-{world_size}",
    )


def _pool(world_size: int) -> LocalRanks:
    pool = _POOLS.pop(world_size, None)
    if pool is not None and pool.broken:
        pool.close(kill=True)
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_LIVE_POOLS:
            _, old = _POOLS.popitem(last=False)
            old.close()
        pool = _new_pool(world_size)
    _POOLS[world_size] = pool
    return pool


def run_ranks(
    world_size: int,
    fn: Callable,
    *args: Any,
    timeout: float = 120.0,
    env: Optional[Dict[str, EnvValue]] = None,
    expect_death: bool = False,
    **kwargs: Any,
) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on every rank of the shared pool of ``world_size`` ranks.

    Args:
        world_size: number of ranks (one process each).
        fn: a module-level function (the workers import it by name).
        timeout: seconds before the pool is killed and ``TimeoutError`` raised.
        env: environment variables set around the call on every rank; a sequence value gives
            one value per rank (e.g. ``{"DK_HOST_ID": ["a", "a", "b", "b"]}``).
        expect_death: allow ranks to die; they come back as :class:`RankDied`.

    Returns:
        The per-rank return values, in rank order.
    """
    pool = _pool(world_size)
    results = pool.run(fn, args, kwargs, env=dict(env or {}), timeout=timeout)
    failures = [f"rank {r.rank}:\n{r.traceback}" for r in results if isinstance(r, RankError)]
    died = [r for r in results if isinstance(r, RankDied)]
    if pool.broken:
        _POOLS.pop(world_size, None)
        pool.close(kill=True)
    if failures:
        raise RanksFailed("\n".join(failures))
    if died and not expect_death:
        raise RanksFailed(f"ranks died unexpectedly: {died}")
    return results


def shm_leaks(prefix: Optional[str] = None) -> List[str]:
    """Names of this run's shared-memory segments currently in /dev/shm (``prefix``: of the
    names to list instead, e.g. ``"dk-"`` for every run's)."""
    prefix = f"dk-{SHM_TAG}-" if prefix is None else prefix
    try:
        return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))
    except FileNotFoundError:
        return []


def shutdown_pools() -> None:
    """Stops every pool (registered with atexit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)
