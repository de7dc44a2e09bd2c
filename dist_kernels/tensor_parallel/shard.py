"""``shard_module``: an unsharded module's layers replaced by tensor-parallel ones, by plan.

    plan = {
        "wte": tp.VocabParallel(),
        "blocks.*.attn.qkv": tp.ColumnParallel(),
        "blocks.*.attn.proj": tp.RowParallel(),
        "blocks.*.ln_*": tp.SequenceParallel(),      # only with sequence parallelism
    }
    tp.shard_module(model, plan, mesh.tp_comm)

Keys are ``fnmatch`` patterns over module paths (``named_modules()``); a pattern that matches
nothing is an error (a typo would leave a layer silently unsharded). Every rank keeps its own
slice of each weight: loading an unsharded checkpoint is slicing, since the layers keep torch's
parameter layout for their shard. Parameters tied before sharding (a tied embedding and head)
are tied again after, if their shards have the same shape.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping

import torch
import torch.nn as nn

from . import mappings
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _sequence_parallel_grad,
)
from .random import get_rng_tracker

__all__ = [
    "ColumnParallel",
    "RowParallel",
    "VocabParallel",
    "SequenceParallel",
    "ShardedDropout",
    "shard_module",
]


def _require(module: nn.Module, kind: type, style: str, name: str) -> None:
    if type(module) is not kind:
        raise TypeError(
            f"shard_module: {style} applies to {kind.__name__}, but {name!r} is a "
            f"{type(module).__name__}"
        )


def _slice(full: torch.Tensor, dim: int, comm: Any) -> torch.Tensor:
    n = full.shape[dim] // mappings.tp_size(comm)
    return full.narrow(dim, mappings.tp_rank(comm) * n, n)


def _load(param: torch.Tensor, value: torch.Tensor, requires_grad: bool) -> None:
    with torch.no_grad():
        param.copy_(value)
    param.requires_grad_(requires_grad)


def _factory(module: nn.Module) -> Dict[str, Any]:
    weight = module.weight
    return {"device": weight.device, "dtype": weight.dtype}


@dataclass(frozen=True)
class ColumnParallel:
    """``nn.Linear`` -> :class:`ColumnParallelLinear` (output features split)."""

    gather_output: bool = False
    sequence_parallel: bool = False

    def apply(self, module: nn.Module, comm: Any, name: str) -> nn.Module:
        _require(module, nn.Linear, "ColumnParallel", name)
        layer = ColumnParallelLinear(
            module.in_features,
            module.out_features,
            comm,
            bias=module.bias is not None,
            gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
            **_factory(module),
        )
        _load(layer.weight, _slice(module.weight, 0, comm), module.weight.requires_grad)
        if module.bias is not None:
            _load(layer.bias, _slice(module.bias, 0, comm), module.bias.requires_grad)
        return layer


@dataclass(frozen=True)
class RowParallel:
    """``nn.Linear`` -> :class:`RowParallelLinear` (input features split)."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False

    def apply(self, module: nn.Module, comm: Any, name: str) -> nn.Module:
        _require(module, nn.Linear, "RowParallel", name)
        layer = RowParallelLinear(
            module.in_features,
            module.out_features,
            comm,
            bias=module.bias is not None,
            input_is_parallel=self.input_is_parallel,
            sequence_parallel=self.sequence_parallel,
            **_factory(module),
        )
        _load(layer.weight, _slice(module.weight, 1, comm), module.weight.requires_grad)
        if module.bias is not None:
            _load(layer.bias, module.bias, module.bias.requires_grad)
        return layer


@dataclass(frozen=True)
class VocabParallel:
    """``nn.Embedding`` -> :class:`VocabParallelEmbedding` (rows split)."""

    sequence_parallel: bool = False

    def apply(self, module: nn.Module, comm: Any, name: str) -> nn.Module:
        _require(module, nn.Embedding, "VocabParallel", name)
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError(
                f"shard_module: VocabParallel does not support padding_idx, max_norm or "
                f"sparse ({name!r})"
            )
        layer = VocabParallelEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            comm,
            sequence_parallel=self.sequence_parallel,
            **_factory(module),
        )
        _load(layer.weight, _slice(module.weight, 0, comm), module.weight.requires_grad)
        return layer


class ShardedDropout(nn.Dropout):
    """``nn.Dropout`` drawing from the per-tensor-parallel-rank stream (a sharded input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork():
            return super().forward(x)


@dataclass(frozen=True)
class SequenceParallel:
    """A norm or dropout that runs on sequence shards (as torch's ``SequenceParallel``).

    A module with parameters (LayerNorm, RMSNorm, ...) keeps them replicated; their gradients
    are summed over the tensor-parallel group as they are produced (each rank sees only its
    shard of the sequence). An ``nn.Dropout`` becomes a :class:`ShardedDropout`: shards need
    independent masks.
    """

    def apply(self, module: nn.Module, comm: Any, name: str) -> nn.Module:
        if hasattr(module, "on_sequence_shards"):  # a dropout that keys its own masks
            return module.on_sequence_shards(mappings.tp_rank(comm), mappings.tp_size(comm))
        if type(module) is nn.Dropout:
            return ShardedDropout(module.p, module.inplace)
        params = list(module.parameters())
        if not params:
            raise TypeError(
                f"shard_module: SequenceParallel applies to norms (modules with parameters) "
                f"and nn.Dropout, but {name!r} is a {type(module).__name__} without parameters"
            )
        for p in params:
            _sequence_parallel_grad(p, comm)
        return module


class ReplicatedOverShards(SequenceParallel):
    """A module with replicated parameters applied to this rank's shard of the heads (a
    per-head norm: QK-norm): each rank's gradient is its heads' part, summed over the
    tensor-parallel group as it is produced (what :class:`SequenceParallel` does for a norm
    on a sequence shard)."""


def _matches(plan: Mapping[str, Any], names: List[str]) -> Dict[str, Any]:
    """``{module path: style}``; ``ValueError`` for a pattern matching nothing or a path
    matched by two patterns."""
    chosen: Dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"shard_module: plan pattern {pattern!r} matches no module")
        for n in hits:
            if n in chosen:
                raise ValueError(f"shard_module: module {n!r} is matched by two plan patterns")
            chosen[n] = style
    return chosen


def tied_names(module: nn.Module) -> List[List[str]]:
    """The names of each parameter ``module`` reaches under more than one (a tied head)."""
    by_id: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: nn.Module, groups: List[List[str]]) -> None:
    for names in groups:
        first = module.get_parameter(names[0])
        for other in names[1:]:
            owner_path, _, attr = other.rpartition(".")
            owner = module.get_submodule(owner_path)
            if getattr(owner, attr).shape != first.shape:
                raise ValueError(
                    f"shard_module: {names[0]!r} and {other!r} were tied, but their shards "
                    f"have shapes {tuple(first.shape)} and {tuple(getattr(owner, attr).shape)} "
                    "(shard both the same way, e.g. VocabParallel and ColumnParallel)"
                )
            setattr(owner, attr, first)


def shard_module(module: nn.Module, plan: Mapping[str, Any], comm: Any) -> nn.Module:
    """Replaces the modules named by ``plan`` with their tensor-parallel forms, in place.

    Args:
        module: the unsharded model, the same weights on every rank of ``comm``.
        plan: ``{fnmatch pattern over module paths: style}`` with styles
            :class:`ColumnParallel`, :class:`RowParallel`, :class:`VocabParallel`,
            :class:`SequenceParallel`.
        comm: the tensor-parallel Communicator (e.g. ``mesh.tp_comm``).

    Returns ``module`` (or the replacement, if the plan names the root ``""``). Each new
    layer's ``tp_name`` (``"ColumnParallelLinear 'blocks.0.attn.qkv'"``) names it in errors.
    """
    tied = tied_names(module)
    names = [n for n, _ in module.named_modules()]
    for name, style in _matches(plan, names).items():
        if not hasattr(style, "apply"):
            raise TypeError(f"shard_module: plan[{name!r}] is not a style: {style!r}")
        old = module.get_submodule(name)
        try:
            new = style.apply(old, comm, name)
        except ValueError as e:
            raise ValueError(f"shard_module: {name!r}: {e}") from None
        if hasattr(new, "tp_name"):
            new.tp_name = f"{type(new).__name__} {name!r}" if name else type(new).__name__
        if name == "":
            module = new
            continue
        parent_path, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_path), attr, new)
    _retie(module, tied)
    return module
