"""The bucket planner (pure Python): cap, order, alignment, no split, printable."""

from __future__ import annotations

import random

import pytest
import torch

from dist_kernels.buckets.plan import plan_buckets

SEED = 5
ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def _random_sizes(seed: int, count: int = 60):
    print(f"seed {seed}")
    rng = random.Random(seed)
    return [rng.choice([1, 3, 7, 16, 100, 1000, 5000, 40000]) for _ in range(count)]


def _check_layout(plan, sizes, align):
    """Every parameter exactly once, whole, aligned, inside its bucket, no overlap."""
    seen = []
    for bucket in plan.buckets:
        end = 0
        for slot in sorted(bucket.slots, key=lambda s: s.offset):
            assert slot.numel == sizes[slot.index]
            assert slot.offset * ITEMSIZE[bucket.dtype] % align == 0
            assert slot.offset >= end
            end = slot.offset + slot.numel
            seen.append(slot.index)
        assert end <= bucket.numel and bucket.nbytes % align == 0
    assert sorted(seen) == list(range(len(sizes)))


@pytest.mark.parametrize("seed", [SEED, SEED + 1, SEED + 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cap_order_alignment(seed, dtype):
    sizes = _random_sizes(seed)
    cap = 64 * 1024
    plan = plan_buckets(sizes, cap_bytes=cap, dtype=dtype)
    _check_layout(plan, sizes, 16)
    # Reverse registration order, bucket after bucket.
    assigned = [s.index for b in plan.buckets for s in b.slots]
    assert assigned == list(reversed(range(len(sizes))))
    for k, bucket in enumerate(plan.buckets):
        # Over the cap only as the single slot of a parameter larger than the cap.
        assert bucket.nbytes <= cap or len(bucket.slots) == 1
        # Greedy: a bucket closes only when the next parameter would not fit.
        if k + 1 < len(plan.buckets):
            nxt = plan.buckets[k + 1].slots[0].numel
            align_elems = 16 // ITEMSIZE[dtype]
            last = bucket.slots[-1]
            start = -(-(last.offset + last.numel) // align_elems) * align_elems
            assert (start + nxt) * ITEMSIZE[dtype] > cap


def test_parameter_larger_than_cap_gets_its_own_bucket():
    plan = plan_buckets([10, 10, 1_000_000, 10], cap_bytes=1024)
    big = [b for b in plan.buckets if any(s.index == 2 for s in b.slots)]
    assert len(big) == 1 and len(big[0].slots) == 1 and big[0].numel == 1_000_000
    assert [s.index for b in plan.buckets for s in b.slots] == [3, 2, 1, 0]
    assert [len(b.slots) for b in plan.buckets] == [1, 1, 2]


def test_first_bucket_cap_and_custom_order():
    sizes = [256] * 10  # 1 KiB each in float32
    plan = plan_buckets(sizes, cap_bytes=4096, first_bucket_bytes=1024)
    assert [len(b.slots) for b in plan.buckets] == [1, 4, 4, 1]
    order = [3, 1, 4, 0, 5, 9, 2, 6, 8, 7]
    plan = plan_buckets(sizes, cap_bytes=4096, order=order)
    assert [s.index for b in plan.buckets for s in b.slots] == order


def test_alignment_in_elements_per_dtype():
    plan = plan_buckets([3, 5, 1], dtype=torch.float16, align=16)
    assert [s.offset for s in plan.buckets[0].slots] == [0, 8, 16]
    assert plan.buckets[0].numel == 24
    plan = plan_buckets([3, 5, 1], dtype=torch.float32, align=64)
    assert [s.offset for s in plan.buckets[0].slots] == [0, 16, 32]


def test_parameters_names_dtypes_and_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    model[1].half()
    plan = plan_buckets(model.named_parameters(), cap_bytes=1 << 20)
    names = {s.name: b.dtype for b in plan.buckets for s in b.slots}
    assert names == {
        "0.weight": torch.float32,
        "1.weight": torch.float16,
        "1.bias": torch.float16,
    }
    assert len(plan.buckets) == 2  # one per dtype
    text = str(plan)
    assert "0.weight" in text and "float16" in text and "bucket 1" in text
    params = list(model.parameters())
    bucket_index, slot_index = plan.bucket_of(2)
    assert plan.buckets[bucket_index].select(params)[slot_index] is params[2]
    with pytest.raises(KeyError):
        plan.bucket_of(1)  # frozen bias
    wire = plan_buckets(model.parameters(), dtype=torch.bfloat16)
    assert len(wire.buckets) == 1 and wire.buckets[0].dtype == torch.bfloat16


def test_argument_errors():
    with pytest.raises(ValueError, match="cap_bytes"):
        plan_buckets([1], cap_bytes=0)
    with pytest.raises(ValueError, match="align"):
        plan_buckets([1], align=12)
    with pytest.raises(ValueError, match="align"):
        plan_buckets([1], align=2, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        plan_buckets([1], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"params_or_sizes\[1\]"):
        plan_buckets([1, "x"])
    with pytest.raises(ValueError, match="order"):
        plan_buckets([1, 2], order=[0, 0])
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        plan_buckets([1], first_bucket_bytes=-1)
