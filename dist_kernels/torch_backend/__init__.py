"""The ``"dk"`` torch.distributed backend: torch DDP, FSDP2, DTensor and functional collectives
on dist_kernels' collectives.

    import dist_kernels                       # registers "dk" (nothing compiled is loaded)
    torch.distributed.init_process_group("dk")
    torch.distributed.init_process_group("cpu:dk,cuda:nccl")   # CPU tensors here, CUDA to NCCL

Registering is cheap: the extension loads when the first "dk" group is created (its creator
builds a :class:`~dist_kernels.Communicator` from the Store, rank and size torch hands it).
See docs/torch_backend.md for what is supported and how it differs from gloo.
"""

from __future__ import annotations

BACKEND_NAME = "dk"
DEVICES = ("cpu", "cuda")

__all__ = ["BACKEND_NAME", "register"]


def register() -> None:
    """Registers ``"dk"`` with ``torch.distributed.Backend`` (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=list(DEVICES))


def _create(common_opts, backend_opts):
    """torch's creator hook: called by ``_new_process_group_helper`` for every "dk" group."""
    from .process_group import create_process_group

    return create_process_group(common_opts)
