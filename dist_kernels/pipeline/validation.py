"""The optimizer step of a pipeline, validated after it starts (zero-bubble's post-validation).

Before a pipeline's optimizer steps it needs one verdict on the gradients of every stage:
whether any is inf or NaN, and their global norm (to clip). That is an all-reduce over the
pipeline ranks, and every rank waits for it (Qi et al. call it the optimizer synchronisation;
bypassing it is worth about 8% to them). :class:`ValidatedOptimizer` starts the step at once
instead, with the all-reduce of the rank's squared gradient norm in flight, then checks::

    pre-validation (post_validation=False)   all-reduce -> wait -> verdict -> [clip] -> step
    post-validation                           all-reduce -> save -> step -> wait -> verdict
                                              non-finite: restore, skip
                                              norm > max_norm: restore, clip, step again

Restoring puts back every parameter and every optimizer state tensor bitwise as they were
(the state a first step creates is removed again), so a rolled-back step leaves no trace. Both
orders compute the verdict and the clipping the same way, so they give bitwise the same
parameters. The optimizer must not modify ``.grad`` in place (torch's optimizers do not).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

__all__ = ["ValidatedOptimizer"]


class ValidatedOptimizer:
    """``optimizer.step()`` with a global non-finite check and optional norm clipping.

    Args:
        optimizer: a torch optimizer over this rank's parameters.
        comm: the communicator whose ranks together hold every parameter once (a pipeline's
            ``pipe.comm``; data-parallel replicas already hold averaged gradients). Its
            ``all_reduce`` must take ``async_op=True`` for post-validation to overlap.
        max_norm: clip the gradients to this global 2-norm (as
            ``torch.nn.utils.clip_grad_norm_``); None: no clipping.
        post_validation: start the step before the verdict arrives (module docstring).

    After :meth:`step`: :attr:`grad_norm` (global), :attr:`found_inf`, :attr:`rolled_back`
    (the speculative step was undone).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        comm: Any,
        *,
        max_norm: Optional[float] = None,
        post_validation: bool = True,
    ) -> None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None), got {max_norm}")
        self.optimizer, self.comm = optimizer, comm
        self.max_norm, self.post_validation = max_norm, bool(post_validation)
        self.grad_norm = 0.0
        self.found_inf = False
        self.rolled_back = False
        self._saved_params: List[torch.Tensor] = []
        self._saved_state: Dict[Any, Dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> bool:
        """Steps unless some gradient is non-finite; returns whether the step was applied."""
        self.rolled_back = False
        verdict = self._local_square_norm()
        if not self.post_validation:
            self._all_reduce(verdict, wait=True)
            return self._apply(verdict)
        work = self._all_reduce(verdict, wait=False)
        saved = self._save()
        self.optimizer.step()
        if work is not None:
            work.wait()
        if self._read(verdict) and not self._needs_clip():
            return True
        self._restore(saved)
        self.rolled_back = True
        return self._apply(verdict)

    # ----------------------------------------------------------------- the verdict

    def _params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _local_square_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self._params() if p.grad is not None]
        total = torch.zeros(1, dtype=torch.float64)
        if grads:
            norms = torch._foreach_norm(grads)
            total += torch.stack([n.double() for n in norms]).square().sum()
        return total

    def _all_reduce(self, verdict: torch.Tensor, wait: bool):
        if self.comm is None or self.comm.world_size == 1:
            return None
        if wait:
            self.comm.all_reduce(verdict)
            return None
        return self.comm.all_reduce(verdict, async_op=True)

    def _read(self, verdict: torch.Tensor) -> bool:
        """Records the global norm; True if every gradient was finite."""
        square = verdict.item()
        self.found_inf = not math.isfinite(square)
        self.grad_norm = math.sqrt(square) if not self.found_inf else float("inf")
        return not self.found_inf

    def _needs_clip(self) -> bool:
        return self.max_norm is not None and self.grad_norm > self.max_norm

    def _apply(self, verdict: torch.Tensor) -> bool:
        """The step after the verdict: skipped when non-finite, clipped when too large."""
        if not self._read(verdict):
            return False
        if self._needs_clip():
            grads = [p.grad for p in self._params() if p.grad is not None]
            torch._foreach_mul_(grads, self.max_norm / (self.grad_norm + 1e-6))
        self.optimizer.step()
        return True

    # ----------------------------------------------------------------- save and restore

    def _save(self) -> Dict[Any, Dict[str, Any]]:
        """Copies of the parameters and of the optimizer state, into buffers kept for reuse."""
        params = self._params()
        if len(self._saved_params) != len(params):
            self._saved_params = [torch.empty_like(p) for p in params]
        with torch.no_grad():
            torch._foreach_copy_(self._saved_params, [p.detach() for p in params])
        saved: Dict[Any, Dict[str, Any]] = {}
        for p in params:
            entry = self.optimizer.state.get(p)
            if entry is None:
                continue
            buffers = self._saved_state.setdefault(p, {})
            saved[p] = {}
            for key, value in entry.items():
                if torch.is_tensor(value):
                    held = buffers.get(key)
                    if held is None or held.shape != value.shape or held.dtype != value.dtype:
                        held = buffers[key] = torch.empty_like(value)
                    held.copy_(value)
                    saved[p][key] = held
                else:
                    saved[p][key] = value
        return saved

    def _restore(self, saved: Dict[Any, Dict[str, Any]]) -> None:
        params = self._params()
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in params], self._saved_params)
        for p in params:
            if p not in saved:
                self.optimizer.state.pop(p, None)  # created by the undone step
                continue
            entry = self.optimizer.state[p]
            for key in [k for k in entry if k not in saved[p]]:
                del entry[key]
            for key, value in saved[p].items():
                if torch.is_tensor(value) and torch.is_tensor(entry.get(key)):
                    entry[key].copy_(value)
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
