"""A parameter server over dist_kernels send/recv: sync (BSP), bounded staleness (SSP), async."""

from .parameter_server import ParameterServer
from .plan import Consistency, Shard, shard_ranges

__all__ = ["ParameterServer", "Consistency", "Shard", "shard_ranges"]
