"""Optimizers: :class:`FusedAdamW` (one fused C++/CUDA kernel per group of same-typed tensors)
and :class:`Muon` (orthogonalised momentum for hidden matrices, AdamW for the rest, its
Newton-Schulz work dealt over the data-parallel replicas and tp shards joined)."""

from .fused_adamw import FusedAdamW
from .muon import Muon, adjusted_lr, deal_matrices, muon_param_groups, newton_schulz

__all__ = [
    "FusedAdamW",
    "Muon",
    "muon_param_groups",
    "newton_schulz",
    "adjusted_lr",
    "deal_matrices",
]
