"""torch.profiler events for our collectives: ``record_param_comms``, with torch's keys.

torch's process groups wrap every collective in a ``record_param_comms`` event whose
arguments ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "Group size",
"Process Group Name", "Seq", ...) profilers and trace analyzers read. The profiler takes them
from a C++ ``ParamCommsDebugInfo`` that Python cannot set (an event of that name without one
crashes torch 2.13's profiler), so ``param_comms.cpp`` is compiled once, at the first profiled
call, against the torch in use (``torch.utils.cpp_extension``, cached in its build directory;
it needs a C++ compiler and ninja, as DeepSpeed's JIT ops do). Without them each call still
runs, with a warning and no event.

The communicator backends call :class:`ProfiledCalls` only while a profiler runs (they check
``torch.autograd.profiler._is_profiler_enabled``, a module flag torch keeps for that purpose,
~20 ns): the event spans the call on the calling thread (for ``async_op=True`` its queueing,
as torch's own events do); the time the call then ran is in the flight recorder
(``dk.debug.trace_handler`` adds it to the exported trace).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Iterator, Optional, Sequence

import torch

from ..dtypes import DTYPE_CODES

#: Our calls -> the collective names torch's process groups record (ProcessGroupGloo/NCCL).
TORCH_NAMES = {
    "all_reduce": "allreduce",
    "reduce_scatter": "_reduce_scatter_base",
    "all_gather": "_allgather_base",
    "broadcast": "broadcast",
    "all_to_all": "all_to_allv",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

_shim: Any = None
_shim_error: Optional[str] = None
_shim_lock = threading.Lock()


def _load_shim() -> Any:
    """The compiled event module, or None (and one warning) when it cannot be built."""
    global _shim, _shim_error
    with _shim_lock:
        if _shim is None and _shim_error is None:
            try:
                from torch.utils.cpp_extension import load

                source = os.path.join(os.path.dirname(__file__), "param_comms.cpp")
                tag = torch.__version__.split("+")[0].replace(".", "_")
                _shim = load(f"dk_param_comms_{tag}", [source], extra_cflags=["-O2"])
            except Exception as error:  # noqa: BLE001 - no compiler / ninja: events are optional
                _shim_error = f"{type(error).__name__}: {error}"
                warnings.warn(
                    "dist_kernels: no record_param_comms events in this profile: compiling "
                    f"their helper failed ({_shim_error})",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _shim


def prepare() -> bool:
    """Compiles the event helper now (a minute the first time); True when events work."""
    return _load_shim() is not None


def _stride(ranks: list) -> tuple:
    """(start, stride) when the group's global ranks are evenly spaced, as torch describes
    groups in these events; (-1, 0) otherwise."""
    if len(ranks) < 2:
        return (ranks[0] if ranks else 0), 1
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return ranks[0], step
    return -1, 0


def param_comms(
    source: Any, op: str, in_count: int, out_count: int, code: int, peer: int, async_op: bool
) -> Any:
    """An open ``record_param_comms`` event for one call (``.end()`` closes it), or None when
    the helper could not be built. ``source``: the communicator's flight-recorder Source
    (group names and ranks); ``code``: the C++ dtype code; ``peer``: the group rank a send or
    receive talks to."""
    shim = _load_shim()
    if shim is None:
        return None
    p2p = op in ("send", "recv")
    ranks = source.ranks
    start, stride = _stride(ranks)
    return shim.ParamCommsEvent(
        source.name,
        source.desc,
        peer if p2p else source.rank,
        TORCH_NAMES[op],
        in_count,
        out_count,
        _DTYPES.get(code, torch.uint8),
        start,
        stride,
        len(ranks),
        source.recorder.next_seq(p2p) if source.recorder is not None else -1,
        p2p,
        bool(async_op),
    )


@contextlib.contextmanager
def events_around(source: Any, calls: Sequence[tuple], async_op: bool) -> Iterator[None]:
    """One ``record_param_comms`` event per call of a launch (``calls``: stream_recorder's
    TraceCall tuples), open while the block runs."""
    events = [param_comms(source, op, i, o, d, p, async_op) for op, d, _r, p, i, o in calls]
    try:
        yield
    finally:
        for event in reversed(events):
            if event is not None:
                event.end()


class ProfiledCalls:
    """The calls of a ``_C.CpuCommunicator``, each inside a ``record_param_comms`` event.

    Same signatures as the binding (pointers, counts, dtype codes), so a backend switches
    between the two objects without changing its calls.
    """

    def __init__(self, impl: Any, source: Any) -> None:
        self._impl, self._source = impl, source

    def _event(self, op: str, in_count: int, out_count: int, code: int, peer: int, async_op):
        return param_comms(self._source, op, in_count, out_count, code, peer, async_op)

    def _run(self, event: Any, call, *args):
        try:
            return call(*args)
        finally:
            if event is not None:
                event.end()

    def all_reduce(self, ptr, count, code, op, algo, async_op):
        event = self._event("all_reduce", count, count, code, -1, async_op)
        return self._run(event, self._impl.all_reduce, ptr, count, code, op, algo, async_op)

    def reduce_scatter(self, out, inp, count, code, op, algo, async_op):
        n = self._source.world_size
        event = self._event("reduce_scatter", n * count, count, code, -1, async_op)
        args = (out, inp, count, code, op, algo, async_op)
        return self._run(event, self._impl.reduce_scatter, *args)

    def all_gather(self, out, inp, count, code, algo, async_op):
        n = self._source.world_size
        event = self._event("all_gather", count, n * count, code, -1, async_op)
        return self._run(event, self._impl.all_gather, out, inp, count, code, algo, async_op)

    def all_to_all(self, out, inp, sends, recvs, code, async_op):
        event = self._event("all_to_all", sum(sends), sum(recvs), code, -1, async_op)
        return self._run(event, self._impl.all_to_all, out, inp, sends, recvs, code, async_op)

    def broadcast(self, ptr, count, code, src, async_op):
        event = self._event("broadcast", count, count, code, -1, async_op)
        return self._run(event, self._impl.broadcast, ptr, count, code, src, async_op)

    def send(self, ptr, count, code, dst, async_op, tag=0):
        event = self._event("send", count, count, code, dst, async_op)
        return self._run(event, self._impl.send, ptr, count, code, dst, async_op, tag)

    def recv(self, ptr, count, code, src, async_op, tag=0):
        event = self._event("recv", count, count, code, src, async_op)
        return self._run(event, self._impl.recv, ptr, count, code, src, async_op, tag)

    def barrier(self, async_op):
        event = self._event("barrier", 0, 0, 0, -1, async_op)
        return self._run(event, self._impl.barrier, async_op)
