"""The fused bucket kernels: pack / unpack / unscale gradients in one pass each (``_C``).

They move gradients in and out of a bucket (laid out by :mod:`dist_kernels.buckets.plan`)::

    pack(grads, flat, bucket, scale=1 / world_size, flag=found_inf)    # cast, scale, check
    comm.all_reduce(flat)
    unpack(flat, grads, bucket, scale=inv_loss_scale, flag=found_inf)  # cast back, scale, check

Every call accepts CPU tensors and, in a CUDA build, CUDA tensors (the flag, the scale tensor and
the sums of squares then stay in device memory: nothing waits for the GPU).
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from ..dtypes import DTYPE_CODES
from .plan import WIRE_DTYPES as _WIRE_DTYPES
from .plan import Bucket, BucketPlan

__all__ = ["pack", "unpack", "unscale_"]

# Bits written into a raised flag: 1 for an int32 flag, 1.0 for a float32 one (torch's found_inf).
_FLAG_BITS = {torch.int32: 1, torch.float32: 0x3F800000}
_SUM_MODES = {"none": 0, "total": 1, "per_tensor": 2}
_F32 = (torch.float32,)


_C: Any = None


def _ext():
    """The extension, imported at the first call (an import statement per call cost ~1 us)."""
    global _C
    if _C is None:
        from .. import _C as ext

        _C = ext
    return _C


def _device_and_stream(t: torch.Tensor) -> Tuple[int, int]:
    if t.device.type == "cpu":
        return -1, 0
    if t.device.type != "cuda":
        raise TypeError(f"tensors on {t.device} are not supported (cpu or cuda)")
    return t.device.index, torch.cuda.current_stream(t.device).cuda_stream


_dtype_of = operator.attrgetter("dtype")


_WIRE_CODES = {dtype: DTYPE_CODES[dtype] for dtype in _WIRE_DTYPES}
_is_cpu = operator.attrgetter("is_cpu")


def _plain_cpu_list(tensors: Sequence[torch.Tensor]) -> Optional[Tuple[List[int], List[int], int]]:
    """(pointers, counts, dtype code) of a non-empty list or tuple of contiguous CPU tensors
    (plain ``torch.Tensor``) of one of the wire dtypes: the common call, checked in one pass.
    None for anything else, which the checked path then takes (and raises on what is wrong).

    The checked path cost ~5 us for a list of one tensor on the 2-core VM (with the rest of
    the call's checks), as much as the kernel on 64K elements; this one ~1 us."""
    if type(tensors) not in (list, tuple) or not tensors:
        return None
    first = tensors[0]
    if type(first) is not torch.Tensor:
        return None
    code = _WIRE_CODES.get(first.dtype)
    if code is None:
        return None
    if len(tensors) == 1:
        if first.is_cpu and first.is_contiguous():
            return [first.data_ptr()], [first.numel()], code
        return None
    if set(map(type, tensors)) != {torch.Tensor} or set(map(_dtype_of, tensors)) != {first.dtype}:
        return None
    if not (all(map(_is_cpu, tensors)) and all(map(torch.Tensor.is_contiguous, tensors))):
        return None
    return list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.numel, tensors)), code


def _cpu_scalar_ptr(t: Any, dtypes: Any) -> int:
    """``t``'s data pointer if it is a one-element CPU tensor of one of ``dtypes``, else 0."""
    if type(t) is torch.Tensor and t.dtype in dtypes and t.is_cpu and t.numel() == 1:
        return t.data_ptr()
    return 0


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


def _by_dtype(tensors: Sequence[torch.Tensor]) -> List[Sequence[torch.Tensor]]:
    """``tensors`` split by dtype, in first-seen order; the common case, one dtype, without a
    per-tensor Python loop (the list is ``tensors`` itself: ~0.2 us a tensor saved)."""
    try:
        dtypes = set(map(_dtype_of, tensors))
    except AttributeError:
        dtypes = set()
    if len(dtypes) == 1 and all(map(torch.Tensor.__instancecheck__, tensors)):
        return [tensors]
    groups: dict = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors: expected tensors, got {type(t).__name__}")
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


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
    plain = _plain_cpu_list(tensors)
    if plain is not None and type(inv_scale) is torch.Tensor and type(found_inf) is torch.Tensor:
        scale_ptr = _cpu_scalar_ptr(inv_scale, _F32)
        flag_ptr = _cpu_scalar_ptr(found_inf, _FLAG_BITS)
        if scale_ptr and flag_ptr:  # GradScaler's call: CPU tensors, a tensor scale and flag
            ptrs, counts, code = plain
            _ext().multi_tensor_unscale(
                ptrs, counts, code, 1.0, scale_ptr, flag_ptr, _FLAG_BITS[found_inf.dtype],
                -1, 0, _threads(num_threads),
            )  # fmt: skip
            return
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors: expected a list or tuple, got {type(tensors).__name__}")
    for group in _by_dtype(tensors):
        device = group[0].device
        ptrs, counts, dtype = _tensor_list(group, "tensors", device)
        scale_value, scale_ptr = _scale_args(inv_scale, device, "inv_scale")
        flag_ptr, flag_bits = _flag_args(found_inf, device, "found_inf")
        device_index, stream = _device_and_stream(group[0])
        _ext().multi_tensor_unscale(
            ptrs, counts, DTYPE_CODES[dtype], scale_value, scale_ptr, flag_ptr, flag_bits,
            device_index, stream, _threads(num_threads),
        )  # fmt: skip
