"""Mapping between torch dtypes / reduce ops and the integer codes of the C++ core.

The codes match ``csrc/common/dtype.h``; they are the binding ABI.
"""

from __future__ import annotations

import enum
from typing import Any, Union

import torch

#: torch dtype -> C++ DType code (csrc/common/dtype.h).
DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.int8: 6,
    torch.uint8: 7,
}

SUPPORTED_DTYPES = tuple(DTYPE_CODES)


class ReduceOp(enum.IntEnum):
    """Reduction operators, named as in ``torch.distributed.ReduceOp``.

    ``AVG`` sums, then divides by the number of ranks (integer types truncate toward zero).
    """

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


ReduceOpLike = Union[ReduceOp, str, Any]


def dtype_code(dtype: torch.dtype, arg: str = "tensor") -> int:
    """Returns the C++ code of ``dtype``; raises ``TypeError`` naming ``arg`` if unsupported."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{arg}: unsupported dtype {dtype}; supported: {names}") from None


def reduce_op(op: ReduceOpLike, arg: str = "op") -> ReduceOp:
    """Accepts a :class:`ReduceOp`, its name, or a ``torch.distributed.ReduceOp`` value."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = op.upper()
    else:
        # torch.distributed.ReduceOp.SUM is a RedOpType whose str() ends with the op's name.
        name = str(op).rsplit(".", 1)[-1].upper()
    try:
        return ReduceOp[name]
    except KeyError:
        valid = ", ".join(o.name for o in ReduceOp)
        raise ValueError(f"{arg}: unsupported reduce op {op!r}; supported: {valid}") from None
