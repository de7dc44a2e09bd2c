"""The Linear path of the B/W split against torch's own full backward, bit for bit.

``pipeline/split_linear.py``: F runs each plain ``nn.Linear`` through a Function that defers its
weight gradient, I is one ordinary backward (input gradients only, the Linears' inputs and
output gradients stashed), W one matmul per Linear into ``.grad``.
"""

import copy

import pytest
import torch
import torch.nn as nn

from dist_kernels.pipeline.split_linear import (
    LinearWeightGradient,
    deferred_linears,
    linear_modules,
    supports,
)

SEED = 20261203


class _Twice(nn.Module):
    """One Linear used twice in a micro-batch: W gets both of its gradients."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


def _modules():
    torch.manual_seed(SEED)
    return {
        "mlp": nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)
        ),  # fmt: skip
        "no-bias": nn.Sequential(nn.Linear(8, 8, bias=False), nn.GELU(), nn.Linear(8, 8)),
        "twice": _Twice(),
    }


def _input(shape, layout):
    gen = torch.Generator().manual_seed(SEED)
    if layout == "transposed":  # a non-contiguous input of more than 2 dims
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen).transpose(-1, -2)
    return torch.randn(*shape, generator=gen)


SHAPES = [((5, 8), "2d"), ((3, 4, 8), "3d"), ((3, 8, 8), "transposed"), ((2, 3, 2, 8), "4d")]


@pytest.mark.parametrize("name", ["mlp", "no-bias", "twice"])
@pytest.mark.parametrize("shape,layout", SHAPES)
@pytest.mark.parametrize("input_grad", [True, False])  # False: the first stage (data inputs)
def test_linear_halves_equal_the_full_backward(name, shape, layout, input_grad):
    print("seed", SEED)
    reference = _modules()[name]
    split = copy.deepcopy(reference)
    assert supports(split)
    x = _input(shape, layout)
    for step in range(2):  # the second accumulates into the first's .grad
        x_ref = x.detach().requires_grad_(input_grad)
        x_split = x.detach().requires_grad_(input_grad)
        out_ref = reference(x_ref)
        stash = []
        with deferred_linears(linear_modules(split), stash):
            out = split(x_split)
        assert torch.equal(out, out_ref)  # F: the same forward
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED + step))
        out_ref.backward(grad)
        out.backward(grad)  # I: a plain backward, no parameter reached
        if input_grad:
            assert torch.equal(x_split.grad, x_ref.grad)
        if step == 0:
            assert all(p.grad is None for p in split.parameters())
        assert len(stash) == sum(1 for _ in _linear_calls(name))
        weight = LinearWeightGradient(stash)
        weight.run()
        for (pname, a), b in zip(reference.named_parameters(), split.parameters()):
            assert torch.equal(a.grad, b.grad), (pname, (a.grad - b.grad).abs().max())
    with pytest.raises(RuntimeError, match="has run already"):
        weight.run()
    assert "forward" not in vars(split.fc if name == "twice" else split[0])  # patch undone


def _linear_calls(name):
    return range({"mlp": 3, "no-bias": 2, "twice": 2}[name])


def test_hooks_fire_in_w_once_each_and_frozen_parameters_stay_untouched():
    """Post-accumulate-grad hooks fire in W (one backward call), not in I; a frozen weight
    gets no gradient while its Linear's input gradient and bias gradient are still right."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0].weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    fired = []
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: fired.append(tuple(p.shape)))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED))
    x_ref, x_split = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    stash = []
    with deferred_linears(linear_modules(model), stash):
        out = model(x_split)
    out.sum().backward()
    assert fired == []
    LinearWeightGradient(stash).run()
    assert sorted(fired) == sorted([(8,), (8, 8), (8,)])
    assert model[0].weight.grad is None
    assert torch.equal(x_split.grad, x_ref.grad)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def test_supports_only_stages_of_plain_linears():
    class MyLinear(nn.Linear):  # a subclass may change forward: not taken
        pass

    assert supports(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert not supports(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    assert not supports(nn.Sequential(MyLinear(4, 4)))
    assert not supports(nn.Sequential(nn.ReLU()))  # nothing to split
    frozen = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    frozen[1].requires_grad_(False)
    assert supports(frozen)  # only trainable parameters count
