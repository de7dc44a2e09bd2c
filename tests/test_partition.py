"""The pure partition plan: alignment, equal shards, exact coverage (no tensors, no processes)."""

from __future__ import annotations

import random

import pytest

from dist_kernels.zero.partition import ALIGN_BYTES, ParamSpec, plan_flat_group, plan_partition

SEED = 7


def _random_params(rng: random.Random, count: int):
    params = []
    for i in range(count):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        numel = 1
        for d in shape:
            numel *= d
        params.append(ParamSpec(f"p{i}", shape, numel))
    return params


def _check(plan, params):
    align = ALIGN_BYTES // plan.itemsize
    unit = plan.world_size * align
    for slot, spec in zip(plan.slots, params):
        assert slot.offset % align == 0 and slot.numel == spec.numel
    assert plan.numel % unit == 0 and plan.shard_numel * plan.world_size == plan.numel
    for b in plan.buckets:
        assert b.numel % unit == 0 and b.slice_numel * plan.world_size == b.numel
        assert b.slice_start(1 % plan.world_size) % align == 0
    assert sum(b.numel for b in plan.buckets) == plan.numel
    # every parameter element is owned by exactly one rank, once
    owned = {spec.name: [0] * spec.numel for spec in params}
    shard_sizes = []
    for rank in range(plan.world_size):
        for seg in plan.segments(rank):
            assert 0 <= seg.shard_offset and seg.shard_offset + seg.length <= plan.shard_numel
            slot = plan.slots[seg.slot]
            assert seg.flat_offset == slot.offset + seg.param_start
            for i in range(seg.param_start, seg.param_start + seg.length):
                owned[seg.name][i] += 1
        shard_sizes.append(plan.shard_numel)
    assert all(all(c == 1 for c in counts) for counts in owned.values())
    # equal shares: in bytes, every rank within one alignment unit of total / world_size
    total_bytes = plan.numel * plan.itemsize
    for size in shard_sizes:
        assert abs(size * plan.itemsize - total_bytes / plan.world_size) <= ALIGN_BYTES


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_plan_invariants_random_layouts(world_size, itemsize):
    rng = random.Random(SEED * 100 + world_size * 10 + itemsize)
    print(f"seed {SEED}, world_size {world_size}, itemsize {itemsize}")
    for _trial in range(20):
        params = _random_params(rng, rng.randint(1, 12))
        cap = rng.choice([16, 64, 200, 4096])
        plan = plan_flat_group("0/x", params, itemsize, world_size, cap)
        _check(plan, params)


def test_a_parameter_may_span_ranks_and_buckets():
    params = [ParamSpec("big", (1000,), 1000), ParamSpec("small", (3,), 3)]
    plan = plan_flat_group("0/float32", params, 4, 4, bucket_cap_bytes=1024)
    owners = {r for r in range(4) for s in plan.segments(r) if s.name == "big"}
    assert owners == {0, 1, 2, 3}
    assert len([b for b in plan.buckets if 0 in b.param_indices]) > 1
    _check(plan, params)


def test_plan_is_printable_and_deterministic():
    params = [ParamSpec("w", (4, 3), 12), ParamSpec("b", (3,), 3)]
    a = plan_partition([("0/float32", 4, params)], 2, 64)
    b = plan_partition([("0/float32", 4, params)], 2, 64)
    assert a == b
    text = str(a)
    print(text)
    assert "bucket 0" in text and "w [4, 3]" in text


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="world_size"):
        plan_flat_group("k", [ParamSpec("a", (1,), 1)], 4, 0, 64)
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        plan_flat_group("k", [ParamSpec("a", (1,), 1)], 4, 2, 0)
    plan = plan_flat_group("k", [ParamSpec("a", (1,), 1)], 4, 2, 64)
    with pytest.raises(ValueError, match="rank"):
        plan.segments(2)
