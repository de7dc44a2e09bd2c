"""ProcessGroupDK: torch.distributed's ProcessGroup on dist_kernels' communicators.

Each torch collective is mapped onto the Communicator's (all_reduce, reduce_scatter,
all_gather, broadcast, send/recv, barrier, all_to_all); the forms torch has and we do not are
composed from them, moving no more data than gloo does:

    reduce            all_reduce (non-roots reduce a copy: their tensor stays as it was)
    gather / scatter  point-to-point between the root and each rank
    list forms        one flat buffer, copied out once the collective completes
    coalesced forms   one flat all_reduce per dtype; the others one collective per tensor
    PREMUL_SUM        scale (this rank's copy of) the input, then SUM

A call with ``opts.asyncOp`` False (``dist.all_reduce(t)`` without ``async_op``) runs inline
on the caller's thread, our fastest path; an asynchronous one is queued on the communicator's
progress thread and returns a :class:`~.work.DkWork`. Arguments are checked on the calling
rank before anything is sent; a failed collective raises ``torch.distributed.DistBackendError``
with our CommError's message.
"""

from __future__ import annotations

import datetime
import functools
import math
import sys
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from .. import ops
from ..dtypes import DTYPE_CODES, ReduceOp
from ..errors import CommError
from . import BACKEND_NAME
from .dynamo import skip_module
from .routes import Routes, device_backends
from .work import Completions, DkWork, to_dist_error

# torch's ReduceOp kind (its int value: hashing the pybind enum costs more than the rest of
# the call's checks) -> ours; PREMUL_SUM becomes SUM after scaling
_SUM = dist.ReduceOp.SUM
_RED_OPS = {
    dist.ReduceOp.RedOpType.SUM.value: ReduceOp.SUM,
    dist.ReduceOp.RedOpType.AVG.value: ReduceOp.AVG,
    dist.ReduceOp.RedOpType.PRODUCT.value: ReduceOp.PROD,
    dist.ReduceOp.RedOpType.MIN.value: ReduceOp.MIN,
    dist.ReduceOp.RedOpType.MAX.value: ReduceOp.MAX,
}
# torch's ReduceOps that act on a complex tensor's real and imaginary parts apart.
_COMPLEX_OPS = {
    dist.ReduceOp.RedOpType.SUM.value,
    dist.ReduceOp.RedOpType.AVG.value,
    dist.ReduceOp.RedOpType.PREMUL_SUM.value,
}
# torch's ReduceOp -> ours on a bool tensor's bytes (ProcessGroupDK._bool_op).
_BOOL_OPS = {
    dist.ReduceOp.RedOpType.SUM.value: ReduceOp.MAX,
    dist.ReduceOp.RedOpType.PRODUCT.value: ReduceOp.MIN,
    dist.ReduceOp.RedOpType.MIN.value: ReduceOp.MIN,
    dist.ReduceOp.RedOpType.MAX.value: ReduceOp.MAX,
    dist.ReduceOp.RedOpType.BAND.value: ReduceOp.MIN,
    dist.ReduceOp.RedOpType.BOR.value: ReduceOp.MAX,
}
# torch's bitwise ReduceOps on integer tensors (and BXOR on bool), which we reduce by
# exchanging every rank's tensor and folding the copies locally (ProcessGroupDK._bitwise).
_BITWISE = {
    dist.ReduceOp.RedOpType.BAND.value: torch.bitwise_and,
    dist.ReduceOp.RedOpType.BOR.value: torch.bitwise_or,
    dist.ReduceOp.RedOpType.BXOR.value: torch.bitwise_xor,
}


def create_process_group(common_opts) -> ProcessGroupDK:
    """The creator torch calls (through ``torch_backend._create``) for each "dk" group."""
    return ProcessGroupDK(
        common_opts.store,
        common_opts.group_rank,
        common_opts.group_size,
        common_opts.timeout,
        group_name=str(common_opts.group_id),
    )


def _kind(op: Any) -> Any:
    """torch's ReduceOp kind (RedOpType) of a ReduceOp or of a kind."""
    return op.op if isinstance(op, dist.ReduceOp) else op


def _device_of(args: Sequence[Any]) -> Optional[torch.device]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            device = _device_of(a)
            if device is not None:
                return device
    return None


def _routed(torch_name: str) -> Callable:
    """Runs the method on our communicator, or hands the call to the torch backend of the
    tensors' device (as ``torch_name``, the Backend's name for it); our CommError becomes
    torch's DistBackendError."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def method(self: ProcessGroupDK, *args: Any, **kwargs: Any) -> Any:
            if self._routes.backends is None:  # the group's first call
                self._resolve_routes()
            if self._routes.delegates:  # only mixed-device groups pay for the lookup
                backend = self._routes.delegate(_device_of([*args, *kwargs.values()]))
                if backend is not None:
                    return getattr(backend, torch_name)(*args, **kwargs)
            try:
                return fn(self, *args, **kwargs)
            except CommError as e:
                raise to_dist_error(e) from e
            except _NotStrided as e:
                raise NotImplementedError(
                    f"{self._what(torch_name)}: a {e.layout} tensor; this backend takes dense "
                    f"(strided) tensors, and sparse COO ones in all_reduce (SUM): call "
                    f".to_dense() first"
                ) from None

        return method

    return wrap


class _NotStrided(Exception):
    """A sparse or other non-strided tensor reached a collective (``_routed`` names both)."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__(str(layout))
        self.layout = layout


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous strided tensor (a copy when it is not one); raises _NotStrided
    for a sparse, nested or other non-strided tensor (their storage is not one buffer)."""
    if t.layout is not torch.strided:
        raise _NotStrided(t.layout)
    return t.contiguous()


def _reducible(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the reductions take it, a view sharing its storage (results land in ``t``): a
    bool tensor's bytes (0 or 1 each) as uint8; a complex tensor's real and imaginary parts as
    floats (SUM and AVG act on them apart; ProcessGroupDK._op refuses the other ops); others as
    they are."""
    if t.dtype is torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t).view(-1)
    return t


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor; for dtypes we do not reduce, their bytes (data movement)."""
    flat = _dense(t).view(-1)
    if t.dtype not in DTYPE_CODES:
        flat = flat.contiguous().view(torch.uint8)
    return flat


# gather and scatter travel as point-to-point messages under this tag, so a user's pending
# send or receive of another tag (0 by default) between the same ranks is never paired with
# them (gloo runs them as collectives of their own). Nonnegative: gloo carries it across hosts.
_GATHER_SCATTER_TAG = 2**31 - 1


class _Staged:
    """A contiguous tensor standing for ``t``, and the copy back when it is not ``t`` itself."""

    def __init__(self, t: torch.Tensor) -> None:
        self.target = t
        self.buf = t if t.is_contiguous() else _dense(t)

    def copy_back(self) -> None:
        if self.buf is not self.target:
            self.target.copy_(self.buf)


class ProcessGroupDK(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives run on dist_kernels.

    Made by torch through the registered creator (``init_process_group("dk")``,
    ``new_group(backend="dk")``, DeviceMesh); not meant to be constructed directly.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        group_name: str = "",
    ) -> None:
        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self._group_name, self._group_desc = group_name, ""
        self._timeout = timeout
        label = f"[rank {rank}] dk group {group_name!r}"
        self._completions = Completions(timeout)
        self._routes = Routes(store, rank, world_size, timeout, label)
        self._cpu: Optional[Any] = None  # our CPU communicator, once the routes say it serves
        # allreduce's hot path (set with the routes: CPU calls ours, no device delegated)
        self._fast_all_reduce: Optional[Callable[[torch.Tensor, int], None]] = None
        self._fast_all_gather: Optional[Callable[[torch.Tensor, torch.Tensor, int], None]] = None
        self._fast_broadcast: Optional[Callable[[torch.Tensor, int, int], None]] = None
        self._sync_done = DkWork.reusable(self._completions)  # what the hot paths return
        self._name_recorder()

    # -- identity (torch's DeviceMesh, FSDP2 and functional collectives look groups up by name)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name
        self._name_recorder()

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc
        self._name_recorder()

    def _name_recorder(self) -> None:
        """Flight-recorder dumps and profiler events name the group as torch does."""
        source = getattr(self._routes.ours_on_cpu(), "_debug_source", None)
        if source is not None:
            source.rename(self._group_name, self._group_desc or "undefined", self._global_ranks)

    def _global_ranks(self) -> List[int]:
        try:
            return dist.get_process_group_ranks(self)
        except (KeyError, RuntimeError, ValueError):  # not registered with torch (yet)
            return list(range(self._world_size))

    def __repr__(self) -> str:
        return (
            f"ProcessGroupDK(rank={self._rank}, world_size={self._world_size}, "
            f"name={self._group_name!r}, devices={self._routes.backends})"
        )

    def communicator(self, device: str = "cpu") -> Any:
        """Our communicator serving ``device`` in this group (the benchmark times it directly,
        beside the same collectives through this group, to show this layer's overhead)."""
        if self._routes.backends is None:
            self._resolve_routes()
        return self._routes.comm(torch.device(device), "communicator")

    def _resolve_routes(self) -> None:
        """The device table, from the backend string torch recorded for this group once it
        was made (routes.py says why not earlier)."""
        self._routes.resolve(device_backends(self))
        self._cpu = self._routes.ours_on_cpu()
        if self._cpu is not None and not self._routes.delegates:
            self._fast_all_reduce = self._cpu._all_reduce_sum_checked
            self._fast_all_gather = self._cpu._all_gather_checked
            self._fast_broadcast = self._cpu._broadcast_checked

    # -- devices (torch registers no per-device backend on a Python group: ours is its own)

    @property
    def _device_types(self) -> List[torch.device]:
        """The device types this group serves, as torch's groups list their registered
        backends'. torch's own table stays empty for a group its creator made, and torch reads
        it: ``set_model_state_dict(..., broadcast_from_rank0=True)`` takes its first entry
        (IndexError on an empty list) and ``dcp.async_save`` requires CPU in it."""
        return [torch.device(kind) for kind in self._device_table()]

    def _get_backend(self, device: Any) -> Any:
        """What torch's helpers read as the backend of ``device``: the torch backend this group
        hands that device to, once made, else a :class:`BackendView` of this group.
        RuntimeError, as torch's, for a device the group does not serve."""
        kind, backends = torch.device(device).type, self._device_table()
        if kind not in backends:
            raise RuntimeError(
                f"{self._what('_get_backend')}: no backend for device type {kind!r}; this group "
                f"serves {', '.join(f'{d}:{b}' for d, b in backends.items())}"
            )
        held = self._routes.held(kind)
        return held if held is not None else BackendView(self)

    def _device_table(self) -> Dict[str, str]:
        """device type -> backend: the routes once resolved, else what torch recorded."""
        return self._routes.backends or device_backends(self)

    # -- helpers ---------------------------------------------------------------------------

    def _what(self, what: str) -> str:
        return f"[rank {self._rank}] dk backend: {what}"

    def _comm(self, tensor: Optional[torch.Tensor], what: str) -> Any:
        if self._cpu is not None and (tensor is None or tensor.is_cpu):
            return self._cpu  # the common case, without the routing table's lookups
        return self._routes.comm(tensor.device if tensor is not None else None, what)

    def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise NotImplementedError(
                f"{self._what(what)}: takes one tensor per call, got {len(tensors)} (the "
                f"multi-device list form is not supported: call once per tensor)"
            )
        return tensors[0]

    @staticmethod
    def _plain_pair(output: Any, input: Any) -> Optional[int]:
        """The dtype code when output and input are plain contiguous CPU tensors of one dtype
        we reduce (the hot paths' test; anything else takes the checked route)."""
        if type(output) is not torch.Tensor or type(input) is not torch.Tensor:
            return None
        if output.dtype is not input.dtype or not (output.is_cpu and input.is_cpu):
            return None
        if not (output.is_contiguous() and input.is_contiguous()):
            return None
        return DTYPE_CODES.get(output.dtype)

    def _list_of_world(
        self, tensors: Sequence[torch.Tensor], like: torch.Tensor, arg: str, what, even=True
    ) -> bool:
        """Checks a per-rank list against the local tensor: world_size entries of its dtype and
        device, of its size too where ``even``; returns whether all sizes equal its size. The
        entry of this rank must always match it."""
        if len(tensors) != self._world_size:
            raise ValueError(
                f"{self._what(what)}: {arg} has {len(tensors)} tensors, expected world_size "
                f"({self._world_size})"
            )
        for r, t in enumerate(tensors):
            mine = r == self._rank
            if (t.numel() != like.numel() and (even or mine)) or (
                t.dtype != like.dtype or t.device != like.device
            ):
                raise NotImplementedError(
                    f"{self._what(what)}: {arg}[{r}] is {tuple(t.shape)} {t.dtype} on "
                    f"{t.device}, but the local tensor is {tuple(like.shape)} {like.dtype} on "
                    f"{like.device}"
                    + ("; uneven sizes are not supported (pad to one size)" if even else "")
                )
        return all(t.numel() == like.numel() for t in tensors)

    def _op(self, op: Any, t: torch.Tensor, what: str) -> Tuple[ReduceOp, Optional[Any]]:
        """(our op, PREMUL_SUM factor or None) for torch's ReduceOp."""
        kind = _kind(op)
        if t.dtype is torch.bool:
            return self._bool_op(kind, what), None
        if t.is_complex() and kind.value not in _COMPLEX_OPS:
            raise ValueError(
                f"{self._what(what)}: ReduceOp {kind} on a complex tensor; complex tensors "
                f"reduce with SUM, AVG and PREMUL_SUM (as torch's backends)"
            )
        ours = _RED_OPS.get(kind.value)
        if ours is not None:
            return ours, None
        if kind == dist.ReduceOp.PREMUL_SUM:
            if not (t.is_floating_point() or t.is_complex()):
                raise NotImplementedError(
                    f"{self._what(what)}: PREMUL_SUM on {t.dtype}; it needs a floating dtype"
                )
            return ReduceOp.SUM, op.factor
        if kind.value in _BITWISE:
            raise TypeError(
                f"{self._what(what)}: ReduceOp {kind} on a {t.dtype} tensor; bitwise ops take "
                f"integer and bool tensors (as gloo)"
            )
        raise NotImplementedError(
            f"{self._what(what)}: ReduceOp {kind} is not supported (SUM, AVG, PRODUCT, MIN, "
            f"MAX, PREMUL_SUM, BAND, BOR and BXOR are)"
        )

    def _bitwise(self, op: Any, t: torch.Tensor) -> Optional[Callable]:
        """torch's function for a BAND, BOR or BXOR on an integer tensor or a BXOR on a bool
        one, else None (bool BAND and BOR reduce as MIN and MAX, see _bool_op; other dtypes
        reach _op, which refuses them). Our kernels have no bitwise ops, so these collectives
        exchange every rank's tensor (:meth:`_gather_fold`, :meth:`_exchange_reduce`) and
        fold the copies here: as much data as a ring all-reduce at 2 ranks, (n - 1) / 2 times
        more at n; results exact, so every rank holds the same bits."""
        if t.is_floating_point() or t.is_complex():  # the common case, before reading the op
            return None
        fn = _BITWISE.get(_kind(op).value)
        if fn is None:
            return None
        if t.dtype is torch.bool and fn is not torch.bitwise_xor:
            return None
        return fn

    def _gather_fold(self, t: torch.Tensor, fold: Callable, async_op: bool, what: str):
        """All-reduce of ``t`` by all-gather and a local fold: (handle, the result's getter,
        valid once the handle completed)."""
        n, flat = self._world_size, _dense(t).view(-1)
        gathered = torch.empty(n * flat.numel(), dtype=t.dtype, device=t.device)
        handle = self._comm(t, what).all_gather(_flat(gathered), _flat(flat), async_op=async_op)
        return handle, lambda: functools.reduce(fold, gathered.view(n, -1).unbind(0))

    def _bool_op(self, kind: Any, what: str) -> ReduceOp:
        """Our op on a bool tensor's bytes (see _reducible): as torch's NCCL backend does,
        SUM is MAX (a sum of bytes could wrap to 0, and a bool byte must stay 0 or 1), PRODUCT
        is MIN; BAND and BOR, which gloo also takes on bool, are MIN and MAX."""
        ours = _BOOL_OPS.get(kind.value)
        if ours is None:
            raise TypeError(
                f"{self._what(what)}: ReduceOp {kind} on a bool tensor; SUM, PRODUCT, MIN, "
                f"MAX, BAND, BOR and BXOR are supported (AVG of booleans is undefined, as in "
                f"torch)"
            )
        return ours

    def _work(self, handles, result, finish=None) -> DkWork:
        return DkWork(handles, result, finish, self._completions)

    # -- all-reduce ------------------------------------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts=None) -> DkWork:
        # The hot path: ``dist.all_reduce(t)`` and DDP's synchronous buckets, one plain
        # contiguous CPU tensor, SUM, not asynchronous, on a group whose CPU calls are ours.
        # Each test is the cheapest form of its check (``opts.reduceOp == SUM`` costs 0.2 us,
        # reading its kind 0.6 us); the call then skips the routing wrapper, the generic
        # checks and the Work construction (benchmarks/bench_pg_overhead.py measures this
        # layer against the direct Communicator call).
        fast = self._fast_all_reduce
        if fast is not None and opts is not None and len(tensors) == 1 and not opts.asyncOp:
            t = tensors[0]
            if type(t) is torch.Tensor and opts.reduceOp == _SUM and t.is_cpu:
                code = DTYPE_CODES.get(t.dtype)
                if code is not None and t.is_contiguous():
                    try:
                        fast(t, code)
                    except CommError as e:
                        raise to_dist_error(e) from e
                    return self._sync_done.finished(tensors)
        return self._allreduce(tensors, opts)

    @_routed("allreduce")
    def _allreduce(self, tensors: List[torch.Tensor], opts=None) -> DkWork:
        opts = opts if opts is not None else AllreduceOptions()
        t = self._one(tensors, "allreduce")
        if t.layout is torch.sparse_coo:
            self._sparse_all_reduce(t, opts.reduceOp)
            return DkWork.done(tensors, self._completions)
        fold = self._bitwise(opts.reduceOp, t)
        if fold is not None:
            handle, folded = self._gather_fold(t, fold, opts.asyncOp, "allreduce")
            return self._work([handle], tensors, lambda: t.copy_(folded().view_as(t)))
        op, factor = self._op(opts.reduceOp, t, "allreduce")
        if t.is_contiguous():  # the hot path (DDP buckets, dist.all_reduce): no staging
            if factor is not None:
                t.mul_(factor)
            handle = self._comm(t, "allreduce").all_reduce(_reducible(t), op, async_op=opts.asyncOp)
            if handle is None:
                return DkWork.done(tensors, self._completions)
            return DkWork((handle,), tensors, None, self._completions)
        staged = _Staged(t)
        if factor is not None:
            staged.buf.mul_(factor)
        handle = self._comm(t, "allreduce").all_reduce(
            _reducible(staged.buf), op, async_op=opts.asyncOp
        )
        return self._work([handle], tensors, staged.copy_back)

    def _sparse_all_reduce(self, t: torch.Tensor, op: Any) -> None:
        """SUM of a sparse COO tensor, as gloo does it (torch DDP sends the gradients of
        ``nn.Embedding(sparse=True)`` this way): every rank's coalesced indices and values
        are all-gathered, the union is coalesced (duplicates summed in rank order, so every
        rank gets the same bits) and replaces ``t``. Runs on the caller's thread."""
        kind = _kind(op)
        if kind != dist.ReduceOp.SUM:
            raise ValueError(
                f"{self._what('allreduce')}: ReduceOp {kind} on a sparse tensor; sparse "
                f"tensors reduce with SUM only (as gloo)"
            )
        n, comm, local = self._world_size, self._comm(t, "allreduce"), t.coalesce()
        sparse_dim, row = t.sparse_dim(), math.prod(t.shape[t.sparse_dim() :])
        layout = zlib.crc32(repr((tuple(t.shape), sparse_dim, str(t.dtype))).encode())
        meta = torch.empty(n * 2, dtype=torch.int64, device=t.device)
        comm.all_gather(meta, torch.tensor([local._nnz(), layout], device=t.device))
        counts, layouts = meta.view(n, 2).t().tolist()
        if len(set(layouts)) != 1:
            raise ValueError(
                f"{self._what('allreduce')}: the ranks' sparse tensors differ in shape, sparse "
                f"dimensions or dtype (this rank: {tuple(t.shape)}, {sparse_dim} sparse dims, "
                f"{t.dtype})"
            )
        _, indices = self._to_every_rank(
            local.indices().t(), [c * sparse_dim for c in counts], comm
        )
        _, values = self._to_every_rank(local.values(), [c * row for c in counts], comm)
        total = torch.sparse_coo_tensor(
            indices.view(-1, sparse_dim).t(), values.view(-1, *t.shape[sparse_dim:]), t.shape
        )
        t.copy_(total.coalesce())

    @_routed("allreduce_coalesced")
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts=None) -> DkWork:
        opts = opts if opts is not None else AllreduceCoalescedOptions()
        if not tensors:
            return self._work([], tensors)
        if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
            raise ValueError(
                f"{self._what('allreduce_coalesced')}: tensors must share one dtype and device"
            )
        flat = torch.cat([_dense(t).view(-1) for t in tensors])
        fold = self._bitwise(opts.reduceOp, flat)
        if fold is not None:
            handle, folded = self._gather_fold(flat, fold, opts.asyncOp, "allreduce_coalesced")
            return self._work([handle], tensors, lambda: _copy_out(folded(), tensors)())
        op, factor = self._op(opts.reduceOp, tensors[0], "allreduce_coalesced")
        if factor is not None:
            flat.mul_(factor)
        comm = self._comm(tensors[0], "allreduce_coalesced")
        handle = comm.all_reduce(_reducible(flat), op, async_op=opts.asyncOp)
        return self._work([handle], tensors, _copy_out(flat, tensors))

    # -- all-gather ------------------------------------------------------------------------

    def _all_gather_flat(self, output: torch.Tensor, input: torch.Tensor, async_op: bool, what):
        """all_gather of ``input`` into ``output`` (any shape of world_size * input.numel())."""
        if output.numel() != self._world_size * input.numel():
            raise ValueError(
                f"{self._what(what)}: output.numel() ({output.numel()}) must equal world_size "
                f"({self._world_size}) * input.numel() ({input.numel()})"
            )
        if output.dtype != input.dtype:
            raise TypeError(
                f"{self._what(what)}: output dtype {output.dtype} differs from input dtype "
                f"{input.dtype}"
            )
        staged = _Staged(output)
        comm = self._comm(input, what)
        handle = comm.all_gather(_flat(staged.buf), _flat(input), async_op=async_op)
        return handle, staged.copy_back

    @_routed("allgather")
    def allgather(self, output_lists, input_tensors, opts=None) -> DkWork:
        opts = opts if opts is not None else AllgatherOptions()
        t = self._one(input_tensors, "allgather")
        outputs = self._one(output_lists, "allgather")
        if not self._list_of_world(outputs, t, "output_tensor_list", "allgather", even=False):
            return self._all_gather_uneven(outputs, t, opts.asyncOp, output_lists)
        flat = torch.empty(self._world_size * t.numel(), dtype=t.dtype, device=t.device)
        handle, _ = self._all_gather_flat(flat, t, opts.asyncOp, "allgather")
        return self._work([handle], output_lists, _copy_out(flat, outputs))

    def _all_gather_uneven(self, outputs, t: torch.Tensor, async_op: bool, result) -> DkWork:
        """all_gather into tensors of several sizes (torch's NCCL backend takes them, gloo does
        not): an all-to-all in which every rank sends its whole input to each rank and receives
        each rank's input at the size its list gives. A rank whose input has another size than
        its peers' lists say makes them raise (the exchange compares sizes), and it raises at
        its next call."""
        comm = self._comm(t, "allgather")
        handle, out = self._to_every_rank(t, [o.numel() for o in outputs], comm, async_op)
        return self._work([handle], result, _copy_out(out, outputs))

    def _to_every_rank(self, t: torch.Tensor, recv_counts, comm, async_op: bool = False):
        """An all-to-all in which each rank sends ``t`` whole to every rank and receives
        ``recv_counts[r]`` elements from rank r, back to back in rank order: (handle, out)."""
        n, flat = self._world_size, _dense(t).view(-1)
        out = torch.empty(sum(recv_counts), dtype=t.dtype, device=t.device)
        handle = comm.all_to_all(
            _flat(out),
            _flat(flat.repeat(n)),
            _scaled([flat.numel()] * n, flat),
            _scaled(recv_counts, flat),
            async_op=async_op,
        )
        return handle, out

    def all_gather_single(self, output, input, opts=None) -> DkWork:
        # The hot path (``all_gather_into_tensor``, FSDP2's parameter gathers): plain
        # contiguous CPU tensors of one dtype and matching sizes, not asynchronous.
        fast = self._fast_all_gather
        if fast is not None and opts is not None and not opts.asyncOp:
            code = self._plain_pair(output, input)
            if code is not None and output.numel() == self._world_size * input.numel():
                try:
                    fast(output, input, code)
                except CommError as e:
                    raise to_dist_error(e) from e
                return self._sync_done.finished([output])
        return self._all_gather_single(output, input, opts)

    @_routed("_allgather_base")
    def _all_gather_single(self, output, input, opts=None) -> DkWork:
        opts = opts if opts is not None else AllgatherOptions()
        handle, finish = self._all_gather_flat(output, input, opts.asyncOp, "all_gather_single")
        return self._work([handle], [output], finish)

    _allgather_base = all_gather_single

    @_routed("allgather_into_tensor_coalesced")
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> DkWork:
        opts = opts if opts is not None else AllgatherOptions()
        if len(outputs) != len(inputs):
            raise ValueError(
                f"{self._what('allgather_into_tensor_coalesced')}: {len(outputs)} outputs "
                f"for {len(inputs)} inputs"
            )
        parts = [
            self._all_gather_flat(o, i, opts.asyncOp, "allgather_into_tensor_coalesced")
            for o, i in zip(outputs, inputs)
        ]
        return self._work([h for h, _ in parts], list(outputs), _run_all([f for _, f in parts]))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_routed("allgather_coalesced")
    def allgather_coalesced(self, output_lists, input_list, opts=None) -> DkWork:
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        opts = opts if opts is not None else AllgatherOptions()
        if len(output_lists) != self._world_size:
            raise ValueError(
                f"{self._what('allgather_coalesced')}: output_lists has {len(output_lists)} "
                f"lists, expected world_size ({self._world_size})"
            )
        works = [
            self.allgather([[outs[i] for outs in output_lists]], [t], opts)
            for i, t in enumerate(input_list)
        ]
        return self._work(works, output_lists)

    # -- reduce-scatter --------------------------------------------------------------------

    def _reduce_scatter_flat(self, output, input, op_arg, async_op: bool, what):
        if input.numel() != self._world_size * output.numel():
            raise ValueError(
                f"{self._what(what)}: input.numel() ({input.numel()}) must equal world_size "
                f"({self._world_size}) * output.numel() ({output.numel()})"
            )
        if self._bitwise(op_arg, input) is not None:
            counts = [output.numel()] * self._world_size
            handle, finish = self._exchange_reduce(output, input, counts, op_arg, async_op, what)
            return handle, finish, input
        op, factor = self._op(op_arg, input, what)
        source = _dense(input).view(-1)
        if factor is not None:
            source = source * factor  # a copy: the caller's input stays as it was
        staged = _Staged(output)
        comm = self._comm(input, what)
        handle = comm.reduce_scatter(
            _reducible(staged.buf.view(-1)), _reducible(source), op, async_op=async_op
        )
        return handle, staged.copy_back, source

    def _exchange_reduce(self, output, input, counts, op_arg, async_op: bool, what):
        """reduce_scatter as an all-to-all and a local reduce: rank r receives the ``counts[r]``
        elements of ``input`` each rank holds for it (consecutive pieces, in rank order), then
        reduces the n copies in rank order, as our kernels do (FP16 / BF16 in FP32, rounded
        once; AVG divides once) or with the bitwise fold. For lists of several sizes (gloo
        takes them) and bitwise ops; moves what a reduce-scatter moves. (handle, finish)."""
        n, m = self._world_size, output.numel()
        fold = self._bitwise(op_arg, output)
        op, factor = (None, None) if fold is not None else self._op(op_arg, output, what)
        source = _dense(input).view(-1)
        if factor is not None:
            source = source * factor  # a copy: the caller's input stays as it was
        received = torch.empty(n * m, dtype=output.dtype, device=output.device)
        handle = self._comm(output, what).all_to_all(
            _flat(received),
            _flat(source),
            _scaled(counts, output),
            _scaled([m] * n, output),
            async_op=async_op,
        )

        def finish() -> None:
            if fold is not None:
                result = functools.reduce(fold, received.view(n, m).unbind(0))
            else:
                rows = _reducible(received).view(n, -1)
                if n > 1:
                    ops.reduce_(rows[0], *rows[1:].unbind(0), op=op)
                result = received[:m]
            output.copy_(result.view_as(output))

        return handle, finish

    @_routed("reduce_scatter")
    def reduce_scatter(self, outputs, input_lists, opts=None) -> DkWork:
        opts = opts if opts is not None else ReduceScatterOptions()
        out = self._one(outputs, "reduce_scatter")
        inputs = self._one(input_lists, "reduce_scatter")
        even = self._list_of_world(inputs, out, "input_list", "reduce_scatter", even=False)
        flat = torch.cat([_dense(t).view(-1) for t in inputs])
        if even:
            handle, finish, _ = self._reduce_scatter_flat(
                out, flat, opts.reduceOp, opts.asyncOp, "reduce_scatter"
            )
        else:  # pieces of several sizes (gloo takes them)
            counts = [t.numel() for t in inputs]
            handle, finish = self._exchange_reduce(
                out, flat, counts, opts.reduceOp, opts.asyncOp, "reduce_scatter"
            )
        return self._work([handle], outputs, finish)

    @_routed("_reduce_scatter_base")
    def reduce_scatter_single(self, output, input, opts=None) -> DkWork:
        opts = opts if opts is not None else ReduceScatterOptions()
        handle, finish, _ = self._reduce_scatter_flat(
            output, input, opts.reduceOp, opts.asyncOp, "reduce_scatter_single"
        )
        return self._work([handle], [output], finish)

    _reduce_scatter_base = reduce_scatter_single

    @_routed("reduce_scatter_tensor_coalesced")
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> DkWork:
        opts = opts if opts is not None else ReduceScatterOptions()
        what = "reduce_scatter_tensor_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(f"{self._what(what)}: {len(outputs)} outputs for {len(inputs)} inputs")
        parts = [
            self._reduce_scatter_flat(o, i, opts.reduceOp, opts.asyncOp, what)
            for o, i in zip(outputs, inputs)
        ]
        return self._work([p[0] for p in parts], list(outputs), _run_all([p[1] for p in parts]))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- rooted collectives ----------------------------------------------------------------

    def _check_root(self, root: int, what: str) -> int:
        if not 0 <= root < self._world_size:
            raise ValueError(
                f"{self._what(what)}: root rank {root} is out of range for world_size "
                f"{self._world_size}"
            )
        return root

    def broadcast(self, tensors, opts=None) -> DkWork:
        # The hot path (``dist.broadcast(t, src)``, DDP's and FSDP's parameter broadcasts,
        # ``broadcast_object_list``): one plain contiguous CPU tensor, not asynchronous, a
        # root in range; it skips the routing wrapper, the generic checks and the Work.
        fast = self._fast_broadcast
        if fast is not None and opts is not None and len(tensors) == 1 and not opts.asyncOp:
            t, root = tensors[0], opts.rootRank
            if type(t) is torch.Tensor and t.is_cpu and 0 <= root < self._world_size:
                code = DTYPE_CODES.get(t.dtype)
                if code is not None and t.is_contiguous():
                    try:
                        fast(t, code, root)
                    except CommError as e:
                        raise to_dist_error(e) from e
                    return self._sync_done.finished(tensors)
        return self._broadcast(tensors, opts)

    @_routed("broadcast")
    def _broadcast(self, tensors, opts=None) -> DkWork:
        opts = opts if opts is not None else BroadcastOptions()
        t = self._one(tensors, "broadcast")
        root = self._check_root(opts.rootRank, "broadcast")
        staged = _Staged(t)
        handle = self._comm(t, "broadcast").broadcast(
            _flat(staged.buf), root, async_op=opts.asyncOp
        )
        return self._work([handle], tensors, staged.copy_back)

    @_routed("reduce")
    def reduce(self, tensors, opts=None) -> DkWork:
        opts = opts if opts is not None else ReduceOptions()
        t = self._one(tensors, "reduce")
        root = self._check_root(opts.rootRank, "reduce")
        fold = self._bitwise(opts.reduceOp, t)
        if fold is not None:
            handle, folded = self._gather_fold(t, fold, opts.asyncOp, "reduce")
            finish = (lambda: t.copy_(folded().view_as(t))) if self._rank == root else None
            return self._work([handle], tensors, finish)
        op, factor = self._op(opts.reduceOp, t, "reduce")
        staged = _Staged(t)
        # Only the root keeps the result; the others reduce a copy.
        buf = staged.buf if self._rank == root else _dense(t).clone()
        if factor is not None:
            buf.mul_(factor)
        handle = self._comm(t, "reduce").all_reduce(_reducible(buf), op, async_op=opts.asyncOp)
        finish = staged.copy_back if self._rank == root else None
        return self._work([handle], tensors, finish)

    def _p2p(self, what: str, comm, t: torch.Tensor, peer: int, tag: int):
        """isend / irecv of ``t``'s bytes (any dtype); returns (handle, finish)."""
        staged = _Staged(t)
        flat = _flat(staged.buf)
        if what == "send":
            return comm.isend(flat, peer, tag=tag), None
        return comm.irecv(flat, peer, tag=tag), staged.copy_back

    @_routed("gather")
    def gather(self, output_lists, input_tensors, opts=None) -> DkWork:
        opts = opts if opts is not None else GatherOptions()
        t = self._one(input_tensors, "gather")
        root = self._check_root(opts.rootRank, "gather")
        comm = self._comm(t, "gather")
        if self._rank != root:
            if output_lists and any(len(o) for o in output_lists):
                raise ValueError(f"{self._what('gather')}: only the root passes output tensors")
            handle, _ = self._p2p("send", comm, t, root, _GATHER_SCATTER_TAG)
            return self._work([handle], [])
        outputs = self._one(output_lists, "gather")
        self._list_of_world(outputs, t, "gather_list", "gather", even=False)
        outputs[root].copy_(t)
        parts = [
            self._p2p("recv", comm, o, r, _GATHER_SCATTER_TAG)
            for r, o in enumerate(outputs)
            if r != root
        ]
        return self._work([h for h, _ in parts], output_lists, _run_all([f for _, f in parts]))

    @_routed("scatter")
    def scatter(self, outputs, input_lists, opts=None) -> DkWork:
        opts = opts if opts is not None else ScatterOptions()
        t = self._one(outputs, "scatter")
        root = self._check_root(opts.rootRank, "scatter")
        comm = self._comm(t, "scatter")
        if self._rank != root:
            if input_lists and any(len(i) for i in input_lists):
                raise ValueError(f"{self._what('scatter')}: only the root passes input tensors")
            handle, finish = self._p2p("recv", comm, t, root, _GATHER_SCATTER_TAG)
            return self._work([handle], outputs, finish)
        inputs = self._one(input_lists, "scatter")
        self._list_of_world(inputs, t, "scatter_list", "scatter", even=False)
        t.copy_(inputs[root])
        handles = [
            self._p2p("send", comm, i, r, _GATHER_SCATTER_TAG)[0]
            for r, i in enumerate(inputs)
            if r != root
        ]
        return self._work(handles, outputs)

    # -- all-to-all ------------------------------------------------------------------------

    def _splits(self, t: torch.Tensor, sizes: Sequence[int], arg: str) -> List[int]:
        """Per-rank element counts of ``t`` cut along dim 0 (``sizes`` empty: equal cuts)."""
        rows = t.size(0) if t.dim() > 0 else 1
        row = t.numel() // rows if rows else 0
        if not sizes:
            if rows % self._world_size:
                raise ValueError(
                    f"{self._what('all_to_all_single')}: {arg}.size(0) ({rows}) is not "
                    f"divisible by world_size ({self._world_size}); pass split sizes"
                )
            return [rows // self._world_size * row] * self._world_size
        if len(sizes) != self._world_size or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(
                f"{self._what('all_to_all_single')}: {arg} split sizes {list(sizes)} must be "
                f"world_size ({self._world_size}) non-negative numbers summing to "
                f"{arg}.size(0) ({rows})"
            )
        return [s * row for s in sizes]

    @_routed("alltoall_base")
    def all_to_all_single(
        self, output, input, output_split_sizes=(), input_split_sizes=(), opts=None
    ) -> DkWork:
        opts = opts if opts is not None else AllToAllOptions()
        what = "all_to_all_single"
        if output.dtype != input.dtype:
            raise TypeError(f"{self._what(what)}: output {output.dtype} != input {input.dtype}")
        recv_counts = self._splits(output, output_split_sizes or (), "output")
        send_counts = self._splits(input, input_split_sizes or (), "input")
        staged = _Staged(output)
        source = _flat(input)
        if source.numel() and source.data_ptr() == _flat(staged.buf).data_ptr():
            source = source.clone()  # in place: every rank still reads its original input
        handle = self._comm(input, what).all_to_all(
            _flat(staged.buf),
            source,
            _scaled(send_counts, input),
            _scaled(recv_counts, input),
            async_op=opts.asyncOp,
        )
        return self._work([handle], [output], staged.copy_back)

    alltoall_base = all_to_all_single

    @_routed("alltoall")
    def alltoall(self, output_tensors, input_tensors, opts=None) -> DkWork:
        opts = opts if opts is not None else AllToAllOptions()
        what = "alltoall"
        if len(output_tensors) != self._world_size or len(input_tensors) != self._world_size:
            raise ValueError(
                f"{self._what(what)}: pass world_size ({self._world_size}) output and input "
                f"tensors, got {len(output_tensors)} and {len(input_tensors)}"
            )
        if len({t.dtype for t in [*output_tensors, *input_tensors]}) != 1:
            raise TypeError(f"{self._what(what)}: all tensors must share one dtype")
        source = torch.cat([_dense(t).view(-1) for t in input_tensors])
        out = torch.empty(
            sum(t.numel() for t in output_tensors), dtype=source.dtype, device=source.device
        )
        handle = self._comm(source, what).all_to_all(
            _flat(out),
            _flat(source),
            _scaled([t.numel() for t in input_tensors], source),
            _scaled([t.numel() for t in output_tensors], source),
            async_op=opts.asyncOp,
        )
        return self._work([handle], output_tensors, _copy_out(out, output_tensors))

    # -- point-to-point and barrier --------------------------------------------------------

    def _check_peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self._world_size or peer == self._rank:
            raise ValueError(
                f"{self._what(what)}: peer {peer} must be another rank of this group "
                f"(world_size {self._world_size})"
            )
        return peer

    @_routed("send")
    def send(self, tensors, dst: int, tag: int = 0) -> DkWork:
        """Always asynchronous (``dist.send`` waits on the Work). ``tag`` as gloo's: the
        receive that names it takes the message (on CUDA tensors NCCL ignores it)."""
        t = self._one(tensors, "send")
        peer = self._check_peer(dst, "send")
        handle, _ = self._p2p("send", self._comm(t, "send"), t, peer, tag)
        return self._work([handle], tensors)

    @_routed("recv")
    def recv(self, tensors, src: int, tag: int = 0) -> DkWork:
        t = self._one(tensors, "recv")
        peer = self._check_peer(src, "recv")
        handle, finish = self._p2p("recv", self._comm(t, "recv"), t, peer, tag)
        return self._work([handle], tensors, finish)

    @_routed("recv_anysource")
    def recv_anysource(self, tensors, tag: int = 0) -> DkWork:
        """``dist.recv(t)`` / ``dist.irecv(t)`` without ``src``: from whichever rank sends
        first; the Work's ``_source_rank()`` names it (what ``dist.recv`` returns)."""
        t = self._one(tensors, "recv")
        if not t.is_cpu:
            raise NotImplementedError(
                f"{self._what('recv')}: receiving from any source works on CPU tensors only "
                f"(got {t.device}); name the source rank"
            )
        staged = _Staged(t)
        handle = self._comm(t, "recv").irecv(_flat(staged.buf), tag=tag)
        return DkWork(
            [handle], tensors, staged.copy_back, self._completions, source=handle.source_rank
        )

    @_routed("barrier")
    def barrier(self, opts=None) -> DkWork:
        opts = opts if opts is not None else BarrierOptions()
        handle = self._comm(None, "barrier").barrier(async_op=opts.asyncOp)
        return self._work([handle], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        raise NotImplementedError(
            f"{self._what('monitored_barrier')}: not supported (gloo only); use barrier(), "
            f"whose timeout names the collective"
        )

    # -- timeouts --------------------------------------------------------------------------

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The timeout of calls started from now on, on every device of the group (torch's
        ``ProcessGroup.set_timeout``)."""
        self._timeout = timeout
        self._routes.set_timeout(timeout)

    _set_default_timeout = set_timeout

    # -- lifetime --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Closes the communicators (torch's destroy_process_group calls this)."""
        self._cpu = self._fast_all_reduce = self._fast_all_gather = self._fast_broadcast = None
        self._routes.close()
        self._completions.close()

    def abort(self) -> None:
        self.shutdown()


def _copy_out(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A Work's finish that copies consecutive pieces of ``flat`` into ``tensors``, each
    piece the size of its tensor."""

    def run() -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    return run


def _run_all(finishes: Sequence[Optional[Callable[[], None]]]) -> Callable[[], None]:
    def run() -> None:
        for finish in finishes:
            if finish is not None:
                finish()

    return run


def _scaled(counts: Sequence[int], flat_of: torch.Tensor) -> List[int]:
    """Element counts of ``flat_of``'s dtype as counts of ``_flat``'s (bytes when viewed)."""
    scale = flat_of.element_size() if flat_of.dtype not in DTYPE_CODES else 1
    return [c * scale for c in counts]


class BackendView:
    """A :class:`ProcessGroupDK` seen as torch's per-device ``Backend``, for torch's helpers
    that look one up (``_get_backend``) to ask what it supports: splitting, coalescing, time
    estimates, shrinking and allocation are all refused, so they take their general path;
    type checks for gloo or NCCL fail, as they should. Collectives go through the group."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def __init__(self, group: ProcessGroupDK) -> None:
        self._group = group

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._group.rank()

    def size(self) -> int:
        return self._group.size()

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return f"BackendView({self._group!r})"


skip_module(sys.modules[__name__])  # torch.compile must not trace these frames (dynamo.py)
