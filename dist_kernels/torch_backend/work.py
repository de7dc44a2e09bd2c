"""torch.distributed Work objects for the "dk" backend.

A :class:`DkWork` wraps the handles of one torch-level call (several of ours for the list and
point-to-point forms), the copy-outs to run once they complete (list outputs, non-contiguous
tensors) and the tensors its future carries. ``get_future()`` (which torch DDP waits on) is
completed by one watcher thread per process group, started the first time a future is asked
for an unfinished call.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CommError


def to_dist_error(e: CommError) -> dist.DistBackendError:
    """Our CommError as the exception torch.distributed users catch (message kept)."""
    err = dist.DistBackendError(str(e))
    err.__cause__ = e
    return err


def _seconds(timeout: Any) -> Optional[float]:
    """torch's timeout forms: a timedelta (0 = none, torch's kNoTimeout), seconds, or None."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return None if seconds <= 0 else float(seconds)


class DkWork(dist.Work):
    """One call on a "dk" process group.

    Args:
        handles: our Work handles (None entries: parts that already ran synchronously).
        result: the tensors ``get_future().value()`` and ``result()`` return.
        finish: copy-outs that make ``result`` valid, run once after every handle completed.
        completions: the group's watcher that completes futures.
        source: for a receive from any source, what names the sender once it completed.
    """

    def __init__(
        self,
        handles: Sequence[Any],
        result: List[torch.Tensor],
        finish: Optional[Callable[[], None]],
        completions: Completions,
        source: Optional[Callable[[], int]] = None,
    ) -> None:
        super().__init__()
        self._source = source
        self._handles = [h for h in handles if h is not None]
        self._result = result
        self._finish = finish
        self._completions = completions
        self._future: Optional[torch.futures.Future] = None
        self._done = not self._handles and finish is None  # a synchronous call: nothing left
        if not self._handles and finish is not None:
            self._complete()

    @classmethod
    def done(cls, result: List[torch.Tensor], completions: Completions) -> DkWork:
        """A call that already ran on the caller's thread (the hot path: no checks to make)."""
        work = cls.__new__(cls)
        dist.Work.__init__(work)
        work._handles, work._result, work._finish = (), result, None
        work._completions, work._future, work._done = completions, None, True
        work._source = None
        return work

    def source_rank(self) -> int:
        """The sender of a receive from any source (``dist.recv(t)`` without ``src`` returns
        it); waits for the receive first."""
        if self._source is None:
            raise ValueError(
                "source_rank() may only be called on the Work of a receive from any source"
            )
        self.wait()
        return self._source()

    _source_rank = source_rank

    def _complete(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._handles = []
        self._done = True

    def wait(self, timeout: Any = None) -> bool:
        """Blocks until done; raises DistBackendError (our CommError's message) on failure or
        when ``timeout`` passes first (the call itself keeps running)."""
        if self._done:
            return True
        seconds = _seconds(timeout)
        try:
            for handle in self._handles:  # without a lock: our handles may be waited by many
                handle.wait(seconds)
        except CommError as e:
            raise to_dist_error(e) from e
        with self._completions.lock:
            if not self._done:
                self._complete()
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not all(h.is_completed() for h in self._handles):
            return False
        try:
            self.wait()
        except dist.DistBackendError:
            pass  # completed, with an error that wait() reports
        return True

    def is_success(self) -> bool:
        if not self.is_completed():
            return False
        try:
            self.wait()
        except dist.DistBackendError:
            return False
        return True

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        with self._completions.lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    self._future.set_result(self._result)
                else:
                    self._completions.watch(self)
        return self._future


class Completions:
    """Completes the futures of unfinished calls, in issue order, on one daemon thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Optional[DkWork]] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        # Guards every DkWork of the group: its copy-outs run once, its future is made once.
        self.lock = threading.Lock()

    def watch(self, work: DkWork) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dk-torch-futures", daemon=True
                )
                self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            future = work._future
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - the future carries it to its waiter
                future.set_exception(e)
                continue
            future.set_result(work._result)

    def close(self) -> None:
        """Stops the thread once the calls it watches have finished (or failed)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
