"""Exceptions raised by dist_kernels."""

from ._C import CommError  # a RuntimeError subclass defined by the extension

CommError.__module__ = "dist_kernels"
CommError.__doc__ = (
    "A collective failed: a peer died or closed, a timeout expired, or ranks disagreed on "
    "count, dtype or op. The message names the rank and the operation."
)

__all__ = ["CommError"]
