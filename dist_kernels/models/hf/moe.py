"""The MoE families both ways: Mixtral (an MoE in every block, stacked experts), Qwen3-MoE
(an MoE every ``decoder_sparse_step`` blocks, ``mlp_only_layers``), Qwen2-MoE (that with a
gated shared expert)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..gpt import GPTConfig
from .common import State, _get
from .family import _MIXTRAL_MOE, _QWEN2_MOE, _QWEN3_MOE
from .llama import _from_llama, _from_qwen3, _to_llama_unbiased, _to_qwen3


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
