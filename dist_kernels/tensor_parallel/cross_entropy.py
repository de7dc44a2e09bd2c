"""Cross-entropy over logits split by vocabulary, without gathering them.

Rank r holds the logits of vocabulary entries ``[r V/tp, (r+1) V/tp)``. With ``m`` the global
maximum of a row, ``t`` its target's logit and ``S = sum_v exp(z_v - m)``::

    loss = log S - (t - m)
    d loss / d z_v = exp(z_v - m) / S - [v == target]

so three all-reduces of one number per row suffice: MAX of the local maxima, SUM of the
target logit (only its owner contributes), SUM of the local sums of exponentials. Each rank's
gradient is its own shard's slice: backward communicates nothing. The full ``[N, V]`` logits
never exist on any rank.
"""

from __future__ import annotations

from typing import Any

import torch

from . import mappings
from .desync import check_replicated

__all__ = ["vocab_parallel_cross_entropy"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # exp and log-sum in FP32 at least: BF16 sums of a vocabulary's exponentials lose digits.
    return torch.float64 if dtype == torch.float64 else torch.float32


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm, ignore_index):
        z = logits.to(_compute_dtype(logits.dtype))
        n_local = z.shape[-1]
        start = mappings.tp_rank(comm) * n_local
        # 1. the row maxima, for a stable exp
        row_max = z.max(dim=-1).values
        _all_reduce(row_max, comm, "max")
        z = z - row_max.unsqueeze(-1)
        # 2. the target's logit, from the rank that owns it
        ignored = targets == ignore_index
        outside = (targets < start) | (targets >= start + n_local) | ignored
        local_target = (targets - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        _all_reduce(target_logit, comm, "sum")
        # 3. the sum of exponentials
        exp = z.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, comm, "sum")
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # now this shard's softmax
        ctx.save_for_backward(exp, local_target, outside, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()  # the saved softmax stays valid for a second backward
        owned = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        scale = grad_loss.to(grad.dtype).masked_fill(ignored, 0.0)
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def _all_reduce(t: torch.Tensor, comm: Any, op: str) -> None:
    if mappings.tp_size(comm) > 1:
        comm.all_reduce(t, op=op)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    comm: Any = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of logits split by vocabulary over the tensor-parallel group.

    Args:
        logits_shard: ``[..., vocab / tp]``, this rank's columns (a ``ColumnParallelLinear``'s
            output with ``gather_output=False``).
        targets: ``[...]`` class indices in ``[0, vocab)`` or ``ignore_index``; the same on
            every rank (checked under ``DK_DEBUG=1``).
        comm: the tensor-parallel Communicator; None = one rank.
        ignore_index: targets with this value contribute neither loss nor gradient.
        reduction: ``"mean"`` (over targets not ignored, as torch), ``"sum"`` or ``"none"``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if tuple(targets.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: targets shape {tuple(targets.shape)} must be the "
            f"logits shape {tuple(logits_shard.shape)} without its last dimension"
        )
    if mappings.tp_size(comm) > 1:
        check_replicated(targets, comm, "vocab_parallel_cross_entropy (targets)")
    loss = _VocabParallelCrossEntropy.apply(logits_shard, targets, comm, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()
