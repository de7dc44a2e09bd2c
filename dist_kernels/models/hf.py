"""Hugging Face ``transformers`` checkpoints of :class:`~dist_kernels.models.GPT`, both ways.

    hf_config, hf_state = to_hf(config, state)       # GPT -> GPT2LMHeadModel / LlamaForCausalLM
                                                     #   / MistralForCausalLM
                                                     #   / Qwen2ForCausalLM / Qwen3ForCausalLM
                                                     #   / MixtralForCausalLM
                                                     #   / Qwen2MoeForCausalLM
                                                     #   / Qwen3MoeForCausalLM
                                                     #   / Phi3ForCausalLM
                                                     #   / Gemma2ForCausalLM / Gemma3ForCausalLM
                                                     #   / Olmo2ForCausalLM
                                                     #   / NemotronForCausalLM
    config, state = from_hf(hf_config, hf_state)     # and back
    save_pretrained(directory, config, state)        # config.json + model.safetensors
    config, state = load_pretrained(directory)       # any local Hugging Face directory

Thirteen families map one to one (Mistral is Llama with a ``sliding_window``; Nemotron is
Llama's attention with rope over part of each head (``rotary_percent``), LayerNorms of
``1 + w`` with biases (``norm_unit_offset``, ``norm_bias``) and an ungated MLP of
``relu(x)^2`` (``squared_relu``); OLMo 2 is Llama
without the pre-norms (``pre_norms=False``), the branches' outputs normalised (``post_norms``)
and the query / key norms over every head's features (``qk_norm_scope="all"``); Gemma 3's text
model is Llama with norms of ``1 + w`` (``norm_unit_offset``), the branches' outputs normalised
too (``post_norms``), per-head query / key norms, GeGLU, embeddings scaled by ``sqrt(hidden)``,
its own attention scale and windowed blocks between every n-th global one; Gemma 2 is that
without the query / key norms, with soft-capped scores and logits; Phi-3 (Phi-4, Phi-4-mini) is
Llama with its query / key / value projections fused in one ``qkv_proj`` and its gate and up
projections in one ``gate_up_proj``, and the rotary embedding over the first
``partial_rotary_factor`` of each head, our ``rotary_percent``: a model with partial rotary
exports as Phi-3, a Phi-3 with full rotary as the Llama or Mistral it equals; Qwen2 is Llama
with biased query / key / value projections, ``qkv_bias``; Qwen3 is Llama with per-head query /
key norms, ``qk_norm``; Mixtral is Llama with an MoE in every block; Qwen3-MoE is Qwen3 with an
MoE in every ``decoder_sparse_step``-th block, our ``moe_every``, less its ``mlp_only_layers``
(then our ``moe_layers`` pattern), its experts
``moe_intermediate_size`` wide, our ``moe_ffn_hidden_size``; Qwen2-MoE is that with Qwen2's
attention and a shared expert scaled by a sigmoid gate, ``moe_shared_expert_intermediate_size``
and ``moe_shared_expert_gate``):

==================  ===========================================  ===========================
GPT option          GPT-2 (``GPT2LMHeadModel``)                  Llama (``LlamaForCausalLM``)
==================  ===========================================  ===========================
normalization       layernorm (biases zero when ``bias=False``)  rmsnorm
MLP                 ``proj(gelu(fc(x)))``: ``gelu`` /            swiglu: gate_proj, up_proj
                    ``gelu_pytorch_tanh`` (``gelu_approximate``)  (= fc), down_proj (= proj)
positions           learned (``wpe``, ``n_positions`` rows)      rope (``rope_parameters``:
                                                                 theta; linear, llama3, yarn,
                                                                 longrope)
attention           every head its key and value                 grouped (``n_kv_heads``)
==================  ===========================================  ===========================

What differs is the layout of the attention's fused projection. Ours is one ``qkv`` laid out
group by group (``[group][q_1 .. q_r, k, v]``, one head each, so a tensor-parallel shard holds
whole groups); GPT-2's ``c_attn`` is ``[q heads | k heads | v heads]`` and a ``Conv1D`` (its
weights stored transposed, ``[in, out]``); Llama has separate ``q_proj``, ``k_proj``,
``v_proj`` whose query head ``h`` uses key / value head ``h // r`` (``repeat_kv``), which is
our group order. Rotary embeddings use the same halves layout (``rotate_half``) and
frequencies. Mixtral's MoE: its router ``gate`` is ours (``router.weight``; softmax, top-k,
the k weights renormalised: ``moe_norm_topk``), its experts are stacked ``[E, 2F, D]``
``gate_up_proj`` (each ``[w1; w3]``) and ``[E, D, F]`` ``down_proj`` (``w2``); an MoE model
other than that (MoE every other block, a sigmoid router, a capacity, raw top-k weights) has
no counterpart. Mixed families (say rope with a GELU MLP) are refused too, naming the options.
``transformers`` is needed only by :func:`save_pretrained`
and :func:`load_pretrained` (it writes and reads the configuration; ``safetensors``, which it
depends on, the weights).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .gpt import GPTConfig

__all__ = ["from_hf", "load_pretrained", "save_pretrained", "to_hf"]

_GELU = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
# Hugging Face activation names -> F.gelu's approximate (gelu_new is the tanh formula too)
_GELU_FROM_HF = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}

State = Dict[str, torch.Tensor]


_MIXTRAL_MOE = dict(
    moe_every=1, moe_layers=None, moe_router="softmax", moe_norm_topk=True,
    moe_capacity_factor=None, moe_shared_expert_intermediate_size=None,
    moe_router_enable_expert_bias=False, bias=False,
)  # fmt: skip
# Qwen3-MoE's router: softmax, top-k (renormalised or not: norm_topk_prob), no capacity; MoE in
# blocks (i + 1) % decoder_sparse_step == 0, as our moe_every
_QWEN3_MOE = dict(
    moe_router="softmax", moe_capacity_factor=None, moe_shared_expert_intermediate_size=None,
    moe_router_enable_expert_bias=False,
)  # fmt: skip
# Qwen2-MoE's: Qwen3-MoE's router beside a shared expert scaled by a sigmoid gate
_QWEN2_MOE = dict(
    moe_router="softmax", moe_capacity_factor=None, moe_shared_expert_gate=True,
    moe_router_enable_expert_bias=False,
)  # fmt: skip


# Gemma 3's fixed options, and the values every other family has of the options only Gemma 3
# sets (its embedding multiplier must be sqrt(dim); its scale, window pattern and local rope
# base are free)
_OLMO2 = dict(pre_norms=False, post_norms=True, qk_norm=True, qk_norm_scope="all")
# Nemotron (Nemotron-4, Minitron): LayerNorms of 1 + w with biases, an ungated squared-ReLU MLP,
# rope over part of each head
_NEMOTRON = dict(normalization="layernorm", swiglu=False, position_embedding="rope",
                 squared_relu=True, norm_unit_offset=True, norm_biased=True)  # fmt: skip
_GEMMA = dict(norm_unit_offset=True, post_norms=True, glu_activation="gelu")
_GEMMA_ONLY = dict(
    norm_unit_offset=False, post_norms=False, glu_activation="silu", embedding_multiplier=1.0,
    softmax_scale=None, global_attention_every=0, rope_local_theta=None,
    attn_logit_softcapping=None, final_logit_softcapping=None,
)  # fmt: skip


def _family(config: GPTConfig) -> str:
    """``"gpt2"``, ``"llama"``, ``"qwen3"`` or ``"mixtral"``; ValueError naming what matches
    none."""
    gpt2 = dict(normalization="layernorm", swiglu=False, position_embedding="learned")
    llama = dict(normalization="rmsnorm", swiglu=True, position_embedding="rope")
    mine = {k: getattr(config, k) for k in gpt2}
    if config.squared_relu:  # first: no other family has it, and each would drop it
        return _nemotron_family(config)
    if not config.pre_norms or config.qk_norm_scope == "all":  # OLMo 2's options
        olmo = {k: getattr(config, k) for k in _OLMO2}
        others = {k: getattr(config, k) for k in _GEMMA_ONLY if k != "post_norms"}
        plain = not (config.bias or config.qkv_bias or config.n_experts or config.sliding_window)
        unscaled = others == {k: v for k, v in _GEMMA_ONLY.items() if k != "post_norms"}
        if mine == llama and plain and olmo == _OLMO2 and unscaled and config.rotary_percent == 1:
            return "olmo2"
        raise ValueError(
            f"hf: pre_norms=False or qk_norm_scope='all' map to OLMo 2 only: {llama} with "
            f"{_OLMO2}, no biases, MoE, window or Gemma's options; this one has {mine}, {olmo}"
        )
    gemma_only = sorted(k for k, v in _GEMMA_ONLY.items() if getattr(config, k) != v)
    if gemma_only:  # options of Gemma's only: Gemma 3 with q / k norms, Gemma 2 without
        gemma = {k: getattr(config, k) for k in (*_GEMMA, "embedding_multiplier")}
        wanted = {**_GEMMA, "embedding_multiplier": config.dim**0.5}
        plain = not (config.bias or config.qkv_bias or config.n_experts)
        if mine == llama and plain and gemma == wanted and config.rotary_percent == 1:
            if config.qk_norm:
                return "gemma3_text"
            if config.rope_local_theta is None:
                return "gemma2"
        raise ValueError(
            f"hf: {gemma_only} map to Gemma 2 / 3 only: {llama} with {wanted}, no biases or "
            f"MoE, full rotary (Gemma 2: no qk_norm or rope_local_theta); this one has {mine}, "
            f"{gemma}, bias={config.bias}, n_experts={config.n_experts}, rotary_percent="
            f"{config.rotary_percent}, qk_norm={config.qk_norm}"
        )
    if config.rotary_percent != 1:  # partial rotary: Phi-3's (Phi-4-mini)
        plain = not (config.bias or config.qkv_bias or config.qk_norm or config.n_experts)
        scaled = config.rope_scaling is not None and config.rope_scaling["rope_type"] != "longrope"
        if mine == llama and plain and not scaled:
            return "phi3"
        raise ValueError(
            f"hf: partial rotary (rotary_percent {config.rotary_percent}) maps to Phi-3 only: "
            f"{llama} without biases, qk_norm, MoE or a rope_scaling but longrope; this one has "
            f"{mine}, "
            f"bias={config.bias}, qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}, "
            f"n_experts={config.n_experts}, rope_scaling={config.rope_scaling}"
        )
    if config.sliding_window is not None:  # Mistral, or Mixtral
        plain = not (config.bias or config.qkv_bias or config.qk_norm)
        moe = {k: getattr(config, k) for k in _MIXTRAL_MOE}
        if mine != llama or not plain or (config.n_experts and moe != _MIXTRAL_MOE):
            raise ValueError(
                f"hf: a sliding window maps to Mistral or Mixtral only: {llama} without biases "
                f"or qk_norm; this one has {mine}, bias={config.bias}, qkv_bias="
                f"{config.qkv_bias}, qk_norm={config.qk_norm}, n_experts={config.n_experts}"
            )
    if config.n_experts and config.moe_shared_expert_intermediate_size:  # Qwen2-MoE
        routed = {k: getattr(config, k) for k in _QWEN2_MOE}
        if mine == llama and not config.bias and not config.qk_norm and routed == _QWEN2_MOE:
            return "qwen2_moe"
        raise ValueError(
            f"hf: a shared expert maps to Qwen2-MoE only: {llama} without biases or qk_norm, "
            f"with {_QWEN2_MOE}; this one has {mine}, bias={config.bias}, "
            f"qk_norm={config.qk_norm}, {routed}"
        )
    if config.qkv_bias and not config.bias:  # Qwen2: Llama with biased q, k, v projections
        if mine == llama and not config.qk_norm and not config.n_experts:
            return "qwen2"
        raise ValueError(
            f"hf: qkv_bias without bias maps to Qwen2 only: {llama} without qk_norm or MoE; "
            f"this one has {mine}, qk_norm={config.qk_norm}, n_experts={config.n_experts}"
        )
    if config.qk_norm:  # Qwen3: Llama with per-head query / key norms, no biases
        routed = {k: getattr(config, k) for k in _QWEN3_MOE}
        if mine == llama and not config.bias and not config.n_experts:
            return "qwen3"
        if mine == llama and not config.bias and routed == _QWEN3_MOE:  # MoE every n blocks
            return "qwen3_moe"
        raise ValueError(
            f"hf: qk_norm maps to Qwen3 only: {llama} without biases, and for Qwen3-MoE "
            f"{_QWEN3_MOE}; this one has {mine}, bias={config.bias}, {routed}"
        )
    if config.n_experts:
        moe = {k: getattr(config, k) for k in _MIXTRAL_MOE}
        if mine == llama and moe == _MIXTRAL_MOE:
            return "mixtral"
        raise ValueError(
            f"hf: an MoE model maps to Mixtral only: {llama} with {_MIXTRAL_MOE}; this one "
            f"has {mine} with {moe}"
        )
    if mine == gpt2 and config.kv_heads == config.n_heads and config.kv_channels is None:
        return "gpt2"
    if mine == llama:
        return "llama" if config.sliding_window is None else "mistral"
    raise ValueError(
        f"hf: {mine} (n_kv_heads {config.kv_heads} of {config.n_heads}, kv_channels "
        f"{config.kv_channels}) is neither GPT-2's {gpt2} with every head its own key and "
        f"value and d_model / n_heads wide nor Llama's {llama}"
    )


def _nemotron_family(config: GPTConfig) -> str:
    nemotron = {k: getattr(config, k) for k in _NEMOTRON}
    gemma_only = {k: getattr(config, k) for k in _GEMMA_ONLY if k != "norm_unit_offset"}
    plain = not (config.qkv_bias or config.qk_norm or config.n_experts or config.post_norms)
    plain = plain and config.pre_norms and config.sliding_window is None
    if (
        nemotron == _NEMOTRON
        and plain
        and config.rope_scaling is None
        and gemma_only == {k: v for k, v in _GEMMA_ONLY.items() if k != "norm_unit_offset"}
    ):
        return "nemotron"
    raise ValueError(
        f"hf: squared_relu maps to Nemotron only: {_NEMOTRON}, pre-norms only, no qkv_bias, "
        f"qk_norm, MoE, window, rope_scaling or Gemma's options; this one has {nemotron}, "
        f"qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}, n_experts={config.n_experts}, "
        f"sliding_window={config.sliding_window}, rope_scaling={config.rope_scaling}"
    )


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


def to_hf(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    """``(configuration, state dict)`` of the Hugging Face model equal to ``GPT(config)``
    holding ``state`` (GPT's names): a ``GPT2Config`` or ``LlamaConfig``'s keyword arguments
    (with ``model_type``) and the model's weights under its names."""
    family = _family(config)
    to = {"gpt2": _to_gpt2, "llama": _to_llama, "qwen2": _to_qwen2, "qwen3": _to_qwen3,
          "mixtral": _to_mixtral, "qwen3_moe": _to_qwen3_moe,
          "qwen2_moe": _to_qwen2_moe, "mistral": _to_mistral, "phi3": _to_phi3,
          "gemma3_text": _to_gemma3, "gemma2": _to_gemma2, "olmo2": _to_olmo2,
          "nemotron": _to_nemotron}  # fmt: skip
    return to[family](config, state)


def _common(config: GPTConfig) -> Dict[str, Any]:
    # no token ids: the model knows none (a tokenizer's are set with it, by its user)
    return {
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


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


def _to_mixtral(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    hf.update(
        model_type="mixtral",
        num_local_experts=config.n_experts,
        num_experts_per_tok=config.top_k,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        router_jitter_noise=0.0,
        sliding_window=config.sliding_window,
        intermediate_size=config.moe_ffn_dim,  # every block's MLP is the MoE
    )
    _experts_to_hf(config, state, out)
    return hf, out


def _experts_to_hf(config: GPTConfig, state: State, out: State) -> None:
    """Each MoE block's router (their ``gate``) and experts, stacked as transformers 5 keeps
    them: ``gate_up_proj`` ``[E, 2F, D]`` (each ``[w1; w3]``), ``down_proj`` ``[E, D, F]``."""
    for i in (i for i in range(config.n_layers) if config.is_moe_block(i)):
        ours, theirs = f"blocks.{i}.mlp", f"model.layers.{i}.mlp"
        expert = [f"{ours}.experts.{e}" for e in range(config.n_experts)]
        out[f"{theirs}.gate.weight"] = state[f"{ours}.router.weight"]
        out[f"{theirs}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{x}.w1.weight"], state[f"{x}.w3.weight"]]) for x in expert]
        )
        out[f"{theirs}.experts.down_proj"] = torch.stack([state[f"{x}.w2.weight"] for x in expert])
        for mine, hf_name in _shared_pairs(config):
            out[f"{theirs}.{hf_name}"] = state[f"{ours}.{mine}"]


def _shared_pairs(config: GPTConfig) -> List[Tuple[str, str]]:
    """(ours, Qwen2-MoE's) names of an MoE block's shared expert and its gate."""
    if not config.moe_shared_expert_intermediate_size:
        return []
    pairs = [(f"shared_expert.{w}.weight", f"shared_expert.{p}_proj.weight")
             for w, p in (("w1", "gate"), ("w3", "up"), ("w2", "down"))]  # fmt: skip
    if config.moe_shared_expert_gate:
        pairs.append(("shared_expert_gate.weight", "shared_expert_gate.weight"))
    return pairs


def _experts_from_hf(config: GPTConfig, state: State, out: State) -> None:
    f = config.moe_ffn_dim
    for i in (i for i in range(config.n_layers) if config.is_moe_block(i)):
        ours, theirs = f"blocks.{i}.mlp", f"model.layers.{i}.mlp"
        out[f"{ours}.router.weight"] = state[f"{theirs}.gate.weight"]
        gate_up = state[f"{theirs}.experts.gate_up_proj"]
        down = state[f"{theirs}.experts.down_proj"]
        for e in range(config.n_experts):
            out[f"{ours}.experts.{e}.w1.weight"] = gate_up[e, :f].contiguous()
            out[f"{ours}.experts.{e}.w3.weight"] = gate_up[e, f:].contiguous()
            out[f"{ours}.experts.{e}.w2.weight"] = down[e].contiguous()
        for mine, hf_name in _shared_pairs(config):
            out[f"{ours}.{mine}"] = state[f"{theirs}.{hf_name}"]


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


# the branches' output norms, ours and Gemma's / OLMo 2's names
_OUTPUT_NORMS = (
    ("post_attn_norm", "post_attention_layernorm"),
    ("post_mlp_norm", "post_feedforward_layernorm"),
)
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


def _to_qwen2_moe(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_llama_unbiased(config, state)
    hf.update(
        model_type="qwen2_moe",
        qkv_bias=config.qkv_bias,
        use_sliding_window=False,
        sliding_window=None,
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        **_routed_to_hf(config),
    )
    _experts_to_hf(config, state, out)
    return hf, out


def _routed_to_hf(config: GPTConfig) -> Dict[str, Any]:
    """Qwen-MoE's routing settings (Qwen2-MoE's and Qwen3-MoE's alike)."""
    return dict(
        num_experts=config.n_experts,
        num_experts_per_tok=config.top_k,
        moe_intermediate_size=config.moe_ffn_dim,
        **_sparse_layers_to_hf(config),
        norm_topk_prob=config.moe_norm_topk,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
    )


def _sparse_layers_to_hf(config: GPTConfig) -> Dict[str, Any]:
    """Qwen-MoE's MoE blocks: every ``decoder_sparse_step``-th block not in
    ``mlp_only_layers`` (a pattern: every block, less its dense ones)."""
    if config.moe_layers is None:
        return dict(decoder_sparse_step=config.moe_every, mlp_only_layers=[])
    dense = [i for i, moe in enumerate(config.moe_layers) if not moe]
    return dict(decoder_sparse_step=1, mlp_only_layers=dense)


def _to_qwen3_moe(config: GPTConfig, state: State) -> Tuple[Dict[str, Any], State]:
    hf, out = _to_qwen3(config, state)
    hf.update(model_type="qwen3_moe", **_routed_to_hf(config))
    _experts_to_hf(config, state, out)
    return hf, out


def _get(hf: Dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


def from_hf(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    """``(GPTConfig, state dict under GPT's names)`` of a Hugging Face GPT-2 or Llama model:
    ``hf`` its configuration as a dict (``config.to_dict()``), ``state`` its weights."""
    model_type = hf.get("model_type")
    if model_type == "gpt2":
        return _from_gpt2(hf, state)
    if model_type == "llama":
        return _from_llama(hf, state)
    if model_type == "mixtral":
        return _from_mixtral(hf, state)
    if model_type == "mistral":
        return _from_mistral(hf, state)
    if model_type == "qwen2":
        return _from_qwen2(hf, state)
    if model_type == "qwen3":
        return _from_qwen3(hf, state)
    if model_type == "qwen3_moe":
        return _from_qwen3_moe(hf, state)
    if model_type == "qwen2_moe":
        return _from_qwen2_moe(hf, state)
    if model_type == "phi3":
        return _from_phi3(hf, state)
    if model_type in ("gemma3_text", "gemma2"):
        return _from_gemma3(hf, state)
    if model_type == "nemotron":
        return _from_nemotron(hf, state)
    if model_type == "olmo2":
        return _from_olmo2(hf, state)
    raise ValueError(
        f"hf: model_type {model_type!r}: only 'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', "
        "'mixtral', 'qwen2_moe', 'qwen3_moe', 'phi3', 'gemma2', 'gemma3_text', 'olmo2' and "
        "'nemotron' are mapped"
    )


def _int_ratio(hidden: int, dim: int) -> Dict[str, Any]:
    """GPTConfig's MLP size: ``mlp_ratio`` when it is a whole multiple, else ``ffn_hidden_size``."""
    if hidden % dim == 0:
        return {"mlp_ratio": hidden // dim}
    return {"ffn_hidden_size": hidden}


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


def _from_mixtral(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    if hf.get("router_jitter_noise"):
        raise ValueError(
            f"hf: Mixtral router_jitter_noise {hf['router_jitter_noise']}: no counterpart here"
        )
    moe = dict(
        _MIXTRAL_MOE,
        n_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 1e-2)),
        sliding_window=hf.get("sliding_window"),
    )
    del moe["bias"]
    config, out = _from_llama({**hf, "attention_bias": False, "mlp_bias": False}, state, moe)
    _experts_from_hf(config, state, out)
    return config, out


def _routed_from_hf(hf: Dict[str, Any], family: str) -> Dict[str, Any]:
    """GPTConfig's MoE fields of a Qwen-MoE configuration (Qwen2-MoE's or Qwen3-MoE's)."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = hf["num_hidden_layers"]
    if dense - set(range(layers)):
        raise ValueError(f"hf: {family} mlp_only_layers {sorted(dense)} past its {layers} layers")
    moe = dict(
        n_experts=_get(hf, "num_local_experts", "num_experts"),
        top_k=hf["num_experts_per_tok"],
        moe_every=step,
        # transformers' rule: block i is MoE unless listed, if (i + 1) % step == 0
        moe_layers=tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
        if dense
        else None,
        moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 1e-3)),
    )
    if hf["moe_intermediate_size"] != hf["intermediate_size"]:
        moe["moe_ffn_hidden_size"] = hf["moe_intermediate_size"]
    return moe


def _from_qwen3_moe(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    config, out = _from_qwen3(hf, state, {**_QWEN3_MOE, **_routed_from_hf(hf, "Qwen3-MoE")})
    _experts_from_hf(config, state, out)
    return config, out


def _from_qwen2_moe(hf: Dict[str, Any], state: State) -> Tuple[GPTConfig, State]:
    if hf.get("use_sliding_window"):
        raise ValueError("hf: Qwen2-MoE with use_sliding_window=True has no counterpart here")
    moe = dict(
        _QWEN2_MOE,
        **_routed_from_hf(hf, "Qwen2-MoE"),
        moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        qkv_bias=bool(hf.get("qkv_bias", True)),
    )
    config, out = _from_llama({**hf, "attention_bias": False, "mlp_bias": False}, state, moe)
    _experts_from_hf(config, state, out)
    return config, out


def save_pretrained(directory: str, config: GPTConfig, state: State) -> None:
    """Writes ``directory`` as ``transformers.AutoModelForCausalLM.from_pretrained`` reads it:
    the model is built by ``transformers`` from the mapped configuration and loaded strictly
    (so every weight has its place), then saved by it (``config.json``,
    ``model.safetensors``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, weights = to_hf(config, state)
    kind = hf.pop("model_type")
    hf_config = AutoConfig.for_model(kind, **hf)
    with torch.random.fork_rng(devices=[]):  # its initialisation is overwritten
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"hf: the mapping left out {missing} and added {unexpected}")
    model.save_pretrained(directory)


def load_pretrained(directory: str) -> Tuple[GPTConfig, State]:
    """``(GPTConfig, state dict)`` of a local Hugging Face model directory (nothing is
    downloaded), in FP32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"hf: {directory} has no config.json (not a Hugging Face model)")
    hf_config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=torch.float32
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return from_hf(hf_config.to_dict(), state)
