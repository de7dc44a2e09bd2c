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
    expert bias (DeepSeek-V3's auxiliary-loss-free balancing, Megatron's
              ``--moe-router-enable-expert-bias``): the top-k chosen by ``scores + b`` while the
              weights stay the chosen experts' scores; after each step
              :func:`update_expert_bias` moves ``b_e`` by ``rate * sign(mean_e' n_e' - n_e)``
              from the assignments ``n`` every data-parallel rank counted since the last update

Everything here is per rank, on this rank's tokens, before any exchange: drops happen before
the all-to-all, as in Megatron, so a dropped assignment never travels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from ..comm.groups import sum_over

__all__ = [
    "Routing",
    "Router",
    "expert_capacity",
    "switch_load_balancing_loss",
    "update_expert_bias",
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
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        if not bias_update_rate >= 0:
            raise ValueError(f"MoE: bias_update_rate must be >= 0, got {bias_update_rate}")
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
        self.bias_update_rate = bias_update_rate
        # the bias is model state (checkpointed); the counts only live between two updates
        self.expert_bias: Optional[torch.Tensor]
        self.tokens_per_expert: Optional[torch.Tensor]
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
            counts = torch.zeros(n_experts, dtype=torch.int64)
            self.register_buffer("tokens_per_expert", counts, persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None

    def forward(self, x: torch.Tensor) -> Routing:
        """Routes ``x`` [T, dim]."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # FP32 at least
        logits = x.to(dtype) @ self.weight.to(dtype).t()
        if self.kind == "softmax":
            scores = torch.softmax(logits, dim=-1)
            weights, experts = self._top_k(scores)
            if self.norm_topk:  # the k weights sum to 1 (a softmax over the chosen logits)
                weights = weights / weights.sum(-1, keepdim=True)
            balance_scores = scores
        else:
            scores = torch.sigmoid(logits)
            top, experts = self._top_k(scores)
            weights = top / (top.sum(-1, keepdim=True) + 1e-20)
            balance_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        routed = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        if self.tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            # (a recomputed forward counts its micro-batch again: every count doubles, and
            # the update reads only which side of the mean each expert is on)
            self.tokens_per_expert += routed
        if x.shape[0] == 0:  # no tokens here: no loss (the formulas divide by T)
            lb = zl = logits.sum()
        else:
            lb = switch_load_balancing_loss(balance_scores, routed, self.top_k, self.aux_loss_coeff)
            zl = z_loss(logits, self.z_loss_coeff)
        keep = self._capacity_mask(experts, weights.detach())
        return Routing(experts, weights, keep, lb + zl, lb, zl, routed)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .double() / .half() move the weight; the bias stays FP32, as Megatron
        # keeps it: steps of 1e-3 on a bias of ~1 vanish in BF16's 8 bits
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def _top_k(self, scores: torch.Tensor):
        """``(the chosen experts' scores, the experts)``: chosen by the scores, or by the scores
        plus the expert bias (which steers the choice and never the weights)."""
        if self.expert_bias is None:
            return torch.topk(scores, self.top_k, dim=-1)
        experts = torch.topk(scores + self.expert_bias.to(scores.dtype), self.top_k, dim=-1)[1]
        return scores.gather(-1, experts), experts

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


@torch.no_grad()
def update_expert_bias(module: nn.Module, comm: Any = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing step, for every router of ``module`` with an
    expert bias: the assignments counted since the last call are summed over ``comm`` (the
    data-parallel ranks that hold the same routers: ``mesh.dp_cp_comm``; a torch process group;
    None: torch.distributed's world when initialised, else this process alone), each expert's
    bias moves by ``bias_update_rate`` up when it got fewer than the mean, down when more
    (Megatron's ``get_updated_expert_bias``), and the counts restart. Collective over
    ``comm``; call it after each optimizer step."""
    routers = [m for m in module.modules() if isinstance(m, Router) and m.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])  # [routers, E], int64
    sum_over(counts, comm)
    for router, n in zip(routers, counts):
        mean = n.sum().double() / router.n_experts
        step = torch.sign(mean - n.double()) * router.bias_update_rate
        router.expert_bias += step.to(router.expert_bias.dtype)
        router.tokens_per_expert.zero_()
