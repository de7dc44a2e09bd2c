"""The Linear path of the B/W split against torch's own full backward, bit for bit.

``pipeline/split_linear.py``: F is the plain forward with each ``nn.Linear`` call recorded,
I one ``torch.autograd.grad`` towards the stage inputs and the Linears' output edges (no
parameter reached), W one matmul per Linear into ``.grad``.
"""

import copy

import pytest
import torch
import torch.nn as nn

from dist_kernels.pipeline.split_linear import (
    Recorder,
    Recording,
    backward_input_linear,
    linear_modules,
    record_linears,
    supports,
)

SEED = 20261203


class _Twice(nn.Module):
    """One Linear called twice in a micro-batch: W gets both of its gradients."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class _Unused(nn.Module):
    """A Linear whose output no output uses: no gradient, as in a full backward."""

    def __init__(self):
        super().__init__()
        self.fc, self.side = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        self.side(x)
        return self.fc(x)


def _modules():
    torch.manual_seed(SEED)
    return {
        "mlp": nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)
        ),  # fmt: skip
        "inplace-relu": nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)),
        "no-bias": nn.Sequential(nn.Linear(8, 8, bias=False), nn.GELU(), nn.Linear(8, 8)),
        "twice": _Twice(),
        "unused": _Unused(),
    }


SHAPES = [((5, 8), "2d"), ((3, 4, 8), "3d"), ((2, 3, 2, 8), "4d")]


@pytest.mark.parametrize("name", ["mlp", "inplace-relu", "no-bias", "twice", "unused"])
@pytest.mark.parametrize("shape,layout", SHAPES)
@pytest.mark.parametrize("input_grad", [True, False])  # False: the first stage (data inputs)
def test_linear_halves_equal_the_full_backward(name, shape, layout, input_grad):
    print("seed", SEED)
    reference = _modules()[name]
    split = copy.deepcopy(reference)
    assert supports(split)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(SEED))
    for step in range(2):  # the second accumulates into the first's .grad
        x_ref = x.detach().requires_grad_(input_grad)
        x_split = x.detach().requires_grad_(input_grad)
        out_ref = reference(x_ref)
        recording = Recording()
        with record_linears(linear_modules(split), recording):
            out = split(x_split)
        assert torch.equal(out, out_ref)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED + step))
        out_ref.backward(grad)
        weight = backward_input_linear([out], [grad], [x_split], recording)
        if name == "inplace-relu" and len(shape) > 2:
            # the output is a view (of addmm's result) modified in place: its edge left the
            # graph, so this micro-batch takes the generic split
            assert weight is None
            return
        assert weight is not None
        if input_grad:
            assert torch.equal(x_split.grad, x_ref.grad)
        if step == 0:  # I alone touches no parameter
            assert all(p.grad is None for p in split.parameters())
        weight.run()
        for (pname, a), b in zip(reference.named_parameters(), split.parameters()):
            assert (a.grad is None) == (b.grad is None), pname
            if a.grad is not None:
                assert not b.grad.requires_grad
                assert torch.equal(a.grad, b.grad), (pname, (a.grad - b.grad).abs().max())
    with pytest.raises(RuntimeError, match="has run already"):
        weight.run()
    assert all(not m._forward_hooks for m in linear_modules(split))  # recording undone


def test_w_into_a_held_grad_at_large_micro_batches_is_within_rounding():
    """From the second micro-batch on, W adds each weight gradient into the held ``.grad`` in
    one GEMM (beta = 1; the test above shows the bits of a full backward at small micro-batches).
    Where the BLAS blocks over the rows (1,024 here) the sum's order differs from autograd's
    product-then-add, so both are checked against the same gradients in float64."""
    print("seed", SEED)
    torch.manual_seed(SEED)
    reference = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    split, exact = copy.deepcopy(reference), copy.deepcopy(reference).double()
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(3):
        x, grad = torch.randn(1024, 64, generator=gen), torch.randn(1024, 64, generator=gen)
        reference(x).backward(grad)
        exact(x.double()).backward(grad.double())
        recording = Recording()
        with record_linears(linear_modules(split), recording):
            out = split(x)
        backward_input_linear([out], [grad], [], recording).run()
    params = zip(exact.named_parameters(), reference.parameters(), split.parameters())
    for (name, e), r, p in params:
        scale = e.grad.abs().max().item()
        for got, who in ((p.grad, "split"), (r.grad, "autograd")):
            err = (got.double() - e.grad).abs().max().item()
            assert err <= 1e-5 * scale, (name, who, err, scale)


def test_w_under_autocast_equals_the_full_backward():
    """Under CPU autocast a Linear multiplies its input cast to bfloat16 while the recorded
    input is the float32 one: W casts it the same way (it raised a dtype mismatch before), and
    float32 weights take their bfloat16 products through AccumulateGrad's cast, bit for bit."""
    print("seed", SEED)
    torch.manual_seed(SEED)
    reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    split = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(2):  # the second adds into the first's .grad
        x = torch.randn(4, 8, generator=gen)
        grad = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_ref = reference(x)
            recording = Recording()
            with record_linears(linear_modules(split), recording):
                out = split(x)
        out_ref.backward(grad)
        backward_input_linear([out], [grad], [], recording).run()
    for (name, a), b in zip(reference.named_parameters(), split.parameters()):
        assert b.grad.dtype == torch.float32
        assert torch.equal(a.grad, b.grad), name


def test_recordings_the_path_cannot_split_fall_back():
    """A non-contiguous input of more than 2 dims (F.linear's batched matmul path) or a call
    with a keyword: None, nothing run (the runtime takes the generic split)."""
    model = nn.Sequential(nn.Linear(8, 8))
    for call in (lambda m: m(torch.randn(3, 8, 4).transpose(1, 2)),
                 lambda m: m[0](input=torch.randn(3, 8))):  # fmt: skip
        recording = Recording()
        with record_linears(linear_modules(model), recording):
            out = call(model)
        assert backward_input_linear([out.sum()], None, [], recording) is None
        assert model[0].weight.grad is None


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
    recording = Recording()
    with record_linears(linear_modules(model), recording):
        out = model(x_split)
    weight = backward_input_linear([out.sum()], None, [x_split], recording)
    assert fired == []
    weight.run()
    assert sorted(fired) == sorted([(8,), (8, 8), (8,)])
    assert model[0].weight.grad is None
    assert torch.equal(x_split.grad, x_ref.grad)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def test_an_input_modified_in_place_before_w_raises():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    recording = Recording()
    x = torch.randn(4, 8, requires_grad=True)
    with record_linears(linear_modules(model), recording):
        out = model(x)
    weight = backward_input_linear([out.sum()], None, [x], recording)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        weight.run()


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


def test_recorder_records_only_inside_recording():
    """The runtime's installed-once hooks: idle outside ``recording``, and inside it the same
    gradients as the full backward."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    recorder = Recorder(linear_modules(model))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED))
    model(x)  # outside: nothing recorded, nothing kept
    recording = Recording()
    with recorder.recording(recording):
        out = model(x)
    model(x)
    assert len(recording.calls) == 2
    reference(x).sum().backward()
    backward_input_linear([out.sum()], None, [], recording).run()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    recorder.remove()
    assert all(not m._forward_hooks for m in linear_modules(model))
