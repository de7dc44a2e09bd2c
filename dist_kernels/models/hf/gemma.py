"""Gemma 2 and Gemma 3 (text) both ways: norms of ``1 + w`` around each branch, GeGLU,
scaled embeddings, windowed blocks between global ones with their own rope, soft-caps."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..gpt import GPTConfig
from .common import _GELU, _GELU_FROM_HF, _OUTPUT_NORMS, State, _rope_parameters
from .llama import _from_llama, _to_llama_unbiased

# Gemma's block norms (Llama's names give our ln_2 to post_attention_layernorm)
_GEMMA3_NORMS = (("ln_2", "pre_feedforward_layernorm"), *_OUTPUT_NORMS)


def _to_gemma3(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    for key in ("hidden_act", "rope_theta"):
        del hf[key]
    scale = config.softmax_scale
    scalar = config.head_dim if scale is None else 1.0 / scale**2
    full = _rope_parameters(config)
    local = full if config.rope_local_theta is None else {"rope_theta": config.rope_local_theta}
    hf.update(
        model_type="gemma3_text",
        hidden_activation=_GELU[config.gelu_approximate],
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        # transformers builds the windowed mask even without windowed blocks: a window over
        # the whole context then
        sliding_window=config.sliding_window or config.block_size,
        layer_types=[
            "sliding_attention" if config.window_of(i) else "full_attention"
            for i in range(config.n_layers)
        ],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", **local},
        },
        final_logit_softcapping=config.final_logit_softcapping,
        attn_logit_softcapping=config.attn_logit_softcapping,
        pad_token_id=None,
    )
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for a, b in _GEMMA3_NORMS:
            out[f"{theirs}.{b}.weight"] = state[f"{ours}.{a}.weight"]
        for norm in ("q_norm", "k_norm") if config.qk_norm else ():
            out[f"{theirs}.self_attn.{norm}.weight"] = state[f"{ours}.attn.{norm}.weight"]
    return hf, out


def _to_gemma2(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    """Gemma 3's mapping less the q / k norms, with one rope for every block."""
    hf, out = _to_gemma3(config, state)
    hf.update(model_type="gemma2", rope_parameters=hf["rope_parameters"]["full_attention"])
    return hf, out


def _gemma_windows(hf: Dict[str, Any]) -> Tuple[int, bool]:
    """``(global_attention_every, any block windowed)`` of Gemma's ``layer_types``."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention"] * n
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else 0
    if [i in full for i in range(n)] != [bool(every) and (i + 1) % every == 0 for i in range(n)]:
        raise ValueError(f"hf: Gemma layer_types {types}: not every n-th block global")
    return every, len(full) < n


def _gemma_ropes(hf: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[float]]:
    """``(the global blocks' rope parameters, the windowed blocks' own base or None)``:
    Gemma 3 has one rope per layer type, Gemma 2 one for all."""
    rope = hf.get("rope_parameters") or {}
    if hf.get("model_type") == "gemma2":
        return dict(rope), None
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    kind = lambda r: {**r, "rope_type": r.get("rope_type", "default")}  # noqa: E731
    if kind(local) == kind(full):  # the windowed blocks turn as the global ones
        return full, None
    if kind(local)["rope_type"] != "default":
        raise ValueError(f"hf: Gemma 3 with scaled rope on its windowed blocks ({local})")
    return full, float(local["rope_theta"])


def _from_gemma3(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    """Gemma 3's text model (and Gemma 2, without the q / k norms): Llama's layout with the
    norms of 1 + w, the branches' output norms, GeGLU, scaled embeddings, its attention scale,
    soft-caps, and windowed blocks (with their own rope base) between every n-th global one."""
    gemma2 = hf.get("model_type") == "gemma2"
    if hf.get("use_bidirectional_attention"):
        raise ValueError("hf: Gemma with use_bidirectional_attention: no counterpart here")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_FROM_HF:
        raise ValueError(f"hf: Gemma hidden_activation {act!r}: only GELU (exact or tanh)")
    every, windowed = _gemma_windows(hf)
    global_rope, local_theta = _gemma_ropes(hf)
    plain = {**hf, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    plain["rope_parameters"], plain["rope_scaling"] = global_rope, None
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    scalar = hf.get("query_pre_attn_scalar", head_dim)
    layers = [f"model.layers.{i}" for i in range(hf["num_hidden_layers"])]
    # our ln_2 is Gemma's pre_feedforward_layernorm, under Llama's name for it
    renamed = {f"{at}.post_attention_layernorm.weight": f"{at}.pre_feedforward_layernorm.weight"
               for at in layers}  # fmt: skip
    llama = {**state, **{llama_name: state[name] for llama_name, name in renamed.items()}}
    extra = dict(
        norm_unit_offset=True, post_norms=True, qk_norm=not gemma2, glu_activation="gelu",
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        gelu_approximate=_GELU_FROM_HF[act], embedding_multiplier=hf["hidden_size"] ** 0.5,
        softmax_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        sliding_window=hf.get("sliding_window") if windowed else None,
        global_attention_every=every if windowed else 0,
        rope_local_theta=local_theta if windowed else None,
    )  # fmt: skip
    config, out = _from_llama(plain, llama, extra)
    for i, theirs in enumerate(layers):
        for ours, name in _OUTPUT_NORMS:
            out[f"blocks.{i}.{ours}.weight"] = state[f"{theirs}.{name}.weight"]
        for norm in ("q_norm", "k_norm") if not gemma2 else ():
            out[f"blocks.{i}.attn.{norm}.weight"] = state[f"{theirs}.self_attn.{norm}.weight"]
    return config, out
