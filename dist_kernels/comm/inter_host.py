"""The engines that carry data between hosts: Gloo, or MPI where the job runs under one.

Design decision 14: between hosts the bytes travel on an engine users already run, never on a
transport of ours. Each engine here wraps one inter-host group (a torch ``ProcessGroupGloo``
or an ``mpi4py`` communicator) behind the same few non-blocking calls; every call returns a
handle whose ``wait(timeout)`` raises the engine's own error, which the hierarchical backend
turns into a :class:`~dist_kernels.CommError` naming the host. Reductions take SUM, PROD,
MAX and MIN (AVG is a SUM the caller divides); tensors are contiguous CPU tensors of a dtype
the engine reduces natively (the caller widens FP16 / BF16 to FP32 first).

MPI is present when the process was started by an MPI launcher (``mpiexec`` / ``srun``: the
launcher's environment says so) and ``mpi4py`` imports; under torchrun there is no MPI world
(MPICH's singleton connect/accept cannot join processes started apart, pmodels/mpich#7805),
so Gloo carries the leg there.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..dtypes import ReduceOp

ENGINES = ("gloo", "mpi")
_MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")

_GLOO_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


class _GlooHandle:
    def __init__(self, work) -> None:
        self.work = work

    def wait(self, timeout: Optional[float] = None) -> None:
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(datetime.timedelta(seconds=timeout))

    def is_completed(self) -> bool:
        return self.work.is_completed()


class GlooLeg:
    """One inter-host group on a torch ``ProcessGroupGloo``; ``rank`` is this host's index."""

    engine = "gloo"

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        self.rank, self.size = rank, size
        self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> _GlooHandle:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[op]
        return _GlooHandle(self.pg.allreduce([t], opts))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> _GlooHandle:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _GLOO_OPS[op]
        return _GlooHandle(self.pg._reduce_scatter_base(out, inp, opts))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _GlooHandle:
        opts = dist.distributed_c10d.AllgatherOptions()
        return _GlooHandle(self.pg._allgather_base(out, inp, opts))

    def broadcast(self, t: torch.Tensor, root: int) -> _GlooHandle:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return _GlooHandle(self.pg.broadcast([t], opts))

    def all_to_all(self, out, inp, out_splits: List[int], in_splits: List[int]) -> _GlooHandle:
        opts = dist.AllToAllOptions()
        return _GlooHandle(self.pg.alltoall_base(out, inp, out_splits, in_splits, opts))

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> _GlooHandle:
        return _GlooHandle(self.pg.send([t], dst, tag))

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> _GlooHandle:
        return _GlooHandle(self.pg.recv([t], src, tag))

    def barrier(self) -> _GlooHandle:
        return _GlooHandle(self.pg.barrier(dist.BarrierOptions()))

    def abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - best effort: the peers learn from the closed sockets
            pass

    def close(self) -> None:
        self.pg = None


# -- MPI ----------------------------------------------------------------------------------------


def mpi_world() -> Optional[Any]:
    """``MPI.COMM_WORLD`` when this process runs under an MPI launcher and mpi4py imports."""
    if not any(v in os.environ for v in _MPI_LAUNCHER_VARS):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


class _MpiHandle:
    """An MPI request. ``wait`` blocks in MPI_Wait: MPICH moves a message's bytes only while
    some MPI call runs (measured: polling MPI_Test between sleeps ran a 64 MiB all-reduce
    between two emulated hosts at a third of MPI_Allreduce's speed). MPI has no timeout of its
    own: a rank that dies ends the job (the launcher kills the others, or the wait raises)."""

    def __init__(self, request, buffers: Sequence[Any] = ()) -> None:
        self.request = request
        self.buffers = buffers  # keeps the numpy views alive until the request completes
        self.done = False

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self.done:
            self.request.Wait()
            self.done = True

    def is_completed(self) -> bool:
        if not self.done:
            self.done = bool(self.request.Test())
        return self.done


class MpiLeg:
    """One inter-host group as an MPI communicator made from ``world`` (MPI_Comm_create_group).

    ``members``: the MPI world ranks of the group, in host order; only they call this.
    """

    engine = "mpi"

    def __init__(self, world, members: Sequence[int], tag: int) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        group = world.Get_group().Incl(list(members))
        self.comm = world.Create_group(group, tag)
        group.Free()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.PROD: MPI.PROD,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.MIN: MPI.MIN,
        }

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> _MpiHandle:
        view = t.numpy()
        return _MpiHandle(self.comm.Iallreduce(self.MPI.IN_PLACE, view, self._ops[op]), [view])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> _MpiHandle:
        src, dst = inp.numpy(), out.numpy()
        return _MpiHandle(self.comm.Ireduce_scatter_block(src, dst, self._ops[op]), [src, dst])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _MpiHandle:
        src, dst = inp.numpy(), out.numpy()
        return _MpiHandle(self.comm.Iallgather(src, dst), [src, dst])

    def broadcast(self, t: torch.Tensor, root: int) -> _MpiHandle:
        view = t.numpy()
        return _MpiHandle(self.comm.Ibcast(view, root), [view])

    def all_to_all(self, out, inp, out_splits: List[int], in_splits: List[int]) -> _MpiHandle:
        src, dst = inp.numpy(), out.numpy()
        send = [src, (in_splits, _offsets(in_splits))]
        recv = [dst, (out_splits, _offsets(out_splits))]
        return _MpiHandle(self.comm.Ialltoallv(send, recv), [src, dst])

    def barrier(self) -> _MpiHandle:
        return _MpiHandle(self.comm.Ibarrier())

    def abort(self) -> None:
        pass  # MPI has no abort of one communicator short of the whole job

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def _offsets(counts: Sequence[int]) -> List[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
