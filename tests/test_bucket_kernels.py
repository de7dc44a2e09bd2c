"""Bucket pack / unpack and multi-tensor unscale against torch references.

Every CPU test runs once per instruction-set build this CPU supports (baseline and AVX2: the
shared functor loop; AVX-512: intrinsics); the gpu tier repeats them on a CUDA device.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_kernels.buckets import kernels as bk
from dist_kernels.buckets.plan import plan_buckets

_C = pytest.importorskip("dist_kernels._C")
from dist_kernels import ops  # noqa: E402  (needs the extension)

SEED = 20261130
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (1, 3, 4, 5, 15, 16, 17, 4099)
ISAS = list(ops.supported_cpu_isas())
HAS_CUDA = torch.cuda.is_available() and bk._ext().build_info()["cuda_compiled"]


def _devices():
    cuda = pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")],
    )
    return [*(f"cpu-{isa}" for isa in ISAS), cuda]


@pytest.fixture(params=_devices())
def device(request):
    """Yields 'cpu' (with the named CPU path selected) or 'cuda'."""
    if request.param == "cuda":
        yield "cuda"
        return
    previous = ops.cpu_isa()
    ops.set_cpu_isa(request.param.split("-", 1)[1])
    yield "cpu"
    ops.set_cpu_isa(previous)


def _gen(offset: int = 0) -> torch.Generator:
    print(f"seed {SEED + offset}")
    return torch.Generator().manual_seed(SEED + offset)


def _grads(num: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    sizes = [SIZES[i % len(SIZES)] for i in range(num)]
    return [(torch.randn(n, generator=gen) * 4).to(dtype).to(device) for n in sizes]


def _bucket_for(grads, wire: torch.dtype):
    plan = plan_buckets([g.numel() for g in grads], cap_bytes=1 << 40, dtype=wire)
    (bucket,) = plan.buckets
    return bucket, list(reversed(grads))  # the plan fills in reverse order


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.cpu().view(view)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """Equal bits, except that any NaN equals any NaN (payload and sign carry no meaning)."""
    both_nan = actual.cpu().isnan() & expected.cpu().isnan()
    a, e = _bits(actual), _bits(expected)
    mismatch = ((a != e) & ~both_nan).nonzero()
    assert mismatch.numel() == 0, f"{what}: {mismatch.numel()} mismatches, first at {mismatch[0]}"


@pytest.mark.parametrize("num", [1, 3, 1000])
@pytest.mark.parametrize("grad_dtype,wire", list(itertools.product(DTYPES, DTYPES)))
def test_pack_unpack_bitwise(device, num, grad_dtype, wire):
    gen = _gen(num)
    grads = _grads(num, grad_dtype, device, gen)
    bucket, ordered = _bucket_for(grads, wire)
    flat = torch.full((bucket.numel,), 7.0, dtype=wire, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    scale, unscale = 0.3, 1.7  # not powers of two: rounding is exercised
    bk.pack(ordered, flat, bucket, scale, flag)
    # Element-wise math: the reference runs once on the concatenated tensors.
    grads_cat = torch.cat(ordered)
    pieces = torch.cat([flat[o : o + n] for o, n in zip(bucket.offsets, bucket.counts)])
    _assert_bitwise(pieces, (grads_cat.float() * scale).to(wire), "pack")
    out = [torch.empty_like(g) for g in ordered]
    bk.unpack(flat, out, bucket, unscale, flag)
    _assert_bitwise(torch.cat(out), (pieces.float() * unscale).to(grad_dtype), "unpack")
    acc = [torch.randn(g.numel(), generator=gen).to(grad_dtype).to(device) for g in ordered]
    acc_before = torch.cat(acc)
    bk.unpack(flat, acc, bucket, torch.tensor([unscale], device=device), flag, accumulate=True)
    # fma in float32, rounded once: float64 holds the exact product, so rounding the float64
    # sum to float32 equals the fma (barring a double-rounding tie, odds about 2^-29).
    unscale32 = torch.tensor(unscale, dtype=torch.float32).double()
    exact = acc_before.double() + pieces.double() * unscale32
    _assert_bitwise(torch.cat(acc), exact.float().to(grad_dtype), "unpack accumulate")
    assert flag.item() == 0, "false positive on finite data"


@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.float64])
def test_unpack_sum_of_squares(device, grad_dtype, sum_dtype):
    grads = _grads(11, grad_dtype, device, _gen(1))
    bucket, ordered = _bucket_for(grads, torch.float32)
    flat = torch.randn(bucket.numel, generator=_gen(2)).to(device)
    per_tensor = torch.full((len(ordered),), 0.5, dtype=sum_dtype, device=device)
    total = torch.zeros(1, dtype=sum_dtype, device=device)
    bk.unpack(flat, ordered, bucket, 0.25, sum_squares=per_tensor)
    bk.unpack(flat, ordered, bucket, 0.25, sum_squares=total)
    expected = torch.stack([g.double().pow(2).sum() for g in ordered])
    rtol = 1e-5 if sum_dtype == torch.float32 else 1e-12
    torch.testing.assert_close(per_tensor.double().cpu(), expected.cpu() + 0.5, rtol=rtol, atol=0)
    torch.testing.assert_close(
        total.double().cpu(), expected.sum().reshape(1).cpu(), rtol=rtol, atol=0
    )


def _inject_cases():
    for which_tensor, which_elem, value in itertools.product(
        ("first", "middle", "last"), ("first", "middle", "last"), ("inf", "-inf", "nan")
    ):
        yield which_tensor, which_elem, float(value)


def _position(which: str, n: int) -> int:
    return {"first": 0, "middle": n // 2, "last": n - 1}[which]


@pytest.mark.parametrize(
    "grad_dtype,wire", [(torch.float32, torch.bfloat16), (torch.float16, torch.float16)]
)
def test_nonfinite_caught_everywhere(device, grad_dtype, wire):
    sizes = (17, 4099, 5)
    for which_tensor, which_elem, value in _inject_cases():
        grads = [torch.ones(n, dtype=grad_dtype, device=device) for n in sizes]
        t = _position(which_tensor, len(sizes))
        grads[t][_position(which_elem, sizes[t])] = value
        offsets = [0, 24, 24 + 4104]
        flat = torch.zeros(24 + 4104 + 8, dtype=wire, device=device)
        where = f"{value} at {which_elem} of {which_tensor} tensor"
        for flag_dtype in (torch.int32, torch.float32):
            flag = torch.zeros(1, dtype=flag_dtype, device=device)
            bk.pack(grads, flat, offsets, 1.0, flag)
            assert flag.item() == 1, f"pack missed {where}"
            flag.zero_()
            bk.unpack(flat, [torch.zeros_like(g) for g in grads], offsets, 0.5, flag)
            assert flag.item() == 1, f"unpack missed {where}"
            flag.zero_()
            bk.unscale_(grads, 0.5, flag)
            assert flag.item() == 1, f"unscale_ missed {where}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_false_positive_on_largest_finite(device, dtype):
    largest = torch.finfo(dtype).max
    grads = [torch.full((n,), largest, dtype=dtype, device=device) for n in (1, 17, 4099)]
    grads[1][3] = -largest
    offsets = [0, 8, 32]
    flat = torch.zeros(32 + 4104, dtype=dtype, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    bk.pack(grads, flat, offsets, 1.0, flag)
    bk.unpack(flat, grads, offsets, 1.0, flag)
    bk.unscale_(grads, 1.0, flag)
    assert flag.item() == 0
    assert torch.equal(grads[0].cpu(), torch.full((1,), largest, dtype=dtype))


def test_overflow_into_narrow_wire_dtype_is_flagged(device):
    # float16's largest value is 65504; 65519 rounds down to it, 65520 rounds up to inf.
    flat = torch.zeros(8, dtype=torch.float16, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    bk.pack([torch.tensor([65519.0, -65519.0], device=device)], flat, [0], 1.0, flag)
    assert flag.item() == 0 and flat[0].item() == 65504.0
    bk.pack([torch.tensor([1.0, 65520.0], device=device)], flat, [0], 1.0, flag)
    assert flag.item() == 1 and flat[1].item() == float("inf")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inject", [False, True])
def test_unscale_matches_torch(device, dtype, inject):
    gen = _gen(3)
    tensors = _grads(40, dtype, device, gen)
    if inject:
        tensors[7][2] = float("nan")
    reference = [t.clone() for t in tensors]
    inv_scale = torch.tensor([1.0 / 3000.0], device=device)
    found, found_ref = (torch.zeros(1, device=device) for _ in range(2))
    bk.unscale_(tensors, inv_scale, found)
    torch._amp_foreach_non_finite_check_and_unscale_(reference, found_ref, inv_scale)
    assert found.item() == found_ref.item() == float(inject)
    for t, r in zip(tensors, reference):
        _assert_bitwise(t, r, f"unscale_ {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flag_dtype", [torch.float32, torch.int32])
def test_unscale_of_one_tensor_matches_torch(dtype, flag_dtype):
    """GradScaler's common call, one CPU tensor with a tensor scale and flag (the fast path),
    against torch's kernel, with and without a non-finite value; float16 has no torch CPU
    reference for the flag's dtype, so its values are checked against float64 math."""
    gen = _gen(5)
    for inject in (False, True):
        t = (torch.randn(140_000, generator=gen) * 100).to(dtype)  # split at 2 threads
        if inject:
            t[139_999] = float("inf")
        want = (t.double() * (1 / 1024)).to(dtype)
        found = torch.zeros(1, dtype=flag_dtype)
        bk.unscale_([t], torch.tensor([1 / 1024]), found)
        assert found.item() == int(inject)
        _assert_bitwise(t, want, f"unscale_ of one {dtype} tensor")


def test_unscale_fast_path_leaves_other_calls_to_the_checks():
    """What the fast path does not take still works or raises as before: a parameter, a
    non-contiguous tensor, a scale of the wrong dtype, a flag of the wrong size."""
    inv, found = torch.tensor([0.5]), torch.zeros(1)
    param = torch.nn.Parameter(torch.full((4,), 2.0), requires_grad=False)
    bk.unscale_([param], inv, found)
    assert torch.equal(param.data, torch.ones(4))
    with pytest.raises(ValueError, match="contiguous"):
        bk.unscale_([torch.ones(4, 4).t()], inv, found)
    with pytest.raises(ValueError, match="inv_scale"):
        bk.unscale_([torch.ones(4)], torch.tensor([0.5], dtype=torch.float64), found)
    with pytest.raises(ValueError, match="found_inf"):
        bk.unscale_([torch.ones(4)], inv, torch.zeros(2))
    with pytest.raises(TypeError, match="tensors"):
        bk.unscale_(torch.ones(4), inv, found)


def test_unscale_mixed_dtypes_and_empty(device):
    tensors = [torch.full((5,), 2.0, dtype=d, device=device) for d in DTYPES]
    found = torch.zeros(1, device=device)
    bk.unscale_(tensors, 0.5, found)
    bk.unscale_([], 0.5, found)
    assert all(torch.equal(t.float().cpu(), torch.ones(5)) for t in tensors)
    assert found.item() == 0


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_pack_to_bf16_rounds_subnormals_exactly(device, scale):
    """FP32 gradients of every finite bit pattern, a subnormal in about one vector in
    sixteen, packed into a BF16 bucket: bitwise torch's rounding. The AVX-512 build
    rounds with vcvtneps2bf16 where the CPU has it, which flushes subnormals to zero, so those
    vectors must take the exact rounding."""
    gen = _gen(77)
    n = 4099
    bits = torch.randint(0, 2**31, (3, n), generator=gen, dtype=torch.int64)
    exponent = torch.randint(0, 255, (3, n), generator=gen, dtype=torch.int64)  # never 255
    subnormal = torch.rand(3, n, generator=gen) < 0.004
    exponent = torch.where(subnormal, torch.zeros_like(exponent), exponent)
    sign = torch.randint(0, 2, (3, n), generator=gen, dtype=torch.int64) << 31
    words = sign | (exponent << 23) | (bits & 0x7FFFFF)
    grads = [w.to(torch.int32).view(torch.float32).to(device) for w in words]
    bucket, ordered = _bucket_for(grads, torch.bfloat16)
    flat = torch.zeros(bucket.numel, dtype=torch.bfloat16, device=device)
    bk.pack(ordered, flat, bucket, scale, torch.zeros(1, dtype=torch.int32, device=device))
    pieces = torch.cat([flat[o : o + k] for o, k in zip(bucket.offsets, bucket.counts)])
    want = (torch.cat(ordered) * scale).to(torch.bfloat16)
    assert bool(((torch.cat(ordered) * scale).abs() < 2.0**-126).logical_and(want != 0).any())
    _assert_bitwise(pieces, want, f"pack x{scale}")


def test_threads_split_gives_same_bits():
    gen = _gen(4)
    # ~1M elements each, and lists just past the split threshold (512 KiB touched)
    sizes = [(1 << 20, 3, (1 << 20) + 17, 5), (60_000, 3, 40_001)]
    for shape in sizes:
        _check_split_bits([torch.randn(n, generator=gen) for n in shape])


def _check_split_bits(grads):
    offsets, end = [], 0
    for g in grads:
        offsets.append(end)
        end += (g.numel() + 7) // 8 * 8
    results = []
    for threads in (1, 2, 3):
        flat = torch.zeros(end, dtype=torch.bfloat16)
        sums = torch.zeros(len(grads), dtype=torch.float64)
        bk.pack(grads, flat, offsets, 0.3, num_threads=threads)
        out = [torch.empty_like(g) for g in grads]
        bk.unpack(flat, out, offsets, 2.0, sum_squares=sums, num_threads=threads)
        results.append((flat, out, sums))
    for flat, out, sums in results[1:]:
        assert torch.equal(flat.view(torch.int16), results[0][0].view(torch.int16))
        assert all(torch.equal(a, b) for a, b in zip(out, results[0][1]))
        torch.testing.assert_close(sums, results[0][2], rtol=1e-12, atol=0)


def test_argument_errors():
    g = [torch.ones(4), torch.ones(3)]
    flat = torch.zeros(16)
    with pytest.raises(TypeError, match="grads"):
        bk.pack(torch.ones(4), flat, [0])
    with pytest.raises(TypeError, match="grads"):
        bk.pack([torch.ones(4), 3], flat, [0, 8])
    with pytest.raises(ValueError, match="grads"):
        bk.pack([torch.ones(4), torch.ones(3, dtype=torch.float16)], flat, [0, 8])
    with pytest.raises(ValueError, match="grads"):
        bk.pack([torch.ones(4, 2).t()], flat, [0])
    with pytest.raises(TypeError, match="grads"):
        bk.pack([torch.ones(4, dtype=torch.float64)], flat, [0])
    with pytest.raises(ValueError, match="plan_or_offsets"):
        bk.pack(g, flat, [0])
    with pytest.raises(ValueError, match="outside the bucket"):
        bk.pack(g, flat, [0, 14])
    with pytest.raises(ValueError, match="overlaps"):
        bk.pack(g, flat, [0, 2])
    with pytest.raises(ValueError, match="flag"):
        bk.pack(g, flat, [0, 8], flag=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale"):
        bk.pack(g, flat, [0, 8], scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="scale"):
        bk.pack(g, flat, [0, 8], scale="2")
    with pytest.raises(ValueError, match="sum_squares"):
        bk.unpack(flat, g, [0, 8], sum_squares=torch.zeros(3))
    plan = plan_buckets([4, 3], dtype=torch.float32)
    with pytest.raises(ValueError, match="grads"):
        bk.pack(g, flat, plan.buckets[0])  # slot order is reversed: counts differ
    with pytest.raises(TypeError, match="plan_or_offsets"):
        bk.pack(g, flat, plan)
