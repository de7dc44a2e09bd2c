"""Bytes per rank of the sharded optimizer: measured from its tensors, and the ZeRO formula.

The ZeRO paper (Rajbhandari et al., 2020, section 3) counts, for P parameters on N ranks,
``s_p`` bytes per parameter value, ``s_g`` per gradient and ``K`` per element of optimizer
state (K = 12 for mixed-precision Adam: FP32 master, m and v; 8 for FP32 Adam, whose
parameters are their own master)::

    stage 1:  s_p P     + s_g P     + K P / N
    stage 2:  s_p P     + s_g P / N + K P / N
    stage 3:  s_p P / N + s_g P / N + K P / N

On top of it the engine holds alignment padding (every parameter offset and every bucket slice
is 16-byte aligned) and communication buffers: at most ``STAGING_SLOTS`` wire buckets, as many
bucket slices, one FP32 bucket slice to step 16-bit shards, and at stage 3 the gathered full
parameters of the units in use. :class:`MemoryReport` puts the measured bytes beside the
formula, per kind, with the padding and the buffer bound the engine allows itself.

Pure code: counts come in, numbers go out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

import torch

KINDS = ("parameters", "gradients", "optimizer_state", "buffers")


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> Optional[int]:
    """FP32 state bytes per parameter element of the optimizers the formula knows (Adam-type:
    m and v, plus the running max with amsgrad; SGD: the momentum buffer), else None."""
    name = type(optimizer).__name__
    group = optimizer.param_groups[0]
    if name in ("Adam", "AdamW", "FusedAdamW"):
        return 12 if group.get("amsgrad") else 8
    if name == "SGD":
        return 4 if group.get("momentum", 0) else 0
    return None


@dataclass(frozen=True)
class GroupCounts:
    """What the formula needs of one flat group."""

    numel: int  # parameter elements (no padding)
    padded_numel: int  # flat buffer elements, padding included
    shard_numel: int  # elements of this rank's shard (padded_numel / N)
    param_bytes: int  # bytes per parameter value (s_p)
    grad_bytes: int  # bytes per stored gradient (s_g)
    master_bytes: int  # 4 for 16-bit parameters (FP32 master), 0 for FP32
    state_bytes: int  # optimizer state bytes per element (K without the master)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank by kind: ``measured`` (from the tensors), ``formula`` (ZeRO paper) and
    ``allowance`` (alignment padding; for buffers the bound the engine states)."""

    stage: int
    world_size: int
    numel: int
    measured: Dict[str, int]
    formula: Dict[str, int]
    allowance: Dict[str, int]
    state_per_element: Optional[int]

    def within_formula(self) -> bool:
        """True when every kind is at the formula plus at most its allowance."""
        return all(
            self.formula[k] <= self.measured[k] <= self.formula[k] + self.allowance[k]
            for k in KINDS
        )

    def total(self, which: str = "measured") -> int:
        return sum(getattr(self, which).values())

    def describe(self) -> str:
        lines = [
            f"ZeRO stage {self.stage}, {self.numel} parameters on {self.world_size} ranks, "
            f"bytes per rank (state per element: {self.state_per_element})",
            f"{'kind':16s} {'measured':>14s} {'formula':>14s} {'allowance':>12s}",
        ]
        for k in KINDS:
            lines.append(
                f"{k:16s} {self.measured[k]:14d} {self.formula[k]:14d} {self.allowance[k]:12d}"
            )
        lines.append(f"{'total':16s} {self.total():14d} {self.total('formula'):14d}")
        return "\n".join(lines)

    __str__ = describe


def _per_rank(stage: int, groups: List[GroupCounts], full: Callable, shard: Callable) -> Dict:
    """Bytes per kind, with ``full(g)`` / ``shard(g)`` elements of a replicated / sharded kind."""
    out = {k: 0 for k in KINDS}
    for g in groups:
        out["parameters"] += g.param_bytes * (shard(g) if stage == 3 else full(g))
        out["gradients"] += g.grad_bytes * (full(g) if stage == 1 else shard(g))
        out["optimizer_state"] += (g.state_bytes + g.master_bytes) * shard(g)
    return out


def formula_bytes(stage: int, world_size: int, groups: List[GroupCounts]) -> Dict[str, int]:
    """The paper's bytes per rank (buffers: 0): sharded kinds are exactly 1/N, rounded up."""
    exact = _per_rank(stage, groups, lambda g: g.numel * world_size, lambda g: g.numel)
    return {k: -(-v // world_size) for k, v in exact.items()}


def padding_allowance(stage: int, world_size: int, groups: List[GroupCounts]) -> Dict[str, int]:
    """Bytes that alignment padding adds to each kind: the plan's padded sizes minus the
    formula (exact)."""
    padded = _per_rank(stage, groups, lambda g: g.padded_numel, lambda g: g.shard_numel)
    formula = formula_bytes(stage, world_size, groups)
    return {k: padded[k] - formula[k] for k in KINDS}
