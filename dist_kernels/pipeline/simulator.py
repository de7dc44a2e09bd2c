"""Predicts a schedule's step time, bubble and activation memory from per-action times.

    >>> sim = dk.pipeline.simulate("zb-h1", 4, 8, times={"F": 1.0, "B": 1.0, "W": 1.0})
    >>> sim.step_time, sim.bubble_fraction, sim.bubble_rate, sim.peak_activations
    (27.0, 0.111..., 0.125, (4, 4, 4, 4))

The schedule runs on the checker's fake runtime (:mod:`.checker`), which executes every rank's
list the way dk.Pipeline does (sends right behind their step, receives in list order when
needed), with each compute action taking its measured time. ``times`` uses the zero-bubble
paper's letters: ``F`` forward, ``B`` the input-gradient half of a backward (torch's action
``I``), ``W`` the weight-gradient half; a full backward (action ``B`` of GPipe and 1F1B) takes
``times["BW"]`` if given, else ``B + W``. ``send`` / ``recv`` are what one transfer costs the
sender's and the receiver's thread, ``p2p`` the time from the end of a send on the sender's
thread to its message being there to receive, ``step`` a cost paid once per step outside the
schedule's actions (``Pipeline.profile()`` measures it: splitting the batch, the last sends'
wait, the loss broadcast), added to the step time and counted as bubble. Each compute time
is one number, the time of one rank's share of the model (a schedule with ``v`` stages per
rank gives each stage ``1 / v`` of it, so schedules compare at the same model), or one per
stage, as ``Pipeline.profile()`` measures them on the real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .actions import Action, Kind, Schedule
from .checker import FakeRuntime
from .schedules import build_schedule

__all__ = ["ScheduleReport", "bubble_formula", "simulate"]

TIME_KEYS = ("F", "B", "W", "BW", "send", "recv", "step")
Times = Mapping[str, Union[float, Sequence[float]]]


@dataclass(frozen=True)
class ScheduleReport:
    """What :func:`simulate` predicts for one step.

    Attributes:
        schedule: the schedule simulated.
        step_time: from the first action to the last, plus ``times["step"]``, in the units
            of ``times``.
        bubble_fraction: the idle share of ``n_ranks * step_time`` (waiting and transfers).
        bubble_rate: the paper's bubble: the largest idle time inside one rank's own span
            (its first action to its last), over that rank's compute time. (p-1)/m for 1F1B,
            (p-1)/(3m) for ZB-H1, 0 for ZB-V at F = B = W.
        peak_activations: per stage, the most micro-batches whose activations are held at
            once (from F to the B or W that frees them).
        peak_memory: per rank, the most activations it holds at once, in micro-batches of its
            whole share of the model (each of its stages counts ``1 / stages_per_rank``).
        timeline: per rank, ``(start, end, action)`` of every compute step.
    """

    schedule: Schedule
    step_time: float
    bubble_fraction: float
    bubble_rate: float
    peak_activations: Tuple[int, ...]
    peak_memory: Tuple[float, ...]
    timeline: Tuple[Tuple[Tuple[float, float, Action], ...], ...]


def simulate(
    schedule: Union[str, Schedule],
    n_stages: Optional[int] = None,
    n_microbatches: Optional[int] = None,
    *,
    times: Optional[Times] = None,
    p2p: float = 0.0,
    stages_per_rank: Optional[int] = None,
) -> ScheduleReport:
    """Runs ``schedule`` on paper; raises :class:`~.checker.ScheduleError` if it cannot run.

    Args:
        schedule: a name (then ``n_stages``, the pipeline ranks, and ``n_microbatches`` are
            required) or a built :class:`~.actions.Schedule`.
        times: per-action times (module docstring); default ``F = B = W = 1``, free transfers.
        p2p: transfer latency, from the end of a send call until it can be received.
        stages_per_rank: for a name: interleaved 1F1B's virtual stages per rank.
    """
    if isinstance(schedule, str):
        if n_stages is None or n_microbatches is None:
            raise ValueError("simulate needs n_stages and n_microbatches with a schedule name")
        schedule = build_schedule(schedule, n_stages, n_microbatches, stages_per_rank)
    per_stage = _per_stage(times or {}, schedule.n_stages, schedule.stages_per_rank)
    if p2p < 0:
        raise ValueError(f"p2p must be >= 0, got {p2p}")
    runtime = FakeRuntime(
        schedule,
        lambda a: per_stage[_TIME_OF[a.kind]][a.stage],
        send=per_stage["send"][0],
        recv=per_stage["recv"][0],
        p2p=p2p,
    ).run()
    overhead = _values("step", (times or {}).get("step", 0.0), 1, 1)[0]
    return _report(schedule, runtime, overhead)


_TIME_OF = {
    Kind.FORWARD: "F",
    Kind.BACKWARD_INPUT: "B",
    Kind.BACKWARD_WEIGHT: "W",
    Kind.BACKWARD: "BW",
}


def _per_stage(times: Times, n_stages: int, per_rank: int) -> Dict[str, List[float]]:
    """``times`` as one list per key, one value per stage (defaults filled in)."""
    unknown = sorted(set(times) - set(TIME_KEYS))
    if unknown:
        raise ValueError(f"times: unknown key(s) {unknown}; expected some of {TIME_KEYS}")
    out: Dict[str, List[float]] = {}
    for key, default in (("F", 1.0), ("B", 1.0), ("W", 1.0), ("send", 0.0), ("recv", 0.0)):
        share = per_rank if key in ("F", "B", "W") else 1
        out[key] = _values(key, times.get(key, default), n_stages, share)
    if times.get("BW") is not None:
        out["BW"] = _values("BW", times["BW"], n_stages, per_rank)
    else:
        out["BW"] = [b + w for b, w in zip(out["B"], out["W"])]
    return out


def _values(key: str, value: Union[float, Sequence[float]], n_stages: int, share: int):
    """One value per stage: a number is a rank's share, split over its ``share`` stages."""
    if isinstance(value, (int, float)):
        values = [float(value) / share] * n_stages
    else:
        values = [float(v) for v in value]
    if len(values) != n_stages:
        raise ValueError(f"times[{key!r}]: {len(values)} values for {n_stages} stages")
    if any(v < 0 for v in values):
        raise ValueError(f"times[{key!r}]: times must be >= 0, got {values}")
    return values


def _report(schedule: Schedule, runtime: FakeRuntime, overhead: float) -> ScheduleReport:
    ranks = runtime.ranks
    step = max(r.clock for r in ranks) + overhead
    busy = sum(r.busy for r in ranks)
    fraction = 1.0 - busy / (step * schedule.n_ranks) if step > 0 else 0.0
    rates = [
        (r.timeline[-1][1] - r.first - r.busy) / r.busy for r in ranks if r.timeline and r.busy > 0
    ]
    return ScheduleReport(
        schedule=schedule,
        step_time=step,
        bubble_fraction=fraction,
        bubble_rate=max(rates, default=0.0),
        peak_activations=tuple(runtime.peak_live[s] for s in range(schedule.n_stages)),
        peak_memory=tuple(runtime.peak_rank_live),
        timeline=tuple(tuple(r.timeline) for r in ranks),
    )


def bubble_formula(n_ranks: int, n_microbatches: int) -> float:
    """GPipe's and 1F1B's bubble fraction with equal stages: ``(p - 1) / (m + p - 1)``."""
    return (n_ranks - 1) / (n_microbatches + n_ranks - 1)
