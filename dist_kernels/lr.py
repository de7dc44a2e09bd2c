"""Learning-rate helpers: scaling with the global batch, warm-up then a decay.

    lr = dk.lr.scale_lr(3e-4, global_batch=512, base_batch=64, rule="sqrt")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = dk.lr.warmup_cosine(opt, warmup_steps=100, total_steps=10_000, min_ratio=0.1)
    for step in range(10_000): ...; opt.step(); sched.step()

The schedulers are ``torch.optim.lr_scheduler.LambdaLR`` objects, so they work in any loop and
with any optimizer (ours included: :class:`dist_kernels.ShardedOptimizer` exposes its shards'
``param_groups``). The multiplier functions are public too (``warmup_cosine_factor``), for loops
that set the rate themselves.

Formulas (``s`` = steps taken, ``W`` = warm-up steps, ``T`` = total steps, ``m`` = min_ratio)::

    warm-up   s < W:   (s + 1) / W                      reaches 1 on the W-th step
    cosine    s >= W:  m + (1 - m) * (1 + cos(pi * p)) / 2,  p = min(1, (s - W) / (T - W))
    linear    s >= W:  m + (1 - m) * (1 - p)
    constant  s >= W:  1
    wsd       s >= W:  1 until T - D, then m + (1 - m) * c(q),  q = min(1, (s - T + D) / D)
                       c: linear 1 - q, cosine (1 + cos(pi q)) / 2, minus_sqrt 1 - sqrt(q),
                       exponential 2 * 0.5^q - 1

``wsd`` is warm-up, stable, decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024 for
``minus_sqrt``): the rate holds at its peak and decays over the last ``D`` steps only, so a run
can be extended from any checkpoint before its decay. Its tails are Megatron's
``--lr-wsd-decay-style`` formulas.

Scaling rules for a batch ``B`` against a reference ``B0`` tuned at ``lr0``: ``linear``
(Goyal et al. 2017, SGD) ``lr0 * B / B0``; ``sqrt`` (Krizhevsky 2014; Adam-type optimizers)
``lr0 * sqrt(B / B0)``; ``none`` ``lr0``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Literal

import torch

__all__ = [
    "SCALING_RULES",
    "scale_lr",
    "WSD_STYLES",
    "warmup_cosine_factor",
    "warmup_constant_factor",
    "warmup_linear_factor",
    "warmup_stable_decay_factor",
    "warmup_cosine",
    "warmup_constant",
    "warmup_linear",
    "warmup_stable_decay",
]

# the shapes of warmup_stable_decay's tail: 1 at q = 0, 0 at q = 1
_WSD_TAILS: Dict[str, Callable[[float], float]] = {
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (1.0 + math.cos(math.pi * q)),
    "minus_sqrt": lambda q: 1.0 - math.sqrt(q),
    "exponential": lambda q: 2.0 * 0.5**q - 1.0,
}
WSD_STYLES = tuple(_WSD_TAILS)

ScalingRule = Literal["none", "linear", "sqrt"]
SCALING_RULES = ("none", "linear", "sqrt")


def scale_lr(base_lr: float, global_batch: int, base_batch: int, rule: ScalingRule) -> float:
    """``base_lr`` (tuned at ``base_batch`` samples) scaled for ``global_batch`` by ``rule``."""
    if rule not in SCALING_RULES:
        raise ValueError(f"rule: must be one of {SCALING_RULES}, got {rule!r}")
    if global_batch < 1 or base_batch < 1:
        raise ValueError(f"global_batch({global_batch}) and base_batch({base_batch}) must be >= 1")
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def _check_steps(warmup_steps: int, total_steps: int) -> None:
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")


def _check_ratio(min_ratio: float) -> None:
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")


def _after_warmup(warmup_steps: int, after: Callable[[int], float]) -> Callable[[int], float]:
    """The multiplier of step ``s``: ``(s + 1) / W`` during the warm-up (the full rate on its
    last step), then ``after(s)``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return after(step)

    return factor


def _decay(min_ratio: float, shape: Callable[[float], float], start: int, steps: int):
    """``m + (1 - m) shape(p)`` with ``p`` going from 0 at step ``start`` to 1 at ``start +
    steps`` (held there after)."""
    return lambda step: min_ratio + (1.0 - min_ratio) * shape(min(1.0, (step - start) / steps))


def warmup_constant_factor(warmup_steps: int) -> Callable[[int], float]:
    """Multiplier of step ``s``: linear warm-up over ``warmup_steps``, then 1."""
    _check_steps(warmup_steps, 1)
    return _after_warmup(warmup_steps, lambda step: 1.0)


def _warmup_then_decay(
    warmup_steps: int, total_steps: int, min_ratio: float, shape: str
) -> Callable[[int], float]:
    """Linear warm-up, then a decay of ``shape`` from the peak to ``min_ratio`` at
    ``total_steps`` (held there after)."""
    _check_steps(warmup_steps, total_steps)
    _check_ratio(min_ratio)
    steps = max(1, total_steps - warmup_steps)
    return _after_warmup(warmup_steps, _decay(min_ratio, _WSD_TAILS[shape], warmup_steps, steps))


def warmup_cosine_factor(
    warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> Callable[[int], float]:
    """Multiplier of step ``s``: linear warm-up, then cosine decay to ``min_ratio`` at
    ``total_steps`` (held there after)."""
    return _warmup_then_decay(warmup_steps, total_steps, min_ratio, "cosine")


def warmup_linear_factor(
    warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> Callable[[int], float]:
    """Multiplier of step ``s``: linear warm-up, then linear decay to ``min_ratio`` at
    ``total_steps`` (held there after)."""
    return _warmup_then_decay(warmup_steps, total_steps, min_ratio, "linear")


def warmup_stable_decay_factor(
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    min_ratio: float = 0.0,
    style: str = "linear",
) -> Callable[[int], float]:
    """Multiplier of step ``s``: linear warm-up, the peak until ``total_steps -
    decay_steps``, then a decay of shape ``style`` (:data:`WSD_STYLES`) to ``min_ratio`` at
    ``total_steps`` (held there after)."""
    _check_steps(warmup_steps, total_steps)
    _check_ratio(min_ratio)
    if style not in _WSD_TAILS:
        raise ValueError(f"style must be one of {WSD_STYLES}, got {style!r}")
    if not 1 <= decay_steps <= total_steps - warmup_steps:
        raise ValueError(
            f"decay_steps({decay_steps}) must be in [1, total_steps({total_steps}) - "
            f"warmup_steps({warmup_steps})]"
        )
    start = total_steps - decay_steps
    decay = _decay(min_ratio, _WSD_TAILS[style], start, decay_steps)
    return _after_warmup(warmup_steps, lambda step: 1.0 if step < start else decay(step))


def warmup_linear(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
    last_epoch: int = -1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`warmup_linear_factor`."""
    return _lambda_lr(
        optimizer, warmup_linear_factor(warmup_steps, total_steps, min_ratio), last_epoch
    )


def warmup_stable_decay(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    min_ratio: float = 0.0,
    style: str = "linear",
    last_epoch: int = -1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`warmup_stable_decay_factor`."""
    factor = warmup_stable_decay_factor(warmup_steps, total_steps, decay_steps, min_ratio, style)
    return _lambda_lr(optimizer, factor, last_epoch)


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
    last_epoch: int = -1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`warmup_cosine_factor` (``last_epoch`` = steps already taken
    minus one, for resuming)."""
    return _lambda_lr(
        optimizer, warmup_cosine_factor(warmup_steps, total_steps, min_ratio), last_epoch
    )


def warmup_constant(
    optimizer: torch.optim.Optimizer, warmup_steps: int, last_epoch: int = -1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`warmup_constant_factor`."""
    return _lambda_lr(optimizer, warmup_constant_factor(warmup_steps), last_epoch)


def _lambda_lr(optimizer, factor, last_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    if last_epoch >= 0:
        # LambdaLR resumes from ``initial_lr``; a fresh optimizer does not have it yet.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=last_epoch)
