"""What the kernel benchmarks share (bench_kernels.py and bench_bucket.py): a table row of our
kernel against its torch baseline on the same bytes, and interleaved median timing."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Iterable, List, Optional, Sequence

import torch


@dataclasses.dataclass
class Row:
    """One benchmark line: our kernel and its torch baseline on the same bytes."""

    section: str
    case: str
    size_bytes: int  # bytes of one operand buffer (the FP32 source for casts)
    moved_bytes: int  # bytes read + written per call, charged to both columns
    ours_s: float  # median seconds per call
    baseline: str
    baseline_s: Optional[float]

    @property
    def ours_gbps(self) -> float:
        return self.moved_bytes / self.ours_s / 1e9

    @property
    def baseline_gbps(self) -> Optional[float]:
        return None if self.baseline_s is None else self.moved_bytes / self.baseline_s / 1e9

    @property
    def ratio(self) -> Optional[float]:
        return None if self.baseline_s is None else self.baseline_s / self.ours_s


Section = Callable[[str, Sequence[int], int], Iterable[Row]]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def time_calls(fns: Sequence[Callable[[], object]], device: str, repeats: int) -> List[float]:
    """Median seconds per call of each fn, after two warm-up calls each (CUDA: event-timed).

    The functions take turns in blocks (a a a, b b b, a a a, ...) so that on a shared machine
    both see the same load. Each block starts with one untimed call: right after a parallel
    torch op, torch's OpenMP workers keep spinning for a while and would steal the other core
    from whichever function is timed next (measured: our 64 MiB pooled sum drops from ~50 to
    ~25 GB/s when it strictly alternates with torch's add_).
    """
    for fn in fns:
        for _ in range(2):
            fn()
    _synchronize(device)
    times: List[List[float]] = [[] for _ in fns]
    block = 3
    for _ in range(max(1, -(-repeats // block))):
        for fn, samples in zip(fns, times):
            fn()
            _synchronize(device)
            samples.extend(_time_once(fn, device) for _ in range(block))
    return [statistics.median(samples) for samples in times]
