"""Rank ``src``'s parameters and buffers to every rank, as bytes through one registered buffer.

One byte-wise broadcast serves any mix of dtypes and shapes: DistributedDataParallel's
``init_sync`` at construction, the buffers before each forward, and the final model after
``join()``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch


def alloc_bytes(comm: Any, tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A registered byte buffer that holds ``tensors`` (collective); None on one rank or when
    there is nothing to send."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    if comm.world_size == 1 or total == 0:
        return None
    return comm.empty((total,), torch.uint8)


def broadcast_state(comm: Any, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Copies rank ``src``'s values of ``tensors`` to every rank: one byte-wise broadcast."""
    flat = alloc_bytes(comm, tensors)
    if flat is not None:
        broadcast_bytes(comm, flat, tensors, src)


def broadcast_bytes(
    comm: Any, flat: torch.Tensor, tensors: Sequence[torch.Tensor], src: int = 0
) -> None:
    """Rank ``src``'s bytes of ``tensors`` to every rank through one registered byte buffer."""
    views: List[Tuple[torch.Tensor, int, int]] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        views.append((t, offset, nbytes))
        offset += nbytes
    if comm.rank == src:
        for t, start, nbytes in views:
            flat[start : start + nbytes].copy_(_as_bytes(t.detach()))
    comm.broadcast(flat, src)
    if comm.rank != src:
        with torch.no_grad():
            for t, start, nbytes in views:
                _copy_bytes_into(t, flat[start : start + nbytes])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copy_bytes_into(t: torch.Tensor, data: torch.Tensor) -> None:
    if t.is_contiguous():
        t.reshape(-1).view(torch.uint8).copy_(data)
    else:
        t.copy_(data.view(t.dtype).view(t.shape))
