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
``longrope`` LongRoPE (Ding et al. 2024; Phi-3's 128k models, Phi-3.5, Phi-4-mini): each pair's
            frequency divided by its own searched factor, ``short_factor[i]`` while the
            sequence (the largest position + 1) is within ``L``, ``long_factor[i]`` beyond it,
            so the same weights run the two regimes; ``cos`` / ``sin`` multiplied by
            ``attention_factor`` (``sqrt(1 + ln(factor) / ln(L))`` unless given).

The tables are computed in FP64 and applied in FP32 (FP64 for an FP64 input)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = [
    "ROPE_SCALINGS",
    "apply_rope",
    "pairs_checked",
    "rope_frequencies",
    "rope_scaling_checked",
    "rope_tables",
]

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
    "longrope": {
        "factor": None,
        "original_max_position_embeddings": None,
        "short_factor": None,
        "long_factor": None,
        "attention_factor": None,  # resolved from factor and the trained length
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
    if kind == "longrope":
        out["short_factor"] = _factors(out["short_factor"], "short_factor")
        out["long_factor"] = _factors(out["long_factor"], "long_factor")
        if len(out["short_factor"]) != len(out["long_factor"]):
            raise ValueError(
                f"rope_scaling 'longrope': short_factor has {len(out['short_factor'])} entries "
                f"and long_factor {len(out['long_factor'])}; one per dimension pair each"
            )
    if "original_max_position_embeddings" in out:
        length = out["original_max_position_embeddings"]
        if isinstance(length, float) and length.is_integer():
            length = int(length)
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"rope_scaling {kind!r}: original_max_position_embeddings must "
                             f"be a positive int, got {length!r}")  # fmt: skip
        out["original_max_position_embeddings"] = length
    if kind == "longrope":
        if out["attention_factor"] is None:  # the paper's; transformers' default
            factor, length = out["factor"], out["original_max_position_embeddings"]
            stretch = math.log(factor) / math.log(length) if factor > 1 and length > 1 else 0.0
            out["attention_factor"] = math.sqrt(1 + stretch)
        out["attention_factor"] = _positive(kind, "attention_factor", out["attention_factor"])
    return out


def _factors(values: Any, key: str) -> List[float]:
    """A longrope factor list as floats, each positive."""
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(
            f"rope_scaling 'longrope': {key} must be a list of numbers, got {values!r}"
        )
    return [_positive("longrope", key, v) for v in values]


def pairs_checked(scaling: Optional[Dict[str, Any]], rotary_dim: int) -> None:
    """A ValueError when a longrope scaling's factor lists are not one per dimension pair of
    a rotary embedding ``rotary_dim`` wide."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        if len(scaling["short_factor"]) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling 'longrope': {len(scaling['short_factor'])} factors for a rotary "
                f"embedding of {rotary_dim} dimensions ({rotary_dim // 2} pairs)"
            )


def _positive(kind: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rope_scaling {kind!r}: {key} must be a positive number, got {value!r}")
    return float(value)


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: Optional[Dict[str, Any]] = None,
    length: Optional[int] = None,
) -> Tuple[torch.Tensor, float]:
    """``(f, attention_factor)``: each dimension pair's turn per position (FP64,
    ``[head_dim / 2]``) and the factor on ``cos`` / ``sin`` (1 but for yarn and longrope), for
    a complete ``scaling`` (:func:`rope_scaling_checked`) or None. ``length``: the sequence's
    (its largest position + 1), which longrope's choice of factors depends on (None: short)."""
    freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freq, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return freq / factor, 1.0
    if kind == "llama3":
        return _llama3(freq, scaling), 1.0
    if kind == "longrope":
        pairs_checked(scaling, head_dim)
        long = length is not None and length > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=freq.dtype)
        return freq / ext, scaling["attention_factor"]
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
    pos: torch.Tensor,
    head_dim: int,
    theta: float,
    scaling: Optional[Dict[str, Any]] = None,
    length: Optional[int] = None,
):
    """``(cos, sin)``, each ``[len(pos), head_dim]`` in FP64: position ``p`` turns dimension
    ``i`` and ``i + head_dim / 2`` together by ``p * f_i`` (:func:`rope_frequencies`, given
    ``length``), both multiplied by the scaling's attention factor."""
    freq, attention_factor = rope_frequencies(head_dim, theta, scaling, length)
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
