"""Resuming a checkpoint at another layout: another pp, tp, pipeline schedule, or ZeRO on or
off (dp, ZeRO stage and ep change through the checkpoints' own resharding already).

A step directory holds one directory per pipeline stage and tensor shard, each with its
stage's slice of the model and optimizer state (``checkpoints.py``). When this run cuts the
model otherwise, no directory is this rank's: every rank reads the whole checkpoint instead
(``export.consolidate_training``: stages merged, tensor shards joined, ZeRO shards assembled,
experts gathered by global id; the optimizer state joined the way its parameter is), then

1. the model is built from the whole weights (``build_model(init_state=...)``, which slices
   them as any run's initialisation is sliced);
2. :meth:`Resharded.attach` takes each of this rank's parameters' optimizer state out of the
   whole state by the same cut: the whole tensor when the parameter is held whole, else the
   tp rank's slice along the one dimension where the shapes differ, and checks that the same
   cut of the whole weights gives the parameter built in step 1, bit for bit (so a cut that
   disagrees with the model's own sharding raises instead of loading moments into the wrong
   elements);
3. :meth:`Resharded.load` hands that state to the engine's optimizer: ZeRO's shards are cut
   from it (``dk.checkpoint.load_whole``), a torch optimizer gets a state dict by index.

The learning-rate schedule's position (``updates``), the loss scaler and the data position
come from the checkpoint as in any resume. Every rank holds the whole model and its optimizer
state for a moment: fine at the sizes this driver trains on CPU; torchtitan's DCP reads only
the pieces a rank needs, which this does not.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn as nn

from .. import checkpoint as dk_checkpoint
from ..moe.checkpoint import global_key
from .config import ConfigError
from .export import Consolidated, _model_key, consolidate_training


def _cut(whole: torch.Tensor, shape: torch.Size, tp_rank: int, tp: int, what: str):
    """This tp rank's part of ``whole`` for a tensor of ``shape``: all of it, or the slice
    along the one dimension where the shapes differ (shards in tp-rank order, as the model's
    tensor-parallel layers cut their weights)."""
    if whole.shape == shape:
        return whole
    split = [d for d, (a, b) in enumerate(zip(whole.shape, shape)) if a != b]
    if (
        len(whole.shape) != len(shape)
        or len(split) != 1
        or whole.shape[split[0]] != tp * shape[split[0]]
    ):
        raise ConfigError(
            f"resume: {what} is {tuple(shape)} on this rank; the checkpoint's whole "
            f"{tuple(whole.shape)} is not tp({tp}) slices of it along one dimension"
        )
    d = split[0]
    return whole.narrow(d, tp_rank * shape[d], shape[d])


class Resharded:
    """A checkpoint read whole, to be cut for this rank's layout (module docstring)."""

    def __init__(self, path: str) -> None:
        self.whole: Consolidated = consolidate_training(path)
        self.state: Dict[int, Dict[str, Any]] = {}  # id(parameter) -> its optimizer state
        self.options: Dict[int, Dict[str, Any]] = {}  # id(parameter) -> its saved group's

    @property
    def init_state(self) -> Dict[str, torch.Tensor]:
        """The whole model's weights under GPT's names (``build_model(init_state=...)``)."""
        return self.whole.model

    @property
    def extra(self) -> Dict[str, Any]:
        return self.whole.extra

    def attach(self, model: nn.Sequential, tp_rank: int, tp: int) -> None:
        """Cuts every parameter's optimizer state for ``model`` (this rank's model as built,
        before any engine: every stage, this tp rank's shards, this ep rank's experts) and
        checks the cut against the parameters."""
        gpt_name = self.whole.names  # the nn.Sequential's names -> GPT's
        known, rename = set(gpt_name), global_key(model)
        for local, p in model.named_parameters():
            name = gpt_name[_model_key(rename(local), known)]
            cut = _cut(self.whole.model[name], p.shape, tp_rank, tp, name)
            if not torch.equal(cut, p.detach()):
                raise ConfigError(
                    f"resume: {name}: the checkpoint's weights cut for tp rank {tp_rank} of "
                    f"{tp} differ from the parameter the model built from them"
                )
            # no saved state: never stepped, a fresh state as in the saving run
            saved = self.whole.optimizer.get(name, {})
            state = {
                k: _cut(v, p.shape, tp_rank, tp, f"{name} ({k})").clone()
                if isinstance(v, torch.Tensor) and v.dim()
                else v
                for k, v in saved.items()
            }
            self.state[id(p)] = {**state, "master": cut.to(torch.float32)}
            self.options[id(p)] = self.whole.options.get(name, {})

    def _attached(self, p: torch.Tensor) -> Dict[str, Any]:
        if id(p) not in self.state:
            raise ConfigError("resume: the optimizer holds a parameter the model did not have")
        return self.state[id(p)]

    def _saved_options(self, p: torch.Tensor) -> Dict[str, Any]:
        """The saving run's hyper-parameters of ``p``'s param group (its ``initial_lr``,
        betas, weight decay), applied to the group ``p`` leads in this run."""
        self._attached(p)  # a parameter the model did not have raises
        return self.options[id(p)]

    def load(self, optimizer: Any, module: nn.Module) -> None:
        """Loads the attached state into the engine's optimizer (collective under ZeRO)."""
        if hasattr(optimizer, "flat_groups"):  # dk.ShardedOptimizer
            options_of = self._saved_options
            dk_checkpoint.load_whole(optimizer, module, self._attached, options_of)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {}
        for i, p in enumerate(params):
            moments = {k: v for k, v in self._attached(p).items() if k != "master"}
            if moments:
                state[i] = moments
        groups, index = [], 0
        for group in optimizer.param_groups:
            current = {k: v for k, v in group.items() if k != "params"}
            ids = list(range(index, index + len(group["params"])))
            saved = self._saved_options(group["params"][0]) if group["params"] else {}
            groups.append({**current, **saved, "params": ids})
            index += len(ids)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
