"""Hierarchical CPU collectives across hosts (design decision 4).

Inside a host the ranks use shared memory (:class:`dist_kernels.comm.shm.ShmBackend`); between
hosts the host leaders (lowest group rank of each host) use a torch.distributed gloo group.

    all_reduce:  local all_reduce -> leaders all_reduce -> local broadcast from the leader
    broadcast:   local broadcast on src's host -> leaders broadcast -> local broadcast
    all_gather:  an all_reduce of the zero-filled output with each rank's piece in place, on
                 the bytes (uint8 SUM with one non-zero contributor per byte is exact)
    reduce_scatter: all_reduce of a copy of the input, then this rank's chunk

Every rank gets the leaders' result through the same local broadcast, so results are
bitwise identical. FP16 and BF16 cross hosts in FP32. Collectives run synchronously; with
``async_op=True`` they return an already completed :class:`Work`. isend/irecv are
asynchronous (shared memory on the host, gloo across hosts).
"""

from __future__ import annotations

import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..dtypes import ReduceOp
from .work import DoneWork

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # then divided once by the leader
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


class _GlooWork:
    """A torch.distributed Work behind the handle interface :class:`~.communicator.Work` wraps."""

    def __init__(self, work) -> None:
        self.work = work

    def wait(self, timeout: Optional[float]) -> None:
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(datetime.timedelta(seconds=timeout))

    def is_completed(self) -> bool:
        return self.work.is_completed()


class HierarchicalBackend:
    """Shared memory inside each host, gloo among the host leaders."""

    def __init__(self, comm, local, hosts: Sequence[str], global_ranks: Tuple[int, ...]):
        self.comm = comm
        self.local = local
        self.hosts = list(hosts)
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.host_order: List[str] = list(dict.fromkeys(self.hosts))
        leaders = [self.hosts.index(h) for h in self.host_order]
        self.is_leader = self.rank in leaders
        # Only the leaders create (and join) the inter-host group.
        self.leaders = (
            dist.new_group(
                [global_ranks[r] for r in leaders], backend="gloo", use_local_synchronization=True
            )
            if self.is_leader
            else None
        )
        self.global_ranks = global_ranks

    def _local_rank_of(self, rank: int) -> int:
        return [r for r in range(self.world_size) if self.hosts[r] == self.hosts[rank]].index(rank)

    def _leader_of(self, rank: int) -> int:
        return self.hosts.index(self.hosts[rank])

    def _done(self, async_op: bool):
        return DoneWork() if async_op else None

    def all_reduce(self, t: torch.Tensor, code: int, op: int, algo: int, async_op: bool):
        op = ReduceOp(op)
        local_op = ReduceOp.SUM if op == ReduceOp.AVG else op
        self.local.all_reduce(t, code, int(local_op), algo, False)
        if self.is_leader:
            wide = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
            dist.all_reduce(wide, _TORCH_OPS[op], group=self.leaders)
            if op == ReduceOp.AVG:
                if wide.is_floating_point():
                    wide.div_(self.world_size)
                else:
                    wide.copy_(torch.div(wide, self.world_size, rounding_mode="trunc"))
            if wide is not t:
                t.copy_(wide)
        self.local.broadcast(t, code, 0, False)
        return self._done(async_op)

    def reduce_scatter(self, out, inp, code: int, op: int, async_op: bool):
        full = inp.clone()
        self.all_reduce(full, code, op, 0, False)
        n = out.numel()
        out.view(-1).copy_(full.view(-1)[self.rank * n : (self.rank + 1) * n])
        return self._done(async_op)

    def all_gather(self, out, inp, code: int, async_op: bool):
        n = inp.numel()
        out.view(-1).zero_()
        out.view(-1)[self.rank * n : (self.rank + 1) * n].copy_(inp.view(-1))
        raw = out.view(-1).view(torch.uint8)
        self.all_reduce(raw, 7, int(ReduceOp.SUM), 0, False)  # 7 = uint8 (csrc/common/dtype.h)
        return self._done(async_op)

    def broadcast(self, t, code: int, src: int, async_op: bool):
        if self.hosts[src] == self.hosts[self.rank]:
            self.local.broadcast(t, code, self._local_rank_of(src), False)
        if self.is_leader:
            dist.broadcast(t, self.global_ranks[self._leader_of(src)], group=self.leaders)
        if self.hosts[src] != self.hosts[self.rank]:
            self.local.broadcast(t, code, 0, False)
        return self._done(async_op)

    # Point-to-point: a peer on this host goes through shared memory (asynchronously when
    # asked); one on another host through gloo, whose isend/irecv are asynchronous too.
    def send(self, t, code: int, dst: int, async_op: bool):
        if self.hosts[dst] == self.hosts[self.rank]:
            return self.local.send(t, code, self._local_rank_of(dst), async_op)
        if async_op:
            return _GlooWork(dist.isend(t, self.global_ranks[dst]))
        dist.send(t, self.global_ranks[dst])
        return None

    def recv(self, t, code: int, src: int, async_op: bool):
        if self.hosts[src] == self.hosts[self.rank]:
            return self.local.recv(t, code, self._local_rank_of(src), async_op)
        if async_op:
            return _GlooWork(dist.irecv(t, self.global_ranks[src]))
        dist.recv(t, self.global_ranks[src])
        return None

    def barrier(self, async_op: bool):
        self.local.barrier(False)
        if self.is_leader:
            dist.barrier(group=self.leaders)
        self.local.barrier(False)
        return self._done(async_op)

    def empty(self, shape, dtype):
        return self.local.empty(shape, dtype)

    def abort(self, reason: str) -> None:
        self.local.abort(reason)

    def close(self) -> None:
        self.local.close()
        if self.leaders is not None:
            dist.destroy_process_group(self.leaders)
            self.leaders = None
