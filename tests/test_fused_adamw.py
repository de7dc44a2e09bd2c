"""dk.optim.FusedAdamW against torch.optim.AdamW (the reference) over many steps."""

from __future__ import annotations

import pytest
import torch

from dist_kernels.optim import FusedAdamW

SEED = 1234
STEPS = 60


def _params(shapes, dtype=torch.float32, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(SEED + 1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _run(opt_cls, params, steps=STEPS, grad_scale=1.0, **kwargs):
    opt = opt_cls(params, **kwargs)
    for step in range(steps):
        for p, g in zip(params, _grads(params, step, scale=1.0 / grad_scale)):
            p.grad = g
        if grad_scale != 1.0:
            opt.step(grad_scale=grad_scale)
        else:
            opt.step()
    return opt


def _max_rel(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


SHAPES = [(7,), (33, 5), (1,), (4, 4, 3), (1025,)]
CASES = [
    {},
    {"lr": 3e-3, "weight_decay": 0.1},
    {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
    {"maximize": True},
    {"amsgrad": True, "weight_decay": 0.05},
    {"betas": (0.6, 0.99)},  # lerp weight >= 0.5 takes torch's other branch
]


@pytest.mark.parametrize("kwargs", CASES, ids=[str(c) for c in CASES])
def test_matches_torch_adamw_fp32(kwargs):
    print(f"seed {SEED}, {STEPS} steps, {kwargs}")
    ours, ref = _params(SHAPES), _params(SHAPES)
    _run(FusedAdamW, ours, **kwargs)
    _run(torch.optim.AdamW, ref, **kwargs)
    err = _max_rel(ours, ref)
    print(f"max relative difference {err:.3e}")
    assert err < 1e-5


def _moments_and_params_rel_diff(opt, params, ref_opt, ref):
    """Max relative difference of exp_avg, exp_avg_sq and the parameters."""
    pairs = [(opt.state[p][k], ref_opt.state[r][k]) for p, r in zip(params, ref)
             for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    return max(_max_rel(*zip(*pairs)), _max_rel(params, ref))


def _scaled_run(grad_scale, steps=3):
    """FusedAdamW fed 1024x gradients, stepping with ``grad_scale``, against torch AdamW fed
    the true gradients; returns the max relative difference of moments and parameters."""
    ours, ref = _params(SHAPES), _params(SHAPES)
    opt, ref_opt = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    for step in range(steps):
        for p, r, g in zip(ours, ref, _grads(ours, step)):
            p.grad, r.grad = g * 1024, g  # a power of two: the scaled gradient is exact
        opt.step(grad_scale=grad_scale)
        ref_opt.step()
    return _moments_and_params_rel_diff(opt, ours, ref_opt, ref)


def test_grad_scale_unscales_inside_the_kernel():
    """Adam's update hardly changes when every gradient is scaled by a constant, so the
    parameters alone cannot show a missing unscale: the stored moments can (exp_avg scales
    with the gradient, exp_avg_sq with its square)."""
    err = _scaled_run(grad_scale=1.0 / 1024)  # gradients arrive 1024x larger
    print(f"seed {SEED}: moments and parameters, max relative difference {err:.3e}")
    assert err < 1e-5


def test_grad_scale_check_rejects_a_missing_unscale():
    """The same check on a run that does not unscale (grad_scale left at 1) fails it."""
    err = _scaled_run(grad_scale=1.0)
    print(f"without unscaling: max relative difference {err:.3e}")
    assert err > 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_with_master_weights_follow_fp32(dtype):
    """The FP32 master follows an FP32 torch run fed the same (16-bit) gradients."""
    ours = _params(SHAPES, dtype)
    ref = [p.detach().float().requires_grad_() for p in ours]
    opt = FusedAdamW(ours, master_weights=True, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, weight_decay=0.1)
    for step in range(STEPS):
        for p, r, g in zip(ours, ref, _grads(ours, step)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    masters = [opt.state[p]["master"] for p in ours]
    err = _max_rel(masters, ref)
    print(f"{dtype}: master vs fp32 reference, max relative difference {err:.3e}")
    assert err < 1e-5
    for p, m in zip(ours, masters):
        assert torch.equal(p, m.to(dtype)), "the parameter is its master rounded once"
        assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_round_every_step(dtype):
    """Without master weights: FP32 math on the rounded parameter, rounded again (float64 ref)."""
    ours = _params(SHAPES, dtype)
    ref = [p.detach().double() for p in ours]
    m = [torch.zeros_like(r) for r in ref]
    v = [torch.zeros_like(r) for r in ref]
    opt = FusedAdamW(ours, lr=1e-2)
    for step in range(1, 21):
        grads = _grads(ours, step)
        for p, g in zip(ours, grads):
            p.grad = g
        opt.step()
        for i, g in enumerate(grads):
            g64 = g.double()
            ref[i] = ref[i] * (1 - 1e-2 * 1e-2)
            m[i] = 0.9 * m[i] + 0.1 * g64
            v[i] = 0.999 * v[i] + 0.001 * g64 * g64
            denom = (v[i] / (1 - 0.999**step)).sqrt() + 1e-8
            ref[i] = (ref[i] - 1e-2 / (1 - 0.9**step) * m[i] / denom).to(dtype).double()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for p, r in zip(ours, ref):
        # a value within half an ULP of a rounding boundary may round either way
        assert ((p.double() - r).abs() <= ulp * r.abs().clamp_min(1e-3)).all()


# Sizes around every vector width (4, 8, 16 floats) and their tails, and one large enough that
# a forced split cuts it inside a tensor
ISA_SHAPES = [(1,), (3,), (4,), (15,), (16,), (17,), (33, 5), (8, 8), (4099,)]
ISA_CASES = [
    (torch.float32, {}),
    (torch.float32, {"amsgrad": True, "weight_decay": 0.05, "maximize": True}),
    (torch.bfloat16, {"master_weights": True, "weight_decay": 0.1}),
    (torch.float16, {}),
]


def _isa_run(dtype, kwargs, isa, split):
    """Parameters and moments after 5 steps with the CPU kernel of ``isa``, the elements cut
    into threads' slices (every call split) or not (none)."""
    from dist_kernels import _C, ops

    previous_isa = ops.cpu_isa()
    previous_min = _C.kernels_set_cpu_parallel_min_bytes(0 if split else 1 << 62)
    ops.set_cpu_isa(isa)
    try:
        params = _params(ISA_SHAPES, dtype)
        opt = _run(FusedAdamW, params, steps=5, lr=1e-2, **kwargs)
    finally:
        ops.set_cpu_isa(previous_isa)
        _C.kernels_set_cpu_parallel_min_bytes(previous_min)
    return params + [t for p in params for _, t in sorted(opt.state[p].items()) if t.dim()]


@pytest.mark.parametrize("dtype,kwargs", ISA_CASES, ids=[f"{d}-{k}" for d, k in ISA_CASES])
def test_every_instruction_set_and_thread_split_gives_the_same_bits(dtype, kwargs):
    """The SSE, AVX2 and AVX-512 loops, one thread or the elements split over threads
    (slices cutting tensors anywhere): bitwise the same parameters. Replicas of a DDP run
    update their parameters on their own, so a bit that depended on the CPU would split them
    on a cluster of mixed machines (the ISA builds are compiled without FMA contraction)."""
    from dist_kernels import ops

    print(f"seed {SEED}; instruction sets here: {ops.supported_cpu_isas()}")
    want = _isa_run(dtype, kwargs, "baseline", split=False)
    # the reference is right, not only self-consistent: fp32 against torch's AdamW
    if dtype == torch.float32 and not kwargs:
        ref = _params(ISA_SHAPES)
        _run(torch.optim.AdamW, ref, steps=5, lr=1e-2)
        assert _max_rel(want[: len(ref)], ref) < 1e-5
    for isa in ops.supported_cpu_isas():
        for split in (False, True):
            got = _isa_run(dtype, kwargs, isa, split)
            assert len(got) == len(want) > len(ISA_SHAPES)  # parameters, then the moments
            for a, b in zip(got, want):
                assert torch.equal(a, b), (isa, split, a.shape)


def test_state_dict_round_trips_with_torch():
    """torch AdamW -> FusedAdamW -> torch AdamW: continuing gives the uninterrupted result."""
    ref, ours = _params(SHAPES), _params(SHAPES)
    ref_opt = _run(torch.optim.AdamW, ref, steps=10, weight_decay=0.1)
    _run(torch.optim.AdamW, ours, steps=10, weight_decay=0.1)
    fused = FusedAdamW(ours, weight_decay=0.1)
    fused.load_state_dict(ref_opt.state_dict())
    assert fused.state[ours[0]]["step"].item() == 10
    for step in range(10, 20):
        for p, r, g in zip(ours, ref, _grads(ours, step)):
            p.grad, r.grad = g, g.clone()
        fused.step()
        ref_opt.step()
    back = torch.optim.AdamW(ours, weight_decay=0.1)
    back.load_state_dict(fused.state_dict())
    for step in range(20, 25):
        for p, r, g in zip(ours, ref, _grads(ours, step)):
            p.grad, r.grad = g, g.clone()
        back.step()
        ref_opt.step()
    err = _max_rel(ours, ref)
    print(f"max relative difference after 25 steps across two loads {err:.3e}")
    assert err < 1e-5


def test_skips_params_without_grad_and_rejects_bad_input():
    a, b = _params([(3,), (4,)])
    before = b.detach().clone()
    opt = FusedAdamW([a, b])
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state
    with pytest.raises(ValueError, match="lr"):
        FusedAdamW([a], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW([a], betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="params"):
        FusedAdamW([torch.zeros(3, dtype=torch.int32)])


def test_non_contiguous_param_is_updated():
    base = _params([(6, 4)])[0]
    ref = base.detach().clone().t().contiguous().requires_grad_()
    p = torch.nn.Parameter(base.detach().clone().t())  # a transposed (non-contiguous) view
    assert not p.is_contiguous()
    _run(FusedAdamW, [p], steps=5)
    _run(torch.optim.AdamW, [ref], steps=5)
    assert _max_rel([p], [ref]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_the_cpu_kernel(dtype):
    """The CUDA kernel runs the same functor: its result equals the CPU kernel's to rounding."""
    import dist_kernels

    if not dist_kernels.build_info()["cuda_compiled"]:
        pytest.skip("this build has no CUDA kernels")
    cpu = _params(SHAPES, dtype)
    gpu = [p.detach().cuda().requires_grad_() for p in cpu]
    cpu_opt = FusedAdamW(cpu, weight_decay=0.1, amsgrad=True, master_weights=True)
    gpu_opt = FusedAdamW(gpu, weight_decay=0.1, amsgrad=True, master_weights=True)
    for step in range(20):
        for p, q, g in zip(cpu, gpu, _grads(cpu, step)):
            p.grad, q.grad = g, g.cuda()
        cpu_opt.step()
        gpu_opt.step()
    torch.cuda.synchronize()
    err = _max_rel([q.cpu().float() for q in gpu], [p.float() for p in cpu])
    print(f"{dtype}: CUDA vs CPU max relative difference {err:.3e}")
    assert err < 1e-5 if dtype == torch.float32 else err <= 2.0**-7
