"""The model seam of the driver: what it trains, as an ``nn.Sequential`` of pipeline-cuttable
children (embedding, blocks, head), with its FLOPs per token.

:func:`build_model` builds ``dist_kernels.models.GPT`` (its dropout masks counter-based,
``dk.models.dropout``, keyed by the engines per micro-batch; a tied head is the
embedding's tensor, which a pipeline gives its first and last stages as copies that it keeps
equal: ``pipeline/tied.py``) as ``GPT.as_sequential()``, sharded over the tensor-
parallel communicator when there is one and run on sequence shards over the context-parallel
one (``GPT.context_parallel``). The driver uses only :func:`build_model`,
:func:`flops_per_token`, :func:`describe` and :func:`loss_fn`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models import GPT, GPTConfig
from ..moe import MoE


def build_model(
    cfg: GPTConfig,
    seed: int,
    tp_comm: Any = None,
    cp_comm: Any = None,
    ep_comm: Any = None,
    recompute: bool = False,
    sequence_parallel: bool = False,
    compile_backend: Optional[str] = None,
    init_state: Optional[Dict[str, torch.Tensor]] = None,
    documents: Optional[Dict[str, Any]] = None,
) -> Tuple[nn.Sequential, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``(model, loss)``: the model initialised from ``seed`` alone (the same on every rank and
    layout), sharded over ``tp_comm`` when given (then the loss is vocabulary-parallel), on
    sequence shards over ``cp_comm`` when given (then the loss is the whole sequences' mean),
    MoE experts sharded over ``ep_comm`` when given (the loss adds the MoE aux losses), every
    block's activations recomputed in backward with ``recompute``, the sequence split over
    ``tp_comm`` between the tensor-parallel layers with ``sequence_parallel``, every block
    compiled by ``torch.compile`` with ``compile_backend`` when given (after the sharding,
    which replaces layers; compiling is lazy, at the first forward). ``init_state`` (the
    whole model's weights under GPT's names: ``export.load_exported``) replaces the seed's
    initialisation before any sharding, so every layout slices the same weights.
    ``documents`` (``GPT.document_masking``'s arguments) keeps packed documents apart."""
    if cfg.vocab_size < 1:
        raise ValueError("model.vocab_size is not set (build the corpus first)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gpt = GPT(cfg)
    if init_state is not None:
        gpt.load_state_dict(init_state)
    if tp_comm is not None and tp_comm.world_size > 1:
        # slices the unsharded initialisation: the same model as tp=1
        gpt.parallelize(tp_comm, sequence_parallel=sequence_parallel)
    if cp_comm is not None and cp_comm.world_size > 1:
        gpt.context_parallel(cp_comm)
    if ep_comm is not None and ep_comm.world_size > 1:
        gpt.expert_parallel(ep_comm)
    if documents is not None:
        gpt.document_masking(**documents)
    gpt.recompute_blocks(recompute)
    if compile_backend is not None:
        gpt.compile_blocks(compile_backend)
    return gpt.as_sequential(), gpt.loss


def pipeline_losses(
    model: nn.Sequential, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Optional[Callable]]:
    """``(loss_fn, stage_loss)`` of a Pipeline over ``model``. With MoE blocks, the head's loss
    alone, and each stage adds its own MoE layers' aux losses, backpropagated from there
    (Megatron's way: nothing crosses stages); the sum is :func:`build_model`'s loss. Without
    them, ``loss`` and nothing."""
    from ..moe import MoE, aux_loss_of

    if not any(isinstance(m, MoE) for m in model.modules()):
        return loss, None
    return lm_loss(model), aux_loss_of


def lm_loss(model: nn.Sequential) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The language-model loss of :func:`build_model`'s model, without MoE aux losses: the
    head's (vocabulary-parallel under tp, over whole sequences under cp). Validation
    reports it."""
    return model[-1].loss


def moe_metrics(model: nn.Module) -> Dict[str, Any]:
    """The MoE layers' last step (of this rank's ep group): tokens per expert, per layer, and
    the drop rate over every layer; empty without MoE layers."""
    from ..moe import MoE

    stats = [m.last_stats for m in model.modules() if isinstance(m, MoE) and m.last_stats]
    if not stats:
        return {}
    return {
        "moe_tokens_per_expert": [s["tokens_per_expert"] for s in stats],
        "moe_drop_rate": sum(s["drop_rate"] for s in stats) / len(stats),
        "moe_imbalance": max(s["imbalance"] for s in stats),
    }


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (computed in FP32 under autocast)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a token's matmuls: the weights and biases of every
    ``nn.Linear`` (the embeddings are lookups, norms a rounding error), an MoE's experts as the
    ``top_k`` of them each token passes through (the router whole)."""
    routed = [m for m in model.modules() if isinstance(m, MoE)]
    expert_linears = {id(x) for m in routed for e in m.experts for x in e.modules()}
    dense = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear) and id(m) not in expert_linears
        for p in m.parameters()
    )
    per_expert = [sum(p.numel() for p in m.experts[0].parameters()) for m in routed]
    routers = sum(p.numel() for m in routed for p in m.router.parameters())  # not nn.Linear
    return dense + routers + sum(m.top_k * n for m, n in zip(routed, per_expert))


def flops_per_token(cfg: GPTConfig, model: nn.Module) -> int:  # model: unsharded
    """Training FLOPs per token: ``6 N + 12 L T d``.

    ``6 N``: forward 2 FLOPs per matmul parameter per token, backward twice that (Kaplan et al.
    2020). ``12 L T d``: attention scores ``QK^T`` and ``AV``, 2 matmuls of ``2 T d`` FLOPs per
    token per layer forward, times 3 with backward; causal masking not subtracted (as in PaLM,
    appendix B). ``N`` = :func:`matmul_params`, ``L`` layers, ``T`` = block_size, ``d`` = the
    queries' width, ``n_heads * head_dim`` (``dim`` unless ``kv_channels`` sets the heads').
    """
    width = cfg.n_heads * cfg.head_dim
    return 6 * matmul_params(model) + 12 * cfg.n_layers * cfg.block_size * width


def describe(cfg: GPTConfig) -> Dict[str, Any]:
    """The model's identity in checkpoints (resuming another model is refused), as JSON
    gives it back (a tuple field as a list: the record's copy compares equal)."""
    return json.loads(json.dumps({"kind": "dist_kernels.models.GPT", **dataclasses.asdict(cfg)}))
