"""Chunks through stages, overlapped: the issue order every rank follows (pure) and its runner.

A hierarchical collective cuts a large message into K chunks, and each chunk passes S stages
(say: reduce-scatter on the host, all-reduce across hosts, all-gather on the host). Stage s of
chunk k may start once stage s-1 of chunk k has finished; stages on one engine run in the
order they were started. The runner starts them in *wavefront* order, the same on every rank,
so that each engine sees the same sequence on every rank and the host and network stages of
neighbouring chunks overlap::

    K = 4, S = 3 (t: wave; within a wave the earliest stage first)

    t=0  (0,0)
    t=1  (1,0)  wait (0,0) -> (0,1)
    t=2  (2,0)  wait (1,0) -> (1,1)  wait (0,1) -> (0,2)
    t=3  (3,0)  wait (2,0) -> (2,1)  wait (1,1) -> (1,2)
    t=4         wait (3,0) -> (3,1)  wait (2,1) -> (2,2)
    t=5                              wait (3,1) -> (3,2)

    host engine order:  (0,0) (1,0) (2,0) (0,2) (3,0) (1,2) (2,2) (3,2)   same on every rank
    network order:      (0,1) (1,1) (2,1) (3,1)

A rank only ever waits for a stage it started earlier in this fixed order, and its peers start
the same stages at the same points of the order, so the waits cannot form a cycle.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

#: A stage: starts its step and returns a handle with ``wait(timeout)``, or None when it ran
#: synchronously (or had nothing to do on this rank).
Stage = Callable[[], Optional[object]]


def wavefront(chunks: int, stages: int) -> Iterator[Tuple[int, int]]:
    """``(chunk, stage)`` pairs in the order they are started (see the picture above)."""
    for wave in range(chunks + stages - 1):
        for stage in range(stages):
            chunk = wave - stage
            if 0 <= chunk < chunks:
                yield chunk, stage


def run_stages(plan: Sequence[Sequence[Stage]], timeout: Optional[float] = None) -> None:
    """Runs ``plan[k][s]`` (chunk k, stage s) in wavefront order; every chunk has as many
    stages. Raises the first failure of a wait (later handles are left to the caller's
    abort)."""
    if not plan:
        return
    width = len(plan[0])
    if any(len(chunk) != width for chunk in plan):
        raise ValueError("run_stages: every chunk needs the same number of stages")
    started: Dict[Tuple[int, int], Optional[object]] = {}
    for chunk, stage in wavefront(len(plan), width):
        if stage:
            _wait(started.pop((chunk, stage - 1)), timeout)
        started[(chunk, stage)] = plan[chunk][stage]()
    for key in sorted(started, key=lambda cs: (cs[1], cs[0])):
        _wait(started[key], timeout)


def _wait(handle: Optional[object], timeout: Optional[float]) -> None:
    if handle is not None:
        handle.wait(timeout)
