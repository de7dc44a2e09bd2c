"""Flight-recorder entries of a communicator whose calls run on a CUDA stream (comm/cuda.py).

The host knows when a call is scheduled; when it starts and ends is the device's business. As
torch's NCCL process group does, an event recorded on the stream before the call and one after
it tell: each time the recorder is read (a dump, a footprint) the calls whose events have
completed since are marked started / completed, stamped with the time of that look (torch's
"time discovered"). Calls complete in stream order, so the look stops at the first event not
yet reached.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Deque, List, Optional, Sequence, Tuple

#: One call as the communicator describes it: (op, dtype code, reduce-op code or -1, peer or
#: -1, input elements, output elements); op is a name of ``_C.FlightRecorder.schedule``.
TraceCall = Tuple[str, int, int, int, int, int]


class StreamRecorder:
    """Schedules calls in ``recorder`` (a ``_C.FlightRecorder``) and discovers their progress
    from the events the communicator records around them."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        # [op ids, start event, done event, started already marked], in stream order
        self._pending: Deque[List[Any]] = collections.deque()
        self._lock = threading.Lock()

    def schedule(self, calls: Sequence[TraceCall]) -> List[int]:
        """Op ids of the calls of one launch (a send and a receive may share one)."""
        return [self.recorder.schedule(op, d, r, p, 0, i, o) for op, d, r, p, i, o in calls]

    def launched(self, op_ids: Sequence[int], start: Any, done: Any) -> None:
        """The launch's events were recorded on the stream (``start`` before it, ``done``
        after)."""
        with self._lock:
            self._pending.append([list(op_ids), start, done, False])

    def failed(self, cause: str) -> None:
        """The communicator failed (NCCL error, timeout): recorded against the oldest call not
        yet completed (the one that hung), or the last one; the first failure wakes the debug
        monitor."""
        self.refresh()
        with self._lock:
            pending = self._pending[0][0][0] if self._pending else 0
        self.recorder.failed(pending or self.recorder.footprint()["calls"], cause)

    def refresh(self) -> None:
        """Marks what the device has reached since the last look."""
        with self._lock:
            while self._pending:
                op_ids, start, done, started = self._pending[0]
                if not started and _reached(start):
                    for op_id in op_ids:
                        self.recorder.started(op_id, 0)
                    self._pending[0][3] = started = True
                if not started or not _reached(done):
                    return
                for op_id in op_ids:
                    self.recorder.completed(op_id)
                self._pending.popleft()


def _reached(event: Optional[Any]) -> bool:
    """Whether the stream has passed ``event`` (a query that fails counts as not yet: the
    communicator reports its own errors)."""
    try:
        return event is not None and bool(event.query())
    except RuntimeError:
        return False


def attach(
    owner: Any,
    name: str,
    ranks: Sequence[int],
    rank: int,
    store: Any,
    timeout_s: float,
) -> Tuple[Any, Optional[StreamRecorder]]:
    """The flight-recorder Source of a CUDA communicator ``owner`` (registered for dumps), and
    its StreamRecorder (None when ``DK_TRACE_BUFFER_SIZE=0``)."""
    from .flight_recorder import Source, new_recorder, register

    recorder = new_recorder()
    stream = StreamRecorder(recorder) if recorder is not None else None
    refresh = stream.refresh if stream is not None else None
    source = Source(
        recorder, name, "undefined", list(ranks), rank, store, timeout_s, "nccl", refresh
    )
    if recorder is not None:
        register(owner, source)
    return source, stream
