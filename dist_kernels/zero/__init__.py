"""Sharded optimizer (ZeRO stages 1 and 2): :class:`ShardedOptimizer` (``sharded_optimizer``)
over a pure partition plan (``partition``: flat buckets split into equal aligned shards)."""

from .sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
