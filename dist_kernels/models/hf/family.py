"""Which Hugging Face family a :class:`~dist_kernels.models.GPTConfig` is, or why it is none:
the options each family fixes, checked in an order where no family takes an option another
one needs (squared ReLU first: every other family would drop it)."""

from __future__ import annotations

from ..gpt import GPTConfig

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
