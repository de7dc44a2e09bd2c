"""Pure planning for the DDP engine: bucket order, cross-rank fingerprints, model descriptions.

Nothing here communicates or touches gradients; every function is data in, data out, so the
unit tests check it without ranks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

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


@dataclass(frozen=True)
class BucketLayout:
    """Where each gradient of one bucket lives in the bucket's flat wire buffer.

    ``offsets`` and ``numel`` count elements of ``dtype`` (the wire dtype); every offset is
    aligned to 16 bytes. ``numel`` includes trailing padding and, for the last bucket, the
    :data:`STATUS_SLOTS` status elements at ``status_offset``.
    """

    index: int
    param_indices: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    numel: int
    dtype: torch.dtype
    status_offset: Optional[int] = None

    def describe(self) -> str:
        """One line: ``bucket 0: 3 params, 1024 x bfloat16 (2.0 KiB)``."""
        nbytes = self.numel * _itemsize(self.dtype)
        dtype = str(self.dtype).replace("torch.", "")
        status = ", status slots" if self.status_offset is not None else ""
        return (
            f"bucket {self.index}: {len(self.param_indices)} params, {self.numel} x {dtype} "
            f"({nbytes / 1024:.1f} KiB){status}"
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(numel: int, dtype: torch.dtype, alignment_bytes: int = 16) -> int:
    per = max(1, alignment_bytes // _itemsize(dtype))
    return (numel + per - 1) // per * per


def layouts_from_plan(buckets: Sequence[Any]) -> List[BucketLayout]:
    """:class:`BucketLayout` s from the buckets of ``dist_kernels.bucketing.plan_buckets``.

    Adds the :data:`STATUS_SLOTS` status elements after the last bucket's slots (re-aligned to
    16 bytes), which is what the engine allocates.
    """
    layouts = []
    for position, bucket in enumerate(buckets):
        last = position == len(buckets) - 1
        status_offset = _align(bucket.numel, bucket.dtype) if last else None
        numel = _align(status_offset + STATUS_SLOTS, bucket.dtype) if last else bucket.numel
        layouts.append(
            BucketLayout(
                index=bucket.index,
                param_indices=tuple(bucket.param_indices),
                offsets=tuple(bucket.offsets),
                sizes=tuple(bucket.counts),
                numel=numel,
                dtype=bucket.dtype,
                status_offset=status_offset,
            )
        )
    return layouts


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


def layout_signature(layouts: Sequence[BucketLayout]) -> int:
    """A 31-bit checksum of every bucket's members and offsets (fingerprint ``layout``)."""
    text = ";".join(f"{b.param_indices}{b.offsets}{b.numel}{b.dtype}" for b in layouts)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def fingerprint(
    sequence: int, bucket: BucketLayout, dtype_code: int, layout: int, status: int
) -> List[int]:
    """The integers all ranks compare before one bucket's all-reduce (DK_DEBUG=1)."""
    return [sequence, bucket.index, bucket.numel, dtype_code, len(bucket.param_indices), layout,
            status]  # fmt: skip


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


def describe_parameters(named: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
    """``name shape dtype`` lines that must agree across ranks before parameters are broadcast."""
    return [f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for name, t in named]


def first_description_mismatch(per_rank: Sequence[Sequence[str]]) -> Optional[str]:
    """None when all ranks describe the same model, else the first differing entry and ranks."""
    longest = max(len(d) for d in per_rank)
    for position in range(longest):
        entries = [d[position] if position < len(d) else "<missing>" for d in per_rank]
        if len(set(entries)) > 1:
            differing = [r for r, e in enumerate(entries) if e != entries[0]]
            shown = "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
            return (
                f"DistributedDataParallel: models differ across ranks at entry {position} "
                f"(ranks {differing} differ from rank 0): {shown}"
            )
    return None
