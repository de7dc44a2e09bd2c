"""Desync guard (``DK_DEBUG=1``): inputs a tensor-parallel layer needs replicated, compared.

A layer such as ``ColumnParallelLinear`` multiplies its input by this rank's shard of the
weight: fed a different input on each tensor-parallel rank, it returns a silently wrong
answer. Under ``DK_DEBUG=1`` every such input is fingerprinted (a CRC of its bytes, shape and
dtype), the fingerprints are all-gathered over the group, and a mismatch raises on every
rank at once, naming the layer and the ranks that differ. Off by default: it costs one small
all-gather per layer call and a pass over the input.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

__all__ = ["TensorParallelDesyncError", "check_replicated", "debug_enabled"]


class TensorParallelDesyncError(RuntimeError):
    """Ranks of one tensor-parallel group were fed different inputs that must be equal."""


def debug_enabled() -> bool:
    """True under ``DK_DEBUG=1`` (read at every call, so tests may toggle it)."""
    return os.environ.get("DK_DEBUG", "0") not in ("", "0")


def _fingerprint(x: torch.Tensor) -> int:
    data = x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    header = f"{tuple(x.shape)}:{x.dtype}".encode()
    return zlib.crc32(data.tobytes(), zlib.crc32(header))


def check_replicated(x: torch.Tensor, comm: Any, where: str) -> None:
    """Raises :class:`TensorParallelDesyncError` if ``x`` differs between ranks of ``comm``.

    Does nothing unless ``DK_DEBUG=1``. Collective over ``comm`` when enabled.
    """
    if not debug_enabled() or comm is None or comm.world_size == 1:
        return
    mine = torch.tensor([_fingerprint(x)], dtype=torch.int64, device=x.device)
    every = torch.empty(comm.world_size, dtype=torch.int64, device=x.device)
    comm.all_gather(every, mine)
    prints = every.tolist()
    if len(set(prints)) == 1:
        return
    differ = [r for r, f in enumerate(prints) if f != prints[0]]
    raise TensorParallelDesyncError(
        f"[rank {comm.rank}] {where}: tensor-parallel ranks were fed different inputs, but this "
        f"layer needs the same input (shape {tuple(x.shape)}, {x.dtype}) on every rank of its "
        f"tp group; tp ranks {differ} differ from tp rank 0 (DK_DEBUG fingerprints {prints})"
    )
