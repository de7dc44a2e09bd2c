"""TrainConfig: every option of ``python -m dist_kernels.train``, typed and checked when built.

The batch arithmetic, checked before any rank starts::

    global_batch = micro_batch x grad_accum x dp          (samples per optimizer step)
    world_size   = dp x tp x cp x pp

``grad_accum`` left at 0 is derived from the other three, so a run resumed on another ``dp``
keeps its global batch and recomputes the accumulation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional, Tuple

from ..lr import WSD_STYLES
from ..models import GPTConfig
from ..pipeline.schedules import SCHEDULES, build_schedule

Dtype = Literal["fp32", "bf16", "fp16"]
OPTIMIZERS = ("adamw", "fused-adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")
MUON_TP_MODES = ("duplicated", "blockwise")
MUON_NS_DTYPES = ("bf16", "fp32")
RESUME_HYPER = ("check", "override", "checkpoint")
Engine = Literal["dk", "torch", "both"]
LrScaling = Literal["none", "linear", "sqrt"]
Decay = Literal["cosine", "linear", "constant", "wsd"]
DECAYS = ("cosine", "linear", "constant", "wsd")


class ConfigError(ValueError):
    """A training option is missing, out of range, or inconsistent with the others."""


def driver_model() -> GPTConfig:
    """The driver's default model: 2 blocks, width 128, 4 heads, 64 characters of context, an
    untied head (``--tie-embeddings`` ties it) and no dropout (``--dropout`` sets it: masks
    counter-based, the same in every layout)."""
    return GPTConfig(block_size=64, n_layers=2, n_heads=4, dim=128, tie_embeddings=False)


# The loss-scaling options (their defaults are torch's GradScaler's behaviour)
_LOSS_SCALING = ("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")


@dataclass
class TrainConfig:
    """One training run. Build it with :func:`from_args` or directly; call :meth:`check`."""

    dp: int = 0
    """Data-parallel replicas; 0 = world_size / (tp x cp x pp)."""
    tp: int = 1
    """Tensor-parallel ranks per layer (needs ``dist_kernels.tensor_parallel``)."""
    cp: int = 1
    """Context-parallel ranks: each holds ``seq_len / cp`` tokens of every sample (zig-zag
    shards, ring attention); ``seq_len`` must be a multiple of ``2 x cp``."""
    pp: int = 1
    """Pipeline stages (``dk.Pipeline``); the blocks are split evenly."""
    ep: int = 1
    """Expert-parallel ranks, carved out of dp: the MoE blocks' experts (``model.n_experts``,
    set by ``--experts``) are sharded over ep and replicated over dp / ep."""
    zero: int = 0
    """ZeRO stage of ``dk.ShardedOptimizer`` over the data-parallel ranks: 0 = DDP, 1, 2 or 3
    (3: parameters sharded too, gathered per block in forward and backward). With
    ``optimizer="muon"`` only 1: Muon's state dealt by whole parameters (``shard_state``)."""
    schedule: str = "1f1b"
    """Pipeline schedule, one of ``dk.pipeline.SCHEDULES``: ``gpipe``, ``1f1b``,
    ``interleaved-1f1b`` (2 stages per rank), ``zb-h1``, ``zb-h2``, ``zb-v`` and
    ``dualpipe-v`` (2 stages per rank, in a V)."""
    micro_batch: int = 4
    """Samples per forward on one rank."""
    grad_accum: int = 0
    """Micro-batches per optimizer step on one rank (pipeline micro-batches with pp > 1);
    0 = global_batch / (micro_batch x dp)."""
    global_batch: int = 0
    """Samples per optimizer step over all replicas; 0 = micro_batch x grad_accum x dp."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB, the same for our DDP / ZeRO and torch's DDP (torch: 25)."""
    first_bucket_mb: float = 1.0
    """Cap of the first bucket (ours; torch DDP's is fixed at 1 MiB)."""
    dtype: Dtype = "fp32"
    """Compute dtype: fp32, or bf16 / fp16 autocast over FP32 weights. fp16 runs with dynamic
    loss scaling (the four ``*loss_scale*`` / ``hysteresis`` options below)."""
    initial_loss_scale: float = 2.0**16
    """fp16: the first loss scale (torch's ``GradScaler`` default; Megatron's is 2**32)."""
    loss_scale_window: int = 2000
    """fp16: steps without an inf or NaN gradient before the scale doubles (torch's
    ``growth_interval``; Megatron's and DeepSpeed's ``loss_scale_window``, 1000 there)."""
    hysteresis: int = 1
    """fp16: overflowing steps in a row before the scale halves; every one is skipped
    (Megatron's and DeepSpeed's ``hysteresis``, 2 there; torch's behaviour is 1)."""
    min_loss_scale: float = 1.0
    """fp16: the scale never halves below this; an overflow at it stops the run."""
    steps: int = 20
    """Optimizer steps to take (in total, counting those before a resume)."""
    stop_after: Optional[int] = None
    """Stop after this step (an interruption to resume from later; the schedule still spans
    ``steps``). None = run to ``steps``."""
    lr: float = 1e-3
    """Peak learning rate at the reference batch ``lr_base_batch``."""
    lr_scaling: LrScaling = "none"
    """How the peak rate scales with ``global_batch / lr_base_batch``: none, linear, sqrt."""
    lr_base_batch: int = 8
    """Global batch at which ``lr`` was tuned (the reference of ``lr_scaling``)."""
    warmup: int = 2
    """Linear warm-up steps."""
    decay: Decay = "cosine"
    """After warm-up: cosine or linear decay to ``min_lr_ratio`` at ``steps``, constant, or
    ``wsd`` (warm-up, stable, decay: the peak until the last ``wsd_decay_steps``, then a
    ``wsd_decay_style`` decay to ``min_lr_ratio``); ``dk.lr``'s formulas."""
    min_lr_ratio: float = 0.1
    """Final rate of the decay, as a fraction of the peak."""
    lr_decay_steps: int = 0
    """The schedule's horizon: warm-up plus decay end here (Megatron's ``--lr-decay-iters``);
    0: ``steps``. Past it the rate stays at the decay's end."""
    wsd_decay_steps: int = 0
    """``wsd``: the steps of the final decay (Megatron's ``--lr-wsd-decay-steps``); 0: the
    last 20% of ``steps``."""
    wsd_decay_style: str = "linear"
    """``wsd``: the decay's shape, one of ``dk.lr.WSD_STYLES`` (Megatron's
    ``--lr-wsd-decay-style``)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    optimizer: str = "adamw"
    """``adamw``: ``torch.optim.AdamW`` as torch picks its implementation (a per-tensor loop on
    CPU, ``foreach`` on CUDA); ``fused-adamw``: each engine's fused kernel, our
    ``dk.optim.FusedAdamW`` for our engines and ``torch.optim.AdamW(fused=True)`` for torch's
    (Megatron and DeepSpeed train with a fused Adam: apex's, Transformer Engine's, theirs);
    ``muon``: ``dk.optim.Muon`` on the hidden matrices and AdamW (``adam_*``) on embeddings,
    the head, biases and norms (``dk.optim.muon_param_groups``); our engines deal its
    Newton-Schulz work over the data-parallel replicas."""
    muon_momentum: float = 0.95
    """Muon's momentum (Megatron's ``--muon-momentum``)."""
    muon_nesterov: bool = True
    """Muon's Nesterov momentum (torch.optim.Muon's default)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per step (Megatron's ``--muon-num-ns-steps``)."""
    muon_adjust_lr: str = "match_rms_adamw"
    """How a matrix's rate follows its shape: ``match_rms_adamw`` (Moonshot's
    ``0.2 sqrt(max(rows, cols))``: AdamW's ``lr`` and weight decay carry over) or
    ``original`` (Keller Jordan's ``sqrt(max(1, rows / cols))``)."""
    muon_split_qkv: bool = False
    """The attention's fused query / key / value weight orthogonalised as three matrices
    (Megatron-Core's ``--muon-split-qkv``); False: as one, as torch.optim.Muon steps it."""
    muon_ns_dtype: str = "bf16"
    """Newton-Schulz's precision: ``bf16`` (torch.optim.Muon's and Keller Jordan's) or ``fp32``
    (slower; layouts then agree to FP32 rounding, where BF16 turns a gradient's last-bit
    difference into a step's 1%)."""
    muon_tp_mode: str = "duplicated"
    """With tp > 1: ``duplicated`` orthogonalises each tp-split matrix whole (gathered over tp:
    the tp = 1 result), ``blockwise`` each rank's block alone (no communication, another
    optimiser; Megatron's ``--muon-tp-mode``)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment coefficient (Megatron's ``--adam-beta1``)."""
    adam_beta2: float = 0.95
    """AdamW's second-moment coefficient (``--adam-beta2``; 0.95 as GPT-3 and Megatron's GPT
    recipes, torch's default is 0.999)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (``--adam-eps``)."""
    sequence_parallel: bool = False
    """With tp > 1: Megatron's sequence parallelism (``GPT.parallelize(tp_comm,
    sequence_parallel=True)``): the norms, residuals and dropout between the tensor-parallel
    layers hold ``seq / tp`` of the sequence on each tp rank (all-gather before, reduce-scatter
    after, in place of one all-reduce), so each tp rank keeps its part of those activations."""
    recompute: bool = False
    """Activation checkpointing of every transformer block (``GPT.recompute_blocks``): less
    activation memory for one more forward of each block in backward. Not part of a
    checkpoint's identity: a run may resume with or without it."""
    compile: bool = False
    """``torch.compile`` of every transformer block (``GPT.compile_blocks``: torchtitan's
    per-block compile) before an engine wraps the model; the collectives inside and between
    blocks run eagerly. Not with the schedules that split the backward (zb-h1, zb-h2, zb-v,
    dualpipe-v). Not part of a checkpoint's identity: a run may resume with or without it."""
    compile_backend: str = "inductor"
    """With ``compile``: torch.compile's backend (``torch._dynamo.list_backends``; inductor is
    torch's default, aot_eager compiles much faster and runs torch's own kernels)."""
    clip_grad: float = 0.0
    """Largest norm of the whole model's gradient before the optimizer step (torch's
    ``clip_grad_norm_``, Megatron's ``--clip-grad``); 0: no clipping and no norm computed.
    The records then carry ``grad_norm``, the norm before clipping."""
    seed: int = 0
    """Seeds the model's initialisation and the data order (both independent of layout)."""
    data: Optional[str] = None
    """A text file to train on (its characters are the tokens), or a file of token ids
    (``.bin``: uint16, nanoGPT's format; ``.npy``: any integer array; a Megatron indexed
    dataset's prefix, ``PREFIX.bin`` with ``PREFIX.idx``); None = the package's own Python
    sources."""
    data_blend: Tuple[Tuple[float, str], ...] = ()
    """``(weight, token file)`` pairs to sample from in proportion (Megatron's ``--data-path
    0.3 a 0.7 b``), in place of ``data``; weights are normalised."""
    vocab_size: int = 0
    """With a token file: the vocabulary's size (every id must be below it); 0 = the largest
    id + 1. A text corpus's vocabulary is its characters."""
    vocab_multiple: int = 64
    """The model's vocabulary is the data's padded to a multiple of this and of tp (Megatron's
    ``--make-vocab-size-divisible-by``, there times tp): one model at every tp dividing it."""
    eod_token: Optional[int] = None
    """The end-of-document token id that the three options below look for (Megatron takes its
    tokenizer's ``eod``); None: documents are not told apart."""
    reset_attention_mask: bool = False
    """Each token attends within its own document only (Megatron's ``--reset-attention-mask``;
    ``GPT.document_masking``): a sample packing the end of one document and the start of the
    next does not let the second see the first. Not with cp or pp."""
    reset_position_ids: bool = False
    """Each token's position counts from its document's start (``--reset-position-ids``)."""
    eod_mask_loss: bool = False
    """No loss on the prediction made at an EOD token (the next document's first token is not
    predictable from the last): those targets become ``-100``, and each micro-batch's loss is
    the mean over the rest (``--eod-mask-loss``)."""
    calculate_per_token_loss: bool = False
    """The step's loss is the mean over every non-masked target of the global batch (Megatron's
    ``--calculate-per-token-loss``), not the mean of the micro-batches' means: with
    ``eod_mask_loss`` micro-batches keep different numbers of targets, and only this makes the
    result independent of how the batch is split over micro-batches and replicas. One int64
    all-reduce of the count a step. Not with cp or MoE."""
    model: GPTConfig = field(default_factory=driver_model)
    """The character-level GPT; ``block_size`` is the characters per sample, and
    ``vocab_size`` is replaced by the corpus's (padded: ``driver.model_config``)."""
    checkpoint_dir: Optional[str] = None
    """Directory of checkpoints (``step-<N>/`` each); None = no checkpoints."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0 = only at the end, when ``checkpoint_dir`` is set)."""
    keep_last: int = 0
    """Complete checkpoints kept: after each save the older ones (and torn saves older than
    the newest) are removed (torchtitan's ``keep_latest_k``); 0 = all."""
    init_from: Optional[str] = None
    """A file of ``python -m dist_kernels.train.export``, or a local Hugging Face GPT-2 or
    Llama model directory (its vocabulary padded to this run's, its position table cut to
    ``--seq-len``): the model starts from its weights (checked to be this model) in place of
    the seed's initialisation, at any layout; the optimizer, the schedule and the data start
    afresh (Megatron's ``--finetune``). A run that resumes a checkpoint of its own ignores
    it."""
    resume: Optional[str] = None
    """``auto``: the newest complete checkpoint in ``checkpoint_dir`` (if any); or a path."""
    resume_hyper: str = "check"
    """A resume whose learning-rate schedule or optimizer settings (``checkpoints.hyper``)
    differ from the checkpoint's: ``check`` refuses it, naming each; ``override`` takes this
    run's (Megatron's ``--override-opt_param-scheduler``); ``checkpoint`` the checkpoint's
    (``--use-checkpoint-opt_param-scheduler``). The optimizer state is kept in each case."""
    eval_interval: int = 0
    """Steps between validation losses (Megatron's ``--eval-interval``), and one at the end;
    0 = none. The tail ``valid_fraction`` of the corpus is then held out of training."""
    eval_iters: int = 2
    """Global batches of held-out windows per validation (the same ones every time)."""
    valid_fraction: float = 0.05
    """With ``eval_interval``: the share of the corpus, at its end (before the test share),
    that validation reads."""
    test_fraction: float = 0.0
    """The share of the corpus, at its very end, held out of training and validation for one
    test loss when the run completes (Megatron's ``--split``'s third part); 0 = none."""
    log_every: int = 1
    """Steps per logging interval (metrics, straggler check)."""
    json: Optional[str] = None
    """Write one JSON object per logged step to this file (rank 0)."""
    plot: Optional[str] = None
    """Write a PNG of loss, tokens/s and per-rank step times (needs matplotlib)."""
    engine: Engine = "dk"
    """dk (our engines), torch (torch DDP / FSDP2 over gloo), or both, one after the other."""
    straggler_threshold: float = 0.3
    """A rank is slow when its busy time exceeds the median by this fraction ..."""
    straggler_min_ms: float = 10.0
    """... and by at least this many milliseconds ..."""
    straggler_patience: int = 2
    """... for this many consecutive intervals."""
    simulate_straggler: Optional[Tuple[int, float]] = None
    """(rank, ms): sleep this long in every forward of that rank, to demonstrate detection."""
    reference_tokens_per_s: Optional[float] = None
    """Throughput of a 1-rank run, for scaling efficiency = tokens/s / (world x reference)."""
    exit_signal_handler: bool = False
    """On SIGTERM, finish the step, write a checkpoint (with ``checkpoint_dir``) and stop,
    every rank after the same step (Megatron's ``--exit-signal-handler``)."""
    exit_duration_in_mins: float = 0.0
    """Stop the same way once rank 0 has trained this many minutes (0: no limit; Megatron's
    ``--exit-duration-in-mins``)."""
    signal_after: Optional[Tuple[int, int]] = None
    """(rank, step): that rank sends itself SIGTERM right after that step (the tests'
    scheduler)."""
    kill_after_checkpoint: Optional[Tuple[int, int]] = None
    """(rank, step): SIGKILL that rank right after the checkpoint of that step, on the first
    attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): a fault to test elastic recovery."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    timeout: float = 300.0
    """Seconds any collective may wait before the run fails."""
    profile_steps: Optional[Tuple[int, int]] = None
    """(A, B): torch.profiler over steps A to B (counted from 1), our collectives included."""
    profile_dir: str = "dk_profile"
    """Where ``profile_steps`` writes ``rank<r>.pt.trace.json`` and the merged trace."""
    tensorboard: Optional[str] = None
    """Write TensorBoard scalars (loss, lr, tokens/s, MFU, phase times, memory) here (rank 0)."""

    @property
    def decay_horizon(self) -> int:
        """The step at which the learning-rate schedule ends: ``lr_decay_steps`` or ``steps``."""
        return self.lr_decay_steps or self.steps

    @property
    def flat_shards(self) -> bool:
        """ZeRO through ``dk.ShardedOptimizer``'s flat shards: every ``zero`` but Muon's, whose
        stage 1 deals whole parameters (DDP's all-reduce, a replicated checkpoint format)."""
        return bool(self.zero) and self.optimizer != "muon"

    def with_layout(self, world_size: int) -> TrainConfig:
        """A copy with ``dp``, ``grad_accum`` and ``global_batch`` resolved for ``world_size``;
        raises :class:`ConfigError` with the arithmetic when they do not fit."""
        cfg = dataclasses.replace(self)
        cfg.check()
        cp_text = f" x cp({cfg.cp})" if cfg.cp > 1 else ""
        if world_size % (cfg.tp * cfg.cp * cfg.pp):
            raise ConfigError(
                f"world_size({world_size}) is not a multiple of tp({cfg.tp}){cp_text} x "
                f"pp({cfg.pp})"
            )
        if cfg.dp == 0:
            cfg.dp = world_size // (cfg.tp * cfg.cp * cfg.pp)
        if cfg.dp * cfg.tp * cfg.cp * cfg.pp != world_size:
            raise ConfigError(
                f"dp({cfg.dp}) x tp({cfg.tp}){cp_text} x pp({cfg.pp}) != world_size({world_size})"
            )
        per_step = cfg.micro_batch * cfg.dp
        if cfg.global_batch == 0:
            cfg.global_batch = per_step * (cfg.grad_accum or 1)
        if cfg.grad_accum == 0:
            if cfg.global_batch % per_step:
                raise ConfigError(
                    f"global_batch({cfg.global_batch}) is not a multiple of "
                    f"micro_batch({cfg.micro_batch}) x dp({cfg.dp}) = {per_step}"
                )
            cfg.grad_accum = cfg.global_batch // per_step
        if cfg.global_batch != per_step * cfg.grad_accum:
            raise ConfigError(
                f"global_batch({cfg.global_batch}) != micro_batch({cfg.micro_batch}) x "
                f"grad_accum({cfg.grad_accum}) x dp({cfg.dp}) = {per_step * cfg.grad_accum}"
            )
        cfg._check_layout()
        return cfg

    @property
    def documents(self) -> Optional[Dict[str, Any]]:
        """``GPT.document_masking``'s arguments, or None when neither reset is on."""
        if not (self.reset_attention_mask or self.reset_position_ids):
            return None
        return dict(eod=self.eod_token, reset_attention_mask=self.reset_attention_mask,
                    reset_position_ids=self.reset_position_ids)  # fmt: skip

    def _check_attention_masks(self) -> None:
        named = [f for f in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")
                 if getattr(self, f)]  # fmt: skip
        if named and self.eod_token is None:
            raise ConfigError(f"{', '.join(named)}: needs eod_token (the end-of-document id)")
        if self.eod_token is not None and (
            not isinstance(self.eod_token, int) or self.eod_token < 0
        ):
            raise ConfigError(f"eod_token must be a token id >= 0, got {self.eod_token!r}")
        if self.model.sliding_window is not None and self.cp > 1:
            raise ConfigError(
                f"sliding_window({self.model.sliding_window}) with cp({self.cp}) > 1: ring "
                "attention has no windowed mask"
            )
        if self.model.qk_norm and self.model.qk_norm_scope == "all" and self.tp > 1:
            raise ConfigError(
                f"qk_norm_scope 'all' with tp({self.tp}) > 1: the norm over every head's "
                "features would need the other tp ranks' heads"
            )
        if self.model.attn_logit_softcapping is not None and self.cp > 1:
            raise ConfigError(
                f"attn_logit_softcapping({self.model.attn_logit_softcapping}) with cp({self.cp}) "
                "> 1: ring attention has no capped scores"
            )
        if self.calculate_per_token_loss and (self.cp > 1 or self.model.n_experts):
            raise ConfigError(
                f"calculate_per_token_loss with cp({self.cp}) > 1 or MoE blocks: the loss under "
                "cp is already a mean over the cp group's tokens, and the MoE aux losses would be "
                "weighted with it"
            )
        if self.documents is not None and (self.cp > 1 or self.pp > 1):
            raise ConfigError(
                f"reset_attention_mask / reset_position_ids with cp({self.cp}) or pp({self.pp}) "
                "> 1: ring attention has no per-document mask, and a pipeline's later stages "
                "never see the token ids the documents are read from"
            )

    def check(self) -> None:
        """Ranges and choices of single options."""
        for name in ("tp", "cp", "pp", "ep", "micro_batch", "steps", "log_every", "lr_base_batch"):
            _at_least(name, getattr(self, name), 1)
        for name in (
            "dp",
            "grad_accum",
            "global_batch",
            "warmup",
            "checkpoint_every",
            "keep_last",
            "vocab_size",
        ):
            _at_least(name, getattr(self, name), 0)
        _choice("zero", self.zero, (0, 1, 2, 3))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("dtype", self.dtype, ("fp32", "bf16", "fp16"))
        _choice("engine", self.engine, ("dk", "torch", "both"))
        _choice("lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        _choice("decay", self.decay, DECAYS)
        _choice("wsd_decay_style", self.wsd_decay_style, WSD_STYLES)
        _choice("resume_hyper", self.resume_hyper, RESUME_HYPER)
        if not 0 <= self.lr_decay_steps:
            raise ConfigError(f"lr_decay_steps must be >= 0 (0: steps), got {self.lr_decay_steps}")
        horizon = self.decay_horizon
        if self.decay == "wsd" and not 0 <= self.wsd_decay_steps <= horizon - self.warmup:
            named = f"lr_decay_steps({horizon})" if self.lr_decay_steps else f"steps({horizon})"
            raise ConfigError(
                f"wsd_decay_steps({self.wsd_decay_steps}) must be in [0, {named} - "
                f"warmup({self.warmup})] (0: the last 20% of them)"
            )
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.data_blend and self.data is not None:
            raise ConfigError(f"data({self.data!r}) and data_blend: give one of them")
        if not self.exit_duration_in_mins >= 0:
            raise ConfigError(
                "exit_duration_in_mins must be >= 0 (0: no limit), got "
                f"{self.exit_duration_in_mins}"
            )
        if not self.clip_grad >= 0:
            raise ConfigError(f"clip_grad must be >= 0 (0: off), got {self.clip_grad}")
        self._check_loss_scaling()
        self._check_compile()
        _at_least("eval_interval", self.eval_interval, 0)
        _at_least("eval_iters", self.eval_iters, 1)
        if not 0 < self.valid_fraction < 1:
            raise ConfigError(f"valid_fraction must lie in (0, 1), got {self.valid_fraction}")
        if self.vocab_multiple < 1:
            raise ConfigError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}")
        if not 0 <= self.test_fraction < 1:
            raise ConfigError(f"test_fraction must lie in [0, 1), got {self.test_fraction}")
        held = self.test_fraction + (self.valid_fraction if self.eval_interval else 0.0)
        if held >= 1:
            raise ConfigError(
                f"valid_fraction({self.valid_fraction}) + test_fraction({self.test_fraction}) "
                "leave nothing to train on"
            )
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise ConfigError(f"adam_eps must be > 0, got {self.adam_eps}")
        self._check_muon()
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.resume is not None and self.resume == "auto" and self.checkpoint_dir is None:
            raise ConfigError("resume=auto needs checkpoint_dir")
        if self.model.attn_dropout and self.cp > 1:
            raise ConfigError(
                f"model: attention dropout({self.model.attn_dropout}) with cp({self.cp}) > 1: "
                "ring attention has no dropout of the probabilities (--attention-dropout 0 "
                "keeps the hidden dropout)"
            )
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last <= self.steps:
                raise ConfigError(
                    f"profile_steps {first}:{last} must satisfy 1 <= A <= B <= steps({self.steps})"
                )

    def _check_muon(self) -> None:
        _choice("muon_adjust_lr", self.muon_adjust_lr, MUON_ADJUST_LR)
        _choice("muon_tp_mode", self.muon_tp_mode, MUON_TP_MODES)
        _choice("muon_ns_dtype", self.muon_ns_dtype, MUON_NS_DTYPES)
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"muon_momentum must lie in [0, 1), got {self.muon_momentum}")
        if not 0 < self.muon_ns_steps < 100:
            raise ConfigError(f"muon_ns_steps must lie in [1, 99], got {self.muon_ns_steps}")
        if self.optimizer == "muon" and self.zero > 1:
            raise ConfigError(
                f"optimizer(muon) with zero({self.zero}): ZeRO-2 and -3 cut gradients and "
                "parameters into flat shards, and Muon steps whole matrices; zero(1) deals "
                "Muon's state by whole parameters over the data-parallel ranks"
            )
        if self.optimizer == "muon" and self.zero and self.engine != "dk":
            raise ConfigError(
                f"optimizer(muon) with zero({self.zero}) and engine({self.engine}): torch's "
                "FSDP2 shards parameters flat; Muon's sharded state runs on our engine only"
            )

    def _check_layout(self) -> None:
        self._check_experts()
        if self.zero and self.dp * self.cp == 1:
            raise ConfigError(
                f"zero({self.zero}) shards over data-parallel ranks (dp x cp): needs dp x cp > 1"
            )
        if self.pp > 1 and self.zero > 1:
            raise ConfigError(
                f"zero({self.zero}) with pp({self.pp}) > 1: a pipeline adds up every "
                "micro-batch's gradients before they are reduced, so each rank holds its "
                "stage's full gradients anyway; use zero(1), which shards the optimizer state "
                "(as DeepSpeed allows ZeRO-1 only with its pipeline)"
            )
        if self.pp > 1 and self.engine != "dk":
            raise ConfigError(f"engine={self.engine!r} supports pp=1 only (pp={self.pp})")
        if self.pp > 1:
            self._check_schedule()
        self._check_attention_masks()
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel splits the sequence over tp ranks: needs tp > 1")
        if self.sequence_parallel and self.model.n_experts:
            raise ConfigError(
                "sequence_parallel with MoE blocks: each tp rank would route its own part of "
                "the sequence, and the aux loss would need its statistics reduced over tp first"
            )
        if self.sequence_parallel and self.model.block_size % (self.tp * self.cp):
            raise ConfigError(
                f"sequence_parallel: block_size({self.model.block_size}) is not a multiple of "
                f"tp({self.tp}) x cp({self.cp})"
            )
        if self.tp > 1 and self.model.n_heads % self.tp:
            raise ConfigError(f"n_heads({self.model.n_heads}) is not a multiple of tp({self.tp})")
        if self.tp > 1 and self.model.kv_heads % self.tp:
            raise ConfigError(
                f"n_kv_heads({self.model.kv_heads}) is not a multiple of tp({self.tp}): a "
                "tensor-parallel rank holds whole key / value groups"
            )
        if self.cp > 1 and self.model.block_size % (2 * self.cp):
            raise ConfigError(
                f"block_size({self.model.block_size}) is not a multiple of 2 x cp({self.cp}) = "
                f"{2 * self.cp}: each cp rank holds two of 2 cp chunks (load balancing)"
            )
        if self.cp > 1 and self.engine != "dk":
            raise ConfigError(f"engine={self.engine!r} supports cp=1 only (cp={self.cp})")
        if self.simulate_straggler is not None:
            rank = self.simulate_straggler[0]
            world = self.dp * self.tp * self.cp * self.pp
            if not 0 <= rank < world:
                raise ConfigError(
                    f"simulate_straggler: rank {rank} not in [0, world_size({world}))"
                )

    def _check_schedule(self) -> None:
        """The pipeline schedule's own rules (micro-batches per step, stages per rank) and
        a layer for every stage, before any rank starts: dk.Pipeline would raise them on
        every rank after the model is built."""
        try:
            plan = build_schedule(self.schedule, self.pp, self.grad_accum)
        except ValueError as e:
            raise ConfigError(
                f"schedule={self.schedule!r} with pp({self.pp}) and grad_accum({self.grad_accum}) "
                f"micro-batches per step: {e}"
            ) from None
        if self.compile and plan.splits_backward:
            raise ConfigError(
                f"compile with schedule={self.schedule!r}: the schedule splits each backward "
                "into an input-gradient and a weight-gradient half, and a compiled block's "
                "backward is one autograd node, which cannot be split (its weight gradients "
                "would be computed twice); use 1f1b, interleaved-1f1b or gpipe with compile"
            )
        layers = self.model.n_layers + 2  # the embedding, the blocks, the head
        if plan.n_stages > layers:
            per_rank = plan.n_stages // self.pp
            raise ConfigError(
                f"{self.schedule} runs {plan.n_stages} stages on pp({self.pp}) ranks "
                f"({per_rank} per rank) but the model has n_layers({self.model.n_layers}) + 2 "
                f"= {layers} layers: a stage would be empty"
            )

    def _check_compile(self) -> None:
        default = TrainConfig.__dataclass_fields__["compile_backend"].default
        if self.compile_backend != default and not self.compile:
            raise ConfigError(
                f"compile_backend={self.compile_backend!r} without compile: the model would "
                "not be compiled"
            )
        if self.compile:
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            _choice("compile_backend", self.compile_backend, backends)

    def _check_loss_scaling(self) -> None:
        if not self.initial_loss_scale > 0:
            raise ConfigError(f"initial_loss_scale must be > 0, got {self.initial_loss_scale}")
        _at_least("loss_scale_window", self.loss_scale_window, 1)
        _at_least("hysteresis", self.hysteresis, 1)
        if not 0 <= self.min_loss_scale <= self.initial_loss_scale:
            raise ConfigError(
                f"min_loss_scale({self.min_loss_scale}) must lie in [0, "
                f"initial_loss_scale({self.initial_loss_scale})]"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        scaling = [k for k in _LOSS_SCALING if getattr(self, k) != defaults[k]]
        if scaling and self.dtype != "fp16":
            raise ConfigError(
                f"{', '.join(scaling)}: loss scaling is for dtype fp16, got dtype {self.dtype} "
                "(bf16 has fp32's range and needs none)"
            )
        torch_lacks = [k for k in ("hysteresis", "min_loss_scale") if k in scaling]
        if torch_lacks and self.dtype == "fp16" and self.engine != "dk":
            raise ConfigError(
                f"{', '.join(torch_lacks)}: engine={self.engine!r} scales with torch's "
                "GradScaler, which has neither (our engines' dk.LossScaler has both)"
            )

    def _check_experts(self) -> None:
        """MoE blocks: where they can run (the others need work not done yet, named)."""
        experts = self.model.n_experts
        if self.ep > 1 and self.dp % self.ep:
            raise ConfigError(
                f"dp({self.dp}) is not a multiple of ep({self.ep}): ep is carved from dp"
            )
        if self.ep > 1 and (not experts or experts % self.ep):
            raise ConfigError(f"experts({experts}) must be a positive multiple of ep({self.ep})")
        if self.ep > 1 and (self.engine != "dk" or self.cp > 1):
            raise ConfigError(
                f"ep({self.ep}) > 1 runs with --engine dk and cp 1 (got engine="
                f"{self.engine!r}, cp={self.cp})"
            )


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")
