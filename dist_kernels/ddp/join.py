"""Uneven inputs for dk.DDP through torch's Join protocol (``torch.distributed.algorithms.Join``).

``with model.join(): for batch in my_batches: ...`` lets ranks with fewer batches finish early:
torch's ``Join`` context manager, on a rank that has run out of batches, runs the engine's
:class:`DDPJoinHook` once per iteration of the others, so the joined rank issues the same
collectives as they do (with zero gradients) instead of leaving them waiting::

    non-joined rank, one iteration                 joined rank (main_hook), same iteration
    ------------------------------------           ---------------------------------------
    Join: all-reduce 1 (gloo, torch's)             Join: all-reduce 0 -> some rank is active
    buffers: common rank, broadcast (if any)       the same, contributing rank -1
    "a synchronised backward follows": 1 / 0       the same, contributing 0
    backward: every bucket (or comm hook) ...      if any rank said 1: the reducer's shadow
      used mask, status; first time: rebuild         pass (every bucket of zeros, used mask,
                                                     status, rebuild): in the same order

When every rank has joined, ``post_hook`` broadcasts parameters and buffers from the last rank
to join (the highest such rank), so every rank ends with the same model, as in torch.

:class:`UnevenInputs` is the engine's part for it (``ddp._uneven``): the per-forward buffer
broadcast (from the common rank under ``join()``), the "synchronised backward follows" flag,
the shadow iteration through the engine's bucket reducer, and the final model. It holds what it
needs (communicator, module, reducer, the backward side) and reads nothing of the engine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from ..buckets import plan
from ..dtypes import ReduceOp
from .broadcast import alloc_bytes, broadcast_bytes

__all__ = ["DDPJoinHook", "UnevenInputs"]


class UnevenInputs:
    """DDP's side of uneven inputs (module docstring).

    Args:
        comm: the engine's Communicator.
        module: the wrapped module (its buffers, and parameters for the final model).
        reducer: the engine's bucket reducer (a joined rank's shadow pass).
        backward: the engine's backward side (a stale pass, whether unused parameters are
            reduced).
        broadcast_buffers: broadcast buffers before every forward (torch's option).
    """

    def __init__(
        self,
        comm: Any,
        module: torch.nn.Module,
        reducer: Any,
        backward: Any,
        broadcast_buffers: bool,
    ) -> None:
        self._comm = comm
        self._module = module
        self._reducer = reducer
        self._backward = backward
        self.device = torch.device(getattr(comm, "device", "cpu"))
        self.broadcast_buffers = broadcast_buffers
        self.buffers = [b for _, b in module.named_buffers()]
        self._buffer_flat = alloc_bytes(comm, self.buffers)
        #: Set by the join hook: False divides by the ranks still training.
        self.divide_by_initial_world_size = True

    def sync_buffers(self, active: bool, under_join: bool) -> None:
        """Broadcasts buffers before a forward: from rank 0, or under join() from the highest
        rank still training (a joined rank's buffers stopped updating), as torch does."""
        if not self.broadcast_buffers or self._buffer_flat is None:
            return
        src = self._common_rank(active) if under_join else 0
        broadcast_bytes(self._comm, self._buffer_flat, self.buffers, src)

    def flag(self, mine: bool) -> bool:
        """Whether any rank said True (every rank calls this)."""
        if self._comm.world_size == 1:
            return mine
        flag = torch.tensor([float(mine)], device=self.device)
        self._comm.all_reduce(flag)
        return bool(flag.item() > 0)

    def shadow_iteration(self) -> None:
        """A joined rank: the collectives of one iteration of the others, in their order."""
        self._backward.abandon_if_stale()
        self.sync_buffers(active=False, under_join=True)
        if not self.flag(False) or self._comm.world_size == 1:
            return
        self._reducer.begin(shadow=True)
        try:
            self._reducer.launch_rest(plan.STATUS_OK)
            self._reducer.wait(used_mask=self._backward.allow_unused)
        finally:
            self._reducer.end()
        self._reducer.rebuild([])

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """After join: parameters and buffers from the last rank to join, on every rank."""
        if self._comm.world_size == 1:
            return
        src = self._common_rank(is_last_joiner)
        tensors = list(self._module.parameters()) + self.buffers
        flat = alloc_bytes(self._comm, tensors)
        if flat is not None:
            broadcast_bytes(self._comm, flat, tensors, src)

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank for which ``candidate`` holds (every rank calls this)."""
        mine = torch.tensor([float(self._comm.rank if candidate else -1)], device=self.device)
        self._comm.all_reduce(mine, op=ReduceOp.MAX)
        return int(mine.item())


class DDPJoinHook(JoinHook):
    """Shadows the collectives of one DDP iteration on a rank that has joined."""

    def __init__(self, uneven: UnevenInputs, divide_by_initial_world_size: bool) -> None:
        self._uneven = uneven
        uneven.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self._uneven.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._uneven.sync_final_model(is_last_joiner)
