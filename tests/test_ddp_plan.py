"""Pure DDP planning: bucket layouts with status slots, rebuilt order, fingerprints, model
descriptions."""

from __future__ import annotations

import random

import pytest
import torch

from dist_kernels.buckets import plan
from dist_kernels.buckets.plan import plan_buckets
from dist_kernels.ddp import structure

SEED = 7


def _layouts(order, sizes, dtypes, wire=None, cap=64, first=64):
    params = [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
    bucket_plan = plan_buckets(params, cap, dtype=wire, first_bucket_bytes=first, order=order)
    return bucket_plan, plan.with_status_slots(bucket_plan.buckets)


@pytest.mark.parametrize("wire", [None, torch.float16])
def test_layouts_keep_the_plan_and_add_status_slots_to_the_last_bucket(wire):
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for trial in range(30):
        n = rng.randint(1, 40)
        sizes = [rng.choice([1, 3, 4, 5, 15, 16, 17, 255, 4099]) for _ in range(n)]
        dtypes = [rng.choice([torch.float32, torch.bfloat16]) for _ in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        bucket_plan, layouts = _layouts(order, sizes, dtypes, wire, rng.choice([64, 20000]))
        members = [i for b in layouts for i in b.param_indices]
        assert sorted(members) == list(range(n)), trial
        assert [b.status_offset is not None for b in layouts] == [False] * (len(layouts) - 1) + [
            True
        ]
        for layout, bucket in zip(layouts, bucket_plan.buckets):
            assert layout.param_indices == bucket.param_indices
            assert layout.offsets == bucket.offsets and layout.counts == bucket.counts
            item = torch.empty((), dtype=layout.dtype).element_size()
            assert layout.numel * item % 16 == 0
            if layout.status_offset is None:
                assert layout.numel == bucket.numel
            else:  # after every slot, 16-byte aligned, inside the allocation
                assert layout.status_offset >= bucket.numel
                assert layout.status_offset * item % 16 == 0
                assert layout.status_offset + plan.STATUS_SLOTS <= layout.numel


def test_rebuilt_order_puts_observed_first_then_reverse_registration():
    assert plan.rebuilt_order([3, 1, 3], 5) == [3, 1, 4, 2, 0]
    assert plan.rebuilt_order([], 3) == [2, 1, 0]
    with pytest.raises(ValueError, match="index 5"):
        plan.rebuilt_order([5], 5)


def test_fingerprint_mismatch_names_ranks_and_buckets():
    _, layouts = _layouts([1, 0], [10, 20], [torch.float32] * 2)
    sig = plan.layout_signature(layouts)
    ok = plan.fingerprint(4, layouts[0], 0, sig, plan.STATUS_OK)
    assert plan.fingerprint_mismatch([ok, ok, ok]) is None
    other = plan.fingerprint(4, layouts[1], 0, sig, plan.STATUS_OK)
    message = plan.fingerprint_mismatch([ok, other, ok])
    assert "ranks 0, 2: all-reduce #4 of bucket 0" in message
    assert "rank 1: all-reduce #4 of bucket 1" in message
    bad = plan.fingerprint(4, layouts[0], 0, sig, plan.STATUS_INCOMPLETE)
    assert "incomplete backward" in plan.fingerprint_mismatch([ok, bad])
    aborted = plan.fingerprint(4, layouts[0], 0, sig, plan.STATUS_ABORTED)
    assert "abandoned backward" in plan.fingerprint_mismatch([ok, aborted])


def test_status_slots_sum_to_counts_per_kind():
    """Each rank writes 0/1 per kind; the all-reduce's sum counts the ranks of each kind."""
    per_rank = [
        plan.status_slots(plan.STATUS_OK, False),
        plan.status_slots(plan.STATUS_INCOMPLETE, True),
        plan.status_slots(plan.STATUS_ABORTED, False),
        plan.status_slots(plan.STATUS_ABORTED, True),
    ]
    summed = [sum(column) for column in zip(*per_rank)]
    assert len(summed) == plan.STATUS_SLOTS
    assert summed[plan.FOUND_INF_SLOT] == 2
    assert summed[plan.ERROR_SLOT] == 1
    assert summed[plan.ABORTED_SLOT] == 2


def test_layout_signature_changes_with_order():
    _, a = _layouts([0, 1, 2], [4, 4, 4], [torch.float32] * 3)
    _, b = _layouts([2, 1, 0], [4, 4, 4], [torch.float32] * 3)
    assert plan.layout_signature(a) != plan.layout_signature(b)
    assert plan.layout_signature(a) == plan.layout_signature(list(a))


def test_first_description_mismatch():
    w = torch.zeros(2, 3)
    a = structure.describe_parameters([("fc.weight", w), ("fc.bias", torch.zeros(2))])
    b = structure.describe_parameters([("fc.weight", w), ("fc.bias", torch.zeros(3))])
    assert structure.first_description_mismatch([a, a]) is None
    message = structure.first_description_mismatch([a, a, b])
    assert "entry 1" in message and "ranks [2]" in message and "rank 2: fc.bias (3,)" in message
    message = structure.first_description_mismatch([a, a[:1]])
    assert "rank 1: <missing>" in message
