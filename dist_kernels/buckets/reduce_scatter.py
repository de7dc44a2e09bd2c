"""ZeRO's buckets on a reduce-scatter: the collective a :class:`BucketReducer` drives for ZeRO.

Every bucket is a range of one flat gradient layout (``plan.plan_flat_buckets``); its
reduce-scatter (``ReduceOp.AVG``, FP32 accumulation inside the collective) leaves this rank's
slice of the average in its gradient shard:

* stage 1: ``.grad`` are views of one full gradient buffer; the bucket's range of it is
  reduce-scattered in place (the output is this rank's own slice, as NCCL allows), so no
  second copy exists. After that the other slices still hold local gradients: before more
  accumulate (a backward without ``zero_grad``), :meth:`ReduceScatter.reopen` makes the bucket
  a valid local contribution again;
* stages 2, 3: each gradient piece is copied (cast to the wire dtype) into one of
  ``STAGING_SLOTS`` staging buffers when its parameter is ready, and ``.grad`` is dropped once
  every piece is in. The reducer's window (``STAGING_SLOTS`` buckets) makes a bucket wait
  until the bucket that used its staging buffer before is complete.

A 16-bit wire for parameters of another dtype goes through a staging buffer and a wire-dtype
output slice, converted into the shard when the bucket completes; accumulating (a second
reduction before ``zero_grad``) adds into the shard instead of overwriting it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..dtypes import ReduceOp
from .plan import Bucket, BucketSlot

__all__ = ["ReduceScatter", "ShardTarget", "STAGING_SLOTS"]

#: Stages 2, 3: one bucket filling while the previous one is on the wire.
STAGING_SLOTS = 2


@dataclass(frozen=True)
class ShardTarget:
    """Where one bucket's reduce-scatter reads and writes on this rank."""

    shard: torch.Tensor
    """This rank's slice of the bucket's reduced gradient (in the parameter dtype)."""
    wire_dtype: torch.dtype
    full: Optional[torch.Tensor] = None
    """Stage 1: the bucket's range of the full gradient buffer (reduced in place)."""
    comm: Any = None
    """The ranks sharing this bucket's shards (None: the collective's; MoE experts: their
    replicas)."""
    scale: float = 1.0
    """Multiplies the average (MoE experts: ``expert_comm.world_size / comm.world_size``)."""


class ReduceScatter:
    """The reducer's collective for ZeRO: each bucket reduce-scattered into gradient shards.

    Args:
        comm: the Communicator of the ranks that share the shards.
        params: the parameters, indexed as the plan's slots.
        targets: per bucket, where its reduce-scatter reads and writes.
        stage: 1 (full gradients kept, reduced in place) or 2, 3 (staging).
        grad_views: stage 1: each parameter's view of the full gradient buffer.
    """

    def __init__(
        self,
        comm: Any,
        params: Sequence[torch.nn.Parameter],
        targets: Sequence[ShardTarget],
        *,
        stage: int,
        grad_views: Optional[Sequence[torch.Tensor]] = None,
    ) -> None:
        self.comm = comm
        self.device = targets[0].shard.device if targets else torch.device("cpu")
        self.params = list(params)
        self.targets = list(targets)
        self.stage = stage
        self._grad_views = list(grad_views) if grad_views is not None else None
        self.layouts: List[Bucket] = []
        self.staging: Dict[torch.dtype, List[torch.Tensor]] = {}
        self.rs_out: Dict[torch.dtype, List[torch.Tensor]] = {}
        #: Whether the shards hold a reduction not cleared since (the next one accumulates).
        self.holds_reduced = False
        self._reduced_in_place: set = set()  # stage 1: buckets whose slice holds the average
        self._owner: Dict[Tuple[torch.dtype, int], int] = {}  # staging buffer -> bucket
        self._pieces_left: List[int] = []  # per parameter: pieces in the plan
        self._left: List[int] = []  # per parameter: pieces not delivered in this pass
        self._accumulate = False

    @property
    def window(self) -> Optional[int]:
        """How many buckets may fill at once: ``STAGING_SLOTS`` where buckets share staging
        buffers (stages 2, 3, or a wire dtype other than the parameters'), else no bound."""
        converts = any(t.wire_dtype != t.shard.dtype for t in self.targets)
        return STAGING_SLOTS if self.stage != 1 or converts else None

    def buffers(self) -> List[torch.Tensor]:
        """The staging buckets and wire-dtype output slices (for memory accounting)."""
        return [t for bufs in (*self.staging.values(), *self.rs_out.values()) for t in bufs]

    # ----------------------------------------------------------------- the reducer's calls

    def allocate(self, buckets: Sequence[Bucket]) -> List[Bucket]:
        """Staging buckets and output slices, shared by every bucket of one wire dtype
        (``STAGING_SLOTS`` each): needed at stages 2, 3 and for a wire dtype that differs from
        the parameters' (collective: registered memory)."""
        self.layouts = list(buckets)
        biggest: Dict[torch.dtype, int] = defaultdict(int)
        needs: Dict[torch.dtype, bool] = defaultdict(bool)
        for bucket, target in zip(self.layouts, self.targets):
            biggest[target.wire_dtype] = max(biggest[target.wire_dtype], bucket.numel)
            converts = target.wire_dtype != target.shard.dtype
            needs[target.wire_dtype] |= self.stage != 1 or converts
        for wire, numel in biggest.items():
            if not needs[wire]:
                continue
            self.staging[wire] = [self.comm.empty((numel,), wire) for _ in range(STAGING_SLOTS)]
            if any(t.wire_dtype == wire != t.shard.dtype for t in self.targets):
                slice_numel = max(
                    b.slice_numel
                    for b, t in zip(self.layouts, self.targets)
                    if t.wire_dtype == wire
                )
                self.rs_out[wire] = [
                    self.comm.empty((slice_numel,), wire) for _ in range(STAGING_SLOTS)
                ]
        self._pieces_left = [0] * len(self.params)
        for bucket in self.layouts:
            for slot in bucket.slots:
                self._pieces_left[slot.index] += 1
        return self.layouts

    def begin(self, *, shadow: bool = False) -> None:
        self._owner = {}
        self._filled = {}
        self._left = list(self._pieces_left)
        self._accumulate = self.stage != 1 and self.holds_reduced

    def deliver(self, b: int, slot: BucketSlot) -> None:
        """One piece of a ready gradient: stage 1 keeps ``.grad`` the view of the full buffer;
        stages 2, 3 copy the piece into the bucket's staging buffer (dropping ``.grad`` after
        its last piece)."""
        p = self.params[slot.index]
        if self.stage == 1:
            self._adopt_grad(slot.index)
            return
        staging = self._staging_for(b)
        if p.grad is not None:
            src = p.grad.reshape(-1)[slot.param_offset : slot.param_offset + slot.numel]
            staging[slot.offset : slot.offset + slot.numel].copy_(src)
            self._filled[b].append((slot.offset, slot.numel))
        self._left[slot.index] -= 1
        if self._left[slot.index] == 0:
            p.grad = None  # the gradient lives on only in the bucket

    def launch(self, b: int, status: int, sequence: int, group: Any) -> Tuple[Any, Callable]:
        """Starts the reduce-scatter of bucket ``b`` into this rank's gradient shard."""
        target, bucket = self.targets[b], self.layouts[b]
        if self.stage == 1:
            self.reopen(b)  # no gradient of it arrived in this backward
            src = target.full
            if target.wire_dtype != target.shard.dtype:
                staging = self._staging_for(b)
                staging.copy_(src)
                src = staging
        else:
            src = self._staging_for(b)
            _zero_gaps(src, self._filled[b])
        shard, accumulate = target.shard, self._accumulate
        direct = target.wire_dtype == shard.dtype and not accumulate
        if direct:
            out = shard
        elif target.wire_dtype != shard.dtype:
            out = self.rs_out[target.wire_dtype][b % STAGING_SLOTS][: bucket.slice_numel]
        else:  # accumulating in the parameter dtype: a temporary the size of one slice
            out = torch.empty_like(shard)
        comm = group if group is not None else self._comm_of(b)
        work = comm.reduce_scatter(out, src, op=ReduceOp.AVG, async_op=True)
        scale = target.scale

        def finish() -> None:
            if direct:
                if scale != 1.0:
                    shard.mul_(scale)
                return
            if accumulate:
                shard.add_(out, alpha=scale)
            else:
                shard.copy_(out)
                if scale != 1.0:
                    shard.mul_(scale)

        return work, finish

    def complete(self, b: int, handle: Tuple[Any, Callable]) -> None:
        work, finish = handle
        work.wait()
        finish()

    def wait(self, handles: Dict[int, Any], status: int, used: Optional[List[bool]]) -> None:
        for b, handle in handles.items():
            self.complete(b, handle)
        self.holds_reduced = True
        if self.stage == 1:
            self._reduced_in_place = set(range(len(self.layouts)))

    # ----------------------------------------------------------------- the owner's calls

    def clear(self) -> None:
        """The gradients were zeroed: the next reduction overwrites the shards."""
        self.holds_reduced = False
        self._reduced_in_place = set()

    def reopen(self, b: int) -> None:
        """Stage 1: after an in-place reduce-scatter this rank's slice holds the average and
        the other slices its local gradients. Before more gradients accumulate (a backward
        without ``zero_grad``), make the bucket a valid local contribution again: N times the
        average in our slice, zeros elsewhere, so the next reduce-scatter averages to
        average + new average on every rank (the target's ``scale`` undone first: it is
        applied again to the sum)."""
        if b not in self._reduced_in_place:
            return
        self._reduced_in_place.discard(b)
        comm, target = self._comm_of(b), self.targets[b]
        rows = target.full.view(comm.world_size, -1)
        mine = rows[comm.rank].clone() if comm.world_size > 1 else None
        if mine is not None:
            rows.zero_()
            rows[comm.rank].copy_(mine.mul_(comm.world_size / target.scale))

    @property
    def reduced_in_place(self) -> bool:
        """Stage 1: whether some bucket's slice holds an average (so it must be reopened)."""
        return bool(self._reduced_in_place)

    # ----------------------------------------------------------------- internals

    def _comm_of(self, b: int) -> Any:
        return self.targets[b].comm if self.targets[b].comm is not None else self.comm

    def _staging_for(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s staging buffer; the reducer's window has completed the bucket that
        used it before. Nothing is zeroed here: the gradients overwrite their slots, and
        :func:`_zero_gaps` zeroes the rest just before the reduce-scatter (zeroing the whole
        bucket first wrote every byte twice, a large part of stage 2's cost over stage 1)."""
        target, numel = self.targets[b], self.layouts[b].numel
        key = (target.wire_dtype, b % STAGING_SLOTS)
        buf = self.staging[target.wire_dtype][b % STAGING_SLOTS][:numel]
        if self._owner.get(key) != b:
            self._owner[key] = b
            self._filled[b] = []
        return buf

    def _adopt_grad(self, index: int) -> None:
        """Stage 1: makes ``.grad`` the view of the full gradient buffer again (a user's
        ``zero_grad(set_to_none=True)`` on the model makes autograd allocate a fresh one)."""
        p, view = self.params[index], self._grad_views[index]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view


def _zero_gaps(buf: torch.Tensor, filled: List[Tuple[int, int]]) -> None:
    """Zeroes the elements of ``buf`` outside the ``(offset, numel)`` runs a gradient wrote:
    padding between slots, the tail, and the slots of parameters without a gradient."""
    position = 0
    for offset, numel in sorted(filled):
        if offset > position:
            buf[position:offset].zero_()
        position = max(position, offset + numel)
    if position < buf.numel():
        buf[position:].zero_()
