"""``--profile-steps A:B``: torch.profiler over optimizer steps A to B (counted from 1, as the
log counts them), with our collectives in it.

Each rank writes ``<profile_dir>/rank<r>.pt.trace.json``: torch's trace, whose
``record_param_comms`` events carry every collective's sizes and group, plus one span per
collective of the time it really ran (``dk.debug.trace_handler``); rank 0 then merges the ranks'
traces into ``<profile_dir>/merged.json`` (one process row per rank; open it in Perfetto).
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

import torch


class StepProfiler:
    """Starts the profiler before step A and stops it after step B.

    Args:
        steps: (A, B), or None for no profiling.
        directory: where the traces go.
        rank, world_size: this rank's place (rank 0 merges).
        barrier: a barrier over the world (the merge waits for every rank's trace).
    """

    def __init__(
        self,
        steps: Optional[Tuple[int, int]],
        directory: str,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
    ) -> None:
        self.steps, self.directory = steps, directory
        self.rank, self.world_size, self._barrier = rank, world_size, barrier
        self._profiler = None
        self.merged: Optional[str] = None
        if steps is not None:
            from .. import debug

            debug.prepare_profiler_events()  # compiled now, not inside a profiled step

    def step_begins(self, number: int) -> None:
        """Before the step that will be logged as ``number``."""
        if self.steps is None or number != self.steps[0]:
            return
        from .. import debug

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities, on_trace_ready=debug.trace_handler(self.directory)
        )
        self._profiler.start()

    def step_ended(self, number: int) -> None:
        """After the step logged as ``number`` (collective once the last step is reached)."""
        if self._profiler is None or number != self.steps[1]:
            return
        self._profiler.stop()  # writes this rank's trace
        self._profiler = None
        self._barrier()
        if self.rank == 0:
            from .. import debug

            paths = [
                os.path.join(self.directory, f"rank{r}.pt.trace.json")
                for r in range(self.world_size)
            ]
            self.merged = debug.merge(paths, os.path.join(self.directory, "merged.json"))
