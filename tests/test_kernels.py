"""dist_kernels.ops against torch: reduce, divide and cast-with-scale on every compiled CPU path.

References: torch ops in float64 for floats (exact torch ops in the dtype for integers, which
wrap like ours); casts bit-exact against ``(src.float() * scale).to(dtype)``. Inputs are random
with a printed seed (set ``DK_TEST_SEED`` to replay one).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from dist_kernels import _C, ReduceOp, ops
from dist_kernels.dtypes import dtype_code

SEED = int(os.environ.get("DK_TEST_SEED", "20261130"))
print(f"test_kernels: seed {SEED} (set DK_TEST_SEED to replay)")

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64, torch.int8, torch.uint8)
HALVES = (torch.float16, torch.bfloat16)
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (0, 1, 7, 1023, 4099, 2**20 + 5)
ALL_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG)


def _gen(*salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + 7919 * hash(salt) % 1_000_003)


@pytest.fixture(autouse=True, scope="module")
def pool_from_one_mib():
    """Sets the thread pool's threshold (512 KiB on torch's OpenMP runtime, 64 MiB on our
    own pool) to 1 MiB so that the 2^20 + 5 and 2^18 + 5
    element cases run split across the pool, parts and ragged last part included."""
    previous = _C.kernels_set_cpu_parallel_min_bytes(1 << 20)
    yield
    _C.kernels_set_cpu_parallel_min_bytes(previous)


@pytest.fixture(params=ops.supported_cpu_isas())
def isa(request):
    """Runs the test on each instruction-set build this CPU can execute."""
    previous = ops.cpu_isa()
    ops.set_cpu_isa(request.param)
    yield request.param
    ops.set_cpu_isa(previous)


def _random(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


def _reference(inputs, op: ReduceOp) -> torch.Tensor:
    """op over inputs: in float64 for floats, in the dtype itself (wrapping) for integers."""
    floating = inputs[0].dtype.is_floating_point
    values = [x.double() for x in inputs] if floating else [x.clone() for x in inputs]
    acc = values[0]
    for x in values[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc + x
        elif op == ReduceOp.PROD:
            acc = acc * x
        elif op == ReduceOp.MAX:
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op == ReduceOp.AVG:
        acc = acc / len(inputs) if floating else torch.div(acc, len(inputs), rounding_mode="trunc")
    return acc


def _tolerance(inputs, op: ReduceOp) -> torch.Tensor:
    """Error bound of an FP32/FP64 accumulation followed by one rounding to the dtype."""
    dtype = inputs[0].dtype
    rounding = torch.finfo(dtype).eps + len(inputs) * torch.finfo(torch.float32).eps
    if dtype == torch.float64:
        rounding = len(inputs) * torch.finfo(torch.float64).eps
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        magnitude = sum(x.double().abs() for x in inputs)
        if op == ReduceOp.AVG:
            magnitude = magnitude / len(inputs)
    elif op == ReduceOp.PROD:
        magnitude = _reference(inputs, op).abs()
    else:
        return torch.zeros(inputs[0].shape, dtype=torch.float64)  # max / min are exact
    return rounding * magnitude + torch.finfo(dtype).tiny


def _check_reduce(dst: torch.Tensor, inputs, op: ReduceOp, what: str) -> None:
    expected = _reference(inputs, op)
    if not dst.dtype.is_floating_point:
        assert torch.equal(dst, expected), f"{what}: integer mismatch (seed {SEED})"
        return
    assert torch.equal(dst.isnan(), expected.isnan()), f"{what}: NaN positions (seed {SEED})"
    error = (dst.double() - expected).abs().nan_to_num(0.0)
    bound = _tolerance(inputs, op)
    bad = (error > bound).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} elements off, first at {bad[0].item()}: "
        f"got {dst[bad[0]].item()}, want {expected[bad[0]].item()} (seed {SEED})"
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD), ids=lambda o: o.name)
def test_reduce_check_rejects_wrong_results(dtype, op):
    """_check_reduce's bound (one rounding) is tight: the right answer rounded once passes;
    zeros, one input alone, a doubled result and SUM in place of AVG all fail."""
    gen = _gen(7, 1023)
    inputs = [_random(dtype, 1023, gen) for _ in range(3)]
    expected = _reference(inputs, op)
    _check_reduce(expected.to(dtype), inputs, op, "rounded once")
    wrong = {"zeros": expected * 0, "one input": inputs[0].double(), "doubled": 2 * expected}
    if op == ReduceOp.AVG:
        wrong["SUM for AVG"] = expected * len(inputs)
    for name, result in wrong.items():
        with pytest.raises(AssertionError, match="elements off"):
            _check_reduce(result.to(dtype), inputs, op, name)


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reduce_two_inputs_matches_torch(isa, dtype, op):
    # The largest size (thread-pool split, long vector loops) on the best build only: the other
    # builds run the same loops at 4099 elements, and the suite stays fast on 2 cores.
    sizes = SIZES if isa == ops.supported_cpu_isas()[-1] else SIZES[:-1]
    for n in sizes:
        gen = _gen(1, n)
        a, b = _random(dtype, n, gen), _random(dtype, n, gen)
        dst = a.clone()
        assert ops.reduce_(dst, b, op=op) is dst
        _check_reduce(dst, [a, b], op, f"{isa} {dtype} {op.name} n={n}")


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reduce_many_inputs_matches_torch(isa, dtype, op):
    cases = [(7, 3), (4099, 4), (1023, 9)]
    if isa == ops.supported_cpu_isas()[-1]:
        cases.append((2**18 + 5, 3))  # thread-pool split: on the best build only (see above)
    for n, nsrcs in cases:
        gen = _gen(2, n)
        inputs = [_random(dtype, n, gen) for _ in range(nsrcs)]
        dst = inputs[0].clone()
        ops.reduce_(dst, *inputs[1:], op=op)
        _check_reduce(dst, inputs, op, f"{isa} {dtype} {op.name} n={n} inputs={nsrcs}")


def test_bf16_sum_is_bit_exact_on_every_class(isa):
    """Two-input BF16 sums of random bit patterns (subnormals, NaN, inf, huge: a subnormal in
    about one vector in sixteen), bitwise torch's FP32 sum rounded once. The AVX-512 build
    rounds with vcvtneps2bf16 where the CPU has it, which flushes subnormals: a vector holding
    one must take the exact rounding. The length leaves a 16-element step and a 7-element tail
    after the 32-element steps, so every loop of the kernel runs."""
    n = (1 << 14) + 16 + 7
    gen = _gen(9)
    a, b = (
        torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int64)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(2)
    )
    want = (a.float() + b.float()).to(torch.bfloat16)
    assert bool(want.float().abs().lt(2.0**-126).logical_and(want.float().ne(0)).any())
    dst = a.clone()
    ops.reduce_(dst, b)
    assert _same_bits(dst, want), f"{isa} (seed {SEED})"


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_multi_input_half_sum_rounds_once(isa, dtype):
    """A 3-input FP16/BF16 sum equals the exact sum rounded once, not (a + b) rounded + c."""
    n = 4099
    gen = _gen(3)
    magnitude = 0.25 + 3.75 * torch.rand(3, n, generator=gen)
    sign = torch.randint(0, 2, (3, n), generator=gen) * 2 - 1
    a, b, c = (sign * magnitude).to(dtype)
    exact = a.double() + b.double() + c.double()
    # Precondition: with exponents this close the FP32 sum is exact, so one rounding of it is the
    # correctly rounded result.
    assert torch.equal((a.float() + b.float() + c.float()).double(), exact)
    expected = exact.float().to(dtype)
    dst = a.clone()
    ops.reduce_(dst, b, c)
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16)), f"seed {SEED}"
    # The test can tell the difference: rounding after every addition gives other bits somewhere.
    twice = (a + b) + c
    assert not torch.equal(twice.view(torch.int16), expected.view(torch.int16))


def _with_specials(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """Small integers (exact in every dtype) with NaN, +inf and -inf at random places."""
    x = torch.randint(-8, 9, (n,), generator=gen).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    where = torch.randint(0, 8, (n,), generator=gen)
    for k in range(3):
        x[where == k] = specials[k]
    return x


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_and_inf_propagate_like_torch(isa, dtype, op):
    for n, nsrcs in ((4099, 2), (1023, 3)):
        gen = _gen(4, n)
        inputs = [_with_specials(dtype, n, gen) for _ in range(nsrcs)]
        dst = inputs[0].clone()
        ops.reduce_(dst, *inputs[1:], op=op)
        expected = _reference(inputs, op).to(dtype)
        assert torch.equal(dst.isnan(), expected.isnan()), f"{dtype} {op.name} (seed {SEED})"
        finite = ~expected.isnan()
        assert torch.equal(dst[finite], expected[finite]), f"{dtype} {op.name} (seed {SEED})"


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_divide_matches_torch(isa, dtype):
    for n in (0, 7, 4099, 2**20 + 5):
        x = _random(dtype, n, _gen(5, n))
        for divisor in (1, 3, 7):
            dst = ops.divide_(x.clone(), divisor)
            if dtype.is_floating_point:
                # A full tensor divisor: torch turns division by a scalar into a multiplication
                # by its reciprocal, which is not correctly rounded.
                wide = x.float() if dtype in HALVES else x
                expected = (wide / torch.full_like(wide, divisor)).to(dtype)
            else:
                expected = torch.div(x, divisor, rounding_mode="trunc")
            assert torch.equal(dst, expected), f"{isa} {dtype} / {divisor} n={n} (seed {SEED})"


def _sum_then_divide(inputs, divisor: int) -> torch.Tensor:
    """AVG's last step done by torch: the sum in the kernels' compute type (FP32 for FP16 / BF16,
    the dtype itself otherwise, wrapping for integers), one correctly rounded division (a tensor
    divisor: torch multiplies by the reciprocal of a scalar), one rounding to the dtype;
    integers truncate toward zero."""
    dtype = inputs[0].dtype
    wide = [x.float() if dtype in HALVES else x for x in inputs]
    total = wide[0].clone()
    for x in wide[1:]:
        total = total + x
    if not dtype.is_floating_point:
        return torch.div(total.to(torch.int64), divisor, rounding_mode="trunc").to(dtype)
    return (total / torch.full_like(total, divisor)).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reduce_average_sums_and_divides_in_one_pass(isa, dtype):
    """The fused AVG kernel (the collectives' last reduce step) is bit-exact against torch's sum
    then divide, for divisors other than the number of sources (a ring's last step adds 2
    buffers and divides by the world size), sizes around the 1024-element block, dst aliasing
    srcs[0] and not."""
    for n in (1, 1023, 1024, 1025, 4099):
        for nsrcs, divisor in ((1, 3), (2, 2), (2, 4), (3, 7), (4, 3)):
            gen = _gen(10, n, nsrcs, divisor)
            inputs = [_random(dtype, n, gen) for _ in range(nsrcs)]
            expected = _sum_then_divide(inputs, divisor)
            for alias in (True, False):
                dst = inputs[0].clone() if alias else torch.empty_like(inputs[0])
                srcs = [dst if alias else inputs[0]] + inputs[1:]
                _C.kernels_reduce_average(
                    dst.data_ptr(), [s.data_ptr() for s in srcs], n, dtype_code(dtype), divisor
                )
                what = f"{isa} {dtype} n={n} sources={nsrcs} / {divisor} alias={alias}"
                assert _same_values(dst, expected), f"{what} (seed {SEED})"


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_reduce_average_of_halves_rounds_once(isa, dtype):
    """FP16 / BF16 AVG divides the FP32 sum before its one rounding: the bits differ from
    rounding the sum first, and an FP16 sum beyond 65504 still averages to a finite value."""
    n = 4099
    code = dtype_code(dtype)
    if dtype == torch.float16:
        a = torch.full((n,), 40000.0, dtype=dtype)
        dst = a.clone()
        _C.kernels_reduce_average(dst.data_ptr(), [dst.data_ptr(), a.data_ptr()], n, code, 4)
        assert torch.equal(dst, torch.full_like(a, 20000.0))
    gen = _gen(11)
    x, y = _random(dtype, n, gen), _random(dtype, n, gen)
    dst = x.clone()
    _C.kernels_reduce_average(dst.data_ptr(), [dst.data_ptr(), y.data_ptr()], n, code, 3)
    twice = ((x + y).float() / torch.full((n,), 3.0)).to(dtype)
    assert torch.equal(dst, _sum_then_divide([x, y], 3)), f"seed {SEED}"
    assert not torch.equal(dst, twice), "the test cannot tell one rounding from two"


def test_integer_average_truncates_like_int64_division_at_the_extremes(isa):
    """The 8- and 32-bit integer divide runs in float / double: exact truncation toward zero
    against int64 division at the dtype's extremes, for small, huge and negative divisors."""
    for dtype in INTS:
        info = torch.iinfo(dtype)
        values = [info.min, info.min + 1, info.min // 3, -7, -1, 0, 1, 7, info.max // 3]
        x = torch.tensor(values + [info.max - 1, info.max], dtype=dtype)
        for divisor in (1, 2, 3, 7, 255, 2**20 + 1, 2**31 - 1, 2**40, 2**62, -1, -2, -3, -(2**33)):
            dst = torch.empty_like(x)
            _C.kernels_divide(dst.data_ptr(), x.data_ptr(), x.numel(), dtype_code(dtype), divisor)
            if divisor == -1:  # negation: INT64_MIN / -1 wraps (torch.div would trap on it)
                exact = x.to(torch.int64) * -1
            else:
                exact = torch.div(x.to(torch.int64), divisor, rounding_mode="trunc")
            assert torch.equal(dst, exact.to(dtype)), f"{isa} {dtype} / {divisor}: {dst} != {exact}"


def test_integer_sum_and_prod_wrap_like_torch(isa):
    for dtype in INTS:
        info = torch.iinfo(dtype)
        a = torch.tensor([info.max, info.min, info.max, -1 if info.min < 0 else 2], dtype=dtype)
        b = torch.tensor([1, -1 if info.min < 0 else 0, info.max, info.min], dtype=dtype)
        for op, expected in ((ReduceOp.SUM, a + b), (ReduceOp.PROD, a * b)):
            dst = ops.reduce_(a.clone(), b, op=op)
            assert torch.equal(dst, expected), f"{dtype} {op.name}"


def test_dst_may_alias_a_source_and_tensors_need_no_alignment(isa):
    base = torch.randn(4099 + 3, generator=_gen(6))
    x = base[1:4100]  # 4-byte aligned only
    y = base[3:].clone()
    expected = x.double() * 2 + y.double()
    ops.reduce_(x, x, y)
    assert torch.allclose(x.double(), expected, rtol=1e-6, atol=1e-6)
    twice = x * 2
    ops.reduce_(x, x)
    assert torch.equal(x, twice)


def test_partially_overlapping_tensors_are_refused():
    base = torch.arange(16.0)
    before = base.clone()
    with pytest.raises(ValueError, match=r"srcs\[0\]: overlaps dst partially"):
        ops.reduce_(base[0:8], base[4:12])
    with pytest.raises(ValueError, match=r"srcs\[1\]: overlaps dst partially"):
        ops.reduce_(base[4:12], base[4:12], base[0:8])
    halves = base.view(torch.bfloat16)  # 32 bf16 over the 16 floats' bytes
    with pytest.raises(ValueError, match="src: overlaps dst partially"):
        ops.cast_(halves[:16], base[:16])  # bf16 dst inside the fp32 source's bytes
    assert torch.equal(base, before)
    ops.reduce_(base[0:8], base[8:16])  # adjacent, not overlapping
    assert torch.equal(base[0:8], before[0:8] + before[8:16])


def _cast_sources(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (every class: subnormals, NaN, inf, huge) plus rounding ties."""
    n = 1 << 16
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
        random = bits.to(torch.int32).view(torch.float32)
        # Exact ties for BF16 (low 16 bits 0x8000) and FP16 (13 dropped bits 0x1000), and the
        # FP16 overflow threshold 65520 (a tie between 65504 and 2^16: rounds to inf).
        high = torch.randint(0, 2**15, (4096,), generator=gen, dtype=torch.int64) << 16
        bf16_ties = (high | 0x8000).to(torch.int32).view(torch.float32)
        f16_ties = (torch.rand(4096, generator=gen) * 60000).to(torch.float16).float()
        f16_ties = (f16_ties.view(torch.int32) | 0x1000).view(torch.float32)
        edges = torch.tensor([65504.0, 65520.0, 65519.99, 6e-8, 3e-8, 1e-39, -0.0, 3.4e38])
        return torch.cat([random, bf16_ties, f16_ties, edges])
    bits = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int64)
    return bits.to(torch.int16).view(dtype)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    int_type = torch.int32 if want.dtype == torch.float32 else torch.int16
    zero = torch.zeros((), dtype=int_type)
    return torch.equal(
        torch.where(nan, zero, got.view(int_type)), torch.where(nan, zero, want.view(int_type))
    )


@pytest.mark.parametrize("dst_dtype", CAST_DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", CAST_DTYPES, ids=str)
def test_cast_with_scale_is_bit_exact(isa, src_dtype, dst_dtype):
    src = _cast_sources(src_dtype, _gen(7))
    for scale in (1.0, 0.5, 3.0, 2.0**-20, 1e-30, 65536.0):
        dst = torch.empty(src.shape, dtype=dst_dtype)
        ops.cast_(dst, src, scale)
        expected = (src.float() * scale).to(dst_dtype)
        assert _same_bits(dst, expected), f"{isa} {src_dtype}->{dst_dtype} x{scale} (seed {SEED})"


def test_cast_sizes_and_tails(isa):
    for n in SIZES:
        src = torch.randn(n + 1, generator=_gen(8, n))[1:]  # unaligned start as well
        dst = torch.empty(n, dtype=torch.bfloat16)
        ops.cast_(dst, src, 0.125)
        assert _same_bits(dst, (src * 0.125).to(torch.bfloat16)), f"n={n}"


def test_bad_inputs_raise_before_any_work():
    x = torch.arange(8.0)
    before = x.clone()
    with pytest.raises(TypeError, match="dst"):
        ops.reduce_([1.0], x)
    with pytest.raises(ValueError, match=r"srcs\[0\]"):
        ops.reduce_(x, torch.zeros(16)[::2])
    with pytest.raises(TypeError, match=r"srcs\[1\]"):
        ops.reduce_(x, x, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"srcs\[1\]"):
        ops.reduce_(x, x, torch.zeros(9))
    with pytest.raises(ValueError, match=r"srcs\[0\]"):
        ops.reduce_(x, torch.zeros(8, device="meta"))
    with pytest.raises(TypeError, match="dst"):
        ops.reduce_(torch.zeros(8, dtype=torch.complex64), torch.zeros(8, dtype=torch.complex64))
    with pytest.raises(ValueError, match="op"):
        ops.reduce_(x, x, op="median")
    with pytest.raises(ValueError, match="srcs"):
        ops.reduce_(x)
    assert torch.equal(x, before)
    with pytest.raises(TypeError, match="dst"):
        ops.cast_(torch.zeros(8, dtype=torch.int32), x)
    with pytest.raises(TypeError, match="src"):
        ops.cast_(torch.zeros(8), torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="src"):
        ops.cast_(torch.zeros(4), x)
    with pytest.raises(TypeError, match="scale"):
        ops.cast_(torch.zeros(8), x, scale="2")
    with pytest.raises(ValueError, match="divisor"):
        ops.divide_(x, 0)
    with pytest.raises(TypeError, match="divisor"):
        ops.divide_(x, 2.0)
    with pytest.raises(ValueError, match="isa"):
        ops.set_cpu_isa("sse9")
    assert torch.equal(x, before)


def test_torch_distributed_reduce_op_is_accepted():
    dist = pytest.importorskip("torch.distributed")
    x = torch.ones(4)
    ops.reduce_(x, torch.full((4,), 3.0), op=dist.ReduceOp.MAX)
    assert torch.equal(x, torch.full((4,), 3.0))


def test_environment_chooses_isa_and_threads():
    code = "from dist_kernels import ops, _C; print(ops.cpu_isa(), _C.kernels_cpu_threads())"
    env = dict(os.environ, DK_CPU_ISA="baseline", DK_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["baseline", "1"]


@pytest.mark.parametrize("pool", ["openmp", "dk"])
def test_pool_threads_follow_omp_num_threads_then_dk_num_threads(pool):
    """torchrun sets OMP_NUM_THREADS=1 for several ranks per host: the kernels follow it, and
    DK_NUM_THREADS overrides it. On torch's OpenMP runtime they use torch's team (what
    torch.get_num_threads() says: torch reads OMP_NUM_THREADS too); on our own pool the
    environment's number, else the core count."""
    code = (
        "import torch; from dist_kernels import _C; "
        "print(_C.kernels_cpu_pool(), _C.kernels_cpu_threads(), torch.get_num_threads())"
    )

    def threads(**overrides) -> int:
        env = {
            k: v for k, v in os.environ.items() if k not in ("DK_NUM_THREADS", "OMP_NUM_THREADS")
        }
        env.update(overrides, DK_CPU_POOL=pool)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        backend, ours, torchs = out.stdout.split()
        assert backend == pool
        if pool == "openmp" and "DK_NUM_THREADS" not in overrides:
            assert ours == torchs, f"ours {ours}, torch's {torchs}"
        return int(ours)

    cores = os.cpu_count()
    assert threads() == cores
    assert threads(OMP_NUM_THREADS="1") == 1
    assert threads(OMP_NUM_THREADS="1", DK_NUM_THREADS="2") == 2
    assert threads(OMP_NUM_THREADS="0") == cores  # not a thread count: ignored, as below 1
    if pool == "dk":
        assert threads(OMP_NUM_THREADS="3") == 3


def _cuda_ready() -> bool:
    import dist_kernels

    return torch.cuda.is_available() and dist_kernels.build_info()["cuda_compiled"]


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and a CUDA build")


def _same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal where not NaN, NaN where NaN (payloads may differ)."""
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.gpu
@needs_cuda
def test_cuda_reduce_matches_cpu_kernels(dtype, op):
    """The CUDA kernels share the CPU kernels' functors: results agree bit for bit."""
    for n, nsrcs in ((0, 2), (1, 2), (7, 3), (4099, 2), (2**20 + 5, 3)):
        gen = _gen(9, n)
        inputs = [_random(dtype, n, gen) for _ in range(nsrcs)]
        on_cpu = ops.reduce_(inputs[0].clone(), *inputs[1:], op=op)
        on_gpu = ops.reduce_(*(x.cuda() for x in inputs), op=op).cpu()
        assert _same_values(on_gpu, on_cpu), f"{dtype} {op.name} n={n} (seed {SEED})"


@pytest.mark.parametrize("dst_dtype", CAST_DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", CAST_DTYPES, ids=str)
@pytest.mark.gpu
@needs_cuda
def test_cuda_cast_is_bit_exact(src_dtype, dst_dtype):
    src = _cast_sources(src_dtype, _gen(10)).cuda()
    # 256-byte aligned and 16-byte aligned (both the vector path: it needs 16 bytes, so an FP32
    # view at 4 elements keeps it), and misaligned (the scalar path).
    for offset in (0, 16 // src.element_size(), 1):
        view = src[offset:]
        dst = torch.empty(view.shape, dtype=dst_dtype, device="cuda")
        ops.cast_(dst, view, 0.75)
        assert _same_bits(dst.cpu(), (view.cpu().float() * 0.75).to(dst_dtype))


@pytest.mark.gpu
@needs_cuda
def test_cuda_rejects_mixed_devices():
    with pytest.raises(ValueError, match=r"srcs\[0\]"):
        ops.reduce_(torch.zeros(4, device="cuda"), torch.zeros(4))


def test_concurrent_callers_share_the_thread_pool():
    """Python threads calling at once (GIL released): one uses the pool, others run inline."""
    n = 1 << 20  # above the pool's split threshold
    gen = _gen(11)
    pairs = [(torch.randn(n, generator=gen), torch.randn(n, generator=gen)) for _ in range(4)]
    expected = [a + b for a, b in pairs]
    results = [a.clone() for a, _ in pairs]

    def work(i: int) -> None:
        for _ in range(5):
            results[i].copy_(pairs[i][0])
            ops.reduce_(results[i], pairs[i][1])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(torch.equal(r, e) for r, e in zip(results, expected))


def _reduce_in_child(n: int) -> tuple:
    # numpy buffers: torch's own OpenMP pool hangs in a child forked after it ran, so the child
    # touches no parallel torch op; only our pool is under test.
    a, b = np.ones(n, dtype=np.float32), np.full(n, 2.0, dtype=np.float32)
    ops.reduce_(torch.from_numpy(a), torch.from_numpy(b))
    return bool((a == 3).all()), _C.kernels_cpu_pool()


def test_thread_pool_works_in_a_forked_child():
    """The parent's pool threads (ours or the OpenMP runtime's) do not exist after fork(); the
    child must build a pool of its own, never enter the parent's OpenMP runtime."""
    n = 1 << 20
    ops.reduce_(torch.ones(n), torch.ones(n))  # parent's pool is running
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_reduce_in_child, (n,)).get(timeout=120) == (True, "dk")


def test_standalone_kernels_run_on_torchs_openmp_runtime():
    """torch is imported, so its OpenMP runtime is in the process: the kernels borrow its
    threads (not a pool of ours beside them), as many as torch's ops use; DK_CPU_POOL=dk keeps
    our own pool."""
    assert _C.kernels_cpu_pool() == "openmp"
    # the team size follows torch.set_num_threads, as torch's own ops do (DK_NUM_THREADS unset)
    if "DK_NUM_THREADS" not in os.environ:
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert _C.kernels_cpu_threads() == 1
            torch.set_num_threads(3)
            assert _C.kernels_cpu_threads() == 3
        finally:
            torch.set_num_threads(previous)
    code = "from dist_kernels import _C; print(_C.kernels_cpu_pool())"
    env = dict(os.environ, DK_CPU_POOL="dk")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["dk"], out.stderr


_POOL_BITS = """
import hashlib, time, torch
from dist_kernels import _C, ops
_C.kernels_set_cpu_parallel_min_bytes(0)  # every call splits: the pool's wake-up paths run
gen = torch.Generator().manual_seed({seed})
out = []
for dtype in (torch.float32, torch.bfloat16):
    srcs = [torch.randn(2**18 + 5, generator=gen).to(dtype) for _ in range(3)]
    for pause in (0.0, 0.0, 0.002):  # back to back (workers spinning), then after they slept
        time.sleep(pause)
        dst = srcs[0].clone()
        ops.reduce_(dst, *srcs[1:])
        out.append(dst.float())
print(_C.kernels_cpu_pool(), _C.kernels_cpu_threads(),
      *(hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in out))
"""


@pytest.mark.parametrize("pool", ["openmp", "dk"])
@pytest.mark.parametrize("threads", [2, 3])
def test_pool_gives_the_same_bits_at_every_thread_count(threads, pool):
    """The OpenMP runtime's team and our spin-then-sleep pool at 1, 2 and 3 threads (more than
    this machine's cores): every call, back to back or after the workers went to sleep, gives
    the one-thread bits."""
    print(f"seed {SEED}")

    def run(n: int) -> list:
        env = dict(os.environ, DK_NUM_THREADS=str(n), DK_CPU_POOL=pool)
        code = _POOL_BITS.format(seed=SEED)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    serial, pooled = run(1), run(threads)
    assert serial[:2] == [pool, "1"] and pooled[:2] == [pool, str(threads)]
    assert pooled[2:] == serial[2:]


@pytest.mark.parametrize("parallel_size", [(37, 129), (300, 1000)], ids=["one-thread", "pool"])
def test_dropout_keep_mask_kernel_equals_the_int64_hash(parallel_size):
    """The C++ last step of a counter-based dropout mask (dk.models.dropout) against the same
    lowbias32 hash in torch's int64 ops, at every threshold's edge; 300 x 1000 elements split
    over the pool. Only the low 32 bits of an index count."""
    from dist_kernels.models.dropout import _MASK32, _mix_tensor

    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    rows, cols = parallel_size
    rows_hash = torch.randint(0, 2**32, (rows,), generator=gen)
    cols_index = torch.randint(0, 2**40, (cols,), generator=gen)
    hashed = _mix_tensor(rows_hash[:, None] ^ (cols_index & _MASK32)[None, :])
    for threshold in (0, 1, 2**31, 2**32 - 1, 2**32):
        keep = ops.dropout_keep_mask(rows_hash, cols_index, threshold)
        assert keep.dtype == torch.bool and keep.shape == (rows, cols)
        assert torch.equal(keep, hashed >= threshold), threshold
    assert ops.dropout_keep_mask(rows_hash, cols_index, 2**32).sum() == 0
    assert ops.dropout_keep_mask(rows_hash, cols_index, 0).all()


def test_dropout_keep_mask_bad_input_names_the_argument():
    good = torch.arange(4)
    with pytest.raises(ValueError, match="rows_hash: expected a 1-D int64 CPU tensor"):
        ops.dropout_keep_mask(good.int(), good, 0)
    with pytest.raises(ValueError, match="cols_index: expected a 1-D int64 CPU tensor"):
        ops.dropout_keep_mask(good, good.view(2, 2), 0)
    with pytest.raises(ValueError, match=r"threshold: 4294967297 outside \[0, 2\*\*32\]"):
        ops.dropout_keep_mask(good, good, 2**32 + 1)
