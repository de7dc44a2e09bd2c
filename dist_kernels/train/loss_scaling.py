"""``--dtype fp16``: dynamic loss scaling (torch's ``GradScaler``, Megatron's and DeepSpeed's
fp16 loss scaler), whatever the layout.

The loss is multiplied by the scale before backward (the pipeline's last stage scales each
micro-batch's loss), so FP16 activations' gradients stay above FP16's smallest normal number.
Before the step the scaler divides the gradients by the scale and checks them for inf / NaN: an
overflow skips the step and halves the scale (after ``hysteresis`` overflows in a row); every
``loss_scale_window`` clean steps double it. Every rank must take the same decision, or the
replicas and the stages would drift apart: our engines use :class:`dist_kernels.LossScaler`
with the world's Communicator, which takes the MAX of the found-inf flag over every rank (tensor
shards and pipeline stages hold different gradients; ZeRO ranks different shards). torch's
engines use torch's ``GradScaler``: DDP's replicas hold equal gradients, and FSDP2's DTensor
gradients have their found-inf flag reduced by DTensor itself.

A skipped step does not advance the learning-rate schedule (``engines._optimizer_step``): it
counts applied updates, as Megatron's (stepped when the update succeeded) and DeepSpeed's
(stepped when there was no overflow) do.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


def make_scaler(cfg: Any, engine: str, world_comm: Any) -> Optional[Any]:
    """The engine's loss scaler at fp16, else None."""
    if cfg.dtype != "fp16":
        return None
    if engine == "torch":
        return torch.amp.GradScaler(
            "cpu", init_scale=cfg.initial_loss_scale, growth_interval=cfg.loss_scale_window
        )
    from ..amp import LossScaler

    return LossScaler(
        init_scale=cfg.initial_loss_scale,
        growth_interval=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis,
        min_scale=cfg.min_loss_scale,
        comm=world_comm,
    )


def scaled_step(scaler: Any, optimizer: Any) -> Tuple[float, bool]:
    """``scaler.step`` and ``update`` (the gradients already unscaled): returns the scale this
    step's gradients carried and whether the step was skipped."""
    scale = scaler.get_scale()
    skipped_before = getattr(scaler, "skipped_steps", None)  # dk.LossScaler counts them
    scaler.step(optimizer)
    scaler.update()
    if skipped_before is not None:
        return scale, scaler.skipped_steps > skipped_before
    # torch's GradScaler (no hysteresis): a skipped step always backs the scale off
    return scale, scaler.get_scale() < scale
