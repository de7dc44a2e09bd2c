"""The autograd pairs every tensor-parallel layer is built from.

Each pair is a collective in forward and its adjoint in backward (Megatron-Core's mappings)::

    copy_to_parallel_region                    forward: identity     backward: all-reduce
    reduce_from_parallel_region                forward: all-reduce   backward: identity
    gather_from_sequence_parallel_region       forward: all-gather   backward: reduce-scatter
    reduce_scatter_to_sequence_parallel_region forward: reduce-scatter  backward: all-gather
    scatter_to_sequence_parallel_region        forward: split        backward: all-gather
    gather_from_tensor_parallel_region         forward: all-gather (last dim)  backward: split
    scatter_to_tensor_parallel_region          forward: split (last dim)  backward: all-gather

"Sequence" pairs work on dimension 0 by default (``[sequence, batch, hidden]``, the layout the
layers use); ``dim=`` picks another. ``comm`` is the tensor-parallel Communicator (``None`` or a
one-rank communicator: every pair is the identity). Every rank of ``comm`` must call the same
pairs in the same order: they are collectives.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .desync import check_replicated

__all__ = [
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "tp_size",
    "tp_rank",
]


def tp_size(comm: Any) -> int:
    """Ranks in the tensor-parallel group (1 for ``comm=None``)."""
    return 1 if comm is None else comm.world_size


def tp_rank(comm: Any) -> int:
    """This rank's index in the tensor-parallel group (0 for ``comm=None``)."""
    return 0 if comm is None else comm.rank


# -- the collectives, on plain tensors ------------------------------------------------------


def all_reduce(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new tensor (autograd may still need ``x``)."""
    out = x.contiguous().clone()
    comm.all_reduce(out)
    return out


def split_size(x: torch.Tensor, dim: int, comm: Any, what: str) -> int:
    """``x.shape[dim] / tp``; ``ValueError`` with the arithmetic if it does not divide."""
    size, n = x.shape[dim], tp_size(comm)
    if size % n:
        raise ValueError(
            f"[rank {tp_rank(comm)}] {what}: dimension {dim} of shape {tuple(x.shape)} is "
            f"not divisible by tp: {size} % tp({n}) != 0"
        )
    return size // n


def split(x: torch.Tensor, dim: int, comm: Any, what: str = "split") -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim``."""
    n = split_size(x, dim, comm, what)
    return x.narrow(dim, tp_rank(comm) * n, n).contiguous()


def all_gather(x: torch.Tensor, dim: int, comm: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    x = x.contiguous()
    out = torch.empty((tp_size(comm),) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x)
    if dim % x.dim() == 0:
        return out.flatten(0, 1)  # rank-major is already dim-0-major: no copy
    return torch.cat(out.unbind(0), dim)


def reduce_scatter(x: torch.Tensor, dim: int, comm: Any, what: str) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of ``x`` over the group."""
    split_size(x, dim, comm, what)
    n = tp_size(comm)
    whole = x.contiguous() if dim % x.dim() == 0 else torch.stack(x.chunk(n, dim))
    shape = list(x.shape)
    shape[dim] //= n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, whole)
    return out


def _solo(comm: Any) -> bool:
    return tp_size(comm) == 1


# -- the pairs ------------------------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.comm), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, reduce_grad):
        ctx.comm, ctx.dim, ctx.reduce_grad = comm, dim, reduce_grad
        return all_gather(x, dim, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:  # every rank's output fed a different partial computation
            grad = reduce_scatter(grad, ctx.dim, ctx.comm, "gather_from_sequence backward")
        else:
            grad = split(grad, ctx.dim, ctx.comm)
        return grad, None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return reduce_scatter(x, dim, comm, "reduce_scatter_to_sequence_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.comm), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, what):
        ctx.comm, ctx.dim = comm, dim
        return split(x, dim, comm, what)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.comm), None, None, None


class _GatherSplitGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return all_gather(x, dim, comm)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.comm), None, None


def copy_to_parallel_region(
    x: torch.Tensor, comm: Any, where: Optional[str] = None
) -> torch.Tensor:
    """Identity forward, all-reduce backward: enters a region where ranks compute on shards.

    The input must be the same on every rank; under ``DK_DEBUG=1`` that is checked and a
    mismatch raises at once naming ``where`` (the layer).
    """
    if _solo(comm):
        return x
    check_replicated(x, comm, where or "copy_to_parallel_region")
    return _CopyToParallel.apply(x, comm)


def reduce_from_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """All-reduce forward, identity backward: sums the ranks' partial results."""
    return x if _solo(comm) else _ReduceFromParallel.apply(x, comm)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, comm: Any, dim: int = 0, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather of sequence shards forward; reduce-scatter backward.

    ``tensor_parallel_output_grad=False`` when every rank's use of the gathered tensor is the
    same (replicated) computation: backward then just keeps this rank's slice.
    """
    if _solo(comm):
        return x
    return _GatherFromSequence.apply(x, comm, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, comm: Any, dim: int = 0
) -> torch.Tensor:
    """Reduce-scatter forward (sum of partials, this rank's sequence shard); all-gather backward."""
    return x if _solo(comm) else _ReduceScatterToSequence.apply(x, comm, dim)


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, comm: Any, dim: int = 0, where: Optional[str] = None
) -> torch.Tensor:
    """This rank's sequence shard of a replicated tensor forward; all-gather backward."""
    if _solo(comm):
        return x
    where = where or "scatter_to_sequence_parallel_region"
    check_replicated(x, comm, where)
    return _Split.apply(x, comm, dim, where)


def gather_from_tensor_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """All-gather along the last dimension forward; this rank's slice backward."""
    return x if _solo(comm) else _GatherSplitGrad.apply(x, comm, -1)


def scatter_to_tensor_parallel_region(
    x: torch.Tensor, comm: Any, where: Optional[str] = None
) -> torch.Tensor:
    """This rank's slice of the last dimension forward; all-gather backward."""
    if _solo(comm):
        return x
    where = where or "scatter_to_tensor_parallel_region"
    check_replicated(x, comm, where)
    return _Split.apply(x, comm, -1, where)
