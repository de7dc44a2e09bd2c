"""Sharded optimizer (ZeRO stages 1, 2 and 3): :class:`ShardedOptimizer` (``sharded_optimizer``)
over a pure partition plan (``partition``: flat buckets split into equal aligned shards); stage 3
gathers parameters per unit of modules (``stage3``); ``memory`` counts bytes per rank beside the
ZeRO formula."""

from .sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
