"""Hugging Face ``transformers`` models as the reference for our GPT, both ways
(``dist_kernels.models.hf``): our weights written for ``from_pretrained`` give
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` our logits; their weights read back give our GPT
their logits; a trained checkpoint exports to them (``export --format hf``), and the driver
starts from them (``--init-from DIR``). Every model is built here from a configuration with
random weights: nothing is downloaded."""

import dataclasses
import os

import numpy as np
import pytest
import torch
from mp_pool import run_ranks
from test_train import SEED, _cfg, _on_ranks

from dist_kernels.models import GPT, GPTConfig
from dist_kernels.models import hf as dk_hf
from dist_kernels.train import ConfigError, data, driver
from dist_kernels.train.export import consolidate, load_exported
from dist_kernels.train.export import main as export_main
from dist_kernels.train.model import build_model

transformers = pytest.importorskip("transformers")

SMALL = dict(n_layers=2, n_heads=4, dim=32, block_size=16, vocab_size=64)
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding="rope", bias=False)
# Mixtral: an MoE in every block, softmax router with the top-k weights renormalised
MIXTRAL_MOE = dict(n_experts=4, top_k=2, moe_every=1, moe_norm_topk=True)
# LongRoPE's per-pair factors (Phi-3.5 / Phi-4-mini's form), for two pairs; trained length 16
LONGROPE = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.7], "long_factor": [2.5, 7.0]}  # fmt: skip
GEMMA3 = dict(norm_unit_offset=True, post_norms=True, qk_norm=True, glu_activation="gelu",
              embedding_multiplier=32**0.5)  # fmt: skip
NEMOTRON = dict(normalization="layernorm", position_embedding="rope", squared_relu=True,
                norm_unit_offset=True, bias=False, norm_bias=True, rotary_percent=0.5)  # fmt: skip
MODELS = {
    "gpt2": GPTConfig(**SMALL, tie_embeddings=False),
    "gpt2-tied-tanh-ffn72-nobias": GPTConfig(
        **SMALL, tie_embeddings=True, gelu_approximate="tanh", ffn_hidden_size=72, bias=False
    ),
    "llama-gqa": GPTConfig(**SMALL, **LLAMA, n_kv_heads=2, rope_theta=500.0, tie_embeddings=False),
    "llama-mqa-bias-ffn72": GPTConfig(
        **{**SMALL, **LLAMA, "bias": True}, n_kv_heads=1, ffn_hidden_size=72, norm_eps=1e-6
    ),
    "qwen2-gqa-qkv-bias": GPTConfig(
        **SMALL, **LLAMA, n_kv_heads=2, qkv_bias=True, norm_eps=1e-6, tie_embeddings=False
    ),
    "qwen3-gqa-qk-norm": GPTConfig(
        **SMALL, **LLAMA, n_kv_heads=2, qk_norm=True, norm_eps=1e-6, tie_embeddings=True
    ),
    "qwen3-wide-heads": GPTConfig(  # heads twice d_model / n_heads wide (Qwen3's head_dim)
        **SMALL, **LLAMA, n_kv_heads=2, qk_norm=True, kv_channels=16, tie_embeddings=False
    ),
    "llama3-rope-scaled": GPTConfig(  # Llama 3.1's scaling, all three bands at head_dim 8
        **SMALL,
        **LLAMA,
        n_kv_heads=2,
        rope_theta=1e4,
        tie_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
    ),
    "qwen3-yarn": GPTConfig(  # Qwen3's long-context setting: yarn, attention factor 1.14
        **SMALL,
        **LLAMA,
        n_kv_heads=2,
        qk_norm=True,
        tie_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    ),
    "qwen3-moe-every-2-experts24": GPTConfig(  # dense and MoE blocks, experts narrower
        **SMALL,
        **LLAMA,
        n_kv_heads=2,
        qk_norm=True,
        n_experts=4,
        top_k=2,
        moe_every=2,
        moe_ffn_hidden_size=24,
        tie_embeddings=False,
    ),
    "qwen3-moe-layers-moe-then-dense": GPTConfig(  # a pattern: mlp_only_layers [1]
        **SMALL,
        **LLAMA,
        qk_norm=True,
        n_experts=4,
        top_k=2,
        moe_layers=(1, 0),
        tie_embeddings=False,
    ),
    "qwen2-moe-shared-gated": GPTConfig(  # biased q / k / v, a gated shared expert
        **SMALL,
        **LLAMA,
        n_kv_heads=2,
        qkv_bias=True,
        n_experts=4,
        top_k=2,
        moe_every=1,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
        tie_embeddings=False,
    ),
    "mistral-window-6": GPTConfig(  # each token sees itself and the 5 before it
        **SMALL, **LLAMA, n_kv_heads=2, sliding_window=6, tie_embeddings=False
    ),
    "mixtral-window-5": GPTConfig(
        **SMALL, **LLAMA, **MIXTRAL_MOE, n_kv_heads=2, sliding_window=5, tie_embeddings=False
    ),
    "mixtral-gqa-ffn40": GPTConfig(
        **SMALL, **LLAMA, **MIXTRAL_MOE, n_kv_heads=2, ffn_hidden_size=40, tie_embeddings=False
    ),
    "phi3-partial-rotary-window-6": GPTConfig(  # Phi-4-mini's 0.75 of the 8 dims: 6 turned
        **SMALL, **LLAMA, n_kv_heads=2, rotary_percent=0.75, sliding_window=6, tie_embeddings=True
    ),
    "phi3-partial-rotary-half-ffn40": GPTConfig(
        **SMALL, **LLAMA, rotary_percent=0.5, ffn_hidden_size=40, tie_embeddings=False
    ),
    # longrope on 4 of 8 dimensions: trained on 8 positions, run on 16 (the long factors)
    "phi3-longrope-long": GPTConfig(
        **SMALL,
        **LLAMA,
        n_kv_heads=2,
        rotary_percent=0.5,
        rope_scaling={**LONGROPE, "original_max_position_embeddings": 8},
    ),
    # Gemma 3: every second block global, the other windowed with its own rope base; heads
    # 16 wide; an attention scale of its own; tied
    "gemma3-window-every-2": GPTConfig(
        **SMALL,
        **LLAMA,
        **GEMMA3,
        n_kv_heads=2,
        kv_channels=16,
        gelu_approximate="tanh",
        softmax_scale=12**-0.5,
        sliding_window=6,
        global_attention_every=2,
        rope_local_theta=500.0,
        tie_embeddings=True,
    ),
    "gemma3-global-exact-gelu": GPTConfig(**SMALL, **LLAMA, **GEMMA3, tie_embeddings=False),
    # Gemma 2: no q / k norms, one rope, scores and logits soft-capped (tight caps: they bite)
    "gemma2-softcapped-window": GPTConfig(
        **SMALL,
        **LLAMA,
        **{**GEMMA3, "qk_norm": False},
        n_kv_heads=2,
        gelu_approximate="tanh",
        softmax_scale=0.25,
        sliding_window=6,
        global_attention_every=2,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=1.0,
        tie_embeddings=True,
    ),
    # OLMo 2: no pre-norms, the outputs normalised, q / k norms over every head's features
    "olmo2-gqa": GPTConfig(
        **SMALL,
        **LLAMA,
        n_kv_heads=2,
        pre_norms=False,
        post_norms=True,
        qk_norm=True,
        qk_norm_scope="all",
        tie_embeddings=False,
    ),
    # Nemotron: LayerNorms of 1 + w with their biases, no linear biases, a squared-ReLU MLP,
    # rope over half of each head, grouped queries
    "nemotron-gqa-half-rotary": GPTConfig(**SMALL, **NEMOTRON, n_kv_heads=2, tie_embeddings=False),
    "nemotron-biased-wide-heads": GPTConfig(  # every linear biased; heads 16 wide
        **{**SMALL, **NEMOTRON, "bias": True, "norm_bias": None, "rotary_percent": 0.25},
        kv_channels=16,
        ffn_hidden_size=40,
        tie_embeddings=True,
    ),
    # the same within the trained length (the short factors), every dimension turned
    "llama-longrope-short": GPTConfig(
        **SMALL,
        **LLAMA,
        rope_scaling={
            **LONGROPE,
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [1.0, 3.0, 5.0, 9.0],
        },
    ),
}
# HF's Llama computes its rotary tables in FP32 whatever the model's dtype (its
# LlamaRotaryEmbedding), so a float64 comparison ends at FP32's rounding of the angles; a
# wrong head order or layout is off by O(1)
TOLERANCE = {"gpt2": 1e-12, "llama": 1e-6}


def _family(config):
    return "llama" if config.position_embedding == "rope" else "gpt2"


def _perturbed_gpt(config, seed):
    """GPT(config) with every weight moved off its initialisation (norm weights not 1, biases
    not 0), rounded to FP32 (what the files hold), in float64."""
    torch.manual_seed(seed)
    gpt = GPT(config)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return gpt.double().eval()


def _hf_logits(directory, ids):
    # MoE experts: the per-expert loop ("eager"), which runs in float64; the default grouped
    # matmul takes 16- and 32-bit floats only
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        return model.double().eval()(ids).logits


@pytest.mark.parametrize("name", list(MODELS))
def test_our_weights_give_the_hf_model_our_logits(tmp_path, name):
    """GPT -> save_pretrained -> transformers' from_pretrained: the same logits; and
    load_pretrained reads the same config and weights back."""
    config = MODELS[name]
    print(f"seed {SEED}")
    gpt = _perturbed_gpt(config, SEED)
    state = {k: v.float() for k, v in gpt.state_dict().items()}
    dk_hf.save_pretrained(str(tmp_path), config, state)
    ids = torch.randint(0, config.vocab_size, (2, config.block_size))
    with torch.no_grad():
        ours = gpt(ids)
    theirs = _hf_logits(str(tmp_path), ids)
    print(f"{name}: largest logit difference {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(theirs, ours, rtol=0, atol=TOLERANCE[_family(config)])
    back_config, back = dk_hf.load_pretrained(str(tmp_path))
    assert back_config.ffn_dim == config.ffn_dim and back_config.kv_heads == config.kv_heads
    assert back_config.rope_scaling == config.rope_scaling
    assert back_config.rotary_percent == config.rotary_percent
    for k, v in state.items():
        if k.endswith("bias") and not config.bias:
            continue
        assert torch.equal(back[k], v), k


# The models transformers builds for the import direction: Llama's shape, and each family's own
LLAMA_SHAPE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip
HF_BUILT = {
    "gpt2": ("GPT2Config", dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                activation_function="gelu_new", tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),  # 2 x d / heads
    "llama-rope-llama3": ("LlamaConfig", dict(rope_parameters={  # Llama 3.1's config.json
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3-rope-yarn": ("Qwen3Config", dict(rope_parameters={  # beside a non-default mscale
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "mscale": 1.0,
        "mscale_all_dim": 0.5, "original_max_position_embeddings": 512, "beta_fast": 16})),
    "llama-rope-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=16,
                                         moe_intermediate_size=24, norm_topk_prob=True,
                                         tie_word_embeddings=False)),  # every block MoE
    "qwen3_moe-sparse-step-2": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=1,
                                                       decoder_sparse_step=2,
                                                       moe_intermediate_size=40)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, decoder_sparse_step=2,
                                         shared_expert_intermediate_size=40)),
    "qwen2_moe-dense-first": ("Qwen2MoeConfig", dict(  # DeepSeek's first dense block
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0],
        shared_expert_intermediate_size=40)),
    "mistral": ("MistralConfig", dict(sliding_window=5, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=None)),  # full rotary
    "gemma3_text": ("Gemma3TextConfig", dict(  # one windowed block, one global, scaled
        head_dim=16, sliding_window=5, query_pre_attn_scalar=12, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "olmo2": ("Olmo2Config", dict(pad_token_id=None, eos_token_id=None, rms_norm_eps=1e-6)),
    "gemma2": ("Gemma2Config", dict(  # its alternating windows, soft-capped
        head_dim=8, sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=0.5,
        final_logit_softcapping=1.0, pad_token_id=None)),
    "gemma3_text-pattern-every-1": ("Gemma3TextConfig", dict(  # all global, exact GELU
        head_dim=8, hidden_activation="gelu", pad_token_id=None, sliding_window_pattern=1,
        tie_word_embeddings=False)),
    "phi3-longrope-long": ("Phi3Config", dict(  # Phi-4-mini's form: 16 positions > 8 trained
        pad_token_id=None, original_max_position_embeddings=8, rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3], "long_factor": [3.0, 11.0]})),
    "phi3-su-short": ("Phi3Config", dict(  # the older "su" name; 16 positions of 16 trained
        pad_token_id=None, original_max_position_embeddings=16, max_position_embeddings=64,
        rope_scaling={"type": "su", "short_factor": [1.0, 1.1, 1.4, 2.0],
                      "long_factor": [4.0, 6.0, 9.0, 20.0]})),
    "phi3-partial-rotary-window": ("Phi3Config", dict(sliding_window=5, pad_token_id=None,
                                                      rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    "nemotron": ("NemotronConfig", dict(head_dim=8, tie_word_embeddings=False)),  # half rotary
    "nemotron-biased": ("NemotronConfig", dict(head_dim=16, attention_bias=True, mlp_bias=True,
                                               rope_parameters={"rope_type": "default",
                                               "rope_theta": 500.0,
                                               "partial_rotary_factor": 0.25})),
    "mixtral": ("MixtralConfig", dict(intermediate_size=40, num_local_experts=4,
                                      num_experts_per_tok=2, tie_word_embeddings=False)),
}  # fmt: skip


@pytest.mark.parametrize("family", list(HF_BUILT))
def test_hf_weights_give_our_gpt_their_logits(tmp_path, family):
    """A model transformers built and initialised itself (its own layout, its own init) ->
    load_pretrained -> our GPT: the same logits (the import direction on its own)."""
    torch.manual_seed(SEED)
    name, extra = HF_BUILT[family]
    kind = getattr(transformers, name)
    if family == "gpt2":
        hf_config = kind(**extra)
    else:
        hf_config = kind(**{**LLAMA_SHAPE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():  # norms and biases off their initial 1 and 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(tmp_path))
    config, state = dk_hf.load_pretrained(str(tmp_path))
    gpt = GPT(config)
    gpt.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ours = gpt.double().eval()(ids)
    torch.testing.assert_close(_hf_logits(str(tmp_path), ids), ours, rtol=0, atol=1e-6)


def test_mappings_refuse_what_has_no_counterpart(tmp_path):
    moe = GPTConfig(**SMALL, n_experts=4)
    with pytest.raises(ValueError, match=r"an MoE model maps to Mixtral only"):
        dk_hf.to_hf(moe, GPT(moe).state_dict())
    for wrong in (dict(moe_every=2), dict(moe_norm_topk=False), dict(moe_router="sigmoid"),
                  dict(moe_router_enable_expert_bias=True), dict(moe_layers=(1, 0))):  # fmt: skip
        other = GPTConfig(**SMALL, **LLAMA, **{**MIXTRAL_MOE, **wrong})
        with pytest.raises(ValueError, match=r"an MoE model maps to Mixtral only"):
            dk_hf.to_hf(other, GPT(other).state_dict())
    # a squared-ReLU MLP is Nemotron's only: GPT-2 would export it as GELU, silently
    for wrong in (dict(position_embedding="learned", rotary_percent=1.0),
                  dict(norm_unit_offset=False), dict(norm_bias=False), dict(qk_norm=True),
                  dict(sliding_window=4)):  # fmt: skip
        other = GPTConfig(**SMALL, **{**NEMOTRON, **wrong})
        with pytest.raises(ValueError, match=r"squared_relu maps to Nemotron only"):
            dk_hf.to_hf(other, GPT(other).state_dict())
    with pytest.raises(ValueError, match=r"squared_relu is the ungated MLP's activation"):
        GPTConfig(**SMALL, squared_relu=True, swiglu=True)
    qkv_gpt2 = GPTConfig(**SMALL, bias=False, qkv_bias=True)
    with pytest.raises(ValueError, match=r"qkv_bias without bias maps to Qwen2 only"):
        dk_hf.to_hf(qkv_gpt2, GPT(qkv_gpt2).state_dict())
    qk_gpt2 = GPTConfig(**SMALL, qk_norm=True)
    with pytest.raises(ValueError, match=r"qk_norm maps to Qwen3 only"):
        dk_hf.to_hf(qk_gpt2, GPT(qk_gpt2).state_dict())
    sliding = {"model_type": "qwen3", "use_sliding_window": True}
    with pytest.raises(ValueError, match=r"use_sliding_window=True has no counterpart"):
        dk_hf.from_hf(sliding, {})
    windowed_qwen = GPTConfig(**SMALL, **LLAMA, qk_norm=True, sliding_window=4)
    with pytest.raises(ValueError, match=r"a sliding window maps to Mistral or Mixtral only"):
        dk_hf.to_hf(windowed_qwen, GPT(windowed_qwen).state_dict())
    ungated = GPTConfig(**SMALL, **LLAMA, n_experts=4, moe_shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match=r"a shared expert maps to Qwen2-MoE only.*'moe_shared"
                       r"_expert_gate': False"):  # fmt: skip
        dk_hf.to_hf(ungated, GPT(ungated).state_dict())
    dense_past = {"model_type": "qwen3_moe", "mlp_only_layers": [0, 2], "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=r"Qwen3-MoE mlp_only_layers \[0, 2\] past its 2 layers"):
        dk_hf.from_hf(dense_past, {})
    capped = GPTConfig(**SMALL, **LLAMA, qk_norm=True, n_experts=4, moe_capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"for Qwen3-MoE \{'moe_router': 'softmax', 'moe_cap"):
        dk_hf.to_hf(capped, GPT(capped).state_dict())
    jitter = {"model_type": "mixtral", "router_jitter_noise": 0.1}
    with pytest.raises(ValueError, match=r"router_jitter_noise 0.1: no counterpart"):
        dk_hf.from_hf(jitter, {})
    mixed = GPTConfig(**SMALL, position_embedding="rope")  # rope with GPT-2's GELU MLP
    with pytest.raises(ValueError, match=r"neither GPT-2's .* nor Llama's"):
        dk_hf.to_hf(mixed, GPT(mixed).state_dict())
    with pytest.raises(ValueError, match=r"model_type 'bert': only 'gpt2', 'llama', 'mistral',"):
        dk_hf.from_hf({"model_type": "bert"}, {})
    shape = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=r"rope_type 'dynamic': only the default, 'linear',"):
        dk_hf.from_hf({**shape, "rope_parameters": {"rope_type": "dynamic"}}, {})
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.5: rope turns every dim"):
        dk_hf.from_hf({**shape, "rope_parameters": {"partial_rotary_factor": 0.5}}, {})
    scaled_partial = GPTConfig(**SMALL, **LLAMA, rotary_percent=0.5, rope_scaling={
        "rope_type": "linear", "factor": 2.0})  # fmt: skip
    with pytest.raises(ValueError, match=r"partial rotary \(rotary_percent 0.5\) maps to Phi-3"):
        dk_hf.to_hf(scaled_partial, GPT(scaled_partial).state_dict())
    with pytest.raises(ValueError, match=r"'longrope': 3 factors for a rotary embedding of 4 "):
        GPTConfig(**SMALL, **LLAMA, rotary_percent=0.5, rope_scaling={
            **LONGROPE, "short_factor": [1, 2, 3], "long_factor": [1, 2, 3]})  # fmt: skip
    with pytest.raises(ValueError, match=r"short_factor has 2 entries and long_factor 1"):
        GPTConfig(**SMALL, **LLAMA, rope_scaling={**LONGROPE, "long_factor": [1.0]})
    scaled_llama = GPTConfig(**SMALL, **LLAMA, softmax_scale=0.5)  # Gemma 3's option alone
    with pytest.raises(ValueError, match=r"\['softmax_scale'\] map to Gemma 2 / 3 only"):
        dk_hf.to_hf(scaled_llama, GPT(scaled_llama).state_dict())
    unscaled = GPTConfig(**SMALL, **LLAMA, **{**GEMMA3, "embedding_multiplier": 2.0})
    with pytest.raises(ValueError, match=r"map to Gemma 2 / 3 only.*'embedding_multiplier': 5.6"):
        dk_hf.to_hf(unscaled, GPT(unscaled).state_dict())
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 3, "hidden_size": 32,
             "num_attention_heads": 4}  # fmt: skip
    with pytest.raises(ValueError, match=r"use_bidirectional_attention: no counterpart"):
        dk_hf.from_hf({**gemma, "use_bidirectional_attention": True}, {})
    local_gemma2 = GPTConfig(**SMALL, **LLAMA, **{**GEMMA3, "qk_norm": False}, sliding_window=4,
                             rope_local_theta=100.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"map to Gemma 2 / 3 only.*Gemma 2: no qk_norm or rope"):
        dk_hf.to_hf(local_gemma2, GPT(local_gemma2).state_dict())
    odd = ["full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"not every n-th block global"):
        dk_hf.from_hf({**gemma, "layer_types": odd}, {})
    with pytest.raises(ValueError, match=r"has no config.json"):
        dk_hf.load_pretrained(str(tmp_path))
    assert export_main([str(tmp_path), str(tmp_path / "x"), "--format", "hf"]) == 2


LLAMA_TRAIN = dataclasses.replace(
    GPTConfig(**{**SMALL, **LLAMA}, n_kv_heads=2, tie_embeddings=False), n_layers=2
)


def test_a_trained_checkpoint_exports_to_hf(tmp_path):
    """A Llama-style model trained at tp 2 x pp 2, exported with --format hf: transformers'
    LlamaForCausalLM gives the logits our GPT gives with the consolidated weights."""
    model = dataclasses.replace(LLAMA_TRAIN, block_size=16, vocab_size=256)
    cfg = _cfg(global_batch=8, tp=2, pp=2, micro_batch=2, model=model)
    out = _trained_and_exported(tmp_path, cfg, 4)[0]
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


def _trained_and_exported(tmp_path, cfg, world):
    """``cfg`` trained on ``world`` ranks with a checkpoint, exported with --format hf; checks
    that transformers' model of the directory gives the consolidated weights' logits; returns
    ``(directory, our GPT holding those weights in float64, its config and state)``."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(world, _on_ranks, dataclasses.replace(cfg, checkpoint_dir=ckpt), timeout=300)
    step = os.path.join(ckpt, f"step-{cfg.steps:08d}")
    out = str(tmp_path / "hf")
    assert export_main([step, out, "--format", "hf"]) == 0
    config, _, state = consolidate(step)
    gpt = GPT(config)
    gpt.load_state_dict(state)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        ours = gpt.double().eval()(ids)
    torch.testing.assert_close(_hf_logits(out, ids), ours, rtol=0, atol=1e-6)
    return out, gpt, config, state


TRAINED_MOE = {
    "mixtral": dict(**MIXTRAL_MOE, ffn_hidden_size=40),
    # a dense block, then an MoE block of narrower experts; raw top-k weights
    "qwen3_moe": dict(qk_norm=True, n_experts=4, top_k=2, moe_every=2, moe_ffn_hidden_size=24),
    # every block MoE with a gated shared expert, renormalised top-k, biased q / k / v
    "qwen2_moe": dict(
        qkv_bias=True,
        n_experts=4,
        top_k=2,
        moe_every=1,
        moe_norm_topk=True,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
    ),
}


@pytest.mark.parametrize("family", list(TRAINED_MOE))
def test_a_trained_moe_checkpoint_exports_to_hf_and_back(tmp_path, family):
    """An MoE model in Mixtral's or Qwen3-MoE's form trained at dp 2 x ep 2 (each rank half
    the experts), exported with --format hf: transformers' model gives our GPT's logits; the
    directory then starts a run (--init-from) whose first loss is the one the export ended
    with, at ep 2 as on one process."""
    model = GPTConfig(**{**SMALL, **LLAMA, "vocab_size": 256}, n_kv_heads=2,
                      tie_embeddings=False, **TRAINED_MOE[family])  # fmt: skip
    cfg = _cfg(global_batch=8, dp=2, ep=2, model=model)
    out, gpt, config, state = _trained_and_exported(tmp_path, cfg, 2)
    assert transformers.AutoConfig.from_pretrained(out).model_type == family
    start = dataclasses.replace(cfg, init_from=out, steps=1)
    one = dataclasses.replace(start, dp=0, ep=1, grad_accum=0).with_layout(1)
    corpus = data.CharCorpus.build(one.data, config.block_size)
    inputs, targets = driver.samplers(one, corpus)[0].replica_batch(0, 0, one.global_batch)
    aux = []  # the run's loss adds each micro-batch's load-balancing loss (ours) to the CE
    with torch.no_grad():
        logits = _hf_logits(out, inputs)
        for micro in inputs.split(one.micro_batch):
            gpt(micro)
            aux.append(gpt.aux_loss().item())
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    want = ce + sum(aux) / len(aux)
    at_ep2 = run_ranks(2, _on_ranks, start, timeout=300)
    single = run_ranks(1, _on_ranks, dataclasses.replace(start, dp=0, ep=1), timeout=300)[0]
    assert single["losses"][0] == pytest.approx(want, rel=1e-5)
    assert at_ep2[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
    back = load_exported(out, config)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def _hf_gpt2(directory, vocab, positions):
    """A GPT-2 transformers builds and initialises (tied head), saved to ``directory``."""
    torch.manual_seed(SEED)
    hf_config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=1, n_head=2,
        activation_function="gelu_new", tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(directory)
    return model


def _starts_at_hf_loss(hf_model, cfg, tokens, layout):
    """The run of ``cfg`` (--init-from ``hf_model``'s directory, a vocabulary of 100 padded to
    128) begins at the Hugging Face model's cross entropy on its first batch, and at
    ``layout`` as on one process. Returns the one-process config and the corpus."""
    one = dataclasses.replace(cfg, grad_accum=0).with_layout(1)
    corpus = data.build_corpus(tokens, cfg.model.block_size, 100)
    sampler = driver.samplers(one, corpus)[0]
    inputs, targets = sampler.replica_batch(0, 0, one.global_batch)
    with torch.no_grad():
        logits = hf_model(inputs).logits  # [b, s, 100]: pad to 128 with the zeros' logits
        padded = torch.cat([logits, logits.new_zeros(*logits.shape[:2], 28)], dim=-1)
    want = torch.nn.functional.cross_entropy(padded.flatten(0, 1), targets.flatten()).item()
    ranks = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **layout), timeout=300)
    single = run_ranks(1, _on_ranks, cfg, timeout=300)[0]
    assert single["losses"][0] == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(ranks[0]["losses"], single["losses"], rtol=1e-5, atol=0)
    return one, corpus


def test_init_from_a_llama31_directory_with_the_flags_its_refusal_prints(tmp_path):
    """A Llama of 3.1's kind (llama3 rope scaling) transformers built: --init-from with the
    rope flags left out is refused and the message prints the model's flags; with them the
    run starts at transformers' loss, at cp 2 (each rank's rope at its global positions) as
    on one process."""
    from dist_kernels.train.cli import build_parser, config_from_args

    torch.manual_seed(SEED)
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip
    hf_config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=88, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters=rope, tie_word_embeddings=False,
    )  # fmt: skip
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_dir = str(tmp_path / "llama31")
    hf_model.save_pretrained(hf_dir)
    tokens = str(tmp_path / "tokens.npy")
    np.save(tokens, np.random.default_rng(SEED).integers(0, 100, size=4000).astype(np.int64))
    unscaled = ["--n-layer", "1", "--n-head", "4", "--d-model", "32", "--num-query-groups", "2",
                "--ffn-hidden-size", "88", "--normalization", "rmsnorm", "--norm-epsilon",
                "1e-06", "--position-embedding-type", "rope", "--rotary-base", "500000.0",
                "--swiglu", "--disable-bias-linear", "--seq-len", "16"]  # fmt: skip
    without = config_from_args(build_parser().parse_args(unscaled)).model
    with pytest.raises(ConfigError, match=r"rope_scaling=.*--rope-scaling llama3 "
                       r"--rope-scaling-factor 8.0 --rope-original-max-positions 8 "):  # fmt: skip
        load_exported(hf_dir, dataclasses.replace(without, vocab_size=128))
    argv = [*unscaled, "--use-rope-scaling", "--rope-original-max-positions", "8"]
    model = config_from_args(build_parser().parse_args(argv)).model
    assert model.rope_scaling["rope_type"] == "llama3"
    cfg = _cfg(global_batch=8, model=model, data=tokens, vocab_size=100, init_from=hf_dir)
    _starts_at_hf_loss(hf_model.double().eval(), cfg, tokens, dict(cp=2))


def test_init_from_a_hf_model_directory(tmp_path):
    """--init-from a GPT-2 directory (vocabulary 100, padded to the run's 128 with zero rows;
    32 positions, cut to --seq-len 16; its tied head untied): the run's first loss is the
    GPT-2's own on that batch, with the padding ids' logits 0; at dp 2 as on one process."""
    hf_dir = str(tmp_path / "gpt2")
    hf_model = _hf_gpt2(hf_dir, vocab=100, positions=32).double().eval()
    tokens = str(tmp_path / "tokens.npy")
    rng = np.random.default_rng(SEED)
    np.save(tokens, rng.integers(0, 100, size=4000).astype(np.int64))
    model = GPTConfig(
        n_layers=1, n_heads=2, dim=32, block_size=16, tie_embeddings=False,
        gelu_approximate="tanh",
    )  # fmt: skip
    cfg = _cfg(global_batch=8, model=model, data=tokens, vocab_size=100, init_from=hf_dir)
    one, corpus = _starts_at_hf_loss(hf_model, cfg, tokens, dict(dp=2))
    with pytest.warns(UserWarning, match=r"ties its output head .*\(--tie-embeddings keeps"):
        state = load_exported(hf_dir, driver.model_config(one, corpus))
    assert state["head.lm_head.weight"].data_ptr() != state["embedding.wte.weight"].data_ptr()
    built, _ = build_model(driver.model_config(one, corpus), cfg.seed, init_state=state)
    assert built[0].wte.weight.shape[0] == 128 and built[0].wpe.weight.shape[0] == 16


def test_a_tied_model_trained_in_a_pipeline_exports_tied_and_starts_tied(tmp_path):
    """A Gemma-style (tied) Llama trained at tp 2 x pp 2 with --tie-embeddings: the stages'
    two copies export as one tensor (transformers' model ties them and gives our logits), and
    the directory starts a tied run at pp 2 whose first loss is transformers' own."""
    model = dataclasses.replace(LLAMA_TRAIN, block_size=16, vocab_size=256, tie_embeddings=True)
    cfg = _cfg(global_batch=8, tp=2, pp=2, micro_batch=2, model=model)
    out, gpt, config, state = _trained_and_exported(tmp_path, cfg, 4)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf_model.config.tie_word_embeddings
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(state["head.lm_head.weight"], state["embedding.wte.weight"])
    start = dataclasses.replace(cfg, init_from=out, steps=1, tp=1)
    one = dataclasses.replace(start, pp=1, grad_accum=0).with_layout(1)
    corpus = data.CharCorpus.build(one.data, config.block_size)
    inputs, targets = driver.samplers(one, corpus)[0].replica_batch(0, 0, one.global_batch)
    with torch.no_grad():
        logits = _hf_logits(out, inputs)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    at_pp2 = run_ranks(2, _on_ranks, start, timeout=300)
    assert at_pp2[0]["losses"][0] == pytest.approx(want, rel=1e-5)


def test_init_from_a_tied_gpt2_trains_tied_and_an_untied_head_is_not_tied(tmp_path):
    """--init-from GPT-2 (tied) with --tie-embeddings: the run starts at GPT-2's loss, at pp 2
    as on one process. An untied model's head would be overwritten by the embedding (or the
    reverse) if loaded into a tied run: refused."""
    hf_dir = str(tmp_path / "gpt2")
    hf_model = _hf_gpt2(hf_dir, vocab=100, positions=32).double().eval()
    tokens = str(tmp_path / "tokens.npy")
    np.save(tokens, np.random.default_rng(SEED).integers(0, 100, size=4000).astype(np.int64))
    model = GPTConfig(
        n_layers=1, n_heads=2, dim=32, block_size=16, tie_embeddings=True,
        gelu_approximate="tanh",
    )  # fmt: skip
    cfg = _cfg(global_batch=8, model=model, data=tokens, vocab_size=100, init_from=hf_dir)
    _starts_at_hf_loss(hf_model, cfg, tokens, dict(pp=2, micro_batch=2))
    untied = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=2,
        activation_function="gelu_new", tie_word_embeddings=False,
    )  # fmt: skip
    own_dir = str(tmp_path / "own-head")
    transformers.AutoModelForCausalLM.from_config(untied).save_pretrained(own_dir)
    with pytest.raises(ConfigError, match=r"output head of its own .* drop --tie-embeddings"):
        load_exported(own_dir, dataclasses.replace(model, vocab_size=128))


def test_init_from_a_hf_model_of_another_shape_is_refused(tmp_path):
    hf_dir = str(tmp_path / "gpt2")
    _hf_gpt2(hf_dir, vocab=100, positions=32)
    model = GPTConfig(n_layers=1, n_heads=2, dim=32, block_size=16, tie_embeddings=False)
    with pytest.raises(ConfigError, match=r"holds another model: gelu_approximate='tanh' "):
        load_exported(hf_dir, dataclasses.replace(model, vocab_size=128))
    tanh = dataclasses.replace(model, gelu_approximate="tanh")
    with pytest.raises(ConfigError, match=r"vocabulary of 100 and this run 64: give "):
        load_exported(hf_dir, dataclasses.replace(tanh, vocab_size=64))
    with pytest.raises(ConfigError, match=r"has 32 positions and this run --seq-len 64"):
        load_exported(hf_dir, dataclasses.replace(tanh, vocab_size=128, block_size=64))


def test_the_flags_that_describe_hf_shapes():
    """--ffn-hidden-size, --openai-gelu, --norm-epsilon, --moe-norm-topk reach the model,
    and a hidden size tp does not divide is refused with the arithmetic."""
    from dist_kernels.train.cli import build_parser, config_from_args

    argv = ["--ffn-hidden-size", "72", "--openai-gelu", "--norm-epsilon", "1e-6", "--moe-norm-topk"]
    model = config_from_args(build_parser().parse_args(argv)).model
    assert (model.ffn_dim, model.gelu_approximate, model.norm_eps) == (72, "tanh", 1e-6)
    assert model.moe_norm_topk
    flags = ["--qk-layernorm", "--add-qkv-bias", "--kv-channels", "24", "--disable-bias-linear",
             "--moe-aux-loss-coeff", "0.001", "--experts", "4",
             "--moe-ffn-hidden-size", "24"]  # fmt: skip
    model = config_from_args(build_parser().parse_args(flags)).model
    assert (model.qk_norm, model.qkv_bias, model.kv_channels) == (True, True, 24)
    assert (model.bias, model.moe_aux_loss_coeff) == (False, 0.001)
    blocks = GPT(model).blocks  # block 0 dense at 4 x d_model, block 1's experts 24 wide
    assert (blocks[0].mlp.fc.out_features, blocks[1].mlp.experts[0].w1.out_features) == (512, 24)
    default = config_from_args(build_parser().parse_args([])).model
    assert (default.ffn_dim, default.gelu_approximate, default.norm_eps) == (512, "none", 1e-5)
    assert not default.moe_norm_topk
    odd = GPTConfig(**SMALL, ffn_hidden_size=75)
    with pytest.raises(ValueError, match=r"mlp hidden \(ffn_hidden_size or mlp_ratio \* dim\)"
                       r"\(75\) % tp\(2\) != 0"):  # fmt: skip
        GPT(odd).tp_plan(2)
    with pytest.raises(ValueError, match=r"gelu_approximate must be one of \('none', 'tanh'\)"):
        GPTConfig(**SMALL, gelu_approximate="erf")


def test_the_rope_scaling_flags():
    """Megatron's two spellings and ours reach GPTConfig.rope_scaling; contradictions and
    orphans are refused, naming the flags."""
    from dist_kernels.train.cli import build_parser, config_from_args

    def scaling(*argv):
        args = build_parser().parse_args(["--position-embedding-type", "rope", *argv])
        return config_from_args(args).model.rope_scaling

    assert scaling() is None
    assert scaling("--rotary-seq-len-interpolation-factor", "2") == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    llama3 = scaling("--use-rope-scaling")
    assert (llama3["factor"], llama3["original_max_position_embeddings"]) == (8.0, 8192)
    yarn = scaling(
        *("--rope-scaling", "yarn", "--rope-scaling-factor", "4"),
        *("--rope-original-max-positions", "512", "--rope-scaling-param", "beta_fast=16"),
        *("--rope-scaling-param", "truncate=false"),
    )
    assert (yarn["factor"], yarn["beta_fast"], yarn["truncate"]) == (4.0, 16.0, False)
    refused = [
        (["--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "2"],
         "--rotary-seq-len-interpolation-factor is linear scaling"),
        (["--rope-scaling-factor", "4"], "need --rope-scaling TYPE"),
        (["--rope-scaling", "linear", "--rope-scaling-factor", "2", "--rope-scaling-param", "x"],
         "KEY=VALUE of a key no other flag sets, got 'x'"),
        (["--use-rope-scaling", "--rope-scaling-param", "beta_fast=fast"], "not a number"),
    ]  # fmt: skip
    for argv, message in refused:
        with pytest.raises(ConfigError, match=message):
            scaling(*argv)
    with pytest.raises(ValueError, match=r"'yarn': original_max_position_embeddings is required"):
        scaling("--rope-scaling", "yarn", "--rope-scaling-factor", "4")


def test_model_flags_rebuild_each_mapped_architecture(tmp_path):
    """model_flags(config) given to the driver builds that architecture, for every model the
    mapping writes; and --init-from a directory of another shape names those flags."""
    from dist_kernels.train.cli import build_parser, config_from_args, model_flags
    from dist_kernels.train.export import _architecture

    for name, config in MODELS.items():
        built = config_from_args(build_parser().parse_args(model_flags(config))).model
        assert _architecture(built) == _architecture(config), name
    config = MODELS["qwen2-gqa-qkv-bias"]
    directory = str(tmp_path / "qwen2")
    dk_hf.save_pretrained(directory, config, GPT(config).state_dict())
    flags = model_flags(config)
    run = config_from_args(build_parser().parse_args([*flags, "--seq-len", "16"])).model
    load_exported(directory, dataclasses.replace(run, vocab_size=64))  # the flags fit
    with pytest.raises(ConfigError, match="its model is the driver's " + " ".join(flags)):
        load_exported(directory, dataclasses.replace(run, vocab_size=64, qkv_bias=False))


def test_dropout_rates_travel_both_ways_and_init_from_names_a_difference(tmp_path):
    """GPT-2's resid / attn pdrop, Llama's and Nemotron's attention_dropout come back as our
    dropout and attention_dropout; --init-from a directory whose rates differ from the run's
    warns with both (a fine-tuning recipe usually keeps the model's rates)."""
    import warnings

    for name, rates in (("gpt2", dict(dropout=0.1, attention_dropout=0.05)),
                        ("llama-gqa", dict(attention_dropout=0.1)),
                        ("nemotron-gqa-half-rotary", dict(attention_dropout=0.1))):  # fmt: skip
        config = dataclasses.replace(MODELS[name], **rates)
        directory = str(tmp_path / name)
        dk_hf.save_pretrained(directory, config, GPT(config).state_dict())
        back, _ = dk_hf.load_pretrained(directory)
        assert (back.dropout, back.attn_dropout) == (config.dropout, config.attn_dropout), name
    hf_dir = str(tmp_path / "hf-gpt2")
    _hf_gpt2(hf_dir, vocab=100, positions=32)  # transformers' defaults: every pdrop 0.1
    run = GPTConfig(n_layers=1, n_heads=2, dim=32, block_size=16, vocab_size=128,
                    tie_embeddings=True, gelu_approximate="tanh")  # fmt: skip
    with pytest.warns(UserWarning, match=r"configured with dropout 0.1 and attention dropout "
                      r"0.1; this run trains with 0.0 and 0.0"):  # fmt: skip
        load_exported(hf_dir, run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_exported(hf_dir, dataclasses.replace(run, dropout=0.1))
    assert not [w for w in caught if "dropout" in str(w.message)]
