"""Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron) both ways: LayerNorms of
``1 + w`` with biases, an ungated squared-ReLU MLP (``up_proj``, ``down_proj``), rope over
``partial_rotary_factor`` of each head."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..gpt import GPTConfig
from .common import (
    State,
    _decoder_config,
    _decoder_shape_from_hf,
    _dropout_rates,
    _qkv_from_hf,
    _qkv_to_hf,
    _rope_parameters,
)


def _nemotron_pairs(i: int, bias: bool) -> List[Tuple[str, str]]:
    """Block ``i``'s tensors but the fused ``qkv``, ``(ours, theirs)``: Llama's names, norms
    with their biases, an MLP of ``up_proj`` and ``down_proj`` only."""
    ours, theirs = f"blocks.{i}", f"model.layers.{i}"
    renamed = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
    pairs = [(f"{ours}.{a}.{kind}", f"{theirs}.{b}.{kind}")
             for a, b in renamed.items() for kind in ("weight", "bias")]  # fmt: skip
    linear = {"attn.proj": "self_attn.o_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
    for kind in ("weight", "bias") if bias else ("weight",):
        pairs += [(f"{ours}.{a}.{kind}", f"{theirs}.{b}.{kind}") for a, b in linear.items()]
    return pairs


def _to_nemotron(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    """Nemotron: its LayerNorm1P stores ``w`` and scales by ``1 + w``, as ours."""
    hf = {
        "model_type": "nemotron",
        **_decoder_config(config),
        "hidden_act": "relu2",
        "norm_eps": config.norm_eps,
        "rope_parameters": {
            **_rope_parameters(config),
            "partial_rotary_factor": config.rotary_percent,
        },  # fmt: skip
    }
    out = {"model.embed_tokens.weight": state["embedding.wte.weight"]}
    for i in range(config.n_layers):
        for ours, theirs in _nemotron_pairs(i, config.bias):
            out[theirs] = state[ours]
        _qkv_to_hf(config, state, out, i, config.bias)
    out["model.norm.weight"], out["model.norm.bias"] = (
        state["head.ln_f.weight"], state["head.ln_f.bias"])  # fmt: skip
    out["lm_head.weight"] = state["head.lm_head.weight"]
    return hf, out


def _from_nemotron(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    if hf.get("hidden_act", "relu2") != "relu2":
        raise ValueError(f"hf: Nemotron hidden_act {hf['hidden_act']!r}: only 'relu2'")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ValueError("hf: Nemotron with attention_bias != mlp_bias has no counterpart here")
    rope = dict(hf.get("rope_parameters") or {})
    partial = rope.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"hf: Nemotron with rope_type {rope['rope_type']!r}: only 'default'")
    bias = bool(hf.get("attention_bias", False))
    config = GPTConfig(
        **_decoder_shape_from_hf(hf),
        norm_eps=hf.get("norm_eps", 1e-5),
        normalization="layernorm",
        norm_unit_offset=True,
        squared_relu=True,
        position_embedding="rope",
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_percent=float(partial),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **_dropout_rates(None, hf.get("attention_dropout")),
        bias=bias,
        norm_bias=None if bias else True,
    )
    out = {"embedding.wte.weight": state["model.embed_tokens.weight"]}
    for i in range(config.n_layers):
        for ours, theirs in _nemotron_pairs(i, bias):
            out[ours] = state[theirs]
        _qkv_from_hf(config, state, out, i, bias)
    out["head.ln_f.weight"], out["head.ln_f.bias"] = (
        state["model.norm.weight"], state["model.norm.bias"])  # fmt: skip
    out["head.lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return config, out
