"""Mixed precision: :class:`LossScaler`, ``torch.amp.GradScaler``'s policy over the fused
unscale kernel of :mod:`dist_kernels.buckets`, with the skip decision agreed across ranks.

``amp.bucketing`` keeps the bucket planner and kernels importable where they used to live.
"""

from . import bucketing
from .loss_scaler import LossScaler

__all__ = ["LossScaler", "bucketing"]
