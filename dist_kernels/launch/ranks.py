"""Local ranks: spawned processes, each a rank of one torch.distributed group, that run the calls
their launcher sends them.

    with LocalRanks(2) as ranks:               # 2 processes, a gloo group among them
        outcomes = ranks.run(fn, (1000, 7))    # fn(1000, 7) on every rank; outcomes in rank order
    results = run(2, fn, 1000, 7)              # once, on fresh ranks; RanksError if one failed

An outcome is what the rank's call returned, a :class:`RankError` (it raised) or a
:class:`RankDied` (its process ended). ``fn`` must be importable by name (module level) and its
arguments and results picklable. The ranks meet through this process's
:class:`~dist_kernels.launch.rendezvous.LocalStore`, so ranks of two launchers (two test runs, a
test run and a benchmark) cannot meet.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from .rendezvous import LocalStore, RankAddress

#: A call's environment variable: one value for every rank, or one per rank.
EnvValue = Union[str, Sequence[str]]
_STOP = b""  # the message that ends a rank
_SPAWN = mp.get_context("spawn")


@dataclass
class RankError:
    """Stands in the outcomes for a rank whose call raised."""

    rank: int
    traceback: str


@dataclass
class RankDied:
    """Stands in the outcomes for a rank whose process ended during the call."""

    rank: int
    exitcode: Optional[int]


class RanksError(RuntimeError):
    """Ranks of :func:`run` raised or died; ``failures`` holds their outcomes."""

    def __init__(self, failures: Sequence[Union[RankError, RankDied]]) -> None:
        self.failures = list(failures)
        super().__init__("ranks failed:\n" + "\n".join(_describe(f) for f in self.failures))


def _describe(failure: Union[RankError, RankDied]) -> str:
    if isinstance(failure, RankError):
        return f"rank {failure.rank} raised:\n{failure.traceback}"
    return f"rank {failure.rank} ended with exit code {failure.exitcode}"


# -- in the rank ------------------------------------------------------------------------------


def _apply_env(env: Mapping[str, EnvValue], rank: int) -> Dict[str, Optional[str]]:
    saved = {}
    for key, value in env.items():
        saved[key] = os.environ.get(key)
        os.environ[key] = value if isinstance(value, str) else str(value[rank])
    return saved


def _restore_env(saved: Mapping[str, Optional[str]]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _send(conn: mpc.Connection, status: str, value: Any) -> None:
    try:
        payload = ForkingPickler.dumps((status, value))
    except Exception:  # noqa: BLE001 - an unpicklable result is the call's error
        payload = ForkingPickler.dumps(("err", traceback.format_exc()))
    conn.send_bytes(payload)


def _call(rank: int, message: bytes) -> tuple:
    """Runs one call sent by the launcher; ``(status, value)``."""
    try:
        fn, args, kwargs, env = ForkingPickler.loads(message)
    except BaseException:  # noqa: BLE001 - e.g. fn's module cannot be imported here
        return "err", traceback.format_exc()
    saved = _apply_env(env, rank)
    try:
        return "ok", fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - everything goes back to the launcher
        return "err", traceback.format_exc()
    finally:
        _restore_env(saved)


def _join(rank: int, address: RankAddress, backend: str, threads: Optional[int]) -> None:
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # also sizes dist_kernels' kernel pool
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    address.init_process_group(rank, backend)


def _rank_main(
    rank: int,
    address: RankAddress,
    conn: mpc.Connection,
    env: Mapping[str, str],
    threads: Optional[int],
    backend: str,
) -> None:
    """A rank's life: join the group, then run calls until the launcher stops it or goes."""
    # Ctrl-C as Python takes it (KeyboardInterrupt), even when the launcher was started with
    # SIGINT ignored (a background job of a shell without job control) and passed that on:
    # the tests interrupt blocked ranks on purpose.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(env)
    try:
        _join(rank, address, backend, threads)
    except BaseException:  # noqa: BLE001 - the launcher reports it
        _send(conn, "err", traceback.format_exc())
        return
    _send(conn, "ok", "ready")
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:  # the launcher is gone
                break
            if message == _STOP:
                break
            _send(conn, *_call(rank, message))
    finally:
        _leave_group()


def _leave_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - peers may be gone already
        pass


# -- in the launcher --------------------------------------------------------------------------

_OPEN: weakref.WeakSet[LocalRanks] = weakref.WeakSet()


class LocalRanks:
    """``world_size`` spawned processes with a torch.distributed group among them.

    Args:
        world_size: ranks, one process each.
        backend: of the group (``torch.distributed.init_process_group``).
        group_timeout: seconds, the store's and the group's timeout.
        start_timeout: seconds the ranks may take to start and join (importing torch costs each
            about 3 s on a loaded machine).
        env: environment variables set in every rank before it joins the group.
        threads: torch threads per rank (and ``OMP_NUM_THREADS``, as torchrun sets it); None
            leaves both as inherited.
        name: the processes' names, formatted with ``rank`` and ``world_size``.

    A rank takes SIGINT as Python does (KeyboardInterrupt, in the call it interrupts).
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        group_timeout: float = 120.0,
        start_timeout: float = 180.0,
        env: Optional[Mapping[str, str]] = None,
        threads: Optional[int] = None,
        name: str = "dk-rank{rank}-of-{world_size}",
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalRanks: world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.broken = False
        self._store = LocalStore()
        self._procs: List[Any] = []
        self._conns: List[mpc.Connection] = []
        address = self._store.address(world_size, group_timeout)
        try:
            for rank in range(world_size):
                self._start(rank, address, dict(env or {}), threads, backend, name)
            self._started(self._collect(start_timeout, None, "start-up"))
        except BaseException:
            self.close(kill=True)
            raise
        _OPEN.add(self)

    def _start(self, rank, address, env, threads, backend, name) -> None:
        parent, child = _SPAWN.Pipe()
        proc = _SPAWN.Process(
            target=_rank_main,
            args=(rank, address, child, env, threads, backend),
            name=name.format(rank=rank, world_size=self.world_size),
        )
        proc.start()
        child.close()
        self._procs.append(proc)
        self._conns.append(parent)

    def _started(self, outcomes: List[Any]) -> None:
        failed = [o for o in outcomes if isinstance(o, (RankError, RankDied))]
        if failed:
            raise RuntimeError(
                f"LocalRanks: {len(failed)} of {self.world_size} ranks did not start:\n"
                + "\n".join(_describe(f) for f in failed)
            )

    def run(
        self,
        fn: Callable,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        *,
        env: Optional[Mapping[str, EnvValue]] = None,
        timeout: Optional[float] = None,
        grace: Optional[float] = None,
    ) -> List[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; the outcomes in rank order.

        Args:
            env: environment variables set around the call on every rank; a sequence value
                gives one value per rank (e.g. ``{"DK_HOST_ID": ["a", "a", "b", "b"]}``).
            timeout: seconds for the whole call (None: no limit); past it every rank is
                killed and ``TimeoutError`` names the ranks still running.
            grace: once a rank has failed, seconds the others get to finish (None: until
                ``timeout``); those still running then are killed (:class:`RankDied`).

        A call interrupted here (Ctrl-C, pytest-timeout) kills the ranks: their late results
        would otherwise answer the next call. After a rank died or was killed, :attr:`broken`
        is set and the object only closes.
        """
        if self.broken:
            raise RuntimeError("LocalRanks: a rank died or was killed, or they were closed")
        call = (fn, tuple(args), dict(kwargs or {}), dict(env or {}))
        messages = [ForkingPickler.dumps(call) for _ in self._conns]  # tensors pass once each
        try:
            for conn, message in zip(self._conns, messages):
                conn.send_bytes(message)
            return self._collect(timeout, grace, getattr(fn, "__name__", str(fn)))
        except BaseException:
            self.close(kill=True)
            raise

    def _collect(self, timeout: Optional[float], grace: Optional[float], what: str) -> List[Any]:
        outcomes: List[Any] = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        graced = math.inf  # when the ranks still running after a failure are killed
        while pending:
            now = time.monotonic()
            if now >= graced:
                self.close(kill=True)
                for rank in pending:
                    outcomes[rank] = RankDied(rank, self._procs[rank].exitcode)
                break
            if now >= deadline:
                self.close(kill=True)
                raise TimeoutError(
                    f"{what}: ranks {sorted(pending)} of {self.world_size} did not finish "
                    f"within {timeout:.0f} s (ranks killed)"
                )
            wait = min(deadline, graced) - now
            ready = mpc.wait(list(pending.values()), timeout=None if wait == math.inf else wait)
            for rank in [r for r, c in pending.items() if c in ready]:
                outcomes[rank] = self._receive(rank)
                del pending[rank]
                if grace is not None and isinstance(outcomes[rank], (RankError, RankDied)):
                    graced = min(graced, time.monotonic() + grace)
        return outcomes

    def _receive(self, rank: int) -> Any:
        try:
            status, value = ForkingPickler.loads(self._conns[rank].recv_bytes())
        except (EOFError, ConnectionError, OSError):
            self._procs[rank].join(timeout=5)
            self.broken = True
            return RankDied(rank, self._procs[rank].exitcode)
        return RankError(rank, value) if status == "err" else value

    def close(self, kill: bool = False) -> None:
        """Stops every rank (``kill``: at once, else each leaves its group first); idempotent."""
        self.broken = True
        if not kill:
            for conn in self._conns:
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._store.close()
        _OPEN.discard(self)

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(kill=exc_type is not None)


def run(
    world_size: int,
    fn: Callable,
    *args: Any,
    timeout: Optional[float] = None,
    grace: Optional[float] = 60.0,
    **options: Any,
) -> List[Any]:
    """``fn(*args)`` once on ``world_size`` fresh local ranks; their results in rank order.

    ``options`` go to :class:`LocalRanks` (``backend``, ``group_timeout``, ``env``, ``threads``,
    ``name``). Raises :class:`RanksError` when a rank raised or died: the others get ``grace``
    seconds to finish (they usually fail too, waiting for the lost one), then are killed.
    """
    with LocalRanks(world_size, **options) as ranks:
        outcomes = ranks.run(fn, args, timeout=timeout, grace=grace)
    failures = [o for o in outcomes if isinstance(o, (RankError, RankDied))]
    if failures:
        raise RanksError(failures)
    return outcomes


@atexit.register
def _close_open_ranks() -> None:
    """Registered after multiprocessing's exit handler (imported above), so it runs first:
    that one joins live children, which would be waiting for a message from this process."""
    for ranks in list(_OPEN):
        ranks.close()
