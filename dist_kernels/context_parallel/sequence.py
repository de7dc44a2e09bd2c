"""The sequence split over the context-parallel ranks: shard, gather, positions, and the loss.

Each is an autograd pair like the tensor-parallel mappings, with its adjoint in backward::

    shard_sequence    forward: this rank's chunks      backward: all-gather (every rank's part
                                                                 of the whole gradient)
    gather_sequence   forward: all-gather, reordered   backward: reduce-scatter (the sum of
                                                                 every rank's use of it)
    sequence_mean     forward: all-reduce of sums      backward: all-reduce

Gradients follow one rule: each rank's backward is that of the sum of every rank's loss, so
a loss replicated on the cp ranks (:func:`sequence_mean`) gives each rank cp times its share
of the gradient, and averaging the parameters' gradients over the cp ranks, as data-parallel
engines average over dp (``mesh.dp_cp_comm``), gives the gradient of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..tensor_parallel.mappings import all_gather, reduce_scatter
from . import layout
from .ring_attention import ring_attention

__all__ = ["shard_sequence", "gather_sequence", "positions", "sequence_mean", "SequenceSharding"]


def _size_rank(comm: Any):
    return (1, 0) if comm is None else (comm.world_size, comm.rank)


def _shard_order(seq_len: int, comm: Any, load_balance: bool, what: str) -> torch.Tensor:
    """Global positions in shard order: rank 0's tokens, then rank 1's, ..."""
    cp, rank = _size_rank(comm)
    layout.check_split(seq_len, cp, load_balance, what, rank)
    order = [p for r in range(cp) for p in layout.positions(seq_len, r, cp, load_balance)]
    return torch.tensor(order, dtype=torch.long)


def positions(seq_len: int, comm: Any, load_balance: bool = True) -> torch.Tensor:
    """The global positions (int64) of this rank's ``seq_len / cp`` tokens of a sequence of
    ``seq_len``: the rows of a learned position table, or the angles of rotary embeddings."""
    cp, rank = _size_rank(comm)
    layout.check_split(seq_len, cp, load_balance, "positions", rank)
    return torch.tensor(layout.positions(seq_len, rank, cp, load_balance), dtype=torch.long)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim: int, load_balance: bool):
        ctx.comm, ctx.dim = comm, dim
        ctx.order = _shard_order(x.shape[dim], comm, load_balance, "shard_sequence")
        mine = positions(x.shape[dim], comm, load_balance).to(x.device)
        return x.index_select(dim, mine)

    @staticmethod
    def backward(ctx, grad):
        whole = all_gather(grad, ctx.dim, ctx.comm)  # in shard order
        inverse = torch.argsort(ctx.order).to(grad.device)
        return whole.index_select(ctx.dim, inverse), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim: int, load_balance: bool):
        cp, _ = _size_rank(comm)
        ctx.comm, ctx.dim = comm, dim
        ctx.order = _shard_order(x.shape[dim] * cp, comm, load_balance, "gather_sequence")
        whole = all_gather(x, dim, comm)
        return whole.index_select(dim, torch.argsort(ctx.order).to(x.device))

    @staticmethod
    def backward(ctx, grad):
        in_shard_order = grad.index_select(ctx.dim, ctx.order.to(grad.device))
        return (
            reduce_scatter(in_shard_order, ctx.dim, ctx.comm, "gather_sequence"),
            None,
            None,
            None,
        )


def shard_sequence(
    x: torch.Tensor, comm: Any, dim: int = 1, load_balance: bool = True
) -> torch.Tensor:
    """This rank's shard of ``x`` (whole, the same on every rank) along ``dim``.

    ``load_balance``: zig-zag, rank i holds chunks i and 2cp-1-i of 2 cp (``seq % (2 cp) ==
    0``), so that causal attention costs every rank the same; False: the i-th of cp contiguous
    pieces. ``comm``: the context-parallel Communicator; None = one rank (``x`` itself).
    """
    dim = dim % x.dim()
    cp, _ = _size_rank(comm)
    if cp == 1:
        layout.check_split(x.shape[dim], 1, load_balance, "shard_sequence", 0)
        return x
    return _Shard.apply(x, comm, dim, bool(load_balance))


def gather_sequence(
    x_shard: torch.Tensor, comm: Any, dim: int = 1, load_balance: bool = True
) -> torch.Tensor:
    """The whole sequence from every rank's shard along ``dim``, in global order (the inverse
    of :func:`shard_sequence` with the same ``load_balance``). Collective over ``comm``."""
    dim = dim % x_shard.dim()
    cp, _ = _size_rank(comm)
    if cp == 1:
        return x_shard
    return _Gather.apply(x_shard, comm, dim, bool(load_balance))


class _SumEverywhere(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = x.detach().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


def sequence_mean(loss_sum: torch.Tensor, count: Any, comm: Any) -> torch.Tensor:
    """The mean over every token of the sharded sequences: ``sum over ranks of loss_sum /
    sum over ranks of count``, the same on every cp rank.

    ``loss_sum``: this rank's sum of per-token losses (a scalar with a graph); ``count``: the
    tokens it counted (targets not ignored; int or tensor). Not the mean of the ranks' means:
    shards may count different numbers of tokens. Backward: see the module docstring.
    """
    cp, _ = _size_rank(comm)
    count = torch.as_tensor(count, dtype=torch.float64).reshape(1).clone()
    if cp == 1:
        return loss_sum / count.to(loss_sum.dtype)[0]
    comm.all_reduce(count)
    total = _SumEverywhere.apply(loss_sum.reshape(1), comm)[0]
    return total / count.to(total.dtype)[0]


@dataclass(frozen=True)
class SequenceSharding:
    """What a model's layers need to run on sequence shards: the context-parallel group and
    its layout. The GPT's attention, position embedding and loss each hold one
    (``GPT.context_parallel``)."""

    comm: Any
    """The context-parallel Communicator (``mesh.cp_comm``)."""
    load_balance: bool = True
    """Zig-zag shards (rank i holds chunks i and 2cp-1-i), as :func:`shard_sequence` made."""

    @property
    def size(self) -> int:
        return _size_rank(self.comm)[0]

    def positions(self, local_len: int) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return positions(local_len * self.size, self.comm, self.load_balance)

    def attention(self, q, k, v, causal: bool) -> torch.Tensor:
        """:func:`ring_attention` of this rank's ``[b, h, seq / cp, d]`` shards."""
        return ring_attention(q, k, v, self.comm, causal=causal, load_balance=self.load_balance)

    def mean(self, loss_sum: torch.Tensor, count: Any) -> torch.Tensor:
        """:func:`sequence_mean` over the group."""
        return sequence_mean(loss_sum, count, self.comm)
