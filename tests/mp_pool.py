"""Shared pools of worker processes for multi-rank tests.

Importing torch costs each spawned rank about 3 s, so the tests share one pool of ranks per
world size instead of spawning per test. Every worker has ``torch.distributed`` initialised
(gloo, through a TCPStore that this process hosts) and runs with one torch thread.

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
"""

from __future__ import annotations

import atexit
import collections
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MAX_LIVE_POOLS = 2  # idle ranks hold ~300 MB each: keep the two most recently used sizes
EnvValue = Union[str, Sequence[str]]


@dataclass
class RankDied:
    """Stands in a result list for a rank whose process ended during the call."""

    rank: int
    exitcode: Optional[int]


class RanksFailed(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def _apply_env(env: Dict[str, EnvValue], rank: int) -> Dict[str, Optional[str]]:
    saved = {}
    for key, value in env.items():
        saved[key] = os.environ.get(key)
        os.environ[key] = value if isinstance(value, str) else str(value[rank])
    return saved


def _restore_env(saved: Dict[str, Optional[str]]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _worker_main(rank: int, world_size: int, port: int, conn: mpc.Connection) -> None:
    sys.path.insert(0, TESTS_DIR)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["DK_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    conn.send(("ready", rank))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs, env = message
        saved = _apply_env(env, rank)
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            conn.send(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        finally:
            _restore_env(saved)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - peers may be gone already
        pass


class _Pool:
    """``world_size`` worker processes with a gloo process group among them."""

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.broken = False
        # This process hosts the store, so the port comes from the kernel: no port races.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        self.procs: List[Any] = []
        self.conns: List[mpc.Connection] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, self._store.port, child),
                name=f"dk-test-rank{rank}-of-{world_size}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._collect(timeout=180.0, what="start-up")

    def run(
        self, fn: Callable, args: tuple, kwargs: dict, env: Dict[str, EnvValue], timeout: float
    ) -> List[Any]:
        for conn in self.conns:
            conn.send((fn, args, kwargs, env))
        try:
            return self._collect(timeout, what=getattr(fn, "__name__", str(fn)))
        except BaseException:
            # Interrupted while ranks still run (pytest-timeout, Ctrl-C): their late results
            # would be read as the next call's, so this pool is done.
            self.close(kill=True)
            raise

    def _collect(self, timeout: float, what: str) -> List[Any]:
        results: List[Any] = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close(kill=True)
                raise TimeoutError(
                    f"{what}: ranks {sorted(pending)} of {self.world_size} did not finish "
                    f"within {timeout:.0f} s (pool killed)"
                )
            ready = mpc.wait(list(pending.values()), timeout=remaining)
            for rank in [r for r, c in pending.items() if c in ready]:
                results[rank] = self._receive(rank)
                del pending[rank]
        return results

    def _receive(self, rank: int) -> Any:
        try:
            status, value = self.conns[rank].recv()
        except (EOFError, ConnectionError, OSError):
            self.procs[rank].join(timeout=5)
            self.broken = True
            return RankDied(rank, self.procs[rank].exitcode)
        if status == "err":
            return _Failure(value)
        return value

    def close(self, kill: bool = False) -> None:
        self.broken = True
        for conn in self.conns:
            if not kill:
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
        for proc in self.procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


@dataclass
class _Failure:
    traceback: str


_POOLS: collections.OrderedDict[int, _Pool] = collections.OrderedDict()


def _pool(world_size: int) -> _Pool:
    pool = _POOLS.pop(world_size, None)
    if pool is not None and pool.broken:
        pool.close(kill=True)
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_LIVE_POOLS:
            _, old = _POOLS.popitem(last=False)
            old.close()
        pool = _Pool(world_size)
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
    results = pool.run(fn, args, kwargs, dict(env or {}), timeout)
    failures = [r.traceback for r in results if isinstance(r, _Failure)]
    died = [r for r in results if isinstance(r, RankDied)]
    if pool.broken:
        _POOLS.pop(world_size, None)
        pool.close(kill=True)
    if failures:
        raise RanksFailed("\n".join(failures))
    if died and not expect_death:
        raise RanksFailed(f"ranks died unexpectedly: {died}")
    return results


def shm_leaks(prefix: str = "dk-") -> List[str]:
    """Names of this package's shared-memory segments currently in /dev/shm."""
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
