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

Modules: ``family`` (which family a configuration is), ``common`` (the fused ``qkv``'s
layouts, Llama's lineage's keys, rope's parameters), one per family group (``gpt2``,
``llama`` with Mistral / Phi-3 / Qwen2 / Qwen3 / OLMo 2, ``moe``, ``gemma``, ``nemotron``);
this one dispatches and reads / writes directories.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import torch

from ..gpt import GPTConfig
from .common import State
from .family import _family
from .gemma import _from_gemma3, _to_gemma2, _to_gemma3
from .gpt2 import _from_gpt2, _to_gpt2
from .llama import (
    _from_llama,
    _from_mistral,
    _from_olmo2,
    _from_phi3,
    _from_qwen2,
    _from_qwen3,
    _to_llama,
    _to_mistral,
    _to_olmo2,
    _to_phi3,
    _to_qwen2,
    _to_qwen3,
)
from .moe import (
    _from_mixtral,
    _from_qwen2_moe,
    _from_qwen3_moe,
    _to_mixtral,
    _to_qwen2_moe,
    _to_qwen3_moe,
)
from .nemotron import _from_nemotron, _to_nemotron

__all__ = ["from_hf", "load_pretrained", "save_pretrained", "to_hf"]


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
