"""Mixture of experts with expert parallelism: ``MoE``, ``shard_experts`` (see docs/moe.md)."""

from . import checkpoint
from .layer import Expert, MoE, aux_loss_of, shard_experts
from .push import RowPlan, push_rows
from .router import (
    Router,
    expert_capacity,
    switch_load_balancing_loss,
    update_expert_bias,
    z_loss,
)

__all__ = [
    "Expert",
    "MoE",
    "Router",
    "RowPlan",
    "aux_loss_of",
    "checkpoint",
    "expert_capacity",
    "push_rows",
    "shard_experts",
    "switch_load_balancing_loss",
    "update_expert_bias",
    "z_loss",
]
