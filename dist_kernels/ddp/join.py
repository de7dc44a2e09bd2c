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
    backward: every bucket (or comm hook) ...      if any rank said 1: every bucket of zeros,
      used mask, status; first time: rebuild         used mask, status, rebuild: in the same order

When every rank has joined, ``post_hook`` broadcasts parameters and buffers from the last rank
to join (the highest such rank), so every rank ends with the same model, as in torch.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.join import JoinHook

__all__ = ["DDPJoinHook"]


class DDPJoinHook(JoinHook):
    """Shadows the collectives of one DDP iteration on a rank that has joined."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)
