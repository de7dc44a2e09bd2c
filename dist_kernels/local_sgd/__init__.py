"""Local SGD and DiLoCo: replicas step alone for H steps, then average their progress."""

from .local_sgd import LocalSGD

__all__ = ["LocalSGD"]
