"""Pipeline parallelism: schedules as data, partitioning, and the runtime that executes them.

``dk.Pipeline`` is the engine; :func:`schedule_table` prints what a schedule does before
anything runs::

    >>> print(dk.pipeline.schedule_table("1f1b", 2, 3))
    1f1b: 2 ranks, 2 stages, 3 micro-batches; bubble 25.0%, peak live activations 2
    rank 0 | F0 F1 .  B0 F2 B1 .  B2
    rank 1 | .  F0 B0 F1 B1 F2 B2 .
"""

from .partition import StageSpan, format_partition, plan_partition
from .runtime import Pipeline, PipelineError
from .schedules import (
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleReport,
    bubble_formula,
    build_schedule,
    schedule_table,
    simulate,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Pipeline",
    "PipelineError",
    "Schedule",
    "ScheduleError",
    "ScheduleReport",
    "StageSpan",
    "bubble_formula",
    "build_schedule",
    "format_partition",
    "plan_partition",
    "schedule_table",
    "simulate",
]
