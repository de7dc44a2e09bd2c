"""dk.lr: scaling rules and schedules against their closed forms, in and out of LambdaLR."""

import math

import pytest
import torch

import dist_kernels as dk


@pytest.mark.parametrize(
    "rule,expected", [("none", 3e-4), ("linear", 3e-4 * 8), ("sqrt", 3e-4 * math.sqrt(8))]
)
def test_scale_lr(rule, expected):
    assert dk.lr.scale_lr(3e-4, global_batch=512, base_batch=64, rule=rule) == pytest.approx(
        expected, rel=1e-15
    )


def test_scale_lr_rejects_bad_input():
    with pytest.raises(ValueError, match="rule"):
        dk.lr.scale_lr(1.0, 8, 4, "cube")
    with pytest.raises(ValueError, match=r"global_batch\(0\)"):
        dk.lr.scale_lr(1.0, 0, 4, "linear")


def _closed_form_cosine(s, warmup, total, m):
    if s < warmup:
        return (s + 1) / warmup
    p = min(1.0, (s - warmup) / (total - warmup))
    return m + (1 - m) * (1 + math.cos(math.pi * p)) / 2


def test_warmup_cosine_factor_matches_closed_form():
    f = dk.lr.warmup_cosine_factor(4, 20, min_ratio=0.1)
    for s in range(30):
        assert f(s) == pytest.approx(_closed_form_cosine(s, 4, 20, 0.1), abs=1e-15), s
    assert f(3) == 1.0  # the warm-up reaches the full rate on its last step
    assert f(12) == pytest.approx(0.55)  # half way down: (1 + 0.1) / 2
    assert f(20) == pytest.approx(0.1) and f(25) == pytest.approx(0.1)


def test_warmup_constant_factor():
    f = dk.lr.warmup_constant_factor(5)
    assert [f(s) for s in range(7)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0]
    assert dk.lr.warmup_constant_factor(0)(0) == 1.0


def _lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_lambda_lr_scheduler_and_resume():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = dk.lr.warmup_cosine(opt, 3, 10)
    straight = _lrs(sched, opt, 10)
    assert straight == pytest.approx([0.5 * _closed_form_cosine(s, 3, 10, 0.0) for s in range(10)])
    # resuming after 6 steps on a fresh optimizer continues the same curve
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    resumed = dk.lr.warmup_cosine(opt2, 3, 10, last_epoch=5)
    assert _lrs(resumed, opt2, 4) == pytest.approx(straight[6:])


def test_schedules_reject_bad_input():
    with pytest.raises(ValueError, match="warmup_steps"):
        dk.lr.warmup_cosine_factor(-1, 10)
    with pytest.raises(ValueError, match="min_ratio"):
        dk.lr.warmup_cosine_factor(1, 10, min_ratio=2.0)
