"""Stopping a run on purpose before ``--steps``: on SIGTERM (``--exit-signal-handler``) or after
a wall-clock budget (``--exit-duration-in-mins``), both Megatron's flags.

A batch scheduler (SLURM, Kubernetes) sends SIGTERM some seconds before it kills a job; torchrun
forwards it to its workers, and ``python -m dist_kernels.train`` to its local ranks. The
handler only notes the signal: the rank finishes its step. After every step the ranks agree
(one all-gather of a flag) whether any rank was signalled or rank 0's clock ran past the
budget, so all of them stop after the same step; the driver then writes a checkpoint (with
``--checkpoint-dir``) and returns normally, and ``--resume auto`` continues from it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

import torch

from .config import TrainConfig

_SIGNALLED, _OUT_OF_TIME = 1, 2


class ExitWatch:
    """Whether the run stops after this step (:meth:`reason`, collective when enabled)."""

    def __init__(self, cfg: TrainConfig, world: Any) -> None:
        self.cfg, self.world = cfg, world
        self.enabled = bool(cfg.exit_signal_handler or cfg.exit_duration_in_mins)
        self.start = time.monotonic()
        self.signalled = False
        self._previous = None
        if cfg.exit_signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True  # acted on after the step, by every rank at once

    def after_step(self, done: int) -> Optional[str]:
        """``"SIGTERM"`` or ``"--exit-duration-in-mins M"`` when the ranks stop after step
        ``done``, else None. Collective over the world when a flag is set."""
        fault = self.cfg.signal_after  # the tests' SIGTERM, sent by this rank to itself
        if fault is not None and fault == (self.world.rank, done):
            os.kill(os.getpid(), signal.SIGTERM)
        if not self.enabled:
            return None
        flags = _SIGNALLED if self.signalled else 0
        minutes = self.cfg.exit_duration_in_mins
        if minutes and self.world.rank == 0 and time.monotonic() - self.start > 60 * minutes:
            flags |= _OUT_OF_TIME  # rank 0's clock alone: the ranks' clocks may disagree
        every = 0
        for row in self.world.gather(torch.tensor([flags], dtype=torch.int64)).flatten():
            every |= int(row)
        if every & _SIGNALLED:
            return "SIGTERM"
        if every & _OUT_OF_TIME:
            return f"--exit-duration-in-mins {minutes:g}"
        return None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
