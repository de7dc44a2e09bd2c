"""The Communicator: all-reduce, reduce-scatter, all-gather, broadcast, send/recv, barrier.

On CPU the ranks of one host talk through POSIX shared memory (``_C.CpuCommunicator``: ring
and double-binary-tree algorithms in C++, a queue of asynchronous calls, the GIL released);
ranks on different hosts go hierarchical (shared memory inside a host, torch.distributed
between host leaders). ``device="cuda"`` hands over to ``dist_kernels.comm.cuda``.

    import torch.distributed as dist, dist_kernels as dk
    dist.init_process_group("gloo")
    with dk.Communicator() as comm:
        comm.all_reduce(t)                       # in place, every rank gets identical bits
        buf = comm.empty((1024,))                # registered: peers read it in place
"""

from __future__ import annotations

import datetime
import itertools
import threading
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..dtypes import DTYPE_CODES, ReduceOp, ReduceOpLike, dtype_code
from . import algorithms
from .base import BaseCommunicator
from .host_layout import host_id as _host_id
from .timeout import resolve_timeout
from .work import Work

__all__ = [
    "Communicator",
    "Work",
    "init",
    "get_default_communicator",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "ReduceOp",
]

#: all_reduce's names -> codes (dist_kernels/comm/algorithms.py): a dict lookup on the hot path.
_ALL_REDUCE_CODES = algorithms.codes("cpu", "all_reduce")
_AUTO_ALL_REDUCE = _ALL_REDUCE_CODES["auto"]
_AUTO_ALL_GATHER = algorithms.codes("cpu", "all_gather")["auto"]

# Communicators of one group are told apart by creation order: every member creates them in
# the same order, so the n-th one of a group gets the same store prefix on every rank.
_creation_counters: Dict[Tuple[int, ...], itertools.count[int]] = {}
_store_counter = itertools.count()  # communicators made from a store (flight-recorder names)
_creation_lock = threading.Lock()


class Communicator(BaseCommunicator):
    """Collectives among the ranks of a torch ProcessGroup.

    Args:
        group: a torch.distributed ProcessGroup; default the WORLD group
            (``torch.distributed.init_process_group`` must have run).
        device: ``"cpu"`` (shared memory, hierarchical across hosts) or ``"cuda"`` (NCCL).
        timeout: per-collective timeout as a ``datetime.timedelta``; default ``DK_TIMEOUT``,
            else the group's when it was set, else 5 minutes (``comm/timeout.py``).
        store, rank, world_size: rendezvous on this Store as ``rank`` of ``world_size``
            instead of a torch group (all three or none; ``group`` must then be None). The
            store must be private to this communicator (a ``PrefixStore`` of its own): this is
            how the ``"dk"`` torch.distributed backend builds the communicator of a group
            before torch has registered it. Across hosts this path creates its own gloo
            groups from the same store.

    Every rank of the group must create its communicators in the same order. Collectives run
    in the order issued; ``async_op=True`` returns a :class:`Work`. A failed collective
    (dead peer, timeout, ranks that disagree) raises :class:`dist_kernels.CommError` on every
    rank and leaves the communicator unusable.
    """

    device_type = "cpu"

    def __new__(
        cls, group=None, device: Union[str, torch.device] = "cpu", timeout=None, **store_args
    ):
        if cls is Communicator and torch.device(device).type == "cuda":
            try:
                from .cuda import CudaCommunicator
            except ImportError as e:
                raise RuntimeError(
                    f"Communicator(device={str(device)!r}): the CUDA communicator is not "
                    f"available in this build ({e})"
                ) from e
            return CudaCommunicator(group=group, device=device, timeout=timeout, **store_args)
        return super().__new__(cls)

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        device: Union[str, torch.device] = "cpu",
        timeout: Optional[datetime.timedelta] = None,
        *,
        store: Optional[dist.Store] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"Communicator: device must be 'cpu' or 'cuda', got {device!r}")
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"Communicator: timeout must be a datetime.timedelta, got {timeout!r}")
        if store is None:
            self._from_group(group, rank, world_size)
        else:
            self._from_store(group, store, rank, world_size)
        from .shm import group_timeout

        group_default = group_timeout(self.group) if self.group is not None else None
        self.timeout = resolve_timeout(timeout, group_default)
        self._pending: List[Work] = []
        self._pending_lock = threading.Lock()
        self._closed = False
        self._backend = self._connect()
        self._track_open()

    def _from_group(self, group, rank, world_size) -> None:
        if rank is not None or world_size is not None:
            raise ValueError("Communicator: rank= and world_size= come with store=")
        if not dist.is_initialized():
            raise RuntimeError("Communicator: call torch.distributed.init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("Communicator: this process is not a member of `group`")
        self._store = None

    def _from_store(self, group, store, rank, world_size) -> None:
        if group is not None:
            raise ValueError("Communicator: pass either group= or store=, not both")
        if not isinstance(rank, int) or not isinstance(world_size, int):
            raise TypeError(
                f"Communicator: store= needs int rank= and world_size=, got {rank!r}, "
                f"{world_size!r}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"Communicator: rank {rank} is not in [0, world_size={world_size})")
        self.group = None
        self.rank, self.world_size = rank, world_size
        self._store = store

    # -- setup ---------------------------------------------------------------------------

    def _connect(self):
        from .shm import ShmBackend, wait_keys

        store, base = self._rendezvous_store()
        # Peers may arrive late (imports, other work): rendezvous waits as long as torch's
        # own store would, even when the collective timeout is short.
        rendezvous_timeout = max(self.timeout, base.timeout)
        store.set(f"host/{self.rank}", _host_id())
        wait_keys(store, [f"host/{r}" for r in range(self.world_size)], rendezvous_timeout)
        hosts = [store.get(f"host/{r}").decode() for r in range(self.world_size)]
        local = [r for r in range(self.world_size) if hosts[r] == hosts[self.rank]]
        host_store = dist.PrefixStore(f"host-{hosts[self.rank]}/", store)
        name, desc, ranks = self._debug_name
        if len(local) < self.world_size:  # the recorder sees this host's part of the group
            name = f"{name}:{hosts[self.rank]}"
        shm = ShmBackend(
            host_store,
            local.index(self.rank),
            len(local),
            self.timeout,
            rendezvous_timeout,
            self.rank,
            debug_group=(name, desc, [ranks[r] for r in local]),
        )
        self._debug_source = shm.debug_source
        if len(local) == self.world_size:
            return shm
        from .hierarchical import connect

        return connect(self, shm, hosts, store)

    def _rendezvous_store(self):
        """A store private to this communicator instance, and the store it is a prefix of.

        Also names the group for the flight recorder (``_debug_name``: name, description,
        global ranks); the "dk" torch backend renames its groups after torch's.
        """
        if self._store is not None:
            with _creation_lock:
                instance = next(_store_counter)
            ranks = list(range(self.world_size))
            self._debug_name = (f"dk:store:{instance}", "undefined", ranks)
            return dist.PrefixStore("dk/comm/", self._store), self._store
        global_ranks = tuple(dist.get_process_group_ranks(self.group))
        with _creation_lock:
            counter = _creation_counters.setdefault(global_ranks, itertools.count())
            instance = next(counter)
        name = f"dk:{self.group.group_name}" + (f":{instance}" if instance else "")
        desc = getattr(self.group, "group_desc", "") or "undefined"
        self._debug_name = (name, desc, list(global_ranks))
        tag = f"{zlib.crc32(repr(global_ranks).encode()):08x}"
        base = dist.distributed_c10d._get_default_store()
        return dist.PrefixStore(f"dk/comm/{tag}/{instance}/", base), base

    # -- checks (on the calling rank, before anything is sent) -------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"[rank {self.rank}] {what}: the communicator is closed")

    def _check_tensor(self, t: Any, arg: str, what: str) -> int:
        # The common case in a few attribute reads (t.device costs ~0.3 us, a third of an
        # 8-byte all-reduce's Python path); anything else takes the checks below, which
        # say what is wrong.
        if type(t) is torch.Tensor and t.is_cpu and t.is_contiguous():
            code = DTYPE_CODES.get(t.dtype)
            if code is not None:
                return code
        return self._check_tensor_slowly(t, arg, what)

    def _check_tensor_slowly(self, t: Any, arg: str, what: str) -> int:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"[rank {self.rank}] {what}: {arg} must be a torch.Tensor, got {type(t).__name__}"
            )
        if t.device.type != "cpu":
            raise ValueError(
                f"[rank {self.rank}] {what}: {arg} is on {t.device}, but this "
                f"communicator is on cpu"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"[rank {self.rank}] {what}: {arg} must be contiguous (call .contiguous() first)"
            )
        try:
            return dtype_code(t.dtype, arg)
        except TypeError as e:
            raise TypeError(f"[rank {self.rank}] {what}: {e}") from None

    def _finish(self, handle: Any, tensors: Tuple[torch.Tensor, ...], async_op: bool):
        if not async_op:
            return None
        work = handle if isinstance(handle, Work) else Work(handle, tensors)
        with self._pending_lock:  # isend and irecv may come from two threads
            self._pending = [w for w in self._pending if not w.is_completed()]
            self._pending.append(work)
        return work

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ReduceOp.SUM,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Optional[Work]:
        """Reduces ``tensor`` over all ranks, in place; every rank gets identical bits.

        Args:
            tensor: contiguous CPU tensor, the same shape and dtype on every rank.
            op: SUM, AVG, PROD, MIN or MAX (``torch.distributed.ReduceOp`` accepted).
            algorithm: "ring" (bandwidth), "tree" (latency at many ranks), "one_shot" (small
                messages: every rank reduces every input itself; up to one shared-memory
                slot, ``_C.shm_slot_bytes(world_size)``) or "auto" (by the cost model).
            async_op: return a :class:`Work` instead of waiting.
        """
        # The hot path of small messages: each step is the cheap form of the check it makes
        # (benchmarks/bench_mpi.py prints what the Python layer costs per call).
        if self._closed:
            self._check_open("all_reduce")
        code = self._check_tensor(tensor, "tensor", "all_reduce")
        op = op if type(op) is ReduceOp else self._op(op, "all_reduce")
        algo = _ALL_REDUCE_CODES.get(algorithm) if type(algorithm) is str else None
        if algo is None:
            algo = self._algorithm("all_reduce", algorithm)
        handle = self._backend.all_reduce(tensor, code, op, algo, async_op)  # op: an int
        return self._finish(handle, (tensor,), async_op) if async_op else None

    def _all_reduce_sum_checked(self, tensor: torch.Tensor, code: int) -> None:
        """all_reduce(tensor) (SUM, auto, synchronous) of a tensor the caller has already
        checked as :meth:`_check_tensor` does and whose dtype code it passes: ProcessGroupDK's
        hot path, which would otherwise make the same checks twice."""
        if self._closed:
            self._check_open("all_reduce")
        self._backend.all_reduce(tensor, code, ReduceOp.SUM, _AUTO_ALL_REDUCE, False)

    def _all_gather_checked(self, output: torch.Tensor, input: torch.Tensor, code: int) -> None:
        """all_gather(output, input) (auto, synchronous) of tensors the caller has already
        checked as :meth:`_check_whole_and_chunk` does: ProcessGroupDK's hot path."""
        if self._closed:
            self._check_open("all_gather")
        self._backend.all_gather(output, input, code, _AUTO_ALL_GATHER, False)

    def _broadcast_checked(self, tensor: torch.Tensor, code: int, src: int) -> None:
        """broadcast(tensor, src) (synchronous) of a tensor the caller has already checked as
        :meth:`_check_tensor` does and a ``src`` in range: ProcessGroupDK's hot path."""
        if self._closed:
            self._check_open("broadcast")
        self._backend.broadcast(tensor, code, src, False)

    def _check_whole_and_chunk(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        whole: str,
        chunk: str,
        opname: str,
    ) -> int:
        """Checks output/input of reduce_scatter or all_gather; returns the dtype code.

        ``whole`` names the argument holding every rank's chunk ("input" for reduce_scatter,
        "output" for all_gather); ``chunk`` names the one holding this rank's.
        """
        code = self._check_tensor(output, "output", opname)
        if self._check_tensor(input, "input", opname) != code:
            raise TypeError(
                f"[rank {self.rank}] {opname}: output dtype {output.dtype} "
                f"differs from input dtype {input.dtype}"
            )
        tensors = {"output": output, "input": input}
        if tensors[whole].numel() != self.world_size * tensors[chunk].numel():
            raise ValueError(
                f"[rank {self.rank}] {opname}: {whole}.numel() "
                f"({tensors[whole].numel()}) must equal world_size ({self.world_size}) * "
                f"{chunk}.numel() ({tensors[chunk].numel()})"
            )
        return code

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOpLike = ReduceOp.SUM,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Optional[Work]:
        """``output`` = this rank's chunk of the reduction of ``input`` over ranks.

        ``input.numel() == world_size * output.numel()``; chunk r is
        ``input.view(-1)[r * n:(r + 1) * n]``. ``algorithm``: "ring", "one_shot" (every rank
        sends each peer its chunk in one exchange and reduces its own chunk itself; a chunk of
        up to one shared-memory slot, ``_C.shm_slot_bytes(world_size)``, else the ring) or
        "auto" (by the cost model, on one host; across hosts an all-reduce of a copy, then this
        rank's chunk). There is no tree reduce-scatter: "tree" raises ValueError rather than
        silently running the ring.
        """
        self._check_open("reduce_scatter")
        code = self._check_whole_and_chunk(output, input, "input", "output", "reduce_scatter")
        op = self._op(op, "reduce_scatter")
        algo = self._algorithm("reduce_scatter", algorithm)
        handle = self._backend.reduce_scatter(output, input, code, int(op), algo, async_op)
        return self._finish(handle, (output, input), async_op)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        *,
        algorithm: str = "auto",
    ) -> Optional[Work]:
        """``output`` = concatenation of every rank's ``input``, in rank order.

        ``output.numel() == world_size * input.numel()``. ``algorithm``: "ring", "one_shot"
        (every rank sends its input to every peer in one exchange; an input of up to one
        shared-memory slot, else the ring) or "auto" (by the cost model); "tree" raises
        ValueError.
        """
        self._check_open("all_gather")
        code = self._check_whole_and_chunk(output, input, "output", "input", "all_gather")
        algo = self._algorithm("all_gather", algorithm)
        handle = self._backend.all_gather(output, input, code, algo, async_op)
        return self._finish(handle, (output, input), async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        send_counts: Optional[Sequence[int]] = None,
        recv_counts: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Optional[Work]:
        """Rank r's block p of ``input`` lands in block r of rank p's ``output``.

        Blocks lie back to back in rank order: ``send_counts[p]`` elements of ``input`` for
        rank p, ``recv_counts[p]`` elements of ``output`` from rank p (default: equal blocks
        of ``numel / world_size``). ``send_counts[p]`` on rank r must equal
        ``recv_counts[r]`` on rank p. Every peer at once, one exchange per message round
        (csrc/algorithm/all_to_all.h); a block in a registered buffer (:meth:`empty`) is
        copied once, by its receiver.
        """
        self._check_open("all_to_all")
        code = self._check_tensor(output, "output", "all_to_all")
        if self._check_tensor(input, "input", "all_to_all") != code:
            raise TypeError(
                f"[rank {self.rank}] all_to_all: output dtype {output.dtype} differs from "
                f"input dtype {input.dtype}"
            )
        sends = self._block_counts(send_counts, input, "send_counts")
        recvs = self._block_counts(recv_counts, output, "recv_counts")
        if output.numel() and input.numel() and output.data_ptr() == input.data_ptr():
            raise ValueError(f"[rank {self.rank}] all_to_all: output must not be input")
        if sends[self.rank] != recvs[self.rank]:
            raise ValueError(
                f"[rank {self.rank}] all_to_all: send_counts[{self.rank}] "
                f"({sends[self.rank]}) must equal recv_counts[{self.rank}] ({recvs[self.rank]})"
            )
        handle = self._backend.all_to_all(output, input, sends, recvs, code, async_op)
        return self._finish(handle, (output, input), async_op)

    def _block_counts(self, counts, t: torch.Tensor, arg: str) -> List[int]:
        n = self.world_size
        if counts is None:
            if t.numel() % n:
                raise ValueError(
                    f"[rank {self.rank}] all_to_all: {arg.split('_')[0]} numel ({t.numel()}) "
                    f"is not divisible by world_size ({n}); pass {arg}"
                )
            return [t.numel() // n] * n
        counts = [int(c) for c in counts]
        if len(counts) != n or min(counts) < 0 or sum(counts) != t.numel():
            raise ValueError(
                f"[rank {self.rank}] all_to_all: {arg} {counts} must be world_size ({n}) "
                f"non-negative counts summing to numel ({t.numel()})"
            )
        return counts

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Work]:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` on every rank."""
        self._check_open("broadcast")
        code = self._check_tensor(tensor, "tensor", "broadcast")
        self._check_peer(src, "src", "broadcast")
        handle = self._backend.broadcast(tensor, code, src, async_op)
        return self._finish(handle, (tensor,), async_op)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst`` (which calls :meth:`recv` with the same shape).

        Returns once ``tensor`` may be reused: small messages are copied into shared memory
        at once, larger ones wait for the receiver. A send and a receive may run at the same
        time on two threads of one rank. ``tag`` as in ``torch.distributed.send``: the
        receive that names it takes the message (see :meth:`recv`).
        """
        self._p2p("send", tensor, dst, async_op=False, tag=tag)

    def recv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> int:
        """Receives into ``tensor`` what rank ``src`` sends; returns the sender's rank.

        ``src=None`` receives from whichever rank sends first, as ``torch.distributed.recv``
        without ``src`` does (ranks are taken in turn when several have sent). A peer that
        died before sending raises :class:`CommError` for this call only: the communicator
        stays usable with the others, and :meth:`dead_peers` names it. One host only.

        ``tag``: the oldest message from ``src`` sent with this tag, as gloo and MPI match
        (NCCL ignores tags). Messages of other tags sent before it are received into memory
        of the communicator's own and kept for the receives that name their tags; messages
        received in the order they were sent are never copied twice.
        """
        if src is None:
            return self._recv_any(tensor, async_op=False, tag=tag)
        self._p2p("recv", tensor, src, async_op=False, tag=tag)
        return src

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Starts sending ``tensor`` to rank ``dst``; do not modify it before ``wait()``.

        Like ``torch.distributed.isend``: sends and receives started with :meth:`isend` and
        :meth:`irecv` may be issued in any order on the two ranks (a pending receive never
        holds up a send). Operations on one peer pair with one tag are matched in issue
        order; collectives issued after them run after them.
        """
        return self._p2p("send", tensor, dst, async_op=True, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> Work:
        """Starts receiving into ``tensor`` from rank ``src``; read it after ``wait()``.

        ``src=None``: from any rank, as :meth:`recv`; ``Work.source_rank()`` then names the
        sender once the receive has completed. ``tag``: as :meth:`recv`.
        """
        if src is None:
            return self._recv_any(tensor, async_op=True, tag=tag)
        return self._p2p("recv", tensor, src, async_op=True, tag=tag)

    def _recv_any(self, tensor: torch.Tensor, async_op: bool, tag: int = 0):
        self._check_open("recv")
        code = self._check_tensor(tensor, "tensor", "recv")
        tag = self._check_tag(tag, "recv")
        recv_any = getattr(self._backend, "recv_any", None)
        if recv_any is None:
            raise NotImplementedError(
                f"[rank {self.rank}] recv: receiving from any source works among the ranks of "
                f"one host; this communicator spans several: name the source rank"
            )
        handle = recv_any(tensor, code, async_op, tag)
        return self._finish(handle, (tensor,), async_op) if async_op else handle

    def _p2p(self, what: str, tensor: torch.Tensor, peer: int, async_op: bool, tag: int = 0):
        self._check_open(what)
        code = self._check_tensor(tensor, "tensor", what)
        self._check_peer(peer, "dst" if what == "send" else "src", what, allow_self=False)
        tag = self._check_tag(tag, what)
        handle = getattr(self._backend, what)(tensor, code, peer, async_op, tag)
        return self._finish(handle, (tensor,), async_op)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The timeout of every call started from now on (``torch.distributed``'s
        ``ProcessGroup.set_timeout``, which torchtitan lowers after its first step)."""
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(
                f"[rank {self.rank}] set_timeout: timeout must be a positive "
                f"datetime.timedelta, got {timeout!r}"
            )
        self._check_open("set_timeout")
        self._backend.set_timeout(timeout)
        self.timeout = timeout

    def dead_peers(self) -> List[int]:
        """Ranks found dead (their process exited holding this communicator), e.g. the one a
        receive from any source raised :class:`CommError` for."""
        self._check_open("dead_peers")
        dead_peers = getattr(self._backend, "dead_peers", None)
        return dead_peers() if dead_peers is not None else []

    def barrier(self, async_op: bool = False) -> Optional[Work]:
        """Returns once every rank has entered the barrier."""
        self._check_open("barrier")
        return self._finish(self._backend.barrier(async_op), (), async_op)

    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32):
        """A tensor in registered shared memory: collectives on it skip the copy-in.

        Collective: every rank calls it with the same shape and dtype. The memory stays
        valid as long as the tensor lives (registered until :meth:`close`).
        """
        self._check_open("empty")
        return self._backend.empty(self._buffer_shape(shape, dtype, "empty"), dtype)

    def _buffer_shape(self, shape: Union[int, Sequence[int]], dtype: torch.dtype, what: str):
        """``shape`` as a tuple of ints, after checking it and ``dtype`` (:meth:`empty`)."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"[rank {self.rank}] {what}: negative dimension in shape {shape}")
        try:
            dtype_code(dtype, "dtype")
        except TypeError as e:
            raise TypeError(f"[rank {self.rank}] {what}: {e}") from None
        return shape

    def empty_symmetric(
        self, shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32
    ) -> List[torch.Tensor]:
        """One registered tensor per rank, every one of them mapped into this process:
        ``bufs[r]`` is rank r's memory (``bufs[self.rank]`` this rank's own, as :meth:`empty`
        gives), so a rank can write straight into a peer's tensor, as torch's symmetric memory
        (``get_buffer(rank, ...)``) allows on GPUs.

        Collective, like :meth:`empty`. The writes of one rank are visible to the others after
        any collective that follows them (:meth:`barrier`); ordering the writes against the
        owner's reads is the caller's business. Only where every rank is on this host.
        """
        self._check_open("empty_symmetric")
        if not hasattr(self._backend, "empty_symmetric"):
            raise NotImplementedError(
                f"[rank {self.rank}] empty_symmetric: needs every rank on one host's shared "
                f"memory; this communicator spans {self.num_hosts} hosts"
            )
        shape = self._buffer_shape(shape, dtype, "empty_symmetric")
        return self._backend.empty_symmetric(shape, dtype)

    @property
    def num_hosts(self) -> int:
        """Hosts this communicator's ranks are on (more than one: the hierarchical backend)."""
        return getattr(self._backend, "hosts_n", 1)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def close(self) -> None:
        """Waits for outstanding collectives, then releases the shared memory."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        self._backend.close()

    def _close_at_exit(self) -> None:
        """Fails the open communicator on every rank rather than draining its queue."""
        backend = getattr(self, "_backend", None)
        if backend is not None and hasattr(backend, "abort"):
            backend.abort("exited with the communicator open")
            self.close()


# -- module-level calls on the default communicator -------------------------------------------

_default: Optional[Communicator] = None


def init(group: Optional[dist.ProcessGroup] = None, device=None) -> Communicator:
    """Creates the default communicator (device default: cuda if available, else cpu)."""
    global _default
    if _default is not None:
        _default.close()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    _default = Communicator(group=group, device=device)
    return _default


def get_default_communicator() -> Communicator:
    """The communicator made by :func:`init`; raises if there is none."""
    if _default is None or _default.closed:  # a CPU or a CUDA communicator
        raise RuntimeError("dist_kernels: call dist_kernels.init() first")
    return _default


def all_reduce(tensor, op=ReduceOp.SUM, algorithm="auto", async_op=False):
    """:meth:`Communicator.all_reduce` on the default communicator."""
    return get_default_communicator().all_reduce(tensor, op, algorithm, async_op)


def reduce_scatter(output, input, op=ReduceOp.SUM, algorithm="auto", async_op=False):
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return get_default_communicator().reduce_scatter(output, input, op, algorithm, async_op)


def all_gather(output, input, async_op=False, *, algorithm="auto"):
    """:meth:`Communicator.all_gather` on the default communicator."""
    return get_default_communicator().all_gather(output, input, async_op, algorithm=algorithm)


def broadcast(tensor, src, async_op=False):
    """:meth:`Communicator.broadcast` on the default communicator."""
    return get_default_communicator().broadcast(tensor, src, async_op)


def send(tensor, dst):
    """:meth:`Communicator.send` on the default communicator."""
    return get_default_communicator().send(tensor, dst)


def recv(tensor, src):
    """:meth:`Communicator.recv` on the default communicator."""
    return get_default_communicator().recv(tensor, src)


def isend(tensor, dst):
    """:meth:`Communicator.isend` on the default communicator."""
    return get_default_communicator().isend(tensor, dst)


def irecv(tensor, src):
    """:meth:`Communicator.irecv` on the default communicator."""
    return get_default_communicator().irecv(tensor, src)


def barrier(async_op=False):
    """:meth:`Communicator.barrier` on the default communicator."""
    return get_default_communicator().barrier(async_op)
