"""``schedule_table``: a schedule drawn as a per-rank grid of compute steps in time."""

from __future__ import annotations

from typing import Optional, Union

from .actions import Schedule
from .schedules import build_schedule
from .simulator import simulate

__all__ = ["schedule_table"]


def schedule_table(
    schedule: Union[str, Schedule],
    n_stages: Optional[int] = None,
    n_microbatches: Optional[int] = None,
    *,
    stages_per_rank: Optional[int] = None,
) -> str:
    """A printable per-rank grid of compute steps in time (``.`` = idle), plus the measures.

    ``schedule`` is a name (then ``n_stages`` = pipeline ranks and ``n_microbatches`` are
    required) or a built :class:`~.actions.Schedule`. Time slots are the paper's equal times:
    one per F, I or W, two per full backward B (drawn ``B0 --``). With several stages per rank
    labels lead with the stage (``2F3`` = stage 2, forward, micro-batch 3)::

        1f1b: 2 ranks, 2 stages, 3 micro-batches; step 12, bubble 25.0% (rate 0.33), ...
        rank 0 | F0 F1 .  .  B0 -- F2 B1 -- .  B2 --
        rank 1 | .  F0 B0 -- F1 B1 -- F2 B2 -- .  .
    """
    if isinstance(schedule, str):
        if n_stages is None or n_microbatches is None:
            raise ValueError("schedule_table needs n_stages and n_microbatches with a name")
        schedule = build_schedule(schedule, n_stages, n_microbatches, stages_per_rank)
    slot = [1.0] * schedule.n_stages  # one slot per stage's action, whatever the stage's size
    report = simulate(schedule, times={"F": slot, "B": slot, "W": slot})
    show = schedule.stages_per_rank > 1
    width = max(len(a.label(show)) for acts in schedule.actions for a in acts if a.kind.is_compute)
    rows = []
    for rank, steps in enumerate(report.timeline):
        cells = ["."] * int(round(report.step_time))
        for start, end, action in steps:
            first, last = int(round(start)), int(round(end))
            cells[first] = action.label(show)
            for slot in range(first + 1, last):
                cells[slot] = "-" * width
        rows.append(f"rank {rank} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    head = (
        f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_stages} stages, "
        f"{schedule.n_microbatches} micro-batches; step {report.step_time:g}, bubble "
        f"{100 * report.bubble_fraction:.1f}% (rate {report.bubble_rate:.2f}), peak activations "
        f"{max(report.peak_activations)}"
    )
    return "\n".join([head, *rows])
