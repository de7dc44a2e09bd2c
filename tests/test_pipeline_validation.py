"""Post-validation of the optimizer step: rolled back bitwise on a failed check."""

import pytest
import torch
import torch.nn as nn
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.pipeline import ValidatedOptimizer

SEED = 20261202
WIDTH = 6


def _model(dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()).to(
        dtype
    )


def _backward(model, scale=1.0):
    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(8, WIDTH, generator=gen, dtype=next(model.parameters()).dtype)
    (model(x).square().sum() * scale).backward()


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for i, p in enumerate(model.parameters())
        if p in opt.state
    }
    return params, state


def _same(a, b) -> bool:
    params_a, state_a = a
    params_b, state_b = b
    if not all(torch.equal(x, y) for x, y in zip(params_a, params_b)):
        return False
    if sorted(state_a) != sorted(state_b):
        return False
    for i in state_a:
        if sorted(state_a[i]) != sorted(state_b[i]):
            return False
        for k, v in state_a[i].items():
            w = state_b[i][k]
            if torch.is_tensor(v) and not torch.equal(v, w):
                return False
    return True


@pytest.mark.parametrize("first_step", [True, False])
def test_non_finite_gradient_rolls_back_bitwise(first_step):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = ValidatedOptimizer(opt, None)
    if not first_step:  # the optimizer has state the undone step must restore
        _backward(model)
        assert step.step() and not step.rolled_back
        step.zero_grad()
    before = _snapshot(model, opt)
    _backward(model)
    model[2].weight.grad[1, 3] = float("nan")
    assert step.step() is False
    assert step.found_inf and step.rolled_back
    assert _same(before, _snapshot(model, opt))


def test_clipping_post_equals_pre_and_torch():
    """Post-validation rolls back and redoes a step whose norm is too large: bitwise what the
    pre-validated order gives, and torch's clip_grad_norm_ then step (FP64: the norms are
    summed in another order, so within rounding)."""
    results = {}
    for post in (True, False):
        model = _model(torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = ValidatedOptimizer(opt, None, max_norm=0.5, post_validation=post)
        _backward(model, scale=10.0)
        assert step.step() and step.rolled_back == post and step.grad_norm > 0.5
        results[post] = [p.detach().clone() for p in model.parameters()]
    reference = _model(torch.float64)
    _backward(reference, scale=10.0)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    for a, b in zip(results[True], reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        ValidatedOptimizer(torch.optim.SGD(_model().parameters(), lr=1), None, max_norm=0)


def _rank_pipeline_rollback():
    """pp = 2: rank 1's gradient turns NaN; both ranks' steps roll back (the verdict is
    global). Then a clipped step, post- and pre-validated, against the whole model's."""
    comm = dk.Communicator()
    out = {}
    for post in (True, False):
        model = _model()
        pipe = dk.Pipeline(model, comm, n_microbatches=2, loss_fn=nn.functional.mse_loss,
                           print_partition=False)  # fmt: skip
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        step = ValidatedOptimizer(opt, pipe.comm, max_norm=0.05, post_validation=post)
        gen = torch.Generator().manual_seed(SEED)
        x, y = torch.randn(2, 8, WIDTH, generator=gen), torch.randn(2, 8, WIDTH, generator=gen)
        pipe.step(x[0], y[0])
        applied = step.step()
        norm = step.grad_norm
        step.zero_grad()
        before = _snapshot(pipe.stage_module, opt)
        pipe.step(x[1], y[1])
        if comm.rank == 1:
            next(pipe.parameters()).grad[0, 0] = float("nan")
        skipped = not step.step()
        out[post] = (applied, norm, skipped, step.found_inf,
                     _same(before, _snapshot(pipe.stage_module, opt)),
                     [p.detach().clone() for p in pipe.parameters()])  # fmt: skip
    comm.close()
    return out


def test_pipeline_rollback_on_every_rank():
    print("seed", SEED)
    results = run_ranks(2, _rank_pipeline_rollback, timeout=120)
    reference = _model()
    gen = torch.Generator().manual_seed(SEED)
    x, y = torch.randn(2, 8, WIDTH, generator=gen), torch.randn(2, 8, WIDTH, generator=gen)
    opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    loss = sum(
        nn.functional.mse_loss(reference(xm), ym) / 2
        for xm, ym in zip(x[0].chunk(2), y[0].chunk(2))
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item()
    opt.step()
    for rank, out in enumerate(results):
        for post, (applied, got_norm, skipped, found_inf, restored, _) in out.items():
            print(f"rank {rank} post={post}: norm {got_norm:.6f} (torch {norm:.6f}), "
                  f"skipped {skipped}, restored bitwise {restored}")  # fmt: skip
            assert applied and skipped and found_inf and restored
            assert got_norm == pytest.approx(norm, rel=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(out[True][5], out[False][5]))
        mine = list(reference[2 * rank].parameters())  # stage r: children 2r and 2r + 1
        assert len(mine) == len(out[True][5]) == 2
        for a, b in zip(out[True][5], mine):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
