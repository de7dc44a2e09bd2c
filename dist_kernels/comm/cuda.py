"""The CUDA side of :class:`dist_kernels.Communicator` (``device="cuda"``).

Python owns everything here (the NCCL communicator, the communicator's stream, the staging
buffer); the C++ core borrows pointers and the stream handle (design decisions 1 and 3).

Stream semantics (design decision 7): each collective runs on the communicator's own stream,
ordered after the caller's current stream (the comm stream waits on an event recorded there) and
before later work on it (the caller's stream waits on an event recorded after the collective).
Only events are used, never host synchronisation, so a collective can be captured in a CUDA
graph. ``async_op=True`` returns a ``dist_kernels.Work`` (around a :class:`CudaWork`) instead of
making the caller's stream wait; its ``wait()`` makes the then-current stream wait, as
torch.distributed's NCCL work does.

Inputs: torch CUDA tensors, and any array with ``__dlpack__`` or ``__cuda_array_interface__``
(CuPy), viewed as a torch tensor without a copy.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _C
from ..dtypes import ReduceOp, ReduceOpLike, dtype_code, reduce_op
from . import nccl
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

DeviceLike = Union[torch.device, int, str, None]


def unavailable_reason() -> Optional[str]:
    """Why a CUDA communicator cannot be made here, or None when it can."""
    if not getattr(_C, "build_info", lambda: {})().get("cuda_compiled", False):
        return "dist_kernels was built without CUDA (DK_WITH_CUDA=0 or no nvcc at build time)"
    if not hasattr(_C, "NcclComm"):
        return "this build of dist_kernels._C has no NCCL communicator"
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


class CudaWork:
    """Completion of one collective on the communicator's stream."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self._done = done

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Makes the caller's current stream wait for the collective (no host blocking)."""
        torch.cuda.current_stream().wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        """True once the device has finished the collective."""
        return self._done.query()


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
        timeout: how long to wait for rank 0's ncclUniqueId (a ``datetime.timedelta``).
        store, rank, world_size: use this Store and these numbers instead of torch.distributed
            (tests and custom launchers); all three or none.
        slot_bytes, num_slots: NcclTransport staging (a multiple of 256 bytes; at least 1).
    """

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
        if store is not None and (rank is None or world_size is None):
            raise ValueError("store: pass rank= and world_size= with it")
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"Communicator(device='cuda') is unavailable: {reason}")
        if store is None:
            store, rank, world_size = _group_store(group)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = _cuda_device(device)
        nccl.load()
        if rank == 0:
            store.set("nccl_unique_id", _C.nccl_unique_id())
        if timeout is not None:
            store.wait(["nccl_unique_id"], timeout)
        unique_id = bytes(store.get("nccl_unique_id"))
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self._comm = _C.NcclComm(unique_id, rank, world_size, self.device.index)
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

    def _tensor(self, obj: Any, arg: str, what: str) -> torch.Tensor:
        if self._comm is None:
            raise RuntimeError(f"[rank {self.rank}] {what}: the communicator is closed")
        try:
            return as_cuda_tensor(obj, self.device, arg)
        except (TypeError, ValueError) as e:
            raise type(e)(f"[rank {self.rank}] {what}: {e}") from None

    def _run(
        self, tensors: Sequence[torch.Tensor], launch: Callable[[int], None], async_op: bool
    ) -> Any:
        """Runs ``launch(stream_handle)`` on the comm stream, ordered by events around it."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            launch(self.stream.cuda_stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        work = CudaWork(done)
        if not async_op:
            work.wait()
            return None
        if not torch.cuda.is_current_stream_capturing():
            for tensor in tensors:  # the allocator must not reuse them before the comm stream ends
                tensor.record_stream(self.stream)
        return _public_work(work, tuple(tensors))

    def _resolve(self, algorithm: str, what: str) -> str:
        """ "auto" is NCCL's own collective on GPUs: its tuning is the better default until our
        ring and tree over NCCL send/recv have been measured on a GPU."""
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"[rank {self.rank}] {what}: algorithm must be one of {ALGORITHMS}, "
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
        return self._run([t], launch, async_op)

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOpLike = ReduceOp.SUM,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Any:
        """``output`` = this rank's chunk of the reduction of ``input`` over ranks.

        ``input.numel() == world_size * output.numel()``; "ring" or "nccl" ("tree" has none).
        """
        out, inp = self._pair(output, input, "reduce_scatter", big="input")
        code, red = dtype_code(out.dtype), self._op(op, "reduce_scatter")
        args = (inp.data_ptr(), out.data_ptr(), out.numel(), code, red)
        if self._resolve(algorithm, "reduce_scatter") == "nccl":
            launch = lambda s: self._comm.reduce_scatter(*args, s)  # noqa: E731
        else:
            launch = lambda _s: self._algorithms.reduce_scatter(*args)  # noqa: E731
        return self._run([out, inp], launch, async_op)

    def all_gather(
        self, output: Any, input: Any, async_op: bool = False, *, algorithm: str = "auto"
    ) -> Any:
        """``output`` = every rank's ``input`` in rank order (``world_size * input.numel()``)."""
        out, inp = self._pair(output, input, "all_gather", big="output")
        args = (inp.data_ptr(), out.data_ptr(), inp.numel(), dtype_code(out.dtype))
        if self._resolve(algorithm, "all_gather") == "nccl":
            launch = lambda s: self._comm.all_gather(*args, s)  # noqa: E731
        else:
            launch = lambda _s: self._algorithms.all_gather(*args)  # noqa: E731
        return self._run([out, inp], launch, async_op)

    def broadcast(
        self, tensor: Any, src: int, async_op: bool = False, *, algorithm: str = "auto"
    ) -> Any:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` on every rank."""
        t = self._tensor(tensor, "tensor", "broadcast")
        src = self._peer(src, "src", "broadcast")
        ptr, n, code = t.data_ptr(), t.numel(), dtype_code(t.dtype)
        if self._resolve(algorithm, "broadcast") == "nccl":
            launch = lambda s: self._comm.broadcast(ptr, ptr, n, code, src, s)  # noqa: E731
        else:  # chain or heap tree, by size
            launch = lambda _s: self._algorithms.broadcast(ptr, n, code, src)  # noqa: E731
        return self._run([t], launch, async_op)

    def send(self, tensor: Any, dst: int) -> None:
        """Sends ``tensor`` to rank ``dst`` (which calls :meth:`recv` with the same size)."""
        t = self._tensor(tensor, "tensor", "send")
        self.send_recv(t, self._peer(dst, "dst", "send", allow_self=False), None, -1)

    def recv(self, tensor: Any, src: int) -> None:
        """Receives into ``tensor`` what rank ``src`` sends."""
        t = self._tensor(tensor, "tensor", "recv")
        self.send_recv(None, -1, t, self._peer(src, "src", "recv", allow_self=False))

    def isend(self, tensor: Any, dst: int) -> Any:
        """Asynchronous :meth:`send` (ordered on the communicator's stream); returns a Work."""
        t = self._tensor(tensor, "tensor", "isend")
        return self.send_recv(
            t, self._peer(dst, "dst", "isend", allow_self=False), None, -1, async_op=True
        )

    def irecv(self, tensor: Any, src: int) -> Any:
        """Asynchronous :meth:`recv` (ordered on the communicator's stream); returns a Work."""
        t = self._tensor(tensor, "tensor", "irecv")
        return self.send_recv(
            None, -1, t, self._peer(src, "src", "irecv", allow_self=False), async_op=True
        )

    def send_recv(
        self, send: Optional[Any], dst: int, recv: Optional[Any], src: int, async_op: bool = False
    ) -> Any:
        """Sends ``send`` to ``dst`` while receiving ``recv`` from ``src``, in one NCCL group
        per message (so two ranks may exchange without deadlock). Either side may be None."""
        tensors: List[torch.Tensor] = []
        sides = []
        for obj, peer, arg in ((send, dst, "send"), (recv, src, "recv")):
            if obj is None:
                sides += [0, 0, -1]
                continue
            t = self._tensor(obj, arg, "send_recv")
            tensors.append(t)
            sides += [t.data_ptr(), t.numel() * t.element_size(), self._peer(peer, arg, arg)]
        return self._run(tensors, lambda _s: self._transport.send_recv(*sides), async_op)

    def barrier(self, async_op: bool = False) -> Any:
        """Every rank reaches it before any leaves (a one-element NCCL all-reduce); without
        ``async_op`` the host also waits for this communicator's work."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        work = self.all_reduce(flag, algorithm="nccl", async_op=async_op)
        if not async_op:
            torch.cuda.current_stream(self.device).synchronize()
        return work

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
        """Waits for this communicator's work, then destroys the NCCL communicator."""
        if self._comm is None:
            return
        self.stream.synchronize()
        self._algorithms = None
        self._transport = None
        comm, self._comm = self._comm, None
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


def _public_work(work: CudaWork, tensors: Tuple[torch.Tensor, ...]) -> Work:
    """The public :class:`Work` around ``work``, keeping ``tensors`` alive until it is waited."""
    return Work(work, tensors)
