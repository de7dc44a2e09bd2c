"""A resume whose learning-rate schedule or optimizer settings differ from the checkpoint's:
refused by default, naming each difference; this run's with --override-opt-param-scheduler;
the checkpoint's with --use-checkpoint-opt-param-scheduler (Megatron's three behaviours);
and --lr-decay-steps, the schedule's own horizon."""

from __future__ import annotations

import dataclasses
import math

import pytest
from mp_pool import run_ranks
from test_train import _cfg, _on_ranks

from dist_kernels import lr as dk_lr
from dist_kernels.train import ConfigError
from dist_kernels.train.cli import build_parser, config_from_args, preflight

STEPS = 6


def _base(tmp_path, **kw):
    base = dict(global_batch=8, dp=2, steps=STEPS, log_every=1, warmup=1, decay="cosine")
    return _cfg(**{**base, **kw})


def _saved(tmp_path, cfg):
    """The uninterrupted run, and a checkpoint of the same run at step 2."""
    straight = run_ranks(2, _on_ranks, cfg, timeout=300)[0]
    stop = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), stop_after=2)
    run_ranks(2, _on_ranks, stop, timeout=300)
    return straight, str(tmp_path / "step-00000002")


def _lrs(result):
    return [rec["lr"] for rec in result["records"]]


def _cosine(peak, step, warmup, horizon, min_ratio):
    """The rate of (1-based) step ``step``: dk.lr's warmup_cosine factor at ``step - 1``."""
    return peak * dk_lr.warmup_cosine_factor(warmup, horizon, min_ratio)(step - 1)


def test_a_changed_schedule_is_refused_naming_each_difference(tmp_path):
    cfg = _base(tmp_path)
    _, step2 = _saved(tmp_path, cfg)
    changed = dataclasses.replace(cfg, resume=step2, lr=1e-3, warmup=2)
    with pytest.raises(ConfigError) as e:
        preflight(changed, 2)  # before any rank starts
    message = str(e.value)
    assert "lr: 0.003 there, 0.001 here" in message and "warmup: 1 there, 2 here" in message
    assert "--override-opt-param-scheduler" in message
    same = run_ranks(2, _on_ranks, dataclasses.replace(cfg, resume=step2), timeout=300)[0]
    assert same["start"] == 2  # the same settings resume as before


def test_override_takes_this_runs_schedule_and_keeps_the_state(tmp_path):
    """--override-opt-param-scheduler with another peak and horizon: the first resumed step
    is the uninterrupted run's loss (same weights), and every rate is this run's formula."""
    cfg = _base(tmp_path)
    straight, step2 = _saved(tmp_path, cfg)
    new = dataclasses.replace(cfg, resume=step2, lr=1e-3, steps=8, resume_hyper="override")
    resumed = run_ranks(2, _on_ranks, new, timeout=300)[0]
    assert resumed["start"] == 2
    assert resumed["losses"][0] == straight["losses"][2]
    want = [_cosine(1e-3, s, 1, 8, cfg.min_lr_ratio) for s in range(3, 9)]
    assert _lrs(resumed) == pytest.approx(want, rel=1e-12)
    assert resumed["losses"][1] != straight["losses"][3]  # the new rate took effect


def test_override_turns_weight_decay_on(tmp_path):
    """Weight decay 0 -> 0.5 with --override-opt-param-scheduler: the groups differ (one
    without decay, two with), so the state loads by parameter name; the run's groups decay
    its matrices and embeddings by 0.5 and spare the 1-D parameters."""
    cfg = _base(tmp_path)
    straight, step2 = _saved(tmp_path, cfg)
    new = dataclasses.replace(cfg, resume=step2, weight_decay=0.5, resume_hyper="override")
    resumed = run_ranks(2, _on_ranks, new, timeout=300)[0]
    assert resumed["losses"][0] == straight["losses"][2]
    undecayed = run_ranks(
        2, _on_ranks, dataclasses.replace(new, weight_decay=0.0, resume_hyper="check"),
        timeout=300,
    )[0]  # fmt: skip
    assert undecayed["losses"] == straight["losses"][2:]
    # decay shrank the matrices and left the norms' weights to the gradient alone
    shrunk = [k for k in resumed["params"] if resumed["params"][k].dim() >= 2]
    for k in shrunk:
        assert resumed["params"][k].norm() < undecayed["params"][k].norm(), k


def test_use_checkpoint_continues_the_saved_schedule(tmp_path):
    """--use-checkpoint-opt-param-scheduler with another --lr and --steps 8: steps 3-6 are the
    uninterrupted run's bit for bit (its peak, its horizon of 6), 7-8 run at the decay's end."""
    cfg = _base(tmp_path)
    straight, step2 = _saved(tmp_path, cfg)
    new = dataclasses.replace(cfg, resume=step2, lr=1e-3, steps=8, resume_hyper="checkpoint")
    resumed = run_ranks(2, _on_ranks, new, timeout=300)[0]
    assert resumed["losses"][:4] == straight["losses"][2:]
    assert _lrs(resumed)[:4] == _lrs(straight)[2:]
    assert _lrs(resumed)[4:] == pytest.approx([cfg.lr * cfg.min_lr_ratio] * 2, rel=1e-12)


def test_lr_decay_steps_sets_the_horizon(tmp_path):
    cfg = _base(tmp_path, lr_decay_steps=4)
    result = run_ranks(2, _on_ranks, cfg, timeout=300)[0]
    want = [_cosine(cfg.lr, s, 1, 4, cfg.min_lr_ratio) for s in range(1, STEPS + 1)]
    assert _lrs(result) == pytest.approx(want, rel=1e-12)
    assert math.isclose(_lrs(result)[-1], cfg.lr * cfg.min_lr_ratio, rel_tol=1e-12)


def test_flags():
    parse = lambda *a: config_from_args(build_parser().parse_args(list(a)))  # noqa: E731
    assert parse().resume_hyper == "check"
    assert parse("--override-opt_param-scheduler").resume_hyper == "override"
    assert parse("--use-checkpoint-opt-param-scheduler").resume_hyper == "checkpoint"
    assert parse("--lr-decay-iters", "40").lr_decay_steps == 40
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"]
        )
    with pytest.raises(ConfigError, match="resume_hyper must be one of"):
        _cfg(resume_hyper="ignore").with_layout(1)
