"""Rotary position embeddings (Su et al. 2021) and the ways long-context models stretch them.

Each pair of dimensions ``(i, i + d / 2)`` of a head of width ``d`` turns by ``p * f_i`` at
position ``p``, with ``f_i = theta^(-2i / d)`` (the halves layout of Llama's Hugging Face port
and Megatron's default). A model trained on ``L`` positions has seen every pair turn only as
far as ``L * f_i``; the scalings change the ``f_i`` so that a longer context stays within the
angles training saw, and are named as Hugging Face's ``rope_parameters`` name them:

``linear``  every ``f_i / factor`` (position interpolation, Chen et al. 2023; Megatron's
            ``--rotary-seq-len-interpolation-factor``).
``llama3``  Llama 3.1's: pairs whose wavelength ``2 pi / f_i`` is shorter than
            ``L / high_freq_factor`` kept, longer than ``L / low_freq_factor`` divided by
            ``factor``, the band between blended (``L`` = ``original_max_position_embeddings``;
            Megatron's ``--use-rope-scaling``).
``yarn``    YaRN (Peng et al. 2023): pairs turning more than ``beta_fast`` times over ``L`` kept,
            fewer than ``beta_slow`` times divided by ``factor``, a linear ramp over the
            dimensions between; and ``cos`` / ``sin`` multiplied by ``attention_factor``
            (``0.1 ln(factor) + 1`` unless given), which scales the attention logits by its
            square (Qwen3's and DeepSeek's long-context setting).

The tables are computed in FP64 and applied in FP32 (FP64 for an FP64 input)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["ROPE_SCALINGS", "rope_scaling_checked", "rope_frequencies", "rope_tables", "apply_rope"]

# Each kind's keys and their defaults (None: required). llama3's are Llama 3.1's release values
# (also Megatron's fixed ones); yarn's betas are the paper's.
_KEYS: Dict[str, Dict[str, Any]] = {
    "linear": {"factor": None},
    "llama3": {
        "factor": None,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "factor": None,
        "original_max_position_embeddings": None,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": None,  # resolved from factor
        "truncate": True,
    },
}
ROPE_SCALINGS = tuple(_KEYS)


def rope_scaling_checked(scaling: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``scaling`` complete (defaults filled, yarn's attention factor resolved, numbers as
    float / int) or None for none; a ValueError names what is wrong. Idempotent, so a
    configuration read back from JSON compares equal to the one written."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict) or scaling.get("rope_type") not in _KEYS:
        raise ValueError(
            f"rope_scaling: a dict whose rope_type is one of {ROPE_SCALINGS}, got {scaling!r}"
        )
    kind = scaling["rope_type"]
    unknown = sorted(set(scaling) - set(_KEYS[kind]) - {"rope_type"})
    if unknown:
        raise ValueError(
            f"rope_scaling {kind!r}: unknown keys {unknown} (known: {list(_KEYS[kind])})"
        )
    out: Dict[str, Any] = {"rope_type": kind}
    for key, default in _KEYS[kind].items():
        value = scaling.get(key, default)
        if value is None and key != "attention_factor":
            raise ValueError(f"rope_scaling {kind!r}: {key} is required")
        out[key] = value
    out["factor"] = _positive(kind, "factor", out["factor"])
    if kind == "llama3":
        low = _positive(kind, "low_freq_factor", out["low_freq_factor"])
        high = _positive(kind, "high_freq_factor", out["high_freq_factor"])
        if not low < high:
            raise ValueError(f"rope_scaling 'llama3': low_freq_factor({low}) must be below "
                             f"high_freq_factor({high})")  # fmt: skip
        out.update(low_freq_factor=low, high_freq_factor=high)
    if kind == "yarn":
        fast = _positive(kind, "beta_fast", out["beta_fast"])
        slow = _positive(kind, "beta_slow", out["beta_slow"])
        if out["attention_factor"] is None:  # the paper's sqrt(1/t) = 0.1 ln(s) + 1
            out["attention_factor"] = 0.1 * math.log(out["factor"]) + 1.0
        attention = _positive(kind, "attention_factor", out["attention_factor"])
        out.update(beta_fast=fast, beta_slow=slow, attention_factor=attention)
        out["truncate"] = bool(out["truncate"])
    if "original_max_position_embeddings" in out:
        length = out["original_max_position_embeddings"]
        if isinstance(length, float) and length.is_integer():
            length = int(length)
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"rope_scaling {kind!r}: original_max_position_embeddings must "
                             f"be a positive int, got {length!r}")  # fmt: skip
        out["original_max_position_embeddings"] = length
    return out


def _positive(kind: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rope_scaling {kind!r}: {key} must be a positive number, got {value!r}")
    return float(value)


def rope_frequencies(
    head_dim: int, theta: float, scaling: Optional[Dict[str, Any]] = None
) -> Tuple[torch.Tensor, float]:
    """``(f, attention_factor)``: each dimension pair's turn per position (FP64,
    ``[head_dim / 2]``) and the factor on ``cos`` / ``sin`` (1 but for yarn), for a complete
    ``scaling`` (:func:`rope_scaling_checked`) or None."""
    freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freq, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return freq / factor, 1.0
    if kind == "llama3":
        return _llama3(freq, scaling), 1.0
    return _yarn(freq, head_dim, theta, scaling), scaling["attention_factor"]


def _llama3(freq: torch.Tensor, s: Dict[str, Any]) -> torch.Tensor:
    # Short wavelengths (many turns over the trained length) resolve nearby tokens: keep them;
    # long ones never completed a turn in training: interpolate them; blend the band between
    # by where the pair's turn count over the trained length falls between the two factors
    length, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelength = 2 * math.pi / freq
    weight = ((length / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 1: keep, 0: divide
    return (1 - weight) * freq / factor + weight * freq


def _yarn(freq: torch.Tensor, head_dim: int, theta: float, s: Dict[str, Any]) -> torch.Tensor:
    length, factor = s["original_max_position_embeddings"], s["factor"]

    def dimension(turns: float) -> float:  # the pair index that turns `turns` times over length
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dimension(s["beta_fast"]), dimension(s["beta_slow"])
    if s["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:  # a step, not a ramp
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0.0, 1.0)
    return freq / factor * ramp + freq * (1 - ramp)  # ramp 0: fast pairs kept as trained


def rope_tables(
    pos: torch.Tensor, head_dim: int, theta: float, scaling: Optional[Dict[str, Any]] = None
):
    """``(cos, sin)``, each ``[len(pos), head_dim]`` in FP64: position ``p`` turns dimension
    ``i`` and ``i + head_dim / 2`` together by ``p * f_i`` (:func:`rope_frequencies`), both
    multiplied by the scaling's attention factor."""
    freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
    angles = pos.to(torch.float64)[:, None] * freq.to(pos.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., s, d]`` turned by the tables of its ``s`` positions, computed in FP32 (FP64
    for an FP64 ``x``) and returned in ``x``'s dtype. Tables narrower than ``d`` (``r``
    columns: partial rotary) turn the first ``r`` dimensions and pass the rest."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    half = x.shape[-1] // 2
    xf = x.to(dtype)
    turned = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.to(dtype) + turned * sin.to(dtype)).to(x.dtype)
