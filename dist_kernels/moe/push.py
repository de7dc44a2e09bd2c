"""One-copy row exchange: each rank writes its rows straight into the receiver's memory.

The all-to-all of ``exchange.py`` copies a row twice (gathered into this rank's registered
buffer, then copied out by the receiver into a fresh tensor) and the layer then regroups the
arrived rows by expert: three copies and a fresh tensor's page faults per direction. Here,
with every peer's memory mapped (``Communicator.empty_symmetric``), the sender gathers its rows
``x[index]`` straight into the receiver's memory at the place the receiver wants them (by local
expert, then by source rank), and the receiver's result *is* that memory: one copy per row,
which is DeepEP's dispatch / combine idea on shared memory.

    acquire    every rank picks a free slab of the pool for what it will receive and writes
               its choice, with the plan's fingerprint, into every rank's mailbox; one barrier
               (which also orders the writes after the owner chose the slab)
    write      this rank's segments into each receiver's slab (``index_select(out=...)``)
    barrier    every write has landed
    result     a tensor over this rank's slab; the slab is free again when the last tensor
               viewing it dies (a finalizer on its storage), so autograd may keep it

The slabs are symmetric (every rank allocated the same list in the same order: growth is
collective and decided from the mailboxes), so one slab id names the same size on every rank.
"""

from __future__ import annotations

import weakref
from itertools import accumulate
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["RowPlan", "push_rows", "supports_push"]

Segment = Tuple[int, int, int]  # (row in the sender's rows, row in the receiver's rows, rows)


class RowPlan:
    """Where every rank's rows go: ``segments[src][dst]`` lists ``(src_row, dst_row, n)``;
    rank r sends ``send_rows[r]`` rows and receives ``recv_rows[r]``. Pure arithmetic, the same
    on every rank, so the backward's reverse plan (:meth:`transposed`) needs no exchange."""

    def __init__(
        self, segments: List[List[List[Segment]]], send_rows: List[int], recv_rows: List[int]
    ) -> None:
        self.segments, self.send_rows, self.recv_rows = segments, send_rows, recv_rows

    @property
    def world_size(self) -> int:
        return len(self.send_rows)

    @property
    def fingerprint(self) -> int:
        """A hash of the whole plan, the same in every process (ints and tuples only): ranks
        compare it before any write, so plans that disagree raise instead of misplacing rows."""
        if not hasattr(self, "_fingerprint"):
            segments = tuple(
                tuple(tuple(map(tuple, cell)) for cell in row) for row in self.segments
            )
            whole = (segments, tuple(self.send_rows), tuple(self.recv_rows))
            self._fingerprint = hash(whole) & ((1 << 62) - 1)
        return self._fingerprint

    def transposed(self) -> RowPlan:
        """The reverse trip: every row goes back from where it landed to where it came from."""
        n = self.world_size
        segments = [
            [[(d, s, k) for (s, d, k) in self.segments[dst][src]] for dst in range(n)]
            for src in range(n)
        ]
        return RowPlan(segments, list(self.recv_rows), list(self.send_rows))

    @classmethod
    def blocks(cls, rows: Sequence[Sequence[int]]) -> RowPlan:
        """A plain all-to-all by row counts: ``rows[src][dst]`` rows, sent in destination order
        and received in source order (``all_to_all_single``'s layout)."""
        n = len(rows)
        send_at = [_prefix(rows[s]) for s in range(n)]
        recv_at = [_prefix([rows[s][d] for s in range(n)]) for d in range(n)]
        segments = [
            [[(send_at[s][d], recv_at[d][s], rows[s][d])] if rows[s][d] else [] for d in range(n)]
            for s in range(n)
        ]
        return cls(
            segments, [sum(r) for r in rows], [sum(rows[s][d] for s in range(n)) for d in range(n)]
        )

    @classmethod
    def moe_dispatch(cls, counts: Sequence[Sequence[int]], num_local: int) -> RowPlan:
        """The MoE dispatch: ``counts[src][e]`` rows of rank src for expert e, which lives on
        rank ``e // num_local``. A sender's rows are sorted by expert; a receiver gets them
        grouped by local expert, then by source rank, so each expert's rows are contiguous."""
        ep = len(counts)
        segments: List[List[List[Segment]]] = [[[] for _ in range(ep)] for _ in range(ep)]
        send_at = [_prefix(counts[s]) for s in range(ep)]
        recv_rows = []
        for dst in range(ep):
            at = 0
            for le in range(num_local):
                e = dst * num_local + le
                for src in range(ep):
                    n = counts[src][e]
                    if n:
                        segments[src][dst].append((send_at[src][e], at, n))
                    at += n
            recv_rows.append(at)
        return cls(segments, [sum(c) for c in counts], recv_rows)


def _prefix(values: Sequence[int]) -> List[int]:
    """Where each block starts when blocks of ``values`` rows lie back to back."""
    return list(accumulate(values, initial=0))[:-1]


def supports_push(comm: Any) -> bool:
    """True where every peer's memory can be mapped here (one host's shared memory)."""
    return (
        comm is not None
        and hasattr(comm, "empty_symmetric")
        and getattr(comm, "num_hosts", 1) == 1
        and getattr(getattr(comm, "device", None), "type", "cpu") == "cpu"
    )


class _SlabPool:
    """The symmetric slabs of one communicator, and which of this rank's are in use."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.slabs: List[List[torch.Tensor]] = []  # [slab][rank]: flat uint8, rank's memory
        self.arrays: List[Any] = []  # this rank's slab as numpy: a fresh storage per result
        self.busy: List[bool] = []
        self.mailbox: Optional[List[Any]] = None  # per rank: int64 [world, 2], choices, checks

    def acquire(self, needs: Sequence[int], check: int) -> List[int]:
        """Collective: a slab id per rank holding at least ``needs[r]`` bytes (-1: none
        needed). Every rank passes the same ``needs`` and ``check`` (a plan's fingerprint);
        ValueError on every rank, before any write, where they differ."""
        me = self.comm.rank
        mine = self._free_slab(needs[me]) if needs[me] else -2
        ids, checks = self._publish(mine, check)
        if len(set(checks)) > 1:
            # Every rank read the same mailbox and raises; the barrier keeps a rank that
            # raised first from writing the next call's choice into a mailbox that a peer
            # has not read yet (the success path's completion barrier does that there).
            self.comm.barrier()
            groups: dict = {}
            for r, c in enumerate(checks):
                groups.setdefault(c, []).append(r)
            raise ValueError(
                f"[rank {me}] push_rows: the ranks passed different plans (ranks "
                f"{' / '.join(str(g) for g in groups.values())} agree among themselves); every "
                "rank must pass the same RowPlan, built from the same counts, and rows as wide"
            )
        short = [r for r, i in enumerate(ids) if i == -1]
        if short:  # every rank sees the same list, so every rank grows the same slab
            size = 1 << max(16, (max(needs[r] for r in short) - 1).bit_length())
            self._grow(size)
            for r in short:
                ids[r] = len(self.slabs) - 1
        if ids[me] >= 0:
            self.busy[ids[me]] = True
        return [max(i, -1) for i in ids]

    def _publish(self, mine: int, check: int) -> Tuple[List[int], List[int]]:
        """Every rank's choice and check: written into every peer's mailbox, then one barrier
        (which also orders the senders' writes after the owner chose the slab)."""
        if self.mailbox is None:  # [rank][slot]: row r holds rank r's (choice, check)
            boxes = self.comm.empty_symmetric((self.comm.world_size, 2), torch.int64)
            self.mailbox = [t.numpy() for t in boxes]
        me = self.comm.rank
        for box in self.mailbox:
            box[me] = (mine, check)
        self.comm.barrier()
        ids, checks = self.mailbox[me].T.tolist()
        # The next call writes the mailboxes again only after a barrier of its own push (or,
        # when the plans differ, the one before the ValueError), which every rank enters after
        # reading here.
        return ids, checks

    def _free_slab(self, nbytes: int) -> int:
        """The smallest free slab of at least ``nbytes`` on this rank, or -1."""
        best = -1
        for i, slab in enumerate(self.slabs):
            if not self.busy[i] and slab[0].numel() >= nbytes:
                if best < 0 or slab[0].numel() < self.slabs[best][0].numel():
                    best = i
        return best

    def _grow(self, nbytes: int) -> None:
        bufs = self.comm.empty_symmetric(nbytes, torch.uint8)
        self.slabs.append(bufs)
        self.arrays.append(bufs[self.comm.rank].numpy())
        self.busy.append(False)

    def release(self, slab: int) -> None:
        self.busy[slab] = False

    def result(self, slab: int, rows: int, d: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slab as a [rows, d] tensor of its own storage: when the last tensor
        viewing that storage dies, the slab is free again."""
        out = torch.frombuffer(self.arrays[slab], dtype=dtype, count=rows * d).view(rows, d)
        weakref.finalize(out.untyped_storage(), self.release, slab)
        return out


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool(comm: Any) -> _SlabPool:
    pool = _pools.get(comm)
    if pool is None:
        pool = _pools[comm] = _SlabPool(comm)
    return pool


def _push(comm: Any, x: torch.Tensor, index: Optional[torch.Tensor], plan: RowPlan):
    """Rows ``x[index]`` (``x`` when index is None) by ``plan``; this rank's received rows."""
    me, d, dtype = comm.rank, x.shape[1], x.dtype
    row_bytes = d * x.element_size()
    pool = _pool(comm)
    ids = pool.acquire([r * row_bytes for r in plan.recv_rows], hash((plan.fingerprint, row_bytes)))
    try:
        for dst in range(comm.world_size):
            segments = plan.segments[me][dst]
            if not segments:
                continue
            flat = pool.slabs[ids[dst]][dst][: plan.recv_rows[dst] * row_bytes]
            into = flat.view(dtype).view(-1, d)
            for src_row, dst_row, n in segments:
                out = into[dst_row : dst_row + n]
                if index is None:
                    out.copy_(x[src_row : src_row + n])
                else:
                    torch.index_select(x, 0, index[src_row : src_row + n], out=out)
        comm.barrier()  # every write into every slab has landed
    except BaseException:
        if ids[me] >= 0:
            pool.release(ids[me])
        raise
    if ids[me] < 0:
        return x.new_empty(0, d)
    return pool.result(ids[me], plan.recv_rows[me], d, dtype)


class PushRows(torch.autograd.Function):
    """``_push`` with autograd: the backward pushes the gradient rows back by the transposed
    plan, then scatters them onto ``x``'s rows (``index_add_``: a row sent k times gets the
    sum of its k gradients)."""

    @staticmethod
    def forward(ctx, x, index, comm, plan: RowPlan):
        ctx.comm, ctx.plan, ctx.rows = comm, plan, x.shape[0]
        ctx.has_index = index is not None
        if index is not None:
            ctx.save_for_backward(index)
        return _push(comm, x, index, plan)

    @staticmethod
    def backward(ctx, grad):
        back = _push(ctx.comm, grad.contiguous(), None, ctx.plan.transposed())
        if not ctx.has_index:
            return back, None, None, None
        (index,) = ctx.saved_tensors
        grad_x = back.new_zeros(ctx.rows, back.shape[1]).index_add_(0, index, back)
        return grad_x, None, None, None


def push_rows(
    x: torch.Tensor, index: Optional[torch.Tensor], comm: Any, plan: RowPlan
) -> torch.Tensor:
    """Rows ``x[index]`` (or ``x``'s rows) sent by ``plan`` from this rank (``comm.rank``),
    written once, straight into the receivers' memory; returns the rows this rank received,
    ``[plan.recv_rows[comm.rank], x.shape[1]]``, laid out as the plan says. Collective."""
    if x.dim() != 2:
        raise ValueError(f"[rank {comm.rank}] push_rows: x must be [rows, dim], got {x.shape}")
    sent = plan.send_rows[comm.rank]
    have = x.shape[0] if index is None else index.numel()
    if have != sent:
        raise ValueError(
            f"[rank {comm.rank}] push_rows: the plan sends {sent} rows from this rank, "
            f"{'x' if index is None else 'index'} has {have}"
        )
    return PushRows.apply(x, index, comm, plan)
