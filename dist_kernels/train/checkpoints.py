"""Checkpoints of a training run: one ``dk.checkpoint`` directory per pipeline stage.

    <checkpoint_dir>/step-00000006/stage-0/     dk.checkpoint (manifest, shards, ...)
                                   stage-1/
                                   COMPLETE.json   written last, by rank 0, after every stage

``COMPLETE.json`` is the commit point (written atomically once every stage's save returned on
every rank): ``--resume auto`` takes the newest step directory that has one, so a rank killed
mid-save leaves the previous checkpoint as the newest complete one. It also records what the
run was (model, corpus, pp, tp, zero) so that resuming something else fails before training.

With ZeRO the optimizer's shards go through ``dk.checkpoint``'s resharding (save on N replicas,
load on M), one directory per stage for every ep rank: the shards name MoE experts by global
id, so a run at another ep loads them the same way. Without it every replica holds the same
state: replica 0 of each stage saves its model and, in ``extra``, the torch optimizer's state
dict with its parameters' names (MoE experts by global id). With ep > 1 each ep rank saves its
own experts (``stage-0-ep-<r>``); a run at another ep resumes through ``dk.moe.checkpoint``:
each rank reads the ep ranks that held its experts and reshards model and optimizer state by
name. A run at another pp, tp, stage placement (schedule) or with ZeRO switched on or off reads
the whole checkpoint on every rank and cuts it for its own layout (``reshard.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from dataclasses import MISSING
from typing import Any, Dict, List, Optional, Tuple

from .. import checkpoint as dk_checkpoint
from ..moe import checkpoint as moe_checkpoint
from .config import ConfigError, TrainConfig

COMPLETE = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MUST_MATCH = ("model", "data", "optimizer")
# what a record written before a key existed was trained with
_DEFAULTS = {"optimizer": "adamw"}


def step_dir(cfg: TrainConfig, step: int) -> str:
    return os.path.join(cfg.checkpoint_dir, f"step-{step:08d}")


def identity(cfg: TrainConfig, model_desc: Dict[str, Any], data_fp: str) -> Dict[str, Any]:
    """What the run was: the checkpoint must agree with this run on ``_MUST_MATCH`` and the
    global batch; :data:`LAYOUT_KEYS` decide how it is loaded."""
    return {
        "model": model_desc,
        "data": data_fp,
        "pp": cfg.pp,
        "tp": cfg.tp,
        "schedule": cfg.schedule if cfg.pp > 1 else None,  # how the stages are placed
        "ep": cfg.ep,
        "sharded": cfg.flat_shards,
        "global_batch": cfg.global_batch,
        # the optimizer state's kind: AdamW's moments (adamw and fused-adamw share them) or
        # Muon's momentum buffers; a resume with the other would load one into the other
        "optimizer": "muon" if cfg.optimizer == "muon" else "adamw",
    }


def hyper(cfg: TrainConfig) -> Dict[str, Any]:
    """The learning-rate schedule and optimizer settings a checkpoint records, resolved (the
    schedule's horizon and wsd's decay as numbers): a resume compares them with its own
    (``TrainConfig.resume_hyper``). Fields that do not shape this run's schedule are left out
    (the horizon of a constant rate; wsd's settings under another decay; Muon's under AdamW)."""
    from .engines import wsd_decay_steps  # (late: engines imports this module's users)

    out: Dict[str, Any] = {
        "lr": cfg.lr, "lr_scaling": cfg.lr_scaling, "lr_base_batch": cfg.lr_base_batch,
        "warmup": cfg.warmup, "decay": cfg.decay, "min_lr_ratio": cfg.min_lr_ratio,
        "weight_decay": cfg.weight_decay, "adam_beta1": cfg.adam_beta1,
        "adam_beta2": cfg.adam_beta2, "adam_eps": cfg.adam_eps,
    }  # fmt: skip
    if cfg.decay != "constant":
        out["lr_decay_steps"] = cfg.decay_horizon
    if cfg.decay == "wsd":
        out.update(wsd_decay_steps=wsd_decay_steps(cfg), wsd_decay_style=cfg.wsd_decay_style)
    if cfg.optimizer == "muon":
        out.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                    if f.name.startswith("muon_")})  # fmt: skip
    return out


_HYPER_FLAGS = (
    "--override-opt-param-scheduler takes this run's (the optimizer state kept), "
    "--use-checkpoint-opt-param-scheduler the checkpoint's"
)


def _hyper_resolution(cfg: TrainConfig, record: Dict[str, Any], path: str) -> Dict[str, Any]:
    """``{}`` when the checkpoint's schedule and optimizer settings are this run's (or it
    records none: older checkpoints); else per ``cfg.resume_hyper``: ConfigError naming each
    difference, ``{"override": [...]}`` or ``{"adopt": {field: checkpoint's value}}``."""
    saved, mine = record.get("hyper"), hyper(cfg)
    if saved is None:
        return {}
    keys = _differing(saved, mine)
    if not keys:
        return {}
    if cfg.resume_hyper == "override":
        return {"override": keys}
    if cfg.resume_hyper == "checkpoint":
        adopt = {k: saved[k] for k in keys if k in saved and k in _ADOPTABLE}
        still = hyper(dataclasses.replace(cfg, **adopt))
        lost = _differing(saved, still)
        if lost:
            raise ConfigError(
                f"resume: checkpoint {path}: this run cannot take its {lost} "
                "(--use-checkpoint-opt-param-scheduler)"
            )
        return {"adopt": adopt}
    differences = ", ".join(f"{k}: {saved.get(k)!r} there, {mine.get(k)!r} here" for k in keys)
    raise ConfigError(
        f"resume: checkpoint {path} was trained with another schedule or optimizer setting "
        f"({differences}); {_HYPER_FLAGS}"
    )


def _differing(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """The keys whose values differ between ``a`` and ``b`` (a missing key counts as None)."""
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


# what the checkpoint's ``hyper`` may set in this run's config (all of it but the optimizer kind)
_ADOPTABLE = {f.name for f in dataclasses.fields(TrainConfig)} - {"optimizer"}


# what a step directory's layout is cut by: a change in any of these needs the whole state
LAYOUT_KEYS = ("pp", "tp", "schedule", "sharded")


def layout_change(saved: Dict[str, Any], ident: Dict[str, Any]) -> Optional[str]:
    """``"pp 2 -> 1, tp 1 -> 2"``: how this run's layout differs from the checkpoint's in
    :data:`LAYOUT_KEYS` (a record without a key was written at this run's value), or None."""
    changes = [
        f"{key} {saved[key]} -> {ident[key]}"
        for key in LAYOUT_KEYS
        if key in saved
        and saved[key] != ident[key]
        and not (key == "schedule" and None in (saved[key], ident[key]))  # pp says it
    ]
    return ", ".join(changes) or None


def newest_complete(directory: str) -> Optional[str]:
    """The newest ``step-N`` directory with a ``COMPLETE.json``, or None."""
    if not os.path.isdir(directory):
        return None
    steps = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, COMPLETE)):
            steps.append((int(match.group(1)), name))
    return os.path.join(directory, max(steps)[1]) if steps else None


def _model_with_defaults(desc: Dict[str, Any]) -> Dict[str, Any]:
    """A saved model description with the GPTConfig fields it predates at their defaults
    (which is what the model that saved it had), so a field added since does not refuse it."""
    from ..models import GPTConfig

    defaults = {
        f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not MISSING
    }
    return {**{k: v for k, v in defaults.items() if k not in desc}, **desc}


def read_record(path: str, what: str) -> Dict[str, Any]:
    """The ``COMPLETE.json`` of step directory ``path``; ConfigError (``what``: the option
    asking) when it is missing or unreadable: the checkpoint is not complete."""
    record_path = os.path.join(path, COMPLETE)
    try:
        with open(record_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}: {record_path} is not a complete checkpoint: {e}") from None


def resolve_resume(cfg: TrainConfig, ident: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The checkpoint this run resumes from (its COMPLETE record plus ``path``), checked
    against ``ident``; None when there is nothing to resume. Raises ConfigError on a mismatch."""
    if cfg.resume is None:
        return None
    path = newest_complete(cfg.checkpoint_dir) if cfg.resume == "auto" else cfg.resume
    if path is None:
        return None
    record = read_record(path, "resume")
    for key in _MUST_MATCH:
        saved = record["identity"].get(key, _DEFAULTS.get(key))
        if key == "model" and isinstance(saved, dict):
            saved = _model_with_defaults(saved)
        if saved != ident[key]:
            raise ConfigError(
                f"resume: checkpoint {path} was written with {key}={saved!r}; "
                f"this run has {key}={ident[key]!r}"
            )
    if record["identity"]["global_batch"] != ident["global_batch"]:
        raise ConfigError(
            f"resume: checkpoint {path} trained with global_batch("
            f"{record['identity']['global_batch']}); this run has global_batch("
            f"{ident['global_batch']}): keep the global batch, change dp or grad_accum"
        )
    if record["step"] >= cfg.steps:
        raise ConfigError(
            f"resume: checkpoint {path} is at step {record['step']} >= steps({cfg.steps})"
        )
    resolution = _hyper_resolution(cfg, record, path)
    reshard = layout_change(record["identity"], ident)
    if "weight_decay" in resolution.get("override", ()) and not reshard:
        # decay on or off changes the param groups (decay_groups): load by parameter name
        reshard = "weight decay overridden"
    # another pp, tp, schedule or ZeRO: every rank reads the whole checkpoint (reshard.py)
    return {**record, **resolution, "path": path, "reshard": reshard}


def adopt_hyper(cfg: TrainConfig, resume: Optional[Dict[str, Any]]) -> TrainConfig:
    """``cfg`` with the checkpoint's schedule and optimizer settings where
    ``--use-checkpoint-opt-param-scheduler`` takes them (:func:`resolve_resume`)."""
    if not resume or not resume.get("adopt"):
        return cfg
    return dataclasses.replace(cfg, **resume["adopt"])


def save(cfg, engine, ident, step: int, shard: str, barrier) -> str:
    """Collective over the world: every stage (and tensor shard) saves, then rank 0 commits
    COMPLETE.json. ``shard``: this rank's directory name (``stage-1``, ``stage-0-tp-1``)."""
    root = step_dir(cfg, step)
    stage = os.path.join(root, shard)
    extra = {"step": step, "samples": step * cfg.global_batch, "identity": ident}
    extra["updates"] = engine.updates  # the schedule's position (fp16 skips do not advance it)
    if engine.scaler is not None:  # fp16: the same state on every rank
        extra["loss_scaler"] = engine.scaler.state_dict()
    consolidate = getattr(engine.optimizer, "consolidate_state_dict", None)
    if consolidate is not None and not cfg.flat_shards:
        consolidate()  # Muon's zero(1): every replica holds its part; collective
    if cfg.flat_shards:
        dk_checkpoint.save(stage, model=engine.module, optimizer=engine.optimizer, extra=extra)
    elif engine.replica_rank == 0:  # one of the dp x cp ranks that hold these weights
        extra["optimizer"] = engine.optimizer.state_dict()
        extra["param_names"] = _optimizer_order_names(engine)
        dk_checkpoint.save(stage, model=engine.module, extra=extra)
    barrier()
    if barrier.rank == 0:
        record = {"step": step, "samples": step * cfg.global_batch, "identity": ident}
        record["hyper"] = hyper(cfg)
        _write_json_atomic(os.path.join(root, COMPLETE), record)
    barrier()
    if barrier.rank == 0 and cfg.keep_last:
        prune(cfg.checkpoint_dir, cfg.keep_last)
    return root


def prune(directory: str, keep: int) -> List[str]:
    """Removes every complete step directory but the newest ``keep`` and every incomplete one
    older than the newest complete (a save torn by a crash, superseded); returns what it
    removed. Each loses its ``COMPLETE.json`` first, so a removal cut short leaves an
    incomplete directory (never resumed, removed next time), not a damaged complete one. A
    removal that fails is reported and skipped: training goes on."""
    steps = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            complete = os.path.isfile(os.path.join(directory, name, COMPLETE))
            steps.append((int(match.group(1)), complete, name))
    complete = sorted(step for step, done, _ in steps if done)
    if not complete:
        return []
    kept = set(complete[-keep:])
    removed = []
    for step, _, name in sorted(steps):
        if step in kept or step > complete[-1]:
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isfile(os.path.join(path, COMPLETE)):
                os.remove(os.path.join(path, COMPLETE))  # no longer a checkpoint, first
            shutil.rmtree(path)
            removed.append(path)
        except OSError as e:
            warnings.warn(f"keep_last: could not remove {path}: {e}", stacklevel=2)
    return removed


def _options(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "initial_lr")}


def _optimizer_order_names(engine) -> list:
    """The global names (experts by global id) of the optimizer's parameters in its state
    dict's index order: its param groups one after the other (weight decay's two groups do
    not follow the module's order)."""
    module = engine.module
    by_id = dict(zip(map(id, module.parameters()), moe_checkpoint.global_param_names(module)))
    return [by_id[id(p)] for group in engine.optimizer.param_groups for p in group["params"]]


def _load_resharded(engine, path: str, shard: str, saved_ep: int) -> Dict[str, Any]:
    """Model and optimizer of a run saved at ``saved_ep`` (not this run's ep): each saved ep
    rank's directory is the shard name with its ep rank (none at ep 1). Returns the first
    one's ``extra``."""
    base = re.sub(r"-ep-\d+$", "", shard)

    def read(r: int):
        name = f"{base}-ep-{r}" if saved_ep > 1 else base
        state, extra = dk_checkpoint.read_model(os.path.join(path, name))
        if "param_names" not in extra:
            raise ConfigError(
                f"resume: {path}/{name} records no parameter names (an older checkpoint): "
                f"resume it at its own ep({saved_ep})"
            )
        return state, extra

    states = {}

    def saved(r: int):
        if r not in states:
            states[r] = read(r)
        return states[r]

    module = engine.module
    module.load_state_dict(moe_checkpoint.reshard_state(module, saved_ep, lambda r: saved(r)[0]))
    optimizer_state = moe_checkpoint.reshard_optimizer_state(
        module,
        saved_ep,
        lambda r: (saved(r)[1]["optimizer"], saved(r)[1]["param_names"]),
        [group["params"] for group in engine.optimizer.param_groups],
    )
    engine.optimizer.load_state_dict(optimizer_state)
    return saved(0)[1]


def _write_json_atomic(path: str, record: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(cfg, engine, resume: Dict[str, Any], shard: str, resharded=None) -> Tuple[int, int]:
    """Restores model and optimizer from ``resume``; returns the step to continue from and
    the optimizer steps applied before it (the learning-rate schedule's position).
    ``resharded``: the whole checkpoint (``reshard.Resharded``) when this run's layout is not
    the checkpoint's; the model was built from its weights, its optimizer state loads here."""
    stage = os.path.join(resume["path"], shard)
    saved_ep = resume["identity"].get("ep", cfg.ep)  # older records: resumed at their own ep
    # --override-opt-param-scheduler: this run's settings, as the engine built them
    mine = [_options(g) for g in engine.optimizer.param_groups] if resume.get("override") else []
    if resharded is not None:
        resharded.load(engine.optimizer, engine.module)
        extra = resharded.extra
    elif cfg.flat_shards:  # at any ep: the shards name experts by global id
        extra = dk_checkpoint.load(stage, model=engine.module, optimizer=engine.optimizer)
    elif saved_ep != cfg.ep:
        extra = _load_resharded(engine, resume["path"], shard, saved_ep)
    else:
        extra = dk_checkpoint.load(stage, model=engine.module)
        engine.optimizer.load_state_dict(extra["optimizer"])
    for group, options in zip(engine.optimizer.param_groups, mine):
        group.pop("initial_lr", None)  # the schedule starts again from this run's peak
        group.update(options)
    # fp16 resumes its loss scale (a run saved at another dtype starts the scaler afresh)
    if engine.scaler is not None and "loss_scaler" in extra:
        engine.scaler.load_state_dict(extra["loss_scaler"])
    step = int(resume["step"])
    return step, int(extra.get("updates", step))  # older checkpoints: every step applied
