"""Mixed precision: :class:`LossScaler` and the fused bucket kernels it and DDP share.

``bucketing`` plans gradient buckets and packs / unpacks them with a cast, a scale and a
non-finite check in one pass (``_C`` kernels); ``loss_scaler`` is ``torch.amp.GradScaler``'s
policy over those kernels, with the skip decision agreed across ranks.
"""

from . import bucketing
from .loss_scaler import LossScaler

__all__ = ["LossScaler", "bucketing"]
