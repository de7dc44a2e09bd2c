"""The CUDA side of :class:`dist_kernels.Communicator` (``device="cuda"``).

One C++ object does the work: ``_C.NcclCommunicator`` (csrc/comm/nccl_communicator.h) owns the
NCCL communicators (one per lane), their transports, compute and staging, runs every
collective (NCCL's own, or our ring and tree over NCCL send/recv) and resolves ``"auto"``. This
module owns what is torch's: the communicator's stream, the ordering against the caller's
streams, tensors' lifetimes, host waits and errors (design decisions 1 and 3).

Stream semantics (design decision 7): each collective runs on the communicator's own stream,
ordered after the caller's current stream (the comm stream waits on an event recorded there) and
before later work on it (the caller's stream waits on an event recorded after the collective).
Only events are used, never host synchronisation, so a collective can be captured in a CUDA
graph (a captured collective's staging is the graph's own, allocated inside it). ``async_op=True``
returns a ``dist_kernels.Work`` (around a :class:`CudaWork`) instead of making the caller's
stream wait; its ``wait()`` makes the then-current stream of the communicator's device wait, as
torch.distributed's NCCL work does, and ``wait(timeout)`` also blocks the host until the
collective ends or ``timeout`` seconds pass. A Work started inside a graph capture must be
waited inside the same capture (``RuntimeError`` otherwise).

Arrays of other libraries (CuPy): the collective also waits for, and is then waited by, the
stream their owner uses: ``__cuda_array_interface__``'s ``stream``, or CuPy's current stream for
a CuPy array passed through DLPack; they are held until the collective has completed.

Failures (:class:`NcclWatch`): every call first asks NCCL for an asynchronous error (a dead peer,
a closed socket); a host wait (``wait(timeout)``, ``barrier()``, ``close()``) polls for it while
it waits. An error or a timeout aborts the NCCL communicators (``ncclCommAbort``, which also ends
their kernels still waiting on the device) and raises ``CommError`` naming the rank, the
operation and NCCL's own message; every later call raises ``CommError`` too.

Threads: one thread at a time per communicator (NCCL's rule); a call that finds another thread
inside raises ``RuntimeError`` instead of interleaving the two on the stream.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import threading
import time
import zlib
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

import torch
from torch.autograd import profiler as _torch_profiler

from .. import _C
from ..debug import profiler, stream_recorder
from ..dtypes import ReduceOp, ReduceOpLike, dtype_code
from ..errors import CommError
from . import algorithms, nccl
from . import timeout as _timeout
from .base import BaseCommunicator
from .work import Work

#: Staging per lane for NcclTransport receives: 8 slots of 4 MiB, plus one slot of scratch. A
#: slot is the largest message of one algorithm step (ring and tree cut their slices to fit); the
#: ring holds one slot at a time and the tree two (its two children), so 8 leaves room. Not yet
#: tuned on a GPU: the slot size trades NCCL calls per byte against the smallest pipelined slice.
DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_NUM_SLOTS = 8
#: Lanes (one NCCL communicator, stream and staging each): ring slices and tree halves alternate
#: over them, so one lane's reduce overlaps the next slice's transfer. DK_NCCL_LANES overrides
#: (1 = one stream, as before lanes existed: what the device check compares against).
DEFAULT_LANES = 2
_NAMES = {code: name for name, code in algorithms.CODES.items()}

DeviceLike = Union[torch.device, int, str, None]
#: Host waits' timeout when none is given and DK_TIMEOUT is unset (comm/timeout.py).
DEFAULT_TIMEOUT = _timeout.DEFAULT_TIMEOUT
#: Host polling while waiting: starts at 0.1 ms (short collectives end fast) and doubles up to
#: 10 ms, so a long wait costs the host little and an error is seen within 10 ms.
_POLL_FIRST_S, _POLL_MAX_S = 1e-4, 1e-2


def unavailable_reason() -> Optional[str]:
    """Why a CUDA communicator cannot be made here, or None when it can."""
    if not getattr(_C, "build_info", lambda: {})().get("cuda_compiled", False):
        return "dist_kernels was built without CUDA (DK_WITH_CUDA=0 or no nvcc at build time)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (CPU build of torch, no driver, or no GPU)"
    return None


def default_lanes() -> int:
    """DK_NCCL_LANES, else :data:`DEFAULT_LANES`."""
    value = os.environ.get("DK_NCCL_LANES", "")
    if not value:
        return DEFAULT_LANES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"DK_NCCL_LANES: expected a positive integer, got {value!r}")
    return int(value)


def _cuda_device(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {dev}")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def as_cuda_tensor(obj: Any, device: torch.device, arg: str) -> torch.Tensor:
    """Views ``obj`` (torch tensor, DLPack or ``__cuda_array_interface__`` array) as a tensor.

    Raises ``TypeError`` for an unsupported object or dtype and ``ValueError`` for memory that
    is not contiguous or not on ``device`` (a CPU tensor included), naming ``arg``.
    """
    if isinstance(obj, torch.Tensor):
        tensor = obj
    elif hasattr(obj, "__dlpack__"):
        # DLPack's stream handshake orders the producer's stream before torch's current one.
        tensor = torch.from_dlpack(obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        tensor = torch.as_tensor(obj, device=device)
    else:
        raise TypeError(f"{arg}: expected a torch.Tensor or a CUDA array, got {type(obj).__name__}")
    if tensor.device != device:
        raise ValueError(
            f"{arg}: expected a tensor on {device} (this communicator's device), "
            f"got one on {tensor.device}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor")
    dtype_code(tensor.dtype, arg)
    return tensor


def owner_stream(obj: Any) -> Optional[int]:
    """The stream (a raw handle) on which the owner of a foreign array orders its work, or None
    when nothing says: ``__cuda_array_interface__``'s ``stream`` (None there means no
    synchronisation is needed), else CuPy's current stream for a CuPy array."""
    interface = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(interface, dict) and interface.get("stream") is not None:
        # 1 is the interface's name for the legacy default stream, torch's stream 0; 2 (the
        # per-thread default stream) is also CUDA's own handle for it.
        stream = int(interface["stream"])
        return 0 if stream == 1 else stream
    if type(obj).__module__.split(".")[0] == "cupy" and "cupy" in sys.modules:
        return int(sys.modules["cupy"].cuda.get_current_stream().ptr)
    return None


class NcclWatch:
    """Turns a hang or NCCL's asynchronous error into ``CommError`` (see the module docstring).

    ``comm`` is an ``_C.NcclCommunicator`` (or anything with ``closed``, ``async_error()``,
    ``last_error()`` and ``abort()``). Once it has failed, :attr:`failure` holds the first
    error's message.
    """

    def __init__(
        self, comm: Any, rank: int, on_failure: Optional[Callable[[str], None]] = None
    ) -> None:
        self._comm = comm
        self.rank = rank
        self.failure: Optional[str] = None
        self._on_failure = on_failure  # told the first failure (the flight recorder)

    def check(self, what: str) -> None:
        """Raises ``CommError`` if the communicator failed earlier or NCCL reports an error now
        (and then aborts it)."""
        if self.failure is not None:
            raise CommError(
                f"[rank {self.rank}] {what}: the communicator was aborted after an earlier "
                f"failure: {self.failure}"
            )
        if self._comm.closed:  # closed cleanly (a Work waited after close()): nothing to ask
            return
        error = self._comm.async_error()
        if error is not None:
            self.abort(what, f"NCCL reported an asynchronous error: {error}")

    def wait(self, is_done: Callable[[], bool], timeout: float, what: str) -> None:
        """Blocks the host until ``is_done()``; polls NCCL's error meanwhile; after ``timeout``
        seconds aborts and raises ``CommError``."""
        deadline = time.monotonic() + timeout
        delay = _POLL_FIRST_S
        while not is_done():
            self.check(what)
            if time.monotonic() >= deadline:
                self.abort(what, f"not finished after {timeout:g} s (timeout)")
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def abort(self, what: str, why: str) -> NoReturn:
        """Aborts the NCCL communicator and raises ``CommError`` saying why."""
        last = self._comm.last_error()
        message = f"{why}" + (f"; NCCL's last error: {last}" if last and last not in why else "")
        self.failure = f"{what}: {message}"
        if self._on_failure is not None:
            self._on_failure(self.failure)
        try:
            self._comm.abort()
        except Exception as error:  # noqa: BLE001 - the first failure is the one to report
            message += f" (ncclCommAbort failed too: {error})"
        raise CommError(f"[rank {self.rank}] {what}: {message}; the NCCL communicator was aborted")


class CudaWork:
    """Completion of one collective on the communicator's stream.

    ``owners``: raw handles of foreign arrays' streams that wait too (see :func:`owner_stream`).
    ``capture``: the CUDA graph capture it was started in (0: none); it must be waited there.
    """

    def __init__(
        self,
        done: Any,
        watch: NcclWatch,
        what: str,
        device: torch.device,
        owners: Sequence[int] = (),
        capture: int = 0,
    ) -> None:
        self._done = done
        self._watch = watch
        self._what = what
        self._device = device
        self._owners = tuple(owners)
        self.capture = capture
        self.waited = False

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def done_event(self) -> Any:
        """The event recorded after the collective (the torch backend orders futures by it)."""
        return self._done

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Makes the current stream of the communicator's device wait for the collective.

        With ``timeout`` (seconds) the host also waits, polling NCCL's asynchronous error: on
        an error or after ``timeout`` the communicator is aborted and ``CommError`` raised.
        (Inside CUDA graph capture nothing can be waited for on the host: only the stream
        waits.)
        """
        self._watch.check(self._what)
        self._check_same_capture(_capture_id(self._device))
        if timeout is not None and not self.capture:
            self._watch.wait(self._done.query, timeout, self._what)
        torch.cuda.current_stream(self._device).wait_event(self._done)
        _owners_wait(self._owners, self._done, self._device)
        self.waited = True
        return True

    def is_completed(self) -> bool:
        """True once the device has finished the collective (or the communicator failed)."""
        return self._watch.failure is not None or self._done.query()

    def _check_same_capture(self, current: int) -> None:
        """A graph's collective is waited inside its capture, an eager one outside any."""
        if current == self.capture:
            return
        where = f"CUDA graph capture {self.capture}" if self.capture else "no graph capture"
        raise RuntimeError(
            f"[rank {self._watch.rank}] {self._what}: this Work was started in {where} and is "
            f"waited in {f'capture {current}' if current else 'eager mode'}: wait() a captured "
            "collective's Work inside its capture (before the `torch.cuda.graph` block ends), "
            "an eager one before a capture begins"
        )


def _capture_id(device: torch.device) -> int:
    """The CUDA graph capture the current stream of ``device`` takes part in, or 0."""
    with torch.cuda.device(device):
        if not torch.cuda.is_current_stream_capturing():
            return 0
        return _C.cuda_capture_id(torch.cuda.current_stream(device).cuda_stream)


def _owners_wait(owners: Sequence[int], done: Any, device: torch.device) -> None:
    for handle in owners:
        torch.cuda.ExternalStream(handle, device=device).wait_event(done)


def _foreign(*objs: Any) -> Tuple[Any, ...]:
    """The inputs whose memory torch's allocator does not own (CuPy arrays and the like)."""
    return tuple(o for o in objs if o is not None and not isinstance(o, torch.Tensor))


_cuda_names = itertools.count()  # flight-recorder names of CUDA communicators, in creation order


def _global_ranks(group: Any) -> Optional[List[int]]:
    """Global ranks of ``group``'s members (default WORLD), None without torch.distributed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _trace_dtype(t: torch.Tensor) -> int:
    """The dtype code a send / receive is recorded with (bytes for dtypes we do not reduce)."""
    try:
        return dtype_code(t.dtype)
    except TypeError:
        return dtype_code(torch.uint8)


# Communicators of one group are told apart by creation order (every member creates them in
# the same order), as on CPU; the CUDA ones count separately under their own Store prefix.
_creation_counters: Dict[Tuple[int, ...], itertools.count[int]] = {}
_creation_lock = threading.Lock()


def _group_store(group: Any) -> Tuple[Any, int, int]:
    """A Store private to this communicator instance of ``group``, this rank, the world size."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "Communicator(device='cuda'): call torch.distributed.init_process_group first "
            "(or pass store=, rank= and world_size=)"
        )
    group = group if group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("Communicator: this process is not a member of `group`")
    global_ranks = tuple(dist.get_process_group_ranks(group))
    with _creation_lock:
        instance = next(_creation_counters.setdefault(global_ranks, itertools.count()))
    tag = f"{zlib.crc32(repr(global_ranks).encode()):08x}"
    store = dist.PrefixStore(
        f"dk/cuda/{tag}/{instance}/", dist.distributed_c10d._get_default_store()
    )
    return store, rank, world_size


def _unique_ids(store: Any, rank: int, lanes: int, timeout: datetime.timedelta) -> List[bytes]:
    """One ncclUniqueId per lane, made by rank 0 and carried by the Store; rank 0's lane count
    is everyone's (a rank asking for another one raises ``ValueError``)."""
    if rank == 0:
        for lane in range(lanes):
            store.set(f"nccl_unique_id/{lane}", _C.nccl_unique_id())
        store.set("lanes", str(lanes))
    store.wait(["lanes"], timeout)
    agreed = int(store.get("lanes"))
    if agreed != lanes:
        raise ValueError(
            f"[rank {rank}] Communicator(device='cuda'): lanes={lanes}, but rank 0 has {agreed}"
        )
    keys = [f"nccl_unique_id/{lane}" for lane in range(lanes)]
    store.wait(keys, timeout)
    return [bytes(store.get(key)) for key in keys]


class CudaCommunicator(BaseCommunicator):
    """Collectives among the ranks of a torch ProcessGroup on CUDA tensors (NCCL underneath).

    ``dist_kernels.Communicator(group, device="cuda")`` returns one of these; the methods
    behave as the CPU communicator's (see the module docstring for streams and inputs).

    Args:
        group: a torch.distributed ProcessGroup; default WORLD (its Store carries the
            ncclUniqueIds from rank 0 to the others).
        device: this rank's CUDA device (``"cuda"`` = the current device).
        timeout: how long a host wait may take (rank 0's ncclUniqueIds, ``barrier()``,
            ``close()``; a ``datetime.timedelta``, default ``DK_TIMEOUT`` else 5 minutes:
            ``comm/timeout.py``) before ``CommError``.
            ``Work.wait(timeout)`` takes its own.
        store, rank, world_size: use this Store and these numbers instead of torch.distributed
            (tests and custom launchers); all three or none.
        slot_bytes, num_slots: staging per lane (a multiple of 256 bytes; at least 1 slot).
        lanes: NCCL communicators and streams the ring and tree alternate over (default
            ``DK_NCCL_LANES`` or 2; every rank passes the same).
    """

    device_type = "cuda"
    # The flight recorder (dist_kernels.debug), attached once NCCL is up.
    _debug_source: Any = None
    _recording: Optional[stream_recorder.StreamRecorder] = None

    def __init__(
        self,
        group: Any = None,
        device: DeviceLike = "cuda",
        timeout: Optional[datetime.timedelta] = None,
        *,
        store: Any = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        num_slots: int = DEFAULT_NUM_SLOTS,
        lanes: Optional[int] = None,
    ) -> None:
        self._comm = None
        self._held: List[Tuple[Any, Tuple[Any, ...]]] = []  # (done event, foreign inputs)
        self._captured: List[CudaWork] = []  # async works of graph captures, until waited
        self._busy = threading.Lock()
        if store is not None and (rank is None or world_size is None):
            raise ValueError("store: pass rank= and world_size= with it")
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"Communicator(device='cuda') is unavailable: {reason}")
        global_ranks = None if store is not None else _global_ranks(group)
        if store is None:
            store, rank, world_size = _group_store(group)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = _cuda_device(device)
        self.timeout = _timeout.resolve_timeout(timeout)
        nccl.load()
        ids = _unique_ids(store, rank, default_lanes() if lanes is None else lanes, self.timeout)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self._comm = _C.NcclCommunicator(
                ids, rank, world_size, self.device.index, self.stream.cuda_stream, slot_bytes,
                num_slots,
            )  # fmt: skip
            self._debug_source, self._recording = stream_recorder.attach(
                self,
                f"dk:cuda:{next(_cuda_names)}",
                global_ranks or range(world_size),
                rank,
                store,
                self.timeout.total_seconds(),
            )
        self._watch = NcclWatch(self._comm, rank, self._record_failure)
        self._track_open()

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close` or :meth:`abort`."""
        return self._comm is None

    @property
    def lanes(self) -> int:
        """NCCL communicators (and streams) the ring and tree alternate over."""
        return self._comm.lanes

    def _tensor(self, obj: Any, arg: str, what: str) -> torch.Tensor:
        if self._comm is None:
            raise RuntimeError(f"[rank {self.rank}] {what}: the communicator is closed")
        try:
            return as_cuda_tensor(obj, self.device, arg)
        except (TypeError, ValueError) as e:
            raise type(e)(f"[rank {self.rank}] {what}: {e}") from None

    def _run(
        self,
        what: str,
        tensors: Sequence[torch.Tensor],
        launch: Callable[[], None],
        async_op: bool,
        foreign: Tuple[Any, ...] = (),
        trace: Sequence[stream_recorder.TraceCall] = (),
    ) -> Any:
        """Runs ``launch()`` (which enqueues on the comm stream), ordered by events around it.

        ``caller`` is the current stream of the communicator's device (not of the current
        device, which may be another). ``foreign``: inputs held until the collective is done,
        whose owners' streams order it too. ``trace``: the calls of this launch, for the flight
        recorder and profiler events. One thread at a time.
        """
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"[rank {self.rank}] {what}: another thread is calling this communicator; a "
                "CUDA communicator takes calls from one thread at a time (as NCCL requires)"
            )
        try:
            return self._run_alone(what, tensors, launch, async_op, foreign, trace)
        finally:
            self._busy.release()

    def _run_alone(self, what, tensors, launch, async_op, foreign, trace) -> Any:
        self._watch.check(what)
        caller = torch.cuda.current_stream(self.device)
        capture = _capture_id(self.device)
        self._check_captured(what, capture)
        # Foreign arrays' owners in a capture would join it from outside: they order eagerly only.
        owners = [] if capture else [h for h in map(owner_stream, foreign) if h is not None]
        recording = self._recording if trace and not capture else None
        op_ids = recording.schedule(trace) if recording is not None else []
        self.stream.wait_stream(caller)
        with torch.cuda.device(self.device):
            for handle in owners:  # the collective starts after their owners' work too
                self.stream.wait_stream(torch.cuda.ExternalStream(handle, device=self.device))
            start = torch.cuda.Event() if op_ids else None
            if start is not None:
                start.record(self.stream)
            if _torch_profiler._is_profiler_enabled and self._debug_source is not None:
                with profiler.events_around(self._debug_source, trace, async_op):
                    launch()
            else:
                launch()
            done = torch.cuda.Event()
            done.record(self.stream)
        if recording is not None:
            recording.launched(op_ids, start, done)
        if not capture:  # a captured graph's memory is the graph's (and its caller's) to keep
            for tensor in tensors:  # the allocator must not reuse them before the comm stream ends
                tensor.record_stream(self.stream)
            self._hold(done, foreign)
        if not async_op:
            caller.wait_event(done)
            _owners_wait(owners, done, self.device)
            return None
        work = CudaWork(done, self._watch, what, self.device, owners, capture)
        if capture:
            self._captured.append(work)
        return Work(work, tuple(tensors), self.device)

    def _check_captured(self, what: str, capture: int) -> None:
        """Raises once for async works of an ended capture that were never waited inside it."""
        stale = [w for w in self._captured if not w.waited and w.capture != capture]
        self._captured = [w for w in self._captured if not w.waited and w.capture == capture]
        if stale:
            names = ", ".join(f"{w._what} (capture {w.capture})" for w in stale)
            raise RuntimeError(
                f"[rank {self.rank}] {what}: earlier async_op=True calls were started inside a "
                f"CUDA graph capture and never waited inside it: {names}. Call wait() on a "
                "captured collective's Work before its capture ends (its graph could not be "
                "completed without it)"
            )

    def _record_failure(self, cause: str) -> None:
        if self._recording is not None:
            self._recording.failed(cause)

    def _hold(self, done: Any, foreign: Tuple[Any, ...]) -> None:
        """Keeps ``foreign`` alive until ``done`` completes; drops what finished before."""
        self._held = [(event, objs) for event, objs in self._held if not event.query()]
        if foreign:
            self._held.append((done, foreign))

    def _auto_runs(self, collective: str) -> str:
        return "auto" if self._comm is None else _NAMES[self._comm.resolve(0, 0)]

    def _pair(self, output: Any, input: Any, what: str, big: str):
        """Checks an (output, input) pair whose side ``big`` holds world_size times the other."""
        out, inp = self._tensor(output, "output", what), self._tensor(input, "input", what)
        if out.dtype != inp.dtype:
            raise TypeError(
                f"[rank {self.rank}] {what}: output dtype {out.dtype} differs from input "
                f"dtype {inp.dtype}"
            )
        sides = {"output": out, "input": inp}
        small = "input" if big == "output" else "output"
        if sides[big].numel() != self.world_size * sides[small].numel():
            raise ValueError(
                f"[rank {self.rank}] {what}: {big}.numel() ({sides[big].numel()}) must equal "
                f"world_size ({self.world_size}) * {small}.numel() ({sides[small].numel()})"
            )
        return out, inp

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: Any,
        op: ReduceOpLike = ReduceOp.SUM,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Any:
        """Reduces ``tensor`` over all ranks, in place; every rank gets identical bits.

        ``algorithm``: "nccl" (NCCL's own all-reduce), "ring" or "tree" (ours over NCCL
        send/recv with our reduce kernels) or "auto" (= "nccl" on GPUs for now).
        """
        t = self._tensor(tensor, "tensor", "all_reduce")
        code, red = dtype_code(t.dtype), int(self._op(op, "all_reduce"))
        which = self._algorithm("all_reduce", algorithm)
        ptr, n = t.data_ptr(), t.numel()
        launch = lambda: self._comm.all_reduce(ptr, ptr, n, code, red, which)  # noqa: E731
        trace = [("all_reduce", code, red, -1, n, n)]
        return self._run("all_reduce", [t], launch, async_op, _foreign(tensor), trace)

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOpLike = ReduceOp.SUM,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Any:
        """``output`` = this rank's chunk of the reduction of ``input`` over ranks.

        ``input.numel() == world_size * output.numel()``; "ring", "nccl" or "auto" (NCCL's).
        There is no tree reduce-scatter: "tree" raises ValueError.
        """
        out, inp = self._pair(output, input, "reduce_scatter", big="input")
        code, red = dtype_code(out.dtype), int(self._op(op, "reduce_scatter"))
        which = self._algorithm("reduce_scatter", algorithm)
        args = (inp.data_ptr(), out.data_ptr(), out.numel(), code, red, which)
        launch = lambda: self._comm.reduce_scatter(*args)  # noqa: E731
        trace = [("reduce_scatter", code, red, -1, inp.numel(), out.numel())]
        foreign = _foreign(output, input)
        return self._run("reduce_scatter", [out, inp], launch, async_op, foreign, trace)

    def all_gather(
        self, output: Any, input: Any, async_op: bool = False, *, algorithm: str = "auto"
    ) -> Any:
        """``output`` = every rank's ``input`` in rank order (``world_size * input.numel()``).

        "ring", "nccl" or "auto" (NCCL's); there is no tree all-gather: "tree" raises ValueError.
        """
        out, inp = self._pair(output, input, "all_gather", big="output")
        which = self._algorithm("all_gather", algorithm)
        args = (inp.data_ptr(), out.data_ptr(), inp.numel(), dtype_code(out.dtype), which)
        launch = lambda: self._comm.all_gather(*args)  # noqa: E731
        trace = [("all_gather", args[3], -1, -1, inp.numel(), out.numel())]
        foreign = _foreign(output, input)
        return self._run("all_gather", [out, inp], launch, async_op, foreign, trace)

    def broadcast(
        self, tensor: Any, src: int, async_op: bool = False, *, algorithm: str = "auto"
    ) -> Any:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` on every rank.

        "nccl" / "auto": NCCL's; "ring" and "tree" both run ours, which picks by size: a
        pipelined chain for a message of several slots, the heap tree for one slot.
        """
        t = self._tensor(tensor, "tensor", "broadcast")
        src = self._check_peer(src, "src", "broadcast")
        which = self._algorithm("broadcast", algorithm)
        args = (t.data_ptr(), t.numel(), dtype_code(t.dtype), src, which)
        launch = lambda: self._comm.broadcast(*args)  # noqa: E731
        trace = [("broadcast", args[2], -1, src, t.numel(), t.numel())]
        return self._run("broadcast", [t], launch, async_op, _foreign(tensor), trace)

    # ``tag`` is accepted and ignored, as torch's NCCL backend ignores it: NCCL matches the
    # messages between two ranks in the order they are issued.

    def send(self, tensor: Any, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst`` (which calls :meth:`recv` with the same size)."""
        self._send_recv("send", (tensor, dst, False), None, False)

    def recv(self, tensor: Any, src: int, tag: int = 0) -> None:
        """Receives into ``tensor`` what rank ``src`` sends."""
        self._send_recv("recv", None, (tensor, src, False), False)

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Any:
        """Asynchronous :meth:`send` (ordered on the communicator's stream); returns a Work."""
        return self._send_recv("isend", (tensor, dst, False), None, True)

    def irecv(self, tensor: Any, src: int, tag: int = 0) -> Any:
        """Asynchronous :meth:`recv` (ordered on the communicator's stream); returns a Work."""
        return self._send_recv("irecv", None, (tensor, src, False), True)

    def send_recv(
        self, send: Optional[Any], dst: int, recv: Optional[Any], src: int, async_op: bool = False
    ) -> Any:
        """Sends ``send`` to ``dst`` while receiving ``recv`` from ``src``, in one NCCL group
        per message (so two ranks may exchange without deadlock). Either side may be None."""
        return self._send_recv(
            "send_recv",
            None if send is None else (send, dst, True),
            None if recv is None else (recv, src, True),
            async_op,
        )

    def _send_recv(self, what: str, send, recv, async_op: bool) -> Any:
        """``send`` / ``recv``: None or (array, peer, whether the peer may be this rank)."""
        tensors: List[torch.Tensor] = []
        sides: List[int] = []
        trace: List[stream_recorder.TraceCall] = []
        for side, arg, peer_arg in ((send, "send", "dst"), (recv, "recv", "src")):
            if side is None:
                sides += [0, 0, -1]
                continue
            obj, peer, allow_self = side
            name = arg if what == "send_recv" else "tensor"
            t = self._tensor(obj, name, what)
            tensors.append(t)
            peer = self._check_peer(peer, peer_arg, what, allow_self=allow_self)
            sides += [t.data_ptr(), t.numel() * t.element_size(), peer]
            trace.append((arg, _trace_dtype(t), -1, peer, t.numel(), t.numel()))
        originals = _foreign(*(side[0] for side in (send, recv) if side is not None))
        launch = lambda: self._comm.send_recv(*sides)  # noqa: E731
        return self._run(what, tensors, launch, async_op, originals, trace)

    def barrier(self, async_op: bool = False) -> Any:
        """Every rank reaches it before any leaves (a one-element NCCL all-reduce); without
        ``async_op`` the host also waits for it, at most the communicator's ``timeout``
        (then ``CommError``, the communicator aborted)."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        work = self.all_reduce(flag, algorithm="nccl", async_op=True)
        if async_op:
            return work
        work.wait(self.timeout.total_seconds())
        return None

    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32):
        """A tensor on this communicator's device. (NCCL-registered memory is future work:
        collectives on it go through staging like any other tensor.)"""
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"[rank {self.rank}] empty: negative dimension in shape {shape}")
        dtype_code(dtype, "dtype")
        return torch.empty(shape, dtype=dtype, device=self.device)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for this communicator's work (at most ``timeout``), then destroys the NCCL
        communicators. After a failure (or on timeout) it aborts instead of waiting."""
        if self._comm is None:
            return
        try:
            if self._watch.failure is None:
                done = torch.cuda.Event()
                done.record(self.stream)
                self._watch.wait(done.query, self.timeout.total_seconds(), "close")
        finally:
            self._release(aborted=self._watch.failure is not None)

    def abort(self) -> None:
        """Aborts the NCCL communicators without waiting (``ncclCommAbort``: their kernels still
        on the device end too), for a peer that died; the communicator is closed after it."""
        if self._comm is None:
            return
        self._release(aborted=True)

    def _close_at_exit(self) -> None:
        """An idle communicator is closed; one whose stream still has work is aborted rather
        than waited for (a peer may never come), as a CPU one is failed."""
        if self.stream.query():
            self.close()
        else:
            self.abort()

    def _release(self, aborted: bool) -> None:
        self._held = []
        self._captured = []
        comm, self._comm = self._comm, None
        if comm.closed:  # NcclWatch aborted it already
            return
        if aborted:
            comm.abort()
        else:
            comm.close()
