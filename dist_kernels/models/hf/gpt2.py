"""GPT-2 (``GPT2LMHeadModel``) both ways: ``Conv1D`` weights stored transposed, ``c_attn`` as
``[q heads | k heads | v heads]``, every LayerNorm biased."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..gpt import GPTConfig
from .common import (
    _GELU,
    _GELU_FROM_HF,
    State,
    _common,
    _dropout_rates,
    _int_ratio,
    _join_qkv,
    _split_qkv,
)


def _to_gpt2(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    dim, hidden = config.dim, config.ffn_dim
    hf = {
        "model_type": "gpt2",
        **_common(config),
        "n_positions": config.block_size,
        "n_embd": dim,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": hidden,
        "activation_function": _GELU[config.gelu_approximate],
        "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attn_dropout,
        "initializer_range": config.init_std,
    }
    weight = state["embedding.wte.weight"]
    out = {
        "transformer.wte.weight": weight,
        "transformer.wpe.weight": state["embedding.wpe.weight"],
    }

    def norm(ours: str, theirs: str) -> None:  # GPT-2's LayerNorm always has a bias
        out[f"{theirs}.weight"] = w = state[f"{ours}.weight"]
        out[f"{theirs}.bias"] = state.get(f"{ours}.bias", torch.zeros_like(w))

    def conv1d(theirs: str, w: torch.Tensor, b: Optional[torch.Tensor]) -> None:
        out[f"{theirs}.weight"] = w.t().contiguous()  # Conv1D: [in, out]
        out[f"{theirs}.bias"] = b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)

    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        norm(f"{ours}.ln_1", f"{theirs}.ln_1")
        norm(f"{ours}.ln_2", f"{theirs}.ln_2")
        qkv_bias = state.get(f"{ours}.attn.qkv.bias")
        conv1d(
            f"{theirs}.attn.c_attn",
            torch.cat(_split_qkv(config, state[f"{ours}.attn.qkv.weight"])),
            None if qkv_bias is None else torch.cat(_split_qkv(config, qkv_bias)),
        )
        for mine, name in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                           ("mlp.proj", "mlp.c_proj")):  # fmt: skip
            w, b = state[f"{ours}.{mine}.weight"], state.get(f"{ours}.{mine}.bias")
            conv1d(f"{theirs}.{name}", w, b)
    norm("head.ln_f", "transformer.ln_f")
    out["lm_head.weight"] = state["head.lm_head.weight"]
    return hf, out


def _from_gpt2(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_FROM_HF:
        raise ValueError(f"hf: GPT-2 activation {act!r}: one of {sorted(_GELU_FROM_HF)}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ValueError(f"hf: GPT-2 with {flag}=True has no counterpart here")
    dim = hf["n_embd"]
    hidden = hf.get("n_inner") or 4 * dim
    config = GPTConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf["n_positions"],
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        dim=dim,
        **_int_ratio(hidden, dim),
        gelu_approximate=_GELU_FROM_HF[act],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **_dropout_rates(hf.get("resid_pdrop", 0.1), hf.get("attn_pdrop", 0.1)),
        bias=True,
    )
    s = {k.removeprefix("transformer."): v for k, v in state.items()}
    out = {"embedding.wte.weight": s["wte.weight"], "embedding.wpe.weight": s["wpe.weight"]}
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"h.{i}"
        for norm in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                out[f"{ours}.{norm}.{kind}"] = s[f"{theirs}.{norm}.{kind}"]
        w, b = s[f"{theirs}.attn.c_attn.weight"].t(), s[f"{theirs}.attn.c_attn.bias"]
        out[f"{ours}.attn.qkv.weight"] = _join_qkv(config, *w.contiguous().chunk(3))
        out[f"{ours}.attn.qkv.bias"] = _join_qkv(config, *b.chunk(3))
        for mine, theirs_name in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                  ("mlp.proj", "mlp.c_proj")):  # fmt: skip
            out[f"{ours}.{mine}.weight"] = s[f"{theirs}.{theirs_name}.weight"].t().contiguous()
            out[f"{ours}.{mine}.bias"] = s[f"{theirs}.{theirs_name}.bias"]
    out["head.ln_f.weight"], out["head.ln_f.bias"] = s["ln_f.weight"], s["ln_f.bias"]
    out["head.lm_head.weight"] = state.get("lm_head.weight", s["wte.weight"])
    return config, out
