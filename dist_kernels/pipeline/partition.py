"""Splitting an ``nn.Sequential`` into pipeline stages.

Three ways, checked in this order: ``split_points`` (where each stage after the first begins:
child indices or child names), ``balance`` (how many children each stage gets), or by parameter
count (contiguous stages, the largest stage as small as possible). Every rank computes the same
split from the same model, so no message is needed to agree on it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch.nn as nn


@dataclass(frozen=True)
class StageSpan:
    """Children ``[start, stop)`` of the model form stage ``stage``."""

    stage: int
    start: int
    stop: int
    n_params: int
    names: tuple


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _bounds_from_split_points(model: nn.Sequential, split_points: Sequence) -> List[int]:
    names = [name for name, _ in model.named_children()]
    bounds = []
    for point in split_points:
        if isinstance(point, str):
            if point not in names:
                raise ValueError(f"split_points: no child named {point!r} (children: {names})")
            point = names.index(point)
        if not isinstance(point, int) or isinstance(point, bool):
            raise TypeError(f"split_points: entries are child indices or names, got {point!r}")
        bounds.append(point)
    full = [0, *bounds, len(model)]
    if any(a >= b for a, b in zip(full, full[1:])):
        raise ValueError(
            f"split_points must rise strictly inside (0, {len(model)}) so that no stage is "
            f"empty, got {list(split_points)}"
        )
    return full


def _bounds_from_balance(model: nn.Sequential, balance: Sequence[int]) -> List[int]:
    if any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance: every stage needs at least one layer, got {list(balance)}")
    if sum(balance) != len(model):
        shown = " + ".join(str(b) for b in balance)
        raise ValueError(f"balance: {shown} = {sum(balance)} != {len(model)} layers in the model")
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    return bounds


def _bounds_by_params(model: nn.Sequential, n_stages: int) -> List[int]:
    """Contiguous split minimising the largest stage's parameter count (linear partition DP).

    best[k][i] = the smallest possible largest stage when the first ``i`` layers form ``k``
    stages; ties keep the latest cut (layers without parameters, such as activations, stay
    with the layer before them), and every rank derives the same split.
    """
    sizes = [_param_count(layer) for layer in model]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    n = len(sizes)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def plan_partition(
    model: nn.Sequential,
    n_stages: int,
    split_points: Optional[Sequence[Union[int, str]]] = None,
    balance: Optional[Sequence[int]] = None,
) -> List[StageSpan]:
    """Which children of ``model`` go to each of ``n_stages`` stages."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"module_or_stages: expected nn.Sequential, got {type(model).__name__}")
    if split_points is not None and balance is not None:
        raise ValueError("give split_points or balance, not both")
    if len(model) < n_stages:
        raise ValueError(f"cannot split {len(model)} layers into {n_stages} non-empty stages")
    if split_points is not None:
        if len(split_points) != n_stages - 1:
            raise ValueError(
                f"split_points: {len(split_points)} points make {len(split_points) + 1} stages, "
                f"the pipeline has {n_stages}"
            )
        bounds = _bounds_from_split_points(model, split_points)
    elif balance is not None:
        if len(balance) != n_stages:
            raise ValueError(f"balance: {len(balance)} entries for {n_stages} stages")
        bounds = _bounds_from_balance(model, balance)
    else:
        bounds = _bounds_by_params(model, n_stages)
    names = [name for name, _ in model.named_children()]
    layers = list(model)
    return [
        StageSpan(s, a, b, sum(_param_count(x) for x in layers[a:b]), tuple(names[a:b]))
        for s, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


def build_stage(model: nn.Sequential, span: StageSpan) -> nn.Sequential:
    """The children of ``span`` as their own ``nn.Sequential`` (sharing the parameters)."""
    children = list(model.named_children())[span.start : span.stop]
    return nn.Sequential(OrderedDict(children))


def format_partition(
    model: nn.Sequential, spans: Sequence[StageSpan], n_ranks: Optional[int] = None
) -> str:
    """One line per stage: its rank (stage ``s`` runs on rank ``s % n_ranks``), layers, their
    types and parameter count."""
    layers = list(model)
    lines = []
    for span in spans:
        kinds = ", ".join(type(layer).__name__ for layer in layers[span.start : span.stop])
        where = f" (rank {span.stage % n_ranks})" if n_ranks else ""
        lines.append(
            f"stage {span.stage}{where}: layers {span.start}..{span.stop - 1} ({kinds}), "
            f"{span.n_params:,} parameters"
        )
    return "\n".join(lines)
