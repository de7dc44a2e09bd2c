"""Pure DDP planning: bucket layouts, rebuilt order, fingerprints, model descriptions."""

from __future__ import annotations

import random

import pytest
import torch

from dist_kernels import _ddp_plan as plan

SEED = 7


def _random_model(rng: random.Random, n: int):
    sizes = [rng.choice([1, 3, 4, 5, 15, 16, 17, 255, 4099]) for _ in range(n)]
    dtypes = [rng.choice([torch.float32, torch.bfloat16]) for _ in range(n)]
    return sizes, dtypes


@pytest.mark.parametrize("wire", [None, torch.float16])
def test_layouts_cover_every_parameter_once_aligned_and_capped(wire):
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for trial in range(50):
        n = rng.randint(1, 40)
        sizes, dtypes = _random_model(rng, n)
        order = list(range(n))
        rng.shuffle(order)
        cap, first = rng.choice([64, 1000, 20000]), rng.choice([16, 512])
        layouts = plan.plan_layouts(
            order, sizes, dtypes, wire_dtype=wire, bucket_cap_bytes=cap, first_bucket_bytes=first
        )
        members = [i for b in layouts for i in b.param_indices]
        assert sorted(members) == list(range(n)), trial
        assert [b.index for b in layouts] == list(range(len(layouts)))
        assert [b.status_offset is not None for b in layouts] == [False] * (len(layouts) - 1) + [
            True
        ]
        for b in layouts:
            item = torch.empty((), dtype=b.dtype).element_size()
            assert all(o * item % 16 == 0 for o in b.offsets)
            assert b.numel * item % 16 == 0
            assert all(b.dtype == (wire or dtypes[i]) for i in b.param_indices)
            ends = [o + sizes[i] for o, i in zip(b.offsets, b.param_indices)]
            assert all(e <= o for e, o in zip(ends, b.offsets[1:])), "overlap"
            if b.status_offset is not None:
                assert ends[-1] <= b.status_offset and b.status_offset + 2 <= b.numel
            if len(b.param_indices) > 1:  # a bucket over the cap holds a single parameter
                first_of_dtype = all(o.dtype != b.dtype for o in layouts[: b.index])
                cap_here = max(first, cap) if first_of_dtype else cap
                assert (b.numel - (2 if b.status_offset is not None else 0) - 16) * item <= cap_here
        # Within one dtype, buckets follow the given order.
        for dtype in set(b.dtype for b in layouts):
            seq = [i for b in layouts if b.dtype == dtype for i in b.param_indices]
            assert seq == [i for i in order if (wire or dtypes[i]) == dtype]


def test_rebuilt_order_puts_observed_first_then_reverse_registration():
    assert plan.rebuilt_order([3, 1, 3], 5) == [3, 1, 4, 2, 0]
    assert plan.rebuilt_order([], 3) == [2, 1, 0]
    with pytest.raises(ValueError, match="index 5"):
        plan.rebuilt_order([5], 5)


def test_fingerprint_mismatch_names_ranks_and_buckets():
    layouts = plan.plan_layouts(
        [1, 0], [10, 20], [torch.float32] * 2, wire_dtype=None,
        bucket_cap_bytes=64, first_bucket_bytes=64,
    )  # fmt: skip
    sig = plan.layout_signature(layouts)
    ok = plan.fingerprint(4, layouts[0], 0, sig, plan.STATUS_OK)
    assert plan.fingerprint_mismatch([ok, ok, ok]) is None
    other = plan.fingerprint(4, layouts[1], 0, sig, plan.STATUS_OK)
    message = plan.fingerprint_mismatch([ok, other, ok])
    assert "ranks 0, 2: all-reduce #4 of bucket 0" in message
    assert "rank 1: all-reduce #4 of bucket 1" in message
    bad = plan.fingerprint(4, layouts[0], 0, sig, plan.STATUS_INCOMPLETE)
    assert "incomplete backward" in plan.fingerprint_mismatch([ok, bad])


def test_layout_signature_changes_with_order():
    args = dict(wire_dtype=None, bucket_cap_bytes=64, first_bucket_bytes=64)
    a = plan.plan_layouts([0, 1, 2], [4, 4, 4], [torch.float32] * 3, **args)
    b = plan.plan_layouts([2, 1, 0], [4, 4, 4], [torch.float32] * 3, **args)
    assert plan.layout_signature(a) != plan.layout_signature(b)
    assert plan.layout_signature(a) == plan.layout_signature(list(a))


def test_first_description_mismatch():
    w = torch.zeros(2, 3)
    a = plan.describe_parameters([("fc.weight", w), ("fc.bias", torch.zeros(2))])
    b = plan.describe_parameters([("fc.weight", w), ("fc.bias", torch.zeros(3))])
    assert plan.first_description_mismatch([a, a]) is None
    message = plan.first_description_mismatch([a, a, b])
    assert "entry 1" in message and "ranks [2]" in message and "rank 2: fc.bias (3,)" in message
    message = plan.first_description_mismatch([a, a[:1]])
    assert "rank 1: <missing>" in message
