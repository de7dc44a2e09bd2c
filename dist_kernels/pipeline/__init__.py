"""Pipeline parallelism: schedules as data, partitioning, and the runtime that executes them.

``dk.Pipeline`` is the engine; :func:`schedule_table` prints what a schedule does before
anything runs.
"""

from .schedules import (
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleReport,
    build_schedule,
    bubble_formula,
    schedule_table,
    simulate,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleReport",
    "build_schedule",
    "bubble_formula",
    "schedule_table",
    "simulate",
]
