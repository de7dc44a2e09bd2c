"""Work: the handle of an asynchronous call, shared by every communicator backend.

It lives below the backends (shared memory, hierarchical, CUDA) so each can import it without
importing the Communicator that chooses among them.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Tuple, Union

import torch

__all__ = ["Work", "DoneWork"]


class Work:
    """Handle of an asynchronous collective (``async_op=True``).

    Keeps the collective's tensors alive until it completes. :attr:`device` is the CUDA device
    whose stream the collective runs on (None on CPU): there ``wait()`` orders the caller's
    current stream after it rather than blocking the host (see ``dist_kernels.comm.cuda``).
    """

    def __init__(
        self,
        handle: Any,
        tensors: Tuple[torch.Tensor, ...],
        device: Optional[torch.device] = None,
    ) -> None:
        self._handle = handle
        self._tensors: Optional[Tuple[torch.Tensor, ...]] = tensors
        self.device = device

    def wait(self, timeout: Optional[Union[float, datetime.timedelta]] = None) -> bool:
        """Blocks until the collective has finished; raises :class:`CommError` if it failed.

        Args:
            timeout: seconds (or a timedelta) to wait at most; ``CommError`` if exceeded
                (the collective itself keeps running). None waits as long as it takes.
        """
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if self._handle is not None:
            self._handle.wait(timeout)
        self._tensors = None
        return True

    def is_completed(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._handle is None or self._handle.is_completed()

    def source_rank(self) -> int:
        """The sender of a completed receive from any source (``irecv(t)`` without ``src``),
        as torch's ``Work.source_rank()``; -1 for any other call or before it completed."""
        source_rank = getattr(self._handle, "source_rank", None)
        return source_rank() if source_rank is not None else -1


class DoneWork(Work):
    """A Work whose operation already ran synchronously (hierarchical path)."""

    def __init__(self) -> None:
        super().__init__(None, ())
