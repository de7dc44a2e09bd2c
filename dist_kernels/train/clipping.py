"""``--clip-grad``: gradients scaled so that the whole model's norm is at most ``max_norm``
(torch's ``clip_grad_norm_``, Megatron's ``--clip-grad``, DeepSpeed's ``gradient_clipping``),
whatever the layout.

The norm is the model's, not one rank's: every gradient element counts once over the world.
After the reductions, the replicas over dp x cp hold the same gradient (an expert's
parameters: its replicas over the expert-dp group), so only the first replica counts it. A
tensor-parallel shard counts on every tp rank, each holding its own part; a parameter every tp
rank holds whole (a layer norm, a row-parallel bias) counts on tp rank 0 only. Pipeline stages
hold different parameters, except a tied one's copies (``pipeline/tied.py``): the first
stage's counts. One all-reduce of the partial sums, in float64, gives every rank the same norm
and so the same factor: replicas stay equal. ZeRO shards the gradients themselves: there
``ShardedOptimizer.clip_grad_norm_`` sums each rank's shard over dp x cp. torch's engines clip
with torch's own ``clip_grad_norm_`` (DTensor gradients under FSDP2).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, List, Optional

import torch

from ..pipeline.tied import is_tied_copy
from ..tensor_parallel import is_tensor_parallel_shard

# torch's clip_grad_norm_ adds this to the norm before dividing
_EPS = 1e-6


def _owned(p: torch.Tensor, mesh: Any) -> bool:
    """Whether this rank counts ``p``'s gradient in the model's norm (see the module doc)."""
    if is_tied_copy(p):  # an earlier pipeline stage holds this parameter too and counts it
        return False
    if mesh is None:
        return True
    expert = getattr(p, "expert_parallel", False)
    replica = mesh.expert_dp_rank if expert and mesh.ep > 1 else mesh.dp_cp_rank
    return replica == 0 and (mesh.tp_rank == 0 or is_tensor_parallel_shard(p))


def owned_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, mesh: Any, world_comm: Any
) -> float:
    """Clips the gradients of ``params`` (this rank's) to the model's norm ``max_norm``;
    returns the norm before clipping, the same on every rank."""
    grads: List[torch.Tensor] = []
    total = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        grads.append(p.grad)
        if _owned(p, mesh):
            total += p.grad.detach().double().square().sum()
    if world_comm is not None:
        world_comm.all_reduce(total)
    norm = math.sqrt(float(total[0]))
    coef = max_norm / (norm + _EPS)
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return norm


def make_clipper(
    max_norm: float, engine: str, optimizer: Any, params: List[torch.Tensor], mesh: Any,
    world_comm: Any,
) -> Optional[Callable[[], float]]:  # fmt: skip
    """The clipping call of an engine (None when ``max_norm`` is 0: no clipping, no norm)."""
    if not max_norm:
        return None
    clip = getattr(optimizer, "clip_grad_norm_", None)
    if engine == "dk" and clip is not None:  # ZeRO: the shards over dp x cp
        return lambda: float(clip(max_norm))
    if engine == "torch":
        return lambda: float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return lambda: owned_grad_norm_(params, max_norm, mesh, world_comm)
