"""The B/W split of one stage's backward against torch's own full backward, bit for bit."""

import copy

import pytest
import torch
import torch.nn as nn

from dist_kernels.pipeline.split import backward_input, parameter_nodes

SEED = 20261202


class _SharedWeight(nn.Module):
    """One Linear used twice on the input path, and a second output from a parameter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.fc(torch.relu(self.fc(x)))
        return h + self.b, (self.b * 2).sum() + h.mean()


class _OffPath(nn.Module):
    """A parameter whose branch never meets the input path, and one no output uses."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.c = nn.Parameter(torch.randn(8))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.fc(x) + self.c.exp()


def _modules():
    torch.manual_seed(SEED)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    norm = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8))
    return {"mlp": mlp, "layernorm": norm, "shared": _SharedWeight(), "off-path": _OffPath()}


def _outputs(module, x):
    out = module(x)
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", ["mlp", "layernorm", "shared", "off-path"])
@pytest.mark.parametrize("input_grad", [True, False])  # False: the first stage (data inputs)
@pytest.mark.parametrize("one_backward", [False, True])  # True: W in one call (under DDP)
def test_halves_equal_the_full_backward(name, input_grad, one_backward):
    print("seed", SEED)
    reference = _modules()[name]
    split = copy.deepcopy(reference)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(SEED))
    for step in range(2):  # the second accumulates into the first's .grad
        x_ref = x.detach().requires_grad_(input_grad)
        x_split = x.detach().requires_grad_(input_grad)
        outs_ref, outs = _outputs(reference, x_ref), _outputs(split, x_split)
        grads = [torch.randn_like(o) for o in outs_ref]
        torch.autograd.backward(outs_ref, grads)
        weight = backward_input(outs, grads, [x_split], parameter_nodes(list(split.parameters())))
        if input_grad:
            assert torch.equal(x_split.grad, x_ref.grad)
        if step == 0:  # I alone touches no parameter
            assert all(p.grad is None for p in split.parameters())
        weight.run(one_backward=one_backward)
        for (pname, a), b in zip(reference.named_parameters(), split.parameters()):
            assert (a.grad is None) == (b.grad is None), pname
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad), (pname, (a.grad - b.grad).abs().max())
    with pytest.raises(RuntimeError, match="has run already"):
        weight.run()


def test_integer_inputs_and_hooks_fire_in_w():
    """An embedding's ids have no gradient (W is the whole backward); parameters' post-
    accumulate-grad hooks fire in W, once each, as in a full backward."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p.shape))
    ids = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(SEED))
    out, out_ref = model(ids), reference(ids)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    weight = backward_input([out], [grad], [ids], parameter_nodes(list(model.parameters())))
    assert fired == []
    weight.run()
    assert sorted(fired) == sorted(p.shape for p in model.parameters())
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_w_does_not_run_the_input_path_again():
    """W computes weight gradients only: with the input path's nodes counted, none runs in W."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8).requires_grad_(True)
    out = model(x)
    relus = []
    node = out.grad_fn
    while node is not None:  # ReluBackward -> AddmmBackward -> ReluBackward ...
        if "Relu" in node.name():
            relus.append(node)
        node = next((n for n, _ in node.next_functions if n is not None and "Accumulate"
                     not in n.name() and "TBackward" not in n.name()), None)  # fmt: skip
    runs = []
    for relu in relus:
        relu.register_prehook(lambda g: runs.append(1))
    weight = backward_input(
        [out], [torch.ones_like(out)], [x], parameter_nodes(list(model.parameters()))
    )
    assert len(runs) == len(relus) == 2  # I ran the input path once
    weight.run()
    assert len(runs) == 2  # W did not
