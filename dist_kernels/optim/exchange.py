"""The collectives an optimizer needs across its replicas and shards, on our Communicator or
a ``torch.distributed`` process group alike (a torch DDP script passes ``dist.group.WORLD``):
one all_gather that shares each rank's own tensors with every rank, a tensor-parallel
matrix's shards joined, and the adapter that lets a process group stand for a Communicator.
Muon (:mod:`.muon`) deals matrices over ranks and exchanges their results through these."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["as_comm", "gather_along", "share", "size_rank"]


def share(comm: Any, values: List[Optional[torch.Tensor]], owners: List[int], dtype, shapes=None):
    """One all_gather over ``comm``: each rank's own ``values`` (those it owns, in order),
    packed and padded to the largest rank's total; on return ``values`` holds every rank's
    (the others' as views of the received buffer). ``shapes``: the values' shapes (default:
    the owned values' own, which every rank then must hold: AdamW's parameters)."""
    size, rank = size_rank(comm)
    shapes = shapes or [v.shape for v in values]
    numel = [0] * size
    for shape, o in zip(shapes, owners):
        numel[o] += math.prod(shape)
    width = max(numel)
    send = torch.zeros(width, dtype=dtype)
    offset = 0
    for value, o in zip(values, owners):
        if o == rank:
            n = value.numel()
            send[offset : offset + n].copy_(value.reshape(-1))
            offset += n
    received = torch.empty(size * width, dtype=dtype)
    comm.all_gather(received, send)
    offsets = [r * width for r in range(size)]
    for i, (shape, o) in enumerate(zip(shapes, owners)):
        n = math.prod(shape)
        if o != rank:
            values[i] = received[offsets[o] : offsets[o] + n].view(shape)
        offsets[o] += n


class _TorchGroup:
    """A ``torch.distributed`` process group seen as the two collectives Muon calls (a torch
    DDP script's group: gloo, NCCL, or our ``"dk"`` backend)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group, self._dist = group, dist
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._dist.all_gather_into_tensor(output, input, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._dist.broadcast(
            tensor, src=self._dist.get_global_rank(self.group, src), group=self.group
        )


def as_comm(comm: Any) -> Any:
    """Our Communicator as it is; a torch ProcessGroup (or ``torch.distributed.group.WORLD``)
    through :class:`_TorchGroup`."""
    import torch.distributed as dist

    if comm is not None and isinstance(comm, dist.ProcessGroup):
        return _TorchGroup(comm)
    return comm


def size_rank(comm: Any) -> Tuple[int, int]:
    return (1, 0) if comm is None else (comm.world_size, comm.rank)


def gather_along(comm: Any, shard: torch.Tensor, dim: int) -> torch.Tensor:
    """The tp group's shards of a matrix joined along ``dim``, in tp-rank order."""
    size = comm.world_size
    whole = torch.empty((size, *shard.shape), dtype=shard.dtype)
    comm.all_gather(whole, shard.contiguous())
    if dim == 0:
        return whole.reshape(size * shard.shape[0], shard.shape[1])
    return whole.permute(1, 0, 2).reshape(shard.shape[0], size * shard.shape[1])
