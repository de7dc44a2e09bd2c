"""Data parallelism: :class:`DistributedDataParallel` (``engine``; its backward in ``reducer``,
uneven inputs in ``join``) over a pure bucket plan (``plan``: which parameters share a bucket,
in what order their gradients arrive)."""

from .engine import DDP, DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDP"]
