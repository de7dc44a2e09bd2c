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

The engine's side lives here too: ``_UnevenInputs``, the mixin that gives
DistributedDataParallel ``join()``, ``join_hook()``, the per-forward buffer broadcast from the
common rank and the shadowed iteration this hook runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.join import Join, JoinHook

from ..buckets import plan
from ..dtypes import ReduceOp
from .broadcast import _broadcast_bytes
from .reducer import _BackwardPass

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


class _UnevenInputs:
    """The engine's side of ``join()`` (mixin of DistributedDataParallel: its methods use
    the engine's state directly, moved verbatim from it, as ``_Reducer`` in ``reducer.py``).
    """

    # ----------------------------------------------------------------- uneven inputs

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs across ranks (torch DDP's ``join``).

        Inside it, a rank that has run out of batches shadows the collectives of the ranks
        still training (zero gradients), so nobody hangs; on exit every rank has the
        parameters and buffers of the last rank to join. Gradients are divided by the
        initial world size (joined ranks contribute zeros), or with
        ``divide_by_initial_world_size=False`` by the number of ranks still training.
        ``throw_on_early_termination=True`` instead raises ``RuntimeError`` on every rank as
        soon as one has run out. Under ``join()`` the forward decides whether its backward
        synchronises (``set_requires_gradient_sync`` between forward and backward would
        leave joined ranks shadowing the wrong thing). See torch's
        ``torch.distributed.algorithms.Join``.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook :class:`torch.distributed.algorithms.Join` runs on a joined rank."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        """The torch process group of the Communicator (Join counts active ranks on it)."""
        return getattr(self.comm, "group", None)

    def _sync_buffers(self, active: bool) -> None:
        """Broadcasts buffers before a forward: from rank 0, or under join() from the highest
        rank still training (a joined rank's buffers stopped updating), as torch does."""
        if not self.broadcast_buffers or self._buffer_flat is None:
            return
        src = self._common_rank(active) if self._join_config.enable else 0
        _broadcast_bytes(self.comm, self._buffer_flat, self._module_buffers, src)

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank for which ``candidate`` holds (every rank calls this)."""
        mine = torch.tensor([float(self.rank if candidate else -1)], device=self._device)
        self.comm.all_reduce(mine, op=ReduceOp.MAX)
        return int(mine.item())

    def _join_flag(self, mine: bool) -> bool:
        """Whether any rank said True (every rank calls this)."""
        if self._local:
            return mine
        flag = torch.tensor([float(mine)], device=self._device)
        self.comm.all_reduce(flag)
        return bool(flag.item() > 0)

    def _shadow_iteration(self) -> None:
        """A joined rank: the collectives of one iteration of the others, in their order."""
        self._abandon_if_stale()
        self._sync_buffers(active=False)
        if not self._join_flag(False) or self._local:
            return
        state = _BackwardPass(self._layouts, len(self._params), self._device)
        state.shadow = True
        self._pass = state
        try:
            self._launch_from(state, plan.STATUS_OK)
            self._wait_reductions(state)
            if not self._rebuilt:
                self._rebuild([])
        finally:
            self._pass = None

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After join: parameters and buffers from the last rank to join, on every rank."""
        if self._local:
            return
        src = self._common_rank(is_last_joiner)
        tensors = list(self.module.parameters()) + self._module_buffers
        flat = self._alloc_bytes(tensors)
        if flat is not None:
            _broadcast_bytes(self.comm, flat, tensors, src)

    def _rescale_for_joined(self) -> None:
        """``divide_by_initial_world_size=False``: the average over the active ranks only."""
        work, self._join_work = self._join_work, None
        if work is None:
            return
        work.wait()
        active = float(work.result()[0].item())
        if active < self.world_size:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.world_size / active)
