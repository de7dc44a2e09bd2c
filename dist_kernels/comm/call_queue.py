"""Calls run one at a time, in issue order, on the caller's thread or on a worker of their own.

The hierarchical backend composes each collective from several engines (shared memory on the
host, Gloo or MPI between hosts), so it keeps its own order: every rank must start the host
and inter-host steps of its collectives in the same sequence. ``call(fn, async_op=True)``
queues ``fn`` for the worker thread and returns a :class:`Pending`; a synchronous call waits
until nothing is queued or running and then runs on the caller's thread (no thread handoff on
the latency path of back-to-back small calls). A queued ``fn`` may return a handle (a started
point-to-point transfer): the Pending then completes when that handle does, so a posted
receive never holds up the calls queued after it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Optional, Tuple

from ..errors import CommError


class Pending:
    """The handle of a queued call (what :class:`~dist_kernels.comm.work.Work` wraps)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._ran = threading.Event()
        self._error: Optional[BaseException] = None
        self._inner: Any = None

    def _finish(self, inner: Any = None, error: Optional[BaseException] = None) -> None:
        self._inner, self._error = inner, error
        self._ran.set()

    def wait(self, timeout: Optional[float] = None) -> None:
        start = time.monotonic()
        if not self._ran.wait(timeout):
            raise CommError(f"{self.what}: not finished after {timeout:.1f} s (Work.wait timeout)")
        if self._error is not None:
            raise self._error
        if self._inner is not None:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            self._inner.wait(left)

    def is_completed(self) -> bool:
        if not self._ran.is_set():
            return False
        return self._error is not None or self._inner is None or self._inner.is_completed()


class CallQueue:
    """Runs calls in issue order; see the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cv = threading.Condition()
        self._queue: Deque[Tuple[Callable[[], Any], Pending]] = collections.deque()
        self._running = False
        self._closed = False
        self._worker: Optional[threading.Thread] = None

    def call(self, fn: Callable[[], Any], what: str, async_op: bool) -> Optional[Pending]:
        """Runs ``fn`` after every call issued before it; returns a Pending if ``async_op``."""
        if async_op:
            return self._submit(fn, what)
        with self._cv:
            while self._queue or self._running:
                self._cv.wait()
            self._running = True
        try:
            inner = fn()
        finally:
            with self._cv:
                self._running = False
                self._cv.notify_all()
        if inner is not None:  # a point-to-point transfer: synchronous means finished
            inner.wait(None)
        return None

    def _submit(self, fn: Callable[[], Any], what: str) -> Pending:
        pending = Pending(what)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{what}: the communicator is closed")
            self._queue.append((fn, pending))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._worker.start()
            self._cv.notify_all()
        return pending

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._running or not self._queue):
                    self._cv.wait()
                if not self._queue:  # closed and drained
                    return
                fn, pending = self._queue.popleft()
                self._running = True
            try:
                pending._finish(inner=fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                pending._finish(error=e)
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()

    def drain(self) -> None:
        """Waits until every queued call has run."""
        with self._cv:
            while self._queue or self._running:
                self._cv.wait()

    def close(self, wait: bool = True) -> None:
        """Lets queued calls finish, then stops the worker. ``wait`` False: returns at once
        (a failed communicator: its queued calls fail as they come up, and one blocked in an
        engine ends at the engine's timeout, which an exiting process must not wait for)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            worker = self._worker
        if wait and worker is not None and worker is not threading.current_thread():
            worker.join()
