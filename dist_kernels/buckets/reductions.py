"""Reductions: the all-reduces one DDP engine issues, counted, with hook futures completed in order.

How futures complete: an all-reduce started by :meth:`Reductions.future` (what a comm hook's
``all_reduce_future`` calls) returns a Future that the engine completes at the end of backward,
in the order the all-reduces were issued, on the thread that runs backward. ``then`` callbacks
run there and may start further all-reduces (PowerSGD's P and Q rounds); those join the end of
the queue. Every rank therefore issues the same collectives in the same order, which the
Communicator requires; completing them from a progress thread as soon as each finishes would
let ranks interleave the next round differently.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Tuple

import torch

__all__ = ["Reductions"]


class Reductions:
    """All-reduces issued by one DDP engine; hook futures completed in issue order.

    Also counts the payload bytes this rank hands to all-reduces (``bytes``): what a step
    costs on the wire before the algorithm's factor (a ring sends ``2 (n-1) / n`` of it).
    """

    def __init__(self, comm: Any, algorithm: str) -> None:
        self.comm = comm
        self.algorithm = algorithm
        self.bytes = 0
        self._queue: Deque[Tuple[Any, torch.futures.Future, torch.Tensor]] = collections.deque()
        self._scratch: dict = {}

    def all_reduce(self, tensor: torch.Tensor, comm: Any = None) -> Any:
        """Starts a SUM all-reduce of ``tensor`` in place (on ``comm``, default the engine's);
        returns the Communicator's Work."""
        self.bytes += tensor.numel() * tensor.element_size()
        comm = self.comm if comm is None else comm
        return comm.all_reduce(tensor, algorithm=self.algorithm, async_op=True)

    def future(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Starts a SUM all-reduce; the Future (value: ``tensor``) completes in :meth:`drain`."""
        work = self.all_reduce(tensor)
        future: torch.futures.Future = torch.futures.Future()
        self._queue.append((work, future, tensor))
        return future

    def drain(self) -> None:
        """Completes every queued future in issue order, including ones its callbacks add."""
        while self._queue:
            work, future, tensor = self._queue.popleft()
            work.wait()
            future.set_result(tensor)

    def discard(self) -> None:
        """Waits for queued all-reduces without completing their futures (an error path)."""
        while self._queue:
            self._queue.popleft()[0].wait()

    def scratch(self, key: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A registered buffer kept per ``key`` (e.g. a bucket's compressed copy)."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._scratch[key] = self.comm.empty((numel,), dtype)
        return buf
