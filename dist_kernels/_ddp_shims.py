"""Stand-ins used by the DDP engine while the Communicator and bucket kernels are not built.

Temporary: each function here has the signature the engine expects from
``dist_kernels.communicator`` / ``dist_kernels.bucketing`` and is deleted when those land.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


class TorchDistComm:
    """The Communicator API the engine uses, over a torch.distributed process group."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, t, op=None, algorithm="auto", async_op=False):
        work = dist.all_reduce(t, group=self.group, async_op=True)
        average = op is not None and int(op) == 4  # ReduceOp.AVG: gloo lacks it
        done = _Averaged(work, t, self.world_size if average else 1)
        return done if async_op else done.wait()

    def broadcast(self, t, src, async_op=False):
        return dist.broadcast(t, src, group=self.group, async_op=async_op)

    def all_gather(self, out, inp, async_op=False):
        return dist.all_gather_into_tensor(out, inp, group=self.group, async_op=async_op)

    def barrier(self):
        dist.barrier(group=self.group)

    def empty(self, shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype)


class _Averaged:
    """Work whose wait() divides the summed tensor by the number of ranks."""

    def __init__(self, work, tensor, divisor: int) -> None:
        self.work, self.tensor, self.divisor = work, tensor, divisor

    def wait(self):
        self.work.wait()
        if self.divisor != 1:
            self.tensor.div_(self.divisor)
            self.divisor = 1


def pack(
    grads: Sequence[torch.Tensor],
    bucket: torch.Tensor,
    offsets: Sequence[int],
    scale: float,
    flag: torch.Tensor,
) -> None:
    """bucket[offset:offset+numel] = grad * scale for each grad; flag = 1 if any is not finite."""
    for grad, offset in zip(grads, offsets):
        view = bucket[offset : offset + grad.numel()]
        view.copy_(grad.reshape(-1)).mul_(scale)
        if not torch.isfinite(grad).all():
            flag.fill_(1)


def unpack(
    bucket: torch.Tensor,
    grads: List[torch.Tensor],
    offsets: Sequence[int],
    scale: float,
    flag: torch.Tensor,
) -> None:
    """grad = bucket[offset:offset+numel] * scale, cast to the grad's dtype; flag on inf/NaN."""
    for grad, offset in zip(grads, offsets):
        view = bucket[offset : offset + grad.numel()].view(grad.shape)
        grad.copy_(view.to(torch.float32).mul_(scale) if scale != 1.0 else view)
        if not torch.isfinite(grad).all():
            flag.fill_(1)


def unscale_(tensors: Sequence[torch.Tensor], inv_scale: float, found_inf: torch.Tensor) -> None:
    """t *= inv_scale for each tensor; found_inf = 1 if any value is not finite."""
    for t in tensors:
        t.mul_(inv_scale)
        if not torch.isfinite(t).all():
            found_inf.fill_(1)
