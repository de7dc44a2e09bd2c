"""Gradient bucket plans: which parameter elements each bucket holds, and where (pure).

One vocabulary for every engine: a :class:`Bucket` is a flat run of ``numel`` elements holding
:class:`BucketSlot` s (a parameter's elements at an aligned offset); the
:class:`~dist_kernels.buckets.reducer.BucketReducer` launches buckets in plan order. Two layouts:

* :func:`plan_buckets` (DDP): each bucket a buffer of its own, filled greedily up to a byte cap
  in the order gradients are expected to arrive, never splitting a parameter::

      bucket 0  |p3 p3 .|p2|           (reverse registration order: the last layer's gradient
      bucket 1  |p1 p1 p1 .|p0 p0|      is ready first in backward)

* :func:`plan_flat_buckets` (ZeRO): the parameters back to back in one flat buffer, cut into
  equal buckets of a multiple of ``shards * align`` elements, so that every bucket splits into
  ``shards`` equal aligned slices (slice r is rank r's); a parameter whose elements cross a cut
  has a slot in each bucket (``param_offset`` says where its part starts)::

      flat      |p0 p0 p0 p1 p1|p1 p2 p2 p2 pad|     shards 2
      bucket 0  |r0 r0 |r1 r1 |                      slots: p0 [0, 3), p1 [0, 2)
      bucket 1                 |r0 r0 |r1 r1  |      slots: p1 [2, 3), p2 [0, 3)

On top of a plan DDP adds :func:`with_status_slots` (status elements after the last bucket's
gradients, summed by its all-reduce), :func:`rebuilt_order` (the plan after the first backward)
and the fingerprints ranks compare under ``DK_DEBUG=1``. Nothing here touches a tensor's data
or communicates.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "BucketSlot",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "plan_flat_buckets",
    "with_status_slots",
    "rebuilt_order",
]

WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class BucketSlot:
    """Where one parameter's gradient (or, in a flat plan, part of it) lives in its bucket."""

    index: int
    """Position of the parameter in the sequence given to the planner."""
    name: str
    """The parameter's name when names were given, else ``"param<index>"``."""
    numel: int
    """Number of elements."""
    offset: int
    """First element in the bucket (a multiple of ``align / itemsize``)."""
    param_offset: int = 0
    """First element of the parameter (flattened) that the slot holds: 0 unless a flat plan
    cut the parameter between buckets."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat run of ``numel`` elements of ``dtype`` holding the gradients of ``slots``."""

    index: int
    dtype: Optional[torch.dtype]
    """The wire dtype (None in a flat plan made from an itemsize alone)."""
    slots: Tuple[BucketSlot, ...]
    numel: int
    """Elements including alignment padding (the size to allocate)."""
    start: int = 0
    """First element in the flat buffer of a flat plan (0 for a bucket of its own)."""
    shards: int = 1
    """Equal slices the bucket splits into (a flat plan's ``shards``: the world size)."""
    status_offset: Optional[int] = None
    """Where :func:`with_status_slots` put the status elements (the last bucket only)."""
    group: int = 0
    """Which reduction group the bucket's parameters belong to (``plan_buckets``'
    ``group_of``: 0 the engine's communicator, e.g. 1 the expert-parallel replicas)."""

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @functools.cached_property
    def offsets(self) -> Tuple[int, ...]:
        """Element offset of each slot, in slot order (computed once: pack calls reuse it)."""
        return tuple(s.offset for s in self.slots)

    @functools.cached_property
    def counts(self) -> Tuple[int, ...]:
        """Element count of each slot, in slot order."""
        return tuple(s.numel for s in self.slots)

    @property
    def param_indices(self) -> Tuple[int, ...]:
        return tuple(s.index for s in self.slots)

    def select(self, items: Sequence) -> list:
        """``items`` (indexed like the planned parameters) in this bucket's slot order."""
        return [items[s.index] for s in self.slots]

    @property
    def slice_numel(self) -> int:
        """Elements of each of the ``shards`` slices."""
        return self.numel // self.shards

    @property
    def shard_offset(self) -> int:
        """Where every rank's slice of this bucket sits in that rank's shard (flat plans)."""
        return self.start // self.shards

    def slice_start(self, rank: int) -> int:
        """First flat element of ``rank``'s slice."""
        return self.start + rank * self.slice_numel

    def renumbered(self, index: int, first_param: int) -> Bucket:
        """This bucket as bucket ``index`` of a longer list whose parameters are numbered from
        ``first_param`` (an engine that reduces several plans with one reducer)."""
        slots = tuple(dataclasses.replace(s, index=s.index + first_param) for s in self.slots)
        return dataclasses.replace(self, index=index, slots=slots)

    def describe(self) -> str:
        """One line: ``bucket 0: 3 params, 1024 x bfloat16 (2.0 KiB)``."""
        dtype = str(self.dtype).replace("torch.", "")
        status = ", status slots" if self.status_offset is not None else ""
        return (
            f"bucket {self.index}: {len(self.slots)} params, {self.numel} x {dtype} "
            f"({self.nbytes / 1024:.1f} KiB){status}"
        )


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Buckets in the order they fill during the backward pass."""

    buckets: Tuple[Bucket, ...]
    cap_bytes: int
    first_bucket_bytes: int
    align: int
    num_params: int
    flat_offsets: Tuple[int, ...] = ()
    """A flat plan: each parameter's first element in the flat buffer."""
    flat_numel: int = 0
    """A flat plan: the flat buffer's elements, padding included (the sum of the buckets')."""

    def bucket_of(self, param_index: int) -> Tuple[int, int]:
        """(bucket index, slot index) of a parameter's first slot; KeyError if it has none."""
        for bucket in self.buckets:
            for k, slot in enumerate(bucket.slots):
                if slot.index == param_index:
                    return bucket.index, k
        raise KeyError(f"parameter {param_index} is in no bucket")

    def __str__(self) -> str:
        lines = [
            f"BucketPlan: {len(self.buckets)} bucket(s), {self.num_params} parameter(s), "
            f"cap {self.cap_bytes} B (first {self.first_bucket_bytes} B), align {self.align} B"
        ]
        for b in self.buckets:
            dtype = str(b.dtype).replace("torch.", "")
            size = f", {b.nbytes} B" if b.dtype is not None else ""
            lines.append(f"  bucket {b.index}: {dtype}, {b.numel} elements{size}")
            for s in b.slots:
                lines.append(f"    [{s.offset:>10}, {s.offset + s.numel:>10})  {s.name}")
        return "\n".join(lines)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _describe_params(params_or_sizes: Iterable) -> List[Tuple[str, int, torch.dtype, bool]]:
    """(name, numel, dtype, wants_grad) per entry: a tensor, an int, or a (name, either) pair."""
    described = []
    for i, item in enumerate(params_or_sizes):
        name = f"param{i}"
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, item = item
        if isinstance(item, torch.Tensor):
            wants_grad = not isinstance(item, torch.nn.Parameter) or item.requires_grad
            described.append((name, item.numel(), item.dtype, wants_grad))
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            described.append((name, item, torch.float32, True))
        else:
            raise TypeError(
                f"params_or_sizes[{i}]: expected a tensor, a non-negative int or a "
                f"(name, tensor) pair, got {item!r}"
            )
    return described


def _check_plan_args(cap_bytes, first_bucket_bytes, align, dtype, order, num_params):
    if not isinstance(cap_bytes, int) or cap_bytes <= 0:
        raise ValueError(f"cap_bytes: expected a positive int, got {cap_bytes!r}")
    if first_bucket_bytes is not None and (
        not isinstance(first_bucket_bytes, int) or first_bucket_bytes <= 0
    ):
        raise ValueError(f"first_bucket_bytes: expected a positive int, got {first_bucket_bytes!r}")
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"align: expected a power of two in bytes, got {align!r}")
    if dtype is not None and dtype not in WIRE_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    if order is not None and sorted(order) != list(range(len(order))):
        raise ValueError(f"order: expected distinct indices below {num_params}, got {list(order)}")
    if order is not None and any(not 0 <= i < num_params for i in order):
        raise ValueError(f"order: expected indices below {num_params}, got {list(order)}")


class _OpenBucket:
    """A bucket being filled: slots so far and its byte cap."""

    def __init__(self, dtype: torch.dtype, cap_bytes: int, group: int = 0):
        self.dtype, self.cap_bytes, self.slots, self.end = dtype, cap_bytes, [], 0
        self.group = group

    def fits(self, numel: int, align_elems: int) -> bool:
        end = _round_up(self.end, align_elems) + numel
        return not self.slots or end * _itemsize(self.dtype) <= self.cap_bytes

    def add(self, index: int, name: str, numel: int, align_elems: int) -> None:
        offset = _round_up(self.end, align_elems)
        self.slots.append(BucketSlot(index, name, numel, offset))
        self.end = offset + numel


def plan_buckets(
    params_or_sizes: Iterable,
    cap_bytes: int = 25 * 2**20,
    dtype: Optional[torch.dtype] = None,
    first_bucket_bytes: Optional[int] = None,
    align: int = 16,
    order: Optional[Sequence[int]] = None,
    group_of: Optional[Callable[[int], int]] = None,
) -> BucketPlan:
    """Assigns parameters to gradient buckets.

    Args:
        params_or_sizes: tensors (e.g. ``model.parameters()``), element counts (float32), or
            ``(name, tensor)`` pairs (``model.named_parameters()``). ``nn.Parameter`` objects
            with ``requires_grad=False`` get no bucket.
        cap_bytes: largest bucket in bytes (padding included). A parameter larger than the cap
            gets a bucket of its own; no parameter is split.
        dtype: the bucket (wire) dtype; by default each parameter's own dtype, and parameters
            of different dtypes go to different buckets.
        first_bucket_bytes: cap of the first bucket of each dtype (a small first bucket starts
            communication earlier); defaults to ``cap_bytes``.
        align: byte alignment of every slot's start (a power of two, a multiple of the itemsize).
        order: the order in which parameters are assigned (e.g. the order their gradients
            became ready); defaults to reverse registration order.
        group_of: parameter index -> reduction group (default 0 for all): parameters of
            different groups never share a bucket (MoE: experts are reduced over their
            replicas only). The last bucket, which carries the status slots, is of group 0.

    Returns:
        A :class:`BucketPlan`; ``print(plan)`` shows every slot.
    """
    described = _describe_params(params_or_sizes)
    _check_plan_args(cap_bytes, first_bucket_bytes, align, dtype, order, len(described))
    first = cap_bytes if first_bucket_bytes is None else first_bucket_bytes
    open_buckets: dict = {}
    closed: List[_OpenBucket] = []
    for i in reversed(range(len(described))) if order is None else order:
        name, numel, param_dtype, wants_grad = described[i]
        if not wants_grad:
            continue
        wire = dtype or param_dtype
        if wire not in WIRE_DTYPES:
            raise TypeError(f"params_or_sizes[{i}] ({name}): dtype {param_dtype} has no bucket")
        itemsize = _itemsize(wire)
        if align % itemsize:
            raise ValueError(f"align: {align} B is not a multiple of the {wire} itemsize")
        group = 0 if group_of is None else int(group_of(i))
        current = open_buckets.get((wire, group))
        if current is None or not current.fits(numel, align // itemsize):
            if current is not None:
                closed.append(current)
            seen = any(b.dtype == wire for b in closed)
            cap = cap_bytes if seen else first
            current = open_buckets[(wire, group)] = _OpenBucket(wire, cap, group)
        current.add(i, name, numel, align // itemsize)
    closed.extend(sorted(open_buckets.values(), key=lambda b: b.group == 0))  # group 0 last
    if closed and closed[-1].group != 0:
        raise ValueError(
            "plan_buckets: every parameter is outside group 0; the status slots need one"
        )
    buckets = tuple(
        Bucket(
            k, b.dtype, tuple(b.slots), _round_up(b.end, align // _itemsize(b.dtype)), group=b.group
        )
        for k, b in enumerate(closed)
    )
    return BucketPlan(buckets, cap_bytes, first, align, len(described))


def plan_flat_buckets(
    numels: Sequence[int],
    itemsize: int,
    cap_bytes: int,
    shards: int,
    *,
    names: Optional[Sequence[str]] = None,
    dtype: Optional[torch.dtype] = None,
    align: int = 16,
) -> BucketPlan:
    """Lays the parameters out back to back in one flat buffer and cuts it into buckets.

    Args:
        numels: element counts, in layout order (the order gradients are expected).
        itemsize: bytes per element of the flat buffer.
        cap_bytes: bucket size in bytes, rounded down to a whole number of alignment units
            (one unit is ``shards * align`` bytes; a bucket holds at least one); the last
            bucket takes what is left.
        shards: equal slices every bucket splits into (the world size of a sharded engine).
        names, dtype: recorded in the slots and buckets.
        align: byte alignment of every parameter's start and of every slice.

    Invariants (tested): offsets are aligned; every bucket is a multiple of ``shards``
    alignment units; the buckets cover the flat buffer exactly, so the ranks' shards (slice r
    of every bucket) have equal sizes and together hold every parameter element once.
    """
    if shards < 1:
        raise ValueError(f"world_size: must be >= 1, got {shards}")
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes: must be > 0, got {cap_bytes}")
    align_elems = max(1, align // itemsize)
    offsets, end = [], 0
    for numel in numels:
        offsets.append(end)
        end = _round_up(end + numel, align_elems)
    unit = shards * align_elems
    flat_numel = _round_up(max(end, 1), unit)
    bucket_numel = max(unit, cap_bytes // itemsize // unit * unit)
    buckets, start = [], 0
    while start < flat_numel:
        size = min(bucket_numel, flat_numel - start)
        slots = tuple(
            _flat_slot(i, names, offsets[i], numel, start, size)
            for i, numel in enumerate(numels)
            if offsets[i] < start + size and offsets[i] + numel > start
        )
        buckets.append(Bucket(len(buckets), dtype, slots, size, start, shards))
        start += size
    return BucketPlan(
        tuple(buckets), cap_bytes, cap_bytes, align, len(numels), tuple(offsets), flat_numel
    )


def _flat_slot(index, names, flat_offset: int, numel: int, start: int, size: int) -> BucketSlot:
    """The part of one parameter (at ``flat_offset``) inside the bucket ``[start, start+size)``."""
    lo, hi = max(start, flat_offset), min(start + size, flat_offset + numel)
    name = names[index] if names is not None else f"param{index}"
    return BucketSlot(index, name, hi - lo, lo - start, lo - flat_offset)


# --------------------------------------------------------------------------------------------
# What DDP adds: status slots, the rebuilt order, fingerprints
# --------------------------------------------------------------------------------------------

#: Bucket status slots: the last bucket launched in a backward carries these trailing
#: elements, summed by its all-reduce like the gradients, so they cost no extra collective.
#: FOUND_INF: this rank saw an inf/NaN gradient. ERROR: this rank's backward was incomplete
#: (a parameter without a gradient): peers raise instead of unpacking garbage. ABORTED: this
#: rank's backward was abandoned midway (an exception, e.g. from a user hook), and the rank
#: sent its remaining buckets only to release the peers waiting for them.
FOUND_INF_SLOT = 0
ERROR_SLOT = 1
ABORTED_SLOT = 2
STATUS_SLOTS = 3

#: Fingerprint fields exchanged under DK_DEBUG=1 before every bucket all-reduce.
FINGERPRINT_FIELDS = ("sequence", "bucket", "numel", "dtype", "params", "layout", "status")
STATUS_OK = 0
STATUS_INCOMPLETE = 1
STATUS_ABORTED = 2


def _align(numel: int, dtype: torch.dtype, alignment_bytes: int = 16) -> int:
    per = max(1, alignment_bytes // _itemsize(dtype))
    return (numel + per - 1) // per * per


def with_status_slots(buckets: Sequence[Bucket]) -> List[Bucket]:
    """The buckets with :data:`STATUS_SLOTS` status elements after the last one's slots
    (re-aligned to 16 bytes): what DDP allocates."""
    out = list(buckets)
    if out:
        last = out[-1]
        status_offset = _align(last.numel, last.dtype)
        numel = _align(status_offset + STATUS_SLOTS, last.dtype)
        out[-1] = dataclasses.replace(last, numel=numel, status_offset=status_offset)
    return out


def rebuilt_order(ready_order: Sequence[int], num_params: int) -> List[int]:
    """The bucket order for later iterations: gradients in the order they became ready.

    Parameters never observed (unused in the first iteration) follow in reverse registration
    order, the order autograd usually produces for them. Duplicates keep their first position.
    """
    seen = set()
    order = []
    for index in ready_order:
        if not 0 <= index < num_params:
            raise ValueError(f"ready_order: index {index} outside [0, {num_params})")
        if index not in seen:
            seen.add(index)
            order.append(index)
    order.extend(i for i in reversed(range(num_params)) if i not in seen)
    return order


def layout_signature(buckets: Sequence[Bucket]) -> int:
    """A 31-bit checksum of every bucket's members and offsets (fingerprint ``layout``)."""
    text = ";".join(f"{b.param_indices}{b.offsets}{b.numel}{b.dtype}" for b in buckets)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def fingerprint(
    sequence: int, bucket: Bucket, dtype_code: int, layout: int, status: int
) -> List[int]:
    """The integers all ranks compare before one bucket's all-reduce (DK_DEBUG=1)."""
    return [sequence, bucket.index, bucket.numel, dtype_code, len(bucket.slots), layout, status]


def fingerprint_mismatch(per_rank: Sequence[Sequence[int]]) -> Optional[str]:
    """None when every rank sent the same fingerprint, else a message naming ranks and buckets.

    ``per_rank[r]`` is rank r's :func:`fingerprint`. Ranks are grouped by what they sent, so
    the message reads "rank 0: bucket 3 ...; ranks 1, 2: bucket 2 ...".
    """
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for rank, fields in enumerate(per_rank):
        groups.setdefault(tuple(int(f) for f in fields), []).append(rank)
    if len(groups) == 1:
        return None
    parts = []
    for fields, ranks in groups.items():
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        named = dict(zip(FINGERPRINT_FIELDS, fields))
        state = _STATUS_NAMES.get(named["status"], f"status {named['status']}")
        parts.append(
            f"{who}: all-reduce #{named['sequence']} of bucket {named['bucket']} "
            f"({named['numel']} elements, dtype code {named['dtype']}, {named['params']} params, "
            f"layout {named['layout']:#x}, {state})"
        )
    return "DDP bucket fingerprints differ across ranks: " + "; ".join(parts)


_STATUS_NAMES = {
    STATUS_OK: "ready",
    STATUS_INCOMPLETE: "incomplete backward",
    STATUS_ABORTED: "abandoned backward",
}


def status_slots(status: int, found_inf: bool) -> List[float]:
    """The values one rank writes into the status slots (indexed by the ``*_SLOT`` names)."""
    slots = [0.0] * STATUS_SLOTS
    slots[FOUND_INF_SLOT] = float(found_inf)
    slots[ERROR_SLOT] = float(status == STATUS_INCOMPLETE)
    slots[ABORTED_SLOT] = float(status == STATUS_ABORTED)
    return slots
