"""A reduction over whichever group a caller holds: our Communicator, a ``torch.distributed``
process group, or none (torch.distributed's world when initialised, else this process alone).
For the small bookkeeping sums the layers above make once a step (routing counts, token
counts), under our engines and torch's alike."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sum_over"]


def sum_over(tensor: torch.Tensor, comm: Any = None) -> None:
    """Sums ``tensor`` in place over ``comm``'s ranks (collective over them)."""
    import torch.distributed as dist

    if comm is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tensor)
    elif isinstance(comm, dist.ProcessGroup):
        dist.all_reduce(tensor, group=comm)
    elif comm.world_size > 1:
        comm.all_reduce(tensor, op="sum")
