"""Measurements of a training run: phase times, the matmul peak, MFU, memory, output sinks.

Phases of one optimizer step (milliseconds, summed over its micro-batches):

    forward     model forward and loss
    backward    backward compute: until the last parameter's gradient is accumulated
    comm        exposed communication: from that moment until backward returns (the gradient
                reductions still on the wire, which overlap hid the rest of); the same hook
                measures torch DDP, so the two engines are compared on one definition
    optimizer   optimizer step, zero_grad and scheduler (ZeRO's parameter all-gather included)

``step_ms`` is the wall time of the whole step; ``busy_ms = step_ms - comm`` is what a rank
spent computing, the quantity compared between ranks to find stragglers (in synchronous
training every rank's step time is the same: the fast ranks wait in ``comm``).
"""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

PHASES = ("forward", "backward", "comm", "optimizer")


@dataclass
class StepTimes:
    """One step's phase times in ms (None: not measured by this engine, e.g. inside a pipeline)."""

    step_ms: float = 0.0
    phases: Dict[str, Optional[float]] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    grad_norm: Optional[float] = None  # the model's gradient norm before --clip-grad clipped it
    loss_scale: Optional[float] = None  # fp16: the scale this step's gradients carried
    skipped: bool = False  # fp16: the step was skipped (an inf or NaN gradient somewhere)
    nonfinite_loss: bool = False  # this rank's loss was inf or NaN: the run diverged

    def add(self, phase: str, ms: Optional[float]) -> None:
        if ms is None or self.phases[phase] is None:
            self.phases[phase] = None
        else:
            self.phases[phase] += ms

    @property
    def busy_ms(self) -> float:
        return self.step_ms - (self.phases["comm"] or 0.0)


class LastGradClock:
    """Remembers when the last parameter's gradient was accumulated during a backward.

    A post-accumulate-grad hook on every parameter stamps the time; the last stamp of a backward
    is the end of its compute, so ``backward end - stamp`` is communication the engine did not
    hide. Registered after the engine's own hooks, so it runs after them.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.stamp: Optional[float] = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for p in params if p.requires_grad
        ]

    def _hook(self, _param: torch.Tensor) -> None:
        self.stamp = time.perf_counter()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@functools.cache
def matmul_peak_flops(size: int = 512, seconds: float = 0.3) -> float:
    """FP32 FLOP/s of this process, from square matmuls repeated for about ``seconds``.

    Run on every rank at once, so ranks sharing cores measure the share they really get; once
    per process, so both engines of ``--engine both`` are held to the same peak.
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size**3 * n / elapsed


def peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU), or peak allocated CUDA memory."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


class JsonLines:
    """One JSON object per logged step (rank 0), flushed as written; ``append`` continues a
    file (a resumed run, or the second engine of ``--engine both``)."""

    def __init__(self, path: Optional[str], append: bool = False) -> None:
        self._file = open(path, "a" if append else "w") if path else None

    def write(self, record: Dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Progress:
    """A tqdm bar on rank 0 (absent elsewhere, or when disabled)."""

    def __init__(self, enabled: bool, total: int, initial: int, desc: str) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the optional extra is missing: metrics still print, per line
                print("no progress bar: pip install dist_kernels[train] for tqdm", flush=True)
                return
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", leave=True)

    def update(self, steps: int, **fields: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(steps)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def mean_or_none(values: List[Optional[float]]) -> Optional[float]:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)
