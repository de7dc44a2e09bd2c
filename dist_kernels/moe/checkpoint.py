"""Expert checkpoints across expert-parallel sizes: save at one ep, load at any other.

A run at ep saves one model state per ep rank (``dk.checkpoint``, one directory per ep rank:
the driver's ``stage-0-ep-<r>``), whose experts sit under their local indices
``<moe>.experts.<i>``. Ep rank ``r`` of ``ep`` holds global experts
``[r E / ep, (r + 1) E / ep)``, so local index ``i`` there is global expert ``r E / ep + i``::

    saved at ep 2          rank 0: experts.0 experts.1 | rank 1: experts.0 experts.1
    global ids                     0         1         |         2         3
    loaded at ep 4         rank 0: 0 | rank 1: 1 | rank 2: 2 | rank 3: 3   (each from one file)
    loaded at ep 1         rank 0: 0 1 2 3                                  (from both files)

Loading renames every saved key to its global id, takes each local expert from the saved rank
that holds it and the dense weights (replicated over ep) from the first saved rank read, and
loads strictly, so a missing or extra expert raises. Optimizer state (a torch optimizer's state
dict over ``model.parameters()``) reshards the same way, by parameter name, given the saving
run's parameter names in global form (:func:`global_param_names`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .layer import MoE

__all__ = [
    "expert_key_test",
    "global_key",
    "global_param_names",
    "global_state",
    "named_optimizer_state",
    "reshard_optimizer_state",
    "reshard_state",
    "saved_ranks",
]

StateReader = Callable[[int], Mapping[str, torch.Tensor]]


def _moe_layers(model: nn.Module) -> List[Tuple[str, MoE]]:
    """``(key prefix of its experts, layer)`` of every MoE layer of ``model``."""
    return [
        (f"{name}.experts." if name else "experts.", m)
        for name, m in model.named_modules()
        if isinstance(m, MoE)
    ]


def _renamed(key: str, layers: Sequence[Tuple[str, MoE]], first: Callable[[MoE], int]) -> str:
    """``key`` with a local expert index replaced by ``first(layer) + index``."""
    for prefix, layer in layers:
        if key.startswith(prefix):
            index, rest = key[len(prefix) :].split(".", 1)
            return f"{prefix}{first(layer) + int(index)}.{rest}"
    return key


def _check_ep(model: nn.Module, ep: int, what: str) -> None:
    for prefix, layer in _moe_layers(model):
        if not isinstance(ep, int) or ep < 1 or layer.n_experts % ep:
            raise ValueError(
                f"{what}: ep({ep}) must divide the {layer.n_experts} experts of "
                f"{prefix[: -len('.experts.')] or '<model>'}"
            )


def global_state(
    state: Mapping[str, torch.Tensor], model: nn.Module, ep_rank: int, ep: int
) -> Dict[str, torch.Tensor]:
    """A state dict saved by ep rank ``ep_rank`` of ``ep`` (of a model shaped like ``model``,
    whatever its own ep), its expert keys renamed to global expert ids."""
    _check_ep(model, ep, "global_state")
    layers = _moe_layers(model)
    return {
        _renamed(k, layers, lambda m: ep_rank * (m.n_experts // ep)): v for k, v in state.items()
    }


def global_key(model: nn.Module) -> Callable[[str], str]:
    """Renames one of ``model``'s parameter or state keys to its global form (experts by
    global id, other keys unchanged)."""
    layers = _moe_layers(model)
    return lambda key: _renamed(key, layers, lambda m: m.local_expert_ids[0])


def expert_key_test(model: nn.Module) -> Callable[[str], bool]:
    """True for a key of one of ``model``'s MoE layers' experts, whatever its expert id (a
    key that another ep rank may hold)."""
    prefixes = tuple(prefix for prefix, _ in _moe_layers(model))
    return lambda key: bool(prefixes) and key.startswith(prefixes)


def global_param_names(model: nn.Module) -> List[str]:
    """``model.parameters()``'s names in order, experts by global id (``local_expert_ids``)."""
    layers = _moe_layers(model)
    return [
        _renamed(n, layers, lambda m: m.local_expert_ids[0]) for n, _ in model.named_parameters()
    ]


def saved_ranks(model: nn.Module, saved_ep: int) -> List[int]:
    """The ep ranks of a run at ``saved_ep`` holding this model's local experts (rank 0 when
    the model has none: its dense weights)."""
    _check_ep(model, saved_ep, "saved_ranks")
    ranks = {
        e // (layer.n_experts // saved_ep)
        for _, layer in _moe_layers(model)
        for e in layer.local_expert_ids
    }
    return sorted(ranks) or [0]


def _local_keys(model: nn.Module) -> Dict[str, str]:
    """Global key -> this model's state-dict key, for every key of ``model.state_dict()``."""
    layers = _moe_layers(model)
    return {_renamed(k, layers, lambda m: m.local_expert_ids[0]): k for k in model.state_dict()}


def reshard_state(model: nn.Module, saved_ep: int, read: StateReader) -> Dict[str, torch.Tensor]:
    """This model's state dict (its own ep and local experts) from a run saved at
    ``saved_ep``: ``read(r)`` returns ep rank ``r``'s saved state dict. Reads only the saved
    ranks holding this model's experts. Raises ``KeyError`` naming what no saved rank had."""
    wanted = _local_keys(model)
    merged: Dict[str, torch.Tensor] = {}
    for r in saved_ranks(model, saved_ep):
        for key, value in global_state(read(r), model, r, saved_ep).items():
            if key in wanted:
                merged.setdefault(wanted[key], value)
    missing = sorted(set(wanted.values()) - set(merged))
    if missing:
        raise KeyError(
            f"reshard_state: the saved ranks {saved_ranks(model, saved_ep)} of ep({saved_ep}) "
            f"lack {len(missing)} keys of this model, e.g. {missing[:3]}"
        )
    return merged


def named_optimizer_state(
    saved: Mapping[str, Any], names: Sequence[str]
) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """``(state by parameter name, hyper-parameters by parameter name)`` of a torch optimizer
    state dict whose parameter indices ``names`` names (in the optimizer's order); a
    parameter without state (never stepped) has hyper-parameters only."""
    state: Dict[str, Any] = {}
    options: Dict[str, Dict[str, Any]] = {}
    for group in saved["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for index in group["params"]:
            options[names[index]] = hyper
            if index in saved["state"]:
                state[names[index]] = saved["state"][index]
    return state, options


def reshard_optimizer_state(
    model: nn.Module,
    saved_ep: int,
    read: Callable[[int], Tuple[Mapping[str, Any], Sequence[str]]],
    groups: Optional[Sequence[Sequence[torch.Tensor]]] = None,
) -> Dict[str, Any]:
    """A torch optimizer state dict for ``model``'s parameters from a run saved at
    ``saved_ep``: ``read(r)`` returns ep rank ``r``'s optimizer state dict and that run's
    :func:`global_param_names`. ``groups``: the loading optimizer's param groups (its
    ``param_groups``' parameters; default one group of ``model.parameters()``); each gets the
    hyper-parameters the saving run's group of its first parameter had."""
    names_of = {id(p): n for p, n in zip(model.parameters(), global_param_names(model))}
    groups = [list(model.parameters())] if groups is None else [list(g) for g in groups]
    by_name: Dict[str, Any] = {}
    options: Dict[str, Dict[str, Any]] = {}
    for r in saved_ranks(model, saved_ep):
        state, hyper = named_optimizer_state(*read(r))
        for name, value in state.items():
            by_name.setdefault(name, value)
        for name, value in hyper.items():
            options.setdefault(name, value)
    names = [names_of[id(p)] for g in groups for p in g]
    if by_name and not set(names) <= set(by_name):
        missing = sorted(set(names) - set(by_name))
        raise KeyError(
            f"reshard_optimizer_state: no saved rank of ep({saved_ep}) has state for "
            f"{len(missing)} parameters, e.g. {missing[:3]}"
        )
    state = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    param_groups, start = [], 0
    for g in groups:
        first = options.get(names_of[id(g[0])], {}) if g else {}
        param_groups.append({**first, "params": list(range(start, start + len(g)))})
        start += len(g)
    return {"state": state, "param_groups": param_groups}
