"""Mixture of experts with expert parallelism: ``MoE``, ``shard_experts`` (see docs/moe.md)."""

from . import checkpoint
from .layer import Expert, MoE, shard_experts
from .router import Router, expert_capacity, switch_load_balancing_loss, z_loss

__all__ = [
    "Expert",
    "MoE",
    "Router",
    "checkpoint",
    "expert_capacity",
    "shard_experts",
    "switch_load_balancing_loss",
    "z_loss",
]
