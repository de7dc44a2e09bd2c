"""torch.distributed Work objects for the "dk" backend.

A :class:`DkWork` wraps the handles of one torch-level call (several of ours for the list and
point-to-point forms), the copy-outs to run once they complete (list outputs, non-contiguous
tensors) and the tensors its future carries. ``get_future()`` (which torch DDP waits on) is
completed by the process group's watcher threads (:class:`Completions`), started the first
time a future is asked for an unfinished call.

CUDA tensors, as ProcessGroupNCCL does it: ``wait()`` makes the caller's current stream wait
for the collective (and the copy-outs), without blocking the host; the future carries the CUDA
devices of its tensors (``torch.futures.Future(devices=...)``) and is completed only once the
GPU work is done, its events recorded after the collective and the copy-outs, so ``then()``
callbacks (DDP comm hooks) and ``Future.wait()`` on any stream are ordered after it.
"""

from __future__ import annotations

import datetime
import queue
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import CommError
from .dynamo import skip_module


def to_dist_error(e: CommError) -> dist.DistBackendError:
    """Our CommError as the exception torch.distributed users catch (message kept)."""
    err = dist.DistBackendError(str(e))
    err.__cause__ = e
    return err


#: The watcher's host wait for CUDA work when the group has no timeout: as long as it takes.
_NO_TIMEOUT = datetime.timedelta(days=365)


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
        self.device = _cuda_device(self._handles)  # where the work runs (None: the CPU)
        self._ready: Optional[Any] = None  # CUDA: an event after the copy-outs
        self._done = not self._handles and finish is None  # a synchronous call: nothing left
        if not self._handles and finish is not None:
            self._complete()

    # A call that already ran (:meth:`done`) sets only its result and watcher: every other
    # attribute reads these class-level values until the instance sets its own (each
    # instance attribute set costs ~0.07 us, and the hot path makes one Work per call).
    _handles: Sequence[Any] = ()
    _finish: Optional[Callable[[], None]] = None
    _future: Optional[torch.futures.Future] = None
    _done = True
    _source: Optional[Callable[[], int]] = None
    device: Optional[Any] = None
    _ready: Optional[Any] = None

    @classmethod
    def done(cls, result: List[torch.Tensor], completions: Completions) -> DkWork:
        """A call that already ran on the caller's thread (the hot path: no checks to make)."""
        work = cls.__new__(cls)
        dist.Work.__init__(work)
        work._result, work._completions = result, completions
        return work

    @classmethod
    def reusable(cls, completions: Completions) -> DkWork:
        """The finished Work a group's synchronous hot paths return, one per group: building
        a torch Work costs ~1.5 us (pybind's base __init__), as much as an 8-byte all-reduce.
        Each call sets its tensors as the result (:meth:`SyncDone.finished`); ``wait()`` and
        ``is_completed()`` are True at once and ``get_future()`` gives a fresh finished future
        per call. torch's synchronous API waits on the Work and drops it; two threads calling
        the same group at once share it, and ``result()`` then names the later call's tensors."""
        work = SyncDone.__new__(SyncDone)
        dist.Work.__init__(work)
        work._result, work._completions = [], completions
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
        """Runs the copy-outs (on CUDA: on the current stream, which waited for the handles),
        once."""
        if self._finish is not None:
            self._finish()
            self._finish = None
        if self.device is not None:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.device))
        self._handles = []
        self._done = True

    def _order_current_stream(self) -> None:
        """CUDA: the caller's current stream continues after the copy-outs, wherever they ran."""
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)

    def wait(self, timeout: Any = None) -> bool:
        """Blocks until done (CUDA: the current stream waits, the host only with ``timeout``);
        raises DistBackendError (our CommError's message) on failure or when ``timeout`` passes
        first (the call itself keeps running)."""
        if self._done:
            if self._ready is not None:
                self._order_current_stream()
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
        self._order_current_stream()
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
                # A synchronous CUDA call is already ordered on the caller's stream: its future
                # records its events there.
                self._future = torch.futures.Future(devices=_cuda_devices(self._result))
                if self._done:
                    self._future.set_result(self._result)
                else:
                    self._completions.watch(self)
        return self._future


class SyncDone(DkWork):
    """:meth:`DkWork.reusable`: a synchronous call that already ran, reused call after call."""

    def finished(self, result: List[torch.Tensor]) -> SyncDone:
        self._result = result
        return self

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future(devices=_cuda_devices(self._result))
        future.set_result(self._result)
        return future


def _cuda_device(handles: Sequence[Any]) -> Optional[torch.device]:
    """The CUDA device the handles run on (our Work and DkWork say), or None."""
    devices = {getattr(h, "device", None) for h in handles} - {None}
    return next(iter(devices)) if len(devices) == 1 else None


def _cuda_devices(tensors: Any) -> List[torch.device]:
    """The CUDA devices of ``tensors`` (nested lists of tensors), sorted."""
    found = set()
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                found.add(item.device)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sorted(found, key=lambda d: d.index)


class Completions:
    """Completes the futures of unfinished calls, in issue order, on daemon threads.

    ``future.set_result`` runs the future's ``then()`` callbacks on the thread that calls it,
    and a callback may block on a later call of the same group: torch's PowerSGD hook waits,
    inside its callbacks, for an all-reduce it starts there. So one thread at a time (the
    leader) takes the next call and waits for it; before it runs the callbacks it leaves the
    pool, and when no other thread is left to lead, it starts one. A pool thread therefore
    stays free to complete the call a callback waits for; the pool grows to one thread more
    than the callbacks blocked at once (two, for DDP and PowerSGD) and lives until
    :meth:`close`.

    CUDA work is completed on a stream of the watchers' own per device: the stream waits for
    the collective, the host waits (at most ``timeout``) until the GPU is done, the copy-outs run
    on that stream, and only then is the future's result set, with its events recorded there.
    """

    def __init__(self, timeout: Optional[datetime.timedelta] = None) -> None:
        self._queue: queue.SimpleQueue[Optional[DkWork]] = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []
        self._free = 0  # pool threads not running callbacks (the leader and those waiting)
        self._lock = threading.Lock()  # guards _threads and _free
        self._lead = threading.Lock()  # held by the thread that takes and waits for a call
        self._timeout = timeout
        self._streams: Dict[torch.device, Any] = {}  # the watchers' CUDA streams
        # Guards every DkWork of the group: its copy-outs run once, its future is made once.
        self.lock = threading.Lock()

    def watch(self, work: DkWork) -> None:
        with self._lock:
            if not self._threads:
                self._start()
        self._queue.put(work)

    def _start(self) -> None:
        """One more pool thread (called with ``_lock`` held)."""
        thread = threading.Thread(target=self._run, name="dk-torch-futures", daemon=True)
        self._threads.append(thread)
        self._free += 1
        thread.start()

    def _run(self) -> None:
        while True:
            with self._lead:
                work = self._queue.get()
                if work is None:  # close(): pass the word on to the next thread
                    self._queue.put(None)
                    return
                stream, error = self._wait(work)
                with self._lock:  # leaving the pool to run callbacks: keep a thread to lead
                    self._free -= 1
                    if self._free == 0:
                        self._start()
            try:
                self._set(work, stream, error)
            finally:
                with self._lock:
                    self._free += 1

    def _wait(self, work: DkWork) -> Tuple[Optional[Any], Optional[BaseException]]:
        """Waits for ``work`` (CUDA: on the device's watcher stream); (that stream, the error)."""
        stream = None
        try:
            if work.device is None:
                work.wait()
            else:
                stream = self._streams.get(work.device)
                if stream is None:
                    stream = self._streams[work.device] = torch.cuda.Stream(work.device)
                with torch.cuda.device(work.device), torch.cuda.stream(stream):
                    work.wait(self._timeout if self._timeout is not None else _NO_TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - the future carries it to its waiter
            return stream, e
        return stream, None

    @staticmethod
    def _set(work: DkWork, stream: Optional[Any], error: Optional[BaseException]) -> None:
        """Completes the future, which runs its callbacks here (CUDA: events on ``stream``)."""
        future = work._future
        if error is not None:
            future.set_exception(error)
        elif stream is None:
            future.set_result(work._result)
        else:
            with torch.cuda.device(work.device), torch.cuda.stream(stream):
                future.set_result(work._result)

    def close(self) -> None:
        """Stops the threads once the calls they watch have finished (or failed)."""
        with self._lock:
            threads, self._threads = self._threads, []
        if threads:
            self._queue.put(None)
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
        with self._lock:  # the stop word stays queued: a later watch() starts afresh
            self._queue, self._free = queue.SimpleQueue(), 0


skip_module(sys.modules[__name__])  # torch.compile must not trace these frames (dynamo.py)
