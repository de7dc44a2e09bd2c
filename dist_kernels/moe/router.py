"""The router of a mixture-of-experts layer: scores, top-k, capacity, and its two losses.

Megatron-Core's semantics (``megatron/core/transformer/moe/router.py``, ``moe_utils.py``):

    logits  = x @ W.T                        [tokens, n_experts], in FP32 (or wider: float64 in)
    softmax: scores = softmax(logits)        weights = the top-k scores (not renormalised; with
                                             ``norm_topk``: / their sum, Mixtral's and Qwen's
                                             ``norm_topk_prob``, Megatron's default top-k softmax)
    sigmoid: scores = sigmoid(logits)        weights = the top-k scores / their sum (DeepSeek-V3)
    capacity  = ceil(tokens * top_k / n_experts * capacity_factor)   (Megatron's get_capacity)
    drop_policy "probs":    each expert keeps its `capacity` highest-weight assignments
                "position": each expert keeps its first `capacity` assignments in token order
    aux loss  = coeff * n_experts / (top_k * T * T) * sum_e (sum_t p[t, e]) * f_e
                (switch_load_balancing_loss_func: p the scores, for sigmoid normalised over
                experts; f_e the assignments to expert e before drops; T the tokens)
    z-loss    = coeff * mean_t logsumexp(logits[t])^2

Everything here is per rank, on this rank's tokens, before any exchange: drops happen before
the all-to-all, as in Megatron, so a dropped assignment never travels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

__all__ = [
    "Routing",
    "Router",
    "expert_capacity",
    "switch_load_balancing_loss",
    "z_loss",
]

ROUTERS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments an expert accepts from ``tokens`` tokens (Megatron's get_capacity of
    ``tokens * top_k`` assignments)."""
    return math.ceil(tokens * top_k / n_experts * capacity_factor)


def switch_load_balancing_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int, coeff: float
) -> torch.Tensor:
    """Switch / GShard load-balancing loss of ``scores`` [T, E] and assignment counts [E]."""
    tokens, n_experts = scores.shape
    scale = n_experts * coeff / (top_k * tokens * tokens)
    return (scores.sum(0) * tokens_per_expert.to(scores.dtype)).sum() * scale


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: ``coeff * mean(logsumexp(logits)^2)``."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


@dataclass
class Routing:
    """One step's routing of T tokens: every tensor is [T, top_k] unless said."""

    experts: torch.Tensor  # int64: the chosen experts
    weights: torch.Tensor  # the combine weights (FP32 or wider), differentiable
    keep: torch.Tensor  # bool: the assignment survived the capacity
    aux_loss: torch.Tensor  # scalar: load-balancing + z-loss, coefficients applied
    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    routed: torch.Tensor  # [E] int64: assignments per expert before drops


class Router(nn.Module):
    """Linear gate ``weight`` [n_experts, dim] (no bias) and the policy of the module docstring."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        kind: str = "softmax",
        capacity_factor: Optional[float] = None,
        drop_policy: str = "probs",
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float = 0.0,
        norm_topk: bool = False,
    ) -> None:
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"MoE: router must be one of {ROUTERS}, got {kind!r}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(
                f"MoE: drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}"
            )
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 or None, got {capacity_factor}")
        self.n_experts, self.top_k, self.kind = n_experts, top_k, kind
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.norm_topk = bool(norm_topk)
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> Routing:
        """Routes ``x`` [T, dim]."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # FP32 at least
        logits = x.to(dtype) @ self.weight.to(dtype).t()
        if self.kind == "softmax":
            scores = torch.softmax(logits, dim=-1)
            weights, experts = torch.topk(scores, self.top_k, dim=-1)
            if self.norm_topk:  # the k weights sum to 1 (a softmax over the chosen logits)
                weights = weights / weights.sum(-1, keepdim=True)
            balance_scores = scores
        else:
            scores = torch.sigmoid(logits)
            top, experts = torch.topk(scores, self.top_k, dim=-1)
            weights = top / (top.sum(-1, keepdim=True) + 1e-20)
            balance_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        routed = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        if x.shape[0] == 0:  # no tokens here: no loss (the formulas divide by T)
            lb = zl = logits.sum()
        else:
            lb = switch_load_balancing_loss(balance_scores, routed, self.top_k, self.aux_loss_coeff)
            zl = z_loss(logits, self.z_loss_coeff)
        keep = self._capacity_mask(experts, weights.detach())
        return Routing(experts, weights, keep, lb + zl, lb, zl, routed)

    def _capacity_mask(self, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Which assignments each expert accepts (all of them without a capacity)."""
        keep = torch.ones_like(experts, dtype=torch.bool)
        if self.capacity_factor is None or experts.numel() == 0:
            return keep
        tokens = experts.shape[0]
        capacity = expert_capacity(tokens, self.n_experts, self.top_k, self.capacity_factor)
        flat_e, flat_keep = experts.reshape(-1), keep.view(-1)
        # Rank every assignment inside its expert: by weight (ties: token order) or by position.
        order = torch.arange(flat_e.numel(), device=experts.device)
        if self.drop_policy == "probs":
            order = torch.sort(-weights.reshape(-1), stable=True).indices
        order = order[torch.sort(flat_e[order], stable=True).indices]  # expert-major, ranked
        counts = torch.bincount(flat_e, minlength=self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
        flat_keep[order] = rank_in_expert < capacity
        return keep
