"""Local SGD / DiLoCo over a dist_kernels Communicator.

Each replica runs its own (inner) optimizer; every ``sync_every`` steps the replicas' parameter
deltas since the last sync are averaged with one all-reduce of one flat buffer and applied to
the shared starting point ("anchor"):

    anchor = params at the last sync (identical on every rank)
    every H steps:  delta = all_reduce_avg(params - anchor)      # one flat buffer
                    anchor += delta                  (outer_optimizer None: plain averaging)
                    or outer.step() with anchor.grad = -delta    (DiLoCo: Nesterov SGD)
                    params = anchor

With H = 1 and plain averaging, SGD without momentum gives exactly synchronous data parallelism
up to rounding: params = p0 + mean_i(-lr g_i) = p0 - lr mean_i(g_i).

    local = dk.LocalSGD(model, comm, sync_every=4)
    for x, y in batches:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        local.step()                                 # syncs on every 4th call
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn

from ..dtypes import ReduceOp

OuterOptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]


def _flat_params(model: nn.Module, rank: int) -> List[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"[rank {rank}] LocalSGD: the model has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(
            f"[rank {rank}] LocalSGD: parameters must share one dtype (one flat buffer), "
            f"got {sorted(str(d) for d in dtypes)}"
        )
    return params


class LocalSGD:
    """Averages parameter deltas every ``sync_every`` optimizer steps.

    Args:
        model: the replica; its trainable parameters must share one dtype. Rank 0's values
            are broadcast at construction so that every replica starts from the same point.
        comm: a dist_kernels Communicator (CPU or CUDA) over the data-parallel ranks.
        sync_every: H, the number of inner steps between syncs (1 = every step).
        outer_optimizer: ``None`` for plain averaging, or a factory ``params -> Optimizer``
            called with the anchor (one flat tensor); it steps with the negated average delta
            as its gradient. DiLoCo: ``lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9,
            nesterov=True)``.
        wire_dtype: dtype the delta travels in (``torch.bfloat16`` / ``torch.float16`` halve
            the bytes; the reduction accumulates in FP32); default the parameters' dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Any,
        sync_every: int = 1,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        wire_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.rank = comm.rank
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(
                f"[rank {self.rank}] LocalSGD: sync_every must be an int >= 1, got {sync_every!r}"
            )
        self.model = model
        self.comm = comm
        self.sync_every = sync_every
        self.params = _flat_params(model, self.rank)
        dtype = self.params[0].dtype
        self.wire_dtype = wire_dtype or dtype
        numel = sum(p.numel() for p in self.params)
        self.steps = 0
        self.syncs = 0
        with torch.no_grad():
            self.anchor = torch.cat([p.detach().reshape(-1) for p in self.params]).to(dtype)
            comm.broadcast(self.anchor, src=0)  # every replica starts from rank 0's values
            self._write_params(self.anchor)
        self._wire = comm.empty((numel,), self.wire_dtype)  # registered: no staging copy
        self.outer = outer_optimizer([self.anchor]) if outer_optimizer is not None else None

    def _write_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def step(self) -> bool:
        """Counts one inner step; on every ``sync_every``-th, syncs. Returns True if it did."""
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Averages the deltas since the last sync over ranks and applies them (collective)."""
        offset = 0
        for p in self.params:  # delta = params - anchor, cast into the wire buffer
            n = p.numel()
            self._wire[offset : offset + n].copy_(p.reshape(-1) - self.anchor[offset : offset + n])
            offset += n
        self.comm.all_reduce(self._wire, op=ReduceOp.AVG)
        delta = self._wire.to(self.anchor.dtype)
        if self.outer is None:
            self.anchor += delta
        else:
            self.anchor.grad = delta.neg_()  # the pseudo-gradient points against progress
            self.outer.step()
        self._write_params(self.anchor)
        self.syncs += 1

    def __repr__(self) -> str:
        outer = type(self.outer).__name__ if self.outer is not None else "average"
        return (
            f"LocalSGD(rank={self.rank}, sync_every={self.sync_every}, outer={outer}, "
            f"wire_dtype={self.wire_dtype}, steps={self.steps}, syncs={self.syncs})"
        )
