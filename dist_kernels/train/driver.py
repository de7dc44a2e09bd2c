"""The training loop: setup, steps, logging intervals, checkpoints. Runs on every rank.

    result = train(cfg)     # torch.distributed initialised (gloo), or one process without it

One interval (``log_every`` steps) costs one small all-gather on our Communicator: each rank's
last loss, mean step / busy / phase times and peak memory. Rank 0 turns the rows into the
metrics record (JSON line, progress bar) and feeds the straggler detector.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional

import torch

from . import checkpoints
from .config import TrainConfig
from .data import Corpus, Sampler, build_blend, split
from .engines import build_engine
from .exits import ExitWatch
from .metrics import PHASES, JsonLines, Progress, StepTimes, matmul_peak_flops, peak_memory_mb
from .model import build_model, describe, flops_per_token, moe_metrics
from .profiling import StepProfiler
from .stragglers import StragglerDetector, StragglerReport, minmax_line
from .tensorboard import TensorBoardLog

_ROW = ("loss", "step_ms", "busy_ms", *PHASES, "peak_mem_mb", "peak_flops", "nonfinite_step")


@dataclass
class RunResult:
    """What :func:`train` returns on each rank (records and reports only on rank 0)."""

    engine: str
    start_step: int
    records: List[Dict[str, Any]] = field(default_factory=list)
    stragglers: List[StragglerReport] = field(default_factory=list)
    params: Dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's stage, at the end
    evals: List[Dict[str, Any]] = field(default_factory=list)  # validation records (rank 0)
    test: Optional[Dict[str, Any]] = None  # the test record at the end (rank 0; --split)
    summary: Dict[str, Any] = field(default_factory=dict)
    exit_reason: Optional[str] = None  # why the run stopped before its end (exits.py)


class World:
    """Rank, world size, hosts, the mesh (our engines) and the metrics all-gather."""

    def __init__(self, cfg: TrainConfig, need_mesh: bool) -> None:
        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.hosts = [socket.gethostname()] * self.world_size
        self.mesh = self.comm = None
        if self.world_size > 1:
            from ..comm import Communicator
            from ..mesh import ProcessMesh

            dist.all_gather_object(self.hosts, socket.gethostname())
            self.comm = Communicator()
            if need_mesh:
                self.mesh = ProcessMesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, ep=cfg.ep)
        self.pp_rank = self.mesh.pp_rank if self.mesh is not None else 0
        self.tp_rank = getattr(self.mesh, "tp_rank", 0)
        self.tp_comm = getattr(self.mesh, "tp_comm", None) if cfg.tp > 1 else None
        self.cp_comm = getattr(self.mesh, "cp_comm", None) if cfg.cp > 1 else None
        self.ep_comm = getattr(self.mesh, "ep_comm", None) if cfg.ep > 1 else None

    def shard_name(self, sharded: bool) -> str:
        """This rank's checkpoint directory: its stage, its tensor shard when tp > 1, and its
        ep rank when ep > 1 unless ZeRO saves (``sharded``: one directory for every ep rank,
        whose shards record each rank's experts by global id)."""
        tp = f"-tp-{self.tp_rank}" if self.tp_comm is not None else ""
        ep = f"-ep-{self.mesh.ep_rank}" if self.ep_comm is not None and not sharded else ""
        return f"stage-{self.pp_rank}{tp}{ep}"

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """``[world_size, len(row)]``: every rank's row (one all-gather)."""
        if self.comm is None:
            return row[None].clone()
        out = torch.empty(self.world_size * row.numel(), dtype=row.dtype)
        self.comm.all_gather(out, row)
        return out.view(self.world_size, -1)

    def __call__(self) -> None:
        """Barrier over the world (used by checkpoints)."""
        if self.comm is not None:
            self.comm.barrier()

    def close(self) -> None:
        for obj in (self.mesh, self.comm):
            if obj is not None:
                obj.close()


def model_config(cfg: TrainConfig, corpus: Corpus):
    """The model size with the corpus's vocabulary padded to a multiple of
    ``cfg.vocab_multiple`` (64 unless ``--make-vocab-size-divisible-by``; and of tp, when tp
    does not divide it): the head and embedding are split by vocabulary, and padding by a
    constant rather than by tp (Megatron pads to the multiple times tp) builds the same model,
    the same initialisation and so the same losses at every tp that divides it. The padding
    ids never occur."""
    multiple = math.lcm(cfg.vocab_multiple, cfg.tp)
    vocab = -(-corpus.vocab_size // multiple) * multiple
    return dataclasses.replace(cfg.model, vocab_size=vocab)


def train(cfg: TrainConfig, engine: Optional[str] = None, append_log: bool = False) -> RunResult:
    """Trains ``cfg`` (layout already resolved by ``cfg.with_layout``) with ``engine``
    ("dk" or "torch"; default ``cfg.engine``). Collective: every rank calls it. The JSON log
    is appended to when ``append_log`` or when the run resumes a checkpoint."""
    engine = engine or cfg.engine
    corpus = build_blend(cfg.data, cfg.data_blend, cfg.model.block_size, cfg.vocab_size)
    cfg = dataclasses.replace(cfg, model=model_config(cfg, corpus))
    world = World(cfg, need_mesh=engine == "dk")
    try:
        return _Run(cfg, engine, world, corpus, append_log).run()
    finally:
        world.close()


class _Run:
    def __init__(
        self, cfg: TrainConfig, engine: str, world: World, corpus: Corpus, append_log: bool
    ) -> None:
        self.cfg, self.engine_name, self.world = cfg, engine, world
        self.data = samplers(cfg, corpus)
        self.sampler, data_fp = self.data.train, self.data.fingerprint
        self.ident = checkpoints.identity(cfg, describe(cfg.model), data_fp)
        resume = checkpoints.resolve_resume(cfg, self.ident)
        cfg = self.cfg = checkpoints.adopt_hyper(cfg, resume)  # the checkpoint's schedule
        compile_backend = cfg.compile_backend if cfg.compile else None
        init_state = resharded = None
        if cfg.init_from is not None and resume is None:  # a resumed run has its own weights
            from .export import load_exported  # (late: `python -m ...export` imports it first)

            init_state = load_exported(cfg.init_from, cfg.model)
        if resume is not None and resume["reshard"]:  # another layout: the whole checkpoint
            from .reshard import Resharded

            resharded = Resharded(resume["path"])
            init_state = resharded.init_state
        full, _ = build_model(
            cfg.model,
            cfg.seed,
            recompute=cfg.recompute,
            compile_backend=compile_backend,
            init_state=init_state,
            documents=cfg.documents,
        )
        self.flops_per_token = flops_per_token(cfg.model, full)  # the whole model, not a shard
        sharded = any(c is not None for c in (world.tp_comm, world.cp_comm, world.ep_comm))
        model, loss = (
            build_model(
                cfg.model,
                cfg.seed,
                world.tp_comm,
                world.cp_comm,
                world.ep_comm,
                cfg.recompute,
                cfg.sequence_parallel,
                compile_backend,
                init_state,
                cfg.documents,
            )
            if sharded
            else (full, _)
        )
        if resharded is not None:  # before the engine: ZeRO-3 frees the parameters' storage
            resharded.attach(model, world.tp_rank, cfg.tp)
        self.engine = build_engine(
            cfg, model, loss, engine, world.mesh, world.rank, world.comm if engine == "dk" else None
        )
        self.start_step = updates = 0
        if resume is not None:
            self.start_step, updates = checkpoints.load(
                cfg, self.engine, resume, world.shard_name(cfg.flat_shards), resharded
            )
        self.engine.start(updates)
        self.is_rank0 = world.rank == 0
        self.detector = StragglerDetector(
            cfg.straggler_threshold, cfg.straggler_min_ms, cfg.straggler_patience
        )
        self.result = RunResult(engine, self.start_step)
        self.peak_flops = matmul_peak_flops(seconds=0.1)
        self.tokens_per_step = cfg.global_batch * cfg.model.block_size
        self.progress = Progress(
            cfg.progress and self.is_rank0, cfg.steps, self.start_step, f"train[{engine}]"
        )
        self.json = JsonLines(
            cfg.json if self.is_rank0 else None, append=append_log or resume is not None
        )
        self.tensorboard = TensorBoardLog(cfg.tensorboard if self.is_rank0 else None)
        profile_dir = cfg.profile_dir  # --engine both: one folder per engine
        if cfg.engine == "both":
            profile_dir = os.path.join(profile_dir, engine)
        self.profiler = StepProfiler(
            cfg.profile_steps, profile_dir, world.rank, world.world_size, world
        )
        if self.is_rank0 and resume is not None:
            how = f" (resharded: {resume['reshard']})" if resume["reshard"] else ""
            self.progress.write(f"resumed from {resume['path']} at step {self.start_step}{how}")

    def run(self) -> RunResult:
        self.exits = ExitWatch(self.cfg, self.world)
        try:
            self._loop()
            self.result.params = self.engine.final_params()
        finally:
            self.exits.close()
            self.progress.close()
            self.json.close()
            self.tensorboard.close()
            self.engine.close()
        summary = _summary(self.result.records, self.start_step)
        self.result.summary = _with_validation(summary, self.result.evals, self.result.test)
        return self.result

    def _loop(self) -> None:
        cfg = self.cfg
        interval: List[StepTimes] = []
        loss = math.nan
        wall = time.perf_counter()
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
        for step in range(self.start_step, end):
            self.profiler.step_begins(step + 1)
            loss, times = self.engine.step(step, self.sampler)
            times.nonfinite_loss = not math.isfinite(loss)
            interval.append(times)
            done = step + 1
            self.profiler.step_ended(done)
            if done % cfg.log_every == 0 or done == end:
                self._log(done, loss, interval, time.perf_counter() - wall)
                interval = []
                wall = time.perf_counter()
            if cfg.eval_interval and (done % cfg.eval_interval == 0 or done == end):
                self._evaluate(done)
                wall = time.perf_counter()  # validation time is not training throughput
            if self._checkpoint_due(done):
                self._save(done)
                self._maybe_die(done)
                wall = time.perf_counter()  # checkpoint time is not training throughput
            reason = self.exits.after_step(done)
            if reason is not None:
                self._exit_early(done, reason, loss, interval, time.perf_counter() - wall)
                return
        if self.data.test is not None and end == cfg.steps:  # Megatron's test at the end
            self._evaluate(end, "test")

    def _save(self, done: int) -> str:
        cfg = self.cfg
        shard = self.world.shard_name(cfg.flat_shards)
        return checkpoints.save(cfg, self.engine, self.ident, done, shard, self.world)

    def _exit_early(self, done: int, reason: str, loss: float, interval, seconds: float) -> None:
        """Every rank stops after step ``done`` (``exits.py``): the steps not yet logged are,
        and a checkpoint is written unless this step's was."""
        if interval:
            self._log(done, loss, interval, seconds)
        saved = None
        if self.cfg.checkpoint_dir is not None and self.engine_name == "dk":
            saved = checkpoints.step_dir(self.cfg, done)
            if not self._checkpoint_due(done):
                self._save(done)
        self.result.exit_reason = reason
        if self.is_rank0:
            where = f"; checkpoint {saved}" if saved else "; no --checkpoint-dir: nothing saved"
            self.progress.write(f"stopped after step {done} of {self.cfg.steps} ({reason}){where}")

    def _evaluate(self, done: int, split: str = "valid") -> None:
        """The validation (or test) loss: ``eval_iters`` held-out global batches (the same
        each time), every replica its share, averaged over the ranks (a replica's ranks
        agree)."""
        cfg = self.cfg
        sampler = self.data.valid if split == "valid" else self.data.test
        mine = sum(self.engine.evaluate(sampler, k) for k in range(cfg.eval_iters))
        rows = self.world.gather(torch.tensor([mine / cfg.eval_iters], dtype=torch.float64))
        if not self.is_rank0:
            return
        loss = float(rows.mean())
        record = {"step": done, "engine": self.engine_name, f"{split}_loss": loss}
        record[f"{split}_ppl"] = math.exp(min(loss, 700.0))
        if split == "valid":
            self.result.evals.append(record)
        else:
            self.result.test = record
        self.json.write(record)
        self.tensorboard.write_eval(record, split)
        name = "validation" if split == "valid" else "test"
        self.progress.write(
            f"step {done} | {name} loss {loss:.4f} | ppl {record[f'{split}_ppl']:.2f}"
        )

    def _checkpoint_due(self, done: int) -> bool:
        cfg = self.cfg
        if cfg.checkpoint_dir is None or self.engine_name != "dk":
            return False
        every = cfg.checkpoint_every
        return done in (cfg.steps, cfg.stop_after) or (every > 0 and done % every == 0)

    def _maybe_die(self, done: int) -> None:
        fault = self.cfg.kill_after_checkpoint
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if fault is not None and fault == (self.world.rank, done) and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)

    def _log(self, done: int, loss: float, interval: List[StepTimes], seconds: float) -> None:
        row = _row(loss, interval, self.peak_flops, done)
        rows = self.world.gather(row)
        _stop_if_diverged(rows, self.cfg)  # every rank sees the rows: all stop together
        if not self.is_rank0:
            return
        record = self._record(done, rows, len(interval), seconds)
        last = interval[-1]
        if self.cfg.clip_grad:  # the interval's last step; the same norm on every rank
            finite = last.grad_norm is not None and math.isfinite(last.grad_norm)
            record["grad_norm"] = last.grad_norm if finite else None  # None: an overflow
        if self.cfg.dtype == "fp16":  # the same decisions on every rank
            record["loss_scale"] = last.loss_scale
            record["skipped_steps"] = sum(t.skipped for t in interval)
        self.result.records.append(record)
        self.json.write(record)
        self.tensorboard.write(record)
        if self.world.world_size > 1:
            self.progress.write(_minmax(done, rows))
        self._check_stragglers(done, rows)
        self.progress.update(
            len(interval),
            loss=f"{record['loss']:.4f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            comm_ms=_fmt(record["comm_ms"]),
        )

    def _record(self, done: int, rows: torch.Tensor, n_steps: int, seconds: float):
        cfg, col = self.cfg, {name: i for i, name in enumerate(_ROW)}
        step_s = seconds / n_steps
        tokens_per_s = self.tokens_per_step / step_s
        mean = rows.mean(dim=0)
        record = {
            "step": done,
            "engine": self.engine_name,
            "loss": float(mean[col["loss"]]),
            "lr": self.engine.lr,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": cfg.global_batch / step_s,
            "step_ms": step_s * 1e3,
            "mfu": tokens_per_s * self.flops_per_token / float(rows[:, col["peak_flops"]].sum()),
            "peak_flops": float(rows[:, col["peak_flops"]].sum()),
            "flops_per_token": self.flops_per_token,
        }
        for phase in PHASES:
            value = float(mean[col[phase]])
            record[f"{phase}_ms"] = None if math.isnan(value) else value
        record["rank_step_ms"] = rows[:, col["step_ms"]].tolist()
        record["rank_busy_ms"] = rows[:, col["busy_ms"]].tolist()
        record["peak_mem_mb"] = rows[:, col["peak_mem_mb"]].tolist()
        record.update(moe_metrics(self.engine.module))
        if cfg.reference_tokens_per_s:
            reference = self.world.world_size * cfg.reference_tokens_per_s
            record["scaling_efficiency"] = tokens_per_s / reference
        return record

    def _check_stragglers(self, done: int, rows: torch.Tensor) -> None:
        col = {name: i for i, name in enumerate(_ROW)}
        phases = [
            {p: (None if math.isnan(float(r[col[p]])) else float(r[col[p]])) for p in PHASES}
            for r in rows
        ]
        busy = rows[:, col["busy_ms"]].tolist()
        for report in self.detector.observe(done, busy, phases, self.world.hosts):
            self.result.stragglers.append(report)
            self.progress.write(str(report))


class Samplers(NamedTuple):
    """The run's samplers: training, validation (with ``eval_interval``), test (with
    ``test_fraction``), and the data's fingerprint."""

    train: Sampler
    valid: Optional[Sampler]
    test: Optional[Sampler]
    fingerprint: str


def samplers(cfg: TrainConfig, corpus: Corpus) -> Samplers:
    """The run's :class:`Samplers`: with ``eval_interval`` (and ``test_fraction``) the
    corpus's tail is held out, which the fingerprint records (a resume must train on the same
    text; the command line's preflight checks it with this too)."""
    seq, batch = cfg.model.block_size, cfg.global_batch
    valid = cfg.valid_fraction if cfg.eval_interval else 0.0
    if not valid and not cfg.test_fraction:
        return Samplers(Sampler(corpus, seq, batch, cfg.seed), None, None, corpus.fingerprint())
    spans = split(corpus, valid, cfg.test_fraction)
    made = [Sampler(corpus, seq, batch, cfg.seed, span=spans[0])]
    for fraction, span in zip((valid, cfg.test_fraction), spans[1:]):
        made.append(Sampler(corpus, seq, batch, cfg.seed, span=span) if fraction else None)
    train_span = spans[0]
    ends = [s[1] for s in train_span] if isinstance(train_span, list) else train_span[1]
    return Samplers(*made, f"{corpus.fingerprint()}:train{ends}")


def _minmax(done: int, rows: torch.Tensor) -> str:
    """Megatron's min/max-by-rank line of the interval: step time, busy time, exposed comm."""
    col = {name: i for i, name in enumerate(_ROW)}
    columns = {"Rtt": rows[:, col["step_ms"]].tolist(), "Busy": rows[:, col["busy_ms"]].tolist()}
    comm = rows[:, col["comm"]]
    if not torch.isnan(comm).any():
        columns["Comm"] = comm.tolist()
    return minmax_line(done, columns)


def _row(loss: float, interval: List[StepTimes], peak_flops: float, done: int) -> torch.Tensor:
    """This rank's metrics row (NaN for a phase its engine does not measure); its last column
    is the interval's first step whose loss was inf or NaN here (0: none)."""
    n = len(interval)
    values = [loss, sum(t.step_ms for t in interval) / n, sum(t.busy_ms for t in interval) / n]
    for phase in PHASES:
        per_step = [t.phases[phase] for t in interval]
        values.append(math.nan if None in per_step else sum(per_step) / n)
    bad = [done - n + 1 + i for i, t in enumerate(interval) if t.nonfinite_loss]
    values += [peak_memory_mb(), peak_flops, bad[0] if bad else 0]
    return torch.tensor(values, dtype=torch.float64)


def _stop_if_diverged(rows: torch.Tensor, cfg: TrainConfig) -> None:
    """Raises ``FloatingPointError`` on every rank when any rank's loss went inf or NaN in the
    interval (Megatron's NaN check), naming the first such step and the ranks: a diverged run
    stops at its next log instead of training on NaN."""
    steps = rows[:, _ROW.index("nonfinite_step")]
    if not bool((steps > 0).any()):
        return
    first = int(steps[steps > 0].min())
    ranks = [r for r, s in enumerate(steps.tolist()) if s > 0]
    raise FloatingPointError(
        f"the loss is not finite from step {first} on rank(s) {ranks} (dtype {cfg.dtype}, "
        f"lr {cfg.lr}): the run diverged; lower --lr, or add --clip-grad or --warmup steps"
    )


def _summary(records: List[Dict[str, Any]], start_step: int) -> Dict[str, Any]:
    """Means over the logged intervals after the first (which pays warm-up and planning)."""
    if not records:
        return {}
    steady = records[1:] or records
    out: Dict[str, Any] = {"final_loss": records[-1]["loss"], "steps": records[-1]["step"]}
    for key in ("tokens_per_s", "step_ms", "mfu", *(f"{p}_ms" for p in PHASES)):
        values = [r[key] for r in steady if r.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    out["peak_mem_mb"] = max(max(r["peak_mem_mb"]) for r in records)
    return out


def _with_validation(
    summary: Dict[str, Any], evals: List[Dict[str, Any]], test: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """The summary with the last validation loss and the test loss (when there were)."""
    if evals:
        summary["valid_loss"] = evals[-1]["valid_loss"]
    if test is not None:
        summary["test_loss"] = test["test_loss"]
    return summary


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"
