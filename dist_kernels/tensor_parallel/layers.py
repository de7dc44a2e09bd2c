"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Each layer keeps torch's parameter layout for its shard, so loading an unsharded checkpoint is
slicing (``tp.shard_module`` does it)::

    ColumnParallelLinear  weight [out / tp, in]   output features split   y_r = x W_r^T + b_r
    RowParallelLinear     weight [out, in / tp]   input features split    y = sum_r x_r W_r^T + b
    VocabParallelEmbedding weight [vocab / tp, dim]  rows of the table split

The usual pairing is a column-parallel layer (its output stays split) feeding a row-parallel one
(its input is that split), which costs one all-reduce in forward and one in backward per pair.
With ``sequence_parallel=True`` activations outside the pair are split along the sequence
(dimension 0, layout ``[sequence, batch, hidden]``): the column layer all-gathers its input and
the row layer reduce-scatters its output (the same bytes as one all-reduce), and the norms and
dropouts between them run on a ``1 / tp`` shard.

Overlap: in ``ColumnParallelLinear``'s backward the all-reduce (or reduce-scatter) of the
input gradient is started asynchronously and the weight gradient is computed while it runs.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import mappings
from .desync import check_replicated
from .random import get_rng_tracker

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def _divide(total: int, comm: Any, layer: str, what: str) -> int:
    n = mappings.tp_size(comm)
    if total % n:
        raise ValueError(f"[rank {mappings.tp_rank(comm)}] {layer}: {what}({total}) % tp({n}) != 0")
    return total // n


def _autocast(*tensors: Optional[torch.Tensor]):
    """The tensors cast to the autocast dtype when autocast is on for their device.

    The casts stay outside the custom autograd functions, so gradients of FP32 (master)
    parameters come back in FP32 through autograd's own cast.
    """
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _sequence_parallel_grad(param: torch.Tensor, comm: Any) -> None:
    """Sums ``param``'s gradient over the tensor-parallel group as it is produced.

    A replicated parameter used on a sequence shard (norm weights, the row layer's bias under
    sequence parallelism) gets only this shard's part of its gradient on each rank; the sum
    over ranks is the whole gradient. The hook runs before the gradient accumulates into
    ``.grad`` (and before DDP's post-accumulate hook), once per backward pass.
    """
    if mappings.tp_size(comm) == 1 or getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True
    param.register_hook(lambda grad: mappings.all_reduce(grad, comm))


class _ColumnLinearFunction(torch.autograd.Function):
    """``y = gather?(x) W^T + b``; backward overlaps the input-gradient reduction."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, sequence_parallel):
        total = mappings.all_gather(x, 0, comm) if sequence_parallel else x
        # Under sequence parallelism this keeps the gathered input (tp x the shard) for the
        # weight gradient; Megatron instead re-gathers it in backward, trading memory for an
        # all-gather overlapped with the input-gradient matmul.
        ctx.save_for_backward(total, weight)
        ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        total, weight = ctx.saved_tensors
        comm = ctx.comm
        grad = grad.contiguous()
        grad_input, work = None, None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight)
            grad_input, work = _start_input_grad_reduction(grad_input, comm, ctx.sequence_parallel)
        # Runs while the input gradient's collective is in flight.
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_input, grad_weight, grad_bias, None, None


def _start_input_grad_reduction(grad_input: torch.Tensor, comm: Any, sequence_parallel: bool):
    """Starts the all-reduce (or the reduce-scatter back to sequence shards) of the input
    gradient; returns ``(tensor it lands in, Work or None)``."""
    if mappings.tp_size(comm) == 1:
        return grad_input, None
    if not sequence_parallel:
        return grad_input, comm.all_reduce(grad_input, async_op=True)
    mappings.split_size(grad_input, 0, comm, "ColumnParallelLinear backward")
    shard = torch.empty(
        (grad_input.shape[0] // comm.world_size,) + tuple(grad_input.shape[1:]),
        dtype=grad_input.dtype,
        device=grad_input.device,
    )
    return shard, comm.reduce_scatter(shard, grad_input, async_op=True)


class _TensorParallelModule(nn.Module):
    """Shared bookkeeping: the group, this rank's place in it, a name for error messages."""

    def _setup(self, comm: Any, sequence_parallel: bool) -> None:
        self.comm = comm
        self.tp_size = mappings.tp_size(comm)
        self.tp_rank = mappings.tp_rank(comm)
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_name = type(self).__name__  # tp.shard_module sets the module's path

    def _mark_shards(self, dim: int, *params: Optional[nn.Parameter]) -> None:
        """Marks the parameters each tp rank holds a different part of (Megatron's
        ``tensor_model_parallel``): a norm over the model counts them on every tp rank, the
        others on one (train/clipping.py). ``tensor_parallel_dim`` is the dimension they are
        cut along (Megatron's ``partition_dim``): what joins them again (Muon's whole-matrix
        step, dk.optim.muon)."""
        if self.tp_size > 1:
            for p in params:
                if p is not None:
                    p.tensor_parallel_shard = True
                    p.tensor_parallel_dim = dim

    def _init_sharded(self, tensor: torch.Tensor, init) -> None:
        # Shards differ between tensor-parallel ranks: draw them from the per-rank generator.
        with torch.no_grad(), get_rng_tracker().fork():
            init(tensor)


class ColumnParallelLinear(_TensorParallelModule):
    """``nn.Linear`` with its output features split over the tensor-parallel group.

    Args:
        in_features, out_features: the unsharded layer's sizes (``out_features % tp == 0``).
        comm: the tensor-parallel Communicator (e.g. ``mesh.tp_comm``); None = one rank.
        bias: whether to learn a bias (split like the output).
        gather_output: all-gather the output so every rank holds all ``out_features``;
            otherwise each rank returns its ``out_features / tp`` columns.
        sequence_parallel: the input is this rank's shard of dimension 0 (the sequence);
            it is all-gathered in forward and the input gradient reduce-scattered in backward.

    Without ``sequence_parallel`` the input must be the same on every rank (checked under
    ``DK_DEBUG=1``). ``weight`` has shape ``[out_features / tp, in_features]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Any = None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self._setup(comm, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = bool(gather_output)
        self.out_per_rank = _divide(out_features, comm, "ColumnParallelLinear", "out_features")
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, **factory)) if bias else None
        bound = 1 / math.sqrt(in_features) if in_features else 0.0  # nn.Linear's bounds
        self._init_sharded(self.weight, lambda w: w.uniform_(-bound, bound))
        if self.bias is not None:
            self._init_sharded(self.bias, lambda b: b.uniform_(-bound, bound))
        self._mark_shards(0, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and not self.sequence_parallel:
            check_replicated(x, self.comm, self.tp_name)
        x, weight, bias = _autocast(x, self.weight, self.bias)
        if self.tp_size == 1:
            y = F.linear(x, weight, bias)
        else:
            y = _ColumnLinearFunction.apply(x, weight, bias, self.comm, self.sequence_parallel)
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.comm)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this rank: {self.out_per_rank}), tp={self.tp_size}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_TensorParallelModule):
    """``nn.Linear`` with its input features split over the tensor-parallel group.

    Args:
        in_features, out_features: the unsharded layer's sizes (``in_features % tp == 0``).
        comm: the tensor-parallel Communicator; None = one rank.
        bias: whether to learn a bias (replicated; added once, after the sum over ranks).
        input_is_parallel: the input is already split along its last dimension (the output
            of a ``ColumnParallelLinear``); otherwise it must be replicated and is split here.
        sequence_parallel: reduce-scatter the output along dimension 0 (the sequence) instead
            of all-reducing it; needs ``input_is_parallel=True``.

    ``weight`` has shape ``[out_features, in_features / tp]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Any = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self._setup(comm, sequence_parallel)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(the input comes split by features from a ColumnParallelLinear)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = bool(input_is_parallel)
        self.in_per_rank = _divide(in_features, comm, "RowParallelLinear", "in_features")
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self._init_sharded(self.weight, lambda w: w.uniform_(-bound, bound))
        self._mark_shards(1, self.weight)  # the bias is whole on every rank
        if self.bias is not None:
            with torch.no_grad():  # replicated: the same draw on every rank
                self.bias.uniform_(-bound, bound)
            if self.sequence_parallel:
                _sequence_parallel_grad(self.bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.comm, where=self.tp_name)
        x, weight = _autocast(x, self.weight)
        y = F.linear(x, weight)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.comm)
        else:
            y = mappings.reduce_from_parallel_region(y, self.comm)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this rank: {self.in_per_rank}), "
            f"out_features={self.out_features}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(_TensorParallelModule):
    """``nn.Embedding`` with the rows (the vocabulary) split over the tensor-parallel group.

    Each rank looks up the ids that fall in its rows (zeros elsewhere) and the partial results
    are summed: all-reduced, or with ``sequence_parallel=True`` reduce-scattered along
    dimension 0 (feed ids as ``[sequence, batch]``). The ids must be the same on every rank
    (checked under ``DK_DEBUG=1``). ``weight`` has shape ``[num_embeddings / tp, dim]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: Any = None,
        *,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self._setup(comm, sequence_parallel)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = _divide(
            num_embeddings, comm, "VocabParallelEmbedding", "num_embeddings"
        )
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim, device=device, dtype=dtype)
        )
        self._init_sharded(self.weight, nn.init.normal_)
        self._mark_shards(0, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_range(ids)
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight)
        else:
            check_replicated(ids, self.comm, self.tp_name)
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.rows_per_rank)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, self.comm)
        return mappings.reduce_from_parallel_region(out, self.comm)

    def _check_range(self, ids: torch.Tensor) -> None:
        # Out-of-range ids would fall outside every shard and silently embed to zeros.
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"[rank {self.tp_rank}] {self.tp_name}: ids must lie in "
                f"[0, {self.num_embeddings}), got [{int(ids.min())}, {int(ids.max())}]"
            )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (this rank: rows {self.vocab_start}.."
            f"{self.vocab_start + self.rows_per_rank - 1}), {self.embedding_dim}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


def is_tensor_parallel_shard(p: torch.Tensor) -> bool:
    """True for a parameter of which each tensor-parallel rank holds a different part (a
    column-parallel weight or bias, a row-parallel weight, a vocabulary-parallel embedding,
    at tp > 1); False for one every rank holds whole."""
    return bool(getattr(p, "tensor_parallel_shard", False))
