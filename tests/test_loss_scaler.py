"""LossScaler against torch.amp.GradScaler and against a plain-Python model of its policy."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import dist_kernels as dk
from dist_kernels.amp.loss_scaler import LossScaler

SEED = 1234


def _param(dtype=torch.float32):
    return torch.nn.Parameter(torch.ones(8, dtype=dtype))


def _run_step(scaler, opt, param, overflow: bool):
    """One iteration: a scaled 'backward' writes scale * 0.25 (or an inf), step, update."""
    scaled_one = scaler.scale(torch.ones((), dtype=torch.float32))
    grad = torch.full_like(param, 0.25) * scaled_one.to(param.dtype)
    if overflow:
        grad[3] = float("inf")
    param.grad = grad
    scaler.step(opt)
    scaler.update()


def _events(seed: int, steps: int = 60, p_overflow: float = 0.3):
    print(f"seed {seed}")
    rng = random.Random(seed)
    return [rng.random() < p_overflow for _ in range(steps)]


def test_trajectory_matches_grad_scaler():
    events = [True, True, False, False, False, False, True] + _events(SEED)
    runs = []
    for make in (
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3),
        lambda: LossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=1, min_scale=0.0),
    ):
        scaler, param = make(), _param()
        opt = torch.optim.SGD([param], lr=0.1)
        trace = []
        for overflow in events:
            _run_step(scaler, opt, param, overflow)
            trace.append(
                (
                    scaler.get_scale(),
                    scaler._get_growth_tracker()
                    if hasattr(scaler, "_get_growth_tracker")
                    else None,
                    param.sum().item(),
                )
            )
        runs.append(trace)
    grad_scaler, loss_scaler = runs
    assert [t[0] for t in loss_scaler] == [t[0] for t in grad_scaler]
    assert [t[2] for t in loss_scaler] == [t[2] for t in grad_scaler]  # same steps skipped
    assert len({t[0] for t in grad_scaler}) > 3  # the sequence both grows and backs off


def _reference_policy(events, init, growth, backoff, interval, hysteresis, min_scale):
    """The documented policy in plain Python: the scale after each iteration."""
    scale, clean, allowance, trace = init, 0, hysteresis, []
    for overflow in events:
        if overflow:
            clean, allowance = 0, allowance - 1
            if allowance <= 0:
                scale = max(scale * backoff, min_scale)
        else:
            clean, allowance = clean + 1, hysteresis
            if clean == interval:
                clean, scale = 0, scale * growth
        trace.append(scale)
    return trace


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("min_scale", [0.0, 2.0**9])
def test_hysteresis_and_min_scale_follow_the_documented_policy(hysteresis, min_scale):
    events = [True] * 6 + [False, True, True, False] + _events(SEED + hysteresis, p_overflow=0.5)
    scaler = LossScaler(
        init_scale=2.0**12,
        growth_interval=4,
        hysteresis=hysteresis,
        min_scale=min_scale,
        on_min_scale="continue",
    )
    param = _param()
    opt = torch.optim.SGD([param], lr=0.1)
    trace = []
    for overflow in events:
        _run_step(scaler, opt, param, overflow)
        trace.append(scaler.get_scale())
    assert trace == _reference_policy(events, 2.0**12, 2.0, 0.5, 4, hysteresis, min_scale)
    assert scaler.skipped_steps == sum(events)
    assert scaler.last_overflow_step == max(i for i, e in enumerate(events) if e)
    if min_scale:
        assert min(trace) == min_scale


def test_on_min_scale_raise_warn_continue():
    for mode in ("raise", "warn", "continue"):
        scaler = LossScaler(init_scale=4.0, min_scale=2.0, on_min_scale=mode)
        param = _param()
        opt = torch.optim.SGD([param], lr=0.1)
        _run_step(scaler, opt, param, True)  # 4 -> 2: backing off still helps
        assert scaler.get_scale() == 2.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "raise":
                with pytest.raises(FloatingPointError, match="min_scale=2.0"):
                    _run_step(scaler, opt, param, True)
            else:
                _run_step(scaler, opt, param, True)
        assert len([w for w in caught if "min_scale" in str(w.message)]) == (mode == "warn")
        assert scaler.get_scale() == 2.0 and scaler.skipped_steps == 2


def test_state_dict_round_trip_and_grad_scaler_state():
    events = _events(SEED + 7, steps=30)
    kwargs = dict(init_scale=2.0**8, growth_interval=2, hysteresis=2, min_scale=4.0)
    first, param = LossScaler(**kwargs), _param()
    opt = torch.optim.SGD([param], lr=0.1)
    for overflow in events[:15]:
        _run_step(first, opt, param, overflow)
    state = first.state_dict()
    second = LossScaler(init_scale=1.0, min_scale=0.5)
    second.load_state_dict(state)
    assert second.state_dict() == state
    param2 = torch.nn.Parameter(param.detach().clone())
    opt2 = torch.optim.SGD([param2], lr=0.1)
    for overflow in events[15:]:
        _run_step(first, opt, param, overflow)
        _run_step(second, opt2, param2, overflow)
        assert first.get_scale() == second.get_scale()
    assert first.state_dict() == second.state_dict()
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    grad_scaler.scale(torch.ones(()))
    third = LossScaler()
    third.load_state_dict(grad_scaler.state_dict())
    assert third.get_scale() == 8.0 and third.get_growth_interval() == 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_are_unscaled(dtype):
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    param = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    grad = (torch.randn(1000, generator=gen) * 100).to(dtype)
    param.grad = grad.clone()
    scaler = LossScaler(init_scale=3.0)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler.unscale_(opt)
    expected = (grad.float() * torch.tensor(1 / 3.0).float()).to(dtype)
    assert torch.equal(param.grad, expected)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


def test_update_stays_on_device(monkeypatch):
    scaler, param = LossScaler(growth_interval=1), _param()
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(torch.ones(()))
    param.grad = torch.ones_like(param)
    scaler.step(opt)

    def no_sync(*args, **kwargs):
        raise AssertionError("update() read a tensor on the host")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    scaler.update()
    monkeypatch.undo()
    assert scaler.get_scale() == 2.0**17


class FakeComm:
    """Stands in for a Communicator: all_reduce(MAX) with one peer holding `peer_flag`."""

    device = torch.device("cpu")

    def __init__(self, peer_flag: float):
        self.peer_flag, self.calls = peer_flag, []

    def all_reduce(self, tensor, op=dk.ReduceOp.SUM):
        self.calls.append(op)
        assert op == dk.ReduceOp.MAX
        tensor.clamp_(min=self.peer_flag)


@pytest.mark.parametrize("peer_flag", [0.0, 1.0])
def test_overflow_on_another_rank_skips_the_step(peer_flag):
    comm = FakeComm(peer_flag)
    scaler, param = LossScaler(init_scale=8.0, comm=comm), _param()
    opt = torch.optim.SGD([param], lr=0.1)
    _run_step(scaler, opt, param, overflow=False)
    assert comm.calls == [dk.ReduceOp.MAX]
    stepped = param.sum().item() != 8.0
    assert stepped == (peer_flag == 0.0)
    assert scaler.skipped_steps == int(peer_flag) and scaler.get_scale() == 8.0 * (
        0.5 if peer_flag else 1.0
    )


@pytest.mark.parametrize("peer_flag", [0.0, 1.0])
def test_a_rank_that_scales_nothing_decides_with_the_others(peer_flag):
    """A pipeline stage before the last never calls scale(): its gradients carry the scale
    through the ones it received. With a comm it unscales, steps and updates all the same,
    from the initial scale, and skips when a peer overflowed."""
    comm = FakeComm(peer_flag)
    scaler, param = LossScaler(init_scale=8.0, comm=comm), _param()
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.full_like(param, 0.25 * 8.0)  # as if backward came from a scaled loss
    scaler.unscale_(opt)
    assert torch.equal(param.grad, torch.full_like(param, 0.25))
    scaler.step(opt)
    scaler.update()
    assert comm.calls == [dk.ReduceOp.MAX]
    assert (param.sum().item() != 8.0) == (peer_flag == 0.0)
    assert scaler.get_scale() == 8.0 * (0.5 if peer_flag else 1.0)
    # without a comm there is no one to decide with: the missing scale() is an error, as in
    # torch's GradScaler
    with pytest.raises(AssertionError, match="scale is not initialised"):
        LossScaler(init_scale=8.0).unscale_(opt)


def test_disabled_is_a_pass_through():
    scaler, param = LossScaler(enabled=False), _param()
    opt = torch.optim.SGD([param], lr=1.0)
    loss = torch.ones(())
    assert scaler.scale(loss) is loss
    param.grad = torch.ones_like(param)
    scaler.step(opt)
    scaler.update()
    assert param.sum().item() == 0.0 and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_argument_errors():
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="hysteresis"):
        LossScaler(hysteresis=0)
    with pytest.raises(ValueError, match="on_min_scale"):
        LossScaler(on_min_scale="explode")
    with pytest.raises(ValueError, match="min_scale"):
        LossScaler(init_scale=1.0, min_scale=2.0)
    with pytest.raises(AssertionError, match="scale"):
        LossScaler().update()


def _train(dtype, use_scaler: bool, steps: int = 150):
    torch.manual_seed(SEED)
    x = torch.randn(256, 16)
    y = torch.sin(x @ torch.randn(16, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**16, growth_interval=20, enabled=use_scaler)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses, scaler


def test_fp16_training_follows_fp32():
    """FP16 weights and gradients with LossScaler track the FP32 run.

    Tolerance: the mean loss over the last 20 of 150 steps within 5% (relative) of FP32's
    (seen: 0.3816 vs 0.3804, FP32 falling from 0.595); the early steps that overflow at scale
    2^16 are skipped (2 here).
    """
    print(f"seed {SEED}")
    fp32, _ = _train(torch.float32, use_scaler=False)
    fp16, scaler = _train(torch.float16, use_scaler=True)
    tail32, tail16 = sum(fp32[-20:]) / 20, sum(fp16[-20:]) / 20
    assert tail32 < 0.7 * fp32[0], "the reference run did not learn"
    assert abs(tail16 - tail32) <= 0.05 * tail32, (tail16, tail32)
    assert scaler.skipped_steps > 0  # the scaler had to back off from 2^16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trajectory_matches_cpu():
    """On the device the policy runs as tensor ops; it must give the CPU run's trajectory."""
    events = _events(SEED + 11, steps=40, p_overflow=0.4)
    traces = []
    for device in ("cpu", "cuda"):
        scaler = LossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=0.0)
        param = torch.nn.Parameter(torch.ones(8, dtype=torch.float16, device=device))
        opt = torch.optim.SGD([param], lr=0.1)
        trace = []
        for overflow in events:
            _run_step(scaler, opt, param, overflow)
            trace.append((scaler.get_scale(), param.float().sum().item()))
        traces.append(trace)
    assert traces[0] == traces[1]


def _two_rank_overflow(overflow_ranks_per_step):
    """Runs on every rank: LossScaler over a real Communicator; rank r overflows at step s when
    r is in overflow_ranks_per_step[s]. Returns (scales, parameter sums, skipped steps)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    scales, sums = [], []
    with dk.Communicator() as comm:
        scaler = LossScaler(init_scale=8.0, growth_interval=2, comm=comm)
        param = _param(torch.float16)
        opt = torch.optim.SGD([param], lr=0.5)
        for overflow_ranks in overflow_ranks_per_step:
            _run_step(scaler, opt, param, overflow=rank in overflow_ranks)
            scales.append(scaler.get_scale())
            sums.append(param.float().sum().item())
    return scales, sums, scaler.skipped_steps


def test_overflow_on_one_rank_skips_every_rank():
    from mp_pool import run_ranks, shm_leaks

    schedule = [(), (1,), (), (0, 1), (0,), (), ()]
    results = run_ranks(2, _two_rank_overflow, schedule, timeout=120)
    assert results[0] == results[1], results  # replicas stay identical
    scales, sums, skipped = results[0]
    assert skipped == 3
    # Steps with an overflow anywhere leave the parameters alone on both ranks.
    for step, overflow_ranks in enumerate(schedule):
        before = sums[step - 1] if step else 8.0
        assert (sums[step] == before) == bool(overflow_ranks), (step, sums)
    assert scales == _reference_policy([bool(o) for o in schedule], 8.0, 2.0, 0.5, 2, 1, 1.0)
    assert shm_leaks() == []


def _engine_step(scaler, opts, params, overflow: bool, how: str) -> None:
    """A step whose gradients an "engine" unscales itself and hands over with mark_unscaled."""
    scaled_one = scaler.scale(torch.ones((), dtype=torch.float32))
    for param in params:
        param.grad = torch.full_like(param, 0.25) * scaled_one
        if overflow:
            param.grad[3] = float("inf")
    if how == "unscale_":  # the reference: GradScaler's own unscale_ inside step
        pass
    else:
        found = torch.zeros(1)
        for param in params:  # what an engine does in its own pass
            found.fill_(max(found.item(), float(not bool(param.grad.isfinite().all()))))
            param.grad.mul_(1.0 / scaler.get_scale())
        if how == "mark_all":
            scaler.mark_unscaled(found)
        else:  # one call per optimizer, the flag as a bool
            for opt in opts:
                scaler.mark_unscaled(bool(found.item()), optimizer=opt)
    for opt in opts:
        scaler.step(opt)
    scaler.update()


def test_mark_unscaled_follows_unscale_():
    """Trajectory (scale, skipped steps, parameters) equals the one of scaler.unscale_."""
    events = [True, False, False, True, True] + _events(SEED + 11, steps=30)
    runs = {}
    for how in ("unscale_", "mark_all", "mark_each"):
        scaler = LossScaler(init_scale=2.0**10, growth_interval=2, hysteresis=2)
        params = [_param(), _param()]
        opts = [torch.optim.SGD([p], lr=0.1) for p in params]
        trace = []
        for overflow in events:
            _engine_step(scaler, opts, params, overflow, how)
            trace.append((scaler.get_scale(), [p.sum().item() for p in params]))
        runs[how] = (trace, scaler.skipped_steps)
    assert runs["mark_all"] == runs["unscale_"] == runs["mark_each"]
    assert runs["unscale_"][1] > 0 and len({t[0] for t in runs["unscale_"][0]}) > 2


def test_mark_unscaled_refuses_unscaling_twice():
    scaler = LossScaler(init_scale=8.0)
    param = _param()
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = scaler.scale(torch.ones(8))
    scaler.mark_unscaled(torch.zeros(()))
    with pytest.raises(RuntimeError, match="already unscaled through mark_unscaled"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already unscaled since the last update"):
        scaler.mark_unscaled(False)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already stepped since the last update"):
        scaler.mark_unscaled(False, optimizer=opt)
    scaler.update()
    scaler.unscale_(opt)  # a new step: unscale_ is allowed again
    with pytest.raises(RuntimeError, match="already unscaled since the last update"):
        scaler.mark_unscaled(False, optimizer=opt)
    with pytest.raises(ValueError, match="found_inf: expected a one-element tensor"):
        scaler.mark_unscaled(torch.zeros(2))
    with pytest.raises(TypeError, match="found_inf: expected a bool"):
        scaler.mark_unscaled("no")
    LossScaler(enabled=False).mark_unscaled(True)  # disabled: a pass-through
