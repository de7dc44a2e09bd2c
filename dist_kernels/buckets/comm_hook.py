"""DDP with a communication hook: :class:`CommHook`, the collective that hands each bucket to
``hook(state, bucket)``, and what the hook gets (:class:`GradBucket`, all-reduces on the DDP's
Communicator whose futures complete in issue order: see ``reductions.py``).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch

from . import plan
from .all_reduce import AllReduce, GradientBuckets, write_status
from .reductions import Reductions

__all__ = [
    "CommHook",
    "GradBucket",
    "Reductions",
    "all_reduce_future",
    "average_future",
    "check_state",
    "hook_name",
]


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


class CommHook(AllReduce):
    """The reducer's collective for DDP with a comm hook: each bucket goes to the hook.

    The bucket (without its status slots) holds this rank's gradients, undivided; the hook's
    Future's value (the reduced buffer) is copied back into it and unpacked into ``.grad`` as
    without a hook. The status slots travel in their own all-reduce. Futures are completed at
    the end of backward in issue order (``reductions.py``); one that does not complete within
    the communicator's timeout after all its all-reduces ran raises.
    """

    def __init__(
        self,
        buckets: GradientBuckets,
        reductions: Reductions,
        hook: Any,
        state: Any,
        *,
        debug: bool = False,
        rank: int = 0,
    ) -> None:
        super().__init__(buckets, reductions, debug=debug, rank=rank)
        self.pre_scale = 1.0  # the hook divides (torch's hooks get undivided gradients)
        self.hook, self.state = hook, state
        self._status = reductions.comm.empty((plan.STATUS_SLOTS,), torch.float32)
        self._timeout_s = _seconds(reductions.comm)

    @classmethod
    def replacing(cls, route: AllReduce, hook: Any, state: Any) -> CommHook:
        """A hook route over ``route``'s bucket memory and all-reduces (collective: the
        status buffer), to install in its place (``register_comm_hook``)."""
        return cls(route.memory, route.reductions, hook, state, debug=route.debug, rank=route.rank)

    def _start(self, b: int, group: Any) -> Tuple[torch.futures.Future, torch.Tensor]:
        """Hands bucket ``b`` (without its status slots) to the hook."""
        layout, bucket = self.memory.layouts[b], self.memory.tensors[b]
        end = layout.status_offset if layout.status_offset is not None else layout.numel
        grad_bucket = GradBucket(
            b,
            bucket[:end],
            [self.memory.params[i] for i in layout.param_indices],
            layout.offsets,
            b == len(self.memory.layouts) - 1,
            self.reductions,
        )
        future = self.hook(self.state, grad_bucket)
        if not isinstance(future, torch._C.Future):  # then() returns the C++ base class
            raise TypeError(
                f"[rank {self.rank}] DistributedDataParallel: the comm hook "
                f"{hook_name(self.hook)} returned {type(future).__name__} for bucket {b}; it "
                "must return a torch.futures.Future of the reduced buffer"
            )
        return future, bucket[:end]

    def _wait_buckets(self, handles: Dict[int, Any], status: int) -> List[float]:
        """The status all-reduce, then the hooks' futures in issue order."""
        write_status(self._status, status, self.found_inf)
        status_work = self.reductions.all_reduce(self._status)
        self._complete_futures(handles)
        status_work.wait()
        return self._status.tolist()

    def _complete_futures(self, handles: Dict[int, Any]) -> None:
        """Completes the hooks' all-reduces in issue order, then copies each result in."""
        try:
            self.reductions.drain()
        except BaseException:
            self.reductions.discard()
            raise
        deadline = time.monotonic() + self._timeout_s
        for b, (future, buffer) in handles.items():
            while not future.done():  # a torch.distributed future completes on its own
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"[rank {self.rank}] DistributedDataParallel: the comm hook "
                        f"{hook_name(self.hook)}'s Future for bucket {b} did not complete "
                        "within the communicator's timeout after all of its all-reduces ran; "
                        "the hook must complete it (e.g. from a then() callback)"
                    )
                time.sleep(1e-4)
            result = future.wait()
            if isinstance(result, (list, tuple)) and len(result) == 1:
                result = result[0]  # dist.all_reduce(...).get_future() yields a list
            self._take_result(b, result, buffer)

    def _take_result(self, b: int, result: Any, buffer: torch.Tensor) -> None:
        if not torch.is_tensor(result) or result.numel() != buffer.numel():
            got = tuple(result.shape) if torch.is_tensor(result) else type(result).__name__
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel: the comm hook "
                f"{hook_name(self.hook)}'s Future for bucket {b} holds {got}; expected a "
                f"tensor of the bucket buffer's {buffer.numel()} elements"
            )
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result.reshape(-1))


def hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _seconds(comm: Any) -> float:
    timeout = getattr(comm, "timeout", None)
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return 1800.0
