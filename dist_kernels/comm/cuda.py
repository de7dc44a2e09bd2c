"""The CUDA side of :class:`dist_kernels.Communicator` (``device="cuda"``).

Python owns everything here (the NCCL communicator, the communicator's stream, the staging
buffer); the C++ core borrows pointers and the stream handle (design decisions 1 and 3).

Stream semantics (design decision 7): each collective runs on the communicator's own stream,
ordered after the caller's current stream (the comm stream waits on an event recorded there) and
before later work on it (the caller's stream waits on an event recorded after the collective).
Only events are used, never host synchronisation, so a collective can be captured in a CUDA
graph. ``async_op=True`` returns a ``dist_kernels.Work`` (around a :class:`CudaWork`) instead of
making the caller's stream wait; its ``wait()`` makes the then-current stream of the
communicator's device wait, as torch.distributed's NCCL work does, and ``wait(timeout)`` also
blocks the host until the collective ends or ``timeout`` seconds pass.

Failures (:class:`NcclWatch`): every call first asks NCCL for an asynchronous error (a dead peer,
a closed socket); a host wait (``wait(timeout)``, ``barrier()``, ``close()``) polls for it while
it waits. An error or a timeout aborts the NCCL communicator (``ncclCommAbort``, which also ends
its kernels still waiting on the device) and raises ``CommError`` naming the rank, the operation
and NCCL's own message; every later call raises ``CommError`` too.

Memory: every input gets ``record_stream(comm stream)`` (torch's allocator then keeps its block
until the collective is done); arrays from other libraries (CuPy) are not torch's to keep, so
the communicator holds them until the event after the collective has completed.

Inputs: torch CUDA tensors, and any array with ``__dlpack__`` or ``__cuda_array_interface__``
(CuPy), viewed as a torch tensor without a copy.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
import zlib
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

import torch
from torch.autograd import profiler as _torch_profiler

from .. import _C
from ..debug import profiler, stream_recorder
from ..dtypes import ReduceOp, ReduceOpLike, dtype_code, reduce_op
from ..errors import CommError
from . import nccl
from . import timeout as _timeout
from .work import Work

#: Staging for NcclTransport receives: 8 slots of 4 MiB (32 MiB per communicator). A slot is the
#: largest message of one algorithm step (ring and tree cut their slices to fit); the ring holds
#: one slot at a time and the tree two (its two children), so 8 leaves room. Not yet tuned on a
#: GPU: the slot size trades NCCL calls per byte against the size of the smallest pipelined slice.
DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_NUM_SLOTS = 8
ALGORITHMS = ("auto", "ring", "tree", "nccl")
#: C++ codes of algo::Algorithm (csrc/algorithm/collective.h).
_ALGORITHM_CODES = {"ring": 1, "tree": 2}
#: What reduce_scatter's and all_gather's ``algorithm`` accepts, and what each choice runs
#: (neither has a tree: refused rather than silently run as the ring).
REDUCE_SCATTER_ALGORITHMS = {"auto": "nccl", "ring": "ring", "nccl": "nccl"}
ALL_GATHER_ALGORITHMS = REDUCE_SCATTER_ALGORITHMS

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
    if not hasattr(_C, "NcclTransport"):
        return "this build of dist_kernels._C has no NCCL transport"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (CPU build of torch, no driver, or no GPU)"
    return None


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


class NcclWatch:
    """Turns a hang or NCCL's asynchronous error into ``CommError`` (see the module docstring).

    ``comm`` is an ``_C.NcclComm`` (or anything with ``closed``, ``async_error()``,
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
    """Completion of one collective on the communicator's stream."""

    def __init__(self, done: Any, watch: NcclWatch, what: str, device: torch.device) -> None:
        self._done = done
        self._watch = watch
        self._what = what
        self._device = device

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Makes the current stream of the communicator's device wait for the collective.

        With ``timeout`` (seconds) the host also waits, polling NCCL's asynchronous error: on
        an error or after ``timeout`` the communicator is aborted and ``CommError`` raised.
        (Inside CUDA graph capture nothing can be waited for on the host: only the stream
        waits.)
        """
        self._watch.check(self._what)
        if timeout is not None and not _capturing(self._device):
            self._watch.wait(self._done.query, timeout, self._what)
        torch.cuda.current_stream(self._device).wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        """True once the device has finished the collective (or the communicator failed)."""
        return self._watch.failure is not None or self._done.query()


def _capturing(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _foreign(*objs: Any) -> Tuple[Any, ...]:
    """The inputs whose memory torch's allocator does not own (CuPy arrays and the like)."""
    return tuple(o for o in objs if o is not None and not isinstance(o, torch.Tensor))


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


class CudaCommunicator:
    """Collectives among the ranks of a torch ProcessGroup on CUDA tensors (NCCL underneath).

    ``dist_kernels.Communicator(group, device="cuda")`` returns one of these; the methods
    behave as the CPU communicator's (see the module docstring for streams and inputs).

    Args:
        group: a torch.distributed ProcessGroup; default WORLD (its Store carries the
            ncclUniqueId from rank 0 to the others).
        device: this rank's CUDA device (``"cuda"`` = the current device).
        timeout: how long a host wait may take (rank 0's ncclUniqueId, ``barrier()``,
            ``close()``; a ``datetime.timedelta``, default ``DK_TIMEOUT`` else 5 minutes:
            ``comm/timeout.py``) before ``CommError``.
            ``Work.wait(timeout)`` takes its own.
        store, rank, world_size: use this Store and these numbers instead of torch.distributed
            (tests and custom launchers); all three or none.
        slot_bytes, num_slots: NcclTransport staging (a multiple of 256 bytes; at least 1).
    """

    REDUCE_SCATTER_ALGORITHMS = REDUCE_SCATTER_ALGORITHMS
    ALL_GATHER_ALGORITHMS = ALL_GATHER_ALGORITHMS
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
    ) -> None:
        self._comm = None
        self._held: List[Tuple[Any, Tuple[Any, ...]]] = []  # (done event, foreign inputs)
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
        if rank == 0:
            store.set("nccl_unique_id", _C.nccl_unique_id())
        store.wait(["nccl_unique_id"], self.timeout)
        unique_id = bytes(store.get("nccl_unique_id"))
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self._comm = _C.NcclComm(unique_id, rank, world_size, self.device.index)
            self._debug_source, self._recording = stream_recorder.attach(
                self,
                f"dk:cuda:{next(_cuda_names)}",
                global_ranks or range(world_size),
                rank,
                store,
                self.timeout.total_seconds(),
            )
            self._watch = NcclWatch(self._comm, rank, self._record_failure)
            self._staging = torch.empty(
                slot_bytes * num_slots, dtype=torch.uint8, device=self.device
            )
            self._scratch = torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
        handle = self.stream.cuda_stream
        # Both C++ objects borrow the same staging: they only ever run on the one stream, one
        # collective at a time, and return every slot before a collective ends.
        self._transport = _C.NcclTransport(
            self._comm, handle, self._staging.data_ptr(), slot_bytes, num_slots
        )
        # Ring and tree over NcclTransport + CudaCompute, when the algorithms are in the build.
        self._algorithms = None
        if hasattr(_C, "CudaCommunicator"):
            self._algorithms = _C.CudaCommunicator(
                self._comm,
                handle,
                self._staging.data_ptr(),
                slot_bytes,
                num_slots,
                self._scratch.data_ptr(),
            )

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close` or :meth:`abort`."""
        return self._comm is None

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
        launch: Callable[[int], None],
        async_op: bool,
        foreign: Tuple[Any, ...] = (),
        trace: Sequence[stream_recorder.TraceCall] = (),
    ) -> Any:
        """Runs ``launch(stream_handle)`` on the comm stream, ordered by events around it.

        ``caller`` is the current stream of the communicator's device (not of the current
        device, which may be another). ``foreign``: inputs held until the collective is done.
        ``trace``: the calls of this launch, for the flight recorder and profiler events.
        """
        self._watch.check(what)
        caller = torch.cuda.current_stream(self.device)
        capturing = _capturing(self.device)
        recording = self._recording if trace and not capturing else None
        op_ids = recording.schedule(trace) if recording is not None else []
        self.stream.wait_stream(caller)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start = torch.cuda.Event() if op_ids else None
            if start is not None:
                start.record(self.stream)
            if _torch_profiler._is_profiler_enabled and self._debug_source is not None:
                with profiler.events_around(self._debug_source, trace, async_op):
                    launch(self.stream.cuda_stream)
            else:
                launch(self.stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        if recording is not None:
            recording.launched(op_ids, start, done)
        if not capturing:  # a captured graph's memory is the graph's (and its caller's) to keep
            for tensor in tensors:  # the allocator must not reuse them before the comm stream ends
                tensor.record_stream(self.stream)
            self._hold(done, foreign)
        if not async_op:
            caller.wait_event(done)
            return None
        return _public_work(CudaWork(done, self._watch, what, self.device), tuple(tensors))

    def _record_failure(self, cause: str) -> None:
        if self._recording is not None:
            self._recording.failed(cause)

    def _hold(self, done: Any, foreign: Tuple[Any, ...]) -> None:
        """Keeps ``foreign`` alive until ``done`` completes; drops what finished before."""
        self._held = [(event, objs) for event, objs in self._held if not event.query()]
        if foreign:
            self._held.append((done, foreign))

    def _resolve(self, algorithm: str, what: str, allowed: Any = ALGORITHMS) -> str:
        """ "auto" is NCCL's own collective on GPUs: its tuning is the better default until our
        ring and tree over NCCL send/recv have been measured on a GPU. ``allowed``: what the
        collective accepts (reduce_scatter and all_gather have no tree)."""
        if algorithm not in allowed:
            choices = allowed if isinstance(allowed, tuple) else sorted(allowed)
            no_tree = "" if "tree" in allowed else f" ({what} has no tree)"
            raise ValueError(
                f"[rank {self.rank}] {what}: algorithm must be one of {choices}{no_tree}, "
                f"got {algorithm!r}"
            )
        if algorithm == "auto":
            return "nccl"
        if algorithm != "nccl" and self._algorithms is None:
            raise RuntimeError(
                f"[rank {self.rank}] {what}: algorithm={algorithm!r} needs the ring/tree CUDA "
                "communicator (_C.CudaCommunicator), which this build lacks; use 'nccl'"
            )
        return algorithm

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

    def _op(self, op: ReduceOpLike, what: str) -> int:
        try:
            return int(reduce_op(op))
        except ValueError as e:
            raise ValueError(f"[rank {self.rank}] {what}: {e}") from None

    def _peer(self, peer: Any, arg: str, what: str, allow_self: bool = True) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"[rank {self.rank}] {what}: {arg} must be an int, got {peer!r}")
        if not 0 <= peer < self.world_size or (not allow_self and peer == self.rank):
            raise ValueError(
                f"[rank {self.rank}] {what}: {arg}={peer} is out of range for world_size "
                f"{self.world_size}" + ("" if allow_self else " (and must not be this rank)")
            )
        return peer

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
        code, red = dtype_code(t.dtype), self._op(op, "all_reduce")
        algorithm = self._resolve(algorithm, "all_reduce")
        ptr, n = t.data_ptr(), t.numel()
        if algorithm == "nccl":
            launch = lambda s: self._comm.all_reduce(ptr, ptr, n, code, red, s)  # noqa: E731
        else:
            which = _ALGORITHM_CODES[algorithm]
            launch = lambda _s: self._algorithms.all_reduce(ptr, ptr, n, code, red, which)  # noqa: E731
        trace = [("all_reduce", code, int(red), -1, n, n)]
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
        code, red = dtype_code(out.dtype), self._op(op, "reduce_scatter")
        args = (inp.data_ptr(), out.data_ptr(), out.numel(), code, red)
        if self._resolve(algorithm, "reduce_scatter", REDUCE_SCATTER_ALGORITHMS) == "nccl":
            launch = lambda s: self._comm.reduce_scatter(*args, s)  # noqa: E731
        else:
            launch = lambda _s: self._algorithms.reduce_scatter(*args)  # noqa: E731
        trace = [("reduce_scatter", code, int(red), -1, inp.numel(), out.numel())]
        foreign = _foreign(output, input)
        return self._run("reduce_scatter", [out, inp], launch, async_op, foreign, trace)

    def all_gather(
        self, output: Any, input: Any, async_op: bool = False, *, algorithm: str = "auto"
    ) -> Any:
        """``output`` = every rank's ``input`` in rank order (``world_size * input.numel()``).

        "ring", "nccl" or "auto" (NCCL's); there is no tree all-gather: "tree" raises ValueError.
        """
        out, inp = self._pair(output, input, "all_gather", big="output")
        args = (inp.data_ptr(), out.data_ptr(), inp.numel(), dtype_code(out.dtype))
        if self._resolve(algorithm, "all_gather", ALL_GATHER_ALGORITHMS) == "nccl":
            launch = lambda s: self._comm.all_gather(*args, s)  # noqa: E731
        else:
            launch = lambda _s: self._algorithms.all_gather(*args)  # noqa: E731
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
        src = self._peer(src, "src", "broadcast")
        ptr, n, code = t.data_ptr(), t.numel(), dtype_code(t.dtype)
        if self._resolve(algorithm, "broadcast") == "nccl":
            launch = lambda s: self._comm.broadcast(ptr, ptr, n, code, src, s)  # noqa: E731
        else:  # chain or heap tree, by size
            launch = lambda _s: self._algorithms.broadcast(ptr, n, code, src)  # noqa: E731
        trace = [("broadcast", code, -1, src, n, n)]
        return self._run("broadcast", [t], launch, async_op, _foreign(tensor), trace)

    def send(self, tensor: Any, dst: int) -> None:
        """Sends ``tensor`` to rank ``dst`` (which calls :meth:`recv` with the same size)."""
        self._send_recv("send", (tensor, dst, False), None, False)

    def recv(self, tensor: Any, src: int) -> None:
        """Receives into ``tensor`` what rank ``src`` sends."""
        self._send_recv("recv", None, (tensor, src, False), False)

    def isend(self, tensor: Any, dst: int) -> Any:
        """Asynchronous :meth:`send` (ordered on the communicator's stream); returns a Work."""
        return self._send_recv("isend", (tensor, dst, False), None, True)

    def irecv(self, tensor: Any, src: int) -> Any:
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
            peer = self._peer(peer, peer_arg, what, allow_self=allow_self)
            sides += [t.data_ptr(), t.numel() * t.element_size(), peer]
            trace.append((arg, _trace_dtype(t), -1, peer, t.numel(), t.numel()))
        originals = _foreign(*(side[0] for side in (send, recv) if side is not None))
        launch = lambda _s: self._transport.send_recv(*sides)  # noqa: E731
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
        communicator. After a failure (or on timeout) it aborts instead of waiting."""
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
        """Aborts the NCCL communicator without waiting (``ncclCommAbort``: its kernels still
        on the device end too), for a peer that died; the communicator is closed after it."""
        if self._comm is None:
            return
        self._release(aborted=True)

    def _release(self, aborted: bool) -> None:
        self._algorithms = None
        self._transport = None
        self._held = []
        comm, self._comm = self._comm, None
        if comm.closed:  # NcclWatch aborted it already
            return
        if aborted:
            comm.abort()
        else:
            comm.close()

    def __enter__(self) -> CudaCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._comm is None else "open"
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, {state})"
        )


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


def _public_work(work: CudaWork, tensors: Tuple[torch.Tensor, ...]) -> Work:
    """The public :class:`Work` around ``work``, keeping ``tensors`` alive until it is waited."""
    return Work(work, tensors)
