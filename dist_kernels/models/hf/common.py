"""What the families' mappings share: the fused ``qkv``'s layouts, the configuration keys
of Llama's lineage, rope's parameters both ways, small readers of a configuration."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from ..gpt import GPTConfig

_GELU = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}


# Hugging Face activation names -> F.gelu's approximate (gelu_new is the tanh formula too)
_GELU_FROM_HF = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


State = Dict[str, torch.Tensor]


def _split_qkv(config: GPTConfig, qkv: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Our ``qkv`` weight (or bias) -> ``(q, k, v)``, each with its heads in order."""
    g, r, d = config.kv_heads, config.n_heads // config.kv_heads, config.head_dim
    grouped = qkv.reshape(g, r + 2, d, *qkv.shape[1:])
    q = grouped[:, :r].reshape(g * r * d, *qkv.shape[1:])
    k = grouped[:, r].reshape(g * d, *qkv.shape[1:])
    v = grouped[:, r + 1].reshape(g * d, *qkv.shape[1:])
    return q, k, v


def _join_qkv(config: GPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The inverse of :func:`_split_qkv`."""
    g, r, d = config.kv_heads, config.n_heads // config.kv_heads, config.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, r, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (r + 2) * d, *rest)


def _common(config: GPTConfig) -> Dict[str, Any]:
    # no token ids: the model knows none (a tokenizer's are set with it, by its user)
    return {
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _decoder_config(config: GPTConfig) -> Dict[str, Any]:
    """The configuration keys of Llama's lineage (Llama, Nemotron, ...): sizes, heads, biases,
    the attention's dropout, the initialisation."""
    return {
        **_common(config),
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size,
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "attention_dropout": config.attn_dropout,
        "initializer_range": config.init_std,
    }


def _qkv_to_hf(config: GPTConfig, state: State, out: State, i: int, biased: bool) -> None:
    """Block ``i``'s fused ``qkv`` as Llama's ``q_proj``, ``k_proj``, ``v_proj``."""
    for kind in ("weight", "bias") if biased else ("weight",):
        q, k, v = _split_qkv(config, state[f"blocks.{i}.attn.qkv.{kind}"])
        for name, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            out[f"model.layers.{i}.self_attn.{name}.{kind}"] = value


def _qkv_from_hf(config: GPTConfig, state: State, out: State, i: int, biased: bool) -> None:
    """Block ``i``'s ``q_proj``, ``k_proj``, ``v_proj`` as our fused ``qkv``."""
    for kind in ("weight", "bias") if biased else ("weight",):
        names = (f"model.layers.{i}.self_attn.{n}_proj.{kind}" for n in "qkv")
        out[f"blocks.{i}.attn.qkv.{kind}"] = _join_qkv(config, *(state[n] for n in names))


# the branches' output norms, ours and Gemma's / OLMo 2's names
_OUTPUT_NORMS = (
    ("post_attn_norm", "post_attention_layernorm"),
    ("post_mlp_norm", "post_feedforward_layernorm"),
)


def _dropout_rates(hidden: Any, attention: Any) -> Dict[str, Any]:
    """GPTConfig's ``dropout`` and ``attention_dropout`` of a configuration's rates (None or 0:
    none); ``attention_dropout`` stays None where it equals the hidden rate."""
    hidden, attention = float(hidden or 0.0), float(attention or 0.0)
    return {"dropout": hidden, "attention_dropout": None if attention == hidden else attention}


def _get(hf: Dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


def _int_ratio(hidden: int, dim: int) -> Dict[str, Any]:
    """GPTConfig's MLP size: ``mlp_ratio`` when it is a whole multiple, else ``ffn_hidden_size``."""
    if hidden % dim == 0:
        return {"mlp_ratio": hidden // dim}
    return {"ffn_hidden_size": hidden}


def _rope(hf: Dict[str, Any]) -> Tuple[float, Optional[Dict[str, Any]]]:
    """``(rope_theta, rope_scaling)`` of a configuration in transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``, with transformers'
    defaults for what it leaves out (the trained length: ``max_position_embeddings``; yarn's
    attention factor from ``mscale`` / ``mscale_all_dim`` when both are given)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    theta = float(_get(rope, "rope_theta", default=_get(hf, "rope_theta", default=10000.0)))
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"hf: partial_rotary_factor {partial}: rope turns every dimension here")
    rope.pop("rope_theta", None)
    if kind == "default":
        return theta, None
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind not in ("linear", "llama3", "yarn", "longrope"):
        raise ValueError(
            f"hf: rope_type {kind!r}: only the default, 'linear', 'llama3', 'yarn' and "
            "'longrope' rotary embeddings"
        )
    if kind in ("llama3", "yarn", "longrope"):
        trained = hf.get("original_max_position_embeddings") or hf["max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", trained)
    if kind == "longrope" and rope.get("factor") is None:  # transformers' default
        rope["factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    if kind == "yarn":
        mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
        if rope.get("factor") is None:
            rope["factor"] = (
                hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
            )
        if rope.get("attention_factor") is None and mscale and mscale_all_dim:

            def m(scale: float) -> float:  # YaRN's 0.1 * scale * ln(factor) + 1
                return 0.1 * scale * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0

            rope["attention_factor"] = m(mscale) / m(mscale_all_dim)
        for beta in ("beta_fast", "beta_slow"):  # transformers reads a None as the default
            if rope.get(beta) is None:
                rope.pop(beta, None)
    return theta, {"rope_type": kind, **rope}


def _rope_parameters(config: GPTConfig) -> Dict[str, Any]:
    """transformers 5's ``rope_parameters`` of ``config``'s rope."""
    return {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}


def _decoder_shape_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """GPTConfig's sizes and heads of a configuration of Llama's lineage (Llama, Nemotron)."""
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return dict(
        vocab_size=hf["vocab_size"],
        block_size=hf["max_position_embeddings"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=_get(hf, "num_key_value_heads", default=heads),
        dim=dim,
        kv_channels=None if head_dim in (None, dim // heads) else head_dim,
        **_int_ratio(hf["intermediate_size"], dim),
    )
