"""Straggler detection: pure logic over the per-rank times every interval gathers.

Each logging interval every rank contributes its mean busy time (step time minus exposed
communication: in synchronous training the fast ranks wait, so step times alone are equal)
and its phase times. A rank is *slow in an interval* when

    busy[rank] > median(busy) * (1 + threshold)   and   busy[rank] - median(busy) > min_ms

and it is *reported* after ``patience`` consecutive slow intervals, once per episode, with the
phase whose time exceeds that phase's median the most (where it lost time).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .metrics import PHASES


@dataclass
class StragglerReport:
    interval: int  # 1-based logging interval in which the rank was reported
    step: int
    rank: int
    host: str
    phase: str
    busy_ms: float
    median_ms: float

    def __str__(self) -> str:
        return (
            f"straggler: rank {self.rank} on {self.host} is slow at step {self.step}: "
            f"{self.busy_ms:.1f} ms busy vs median {self.median_ms:.1f} ms, most lost in "
            f"{self.phase}"
        )


class StragglerDetector:
    def __init__(self, threshold: float, min_ms: float, patience: int) -> None:
        if threshold < 0 or min_ms < 0 or patience < 1:
            raise ValueError(
                f"threshold({threshold}) and min_ms({min_ms}) must be >= 0, "
                f"patience({patience}) >= 1"
            )
        self.threshold, self.min_ms, self.patience = threshold, min_ms, patience
        self._streak: Dict[int, int] = {}
        self.intervals = 0
        self.reports: List[StragglerReport] = []

    def observe(
        self,
        step: int,
        busy_ms: Sequence[float],
        phases: Sequence[Dict[str, Optional[float]]],
        hosts: Sequence[str],
    ) -> List[StragglerReport]:
        """One interval's per-rank busy and phase times; returns the ranks reported now."""
        self.intervals += 1
        median = statistics.median(busy_ms)
        new = []
        for rank, busy in enumerate(busy_ms):
            slow = busy > median * (1 + self.threshold) and busy - median > self.min_ms
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if self._streak[rank] == self.patience:
                phase = _worst_phase(rank, phases)
                report = StragglerReport(
                    self.intervals, step, rank, hosts[rank], phase, busy, median
                )
                new.append(report)
        self.reports.extend(new)
        return new


def _worst_phase(rank: int, phases: Sequence[Dict[str, Optional[float]]]) -> str:
    """The phase (comm excluded: waiting is the victims' symptom) with the largest excess of
    ``rank`` over the median of all ranks."""
    best, excess = "unknown", float("-inf")
    for phase in PHASES:
        if phase == "comm" or any(p[phase] is None for p in phases):
            continue
        over = phases[rank][phase] - statistics.median(p[phase] for p in phases)
        if over > excess:
            best, excess = phase, over
    return best


def minmax_line(step: int, columns: Dict[str, Sequence[float]]) -> str:
    """Megatron's straggler line: per quantity, the smallest and largest rank's value and who.

    ``columns``: short name -> per-rank milliseconds, e.g. ``{"Rtt": step_ms, "Busy": busy}``
    gives ``step 10 | MnRtt/Rnk: 41.20ms/1 | MxRtt/Rnk: 43.05ms/0 | MnBusy/Rnk: ...``.
    """
    parts = [f"step {step}"]
    for name, values in columns.items():
        lo = min(range(len(values)), key=lambda r: values[r])
        hi = max(range(len(values)), key=lambda r: values[r])
        parts.append(f"Mn{name}/Rnk: {values[lo]:.2f}ms/{lo}")
        parts.append(f"Mx{name}/Rnk: {values[hi]:.2f}ms/{hi}")
    return " | ".join(parts)
