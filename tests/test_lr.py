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


def _torch_warmup_then_linear(opt, warmup, total, m):
    """torch's own schedulers: LinearLR warm-up from 1 / W to 1 over W - 1 steps, then
    LinearLR from 1 to m over T - W steps (SequentialLR, torch's chained arithmetic)."""
    warm = torch.optim.lr_scheduler.LinearLR(opt, 1 / warmup, 1.0, total_iters=warmup - 1)
    down = torch.optim.lr_scheduler.LinearLR(opt, 1.0, m, total_iters=total - warmup)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, down], milestones=[warmup])


def test_warmup_linear_matches_torchs_linear_schedulers():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    reference = _lrs(_torch_warmup_then_linear(opt, 4, 20, 0.1), opt, 26)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    ours = _lrs(dk.lr.warmup_linear(opt2, 4, 20, min_ratio=0.1), opt2, 26)
    assert ours == pytest.approx(reference, rel=1e-12)
    assert ours[20] == pytest.approx(0.05) and ours[25] == pytest.approx(0.05)  # held at m


def _closed_form_wsd(s, warmup, total, decay, m, style):
    """Warm-up, stable, decay as Hu et al. (2024) define it, the tail's shapes Megatron's."""
    if s < warmup:
        return (s + 1) / warmup
    if s < total - decay:
        return 1.0
    q = min(1.0, (s - (total - decay)) / decay)
    shape = {"linear": 1 - q, "cosine": (1 + math.cos(math.pi * q)) / 2,
             "minus_sqrt": 1 - math.sqrt(q), "exponential": 2 * 0.5**q - 1}[style]  # fmt: skip
    return m + (1 - m) * shape


@pytest.mark.parametrize("style", dk.lr.WSD_STYLES)
def test_warmup_stable_decay_matches_its_definition(style):
    f = dk.lr.warmup_stable_decay_factor(3, 20, 5, min_ratio=0.1, style=style)
    for s in range(25):
        want = _closed_form_wsd(s, 3, 20, 5, 0.1, style)
        assert f(s) == pytest.approx(want, abs=1e-15), (style, s)
    assert [f(s) for s in range(3, 16)] == [1.0] * 13  # stable until the last 5 steps
    assert f(15) == 1.0 and f(16) < 1.0 and f(20) == pytest.approx(0.1)
    if style == "cosine":  # the tail is torch's cosine annealing over the decay steps
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=0.1)
        torch_tail = _lrs(cos, opt, 6)
        assert [f(s) for s in range(15, 21)] == pytest.approx(torch_tail, rel=1e-12)


def test_warmup_stable_decay_rejects_bad_input():
    with pytest.raises(ValueError, match=r"style must be one of"):
        dk.lr.warmup_stable_decay_factor(1, 10, 2, style="step")
    with pytest.raises(ValueError, match=r"decay_steps\(10\) must be in \[1, total_steps\(10\) - "):
        dk.lr.warmup_stable_decay_factor(1, 10, 10)
    with pytest.raises(ValueError, match="min_ratio"):
        dk.lr.warmup_linear_factor(1, 10, min_ratio=-0.5)
