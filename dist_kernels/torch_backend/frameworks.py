"""What frameworks that check backend names need: the default group made as "dk" first.

accelerate (``PartialState`` / ``InitProcessGroupKwargs(backend="dk")``) and transformers'
``TrainingArguments(ddp_backend="dk")`` accept only the backend names they know, but both use
a default process group that already exists. So make it first:

    import dist_kernels as dk
    dk.init_process_group()          # "dk", from torchrun's environment
    accelerator = Accelerator(cpu=True)

See docs/integrations.md for each framework, and its traps.
"""

from __future__ import annotations

import torch.distributed as dist

from . import BACKEND_NAME


def init_process_group(backend: str = BACKEND_NAME, **kwargs) -> dist.ProcessGroup:
    """``torch.distributed.init_process_group`` with ``"dk"`` as the backend, and no error when
    the default group already exists with that backend (a script and the framework under it
    may both ask). Returns the default group.

    Args:
        backend: as torch's (``"dk"``, ``"cpu:dk,cuda:nccl"``, or another one for comparison).
        **kwargs: torch's (``init_method``, ``rank``, ``world_size``, ``timeout``, ...);
            without them torch reads torchrun's environment (``env://``).

    Raises:
        RuntimeError: the default group exists with another backend.
    """
    if dist.is_initialized():
        current = dist.get_backend()
        if current != backend:
            raise RuntimeError(
                f"dist_kernels.init_process_group({backend!r}): the default process group "
                f"already exists with backend {current!r}; destroy it first "
                f"(torch.distributed.destroy_process_group())"
            )
        return dist.group.WORLD
    dist.init_process_group(backend=backend, **kwargs)
    return dist.group.WORLD
