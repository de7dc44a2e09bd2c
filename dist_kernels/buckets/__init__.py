"""Gradient buckets, shared by DDP and ZeRO: plan, kernels, and the reducer that owns them.

* ``plan``: which parameter elements each bucket holds, where (pure; DDP's greedy buckets and
  ZeRO's flat, sharded ones).
* ``kernels``: pack / unpack / unscale gradients in one fused pass each.

``dk.bucketing`` is this package's planner and kernels under their old name.
"""

from .kernels import pack, unpack, unscale_
from .plan import Bucket, BucketPlan, BucketSlot, plan_buckets, plan_flat_buckets

__all__ = [
    "BucketSlot",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "plan_flat_buckets",
    "pack",
    "unpack",
    "unscale_",
]
