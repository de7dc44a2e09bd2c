"""dist_kernels: collectives, fused gradient kernels and training engines for PyTorch.

The public names are imported lazily so that ``import dist_kernels`` stays cheap and a
missing optional piece never breaks the rest.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

from ._dtypes import ReduceOp
from ._version import __version__

# public name -> module (relative to this package) that defines it
_LAZY: Dict[str, str] = {
    "CommError": "errors",
    "build_info": "info",
    "Communicator": "communicator",
    "Work": "communicator",
    "init": "communicator",
    "get_default_communicator": "communicator",
    "all_reduce": "communicator",
    "reduce_scatter": "communicator",
    "all_gather": "communicator",
    "broadcast": "communicator",
    "barrier": "communicator",
    "send": "communicator",
    "recv": "communicator",
    "LossScaler": "loss_scaler",
    "DistributedDataParallel": "ddp",
    "DDP": "ddp",
    "ShardedOptimizer": "zero",
    "Pipeline": "pipeline",
    "ProcessMesh": "mesh",
}
_SUBMODULES = ("ops", "checkpoint", "optim", "pipeline", "bucketing", "bench", "info")

__all__ = ["ReduceOp", "__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'dist_kernels' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
