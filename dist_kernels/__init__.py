"""dist_kernels: collectives, fused gradient kernels and training engines for PyTorch.

The public names are imported lazily so that ``import dist_kernels`` stays cheap and a
missing optional piece never breaks the rest.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
from typing import Any, Dict


def _use_installed_extension() -> None:
    """Lets a source checkout without a built ``_C`` use the installed one.

    ``python -m dist_kernels.bench`` run in the repository root after ``pip install .`` imports
    this package from the checkout (the current directory comes first on ``sys.path``), where
    no extension was built. Searching the installed copy for submodules as well keeps the
    README's commands working from the checkout. An in-place build, if present, still wins.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    if glob.glob(os.path.join(here, "_C.*")):
        return
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "dist_kernels")
        if os.path.realpath(candidate) == os.path.realpath(here):
            continue
        if glob.glob(os.path.join(candidate, "_C.*")):
            __path__.append(candidate)
            return


_use_installed_extension()

from ._version import __version__  # noqa: E402
from .dtypes import ReduceOp  # noqa: E402
from .torch_backend import register as _register_torch_backend  # noqa: E402

_register_torch_backend()  # torch.distributed backend "dk"; loads nothing compiled

# public name -> module (relative to this package) that defines it
_LAZY: Dict[str, str] = {
    "CommError": "errors",
    "build_info": "info",
    "Communicator": "comm",
    "Work": "comm",
    "init": "comm",
    "get_default_communicator": "comm",
    "all_reduce": "comm",
    "reduce_scatter": "comm",
    "all_gather": "comm",
    "broadcast": "comm",
    "barrier": "comm",
    "send": "comm",
    "recv": "comm",
    "isend": "comm",
    "irecv": "comm",
    "LossScaler": "amp",
    "DistributedDataParallel": "ddp",
    "DDP": "ddp",
    "ShardedOptimizer": "zero",
    "Pipeline": "pipeline",
    "ProcessMesh": "mesh",
    "ParameterServer": "param_server",
    "LocalSGD": "local_sgd",
    "init_process_group": "torch_backend.frameworks",
}
# public submodule name -> module (relative to this package); ``bucketing``: ``buckets``, old name
_SUBMODULES: Dict[str, str] = {
    "ops": "ops",
    "checkpoint": "checkpoint",
    "optim": "optim",
    "pipeline": "pipeline",
    "bucketing": "buckets",
    "buckets": "buckets",
    "bench": "bench",
    "info": "info",
    "comm": "comm",
    "debug": "debug",
    "amp": "amp",
    "ddp": "ddp",
    "zero": "zero",
    "ddp_hooks": "ddp.hooks",
    "lr": "lr",
    "train": "train",
    "tensor_parallel": "tensor_parallel",
    "context_parallel": "context_parallel",
    "moe": "moe",
    "models": "models",
    "local_sgd": "local_sgd",
    "param_server": "param_server",
}

__all__ = ["ReduceOp", "__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f".{_SUBMODULES[name]}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'dist_kernels' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
