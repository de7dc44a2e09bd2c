"""Data parallelism: :class:`DistributedDataParallel` (``engine``) and the parts it holds: its
gradient buckets in a :class:`dist_kernels.buckets.reducer.BucketReducer` (``ddp.reducer``),
the autograd side that drives it (``backward``), uneven inputs (``join``); comm hooks in
``hooks`` and ``powersgd``."""

from .engine import DDP, DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDP"]
