"""Gradient buckets, shared by DDP and ZeRO: plan, kernels, and the reducer that owns them.

Who owns a bucket: the :class:`~dist_kernels.buckets.reducer.BucketReducer` of its engine
(``ddp.reducer``, ``opt.reducer``). It holds the plan, one backward's readiness, the launch
order and the collectives in flight, and it alone calls the *collective* it was built with,
which holds the bucket memory and moves the data:

* ``plan``: which parameter elements each bucket holds, where (pure; DDP's greedy buckets and
  ZeRO's flat, sharded ones; DDP's status slots and fingerprints).
* ``kernels``: pack / unpack / unscale gradients in one fused pass each.
* ``reducer``: :class:`BucketReducer`.
* ``all_reduce``: DDP's collective (``GradientBuckets`` memory, ``AllReduce``; ``InPlace`` on
  one rank); ``comm_hook``: DDP's with a communication hook (``CommHook``, ``GradBucket``);
  ``reductions``: the all-reduces they issue, hook futures completed in order.
* ``reduce_scatter``: ZeRO's collective (``ReduceScatter`` into gradient shards).

``dk.bucketing`` is this package's planner and kernels under their old name.
"""

from .kernels import pack, unpack, unscale_
from .plan import Bucket, BucketPlan, BucketSlot, plan_buckets, plan_flat_buckets
from .reducer import BucketReducer

__all__ = [
    "BucketReducer",
    "BucketSlot",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "plan_flat_buckets",
    "pack",
    "unpack",
    "unscale_",
]
