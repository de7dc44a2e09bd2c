"""The model seam of the driver: what it trains, as an ``nn.Sequential`` of pipeline-cuttable
children (embedding, blocks, head), with its FLOPs per token.

:func:`build_model` builds ``dist_kernels.models.GPT`` (untied head, so that the first and last
pipeline stages share nothing; no dropout) as ``GPT.as_sequential()`` when that package is
importable. FALLBACK: until the tensor-parallel issue lands ``dist_kernels.models`` on main, it
builds the small causal transformer below instead (the same GPT-2 layout: pre-norm blocks, fused
qkv, 4x MLP). The stand-in is to be deleted then; the driver uses only :func:`build_model`,
:func:`flops_per_token`, :func:`describe` and :func:`loss_fn`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


class _Embed(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)[None]


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = [z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


def build_model(
    cfg: ModelConfig, seed: int, tp_comm: Any = None
) -> Tuple[nn.Sequential, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``(model, loss)``: the model initialised from ``seed`` alone (the same on every rank and
    layout), sharded over ``tp_comm`` when given (then the loss is vocabulary-parallel)."""
    if cfg.vocab_size < 1:
        raise ValueError("model.vocab_size is not set (build the corpus first)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gpt = _library_gpt(cfg)
        if gpt is None:
            if tp_comm is not None and tp_comm.world_size > 1:
                raise ValueError("tp > 1 needs dist_kernels.models (not importable)")
            blocks = [_Block(cfg) for _ in range(cfg.n_layer)]
            return nn.Sequential(_Embed(cfg), *blocks, _Head(cfg)), loss_fn
    if tp_comm is not None and tp_comm.world_size > 1:
        gpt.parallelize(tp_comm)  # slices the unsharded initialisation: same model as tp=1
    return gpt.as_sequential(), gpt.loss


def _library_gpt(cfg: ModelConfig):
    try:
        from ..models import GPT, GPTConfig
    except ImportError:
        return None
    return GPT(
        GPTConfig(
            vocab_size=cfg.vocab_size,
            block_size=cfg.seq_len,
            n_layers=cfg.n_layer,
            n_heads=cfg.n_head,
            dim=cfg.d_model,
            dropout=0.0,
            tie_embeddings=False,
        )
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (computed in FP32 under autocast)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a matmul: the weights and biases of every ``nn.Linear``
    (the embeddings are lookups, norms a rounding error)."""
    return sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()
    )


def flops_per_token(cfg: ModelConfig, model: nn.Module) -> int:  # model: unsharded
    """Training FLOPs per token: ``6 N + 12 L T d``.

    ``6 N``: forward 2 FLOPs per matmul parameter per token, backward twice that (Kaplan et al.
    2020). ``12 L T d``: attention scores ``QK^T`` and ``AV``, 2 matmuls of ``2 T d`` FLOPs per
    token per layer forward, times 3 with backward; causal masking not subtracted (as in PaLM,
    appendix B). ``N`` = :func:`matmul_params`, ``L`` layers, ``T`` = seq_len, ``d`` = d_model.
    """
    return 6 * matmul_params(model) + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model


def describe(cfg: ModelConfig) -> Dict[str, Any]:
    """The model's identity in checkpoints (resuming another model is refused)."""
    kind = "dist_kernels.models.GPT" if has_library_gpt() else "dist_kernels.train fallback GPT"
    return {"kind": kind, **dataclasses.asdict(cfg)}


def has_library_gpt() -> bool:
    try:
        from ..models import GPT  # noqa: F401
    except ImportError:
        return False
    return True
