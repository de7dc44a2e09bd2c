"""Pipeline parallelism, in four parts that depend downward only:

``schedules``  pure: GPipe / 1F1B / interleaved 1F1B as per-rank action lists, simulated
``partition``  pure: where an ``nn.Sequential`` is cut into stages
``wire``       the tensors one step sends: shapes and dtypes agreed once, then raw buffers
``runtime``    :class:`Pipeline`, running one rank's action list on the Communicator
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
