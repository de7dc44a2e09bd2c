"""Parameters that several pipeline stages share: a tied embedding and output head.

A model whose first and last layers share one weight (GPT-2, Gemma, Megatron's default) cannot
keep that weight as one tensor once the stages sit on different ranks: each stage's rank holds
its own copy. The copies start equal (the first stage's values are sent to the other holders
when the pipeline is built) and stay equal if each step gives them the same gradient: the sum
of every stage's contribution, which is what autograd accumulates into the one tensor on a
single process. Megatron all-reduces the word embedding's gradient over its "embedding group"
(first and last stage) for this; DeepSpeed's ``TiedLayerSpec`` does the same per tied
module.

Here the sharing is found, not declared: a parameter that two stages' modules reach (by
identity, in the ``nn.Sequential`` or the stage list given to the pipeline) is tied. Each stage
of this rank gets its own copy (two stages on one rank, as the V of ZB-V places the first and
the last, would otherwise feed one tensor to two DDP wrappers). After every step's backward the
ranks holding a tied parameter exchange their copies' gradients and every copy receives the
same sum, in stage order, bitwise equal on every holder. The exchange is linear, so it may
follow the data-parallel average (DDP) or precede the reduce-scatter (ZeRO's step): either way
each copy ends with the gradient the single tensor would get.

Every copy but the first stage's is marked :data:`TIED_COPY`: a gradient norm counts the
parameter once (``--clip-grad`` and ZeRO's norm skip the marked copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

# Set (True) on a tied parameter's copy held by any stage but the first that holds it.
TIED_COPY = "pipeline_tied_copy"


def is_tied_copy(p: torch.Tensor) -> bool:
    """Whether ``p`` repeats a parameter an earlier pipeline stage also holds (count it once)."""
    return bool(getattr(p, TIED_COPY, False))


@dataclass
class TiedParameter:
    """One parameter several stages hold: its name in each (stage order), and this rank's
    copies by stage."""

    names: Dict[int, str]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    local: Dict[int, nn.Parameter]

    @property
    def stages(self) -> List[int]:
        return sorted(self.names)

    def describe(self) -> str:
        return ", ".join(f"stage {s} {self.names[s]!r}" for s in self.stages)


def find_tied(stages: Sequence[nn.Module]) -> List[List[Tuple[int, str]]]:
    """``[(stage, name in that stage), ...]`` for each parameter more than one of ``stages``
    holds (the first name a stage gives it), in the order of its first holder's parameters."""
    holders: Dict[int, List[Tuple[int, str]]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            places = holders.setdefault(id(p), [])
            if not places or places[-1][0] != s:
                places.append((s, name))
    return [places for places in holders.values() if len(places) > 1]


def untie(stages: Sequence[nn.Module], mine: Sequence[int]) -> List[TiedParameter]:
    """Gives each of this rank's stages (``mine``) its own copy of every tied parameter, marks
    the copies past the first holder, and returns the tied parameters (every rank the same
    list, so that the gradient exchange matches up)."""
    tied = []
    for places in find_tied(stages):
        first_stage, first_name = places[0]
        p = stages[first_stage].get_parameter(first_name)
        entry = TiedParameter(dict(places), tuple(p.shape), p.dtype, {})
        for s, name in places:
            if s not in mine:
                continue
            copy = p if not entry.local else nn.Parameter(p.detach().clone(), p.requires_grad)
            if copy is not p:
                owner, _, attr = name.rpartition(".")
                setattr(stages[s].get_submodule(owner), attr, copy)
            if s != first_stage:
                setattr(copy, TIED_COPY, True)
            entry.local[s] = copy
        tied.append(entry)
    return tied


@torch.no_grad()
def share_values(tied: Sequence[TiedParameter], comm: Any, rank_of) -> None:
    """Every copy of each tied parameter takes the first stage's values: ranks that seeded
    apart, or a stage list built per rank, start equal (Megatron's first-stage embedding
    sync). The first holder's rank sends to the other holder ranks only."""
    me = comm.rank
    for t in tied:
        first = t.stages[0]
        source, ranks = rank_of(first), sorted({rank_of(s) for s in t.stages})
        if me not in ranks:
            continue
        if me == source:
            value = t.local[first].detach()
            works = [comm.isend(value, r) for r in ranks if r != me]
        else:
            value, works = torch.empty(t.shape, dtype=t.dtype), []
            comm.recv(value, source)
        for s, p in t.local.items():
            if s != first:
                p.copy_(value)
        for w in works:
            w.wait()


def exchange_grads(tied: Sequence[TiedParameter], comm: Any, rank_of) -> None:
    """Every holder's copies of each tied parameter receive the sum of all holders' gradients
    (a missing gradient counts as zero), added in stage order: the same bits on every holder.
    Holder ranks exchange with each other only (isend, then recv); ``rank_of(stage)`` is the
    pipeline rank of a stage."""
    me = comm.rank
    for t in tied:
        ranks = sorted({rank_of(s) for s in t.stages})
        if me not in ranks:
            continue
        parts = {r: _local_sum(t, rank_of, r) if r == me else None for r in ranks}
        works = [comm.isend(parts[me], r) for r in ranks if r != me]
        for r in ranks:
            if r != me:
                parts[r] = torch.empty(t.shape, dtype=t.dtype)
                comm.recv(parts[r], r)
        for w in works:
            w.wait()
        first_stage_of = {r: min(s for s in t.stages if rank_of(s) == r) for r in ranks}
        order = sorted(ranks, key=first_stage_of.get)
        total = parts[order[0]]  # a fresh tensor (a local sum or a receive buffer)
        for r in order[1:]:
            total.add_(parts[r])
        for p in t.local.values():
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.copy_(total)


def _local_sum(t: TiedParameter, rank_of, rank: int) -> torch.Tensor:
    """This rank's copies' gradients added in stage order (zeros where none)."""
    total = torch.zeros(t.shape, dtype=t.dtype)
    for s in t.stages:
        if rank_of(s) == rank and t.local[s].grad is not None:
            total.add_(t.local[s].grad)
    return total
