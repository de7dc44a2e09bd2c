"""Hierarchical CPU collectives across hosts (design decision 4).

Inside a host the ranks use shared memory (:class:`dist_kernels.comm.shm.ShmBackend`); between
hosts the host leaders (lowest group rank of each host) use a torch.distributed gloo group,
and point-to-point between hosts goes through gloo too (:func:`gloo_links` makes both: from
torch groups for a Communicator of a torch group, straight from the Store for one built from a
store, such as the ``"dk"`` backend's, whose world group does not exist yet when it is made).

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
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

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


@dataclass
class GlooLinks:
    """The gloo process groups a hierarchical communicator talks between hosts through.

    ``leaders`` joins the host leaders (None on other ranks); its rank of a leader is the
    index of its host in order of first appearance. ``peers`` carries point-to-point between
    hosts; ``peer_rank`` maps a communicator rank to its rank in ``peers``.
    """

    leaders: Optional[Any]
    peers: Any
    peer_rank: Callable[[int], int]
    destroy: Callable[[], None]


def gloo_links(comm, hosts: Sequence[str], store) -> GlooLinks:
    """Gloo groups for ``comm``: new torch groups, or, for a store-built one, from ``store``."""
    host_order = list(dict.fromkeys(hosts))
    leaders = [hosts.index(h) for h in host_order]
    is_leader = comm.rank in leaders
    if comm.group is not None:
        global_ranks = tuple(dist.get_process_group_ranks(comm.group))
        # Only the leaders create (and join) the inter-host group.
        group = (
            dist.new_group(
                [global_ranks[r] for r in leaders], backend="gloo", use_local_synchronization=True
            )
            if is_leader
            else None
        )
        return GlooLinks(
            group,
            dist.distributed_c10d._get_default_group(),
            lambda r: global_ranks[r],
            (lambda: dist.destroy_process_group(group)) if group is not None else (lambda: None),
        )
    timeout = comm.timeout
    group = (
        dist.ProcessGroupGloo(
            dist.PrefixStore("gloo/leaders/", store),
            leaders.index(comm.rank),
            len(leaders),
            timeout,
        )
        if is_leader
        else None
    )
    peers = dist.ProcessGroupGloo(
        dist.PrefixStore("gloo/peers/", store), comm.rank, comm.world_size, timeout
    )
    return GlooLinks(group, peers, lambda r: r, lambda: None)


class HierarchicalBackend:
    """Shared memory inside each host, gloo among the host leaders."""

    def __init__(self, comm, local, hosts: Sequence[str], links: GlooLinks):
        self.comm = comm
        self.local = local
        self.hosts = list(hosts)
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.host_order: List[str] = list(dict.fromkeys(self.hosts))
        self.is_leader = links.leaders is not None
        self.links = links
        self.leaders = links.leaders

    def _local_rank_of(self, rank: int) -> int:
        return [r for r in range(self.world_size) if self.hosts[r] == self.hosts[rank]].index(rank)

    def _done(self, async_op: bool):
        return DoneWork() if async_op else None

    def all_reduce(self, t: torch.Tensor, code: int, op: int, algo: int, async_op: bool):
        op = ReduceOp(op)
        local_op = ReduceOp.SUM if op == ReduceOp.AVG else op
        self.local.all_reduce(t, code, int(local_op), algo, False)
        if self.is_leader:
            wide = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
            opts = dist.AllreduceOptions()
            opts.reduceOp = _TORCH_OPS[op]
            self.leaders.allreduce([wide], opts).wait()
            if op == ReduceOp.AVG:
                if wide.is_floating_point():
                    wide.div_(self.world_size)
                else:
                    wide.copy_(torch.div(wide, self.world_size, rounding_mode="trunc"))
            if wide is not t:
                t.copy_(wide)
        self.local.broadcast(t, code, 0, False)
        return self._done(async_op)

    # Across hosts both run as an all-reduce (auto's choice on the host); `algo` is not used.
    def reduce_scatter(self, out, inp, code: int, op: int, algo: int, async_op: bool):
        full = inp.clone()
        self.all_reduce(full, code, op, 0, False)
        n = out.numel()
        out.view(-1).copy_(full.view(-1)[self.rank * n : (self.rank + 1) * n])
        return self._done(async_op)

    def all_gather(self, out, inp, code: int, algo: int, async_op: bool):
        n = inp.numel()
        out.view(-1).zero_()
        out.view(-1)[self.rank * n : (self.rank + 1) * n].copy_(inp.view(-1))
        raw = out.view(-1).view(torch.uint8)
        self.all_reduce(raw, 7, int(ReduceOp.SUM), 0, False)  # 7 = uint8 (csrc/common/dtype.h)
        return self._done(async_op)

    def all_to_all(self, out, inp, sends, recvs, code: int, async_op: bool):
        """Point-to-point with every peer (shared memory on the host, gloo across)."""
        send_at = [sum(sends[:p]) for p in range(self.world_size)]
        recv_at = [sum(recvs[:p]) for p in range(self.world_size)]
        src, dst = inp.view(-1), out.view(-1)
        me = self.rank
        dst[recv_at[me] : recv_at[me] + recvs[me]].copy_(src[send_at[me] : send_at[me] + sends[me]])
        works = []
        for p in range(self.world_size):
            if p != me and recvs[p]:
                works.append(self.recv(dst[recv_at[p] : recv_at[p] + recvs[p]], code, p, True))
            if p != me and sends[p]:
                works.append(self.send(src[send_at[p] : send_at[p] + sends[p]], code, p, True))
        for work in works:
            work.wait(None)
        return self._done(async_op)

    def broadcast(self, t, code: int, src: int, async_op: bool):
        if self.hosts[src] == self.hosts[self.rank]:
            self.local.broadcast(t, code, self._local_rank_of(src), False)
        if self.is_leader:
            opts = dist.BroadcastOptions()
            opts.rootRank = self.host_order.index(self.hosts[src])
            self.leaders.broadcast([t], opts).wait()
        if self.hosts[src] != self.hosts[self.rank]:
            self.local.broadcast(t, code, 0, False)
        return self._done(async_op)

    # Point-to-point: a peer on this host goes through shared memory (asynchronously when
    # asked); one on another host through gloo, whose isend/irecv are asynchronous too.
    def send(self, t, code: int, dst: int, async_op: bool):
        if self.hosts[dst] == self.hosts[self.rank]:
            return self.local.send(t, code, self._local_rank_of(dst), async_op)
        return self._gloo_p2p(self.links.peers.send([t], self.links.peer_rank(dst), 0), async_op)

    def recv(self, t, code: int, src: int, async_op: bool):
        if self.hosts[src] == self.hosts[self.rank]:
            return self.local.recv(t, code, self._local_rank_of(src), async_op)
        return self._gloo_p2p(self.links.peers.recv([t], self.links.peer_rank(src), 0), async_op)

    def _gloo_p2p(self, work, async_op: bool):
        if async_op:
            return _GlooWork(work)
        work.wait()
        return None

    def barrier(self, async_op: bool):
        self.local.barrier(False)
        if self.is_leader:
            self.leaders.barrier(dist.BarrierOptions()).wait()
        self.local.barrier(False)
        return self._done(async_op)

    def empty(self, shape, dtype):
        return self.local.empty(shape, dtype)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Shared memory's and our gloo links' (a torch default group we borrow keeps its own)."""
        self.local.set_timeout(timeout)
        for link in (self.leaders, self.links.peers):
            if isinstance(link, dist.ProcessGroupGloo):
                link._set_default_timeout(timeout)
            elif link is not None and link is not dist.distributed_c10d._get_default_group():
                dist.distributed_c10d._set_pg_timeout(timeout, link)

    def abort(self, reason: str) -> None:
        self.local.abort(reason)

    def close(self) -> None:
        self.local.close()
        if self.leaders is not None:
            self.links.destroy()
            self.leaders = None
