"""Pipeline parallelism, in parts that depend downward only:

``actions``    pure: Action, Kind, Schedule: a schedule as per-rank action lists
``orders``     pure: each schedule's compute steps per rank (GPipe, 1F1B, interleaved 1F1B,
               ZB-H1, ZB-H2, ZB-V, DualPipeV)
``schedules``  pure: the transfers placed between them; ``build_schedule``
``checker``    pure: the fake runtime that runs any schedule and rejects what cannot run
``simulator``  pure: step time, bubble and memory predicted from per-action times
``table``      pure: ``schedule_table``, a schedule drawn as a time grid
``partition``  pure: where an ``nn.Sequential`` is cut into stages
``wire``       the tensors one step sends: shapes and dtypes agreed once, then raw buffers
``split``      one stage's backward as an input-gradient half and a weight-gradient half
``profiling``  what ``Pipeline.profile()`` measures for the simulator
``validation`` the optimizer step checked after it starts, rolled back if the check fails
``runtime``    :class:`Pipeline`, running one rank's action list on the Communicator

``python -m dist_kernels.pipeline`` prints the simulator's table for 4 to 64 stages.
"""

from .actions import Action, Kind, Schedule
from .checker import ScheduleError, check_schedule
from .partition import StageSpan, format_partition, plan_partition
from .runtime import Pipeline, PipelineError
from .schedules import SCHEDULES, build_schedule
from .simulator import ScheduleReport, bubble_formula, simulate
from .table import schedule_table
from .validation import ValidatedOptimizer

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
    "ValidatedOptimizer",
    "bubble_formula",
    "build_schedule",
    "check_schedule",
    "format_partition",
    "plan_partition",
    "schedule_table",
    "simulate",
]
