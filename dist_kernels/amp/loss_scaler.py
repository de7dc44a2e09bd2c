"""Dynamic loss scaling with the API of ``torch.amp.GradScaler``, for FP16 and BF16 training.

Differences from ``GradScaler`` (everything else behaves the same, with the same defaults):

* FP16 gradients are accepted (``GradScaler`` refuses them); unscaling runs through the fused
  multi-tensor kernel of :mod:`dist_kernels.buckets.kernels` where it can.
* ``hysteresis``: the number of consecutive overflowing steps tolerated before the scale backs
  off. Every overflowing step is skipped; the first ``hysteresis - 1`` of a run of consecutive
  overflows leave the scale alone, each further one multiplies it by ``backoff_factor``. A clean
  step refills the allowance. ``hysteresis=1`` is ``GradScaler``'s behaviour.
* ``min_scale``: the scale never backs off below it. An overflow while the scale already sits at
  ``min_scale`` cannot be cured by backing off; ``on_min_scale`` says what :meth:`step` does
  then: ``"raise"`` (``FloatingPointError``), ``"warn"`` (a ``RuntimeWarning``) or
  ``"continue"`` (skip the step silently).
* ``skipped_steps`` and ``last_overflow_step`` count skipped optimizer steps and remember the
  last iteration (the number of :meth:`update` calls before it) that overflowed.
* ``comm=``: a found inf on any rank skips the step on every rank (the flag is all-reduced with
  MAX inside :meth:`unscale_`), so replicas never diverge.
* :meth:`mark_unscaled`: an engine that unscales the gradients itself (fused into its own pass,
  as :class:`dist_kernels.DistributedDataParallel` does with ``loss_scaler=``) hands the scaler
  its found-inf flag instead of the scaler unscaling again.

The scale update stays on the scale's device (tensor operations, no ``.item()``). Like
``GradScaler``, :meth:`step` reads the found-inf flag once on the host to decide whether to call
``optimizer.step()``.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Literal, Optional, Union

import torch

from ..dtypes import ReduceOp

__all__ = ["LossScaler"]

_UNSCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> Dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf": None, "marked": False}


@functools.cache
def _extension_handles(device_type: str) -> bool:
    """Whether the compiled kernels can unscale tensors on this kind of device."""
    try:
        from .. import _C
    except ImportError:
        return False
    return device_type == "cpu" or (device_type == "cuda" and _C.build_info()["cuda_compiled"])


class LossScaler:
    """Dynamic loss scaler: ``torch.amp.GradScaler``'s API plus hysteresis and a floor.

    Args:
        device: accepted for ``GradScaler`` compatibility; the scale lives on the device of the
            first tensor passed to :meth:`scale` (or ``comm.device`` when ``comm`` is given).
        init_scale: initial scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps in a row (> 1).
        backoff_factor: multiplies the scale after an overflow beyond the hysteresis (< 1).
        growth_interval: clean steps in a row before the scale grows.
        enabled: ``False`` makes every method a pass-through (``step`` just steps).
        hysteresis: consecutive overflows tolerated before backing off (>= 1).
        min_scale: floor of the scale (>= 0).
        on_min_scale: what :meth:`step` does on an overflow with the scale at ``min_scale``.
        comm: optional dist_kernels Communicator; found infs are all-reduced with MAX on it.
            A rank of ``comm`` may then unscale, step and update without having scaled
            anything itself (a pipeline stage before the last: its gradients carry the scale
            through the gradients it received).
    """

    def __init__(
        self,
        device: Optional[Union[str, torch.device]] = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        on_min_scale: Literal["raise", "warn", "continue"] = "raise",
        comm: Any = None,
    ) -> None:
        _check_positive("init_scale", init_scale)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor: must be > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor: must lie in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval: must be an int >= 1, got {growth_interval!r}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis: must be an int >= 1, got {hysteresis!r}")
        if not min_scale >= 0.0:
            raise ValueError(f"min_scale: must be >= 0, got {min_scale}")
        if min_scale > init_scale:
            raise ValueError(f"min_scale ({min_scale}) exceeds init_scale ({init_scale})")
        if on_min_scale not in ("raise", "warn", "continue"):
            raise ValueError(
                f"on_min_scale: expected 'raise', 'warn' or 'continue', got {on_min_scale!r}"
            )
        self._device = device
        self._enabled = bool(enabled)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._min_scale = float(min_scale)
        self._on_min_scale = on_min_scale
        self._comm = comm
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = hysteresis
        self._scale: Optional[torch.Tensor] = None
        self._growth_tracker: Optional[torch.Tensor] = None
        self._hysteresis_tracker: Optional[torch.Tensor] = None
        self._per_optimizer_states: Dict[int, Dict[str, Any]] = defaultdict(
            self._new_optimizer_state
        )
        # The flag given to mark_unscaled(optimizer=None) since the last update(), if any.
        self._marked_found_inf: Optional[torch.Tensor] = None
        self.skipped_steps = 0
        """Optimizer steps skipped because of inf or NaN gradients."""
        self.last_overflow_step: Optional[int] = None
        """Iteration (number of update() calls before it) of the last overflow, or None."""
        self._iteration = 0

    # ----------------------------------------------------------------------------------------
    # GradScaler API
    # ----------------------------------------------------------------------------------------

    def scale(self, outputs):
        """Multiplies a tensor (or an iterable of tensors) by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        if not isinstance(outputs, Iterable):
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        def apply(value):
            if isinstance(value, torch.Tensor):
                return self.scale(value)
            if isinstance(value, Iterable):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place and records found infs.

        FP32, FP16 and BF16 gradients are accepted. With ``comm``, the found-inf flag is
        all-reduced (MAX) so every rank sees an overflow on any rank.
        """
        if not self._enabled:
            return
        self._require_scale("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED and state["marked"]:
            raise RuntimeError(
                "unscale_(): this step's gradients were already unscaled through "
                "mark_unscaled() (e.g. by DistributedDataParallel(loss_scaler=...)); clip or "
                "inspect them directly instead of calling unscale_()."
            )
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._scale.double().reciprocal().float()
        own_unscale = getattr(optimizer, "_unscale_grads_", None)
        if own_unscale is not None:  # an engine that owns its gradient storage (ZeRO shards)
            found_inf = own_unscale(inv_scale).to(self._scale.device)
        else:
            found_inf = self._unscale_grads(optimizer, inv_scale)
        if self._comm is not None:
            self._comm.all_reduce(found_inf, op=ReduceOp.MAX)
        state["found_inf"] = found_inf
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (unless done already) and calls ``optimizer.step`` if no inf or NaN was found.

        Returns what ``optimizer.step`` returned, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if LossScaler is enabled.")
        self._require_scale("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        overflow, at_floor = self._read_overflow(state["found_inf"])
        result = None
        if overflow:
            self.skipped_steps += 1
            self.last_overflow_step = self._iteration
            if at_floor:
                self._min_scale_reached()
        else:
            result = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return result

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Updates the scale on its device: back off after overflows, grow after clean runs.

        ``new_scale`` (a float or a one-element tensor) sets the scale instead.
        """
        if not self._enabled:
            return
        self._require_scale("update")
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            found = [
                s["found_inf"].to(device=self._scale.device, non_blocking=True)
                for s in self._per_optimizer_states.values()
                if s["found_inf"] is not None
            ]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._update_scale(torch.stack(found).sum())
        self._per_optimizer_states = defaultdict(self._new_optimizer_state)
        self._marked_found_inf = None
        self._iteration += 1

    def mark_unscaled(
        self,
        found_inf: Union[bool, float, torch.Tensor],
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        """Records that this step's gradients are already unscaled, and whether any was inf/NaN.

        For an engine that divides the gradients by :meth:`get_scale` itself, fused into a pass
        it makes anyway (``DistributedDataParallel(loss_scaler=...)`` calls it at the end of
        each synchronised backward). Afterwards :meth:`step` does not unscale again: it skips
        ``optimizer.step()`` when ``found_inf`` is nonzero, and :meth:`update` backs off or
        grows the scale from it, exactly as after :meth:`unscale_`. It is the hand-off point of
        ``GradScaler.unscale_``'s two halves (unscale, record the found-inf flag) when the
        first half ran elsewhere.

        Args:
            found_inf: nonzero when an inf or NaN was found: a bool or number, or a one-element
                tensor (kept on its device; read on the host only by :meth:`step`).
            optimizer: the optimizer whose gradients were unscaled; None: every optimizer
                stepped before the next :meth:`update` (an engine need not know them).

        Raises:
            RuntimeError: the gradients of this step were already unscaled (by
                :meth:`unscale_` or an earlier ``mark_unscaled``) or stepped since the last
                :meth:`update`. Unscaling twice would divide the first gradients by the scale
                twice; with DistributedDataParallel, run all but the last micro-batch of a step
                under ``no_sync()``.
        """
        if not self._enabled:
            return
        flag = self._found_inf_flag(found_inf)
        if optimizer is not None:
            states = [self._per_optimizer_states[id(optimizer)]]
        else:
            states = list(self._per_optimizer_states.values())
            if self._marked_found_inf is not None:
                states.append({"stage": _Stage.UNSCALED})
        for state in states:
            if state["stage"] is not _Stage.READY:
                done = "stepped" if state["stage"] is _Stage.STEPPED else "unscaled"
                raise RuntimeError(
                    f"mark_unscaled(): this step's gradients were already {done} since the last "
                    "update(); unscaling them again would divide them by the scale twice (with "
                    "DistributedDataParallel: run all but the last micro-batch under no_sync(), "
                    "and call scaler.step() and scaler.update() once per synchronised backward)"
                )
        for state in states:
            state.update(stage=_Stage.UNSCALED, found_inf=flag, marked=True)
        if optimizer is None:
            self._marked_found_inf = flag

    def get_scale(self) -> float:
        """The current scale as a Python float (synchronises with the device); 1.0 if disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> Dict[str, Any]:
        """GradScaler's five entries plus this scaler's own; empty when disabled."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._tracker_value(self._growth_tracker, "growth"),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._tracker_value(self._hysteresis_tracker, "hysteresis"),
            "min_scale": self._min_scale,
            "on_min_scale": self._on_min_scale,
            "skipped_steps": self.skipped_steps,
            "last_overflow_step": self.last_overflow_step,
            "_iteration": self._iteration,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads :meth:`state_dict` output (a ``GradScaler`` state dict works too)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of LossScaler."
            )
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        self._min_scale = float(state_dict.get("min_scale", self._min_scale))
        self._on_min_scale = state_dict.get("on_min_scale", self._on_min_scale)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.last_overflow_step = state_dict.get("last_overflow_step")
        self._iteration = int(state_dict.get("_iteration", 0))
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

    def _new_optimizer_state(self) -> Dict[str, Any]:
        """READY, or UNSCALED with the flag of mark_unscaled(optimizer=None) when it ran."""
        if self._marked_found_inf is None:
            return _fresh_optimizer_state()
        return {"stage": _Stage.UNSCALED, "found_inf": self._marked_found_inf, "marked": True}

    def _found_inf_flag(self, found_inf: Union[bool, float, torch.Tensor]) -> torch.Tensor:
        """``found_inf`` as the 0-dim float32 flag kept per optimizer (no host sync)."""
        if isinstance(found_inf, torch.Tensor):
            if found_inf.numel() != 1:
                raise ValueError(
                    f"found_inf: expected a one-element tensor, got shape {tuple(found_inf.shape)}"
                )
            return found_inf.detach().reshape(()).float()
        if not isinstance(found_inf, (bool, int, float)):
            raise TypeError(
                f"found_inf: expected a bool, a number or a tensor, got {type(found_inf).__name__}"
            )
        device = self._scale.device if self._scale is not None else "cpu"
        return torch.tensor(float(found_inf), dtype=torch.float32, device=device)

    def _lazy_init(self, device: torch.device) -> None:
        if self._comm is not None:
            device = torch.device(self._comm.device)
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=device
        )
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=device
        )

    def _require_scale(self, funcname: str) -> None:
        if self._scale is None and self._comm is not None:
            # A rank that scales nothing (a pipeline stage before the last, whose gradients
            # carry the scale through the received ones) still unscales and decides with
            # the others: the scale starts on the communicator's device.
            self._lazy_init(torch.device(self._comm.device))
            return
        if self._scale is None:
            raise AssertionError(
                f"Attempted {funcname} but the scale is not initialised. This may indicate your "
                "script did not use scaler.scale(loss or outputs) earlier in the iteration."
            )

    def _tracker_value(self, tracker: Optional[torch.Tensor], which: str) -> int:
        if tracker is None:
            return getattr(self, f"_init_{which}_tracker")
        return int(tracker.item())

    def _unscale_grads(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor):
        """Unscales every gradient; returns the found-inf flag (float32) on the scale's device."""
        from ..buckets import kernels as bucketing

        by_device: Dict[torch.device, List[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise TypeError("LossScaler: sparse gradients are not supported")
                if grad.dtype not in _UNSCALE_DTYPES:
                    raise TypeError(f"LossScaler: cannot unscale {grad.dtype} gradients")
                by_device[grad.device].append(grad)
        found_infs = []
        for device, grads in by_device.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            device_inv = inv_scale.to(device, non_blocking=True)
            fused = [g for g in grads if g.is_contiguous()]
            strided = [g for g in grads if not g.is_contiguous()]
            if fused and _extension_handles(device.type):
                bucketing.unscale_(fused, device_inv, found)
            elif fused:
                strided = grads
            if strided:
                torch._amp_foreach_non_finite_check_and_unscale_(strided, found, device_inv)
            found_infs.append(found.to(self._scale.device, non_blocking=True))
        if not found_infs:
            return torch.zeros((), dtype=torch.float32, device=self._scale.device)
        return torch.stack(found_infs).amax()

    def _read_overflow(self, found_inf: torch.Tensor):
        """(overflowed, scale already at the floor) with one device-to-host read."""
        at_floor = self._scale <= self._min_scale
        flags = torch.stack([found_inf.float() > 0, at_floor]).tolist()
        return bool(flags[0]), bool(flags[1])

    def _min_scale_reached(self) -> None:
        message = (
            f"LossScaler: gradients overflowed at iteration {self._iteration} with the loss scale "
            f"already at min_scale={self._min_scale}; backing off cannot help (inf/NaN in the "
            f"model or data?). on_min_scale='{self._on_min_scale}'; pass 'warn' or 'continue' "
            "to keep skipping such steps."
        )
        if self._on_min_scale == "raise":
            raise FloatingPointError(message)
        if self._on_min_scale == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """The scale policy as tensor operations (no host sync).

        overflow:  hysteresis_tracker -= 1; growth_tracker = 0;
                   if hysteresis_tracker <= 0: scale = max(scale * backoff, min_scale)
        clean:     hysteresis_tracker = hysteresis; growth_tracker += 1;
                   if growth_tracker == growth_interval: growth_tracker = 0 and
                   scale *= growth when the product is finite in float32
        Products are taken in float64 and rounded once, as torch._amp_update_scale_ does.
        """
        overflow = found_inf > 0
        refilled = torch.full_like(self._hysteresis_tracker, self._hysteresis)
        hysteresis = torch.where(overflow, self._hysteresis_tracker - 1, refilled)
        back_off = overflow & (hysteresis <= 0)
        clean_run = torch.where(overflow, 0, self._growth_tracker + 1)
        grow = clean_run >= self._growth_interval
        scale = self._scale.double()
        grown = (scale * self._growth_factor).float()
        backed_off = (scale * self._backoff_factor).clamp(min=self._min_scale).float()
        new_scale = torch.where(grow & grown.isfinite(), grown, self._scale)
        self._scale.copy_(torch.where(back_off, backed_off, new_scale))
        self._growth_tracker.copy_(torch.where(grow, 0, clean_run))
        self._hysteresis_tracker.copy_(hysteresis)

    def _set_scale(self, new_scale: Union[float, torch.Tensor]) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError("new_scale: expected a one-element tensor without grad")
            self._scale.copy_(new_scale.reshape(()))
        else:
            _check_positive("new_scale", new_scale)
            self._scale.fill_(float(new_scale))


def _check_positive(arg: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{arg}: expected a positive number, got {value!r}")
