"""DistributedDataParallel's constructor arguments: checks, and which Communicator to use.

The checks follow torch DDP's rules where the options are torch's (``device_ids``,
``output_device``, ``dim``) and raise before the engine touches the module; the Communicator is
``comm``, the one behind torch's ``process_group`` argument, or the default one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import comm as communicator

_WIRE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


def _resolve_comm(module: nn.Module, comm: Any, process_group: Any) -> Tuple[Any, bool]:
    """(communicator, created here) from ``comm`` or torch's ``process_group`` argument."""
    if comm is not None and process_group is not None:
        raise ValueError(
            "DistributedDataParallel: pass comm or process_group, not both (comm is a "
            "dist_kernels Communicator, process_group a torch ProcessGroup)"
        )
    if process_group is None:
        return (comm, False) if comm is not None else _default_comm(module)
    try:
        default = communicator.get_default_communicator()
    except RuntimeError:
        default = None
    if default is not None and default.group is process_group:
        return default, False
    return communicator.Communicator(group=process_group, device=_module_device(module)), True


def _module_device(module: nn.Module) -> str:
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return "cuda" if device.type == "cuda" else "cpu"


def _default_comm(module: nn.Module) -> Tuple[Any, bool]:
    """(communicator, created here): the default one if ``dk.init()`` ran, else a new one."""
    try:
        return communicator.get_default_communicator(), False
    except RuntimeError:
        return communicator.Communicator(device=_module_device(module)), True


def _check_options(
    module: nn.Module,
    bucket_cap_mb: float,
    first_bucket_mb: float,
    grad_dtype: Optional[torch.dtype],
    gradient_predivide_factor: Optional[float],
    device_ids: Optional[Sequence[Any]],
    output_device: Any,
    dim: int,
) -> None:
    """Every constructor argument that is checked alone (before the engine touches the
    module or communicates)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(
            f"bucket_cap_mb ({bucket_cap_mb}) and first_bucket_mb ({first_bucket_mb}) must be > 0"
        )
    if grad_dtype not in _WIRE_DTYPES:
        raise TypeError(
            f"grad_dtype: expected None, float32, float16 or bfloat16, got {grad_dtype}"
        )
    if gradient_predivide_factor is not None and gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if any(p.is_sparse for p in module.parameters()):
        raise TypeError("module: sparse parameters are not supported")
    _check_devices(module, device_ids, output_device, dim)


def _check_devices(
    module: nn.Module, device_ids: Optional[Sequence[Any]], output_device: Any, dim: int
) -> None:
    """torch's rules: CPU modules take no device ids; a CUDA module at most its own device.

    The module stays where it is (nothing is moved or scattered), so the ids only have to
    agree with it; ``dim`` (the scatter dimension of torch's single-process multi-device
    mode) must be 0.
    """
    devices = {p.device for p in module.parameters()}
    if dim != 0:
        raise ValueError(
            f"DistributedDataParallel: dim must be 0 (nothing is scattered), got {dim}"
        )
    if device_ids is None and output_device is None:
        return
    cuda = [d for d in devices if d.type == "cuda"]
    if len(devices) != 1 or not cuda or (device_ids is not None and len(device_ids) != 1):
        raise ValueError(
            "DistributedDataParallel: device_ids and output_device work with single-device "
            f"CUDA modules only (as in torch), got device_ids {device_ids}, output_device "
            f"{output_device} and module parameters on {sorted(map(str, devices))}"
        )
    given_ids = (device_ids or [None])[0]
    for what, given in (("device_ids[0]", given_ids), ("output_device", output_device)):
        if given is not None and _as_cuda(given) != cuda[0]:
            raise ValueError(
                f"DistributedDataParallel: {what}={given} but the module is on {cuda[0]} "
                "(this DDP does not move modules)"
            )


def _as_cuda(device: Any) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
