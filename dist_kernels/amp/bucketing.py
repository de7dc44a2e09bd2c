"""Gradient buckets: a pure planner and the fused pack / unpack / unscale kernels.

Planning is plain data (design: "plan first, run second")::

    plan = plan_buckets(model.parameters(), cap_bytes=25 * 2**20, dtype=torch.bfloat16)
    print(plan)

assigns parameters to buckets by a byte cap in reverse registration order (gradients of the last
layers are ready first in the backward pass, as in ``torch.nn.parallel.DistributedDataParallel``),
never splitting a parameter, each parameter starting at a 16-byte aligned offset.

The kernels move gradients in and out of a bucket in one pass each::

    pack(grads, flat, bucket, scale=1 / world_size, flag=found_inf)    # cast, scale, check
    comm.all_reduce(flat)
    unpack(flat, grads, bucket, scale=inv_loss_scale, flag=found_inf)  # cast back, scale, check

Every call accepts CPU tensors and, in a CUDA build, CUDA tensors (the flag, the scale tensor and
the sums of squares then stay in device memory: nothing waits for the GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..dtypes import DTYPE_CODES

__all__ = [
    "BucketSlot",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "pack",
    "unpack",
    "unscale_",
]

_WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bits written into a raised flag: 1 for an int32 flag, 1.0 for a float32 one (torch's found_inf).
_FLAG_BITS = {torch.int32: 1, torch.float32: 0x3F800000}
_SUM_MODES = {"none": 0, "total": 1, "per_tensor": 2}


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BucketSlot:
    """Where one parameter's gradient lives in its bucket."""

    index: int
    """Position of the parameter in the sequence given to :func:`plan_buckets`."""
    name: str
    """The parameter's name when names were given, else ``"param<index>"``."""
    numel: int
    """Number of elements."""
    offset: int
    """First element in the bucket (a multiple of ``align / itemsize``)."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer of ``numel`` elements of ``dtype`` holding the gradients of ``slots``."""

    index: int
    dtype: torch.dtype
    slots: Tuple[BucketSlot, ...]
    numel: int
    """Elements including alignment padding (the size to allocate)."""

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


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Buckets in the order they fill during the backward pass."""

    buckets: Tuple[Bucket, ...]
    cap_bytes: int
    first_bucket_bytes: int
    align: int
    num_params: int

    def bucket_of(self, param_index: int) -> Tuple[int, int]:
        """(bucket index, slot index) of a parameter; KeyError if it has no bucket."""
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
            lines.append(f"  bucket {b.index}: {dtype}, {b.numel} elements, {b.nbytes} B")
            for s in b.slots:
                lines.append(f"    [{s.offset:>10}, {s.offset + s.numel:>10})  {s.name}")
        return "\n".join(lines)


ParamLike = Union[torch.Tensor, int]


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
    if dtype is not None and dtype not in _WIRE_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    if order is not None and sorted(order) != list(range(len(order))):
        raise ValueError(f"order: expected distinct indices below {num_params}, got {list(order)}")
    if order is not None and any(not 0 <= i < num_params for i in order):
        raise ValueError(f"order: expected indices below {num_params}, got {list(order)}")


class _OpenBucket:
    """A bucket being filled: slots so far and its byte cap."""

    def __init__(self, dtype: torch.dtype, cap_bytes: int):
        self.dtype, self.cap_bytes, self.slots, self.end = dtype, cap_bytes, [], 0

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
        if wire not in _WIRE_DTYPES:
            raise TypeError(f"params_or_sizes[{i}] ({name}): dtype {param_dtype} has no bucket")
        itemsize = _itemsize(wire)
        if align % itemsize:
            raise ValueError(f"align: {align} B is not a multiple of the {wire} itemsize")
        current = open_buckets.get(wire)
        if current is None or not current.fits(numel, align // itemsize):
            if current is not None:
                closed.append(current)
            seen = any(b.dtype == wire for b in closed)
            current = open_buckets[wire] = _OpenBucket(wire, cap_bytes if seen else first)
        current.add(i, name, numel, align // itemsize)
    closed.extend(open_buckets.values())
    buckets = tuple(
        Bucket(k, b.dtype, tuple(b.slots), _round_up(b.end, align // _itemsize(b.dtype)))
        for k, b in enumerate(closed)
    )
    return BucketPlan(buckets, cap_bytes, first, align, len(described))


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _ext():
    from .. import _C

    return _C


def _device_and_stream(t: torch.Tensor) -> Tuple[int, int]:
    if t.device.type == "cpu":
        return -1, 0
    if t.device.type != "cuda":
        raise TypeError(f"tensors on {t.device} are not supported (cpu or cuda)")
    return t.device.index, torch.cuda.current_stream(t.device).cuda_stream


_dtype_of = operator.attrgetter("dtype")


def _tensor_list(tensors: Sequence[torch.Tensor], arg: str, device: torch.device):
    """Data pointers, element counts and the common dtype of ``tensors``; checks them.

    Runs once per call on every tensor, so it uses map() over the tensor methods: about 0.3 us
    per tensor here, against about 1.5 us for a comprehension building (dtype, device) tuples.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{arg}: expected a list or tuple of tensors, got {type(tensors).__name__}")
    try:
        dtypes = set(map(_dtype_of, tensors))
        devices = set(map(torch.Tensor.get_device, tensors))
        contiguous = all(map(torch.Tensor.is_contiguous, tensors))
    except (AttributeError, TypeError):
        bad = next(t for t in tensors if not isinstance(t, torch.Tensor))
        raise TypeError(f"{arg}: expected tensors, got {type(bad).__name__}") from None
    if not dtypes:
        return [], [], None
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(f"{arg}: tensors must share one dtype and one device")
    if not contiguous:
        raise ValueError(f"{arg}: tensors must be contiguous")
    if devices != {_device_index(device)}:
        raise ValueError(f"{arg}: tensors are on {tensors[0].device}, the bucket is on {device}")
    (dtype,) = dtypes
    if dtype not in _WIRE_DTYPES:
        raise TypeError(f"{arg}: dtype {dtype} is not float32, float16 or bfloat16")
    return list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.numel, tensors)), dtype


def _device_index(device: torch.device) -> int:
    """What Tensor.get_device() returns for a tensor on ``device`` (-1 for the CPU)."""
    return -1 if device.type == "cpu" else device.index


def _scale_args(scale, device: torch.device, arg: str = "scale") -> Tuple[float, int]:
    """(value, pointer): a Python number, or a one-element float32 tensor read by the kernel."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            raise ValueError(
                f"{arg}: expected a one-element float32 tensor on {device}, got "
                f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
            )
        return 1.0, scale.data_ptr()
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale), 0
    raise TypeError(f"{arg}: expected a number or a tensor, got {type(scale).__name__}")


def _flag_args(flag: Optional[torch.Tensor], device: torch.device, arg: str) -> Tuple[int, int]:
    if flag is None:
        return 0, 0
    if not isinstance(flag, torch.Tensor):
        raise TypeError(f"{arg}: expected a tensor or None, got {type(flag).__name__}")
    if flag.numel() != 1 or flag.dtype not in _FLAG_BITS or flag.device != device:
        raise ValueError(
            f"{arg}: expected a one-element int32 or float32 tensor on {device}, got "
            f"{flag.dtype} of shape {tuple(flag.shape)} on {flag.device}"
        )
    return flag.data_ptr(), _FLAG_BITS[flag.dtype]


def _bucket_args(bucket: torch.Tensor, plan_or_offsets, counts: List[int], arg: str):
    if not isinstance(bucket, torch.Tensor):
        raise TypeError(f"{arg}: expected a tensor, got {type(bucket).__name__}")
    if bucket.dtype not in _WIRE_DTYPES or not bucket.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous float32/float16/bfloat16 tensor")
    if isinstance(plan_or_offsets, Bucket):
        if plan_or_offsets.counts != tuple(counts):
            raise ValueError(
                f"grads: element counts {counts[:8]}... do not match the bucket's slots "
                f"{list(plan_or_offsets.counts[:8])}... (pass grads in bucket.slots order)"
            )
        return plan_or_offsets.offsets
    if isinstance(plan_or_offsets, BucketPlan):
        raise TypeError("plan_or_offsets: pass one bucket of the plan (plan.buckets[i])")
    offsets = list(plan_or_offsets)
    if len(offsets) != len(counts):
        raise ValueError(f"plan_or_offsets: {len(offsets)} offsets for {len(counts)} tensors")
    return offsets


def _threads(num_threads: Optional[int]) -> int:
    return torch.get_num_threads() if num_threads is None else int(num_threads)


def pack(
    grads: Sequence[torch.Tensor],
    bucket: torch.Tensor,
    plan_or_offsets: Union[Bucket, Sequence[int]],
    scale: Union[float, torch.Tensor] = 1.0,
    flag: Optional[torch.Tensor] = None,
    *,
    num_threads: Optional[int] = None,
) -> torch.Tensor:
    """Writes ``bucket[offset_i : offset_i + numel_i] = (grads[i] * scale).to(bucket.dtype)``.

    One pass over the gradients: the product is computed in float32 and rounded once to the
    bucket dtype (nearest even). Padding between slots is left untouched.

    Args:
        grads: contiguous tensors of one dtype (float32, float16 or bfloat16); with a
            :class:`Bucket`, in ``bucket.slots`` order.
        bucket: the flat bucket (float32, float16 or bfloat16), on the gradients' device.
        plan_or_offsets: a :class:`Bucket` of a plan, or one element offset per gradient.
        scale: a number, or a one-element float32 tensor on the device (read by the kernel).
        flag: optional one-element int32 or float32 tensor set to 1 if any packed value is inf
            or NaN (a non-finite gradient, or one that overflows the bucket dtype); never
            cleared.
        num_threads: CPU threads for big calls (default ``torch.get_num_threads()``).

    Returns:
        ``bucket``.
    """
    ptrs, counts, grad_dtype = _tensor_list(grads, "grads", bucket.device)
    offsets = _bucket_args(bucket, plan_or_offsets, counts, "bucket")
    if grad_dtype is None:
        return bucket
    scale_value, scale_ptr = _scale_args(scale, bucket.device)
    flag_ptr, flag_bits = _flag_args(flag, bucket.device, "flag")
    device, stream = _device_and_stream(bucket)
    _ext().bucket_pack(
        ptrs, counts, offsets, DTYPE_CODES[grad_dtype], bucket.data_ptr(), bucket.numel(),
        DTYPE_CODES[bucket.dtype], scale_value, scale_ptr, flag_ptr, flag_bits, device, stream,
        _threads(num_threads),
    )  # fmt: skip
    return bucket


def unpack(
    bucket: torch.Tensor,
    grads: Sequence[torch.Tensor],
    plan_or_offsets: Union[Bucket, Sequence[int]],
    scale: Union[float, torch.Tensor] = 1.0,
    flag: Optional[torch.Tensor] = None,
    *,
    accumulate: bool = False,
    sum_squares: Optional[torch.Tensor] = None,
    num_threads: Optional[int] = None,
) -> None:
    """Writes each slice of ``bucket``, times ``scale``, back into ``grads`` in one pass.

    ``grads[i] = (slice * scale).to(grads[i].dtype)``, or with ``accumulate=True``
    ``grads[i] = fma(slice, scale, grads[i])`` in float32, rounded once.

    Args:
        bucket, grads, plan_or_offsets, scale, num_threads: as in :func:`pack`.
        flag: optional one-element int32 or float32 tensor set to 1 if any written gradient
            value is inf or NaN.
        accumulate: add into the gradients instead of overwriting them.
        sum_squares: optional float32 or float64 tensor receiving (added into, not overwritten)
            the sum of squares of the written values: one element for the total, or one per
            gradient (for gradient-norm clipping). On GPU the sums use atomics: their last bits
            may vary between runs.
    """
    ptrs, counts, grad_dtype = _tensor_list(grads, "grads", bucket.device)
    offsets = _bucket_args(bucket, plan_or_offsets, counts, "bucket")
    if grad_dtype is None:
        return
    scale_value, scale_ptr = _scale_args(scale, bucket.device)
    flag_ptr, flag_bits = _flag_args(flag, bucket.device, "flag")
    sum_ptr, sum_mode, sum_dtype = _sum_squares_args(sum_squares, len(ptrs), bucket.device)
    device, stream = _device_and_stream(bucket)
    _ext().bucket_unpack(
        ptrs, counts, offsets, DTYPE_CODES[grad_dtype], bucket.data_ptr(), bucket.numel(),
        DTYPE_CODES[bucket.dtype], scale_value, scale_ptr, bool(accumulate), flag_ptr, flag_bits,
        sum_ptr, sum_mode, sum_dtype, device, stream, _threads(num_threads),
    )  # fmt: skip


def _sum_squares_args(sum_squares, num_tensors: int, device: torch.device) -> Tuple[int, int, int]:
    if sum_squares is None:
        return 0, _SUM_MODES["none"], 0
    if not isinstance(sum_squares, torch.Tensor):
        raise TypeError(f"sum_squares: expected a tensor, got {type(sum_squares).__name__}")
    if sum_squares.dtype not in (torch.float32, torch.float64) or sum_squares.device != device:
        raise ValueError(f"sum_squares: expected float32 or float64 on {device}")
    if not sum_squares.is_contiguous() or sum_squares.numel() not in (1, num_tensors):
        raise ValueError(
            f"sum_squares: expected 1 (total) or {num_tensors} (per tensor) contiguous elements, "
            f"got {sum_squares.numel()}"
        )
    mode = _SUM_MODES["total" if sum_squares.numel() == 1 else "per_tensor"]
    return sum_squares.data_ptr(), mode, DTYPE_CODES[sum_squares.dtype]


def unscale_(
    tensors: Sequence[torch.Tensor],
    inv_scale: Union[float, torch.Tensor],
    found_inf: Optional[torch.Tensor],
    *,
    num_threads: Optional[int] = None,
) -> None:
    """In place ``t *= inv_scale`` for every tensor; sets ``found_inf`` to 1 on inf or NaN.

    The multi-tensor twin of ``torch._amp_foreach_non_finite_check_and_unscale_`` that also
    takes float16 (and mixed-dtype lists). ``inv_scale`` and ``found_inf`` (int32 or float32)
    are one-element tensors on the tensors' device; the kernel reads and writes them there.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors: expected a list or tuple, got {type(tensors).__name__}")
    groups: dict = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors: expected tensors, got {type(t).__name__}")
        groups.setdefault(t.dtype, []).append(t)
    for group in groups.values():
        device = group[0].device
        ptrs, counts, dtype = _tensor_list(group, "tensors", device)
        scale_value, scale_ptr = _scale_args(inv_scale, device, "inv_scale")
        flag_ptr, flag_bits = _flag_args(found_inf, device, "found_inf")
        device_index, stream = _device_and_stream(group[0])
        _ext().multi_tensor_unscale(
            ptrs, counts, DTYPE_CODES[dtype], scale_value, scale_ptr, flag_ptr, flag_bits,
            device_index, stream, _threads(num_threads),
        )  # fmt: skip
