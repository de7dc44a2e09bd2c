"""A small GPT, unsharded or tensor-parallel: embedding, pre-norm blocks, tied or untied head.

    model = GPT(GPTConfig(vocab_size=256, dim=64, n_heads=4, n_layers=2))
    model.parallelize(mesh.tp_comm, sequence_parallel=True)   # or tp.shard_module(...)
    model.context_parallel(mesh.cp_comm)                      # sequence sharded over cp
    loss = model(idx, targets)                                # idx, targets: [batch, seq]
                                                              # (this rank's shard under cp)

Inside, activations are ``[sequence, batch, hidden]`` (Megatron's layout): under sequence
parallelism dimension 0 is what is split. The model is three kinds of children, so that
``model.as_sequential()`` feeds :class:`~dist_kernels.Pipeline`::

    embedding  ids [b, s] -> x [s, b, h]       token + position embedding, dropout
    blocks[i]  x -> x + attn(ln_1(x)) -> x + mlp(ln_2(x))   (post_norms: x + post(attn(..)))
    head       x -> logits [b, s, vocab (/ tp)]  final norm, linear head

Llama's block is three options away: ``GPTConfig(normalization="rmsnorm", swiglu=True,
position_embedding="rope", bias=False)`` (RMSNorm, SwiGLU MLP, rotary embeddings of queries
and keys in place of the position table).

The fused ``qkv`` projection orders its output features head by head (``[head][q, k, v][d]``),
so splitting its rows into ``tp`` contiguous shards gives each rank whole heads. With grouped
key / value heads (``n_kv_heads``) it goes group by group (``[group][q_1 .. q_r, k, v][d]``,
``r = n_heads / n_kv_heads``; ``r = 1`` is the layout above), and a shard holds whole groups.

Under context parallelism (:meth:`GPT.context_parallel`) every rank holds ``seq / cp`` tokens
of each sample (``cp.shard_sequence``): attention is ring attention over the cp ranks, the
position embedding takes the rows of the shard's global positions, and the loss is the mean
over every token of the whole sequences.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from .. import context_parallel as cp
from .. import moe as moe_lib
from .. import tensor_parallel as tp
from . import dropout as dropout_lib
from .documents import DocumentMasking
from .dropout import SiteDropout
from .rope import apply_rope, pairs_checked, rope_scaling_checked, rope_tables

__all__ = ["GPTConfig", "GPT"]


NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")
GELU_APPROXIMATIONS = ("none", "tanh")  # F.gelu's approximate
# F.scaled_dot_product_attention's enable_gqa (torch >= 2.5), and its CPU flash kernels that
# ring attention calls, pair query head h with key / value head h // r (our group order)
# without r copies of each key and value head; ring attention then moves r times fewer bytes
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class GPTConfig:
    """Shape and options of :class:`GPT`; checked when built."""

    vocab_size: int = 256
    """Tokens in the vocabulary (a multiple of tp when sharded: pad it)."""
    block_size: int = 64
    """Longest sequence (rows of the position embedding)."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads per block (a multiple of tp when sharded)."""
    n_kv_heads: Optional[int] = None
    """Key / value heads (grouped-query attention, Ainslie et al. 2023: each serves
    ``n_heads / n_kv_heads`` query heads; 1 is multi-query attention); None: ``n_heads``.
    A multiple of tp when sharded (Megatron's ``--num-query-groups``)."""
    dim: int = 64
    """Hidden size; a multiple of ``n_heads``."""
    kv_channels: Optional[int] = None
    """Each head's width (Megatron's ``--kv-channels``; Qwen3's ``head_dim``); None:
    ``dim / n_heads``. The attention then projects ``dim`` to ``n_heads * kv_channels`` and
    back."""
    mlp_ratio: int = 4
    """The MLP's hidden size is ``mlp_ratio * dim`` unless ``ffn_hidden_size`` is set."""
    ffn_hidden_size: Optional[int] = None
    """The MLP's (and each expert's) hidden size when set (Megatron's ``--ffn-hidden-size``;
    Llama's ``intermediate_size``, often no multiple of ``dim``)."""
    gelu_approximate: str = "none"
    """GPT-2 MLP's GELU as ``F.gelu``'s ``approximate``: ``"none"`` (exact) or ``"tanh"``
    (OpenAI GPT-2's; Megatron's ``--openai-gelu``)."""
    dropout: float = 0.0
    """Dropout on the embeddings' output and the residual branches (Megatron's hidden dropout),
    and on the attention probabilities unless ``attention_dropout`` is set."""
    attention_dropout: Optional[float] = None
    """Dropout on the attention probabilities (Megatron's ``--attention-dropout``, Hugging
    Face's ``attn_pdrop`` / ``attention_dropout``); None: ``dropout``."""
    bias: bool = True
    """Biases in the linear layers, and in the LayerNorms unless ``norm_bias`` says."""
    norm_bias: Optional[bool] = None
    """Biases in the LayerNorms (RMSNorm has none); None: ``bias``. Megatron's
    ``--disable-bias-linear`` unbiases the linear layers only: its LayerNorms keep theirs."""
    qkv_bias: bool = False
    """The fused query / key / value projection biased even where ``bias`` is False (Qwen2's
    attention; Megatron's ``--add-qkv-bias``)."""
    tie_embeddings: bool = True
    """The head reuses the token embedding's weight (not across pipeline stages)."""
    norm_eps: float = 1e-5
    """The norms' epsilon."""
    norm_unit_offset: bool = False
    """Every norm multiplies by ``1 + w``, its weight ``w`` starting at 0 (Megatron's
    ``--apply-layernorm-1p``; Gemma's RMSNorm): weight decay then pulls towards the identity."""
    pre_norms: bool = True
    """The blocks normalise each branch's input (``ln_1``, ``ln_2``: pre-norm). False, with
    ``post_norms``: only the branches' outputs (OLMo 2: ``x + post(attn(x))``)."""
    post_norms: bool = False
    """Each block's attention and MLP outputs normalised too, before their residual adds
    (Gemma 2 / 3's ``post_attention_layernorm`` and ``post_feedforward_layernorm``):
    ``x + post(attn(ln_1(x)))``."""
    embedding_multiplier: float = 1.0
    """The token embeddings multiplied by this before the first block (Gemma's
    ``sqrt(hidden_size)``)."""
    squared_relu: bool = False
    """The (ungated) MLP's activation is ``relu(x)^2`` in place of GELU (Nemotron's; Megatron's
    ``--squared-relu``; So et al. 2021, Primer). Not with ``swiglu``."""
    glu_activation: str = "silu"
    """With ``swiglu``, the gate's activation: ``"silu"`` (SwiGLU, Llama's) or ``"gelu"``
    (GeGLU, Gemma's; ``gelu_approximate`` applies)."""
    softmax_scale: Optional[float] = None
    """The attention scores' scale; None: ``1 / sqrt(head_dim)`` (Gemma's
    ``query_pre_attn_scalar ** -0.5``; Megatron's ``softmax_scale``)."""
    attn_logit_softcapping: Optional[float] = None
    """Attention scores capped smoothly to ``(-c, c)`` as ``c * tanh(score / c)`` before the
    softmax (Gemma 2's; an explicit attention, not SDPA's fused kernels; not with context
    parallelism); None: uncapped."""
    final_logit_softcapping: Optional[float] = None
    """The head's logits capped the same way (Gemma 2's); None: uncapped."""
    normalization: str = "layernorm"
    """``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama; no bias, no mean subtracted)."""
    qk_norm: bool = False
    """Queries and keys normalised per head (the ``normalization`` over ``head_dim``, one
    weight shared by the heads) after the projection and before the rotary embedding: Qwen3's
    ``q_norm`` / ``k_norm``, Megatron's ``--qk-layernorm``."""
    qk_norm_scope: str = "head"
    """With ``qk_norm``: ``"head"`` (per head, above) or ``"all"``: one norm over the features
    of all the query heads and one over all the key heads, each feature its own weight
    (OLMo 2's ``q_norm`` / ``k_norm``). Not with tensor parallelism."""
    swiglu: bool = False
    """The MLP as Llama's SwiGLU, ``proj(silu(gate(x)) * fc(x))`` (hidden size still
    ``mlp_ratio * dim``), in place of GPT-2's ``proj(gelu(fc(x)))``."""
    position_embedding: str = "learned"
    """``"learned"`` (GPT-2: a table of ``block_size`` rows added to the tokens) or ``"rope"``
    (rotary embedding of queries and keys, Su et al. 2021, as Llama and Megatron apply it)."""
    rope_theta: float = 10000.0
    """The rotary embedding's base: dimension pair ``i`` turns by ``pos / theta^(2i / d)``."""
    rotary_percent: float = 1.0
    """The share of each head's dimensions the rotary embedding turns, the first ones; the
    rest pass unturned (Megatron's ``--rotary-percent``, Hugging Face's
    ``partial_rotary_factor``: Phi-4-mini's 0.75). The frequencies are those of a head of
    ``int(head_dim * rotary_percent)`` dimensions."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """Rope stretched for a longer context than the model was trained on, as Hugging Face's
    ``rope_parameters`` say it: ``{"rope_type": "linear" | "llama3" | "yarn", "factor": ...}``
    and each kind's keys (:mod:`dist_kernels.models.rope`); completed with the defaults when
    built. None: unscaled."""
    sliding_window: Optional[int] = None
    """Each token attends to itself and the ``sliding_window - 1`` tokens before it only
    (Mistral's ``sliding_window``; Megatron's ``--window-size (W - 1, 0)``); None: to every
    earlier token. Not with context parallelism."""
    global_attention_every: int = 0
    """With ``sliding_window``: every n-th block (block ``i`` with ``(i + 1) % n == 0``)
    attends to the whole prefix, the others through the window (Gemma 3: 6, Gemma 2: 2);
    0: every block windowed (Mistral)."""
    rope_local_theta: Optional[float] = None
    """The windowed blocks' rotary base, unscaled (Gemma 3's ``rope_local_base_freq``); None:
    theirs is the model's ``rope_theta`` and ``rope_scaling``."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    n_experts: int = 0
    """Experts of each MoE block (:class:`~dist_kernels.moe.MoE`); 0: no MoE blocks."""
    top_k: int = 2
    """Experts each token is routed to, in MoE blocks."""
    moe_every: int = 2
    """Every ``moe_every``-th block (blocks ``moe_every - 1, 2 * moe_every - 1, ...``) has an
    MoE in place of its MLP; 1: every block."""
    moe_layers: Optional[Tuple[int, ...]] = None
    """Which blocks have an MoE, one 1 (MoE) or 0 (dense MLP) per block, in place of
    ``moe_every``: Megatron's ``--moe-layer-freq`` pattern, DeepSeek-V3's dense first blocks,
    Qwen-MoE's ``mlp_only_layers``."""
    moe_ffn_hidden_size: Optional[int] = None
    """Each expert's hidden size when it is not the MLP's (Megatron's ``--moe-ffn-hidden-size``;
    Qwen3-MoE's ``moe_intermediate_size``); None: ``ffn_dim``."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """A shared expert of that hidden size in every MoE block, which every token passes through
    beside its routed experts (DeepSeek's, Qwen2-MoE's; Megatron's
    ``--moe-shared-expert-intermediate-size``); None: none."""
    moe_shared_expert_gate: bool = False
    """The shared expert's output scaled by ``sigmoid(x . g)`` (Qwen2-MoE's
    ``shared_expert_gate``; Megatron's ``--moe-shared-expert-gate``)."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing (Megatron's
    ``--moe-router-enable-expert-bias``): the top-k chosen by the scores plus a per-expert bias
    that the trainer moves toward balance after each step (``dk.moe.update_expert_bias``)."""
    moe_router_bias_update_rate: float = 1e-3
    """How far each step moves an expert's bias (``--moe-router-bias-update-rate``)."""
    moe_capacity_factor: Optional[float] = None
    """None: no token dropped; a float: Megatron's capacity, drops before the exchange."""
    moe_router: str = "softmax"
    """``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3)."""
    moe_aux_loss_coeff: float = 1e-2
    """Load-balancing loss coefficient; the loss joins the training loss."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient."""
    moe_norm_topk: bool = False
    """Softmax router: the top-k weights divided by their sum (Mixtral; Qwen's
    ``norm_topk_prob``); False: the top-k probabilities as they are."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "dim", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        for name in (
            "ffn_hidden_size",
            "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "sliding_window",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.gelu_approximate not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"GPTConfig: gelu_approximate must be one of {GELU_APPROXIMATIONS}, got "
                f"{self.gelu_approximate!r}"
            )
        if self.kv_channels is None and self.dim % self.n_heads:
            raise ValueError(f"GPTConfig: dim({self.dim}) % n_heads({self.n_heads}) != 0")
        if self.kv_channels is not None and (
            not isinstance(self.kv_channels, int) or self.kv_channels < 1
        ):
            raise ValueError(
                f"GPTConfig: kv_channels must be a positive int or None, got {self.kv_channels!r}"
            )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig: {name} must be in [0, 1), got {value}")
        for name, choices in (
            ("normalization", NORMALIZATIONS),
            ("position_embedding", POSITION_EMBEDDINGS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"GPTConfig: {name} must be one of {choices}, got {getattr(self, name)!r}"
                )
        kv = self.kv_heads
        if not isinstance(kv, int) or kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"GPTConfig: n_kv_heads({self.n_kv_heads}) must be a positive divisor of "
                f"n_heads({self.n_heads})"
            )
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(
                f"GPTConfig: rotary_percent must lie in (0, 1], got {self.rotary_percent}"
            )
        if self.position_embedding == "rope" and (self.rotary_dim % 2 or not self.rotary_dim):
            of = "kv_channels" if self.kv_channels else f"dim({self.dim}) / n_heads({self.n_heads})"
            size = f"the head size {self.head_dim} ({of})"
            if self.rotary_percent < 1:
                size += f" x rotary_percent({self.rotary_percent}) = {self.rotary_dim}"
            raise ValueError(
                f"GPTConfig: rope turns pairs of dimensions, but {size} is "
                f"{'odd' if self.rotary_dim % 2 else 'none'}"
            )
        if self.qk_norm_scope not in ("head", "all"):
            raise ValueError(
                f"GPTConfig: qk_norm_scope must be 'head' or 'all', got {self.qk_norm_scope!r}"
            )
        if not self.pre_norms and not self.post_norms:
            raise ValueError(
                "GPTConfig: pre_norms=False leaves the blocks without norms: set post_norms "
                "(OLMo 2's blocks normalise the branches' outputs)"
            )
        if self.squared_relu and self.swiglu:
            raise ValueError(
                "GPTConfig: squared_relu is the ungated MLP's activation; swiglu gates the MLP "
                "(glu_activation): set one"
            )
        if self.glu_activation not in ("silu", "gelu"):
            raise ValueError(
                f"GPTConfig: glu_activation must be 'silu' or 'gelu', got {self.glu_activation!r}"
            )
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, cap)
            if value is not None and not value > 0:
                raise ValueError(f"GPTConfig: {cap} must be > 0 (None: off), got {value}")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ValueError(f"GPTConfig: softmax_scale must be > 0, got {self.softmax_scale}")
        if not self.embedding_multiplier > 0:
            raise ValueError(
                f"GPTConfig: embedding_multiplier must be > 0, got {self.embedding_multiplier}"
            )
        if self.global_attention_every < 0 or (
            self.global_attention_every and self.sliding_window is None
        ):
            raise ValueError(
                f"GPTConfig: global_attention_every({self.global_attention_every}) is a count "
                ">= 0 of the blocks between global ones, for a model with a sliding_window"
            )
        if self.rope_local_theta is not None and (
            self.sliding_window is None or self.position_embedding != "rope"
        ):
            raise ValueError(
                "GPTConfig: rope_local_theta is the windowed blocks' rotary base: it needs "
                "position_embedding='rope' and a sliding_window"
            )
        if self.rotary_percent != 1 and self.position_embedding != "rope":
            raise ValueError(
                f"GPTConfig: rotary_percent({self.rotary_percent}) needs "
                f"position_embedding='rope', got {self.position_embedding!r}"
            )
        if self.rope_scaling is not None and self.position_embedding != "rope":
            raise ValueError(
                f"GPTConfig: rope_scaling needs position_embedding='rope', got "
                f"{self.position_embedding!r}"
            )
        try:
            self.rope_scaling = rope_scaling_checked(self.rope_scaling)
            pairs_checked(self.rope_scaling, self.rotary_dim)
        except ValueError as e:
            raise ValueError(f"GPTConfig: {e}") from None
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ValueError(
                "GPTConfig: moe_shared_expert_gate needs a shared expert "
                "(moe_shared_expert_intermediate_size)"
            )
        if self.n_experts and (not isinstance(self.moe_every, int) or self.moe_every < 1):
            raise ValueError(f"GPTConfig: moe_every must be a positive int, got {self.moe_every}")
        self._check_moe_layers()

    def window_of(self, i: int) -> Optional[int]:
        """Block ``i``'s attention window (None: the whole prefix)."""
        every = self.global_attention_every
        if self.sliding_window is None or (every and (i + 1) % every == 0):
            return None
        return self.sliding_window

    def rope_of(self, i: int) -> Tuple[float, Optional[Dict[str, Any]]]:
        """Block ``i``'s rotary ``(theta, scaling)``."""
        if self.rope_local_theta is not None and self.window_of(i) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def _check_moe_layers(self) -> None:
        """``moe_layers`` as a tuple (a list from JSON) of one 0 or 1 per block, with experts."""
        if self.moe_layers is None:
            return
        pattern = tuple(self.moe_layers)
        if len(pattern) != self.n_layers or any(v not in (0, 1) for v in pattern):
            raise ValueError(
                f"GPTConfig: moe_layers needs one 0 (dense) or 1 (MoE) per block, "
                f"{self.n_layers} in all; got {list(pattern)}"
            )
        if not self.n_experts:
            raise ValueError("GPTConfig: moe_layers places MoE blocks: it needs n_experts")
        self.moe_layers = tuple(int(v) for v in pattern)

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` has an MoE in place of its MLP."""
        if self.n_experts and self.moe_layers is not None:
            return bool(self.moe_layers[i])
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def norm_biased(self) -> bool:
        """Whether a LayerNorm of this model has a bias."""
        return self.bias if self.norm_bias is None else self.norm_bias

    @property
    def attn_dropout(self) -> float:
        """The attention probabilities' dropout rate."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def any_dropout(self) -> bool:
        return self.dropout > 0 or self.attn_dropout > 0

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden size."""
        return self.ffn_hidden_size or self.mlp_ratio * self.dim

    @property
    def moe_ffn_dim(self) -> int:
        """Each expert's hidden size."""
        return self.moe_ffn_hidden_size or self.ffn_dim

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head the rotary embedding turns (the first ones)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def kv_heads(self) -> int:
        """Key / value heads: ``n_kv_heads``, or ``n_heads`` without grouping."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention, with grouped key / value heads when ``n_kv_heads`` <
    ``n_heads``. The fused ``qkv`` lays its outputs out group by group (the query heads of a
    group, then its key and its value head), so a sharded ``qkv`` holds whole groups and
    nothing here depends on how many this rank has."""

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.head_dim, self.dropout = cfg.head_dim, cfg.attn_dropout
        self.group = cfg.n_heads // cfg.kv_heads  # query heads per key / value head
        theta, self.rope_scaling = cfg.rope_of(layer)
        self.rope_theta = theta if cfg.position_embedding == "rope" else None
        self.rotary_dim = cfg.rotary_dim
        # a scale other than SDPA's 1 / sqrt(d), applied to the queries: every attention
        # path (SDPA, ring attention) then scores with it
        scale = cfg.softmax_scale
        self.query_scale = None if scale is None else scale * cfg.head_dim**0.5
        self.softcap = cfg.attn_logit_softcapping
        qkv_heads = cfg.n_heads + 2 * cfg.kv_heads
        self.qkv = nn.Linear(cfg.dim, qkv_heads * cfg.head_dim, bias=cfg.bias or cfg.qkv_bias)
        self.qk_whole = cfg.qk_norm_scope == "all"  # OLMo 2: over every head's features
        q_size, k_size = (cfg.n_heads, cfg.kv_heads) if self.qk_whole else (1, 1)
        self.q_norm = _norm(cfg, q_size * cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, k_size * cfg.head_dim) if cfg.qk_norm else None
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.bias)
        self.probs_site = 3 * layer + 1  # the attention probabilities' dropout site
        self.drop = SiteDropout(cfg.dropout, 3 * layer + 2)
        self.sequence: Optional[cp.SequenceSharding] = None  # set by GPT.context_parallel
        self.documents: Optional[DocumentMasking] = None  # set by GPT.document_masking
        self.window = cfg.window_of(layer)

    def fused_qkv(self) -> Tuple[torch.Tensor, int, int]:
        """``(weight, query heads per group, head_dim)``: how the fused projection's rows are
        laid out (``[group][q_1 .. q_r, k, v][head_dim]``), for optimizers that treat the
        query, key and value projections as three matrices (``dk.optim.Muon(split_qkv=True)``)."""
        return self.qkv.weight, self.group, self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, groups * (group + 2) * d] (this rank's, whole sequence)
        s, b = qkv.shape[:2]
        r = self.group
        qkv = qkv.view(s, b, -1, r + 2, self.head_dim).permute(1, 2, 3, 0, 4)  # [b,g,r+2,s,d]
        q = qkv[:, :, :r].flatten(1, 2)  # [b, heads, s, d]: group by group
        k, v = qkv[:, :, r], qkv[:, :, r + 1]  # [b, groups, s, d]
        if self.q_norm is not None and self.qk_whole:  # all heads' features at once
            q, k = _across_heads(self.q_norm, q), _across_heads(self.k_norm, k)
        elif self.q_norm is not None:  # per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:  # [b, heads, s, d], turned by the tokens' positions
            cos, sin = self._rope_tables(s, b, q.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.query_scale is not None:
            q = q * self.query_scale
        p = self.dropout if self.training else 0.0
        if r > 1 and not _SDPA_GQA:  # SDPA before torch 2.5 has no groups: repeat each key
            # / value head for the r query heads of its group
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        mask = self._mask(s, q.device)  # None: causal
        keys = dropout_lib.active_keys() if p > 0 else None
        if keys is not None:  # counter-based masks on the probabilities, written out
            drop = functools.partial(self._drop_probs, keys=keys)
            y = _explicit_attention(q, k, v, mask, self.softcap, drop)
        elif self.softcap is not None:  # SDPA has no cap: the scores written out
            drop = functools.partial(F.dropout, p=p)
            with tp.get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
                y = _explicit_attention(q, k, v, mask, self.softcap, drop)
        elif self.sequence is not None:
            y = self.sequence.attention(q, k, v, causal=True)
        else:  # heads are sharded: per-tp-rank masks (no stream swap when nothing is drawn)
            gqa = {"enable_gqa": True} if r > 1 else {}  # no repeated copies of k and v
            causal = {"is_causal": True} if mask is None else {"attn_mask": mask}
            with tp.get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **causal, **gqa)
        y = y.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * d]
        return self.drop(self.proj(y))

    @torch.compiler.disable  # the keys change every step: no graph guarded on them
    def _drop_probs(self, weights: torch.Tensor, keys: Any) -> torch.Tensor:
        """Dropout of the probabilities ``[b, heads, s, s]`` with counter-based masks over
        (sample, global head, query, key); this rank's heads are a contiguous block of all."""
        b, heads, s, _ = weights.shape
        rank = getattr(self.qkv, "tp_rank", 0)
        ids = torch.arange(rank * heads, (rank + 1) * heads)
        keep = dropout_lib.attention_keep(self.probs_site, keys, b, ids, s, self.dropout,
                                          weights.device)  # fmt: skip
        return dropout_lib.apply_mask(weights, keep, self.dropout)

    def _mask(self, s: int, device: torch.device) -> Optional[torch.Tensor]:
        """True where a query may attend: the documents' mask ``[b, 1, s, s]`` and / or the
        sliding window's band ``[s, s]``; None when that is just causal (SDPA's flag)."""
        mask = None if self.documents is None else self.documents.mask
        if self.window is None or s <= self.window:
            return mask
        q, k = torch.arange(s, device=device)[:, None], torch.arange(s, device=device)[None, :]
        band = (k <= q) & (k > q - self.window)  # itself and the window - 1 before it
        return band if mask is None else mask & band

    def _rope_tables(self, s: int, b: int, device: torch.device):
        """cos / sin ``[s, r]`` of positions 0..s-1 (this shard's under cp), or ``[b, 1, s, r]``
        of each token's position in its document when positions reset (``r`` the rotary
        dimensions)."""
        reset = None if self.documents is None else self.documents.positions
        d, theta, scaling = self.rotary_dim, self.rope_theta, self.rope_scaling
        by_length = scaling is not None and scaling["rope_type"] == "longrope"
        if reset is None:
            pos = torch.arange(s) if self.sequence is None else self.sequence.positions(s)
            # longrope's factors follow the whole sequence's length (every cp rank's alike)
            length = s * (1 if self.sequence is None else self.sequence.size)
            return rope_tables(pos.to(device), d, theta, scaling, length if by_length else None)
        length = int(reset.max()) + 1 if by_length else None  # as transformers: max position
        cos, sin = rope_tables(reset.reshape(-1), d, theta, scaling, length)
        return cos.view(b, 1, s, d), sin.view(b, 1, s, d)


def _across_heads(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm`` over the features of all the heads of ``x [b, heads, s, d]`` at once."""
    b, h, s, d = x.shape
    return norm(x.transpose(1, 2).reshape(b, s, h * d)).view(b, s, h, d).transpose(1, 2)


def _explicit_attention(q, k, v, mask, cap: Optional[float], drop: Callable) -> torch.Tensor:
    """Causal attention written out: the scores capped to ``(-cap, cap)`` by
    ``cap * tanh(s / cap)`` (Gemma 2's) unless ``cap`` is None, the probabilities passed
    through ``drop``: ``q [b, h, s, d]``, ``k`` / ``v [b, g, s, d]`` (query head ``i`` on key /
    value head ``i // (h / g)``), ``mask`` True where a query may attend (None: causal)."""
    r = q.shape[1] // k.shape[1]
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask is None:
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
    return drop(weights.to(q.dtype)) @ v


class MLP(nn.Module):
    """GPT-2's ``proj(gelu(fc(x)))`` (Nemotron's ``proj(relu(fc(x))^2)`` with
    ``squared_relu``), or with ``swiglu`` Llama's ``proj(silu(gate(x)) * fc(x))``; ``fc`` and
    ``gate`` are column-parallel under tp, ``proj`` row-parallel."""

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        hidden = cfg.ffn_dim
        self.approximate = cfg.gelu_approximate
        self.squared_relu = cfg.squared_relu
        self.glu = cfg.glu_activation
        self.fc = nn.Linear(cfg.dim, hidden, bias=cfg.bias)
        self.gate = nn.Linear(cfg.dim, hidden, bias=cfg.bias) if cfg.swiglu else None
        self.proj = nn.Linear(hidden, cfg.dim, bias=cfg.bias)
        self.drop = SiteDropout(cfg.dropout, 3 * layer + 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            h = self.fc(x)
            h = F.relu(h).square() if self.squared_relu else F.gelu(h, approximate=self.approximate)
            return self.drop(self.proj(h))
        if self.glu == "gelu":  # GeGLU
            gated = F.gelu(self.gate(x), approximate=self.approximate)
        else:
            gated = F.silu(self.gate(x))
        return self.drop(self.proj(gated * self.fc(x)))


class UnitOffsetNorm(nn.Module):
    """LayerNorm or RMSNorm multiplying by ``1 + weight``, the weight starting at 0
    (``GPTConfig.norm_unit_offset``). Computed in FP32 at least, as Gemma's RMSNorm."""

    def __init__(self, size: int, eps: float, rms: bool, bias: bool) -> None:
        super().__init__()
        self.rms, self.eps, self.shape = rms, eps, (size,)
        self.weight = nn.Parameter(torch.zeros(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias and not rms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf, scale = x.to(dtype), 1 + self.weight.to(dtype)
        if self.rms:
            return (F.rms_norm(xf, self.shape, eps=self.eps) * scale).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.layer_norm(xf, self.shape, scale, bias, self.eps).to(x.dtype)


def _norm(cfg: GPTConfig, size: Optional[int] = None) -> nn.Module:
    """The model's norm over ``size`` features (default: ``dim``)."""
    size = size or cfg.dim
    rms = cfg.normalization == "rmsnorm"
    if rms and not hasattr(nn, "RMSNorm"):
        raise ValueError("GPT: normalization='rmsnorm' needs torch >= 2.4 (nn.RMSNorm)")
    if cfg.norm_unit_offset:
        return UnitOffsetNorm(size, cfg.norm_eps, rms, cfg.norm_biased)
    if rms:
        return nn.RMSNorm(size, eps=cfg.norm_eps)
    return nn.LayerNorm(size, eps=cfg.norm_eps, bias=cfg.norm_biased)


def _moe(cfg: GPTConfig) -> moe_lib.MoE:
    """An unsharded MoE whose experts have ``moe_ffn_dim`` hidden units (``shard_experts``
    later)."""
    return moe_lib.MoE(
        cfg.dim,
        cfg.moe_ffn_dim,
        cfg.n_experts,
        cfg.top_k,
        None,
        cfg.moe_capacity_factor,
        cfg.moe_router,
        cfg.moe_aux_loss_coeff,
        cfg.moe_z_loss_coeff,
        shared_ffn_dim=cfg.moe_shared_expert_intermediate_size,
        shared_gate=cfg.moe_shared_expert_gate,
        expert_bias=cfg.moe_router_enable_expert_bias,
        bias_update_rate=cfg.moe_router_bias_update_rate,
        norm_topk=cfg.moe_norm_topk,
    )


class Block(nn.Module):
    """Pre-norm transformer block; ``mlp`` is an MoE in MoE blocks."""

    def __init__(self, cfg: GPTConfig, moe: bool = False, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = _norm(cfg) if cfg.pre_norms else None
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = _norm(cfg) if cfg.pre_norms else None
        self.mlp = _moe(cfg) if moe else MLP(cfg, layer)
        # Megatron's hidden dropout after an MoE too (the dense MLP has its own, the same site)
        self.moe_drop = SiteDropout(cfg.dropout, 3 * layer + 3) if moe else None
        # Gemma's norms of the branches' outputs (GPTConfig.post_norms)
        self.post_attn_norm = _norm(cfg) if cfg.post_norms else None
        self.post_mlp_norm = _norm(cfg) if cfg.post_norms else None
        self.recompute = False  # GPT.recompute_blocks
        # recomputed with dropout on tp shards: only counter-based masks are drawn alike again
        self.needs_keys = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            if self.needs_keys and self.training and dropout_lib.active_keys() is None:
                raise ValueError(
                    "GPT.recompute_blocks: dropout > 0 on a tensor-parallel model: the "
                    "recomputed forward would draw other dropout masks from the tracker's "
                    "stream than the first one did (run it inside "
                    "dk.models.dropout.dropout_keys: counter-based masks)"
                )
            # Activation checkpointing: keep the block's input only and run the block again in
            # backward. Non-reentrant: the MoE aux loss, an output besides the return value,
            # gets its gradient too; the block's collectives (tensor-parallel all-reduces, ring
            # attention, the token all-to-all) run again on every rank in the same order.
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_attn_norm is None:
            x = x + self.attn(self.ln_1(x))
            return x + self._ffn(self.ln_2(x))
        if self.ln_1 is None:  # OLMo 2: the branches' outputs normalised only
            x = x + self.post_attn_norm(self.attn(x))
            return x + self.post_mlp_norm(self._ffn(x))
        x = x + self.post_attn_norm(self.attn(self.ln_1(x)))
        return x + self.post_mlp_norm(self._ffn(self.ln_2(x)))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return y if self.moe_drop is None else self.moe_drop(y)


class Embedding(nn.Module):
    """Token + learned position embedding: ids ``[b, s]`` -> ``[s, b, h]`` (or this rank's
    sequence shard ``[s / tp, b, h]`` when the token embedding is sequence-parallel)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.multiplier = cfg.embedding_multiplier
        learned = cfg.position_embedding == "learned"  # rope: positions turn q and k instead
        self.wpe = nn.Embedding(cfg.block_size, cfg.dim) if learned else None
        self.drop = SiteDropout(cfg.dropout, 0)
        self.sequence: Optional[cp.SequenceSharding] = None  # set by GPT.context_parallel
        self.documents: Optional[DocumentMasking] = None  # set by GPT.document_masking

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids.shape[1]
        seq = local if self.sequence is None else local * self.sequence.size
        if seq > self.block_size:
            raise ValueError(f"GPT: sequence length {seq} > block_size({self.block_size})")
        if self.documents is not None:  # for the attention layers, until the next forward
            self.documents.observe(ids)
        x = self.wte(ids.t())
        if self.multiplier != 1.0:
            x = x * self.multiplier
        if self.wpe is None:
            return self.drop(x)
        reset = None if self.documents is None else self.documents.positions
        if reset is not None:  # each token's position in its document: [s, b, h]
            pos = self.wpe(reset.t())
        elif self.sequence is None:
            pos = self.wpe.weight[:seq].unsqueeze(1)
        else:  # the rows of this shard's global positions
            pos = self.wpe.weight[self.sequence.positions(local).to(ids.device)].unsqueeze(1)
        if getattr(self.wte, "sequence_parallel", False):
            pos = pos.chunk(self.wte.tp_size)[self.wte.tp_rank]  # this rank's positions
        return self.drop(x + pos.to(x.dtype))


class Head(nn.Module):
    """Final norm and linear head: ``[s, b, h]`` -> logits ``[b, s, vocab]`` (this rank's
    vocabulary columns when sharded)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.softcap = cfg.final_logit_softcapping
        self.sequence: Optional[cp.SequenceSharding] = None  # set by GPT.context_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.transpose(0, 1)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; vocabulary-parallel (no gather) when the head is sharded; over
        every token of the whole sequences under context parallelism."""
        head = self.lm_head
        reduction = "mean" if self.sequence is None else "sum"
        if isinstance(head, tp.ColumnParallelLinear) and not head.gather_output:
            loss = tp.vocab_parallel_cross_entropy(
                logits, targets, comm=head.comm, reduction=reduction
            )
        else:
            flat = logits.reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(flat, targets.reshape(-1), reduction=reduction)
        if self.sequence is None:
            return loss
        return self.sequence.mean(loss, (targets != -100).sum())


class GPT(nn.Module):
    """Decoder-only transformer; see the module docstring for its layout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.blocks = nn.ModuleList(
            Block(config, config.is_moe_block(i), i) for i in range(config.n_layers)
        )
        self.head = Head(config)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embedding.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, s, vocab (/ tp)]``, or the mean loss if ``targets`` is given."""
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if targets is None else self.loss(logits, targets)

    def aux_loss(self) -> torch.Tensor:
        """The MoE blocks' auxiliary losses of the last forward (0 without MoE blocks)."""
        aux = moe_lib.aux_loss_of(self)
        return aux if aux is not None else torch.zeros(())

    def moe_layers(self) -> list:
        """The MoE layers, block order."""
        return [b.mlp for b in self.blocks if isinstance(b.mlp, moe_lib.MoE)]

    def expert_parallel(self, comm: Any) -> GPT:
        """Shards every MoE block's experts over the expert-parallel group ``comm``
        (``mesh.ep_comm``), in place; returns the model. Expert parameters then carry
        ``expert_parallel = True``: their gradients are reduced over ``mesh.expert_dp_comm``."""
        for block in self.blocks:
            if isinstance(block.mlp, moe_lib.MoE):
                block.mlp = moe_lib.shard_experts(block.mlp, comm)
        return self

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of :meth:`forward`'s logits (a Pipeline's ``loss_fn``), plus the MoE
        blocks' aux losses of that forward."""
        loss = self.head.loss(logits, targets)
        return loss + self.aux_loss() if self.moe_layers() else loss

    def recompute_blocks(self, on: bool = True) -> GPT:
        """Activation checkpointing of every block (Megatron's full recompute): a block keeps
        only its input for backward and runs its forward again there. Returns the model.

        torch's checkpoint replays the default generators' state, so dropout draws the same
        masks again; the tensor-parallel tracker's stream it does not replay: a training forward
        of a tensor-parallel model with dropout raises, unless it runs inside
        ``dk.models.dropout.dropout_keys`` (counter-based masks, drawn alike every time;
        docs/tensor_parallel.md, Random numbers)."""
        sharded = any(getattr(m, "tp_size", 1) > 1 for m in self.modules())
        for block in self.blocks:
            block.recompute = bool(on)
            block.needs_keys = bool(on) and sharded and self.config.any_dropout
        return self

    def compile_blocks(self, backend: str = "inductor", **options: Any) -> GPT:
        """``torch.compile`` of every block, in place (torchtitan's per-block compile);
        returns the model. Each block's own forward is compiled, so the parameter names, the
        pipeline's cuts and the engines' per-block hooks (ZeRO-3's gathers) stay as they are.
        The collectives inside a block (tensor-parallel all-reduces, ring attention, the MoE
        token exchange) run eagerly between compiled pieces (graph breaks). ``options`` go to
        ``torch.compile`` (``mode``, ``dynamic``, ...)."""
        for block in self.blocks:
            block.compile(backend=backend, **options)
        return self

    def as_sequential(self) -> nn.Sequential:
        """``embedding, *blocks, head`` (the same modules) as an ``nn.Sequential``."""
        return nn.Sequential(self.embedding, *self.blocks, self.head)

    def tp_plan(self, tp_size: int, sequence_parallel: bool = False) -> Dict[str, Any]:
        """The :func:`tp.shard_module` plan: heads, MLP columns and vocabulary split.

        Raises ``ValueError`` with the arithmetic when a size does not divide.
        """
        cfg = self.config
        for name, value in (
            ("n_heads", cfg.n_heads),
            ("n_kv_heads", cfg.kv_heads),
            ("vocab_size", cfg.vocab_size),
            ("mlp hidden (ffn_hidden_size or mlp_ratio * dim)", cfg.ffn_dim),
        ):
            if value % tp_size:
                raise ValueError(f"GPT: {name}({value}) % tp({tp_size}) != 0")
        sp = bool(sequence_parallel)
        plan: Dict[str, Any] = {
            "embedding.wte": tp.VocabParallel(sequence_parallel=sp),
            "blocks.*.attn.qkv": tp.ColumnParallel(sequence_parallel=sp),
            "blocks.*.attn.proj": tp.RowParallel(sequence_parallel=sp),
            "head.lm_head": tp.ColumnParallel(sequence_parallel=sp),
        }
        if sp and cfg.n_experts:
            raise ValueError(
                "GPT: sequence_parallel with MoE blocks is not supported yet: each tp rank would "
                "route its sequence shard, and the aux loss needs its statistics reduced over "
                "tp first (Megatron's sequence_partition_group)"
            )
        for i in range(cfg.n_layers):  # MoE blocks stay whole over tp (experts shard over ep)
            if cfg.is_moe_block(i):
                continue
            plan[f"blocks.{i}.mlp.fc"] = tp.ColumnParallel(sequence_parallel=sp)
            if cfg.swiglu:
                plan[f"blocks.{i}.mlp.gate"] = tp.ColumnParallel(sequence_parallel=sp)
            plan[f"blocks.{i}.mlp.proj"] = tp.RowParallel(sequence_parallel=sp)
        if cfg.qk_norm and cfg.qk_norm_scope == "all" and tp_size > 1:
            raise ValueError(
                "GPT: qk_norm_scope='all' (OLMo 2's norm over every head's features) with "
                f"tp({tp_size}) > 1: a rank holds only its heads, and the norm's statistics would "
                "need the other ranks'"
            )
        if cfg.qk_norm:  # one weight over this rank's heads: its gradient is a partial sum
            plan["blocks.*.attn.?_norm"] = tp.ReplicatedOverShards()
        if sp:  # everything between the pairs runs on sequence shards
            if cfg.position_embedding == "learned":
                plan["embedding.wpe"] = tp.SequenceParallel()
            patterns = ["embedding.drop", "blocks.*.*.drop", "head.ln_f"]
            if cfg.pre_norms:
                patterns.append("blocks.*.ln_?")
            for pattern in patterns:
                plan[pattern] = tp.SequenceParallel()
            if cfg.post_norms:
                plan["blocks.*.post_*_norm"] = tp.SequenceParallel()
        return plan

    def parallelize(self, comm: Any, sequence_parallel: bool = False) -> GPT:
        """Shards this model in place over the tensor-parallel group ``comm``; returns it."""
        size = 1 if comm is None else comm.world_size
        return tp.shard_module(self, self.tp_plan(size, sequence_parallel), comm)

    def context_parallel(self, comm: Any, load_balance: bool = True) -> GPT:
        """Runs this model on sequence shards over the context-parallel group ``comm``
        (``mesh.cp_comm``); returns it. Inputs and targets are then this rank's shard
        (``cp.shard_sequence(ids, comm, dim=1, load_balance=load_balance)``); parameters'
        gradients are averaged over dp x cp (``mesh.dp_cp_comm``), as over dp."""
        if self.config.attn_dropout > 0:
            raise ValueError(
                f"GPT.context_parallel: attention dropout({self.config.attn_dropout}) > 0, but "
                "ring attention has no dropout of the probabilities (torch's CPU flash kernel "
                "has none): set attention_dropout=0"
            )
        if self.embedding.documents is not None or self.config.sliding_window is not None:
            raise ValueError(
                "GPT.context_parallel: document masking or a sliding window is on, but ring "
                "attention has no per-document or windowed mask"
            )
        if self.config.attn_logit_softcapping is not None:
            raise ValueError(
                "GPT.context_parallel: attn_logit_softcapping is on, but ring attention has no "
                "capped scores"
            )
        sequence = cp.SequenceSharding(comm, load_balance)
        drops = [m for m in self.modules() if isinstance(m, SiteDropout)]  # global positions
        for module in (self.embedding, *(b.attn for b in self.blocks), self.head, *drops):
            module.sequence = sequence
        return self

    def document_masking(
        self, eod: int, reset_attention_mask: bool = True, reset_position_ids: bool = True
    ) -> GPT:
        """Keeps the documents of a packed sequence apart (:mod:`dist_kernels.models.documents`):
        with ``reset_attention_mask`` each token attends within its own document only, with
        ``reset_position_ids`` its position counts from its document's start; documents end
        with token ``eod``. Returns the model. Not with context parallelism."""
        if self.embedding.sequence is not None:
            raise ValueError(
                "GPT.document_masking: the model is context-parallel, and ring attention has "
                "no per-document mask"
            )
        documents = DocumentMasking(eod, reset_attention_mask, reset_position_ids)
        for module in (self.embedding, *(b.attn for b in self.blocks)):
            module.documents = documents
        return self
