"""``python -m dist_kernels.train``: parse, check everything, then spawn ranks or join torchrun.

Without ``torchrun`` (no ``RANK`` / ``WORLD_SIZE`` in the environment) it starts
``dp x tp x cp x pp`` local CPU ranks itself, as ``python -m dist_kernels.bench`` does
(:mod:`dist_kernels.launch`: a TCPStore this process holds open, a gloo group). Under
``torchrun`` it is one of the ranks; with ``--max-restarts`` and ``--resume auto`` a group
restarted after a lost rank continues from the newest complete checkpoint.

Every check that can fail (options, batch arithmetic, data file, checkpoint to resume) runs
in the launching process, before any rank starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import signal
import sys
from typing import Any, List, Optional, Sequence, Tuple

from ..lr import WSD_STYLES
from ..models.gpt import NORMALIZATIONS, POSITION_EMBEDDINGS, GPTConfig
from ..models.rope import ROPE_SCALINGS, rope_scaling_checked
from ..pipeline.schedules import SCHEDULES
from .config import (
    DECAYS,
    MUON_ADJUST_LR,
    MUON_NS_DTYPES,
    MUON_TP_MODES,
    OPTIMIZERS,
    ConfigError,
    TrainConfig,
)
from .megatron_flags import add_megatron_spellings, from_megatron

_STRATEGY_HELP = "0 = DDP; 1 / 2 / 3 = ZeRO stage of dk.ShardedOptimizer (FSDP2 for --engine torch)"


def _pair(kind):
    def parse(text: str) -> Tuple[int, Any]:
        try:
            rank, value = text.split(":")
            return int(rank), kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected RANK:{kind.__name__.upper()}, got {text!r}"
            ) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dist_kernels.train",
        description="Train a character-level GPT with any parallel layout; metrics, "
        "stragglers, checkpoints, and torch's DDP / FSDP2 beside ours.",
    )
    d = TrainConfig()
    m = d.model
    add = p.add_argument

    def field(flag: str, kind: type, help: Optional[str] = None) -> None:
        """A flag for the TrainConfig field of the same name, its default the field's."""
        add(flag, type=kind, default=getattr(d, flag[2:].replace("-", "_")), help=help)

    add("--dp", type=int, default=0, help="data-parallel replicas (0: world / (tp x cp x pp))")
    add("--tp", "--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    add(
        "--cp",
        "--context-parallel-size",
        type=int,
        default=1,
        help="context-parallel ranks (sequence split, ring attention)",
    )
    add(
        "--ep",
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="expert-parallel ranks (carved from dp)",
    )
    add("--experts", type=int, default=0, help="experts per MoE block (0: no MoE blocks)")
    add("--top-k", "--moe-router-topk", type=int, default=2, help="experts per token in MoE blocks")
    add(
        "--moe-every",
        type=int,
        default=None,
        help="every n-th block is an MoE block (default 2; 1 with --num-experts, Megatron's)",
    )
    add(
        "--kv-channels",
        type=int,
        default=None,
        help="each attention head's width (default d_model / heads; Qwen3's head_dim)",
    )
    add(
        "--dropout",
        type=float,
        default=None,
        help="dropout on the embeddings, attention probabilities and residual branches (default "
        "0; its masks are the same in every layout: hashed from the seed, step, sample and "
        "element)",
    )
    add(
        "--attention-dropout",
        type=float,
        default=None,
        help="the attention probabilities' own rate (default: --dropout's; Megatron's flag)",
    )
    add(
        "--disable-bias-linear",
        action="store_true",
        help="no biases in the linear layers (Llama's, Qwen's, Mixtral's); a LayerNorm keeps "
        "its bias, as Megatron's",
    )
    add(
        "--no-norm-bias",
        action="store_true",
        help="LayerNorms without a bias (GPTConfig.norm_bias=False; with --disable-bias-linear: "
        "no bias anywhere)",
    )
    add(
        "--add-qkv-bias",
        action="store_true",
        help="the query / key / value projection biased even without biases elsewhere (Qwen2)",
    )
    add(
        "--qk-layernorm",
        action="store_true",
        help="queries and keys normalised per head before rope (Megatron's; Qwen3's q/k_norm)",
    )
    add(
        "--moe-aux-loss-coeff",
        type=float,
        default=m.moe_aux_loss_coeff,
        help="MoE: the load-balancing loss's coefficient (Megatron's)",
    )
    add(
        "--moe-norm-topk",
        action="store_true",
        help="MoE: the top-k routing weights divided by their sum (Mixtral; norm_topk_prob)",
    )
    add(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="MoE: each expert's hidden size (default --ffn-hidden-size; Megatron's)",
    )
    add(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="MoE: a shared expert of that hidden size beside the routed ones (Megatron's)",
    )
    add(
        "--moe-shared-expert-gate",
        action="store_true",
        help="MoE: the shared expert's output scaled by sigmoid(x . g) (Qwen2-MoE's)",
    )
    add(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="MoE: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert routing bias",
    )
    add(
        "--moe-router-bias-update-rate",
        type=float,
        default=m.moe_router_bias_update_rate,
        help="MoE: each step's move of an expert's bias (Megatron's, 1e-3)",
    )
    add("--pp", "--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    add("--zero", type=int, default=0, choices=(0, 1, 2, 3), help=_STRATEGY_HELP)
    add(
        "--schedule",
        default=d.schedule,
        choices=SCHEDULES,
        help="pipeline schedule (interleaved-1f1b, zb-v and dualpipe-v: 2 stages per rank)",
    )
    add(
        "--micro-batch",
        "--micro-batch-size",
        type=int,
        default=d.micro_batch,
        help="samples per forward per rank",
    )
    add("--grad-accum", type=int, default=0, help="micro-batches per step (0: derived)")
    add(
        "--global-batch",
        "--global-batch-size",
        type=int,
        default=0,
        help="samples per step (0: derived)",
    )
    add(
        "--bucket-cap-mb",
        type=float,
        default=d.bucket_cap_mb,
        help="gradient bucket MiB (both engines)",
    )
    add("--first-bucket-mb", type=float, default=d.first_bucket_mb, help="first bucket MiB (ours)")
    add("--dtype", default=d.dtype, choices=("fp32", "bf16", "fp16"))
    field("--initial-loss-scale", float, "fp16: the first dynamic loss scale")
    field("--loss-scale-window", int, "fp16: clean steps before the loss scale doubles")
    field("--hysteresis", int, "fp16: overflowing steps in a row before the loss scale halves")
    field("--min-loss-scale", float, "fp16: the loss scale's floor (an overflow there stops)")
    add("--steps", "--train-iters", type=int, default=d.steps)
    add("--stop-after", type=int, default=None, help="stop after this step (resume later)")
    add("--lr", type=float, default=d.lr, help="peak learning rate at --lr-base-batch")
    add("--lr-scaling", default=d.lr_scaling, choices=("none", "linear", "sqrt"))
    add("--lr-base-batch", type=int, default=d.lr_base_batch)
    add("--warmup", "--lr-warmup-iters", type=int, default=d.warmup, help="linear warm-up steps")
    add(
        "--decay",
        "--lr-decay-style",
        dest="decay",
        default=d.decay,
        choices=DECAYS,
        help="after warm-up (wsd: warm-up, stable, decay over --lr-wsd-decay-steps)",
    )
    field("--min-lr-ratio", float, "the decay's final rate, a fraction of the peak")
    add(
        "--lr-wsd-decay-steps",
        type=int,
        default=d.wsd_decay_steps,
        help="wsd: the final decay's steps (0: the last 20%% of --steps)",
    )
    add("--lr-wsd-decay-style", default=d.wsd_decay_style, choices=WSD_STYLES)
    add(
        "--lr-decay-steps",
        "--lr-decay-iters",
        dest="lr_decay_steps",
        type=int,
        default=d.lr_decay_steps,
        help="the schedule's horizon: warm-up and decay end there (0: --steps)",
    )
    field("--weight-decay", float, "AdamW weight decay")
    add(
        "--optimizer",
        default=d.optimizer,
        choices=OPTIMIZERS,
        help="fused-adamw: each engine's fused AdamW kernel (ours: dk.optim.FusedAdamW); "
        "muon: dk.optim.Muon on hidden matrices, AdamW on the rest",
    )
    field("--adam-beta1", float, "AdamW's first-moment coefficient")
    field("--adam-beta2", float, "AdamW's second-moment coefficient")
    field("--adam-eps", float, "AdamW's epsilon")
    field("--muon-momentum", float, "muon: the momentum")
    add(
        "--muon-nesterov",
        action=argparse.BooleanOptionalAction,
        default=d.muon_nesterov,
        help="muon: Nesterov momentum",
    )
    add(
        "--muon-num-ns-steps",
        "--muon-ns-steps",
        dest="muon_ns_steps",
        type=int,
        default=d.muon_ns_steps,
        help="muon: Newton-Schulz iterations",
    )
    add(
        "--muon-adjust-lr",
        default=d.muon_adjust_lr,
        choices=MUON_ADJUST_LR,
        help="muon: a matrix's rate by its shape (match_rms_adamw: AdamW's lr carries over)",
    )
    add(
        "--muon-split-qkv",
        action=argparse.BooleanOptionalAction,
        default=d.muon_split_qkv,
        help="muon: the fused query / key / value weight as three matrices",
    )
    add(
        "--muon-ns-dtype",
        default=d.muon_ns_dtype,
        choices=MUON_NS_DTYPES,
        help="muon: Newton-Schulz's precision (bf16 as torch.optim.Muon)",
    )
    add(
        "--muon-tp-mode",
        default=d.muon_tp_mode,
        choices=MUON_TP_MODES,
        help="muon with --tp: orthogonalise each split matrix whole (duplicated) or per block",
    )
    add(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: the sequence split over tp ranks between the tensor-parallel layers",
    )
    add(
        "--recompute",
        action="store_true",
        help="activation checkpointing: every block's forward run again in backward",
    )
    add(
        "--compile",
        action="store_true",
        help="torch.compile every transformer block (not with zb-h1, zb-h2, zb-v, dualpipe-v)",
    )
    field("--compile-backend", str, "torch.compile's backend with --compile")
    add(
        "--clip-grad",
        type=float,
        default=d.clip_grad,
        help="clip the whole model's gradient norm to this before each step (0: off)",
    )
    add("--seed", type=int, default=d.seed)
    add(
        "--data",
        "--data-path",
        dest="data",
        nargs="+",
        default=None,
        metavar="[WEIGHT] FILE",
        help="text file, or token ids (.bin: uint16, nanoGPT's; .npy; a Megatron indexed "
        "dataset's PREFIX, with PREFIX.bin and PREFIX.idx), or a blend of token files as "
        "weight / file pairs (0.3 a.bin 0.7 b_text_document) (default: the package's own "
        "Python sources)",
    )
    field("--vocab-size", int, "with a token file: the vocabulary size (0: largest id + 1)")
    add(
        "--make-vocab-size-divisible-by",
        dest="vocab_multiple",
        type=int,
        default=d.vocab_multiple,
        help="the model's vocabulary padded to a multiple of this and of tp (Megatron's name; "
        "there times tp)",
    )
    docs = p.add_argument_group("documents packed into a sample, kept apart (Megatron's)")
    docs.add_argument(
        "--eod-token",
        type=int,
        default=None,
        help="the end-of-document token id the options below look for",
    )
    docs.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="each token attends within its own document only (not with cp, pp)",
    )
    docs.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="each token's position counts from its document's start",
    )
    docs.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the step's loss is the mean over every kept target of the global batch (Megatron's)",
    )
    docs.add_argument(
        "--eod-mask-loss",
        action="store_true",
        help="no loss on the prediction made at an end-of-document token",
    )
    add("--n-layer", "--num-layers", type=int, default=m.n_layers, help="transformer blocks")
    add(
        "--n-head",
        "--num-attention-heads",
        type=int,
        default=m.n_heads,
        help="attention heads per block",
    )
    add(
        "--num-query-groups",
        type=int,
        default=None,
        help="grouped-query attention: key / value heads (default: --n-head)",
    )
    add("--d-model", "--hidden-size", type=int, default=m.dim, help="width of the residual stream")
    add("--seq-len", "--seq-length", type=int, default=m.block_size, help="characters per sample")
    add(
        "--normalization",
        default=m.normalization,
        type=str.lower,  # Megatron's LayerNorm / RMSNorm
        choices=NORMALIZATIONS,
        help="the blocks' and the head's norm (rmsnorm: Llama's)",
    )
    add("--swiglu", action="store_true", help="Llama's SwiGLU MLP in place of GPT-2's GELU MLP")
    add(
        "--ffn-hidden-size",
        type=int,
        default=m.ffn_hidden_size,
        help="the MLP's hidden size (default: 4 x --d-model)",
    )
    add("--openai-gelu", action="store_true", help="GPT-2's tanh approximation of GELU")
    add(
        "--squared-relu",
        action="store_true",
        help="the MLP's activation relu(x)^2 (Nemotron's; Megatron's flag)",
    )
    add(
        "--geglu",
        action="store_true",
        help="a gated MLP with GELU on the gate (GeGLU, Gemma's; --openai-gelu: tanh GELU)",
    )
    add(
        "--apply-layernorm-1p",
        action="store_true",
        help="norms multiply by 1 + w, w starting at 0 (Megatron's; Gemma's RMSNorm)",
    )
    add(
        "--no-pre-norms",
        action="store_true",
        help="with --post-norms: the branches' inputs not normalised (OLMo 2's blocks)",
    )
    add(
        "--qk-norm-scope",
        choices=("head", "all"),
        default=m.qk_norm_scope,
        help="--qk-layernorm per head, or over all heads' features at once (OLMo 2; no --tp)",
    )
    add(
        "--tie-embeddings",
        action="store_true",
        help="the output head is the token embedding's tensor (GPT-2, Gemma, Megatron's default)",
    )
    add(
        "--post-norms",
        action="store_true",
        help="the attention's and the MLP's outputs normalised before the residual add (Gemma)",
    )
    add(
        "--embedding-multiplier",
        type=float,
        default=m.embedding_multiplier,
        help="the token embeddings scaled by this (Gemma: sqrt(d_model))",
    )
    add(
        "--attn-logit-softcapping",
        type=float,
        default=None,
        help="attention scores capped as c * tanh(score / c) (Gemma 2's; not with cp)",
    )
    add(
        "--final-logit-softcapping",
        type=float,
        default=None,
        help="the logits capped as c * tanh(logit / c) (Gemma 2's)",
    )
    add(
        "--softmax-scale",
        type=float,
        default=None,
        help="the attention scores' scale (default 1 / sqrt(head size); Gemma's "
        "query_pre_attn_scalar ** -0.5)",
    )
    add("--norm-epsilon", type=float, default=m.norm_eps, help="the norms' epsilon")
    add(
        "--position-embedding-type",
        default=m.position_embedding,
        type=lambda v: "learned" if v == "learned_absolute" else v,  # Megatron's name
        choices=POSITION_EMBEDDINGS,
        help="a learned position table (GPT-2) or rotary embeddings of queries and keys",
    )
    add("--rotary-base", type=float, default=m.rope_theta, help="rope: the angles' base theta")
    add(
        "--rotary-percent",
        type=float,
        default=m.rotary_percent,
        help="rope: the share of each head's dimensions turned, the first ones (Phi's partial "
        "rotary)",
    )
    add(
        "--sliding-window",
        type=int,
        default=None,
        help="each token attends to itself and the W - 1 before it (Mistral's; not with cp)",
    )
    add(
        "--global-attention-every",
        type=int,
        default=m.global_attention_every,
        help="with --sliding-window: every n-th block attends to the whole prefix (Gemma 3: 6)",
    )
    add(
        "--rotary-base-local",
        type=float,
        default=None,
        help="the windowed blocks' rope base, unscaled (Gemma 3's rope_local_base_freq)",
    )
    _rope_scaling_flags(p)
    add("--checkpoint-dir", default=None)
    add(
        "--checkpoint-every",
        "--save-interval",
        type=int,
        default=0,
        help="steps between checkpoints",
    )
    field("--keep-last", int, "complete checkpoints kept, the newest (0: all)")
    add(
        "--resume",
        default=None,
        help="'auto' (newest complete checkpoint) or a step directory; at any layout (pp, "
        "tp, schedule, ZeRO may differ from the saving run's)",
    )
    hyper = p.add_mutually_exclusive_group()
    hyper.add_argument(
        "--override-opt-param-scheduler",
        "--override-opt_param-scheduler",
        dest="resume_hyper",
        action="store_const",
        const="override",
        default=d.resume_hyper,
        help="resume: this run's learning-rate schedule and optimizer settings where the "
        "checkpoint's differ (the optimizer state kept)",
    )
    hyper.add_argument(
        "--use-checkpoint-opt-param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
        dest="resume_hyper",
        action="store_const",
        const="checkpoint",
        help="resume: the checkpoint's learning-rate schedule and optimizer settings",
    )
    add(
        "--init-from",
        default=None,
        metavar="FILE",
        help="start from the weights of python -m dist_kernels.train.export (any layout) or "
        "of a local Hugging Face GPT-2 / Llama model directory",
    )
    add(
        "--log-every",
        "--log-interval",
        type=int,
        default=d.log_every,
        help="steps per logging interval",
    )
    field("--eval-interval", int, "steps between validation losses on held-out text (0: none)")
    field("--eval-iters", int, "global batches per validation")
    field("--valid-fraction", float, "share of the corpus held out (with --eval-interval)")
    add(
        "--split",
        default=None,
        metavar="TRAIN,VALID,TEST",
        help="Megatron's split of the corpus into train / validation / test shares, in that "
        "order (969,30,1; missing parts are 0): sets --valid-fraction, and holds the test "
        "share out for one test loss at the end",
    )
    add("--json", default=None, help="write one JSON object per logged step here")
    add("--plot", default=None, help="write loss, tokens/s and per-rank step times to a PNG")
    add("--engine", default=d.engine, choices=("dk", "torch", "both"))
    add("--simulate-straggler", type=_pair(float), default=None, metavar="RANK:MS")
    add("--straggler-threshold", type=float, default=d.straggler_threshold)
    field("--straggler-min-ms", float)
    field("--straggler-patience", int)
    add("--reference-tokens-per-s", type=float, default=None, help="1-rank throughput")
    add(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM: finish the step, save a checkpoint, stop (every rank together)",
    )
    field("--exit-duration-in-mins", float, "stop (and save) after this many minutes; 0: never")
    add("--signal-after", type=_pair(int), default=None, help=argparse.SUPPRESS)  # the tests'
    add(
        "--kill-after-checkpoint",
        type=_pair(int),
        default=None,
        metavar="RANK:STEP",
        help=argparse.SUPPRESS,
    )  # a fault for the elastic-recovery test
    add("--no-progress", action="store_true", help="no progress bar")
    add("--timeout", type=float, default=d.timeout, help="seconds a collective may wait")
    add("--profile-steps", type=_span, default=None, metavar="A:B", help="torch.profiler steps")
    add("--profile-dir", default=d.profile_dir, help="traces of --profile-steps go here")
    add(
        "--tensorboard",
        "--tensorboard-dir",
        default=None,
        metavar="DIR",
        help="write TensorBoard scalars here",
    )
    add_megatron_spellings(p)
    return p


def _span(text: str) -> Tuple[int, int]:
    try:
        first, last = text.split(":")
        return int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps), got {text!r}") from None


def _data(values: Optional[List[str]]) -> Tuple[Optional[str], Tuple[Tuple[float, str], ...]]:
    """``--data``'s values as TrainConfig's ``(data, data_blend)``: one file, or pairs."""
    if values is None or len(values) == 1:
        return (values[0] if values else None), ()
    if len(values) % 2:
        raise ConfigError(f"--data: a blend is weight / file pairs, got {len(values)} values")
    try:
        blend = tuple((float(w), path) for w, path in zip(values[::2], values[1::2]))
    except ValueError:
        raise ConfigError(f"--data: a blend is weight / file pairs, got {values}") from None
    return None, blend


def _rope_scaling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rope scaling (a longer context than the model was trained on)")
    g.add_argument(
        "--rope-scaling",
        choices=ROPE_SCALINGS,
        default=None,
        help="stretch rope's frequencies: linear interpolation, Llama 3.1's, YaRN or LongRoPE "
        "(its short_factor and long_factor by --rope-scaling-param)",
    )
    g.add_argument(
        "--use-rope-scaling",
        dest="rope_scaling",
        action="store_const",
        const="llama3",
        help="Megatron's: --rope-scaling llama3",
    )
    g.add_argument(
        "--rope-scaling-factor",
        type=float,
        default=None,
        help="how many times longer (llama3: 8 unless given, as Megatron)",
    )
    g.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=float,
        default=None,
        help="Megatron's: --rope-scaling linear --rope-scaling-factor F",
    )
    g.add_argument(
        "--rope-original-max-positions",
        type=int,
        default=None,
        help="llama3 / yarn: the length the model was trained on (llama3: 8192)",
    )
    g.add_argument(
        "--rope-scaling-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another key of the scaling (low_freq_factor, high_freq_factor, "
        "beta_fast, beta_slow, attention_factor, truncate; longrope's short_factor=1.0,1.2,... "
        "and long_factor=...); repeatable",
    )


_FACTOR_LISTS = ("short_factor", "long_factor")  # longrope's, one number per dimension pair


def _rope_scaling(args: argparse.Namespace) -> Optional[dict]:
    """The ``rope_scaling`` the rope flags describe (checked by GPTConfig), or None."""
    kind, factor = args.rope_scaling, args.rope_scaling_factor
    if args.rotary_seq_len_interpolation_factor is not None:
        if kind not in (None, "linear") or factor is not None:
            raise ConfigError(
                "--rotary-seq-len-interpolation-factor is linear scaling by that "
                "factor: give it without --rope-scaling / --rope-scaling-factor"
            )
        kind, factor = "linear", args.rotary_seq_len_interpolation_factor
    if kind is None:
        if factor is not None or args.rope_original_max_positions or args.rope_scaling_param:
            raise ConfigError(
                "--rope-scaling-factor / --rope-original-max-positions / "
                "--rope-scaling-param need --rope-scaling TYPE"
            )
        return None
    scaling = {"rope_type": kind, "factor": 8.0 if factor is None and kind == "llama3" else factor}
    if args.rope_original_max_positions is not None:
        scaling["original_max_position_embeddings"] = args.rope_original_max_positions
    for item in args.rope_scaling_param:
        key, sep, value = item.partition("=")
        if not sep or key in scaling:
            raise ConfigError(
                f"--rope-scaling-param: KEY=VALUE of a key no other flag sets, got {item!r}"
            )
        if value.lower() in ("true", "false"):
            scaling[key] = value.lower() == "true"
            continue
        try:  # longrope's per-pair factors: comma-separated
            numbers = [float(v) for v in value.split(",")]
        except ValueError:
            raise ConfigError(f"--rope-scaling-param {item!r}: not a number") from None
        scaling[key] = numbers if key in _FACTOR_LISTS else numbers[0]
        if len(numbers) > 1 and key not in _FACTOR_LISTS:
            raise ConfigError(f"--rope-scaling-param {item!r}: one number, not a list")
    return scaling


def _split(text: Optional[str], valid_fraction: float, eval_interval: int) -> Tuple[float, float]:
    """``--split A,B,C`` (Megatron's: weights, ``,`` or ``/`` between, missing ones 0) as
    ``(valid_fraction, test_fraction)``; without it, ``--valid-fraction`` and no test."""
    if text is None:
        return valid_fraction, 0.0
    if valid_fraction != TrainConfig.valid_fraction:
        raise ConfigError("--split and --valid-fraction both set the validation share: give one")
    try:
        parts = [float(p) for p in text.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {text!r}: expected weights such as 969,30,1") from None
    if not 1 <= len(parts) <= 3 or min(parts) < 0 or not parts[0] > 0:
        raise ConfigError(
            f"--split {text!r}: one to three weights >= 0 (train, validation, test), the "
            "training share above 0"
        )
    train, valid, test = parts + [0.0] * (3 - len(parts))
    total = train + valid + test
    if not valid and eval_interval:
        raise ConfigError(
            f"--split {text!r} gives validation no share, and --eval-interval asks for it"
        )
    # no validation share: the field keeps its default, unused without --eval-interval
    return (valid / total if valid else TrainConfig.valid_fraction), test / total


def _norm_bias(args: argparse.Namespace) -> Optional[bool]:
    """``GPTConfig.norm_bias``: Megatron's LayerNorm is biased whatever --disable-bias-linear
    says (RMSNorm has none: nothing to say)."""
    if args.no_norm_bias:
        return False
    return True if args.disable_bias_linear and args.normalization == "layernorm" else None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    args = from_megatron(args)
    data, blend = _data(args.data)
    held_out = _split(args.split, args.valid_fraction, args.eval_interval)
    base = TrainConfig().model
    model = dataclasses.replace(
        base,
        dropout=base.dropout if args.dropout is None else args.dropout,
        attention_dropout=args.attention_dropout,
        init_std=base.init_std if args.init_method_std is None else args.init_method_std,
        n_layers=args.n_layer,
        n_heads=args.n_head,
        n_kv_heads=args.num_query_groups,
        dim=args.d_model,
        block_size=args.seq_len,
        n_experts=args.experts,
        top_k=args.top_k,
        moe_every=args.moe_every,
        moe_layers=args.moe_layers,
        moe_norm_topk=args.moe_norm_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        qk_norm=args.qk_layernorm,
        kv_channels=args.kv_channels,
        qkv_bias=args.add_qkv_bias,
        bias=not args.disable_bias_linear,
        norm_bias=_norm_bias(args),
        normalization=args.normalization,
        swiglu=args.swiglu or args.geglu,
        glu_activation="gelu" if args.geglu else "silu",
        squared_relu=args.squared_relu,
        norm_unit_offset=args.apply_layernorm_1p,
        post_norms=args.post_norms,
        tie_embeddings=args.tie_embeddings,
        pre_norms=not args.no_pre_norms,
        qk_norm_scope=args.qk_norm_scope,
        embedding_multiplier=args.embedding_multiplier,
        softmax_scale=args.softmax_scale,
        attn_logit_softcapping=args.attn_logit_softcapping,
        final_logit_softcapping=args.final_logit_softcapping,
        global_attention_every=args.global_attention_every,
        rope_local_theta=args.rotary_base_local,
        ffn_hidden_size=args.ffn_hidden_size,
        gelu_approximate="tanh" if args.openai_gelu else "none",
        norm_eps=args.norm_epsilon,
        position_embedding=args.position_embedding_type,
        rope_theta=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=_rope_scaling(args),
        sliding_window=args.sliding_window,
    )
    return TrainConfig(
        dp=args.dp, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, zero=args.zero,
        schedule=args.schedule,
        micro_batch=args.micro_batch, grad_accum=args.grad_accum, global_batch=args.global_batch,
        bucket_cap_mb=args.bucket_cap_mb, first_bucket_mb=args.first_bucket_mb,
        dtype=args.dtype, initial_loss_scale=args.initial_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        min_loss_scale=args.min_loss_scale, steps=args.steps, stop_after=args.stop_after,
        lr=args.lr,
        lr_scaling=args.lr_scaling,
        lr_base_batch=args.lr_base_batch, warmup=args.warmup, decay=args.decay,
        wsd_decay_steps=args.lr_wsd_decay_steps, wsd_decay_style=args.lr_wsd_decay_style,
        lr_decay_steps=args.lr_decay_steps, resume_hyper=args.resume_hyper,
        seed=args.seed,
        clip_grad=args.clip_grad, recompute=args.recompute, compile=args.compile,
        compile_backend=args.compile_backend,
        sequence_parallel=args.sequence_parallel,
        data=data, data_blend=blend, vocab_size=args.vocab_size,
        vocab_multiple=args.vocab_multiple, model=model,
        eod_token=args.eod_token, reset_attention_mask=args.reset_attention_mask,
        reset_position_ids=args.reset_position_ids, eod_mask_loss=args.eod_mask_loss,
        calculate_per_token_loss=args.calculate_per_token_loss,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, resume=args.resume,
        init_from=args.init_from,
        log_every=args.log_every,
        json=args.json, plot=args.plot, engine=args.engine,
        simulate_straggler=args.simulate_straggler,
        straggler_threshold=args.straggler_threshold, straggler_min_ms=args.straggler_min_ms,
        straggler_patience=args.straggler_patience, min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay, optimizer=args.optimizer, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, muon_momentum=args.muon_momentum,
        muon_nesterov=args.muon_nesterov, muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr=args.muon_adjust_lr, muon_tp_mode=args.muon_tp_mode,
        muon_ns_dtype=args.muon_ns_dtype, muon_split_qkv=args.muon_split_qkv,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, valid_fraction=held_out[0], test_fraction=held_out[1],
        reference_tokens_per_s=args.reference_tokens_per_s,
        exit_signal_handler=args.exit_signal_handler,
        exit_duration_in_mins=args.exit_duration_in_mins, signal_after=args.signal_after,
        kill_after_checkpoint=args.kill_after_checkpoint, progress=not args.no_progress,
        timeout=args.timeout, profile_steps=args.profile_steps, profile_dir=args.profile_dir,
        tensorboard=args.tensorboard,
    )  # fmt: skip


def model_flags(model: GPTConfig) -> List[str]:
    """The driver's flags that build ``model``'s architecture (its vocabulary and sequence
    length apart): what to pass with ``--init-from`` a directory of that model."""
    default = TrainConfig().model
    flags = ["--n-layer", str(model.n_layers), "--n-head", str(model.n_heads),
             "--d-model", str(model.dim)]  # fmt: skip
    if model.kv_heads != model.n_heads:
        flags += ["--num-query-groups", str(model.kv_heads)]
    if model.kv_channels is not None:
        flags += ["--kv-channels", str(model.kv_channels)]
    if model.ffn_dim != default.mlp_ratio * model.dim:
        flags += ["--ffn-hidden-size", str(model.ffn_dim)]
    if model.normalization != default.normalization:
        flags += ["--normalization", model.normalization]
    if model.norm_eps != default.norm_eps:
        flags += ["--norm-epsilon", repr(model.norm_eps)]
    if model.position_embedding != default.position_embedding:
        flags += ["--position-embedding-type", model.position_embedding]
    if model.position_embedding == "rope" and model.rope_theta != default.rope_theta:
        flags += ["--rotary-base", repr(model.rope_theta)]
    if model.rotary_percent != default.rotary_percent:
        flags += ["--rotary-percent", repr(model.rotary_percent)]
    flags += _rope_scaling_to_flags(model.rope_scaling)
    if model.sliding_window is not None:
        flags += ["--sliding-window", str(model.sliding_window)]
    geglu = model.swiglu and model.glu_activation == "gelu"
    switches = [
        (model.swiglu and not geglu, "--swiglu"), (geglu, "--geglu"),
        (model.gelu_approximate == "tanh", "--openai-gelu"),
        (model.squared_relu, "--squared-relu"),
        (not model.bias, "--disable-bias-linear"), (model.qkv_bias, "--add-qkv-bias"),
        (model.normalization == "layernorm" and not model.norm_biased, "--no-norm-bias"),
        (model.qk_norm, "--qk-layernorm"), (model.norm_unit_offset, "--apply-layernorm-1p"),
        (model.post_norms, "--post-norms"), (not model.pre_norms, "--no-pre-norms"),
        (model.tie_embeddings, "--tie-embeddings"),
    ]  # fmt: skip
    if model.qk_norm_scope != default.qk_norm_scope:
        flags += ["--qk-norm-scope", model.qk_norm_scope]
    if model.embedding_multiplier != default.embedding_multiplier:
        flags += ["--embedding-multiplier", repr(model.embedding_multiplier)]
    if model.softmax_scale is not None:
        flags += ["--softmax-scale", repr(model.softmax_scale)]
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(model, cap) is not None:
            flags += [f"--{cap.replace('_', '-')}", repr(getattr(model, cap))]
    if model.global_attention_every:
        flags += ["--global-attention-every", str(model.global_attention_every)]
    if model.rope_local_theta is not None:
        flags += ["--rotary-base-local", repr(model.rope_local_theta)]
    flags += [flag for on, flag in switches if on]
    if model.n_experts:
        flags += ["--experts", str(model.n_experts), "--top-k", str(model.top_k)]
        if model.moe_layers is not None:
            flags += ["--moe-layer-freq", str(list(model.moe_layers)).replace(" ", "")]
        else:
            flags += ["--moe-every", str(model.moe_every)]
        if model.moe_norm_topk:
            flags.append("--moe-norm-topk")
        if model.moe_ffn_dim != model.ffn_dim:
            flags += ["--moe-ffn-hidden-size", str(model.moe_ffn_dim)]
        if model.moe_shared_expert_intermediate_size:
            shared = str(model.moe_shared_expert_intermediate_size)
            flags += ["--moe-shared-expert-intermediate-size", shared]
        if model.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
        if model.moe_router_enable_expert_bias:
            flags.append("--moe-router-enable-expert-bias")
    return flags


def _rope_scaling_to_flags(scaling: Optional[dict]) -> List[str]:
    if scaling is None:
        return []
    kind, factor = scaling["rope_type"], scaling["factor"]
    flags = ["--rope-scaling", kind, "--rope-scaling-factor", repr(factor)]
    given = {k: v for k, v in scaling.items() if k == "original_max_position_embeddings"}
    if given:
        flags += ["--rope-original-max-positions", str(given["original_max_position_embeddings"])]
    lists = {k: v for k, v in scaling.items() if k in _FACTOR_LISTS}
    for key, value in lists.items():
        flags += ["--rope-scaling-param", f"{key}={','.join(repr(v) for v in value)}"]
    defaults = rope_scaling_checked({"rope_type": kind, "factor": factor, **given, **lists})
    for key, value in scaling.items():  # the rest where they differ from the defaults
        if value != defaults[key]:
            flags += ["--rope-scaling-param", f"{key}={value!r}".lower()]
    return flags


def preflight(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Every check that can fail before a rank starts; returns the resolved config."""
    from .checkpoints import identity, resolve_resume
    from .data import build_blend
    from .driver import model_config, samplers
    from .model import describe

    cfg = cfg.with_layout(world_size)
    if cfg.tp > 1 and cfg.engine != "dk":
        raise ConfigError(f"engine={cfg.engine!r} supports tp=1 only (tp={cfg.tp})")
    if cfg.engine != "dk" and cfg.checkpoint_dir is not None:
        raise ConfigError(f"checkpoints are written by --engine dk only (engine={cfg.engine!r})")
    corpus = build_blend(cfg.data, cfg.data_blend, cfg.model.block_size, cfg.vocab_size)
    if cfg.eod_token is not None and cfg.eod_token >= corpus.vocab_size:
        raise ConfigError(
            f"--eod-token {cfg.eod_token} is not in the data's vocabulary of {corpus.vocab_size}"
        )
    model = model_config(cfg, corpus)
    # the samplers' checks too (a held-out span too small)
    data_fp = samplers(cfg, corpus).fingerprint
    resume = resolve_resume(cfg, identity(cfg, describe(model), data_fp))
    if cfg.init_from is not None and resume is None:  # (a resumed run ignores it)
        from .export import load_exported

        load_exported(cfg.init_from, model)  # a file of another model fails here
    if cfg.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib (pip install dist_kernels[plot])") from None
    if cfg.tensorboard is not None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("--tensorboard needs tensorboard (pip install tensorboard)") from None
    return cfg


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_rank(cfg: TrainConfig) -> List[Any]:
    """What every rank runs: one training per engine; rank 0 prints the summary and plots."""
    import torch
    import torch.distributed as dist

    from .driver import train
    from .report import plot, summary_table

    if dist.is_initialized():
        torch.set_num_threads(1)  # one thread per rank, as torchrun's OMP_NUM_THREADS=1
    engines = ("dk", "torch") if cfg.engine == "both" else (cfg.engine,)
    results = [train(cfg, engine, append_log=i > 0) for i, engine in enumerate(engines)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(summary_table(cfg, results), flush=True)  # stragglers were reported as found
        if cfg.plot is not None:
            plot(cfg.plot, results)
            print(f"plot written to {cfg.plot}", flush=True)
    return results


def _spawned_rank(cfg: TrainConfig) -> None:
    run_rank(cfg)  # the results stay on the ranks: rank 0 has printed them


def _spawn(cfg: TrainConfig, world_size: int) -> int:
    from .. import launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    previous = None
    if cfg.exit_signal_handler:  # the ranks act on SIGTERM: pass it on, and wait for them
        previous = signal.signal(signal.SIGTERM, _forward_to_ranks)
    try:
        launch.run(
            world_size,
            _spawned_rank,
            cfg,
            grace=min(60.0, cfg.timeout),
            group_timeout=cfg.timeout,
            name="dk-train{rank}",
        )
    except launch.RanksError as e:
        print(f"dist_kernels.train: {e}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _forward_to_ranks(signum: int, frame: Any) -> None:
    """The launcher's SIGTERM, sent on to its local ranks (its child processes)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:  # ended meanwhile
            pass


def _join_torchrun(timeout_s: float) -> None:
    """init_process_group under torchrun, its keys under a prefix of this attempt.

    The workers' store may be the agent's, which outlives a restart; without the prefix a
    restarted group finds the dead attempt's gloo addresses there and fails to connect
    ("Connection refused"). The restart count names the attempt only then: with a store of
    its own per round (``TORCHELASTIC_USE_AGENT_STORE`` False), nothing stale is left, and
    a host whose agent was started anew counts its restarts from 0 while the others do not.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "round"
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"dist_kernels.train/attempt-{attempt}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    torchrun = under_torchrun()
    try:
        cfg = config_from_args(args)  # GPTConfig checks the model's shape when built
        local = (cfg.dp or 1) * cfg.tp * cfg.cp * cfg.pp
        world_size = int(os.environ["WORLD_SIZE"]) if torchrun else local
        cfg = preflight(cfg, world_size)
    except ValueError as e:  # ConfigError, DataError, CheckpointError, GPTConfig's
        print(f"dist_kernels.train: error: {e}", file=sys.stderr)
        return 2
    if world_size == 1:
        run_rank(cfg)
        return 0
    if torchrun:
        import torch.distributed as dist

        _join_torchrun(cfg.timeout)
        try:
            run_rank(cfg)
        finally:
            dist.destroy_process_group()
        return 0
    return _spawn(cfg, world_size)
