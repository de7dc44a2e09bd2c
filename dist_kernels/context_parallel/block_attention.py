"""Attention of one query block against one key/value block, with its log-sum-exp, and the
gradients of that block given the *merged* output and log-sum-exp: the two kernels ring
attention is made of. They are torch's own flash-attention kernels for CPU (the ones
``F.scaled_dot_product_attention`` runs there), which never hold the ``[q, k]`` matrix: the
backward recomputes the probabilities from the log-sum-exp, so memory grows with the block's
length, not its square.

Why the backward of a block may use the merged statistics: with ``lse`` the log-sum-exp of a
query row over *all* keys, ``P = exp(q k^T s - lse)`` is that row's final probability for the
keys of this block, and ``dS = P (dO v^T - rowsum(dO * O))`` with the final ``O``; both are
exactly the terms of the full gradient that involve this block's keys. So the gradients of the
blocks add up to the full gradient (dq over blocks; dk, dv per key block).
"""

from __future__ import annotations

from typing import Tuple

import torch

_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def check_device(q: torch.Tensor, what: str, rank: int) -> None:
    """Raises for a device the block kernels do not cover."""
    if q.device.type != "cpu":
        raise NotImplementedError(
            f"[rank {rank}] {what}: tensors on {q.device}; ring attention's block kernels are "
            "torch's CPU flash attention (a CUDA path is not written yet)"
        )


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` ``[b, h, lq, d]`` against ``k``, ``v`` ``[b, h, lk, d]``; a
    causal mask is top-left aligned. ``lse`` is ``[b, h, lq]`` in FP32 (FP64 for FP64)."""
    return _CPU_FORWARD(q, k, v, 0.0, causal, scale=scale)


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this block, given the merged ``out`` and ``lse`` of ``q``'s rows."""
    return _CPU_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
