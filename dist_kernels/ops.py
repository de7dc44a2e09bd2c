"""Element-wise kernels on torch tensors: in-place reduce, divide and cast-with-scale, and the
last step of a counter-based dropout mask.

These are the kernels the collectives run on each rank, exposed for standalone use. CPU tensors
run the vectorised CPU kernels, split across a small thread pool for calls touching 64 MiB or
more (``DK_NUM_THREADS`` sizes the pool, ``DK_PARALLEL_MIN_BYTES`` moves the threshold). CUDA
tensors run the CUDA kernels on ``torch.cuda.current_stream()`` when the extension was built
with CUDA.

Numerics: float16 and bfloat16 are computed in float32 and rounded once to nearest even, also
across several sources (``reduce_(dst, a, b, c)`` rounds once, not three times); integer sums
and products wrap like torch; NaN propagates through MAX and MIN as in ``torch.maximum``.

Every argument is checked before any work starts; a bad one raises ``TypeError`` (not a tensor,
unsupported dtype) or ``ValueError`` (layout, device, size, op) naming it.
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import torch

from . import _C
from .dtypes import DTYPE_CODES, ReduceOp, ReduceOpLike, dtype_code, reduce_op

__all__ = [
    "reduce_",
    "divide_",
    "cast_",
    "dropout_keep_mask",
    "cpu_isa",
    "set_cpu_isa",
    "supported_cpu_isas",
]

#: dtypes :func:`cast_` converts between.
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_CAST_CODES = {d: DTYPE_CODES[d] for d in CAST_DTYPES}


def _plain_cpu_pair(dst: object, src: object, same_dtype: bool):
    """``(dtype code of dst, dst's address, src's address, elements)`` when dst and src are
    plain contiguous CPU tensors of a dtype we compute, with as many elements, the same dtype
    where asked, and src either dst itself or apart from it: every check the calls below make,
    in their cheapest form (the checked route costs ~6 us a call, as much as the kernel itself
    at 256 KiB; the addresses are returned because each read costs ~0.1 us). None otherwise:
    the checked route then runs, and names what is wrong."""
    if type(dst) is not torch.Tensor or type(src) is not torch.Tensor:
        return None
    if not (dst.is_cpu and src.is_cpu) or (same_dtype and dst.dtype is not src.dtype):
        return None
    n = dst.numel()
    if n == 0 or src.numel() != n or not (dst.is_contiguous() and src.is_contiguous()):
        return None
    first, other = dst.data_ptr(), src.data_ptr()
    if (
        first != other
        and first < other + n * src.element_size()
        and other < first + n * (dst.element_size())
    ):
        return None  # partial overlap (or the same start with other sizes): the checks say
    if first == other and dst.dtype is not src.dtype:
        return None
    code = DTYPE_CODES.get(dst.dtype)
    return None if code is None else (code, first, other, n)


def _check_tensor(t: object, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: tensor must be contiguous (call .contiguous() first)")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{arg}: unsupported device {t.device}; expected cpu or cuda")
    return t


def _check_like(dst: torch.Tensor, t: torch.Tensor, arg: str, same_dtype: bool) -> None:
    if t.device != dst.device:
        raise ValueError(f"{arg}: on {t.device} but dst is on {dst.device}")
    if t.numel() != dst.numel():
        raise ValueError(f"{arg}: has {t.numel()} elements but dst has {dst.numel()}")
    if same_dtype and t.dtype != dst.dtype:
        raise TypeError(f"{arg}: dtype {t.dtype} differs from dst's {dst.dtype}")
    _check_no_partial_overlap(dst, t, arg)


def _check_no_partial_overlap(dst: torch.Tensor, t: torch.Tensor, arg: str) -> None:
    """``t`` is ``dst`` itself or shares no byte with it: the kernels read and write in vector
    packs and threads, so an element written may be one another thread has yet to read."""
    first, size = t.data_ptr(), t.numel() * t.element_size()
    dst_first, dst_size = dst.data_ptr(), dst.numel() * dst.element_size()
    if (first, size) == (dst_first, dst_size) or size == 0 or dst_size == 0:
        return
    if first < dst_first + dst_size and dst_first < first + size:
        raise ValueError(
            f"{arg}: overlaps dst partially (bytes {first:#x}+{size} and {dst_first:#x}+"
            f"{dst_size}); pass dst itself or a tensor that shares no memory with it"
        )


@functools.cache
def _cuda_compiled() -> bool:
    return bool(_C.build_info()["cuda_compiled"])


def _device_and_stream(t: torch.Tensor) -> Tuple[int, int]:
    """(-1, 0) for CPU tensors; (device index, current stream handle) for CUDA tensors."""
    if t.device.type == "cpu":
        return -1, 0
    if not _cuda_compiled():
        raise ValueError(
            f"dst: on {t.device} but this dist_kernels build is CPU-only "
            "(rebuild with nvcc available, see README)"
        )
    return t.device.index, torch.cuda.current_stream(t.device).cuda_stream


def reduce_(
    dst: torch.Tensor, *srcs: torch.Tensor, op: ReduceOpLike = ReduceOp.SUM
) -> torch.Tensor:
    """In place: ``dst = op(dst, *srcs)`` element-wise; returns ``dst``.

    ``op`` is a :class:`ReduceOp`, its name, or a ``torch.distributed.ReduceOp``. ``AVG`` sums,
    then divides by the number of operands (``1 + len(srcs)``; integers truncate toward zero).
    ``dst`` may also appear among ``srcs``; a source that overlaps ``dst`` only in part raises
    ``ValueError``. All tensors: contiguous, same device, dtype and number of elements (shapes
    may differ).
    """
    if len(srcs) == 1 and op is ReduceOp.SUM:
        plain = _plain_cpu_pair(dst, srcs[0], same_dtype=True)
        if plain is not None:
            code, first, other, n = plain
            _C.kernels_reduce(first, [first, other], n, code, 0, -1, 0)
            return dst
    rop = reduce_op(op, "op")
    _check_tensor(dst, "dst")
    code = dtype_code(dst.dtype, "dst")
    if not srcs:
        raise ValueError("srcs: reduce_ needs at least one source tensor besides dst")
    for i, src in enumerate(srcs):
        _check_tensor(src, f"srcs[{i}]")
        _check_like(dst, src, f"srcs[{i}]", same_dtype=True)
    device, stream = _device_and_stream(dst)
    operands: List[int] = [dst.data_ptr()] + [s.data_ptr() for s in srcs]
    if rop == ReduceOp.AVG:  # sum and divide in one pass
        _C.kernels_reduce_average(
            dst.data_ptr(), operands, dst.numel(), code, len(operands), device, stream
        )
    else:
        _C.kernels_reduce(dst.data_ptr(), operands, dst.numel(), code, int(rop), device, stream)
    return dst


def _divide(dst: torch.Tensor, divisor: int, code: int, device: int, stream: int) -> None:
    _C.kernels_divide(dst.data_ptr(), dst.data_ptr(), dst.numel(), code, divisor, device, stream)


def divide_(dst: torch.Tensor, divisor: int) -> torch.Tensor:
    """In place: ``dst = dst / divisor`` for a positive int (AVG's last step).

    Integers truncate toward zero.

    float16 / bfloat16 divide in float32 and round once. Returns ``dst``.
    """
    _check_tensor(dst, "dst")
    code = dtype_code(dst.dtype, "dst")
    if isinstance(divisor, bool) or not isinstance(divisor, int):
        raise TypeError(f"divisor: expected an int, got {type(divisor).__name__}")
    if divisor < 1:
        raise ValueError(f"divisor: must be a positive int, got {divisor}")
    device, stream = _device_and_stream(dst)
    _divide(dst, divisor, code, device, stream)
    return dst


def cast_(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``dst = (dst.dtype)(src * scale)`` for float32 / float16 / bfloat16 in any pairing.

    The product is computed in float32 and rounded once to nearest even; values beyond the
    destination's range become inf, NaN stays NaN. Bit-identical to
    ``(src.float() * scale).to(dst.dtype)``. Returns ``dst``.
    """
    if type(scale) is float or type(scale) is int:
        plain = _plain_cpu_pair(dst, src, same_dtype=False)
        if plain is not None:
            dst_code, src_code = _CAST_CODES.get(dst.dtype), _CAST_CODES.get(src.dtype)
            if dst_code is not None and src_code is not None:
                _, first, other, n = plain
                _C.kernels_cast_scale(first, dst_code, other, src_code, n, float(scale), -1, 0)
                return dst
    _check_tensor(dst, "dst")
    _check_tensor(src, "src")
    for t, arg in ((dst, "dst"), (src, "src")):
        if t.dtype not in CAST_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in CAST_DTYPES)
            raise TypeError(f"{arg}: unsupported dtype {t.dtype} for cast_; supported: {names}")
    _check_like(dst, src, "src", same_dtype=False)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    device, stream = _device_and_stream(dst)
    _C.kernels_cast_scale(
        dst.data_ptr(),
        dtype_code(dst.dtype, "dst"),
        src.data_ptr(),
        dtype_code(src.dtype, "src"),
        dst.numel(),
        float(scale),
        device,
        stream,
    )
    return dst


def dropout_keep_mask(rows_hash: torch.Tensor, cols_index: torch.Tensor, threshold: int):
    """``keep[r, c] = lowbias32(rows_hash[r] ^ cols_index[c]) >= threshold`` as a bool tensor
    ``[rows, cols]`` (``dk.models.dropout``'s full-size step; the low 32 bits of each int64
    are hashed). CPU tensors only: a GPU computes the same bits with torch ops there."""
    for t, arg in ((rows_hash, "rows_hash"), (cols_index, "cols_index")):
        _check_tensor(t, arg)
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_cpu:
            raise ValueError(f"{arg}: expected a 1-D int64 CPU tensor, got {t.dtype} {t.device} "
                             f"of shape {tuple(t.shape)}")  # fmt: skip
    if not 0 <= threshold <= 2**32:
        raise ValueError(f"threshold: {threshold} outside [0, 2**32]")
    out = torch.empty(rows_hash.numel(), cols_index.numel(), dtype=torch.bool)
    rows, cols = rows_hash.numel(), cols_index.numel()
    _C.kernels_dropout_keep_mask(
        out.data_ptr(), rows_hash.data_ptr(), rows, cols_index.data_ptr(), cols, int(threshold)
    )
    return out


def cpu_isa() -> str:
    """The CPU kernel build in use: ``'baseline'``, ``'avx2'`` or ``'avx512'``."""
    return _C.kernels_cpu_isa()


def supported_cpu_isas() -> Sequence[str]:
    """The CPU kernel builds this CPU can run, baseline first."""
    return tuple(_C.kernels_supported_cpu_isas())


def set_cpu_isa(isa: str) -> None:
    """Forces a CPU kernel build (tests, benchmarks); ``DK_CPU_ISA`` sets it at start-up.

    Raises ``ValueError`` for an unknown name or one this CPU cannot run.
    """
    _C.kernels_set_cpu_isa(isa)
