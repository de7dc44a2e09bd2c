"""Fused optimizers: one C++/CUDA kernel pass per group of same-typed tensors.

:class:`FusedAdamW` is a drop-in for ``torch.optim.AdamW`` (same defaults, same update order,
results equal to FP32 rounding) whose moments are always FP32, also for FP16 / BF16 parameters,
and that can keep FP32 master weights for 16-bit parameters. The engines use it on flat buffers
(one kernel per dtype buffer); it works as well on any list of parameters.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..dtypes import dtype_code

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")


def _as_float(value: Union[float, torch.Tensor], arg: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{arg}: expected a scalar, got shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay, one fused kernel per group of same-typed tensors.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay coefficient (``param *= 1 - lr * weight_decay``).
        amsgrad: use the maximum of past second moments (as torch).
        maximize: maximise the objective instead of minimising it.
        master_weights: keep an FP32 copy of every FP16 / BF16 parameter in the state
            (``state["master"]``), update it and round it into the parameter; without it a
            16-bit parameter is rounded after every step, as torch does.

    The state of each parameter has torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``, and
    ``max_exp_avg_sq`` with amsgrad), so a ``torch.optim.AdamW`` state dict loads into it and
    back; the moments are kept in FP32 whatever the parameter dtype.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
    ) -> None:
        lr = _as_float(lr, "lr")
        if lr < 0.0:
            raise ValueError(f"lr: must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"eps: must be >= 0, got {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= _as_float(beta, f"betas[{i}]") < 1.0:
                raise ValueError(f"betas[{i}]: must be in [0, 1), got {beta}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            master_weights=master_weights,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _FLOAT_DTYPES:
                    raise TypeError(
                        f"params: FusedAdamW supports float32, float16 and bfloat16 parameters, "
                        f"got {p.dtype}"
                    )

    def _init_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        state = self.state[p]
        if not state:
            zeros = lambda: torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # noqa: E731
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = zeros()
            state["exp_avg_sq"] = zeros()
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = zeros()
        if group["master_weights"] and p.dtype != torch.float32 and "master" not in state:
            state["master"] = p.detach().to(torch.float32).contiguous()
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0) -> Any:
        """Performs one optimisation step.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as in torch).
            grad_scale: every gradient is multiplied by it first, inside the kernel
                (``1 / loss_scale`` unscales a scaled loss's gradients for free).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            batches: Dict[tuple, List[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("FusedAdamW does not support sparse gradients")
                state = self._init_state(p, group)
                state["step"] += 1
                key = (p.device, p.dtype, p.grad.dtype, float(state["step"]), "master" in state)
                batches[key].append(p)
            for (device, _, _, step, _), params in batches.items():
                self._run_kernel(params, group, step, device, grad_scale)
        return loss

    def _run_kernel(
        self,
        params: List[torch.Tensor],
        group: Dict[str, Any],
        step: float,
        device: torch.device,
        grad_scale: float,
    ) -> None:
        hyper = _hyper(group, step, grad_scale)
        targets = [p if p.is_contiguous() else p.contiguous() for p in params]
        grads = [p.grad.contiguous() for p in params]
        states = [self.state[p] for p in params]

        def ptrs(key: str) -> List[int]:
            return [s[key].data_ptr() for s in states] if key in states[0] else []

        stream = 0
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device).cuda_stream
        elif device.type != "cpu":
            raise TypeError(f"params: FusedAdamW runs on CPU and CUDA tensors, not {device.type}")
        from .. import _C

        _C.adamw_step(
            [t.data_ptr() for t in targets],
            [g.data_ptr() for g in grads],
            ptrs("exp_avg"),
            ptrs("exp_avg_sq"),
            ptrs("max_exp_avg_sq"),
            ptrs("master"),
            [p.numel() for p in params],
            dtype_code(params[0].dtype, "params"),
            dtype_code(grads[0].dtype, "grad"),
            hyper,
            device.index if device.type == "cuda" else -1,
            stream,
        )
        for p, t in zip(params, targets):
            if t is not p:
                p.copy_(t)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.AdamW``.

        torch casts floating state to the parameter dtype on load; the moments (and master
        weights) are put back in FP32 from the given tensors so 16-bit parameters lose nothing.
        """
        saved = {pid: dict(s) for pid, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for group in self.param_groups:
            group.setdefault("master_weights", False)
        for pid, p in zip(saved_ids, params):
            for key in _MOMENT_KEYS:
                if pid in saved and key in saved[pid]:
                    value = saved[pid][key]
                    self.state[p][key] = value.to(p.device, torch.float32, copy=True).contiguous()
            if pid in saved and "step" in saved[pid]:
                self.state[p]["step"] = torch.as_tensor(
                    float(saved[pid]["step"]), dtype=torch.float32
                )


def _hyper(group: Dict[str, Any], step: float, grad_scale: float) -> Any:
    """Per-step scalars, computed in double as torch does, rounded to float by the binding."""
    from .. import _C

    lr = _as_float(group["lr"], "lr")
    beta1 = _as_float(group["betas"][0], "betas[0]")
    beta2 = _as_float(group["betas"][1], "betas[1]")
    hyper = _C.AdamWHyper()
    hyper.step_size = lr / (1 - beta1**step)
    hyper.bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    hyper.decay = 1 - lr * group["weight_decay"]
    hyper.one_minus_beta1 = 1 - beta1
    hyper.beta2 = beta2
    hyper.one_minus_beta2 = 1 - beta2
    hyper.eps = group["eps"]
    hyper.grad_scale = -grad_scale if group["maximize"] else grad_scale
    hyper.amsgrad = bool(group["amsgrad"])
    return hyper


__all__ = ["FusedAdamW"]
