"""What every communicator is: :class:`BaseCommunicator`, the base of the CPU
:class:`~dist_kernels.Communicator` and of :class:`~dist_kernels.comm.cuda.CudaCommunicator`.

``dist_kernels.Communicator(device=...)`` returns one or the other; code that takes either
checks ``isinstance(comm, BaseCommunicator)``. The base holds what the two share: the checks of
peers, reduce ops and algorithm names (one table, :mod:`.algorithms`), the context manager, and
the interpreter-exit hook that closes communicators left open.
"""

from __future__ import annotations

import abc
import atexit
import datetime
import weakref
from typing import Any, Dict, Optional, Sequence, Union

import torch

from ..dtypes import ReduceOp, ReduceOpLike, reduce_op
from . import algorithms

__all__ = ["BaseCommunicator"]


class BaseCommunicator(abc.ABC):
    """Collectives among ``world_size`` ranks on one device type.

    Subclasses set :attr:`device_type` ("cpu" or "cuda": their column of the algorithm table)
    and, in ``__init__``, ``rank``, ``world_size``, ``device`` and ``timeout``, then call
    :meth:`_track_open`.
    """

    device_type: str
    rank: int
    world_size: int
    device: torch.device
    timeout: datetime.timedelta

    # -- the collectives --------------------------------------------------------------------

    @abc.abstractmethod
    def all_reduce(self, tensor, op: ReduceOpLike = ReduceOp.SUM, algorithm="auto", async_op=False):
        """Reduces ``tensor`` over all ranks, in place; every rank gets identical bits."""

    @abc.abstractmethod
    def reduce_scatter(self, output, input, op=ReduceOp.SUM, algorithm="auto", async_op=False):
        """``output`` = this rank's chunk of the reduction of ``input`` over ranks."""

    @abc.abstractmethod
    def all_gather(self, output, input, async_op=False, *, algorithm="auto"):
        """``output`` = every rank's ``input`` in rank order."""

    @abc.abstractmethod
    def broadcast(self, tensor, src: int, async_op=False):
        """Copies ``tensor`` of rank ``src`` into ``tensor`` on every rank."""

    @abc.abstractmethod
    def send(self, tensor, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst`` (``tag``: torch's; CUDA ignores it, as NCCL)."""

    @abc.abstractmethod
    def recv(self, tensor, src: int, tag: int = 0) -> None:
        """Receives into ``tensor`` what rank ``src`` sends with ``tag``."""

    @abc.abstractmethod
    def isend(self, tensor, dst: int, tag: int = 0):
        """Asynchronous :meth:`send`; returns a Work."""

    @abc.abstractmethod
    def irecv(self, tensor, src: int, tag: int = 0):
        """Asynchronous :meth:`recv`; returns a Work."""

    @abc.abstractmethod
    def barrier(self, async_op=False):
        """Returns once every rank has entered the barrier."""

    @abc.abstractmethod
    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32):
        """A tensor in memory the communicator reaches fastest (collective on CPU)."""

    # -- lifecycle --------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True after :meth:`close` (or an abort)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Waits for outstanding work, then releases everything."""

    @abc.abstractmethod
    def _close_at_exit(self) -> None:
        """What the interpreter's exit does to this communicator if it is still open."""

    def _track_open(self) -> None:
        _open_communicators.add(self)

    def __enter__(self) -> BaseCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, {state})"
        )

    # -- checks shared by both devices (on the calling rank, before anything is sent) --------

    def _check_peer(self, peer: Any, arg: str, what: str, allow_self: bool = True) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"[rank {self.rank}] {what}: {arg} must be an int, got {peer!r}")
        if not 0 <= peer < self.world_size or (not allow_self and peer == self.rank):
            raise ValueError(
                f"[rank {self.rank}] {what}: {arg}={peer} is out of range for "
                f"world_size {self.world_size}"
                + ("" if allow_self else " (and must not be this rank)")
            )
        return peer

    def _check_tag(self, tag: Any, what: str) -> int:
        """torch's point-to-point tag: an int that fits the message header's 32 bits."""
        if not isinstance(tag, int) or isinstance(tag, bool):
            raise TypeError(f"[rank {self.rank}] {what}: tag must be an int, got {tag!r}")
        if not -(2**31) <= tag < 2**31:
            raise ValueError(
                f"[rank {self.rank}] {what}: tag={tag} does not fit in 32 bits "
                f"(-2**31 <= tag < 2**31)"
            )
        return tag

    def _op(self, op: ReduceOpLike, what: str) -> ReduceOp:
        if type(op) is ReduceOp:
            return op
        try:
            return reduce_op(op)
        except ValueError as e:
            raise ValueError(f"[rank {self.rank}] {what}: {e}") from None

    def _algorithm(self, collective: str, algorithm: object) -> int:
        """The C++ code of ``algorithm`` for ``collective`` on this device; ValueError else."""
        return algorithms.algorithm_code(self.device_type, collective, algorithm, self.rank)

    def algorithm_runs(self, collective: str) -> Optional[Dict[str, str]]:
        """What each name ``collective``'s ``algorithm`` accepts runs here (None: it takes no
        algorithm). "auto" is the communicator's own choice unless it always runs one thing
        (see :meth:`_auto_runs`)."""
        accepted = algorithms.ACCEPTED[self.device_type].get(collective)
        if accepted is None:
            return None
        runs = {name: name for name in accepted}
        runs["auto"] = self._auto_runs(collective)
        return runs

    def _auto_runs(self, collective: str) -> str:
        """The algorithm "auto" runs for ``collective``, or "auto" when it depends on the call."""
        return "auto"


# Open communicators: at interpreter exit (a KeyboardInterrupt that reached the top, say) each
# is closed the way its device needs (_close_at_exit): a CPU one is failed, not drained, so a
# queued call waiting for a peer cannot hold the exit up until its timeout and the peers learn
# at once that this rank is gone; a CUDA one is closed, or aborted if its stream is still busy.
_open_communicators: weakref.WeakSet[BaseCommunicator] = weakref.WeakSet()


@atexit.register
def _close_open_communicators() -> None:
    for comm in list(_open_communicators):
        if not comm.closed:
            comm._close_at_exit()
