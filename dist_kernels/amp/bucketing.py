"""``dk.bucketing`` where users found it: the bucket planner and kernels now live in
:mod:`dist_kernels.buckets` (``plan`` and ``kernels``); this module names them here too."""

from ..buckets.kernels import pack, unpack, unscale_
from ..buckets.plan import Bucket, BucketPlan, BucketSlot, plan_buckets

__all__ = ["BucketSlot", "Bucket", "BucketPlan", "plan_buckets", "pack", "unpack", "unscale_"]
