"""What a DDP communication hook gets: the bucket, and all-reduces whose futures complete in order.

How futures complete: an all-reduce started by :func:`all_reduce_future` returns a Future that
the engine completes at the end of backward, in the order the all-reduces were issued, on the
thread that runs backward. ``then`` callbacks run there and may start further all-reduces
(PowerSGD's P and Q rounds); those join the end of the queue. Every rank therefore issues the
same collectives in the same order, which the Communicator requires; completing them from a
progress thread as soon as each finishes would let ranks interleave the next round differently.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, List, Sequence, Tuple

import torch

__all__ = ["GradBucket", "Reductions", "all_reduce_future", "average_future", "check_state"]


class GradBucket:
    """One bucket handed to a comm hook: torch's ``dist.GradBucket`` methods.

    ``buffer()`` is the flat gradient buffer (this rank's gradients, not yet divided by the
    world size; the hook divides, as torch's hooks do). It lives in the Communicator's
    registered memory, so reducing it in place costs no staging copy. Slots of the parameters
    are 16-byte aligned, so the buffer may hold a few zero padding elements between them
    (torch's has none); ``gradients()`` are views of the slots.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: Sequence[torch.Tensor],
        offsets: Sequence[int],
        is_last: bool,
        reductions: Reductions,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = list(parameters)
        self._offsets = list(offsets)
        self._is_last = is_last
        self._reductions = reductions

    def index(self) -> int:
        """Position of the bucket in the launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replaces the buffer (torch's compress wrappers hand a cast copy to the inner hook)."""
        self._buffer = buffer

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward (iteration counters tick on it)."""
        return self._is_last

    def parameters(self) -> List[torch.Tensor]:
        return list(self._parameters)

    def gradients(self) -> List[torch.Tensor]:
        """Per-parameter views of :meth:`buffer`, in the bucket's order."""
        return [
            self._buffer[offset : offset + p.numel()].view(p.shape)
            for p, offset in zip(self._parameters, self._offsets)
        ]


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

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Starts a SUM all-reduce of ``tensor`` in place; returns the Communicator's Work."""
        self.bytes += tensor.numel() * tensor.element_size()
        return self.comm.all_reduce(tensor, algorithm=self.algorithm, async_op=True)

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


def all_reduce_future(bucket: GradBucket, tensor: torch.Tensor) -> torch.futures.Future:
    """SUM all-reduce of ``tensor`` on the DDP's Communicator, as a Future of ``tensor``.

    For hooks written against this package: the counterpart of
    ``dist.all_reduce(tensor, async_op=True).get_future()`` (whose value is a list).
    """
    return bucket._reductions.future(tensor)


def check_state(state: Any, bucket: GradBucket, what: str) -> None:
    """The shipped hooks reduce over the DDP's own group: ``state`` must not say otherwise."""
    if state is None:
        return
    comm = bucket._reductions.comm
    group = getattr(comm, "group", None)
    if state is comm or state is group:
        return
    import torch.distributed as dist

    if state is dist.group.WORLD and group is dist.group.WORLD:
        return
    raise ValueError(
        f"[rank {comm.rank}] {what}: state must be None, the DDP's Communicator or its process "
        f"group (these hooks reduce over the DDP's own ranks), got {state!r}"
    )


def average_future(bucket: GradBucket, tensor: torch.Tensor) -> torch.futures.Future:
    """Divides ``tensor`` by the world size in place (first, so FP16 sums stay in range), then
    all-reduces it: the average, as a Future of ``tensor``."""
    tensor.div_(bucket._reductions.comm.world_size)
    return all_reduce_future(bucket, tensor)
