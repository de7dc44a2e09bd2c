"""The CUDA side of :class:`dist_kernels.Communicator` (``device="cuda"``).

Python owns everything here (the NCCL communicator, the communicator's stream, the staging
buffer); the C++ core borrows pointers and the stream handle (design decisions 1 and 3).

Stream semantics (design decision 7): each collective runs on the communicator's own stream,
ordered after the caller's current stream (the comm stream waits on an event recorded there) and
before later work on it (the caller's stream waits on an event recorded after the collective).
Only events are used, never host synchronisation, so a collective can be captured in a CUDA
graph. ``async_op=True`` returns a :class:`CudaWork` instead of making the caller's stream wait.

Inputs: torch CUDA tensors, and any array with ``__dlpack__`` or ``__cuda_array_interface__``
(CuPy), viewed as a torch tensor without a copy.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from . import _C, _nccl
from ._dtypes import ReduceOpLike, dtype_code, reduce_op

#: Staging for NcclTransport receives: 8 slots of 4 MiB. A slot is the largest message of one
#: algorithm step (the ring cuts its slices to fit); 8 covers the tree's two children per step
#: with room for the ring's pipelined slices. Not yet tuned on a GPU.
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

    def __init__(self, done: torch.cuda.Event, result: Any = None) -> None:
        self._done = done
        self._result = result

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Makes the caller's current stream wait for the collective (no host blocking)."""
        torch.cuda.current_stream().wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        """True once the device has finished the collective."""
        return self._done.query()

    def result(self) -> Any:
        return self._result


class CudaCommunicator:
    """One rank's NCCL communicator, its stream and its transport; see the module docstring.

    Args:
        store: a ``torch.distributed.Store`` through which rank 0 shares the ncclUniqueId.
        rank, world_size: this rank and the number of ranks.
        device: the CUDA device of this rank (default: the current device).
        prefix: a Store key prefix unique to this communicator.
        slot_bytes, num_slots: NcclTransport staging (multiple of 256 bytes; at least 1 slot).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        device: DeviceLike = None,
        prefix: str = "dist_kernels",
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        num_slots: int = DEFAULT_NUM_SLOTS,
    ) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"Communicator(device='cuda') is unavailable: {reason}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = _cuda_device(device)
        _nccl.load()
        key = f"{prefix}/nccl_unique_id"
        if rank == 0:
            store.set(key, _C.nccl_unique_id())
        unique_id = bytes(store.get(key))
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self._comm = _C.NcclComm(unique_id, rank, world_size, self.device.index)
            self._staging = torch.empty(
                slot_bytes * num_slots, dtype=torch.uint8, device=self.device
            )
            self._scratch = torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
        handle = self.stream.cuda_stream
        self._transport = _C.NcclTransport(
            self._comm, handle, self._staging.data_ptr(), slot_bytes, num_slots
        )
        # Ring and tree over NcclTransport + CudaCompute, once the algorithms are in the build.
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

    def _tensor(self, obj: Any, arg: str) -> torch.Tensor:
        return as_cuda_tensor(obj, self.device, arg)

    def _run(
        self, tensors: Sequence[torch.Tensor], launch: Callable[[int], None], async_op: bool
    ) -> Optional[CudaWork]:
        """Runs ``launch(stream_handle)`` on the comm stream, ordered by events around it."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            launch(self.stream.cuda_stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        if async_op and not torch.cuda.is_current_stream_capturing():
            for tensor in tensors:  # the allocator must not reuse them before the comm stream ends
                tensor.record_stream(self.stream)
        work = CudaWork(done, tensors[0] if tensors else None)
        if async_op:
            return work
        work.wait()
        return None

    def _resolve(self, algorithm: str) -> str:
        """ "auto" is NCCL's own collective on GPUs: its tuning is the better default until our
        ring and tree over NCCL send/recv have been measured on a GPU."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: {algorithm!r} is not one of {ALGORITHMS}")
        if algorithm == "auto":
            return "nccl"
        if algorithm != "nccl" and self._algorithms is None:
            raise RuntimeError(
                f"algorithm={algorithm!r}: this build has no ring/tree CUDA communicator "
                "(_C.CudaCommunicator); use algorithm='nccl'"
            )
        return algorithm

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(
        self, tensor: Any, op: ReduceOpLike = "sum", async_op: bool = False, algorithm: str = "auto"
    ) -> Optional[CudaWork]:
        """In-place all-reduce of ``tensor`` over every rank."""
        t = self._tensor(tensor, "tensor")
        code, red = dtype_code(t.dtype), int(reduce_op(op))
        algorithm = self._resolve(algorithm)
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
        op: ReduceOpLike = "sum",
        async_op: bool = False,
        algorithm: str = "auto",
    ) -> Optional[CudaWork]:
        """``output`` (n elements) gets this rank's shard of the reduction of ``input`` (n * ws)."""
        out, inp = self._tensor(output, "output"), self._tensor(input, "input")
        self._check_same_dtype(out, inp)
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"[rank {self.rank}] reduce_scatter: input has {inp.numel()} elements, expected "
                f"output.numel() * world_size = {out.numel()} * {self.world_size}"
            )
        code, red = dtype_code(out.dtype), int(reduce_op(op))
        args = (inp.data_ptr(), out.data_ptr(), out.numel(), code, red)
        if self._resolve(algorithm) == "nccl":
            launch = lambda s: self._comm.reduce_scatter(*args, s)  # noqa: E731
        else:  # ring (the tree has no reduce-scatter)
            launch = lambda _s: self._algorithms.reduce_scatter(*args)  # noqa: E731
        return self._run([out, inp], launch, async_op)

    def all_gather(
        self, output: Any, input: Any, async_op: bool = False, algorithm: str = "auto"
    ) -> Optional[CudaWork]:
        """``output`` (n * ws elements) gets every rank's ``input`` (n elements), in rank order."""
        out, inp = self._tensor(output, "output"), self._tensor(input, "input")
        self._check_same_dtype(out, inp)
        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(
                f"[rank {self.rank}] all_gather: output has {out.numel()} elements, expected "
                f"input.numel() * world_size = {inp.numel()} * {self.world_size}"
            )
        code = dtype_code(out.dtype)
        args = (inp.data_ptr(), out.data_ptr(), inp.numel(), code)
        if self._resolve(algorithm) == "nccl":
            launch = lambda s: self._comm.all_gather(*args, s)  # noqa: E731
        else:  # ring
            launch = lambda _s: self._algorithms.all_gather(*args)  # noqa: E731
        return self._run([out, inp], launch, async_op)

    def broadcast(
        self, tensor: Any, src: int = 0, async_op: bool = False, algorithm: str = "auto"
    ) -> Optional[CudaWork]:
        """Copies rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        t = self._tensor(tensor, "tensor")
        if not 0 <= src < self.world_size:
            raise ValueError(f"src: {src} is not in [0, world_size={self.world_size})")
        code = dtype_code(t.dtype)
        ptr, n = t.data_ptr(), t.numel()
        if self._resolve(algorithm) == "nccl":
            launch = lambda s: self._comm.broadcast(ptr, ptr, n, code, src, s)  # noqa: E731
        else:  # chain or heap tree, by size
            launch = lambda _s: self._algorithms.broadcast(ptr, n, code, src)  # noqa: E731
        return self._run([t], launch, async_op)

    def send_recv(
        self,
        send: Optional[Any],
        dst: int,
        recv: Optional[Any],
        src: int,
        async_op: bool = False,
    ) -> Optional[CudaWork]:
        """Sends ``send`` to ``dst`` while receiving ``recv`` from ``src`` (NcclTransport).

        Either side may be None. Bytes move through the transport's staging slots.
        """
        tensors: List[torch.Tensor] = []
        send_ptr = send_bytes = recv_ptr = recv_bytes = 0
        if send is not None:
            s = self._tensor(send, "send")
            tensors.append(s)
            send_ptr, send_bytes = s.data_ptr(), s.numel() * s.element_size()
        if recv is not None:
            r = self._tensor(recv, "recv")
            tensors.append(r)
            recv_ptr, recv_bytes = r.data_ptr(), r.numel() * r.element_size()
        for name, peer in (("dst", dst), ("src", src)):
            if not -1 <= peer < self.world_size:
                raise ValueError(f"{name}: {peer} is not in [0, world_size={self.world_size})")
        dst, src = (dst if send is not None else -1), (src if recv is not None else -1)
        args = (send_ptr, send_bytes, dst, recv_ptr, recv_bytes, src)
        return self._run(tensors, lambda _s: self._transport.send_recv(*args), async_op)

    def barrier(self) -> None:
        """Returns once every rank has reached the barrier and this rank's work is done."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.all_reduce(flag)
        torch.cuda.current_stream(self.device).synchronize()

    def empty(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor on this communicator's device (NCCL-registered memory is future work)."""
        dtype_code(dtype, "dtype")
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _check_same_dtype(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if out.dtype != inp.dtype:
            raise TypeError(f"output: dtype {out.dtype} differs from input's {inp.dtype}")

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for this communicator's work, then destroys the NCCL communicator."""
        if self._comm is None:
            return
        self.stream.synchronize()
        self._algorithms = None
        self._transport = None
        self._comm.close()
        self._comm = None

    def __enter__(self) -> CudaCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
