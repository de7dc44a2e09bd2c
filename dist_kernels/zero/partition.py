"""Pure partition plan of the sharded optimizer: flat buffers, buckets and per-rank shards.

Each *flat group* (the parameters of one param group with one dtype) is laid out in one flat
buffer, every parameter at an offset aligned to 16 bytes. The buffer is cut into buckets (the
unit of one reduce-scatter / all-gather); every bucket holds a multiple of
``world_size * align`` elements and is split into ``world_size`` equal, aligned slices, slice
``r`` belonging to rank ``r``. A rank's shard is the concatenation of its slices, so every rank
holds exactly the same number of elements and a parameter may span several ranks::

    flat buffer  |p0 p0 p0 p1 p1|p1 p2 p2 p2 pad|      two buckets, world_size 2
    bucket 0     |r0 r0 |r1 r1 |                       rank r owns slice r of every bucket
    bucket 1                    |r0 r0 |r1 r1  |
    shard of r0  [bucket 0 slice 0][bucket 1 slice 0]  (contiguous in the rank's shard)

The buckets come from :func:`dist_kernels.buckets.plan.plan_flat_buckets` (the bucket planner
DDP uses too); this module adds the shard view of them: where each parameter sits in the flat
buffer and the segments of each rank's shard. The plan depends only on names, shapes, dtypes,
world size and bucket size: no tensors, no I/O. It is recorded in checkpoints, whose loader
re-plans for the new world size and maps the pieces by parameter name and element offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ..buckets.plan import Bucket, plan_flat_buckets

ALIGN_BYTES = 16
"""Parameter offsets and shard slices are multiples of 16 bytes: one SSE/NEON vector, and the
width of a CUDA 16-byte vector load."""


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one parameter."""

    name: str
    shape: Tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its flat buffer."""

    index: int  # position in the flat group's parameter list
    name: str
    shape: Tuple[int, ...]
    offset: int  # first element in the flat buffer
    numel: int


@dataclass(frozen=True)
class Segment:
    """A run of one parameter's elements inside one rank's shard."""

    slot: int
    name: str
    param_start: int  # first element within the parameter (flattened)
    length: int
    shard_offset: int  # first element within the rank's shard
    flat_offset: int  # first element within the flat buffer


@dataclass(frozen=True)
class FlatGroupPlan:
    """Layout of one flat buffer (one param group, one dtype) and its shards."""

    key: str  # "<param group>/<dtype>", e.g. "0/float32"
    itemsize: int
    world_size: int
    slots: Tuple[Slot, ...]
    buckets: Tuple[Bucket, ...]
    numel: int  # flat buffer elements, padding included
    shard_numel: int  # elements of every rank's shard (numel // world_size)
    _segments: Dict[int, Tuple[Segment, ...]] = field(default_factory=dict, compare=False)

    @property
    def align(self) -> int:
        """Alignment unit in elements."""
        return max(1, ALIGN_BYTES // self.itemsize)

    def segments(self, rank: int) -> Tuple[Segment, ...]:
        """The parameter pieces in ``rank``'s shard, in shard order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: {rank} is outside [0, {self.world_size})")
        if rank not in self._segments:
            self._segments[rank] = tuple(_rank_segments(self, rank))
        return self._segments[rank]

    def describe(self) -> str:
        """A printable table of the layout."""
        lines = [
            f"flat group {self.key}: {len(self.slots)} params, {self.numel} elements "
            f"({self.numel * self.itemsize} B), {len(self.buckets)} buckets, "
            f"{self.shard_numel} elements per rank x {self.world_size} ranks"
        ]
        for b in self.buckets:
            lines.append(
                f"  bucket {b.index}: flat [{b.start}, {b.start + b.numel}), slice "
                f"{b.slice_numel} per rank at shard offset {b.shard_offset}, "
                f"params {list(b.param_indices)}"
            )
        for s in self.slots:
            lines.append(
                f"  param {s.index} {s.name} {list(s.shape)}: flat [{s.offset}, "
                f"{s.offset + s.numel})"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class PartitionPlan:
    """Every flat group's plan for one world size."""

    world_size: int
    groups: Tuple[FlatGroupPlan, ...]

    def describe(self) -> str:
        """A printable summary of every flat group."""
        return "\n".join(g.describe() for g in self.groups)

    __str__ = describe


def _rank_segments(plan: FlatGroupPlan, rank: int) -> List[Segment]:
    segments = []
    for bucket in plan.buckets:
        lo = bucket.slice_start(rank)
        hi = lo + bucket.slice_numel
        for index in bucket.param_indices:
            slot = plan.slots[index]
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                shard_offset = bucket.shard_offset + (start - lo)
                segments.append(
                    Segment(index, slot.name, start - slot.offset, end - start, shard_offset, start)
                )
    return segments


def plan_flat_group(
    key: str,
    params: Sequence[ParamSpec],
    itemsize: int,
    world_size: int,
    bucket_cap_bytes: int,
) -> FlatGroupPlan:
    """Lays out ``params`` (in the given order) and cuts the buffer into buckets.

    Invariants (tested): offsets are aligned; every bucket is a multiple of
    ``world_size * align``; the ranks' shards have equal size and together cover every
    parameter element exactly once.
    """
    flat = plan_flat_buckets(
        [p.numel for p in params],
        itemsize,
        bucket_cap_bytes,
        world_size,
        names=[p.name for p in params],
        align=ALIGN_BYTES,
    )
    slots = tuple(
        Slot(i, p.name, tuple(p.shape), offset, p.numel)
        for i, (p, offset) in enumerate(zip(params, flat.flat_offsets))
    )
    return FlatGroupPlan(
        key,
        itemsize,
        world_size,
        slots,
        flat.buckets,
        flat.flat_numel,
        flat.flat_numel // world_size,
    )


def plan_partition(
    flat_groups: Sequence[Tuple[str, int, Sequence[ParamSpec]]],
    world_size: int,
    bucket_cap_bytes: int,
) -> PartitionPlan:
    """Plans every flat group: ``flat_groups`` holds ``(key, itemsize, params)`` triples."""
    groups = tuple(
        plan_flat_group(key, params, itemsize, world_size, bucket_cap_bytes)
        for key, itemsize, params in flat_groups
    )
    return PartitionPlan(world_size, groups)


__all__ = [
    "ALIGN_BYTES",
    "Bucket",
    "FlatGroupPlan",
    "ParamSpec",
    "PartitionPlan",
    "Segment",
    "Slot",
    "plan_flat_group",
    "plan_partition",
]
