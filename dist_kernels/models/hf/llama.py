"""Llama (``LlamaForCausalLM``) both ways, and the families that are Llama with an option:
Mistral (a window), Phi-3 (fused projections, partial rotary), Qwen2 (biased q / k / v),
Qwen3 (per-head q / k norms), OLMo 2 (norms of the branches' outputs only)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..gpt import GPTConfig
from .common import (
    _OUTPUT_NORMS,
    State,
    _decoder_config,
    _decoder_shape_from_hf,
    _dropout_rates,
    _get,
    _qkv_from_hf,
    _qkv_to_hf,
    _rope,
    _rope_parameters,
)


def _llama_pairs(i: int, bias: bool, mlp: bool = True, norms: bool = True) -> List[Tuple[str, str]]:
    """Block ``i``'s tensors that Llama names otherwise, ``(ours, theirs)`` (the fused
    ``qkv`` apart; ``mlp=False``: an MoE block's, whose experts Mixtral stacks; ``norms=False``:
    a block without pre-norms, OLMo 2's)."""
    ours, theirs = f"blocks.{i}", f"model.layers.{i}"
    pairs = [
        (f"{ours}.ln_1.weight", f"{theirs}.input_layernorm.weight"),
        (f"{ours}.ln_2.weight", f"{theirs}.post_attention_layernorm.weight"),
    ] if norms else []  # fmt: skip
    renamed = {"attn.proj": "self_attn.o_proj", "mlp.fc": "mlp.up_proj",
               "mlp.gate": "mlp.gate_proj", "mlp.proj": "mlp.down_proj"}  # fmt: skip
    if not mlp:
        renamed = {"attn.proj": "self_attn.o_proj"}
    for kind in ("weight", "bias") if bias else ("weight",):
        pairs += [(f"{ours}.{a}.{kind}", f"{theirs}.{b}.{kind}") for a, b in renamed.items()]
    return pairs


def _to_llama(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf = {
        "model_type": "llama",
        **_decoder_config(config),
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": _rope_parameters(config),
    }
    out = {"model.embed_tokens.weight": state["embedding.wte.weight"]}
    for i in range(config.n_layers):
        pairs = _llama_pairs(i, config.bias, not config.is_moe_block(i), config.pre_norms)
        for ours, theirs in pairs:
            out[theirs] = state[ours]
        _qkv_to_hf(config, state, out, i, config.bias or config.qkv_bias)
    out["model.norm.weight"] = state["head.ln_f.weight"]
    out["lm_head.weight"] = state["head.lm_head.weight"]
    return hf, out


def _to_llama_unbiased(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    """Llama's configuration less its bias switches, for the families that have none."""
    hf, out = _to_llama(config, state)
    for key in ("attention_bias", "mlp_bias"):
        del hf[key]
    return hf, out


def _to_mistral(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    hf.update(model_type="mistral", sliding_window=config.sliding_window)
    return hf, out


def _to_phi3(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    hf.update(
        model_type="phi3",
        sliding_window=config.sliding_window,
        original_max_position_embeddings=(config.rope_scaling or {}).get(
            "original_max_position_embeddings", config.block_size
        ),
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        pad_token_id=None,  # Phi3Config's default, 32000, names an id of Phi-3's vocabulary
    )
    hf["rope_parameters"]["partial_rotary_factor"] = config.rotary_percent
    for i in range(config.n_layers):
        at = f"model.layers.{i}"
        qkv = [out.pop(f"{at}.self_attn.{n}_proj.weight") for n in "qkv"]
        out[f"{at}.self_attn.qkv_proj.weight"] = torch.cat(qkv)  # [q heads | k heads | v heads]
        gate_up = [out.pop(f"{at}.mlp.{n}_proj.weight") for n in ("gate", "up")]
        out[f"{at}.mlp.gate_up_proj.weight"] = torch.cat(gate_up)  # chunk(2): gate, then up
    return hf, out


def _to_olmo2(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    hf.update(model_type="olmo2", pad_token_id=None)
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for a, b in _OUTPUT_NORMS:
            out[f"{theirs}.{b}.weight"] = state[f"{ours}.{a}.weight"]
        for norm in ("q_norm", "k_norm"):  # over every head's features
            out[f"{theirs}.self_attn.{norm}.weight"] = state[f"{ours}.attn.{norm}.weight"]
    return hf, out


def _from_olmo2(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    """OLMo 2: Llama without the pre-norms, the branches' outputs normalised, and the query /
    key norms over every head's features."""
    extra = dict(pre_norms=False, post_norms=True, qk_norm=True, qk_norm_scope="all")
    config, out = _from_llama({**hf, "attention_bias": False, "mlp_bias": False}, state, extra)
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for a, b in _OUTPUT_NORMS:
            out[f"{ours}.{a}.weight"] = state[f"{theirs}.{b}.weight"]
        for norm in ("q_norm", "k_norm"):
            out[f"{ours}.attn.{norm}.weight"] = state[f"{theirs}.self_attn.{norm}.weight"]
    return config, out


def _to_qwen2(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    hf.update(model_type="qwen2", use_sliding_window=False, sliding_window=None)
    return hf, out


def _to_qwen3(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama(config, state)
    del hf["mlp_bias"]
    hf.update(model_type="qwen3", use_sliding_window=False, sliding_window=None)
    for i in range(config.n_layers):
        for norm in ("q_norm", "k_norm"):
            out[f"model.layers.{i}.self_attn.{norm}.weight"] = state[
                f"blocks.{i}.attn.{norm}.weight"
            ]
    return hf, out


def _from_llama(
    hf: Dict[str, Any], state: State, moe: Optional[Dict[str, Any]] = None
) -> Tuple[GPTConfig, State]:
    """Llama, or with ``moe`` (more GPTConfig fields: Mixtral's MoE, Qwen2's ``qkv_bias``,
    Qwen3's ``qk_norm``) its variants' attention, norms and embeddings (the rest is the
    caller's)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hf: Llama hidden_act {hf['hidden_act']!r}: only 'silu' (SwiGLU)")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ValueError("hf: Llama with attention_bias != mlp_bias has no counterpart here")
    bias, (theta, scaling) = bool(hf.get("attention_bias", False)), _rope(hf)
    config = GPTConfig(
        **_decoder_shape_from_hf(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        normalization="rmsnorm",
        swiglu=True,
        position_embedding="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Llama has an attention dropout only; Phi-3 a residual one too
        **_dropout_rates(hf.get("resid_pdrop"), hf.get("attention_dropout")),
        bias=bias,
        **(moe or {}),
    )
    out = {"embedding.wte.weight": state["model.embed_tokens.weight"]}
    for i in range(config.n_layers):
        for ours, theirs in _llama_pairs(i, bias, not config.is_moe_block(i), config.pre_norms):
            out[ours] = state[theirs]
        _qkv_from_hf(config, state, out, i, bias or config.qkv_bias)
    out["head.ln_f.weight"] = state["model.norm.weight"]
    out["head.lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return config, out


def _from_mistral(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    if hf.get("layer_types") and len(set(hf["layer_types"])) > 1:
        raise ValueError(f"hf: Mistral with mixed layer_types {sorted(set(hf['layer_types']))}")
    plain = {**hf, "attention_bias": False, "mlp_bias": False}
    return _from_llama(plain, state, {"sliding_window": hf.get("sliding_window")})


def _from_phi3(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    """Phi-3's fused projections split into Llama's, then Llama with Phi-3's window and
    partial rotary (and longrope, the 128k variants' scaling, through the rope mapping)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    partial = rope.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    plain = {**hf, "attention_bias": False, "mlp_bias": False, "partial_rotary_factor": None}
    plain["rope_parameters"], plain["rope_scaling"] = rope, None
    heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    kv = _get(hf, "num_key_value_heads", default=heads)
    d = hf.get("head_dim") or dim // heads
    llama = dict(state)
    for i in range(hf["num_hidden_layers"]):
        at = f"model.layers.{i}"
        q, k, v = llama.pop(f"{at}.self_attn.qkv_proj.weight").split([heads * d, kv * d, kv * d])
        for name, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            llama[f"{at}.self_attn.{name}.weight"] = value
        gate, up = llama.pop(f"{at}.mlp.gate_up_proj.weight").chunk(2)
        llama[f"{at}.mlp.gate_proj.weight"], llama[f"{at}.mlp.up_proj.weight"] = gate, up
    extra = {"sliding_window": hf.get("sliding_window"), "rotary_percent": float(partial)}
    return _from_llama(plain, llama, extra)


def _from_qwen2(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    if hf.get("use_sliding_window"):
        raise ValueError("hf: Qwen2 with use_sliding_window=True has no counterpart here")
    return _from_llama(
        {**hf, "attention_bias": False, "mlp_bias": False}, state, {"qkv_bias": True}
    )


def _from_qwen3(
    hf: Dict[str, Any], state: State, moe: Optional[Dict[str, Any]] = None
) -> Tuple[GPTConfig, State]:
    if hf.get("use_sliding_window"):
        raise ValueError("hf: Qwen3 with use_sliding_window=True has no counterpart here")
    if hf.get("attention_bias"):
        raise ValueError("hf: Qwen3 with attention_bias=True (biased attention, unbiased MLP)")
    config, out = _from_llama({**hf, "mlp_bias": False}, state, {"qk_norm": True, **(moe or {})})
    for i in range(config.n_layers):
        for norm in ("q_norm", "k_norm"):
            out[f"blocks.{i}.attn.{norm}.weight"] = state[
                f"model.layers.{i}.self_attn.{norm}.weight"
            ]
    return config, out
