"""BucketReducer on its own (no ranks, no autograd): a recording collective stands in for the
all-reduce or reduce-scatter, and the tests call ``grad_ready`` directly, as a schedule that
computes weight gradients as their own action would.

Checked: buckets launch in plan order exactly when every earlier one has and their last piece
arrived, for random arrival orders (fuzzed, seed printed); the staging window holds pieces back
and completes the bucket whose memory is reused first; every piece is delivered once; the
rest launches with its status; a Communicator per bucket reaches the collective; the re-plan
happens once and only when the order changed.
"""

from __future__ import annotations

import random

import pytest
import torch

from dist_kernels.buckets.plan import STATUS_INCOMPLETE, plan_buckets, plan_flat_buckets
from dist_kernels.buckets.reducer import BucketReducer

SEED = 11


class Recorder:
    """A collective that records what the reducer asks of it."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.events: list = []

    def allocate(self, buckets):
        self.events.append(("allocate", len(buckets)))
        return list(buckets)

    def begin(self, **options) -> None:
        self.events.append(("begin", options))

    def deliver(self, b, slot) -> None:
        self.events.append(("deliver", b, slot.index, slot.param_offset))

    def launch(self, b, status, sequence, group):
        self.events.append(("launch", b, status, sequence, group))
        return f"handle {b}"

    def complete(self, b, handle) -> None:
        self.events.append(("complete", b, handle))

    def wait(self, handles, status, used):
        self.events.append(("wait", list(handles), status, used))
        return "summed status"

    def of(self, kind: str) -> list:
        return [e for e in self.events if e[0] == kind]


def _check_launch_order(reducer: BucketReducer, rec: Recorder, order) -> None:
    """Reports ``order``; after each report the launched buckets are exactly the longest
    prefix of buckets whose every piece was reported."""
    pieces = [{s.index for s in b.slots} for b in reducer.buckets]
    reported = set()
    for index in order:
        reducer.grad_ready(index)
        reported.add(index)
        complete = 0
        while complete < len(pieces) and pieces[complete] <= reported:
            complete += 1
        assert [e[1] for e in rec.of("launch")] == list(range(complete)), (order, index)


def test_buckets_launch_in_plan_order_whatever_the_arrival_order():
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for trial in range(40):
        sizes = [rng.choice([1, 5, 16, 100, 300]) for _ in range(rng.randint(1, 15))]
        bucket_plan = plan_buckets(sizes, cap_bytes=rng.choice([64, 512, 4096]))
        rec = Recorder()
        reducer = BucketReducer(rec, bucket_plan, len(sizes))
        reducer.begin(inv_loss_scale=0.5)
        order = list(range(len(sizes)))
        rng.shuffle(order)
        _check_launch_order(reducer, rec, order)
        assert [e[3] for e in rec.of("launch")] == list(range(len(reducer.buckets))), trial
        assert reducer.ready_order == order
        assert reducer.wait() == "summed status"
        assert rec.of("begin") == [("begin", {"shadow": False, "inv_loss_scale": 0.5})]
        reducer.end()


def test_window_holds_pieces_back_and_completes_the_reused_bucket_first():
    """A flat plan whose parameters span buckets, two staging buffers (ZeRO stages 2, 3)."""
    rng = random.Random(SEED + 1)
    print(f"seed {SEED + 1}")
    for trial in range(40):
        sizes = [rng.choice([3, 16, 50, 200]) for _ in range(rng.randint(1, 10))]
        flat = plan_flat_buckets(sizes, 4, cap_bytes=rng.choice([64, 256]), shards=2)
        rec = Recorder()
        reducer = BucketReducer(rec, flat, len(sizes), window=2)
        reducer.begin()
        order = list(range(len(sizes)))
        rng.shuffle(order)
        for index in order:
            reducer.grad_ready(index)
        next_launch, completed, first_take = 0, set(), {}
        for e in rec.events:
            if e[0] == "launch":
                assert e[1] == next_launch, trial
                next_launch += 1
            elif e[0] == "deliver":
                assert e[1] < next_launch + 2, (trial, e)  # inside the window
            elif e[0] == "complete":
                completed.add(e[1])
            if e[0] in ("deliver", "launch") and e[1] not in first_take:
                first_take[e[1]] = True
                assert e[1] < 2 or e[1] - 2 in completed, (trial, e)  # its buffer is free
        delivered = sorted((e[2], e[3]) for e in rec.of("deliver"))
        expected = sorted((s.index, s.param_offset) for b in flat.buckets for s in b.slots)
        assert delivered == expected, trial  # every piece once
        assert next_launch == len(flat.buckets)
        reducer.wait()
        left = rec.of("wait")[0][1]
        assert sorted(left + sorted(completed)) == list(range(len(flat.buckets)))


def test_the_rest_launches_flagged_and_groups_reach_the_collective():
    bucket_plan = plan_buckets([10, 10, 10, 10], cap_bytes=48)
    assert len(bucket_plan.buckets) == 4
    rec = Recorder()
    groups = ["dense", "experts", "dense", "experts"]
    reducer = BucketReducer(rec, bucket_plan, 4, groups=groups)
    reducer.begin()
    reducer.grad_ready(3)  # bucket 0 (reverse registration order)
    reducer.grad_ready(1, used=False)  # bucket 2: waits for bucket 1
    assert reducer.unready() == [0, 2]
    reducer.launch_rest(STATUS_INCOMPLETE)
    launches = rec.of("launch")
    assert [(e[1], e[2], e[4]) for e in launches] == [
        (0, 0, "dense"),
        (1, STATUS_INCOMPLETE, "experts"),
        (2, STATUS_INCOMPLETE, "dense"),
        (3, STATUS_INCOMPLETE, "experts"),
    ]
    reducer.wait(used_mask=True)
    assert rec.of("wait")[0][2:] == (STATUS_INCOMPLETE, [False, False, False, True])
    with pytest.raises(RuntimeError, match="ready already"):
        reducer.grad_ready(3)
    reducer.end()
    with pytest.raises(ValueError, match="groups"):
        BucketReducer(Recorder(), bucket_plan, 4, groups=groups[:2])
    with pytest.raises(ValueError, match="fixed plan"):
        BucketReducer(Recorder(), bucket_plan, 4, groups=groups, planner=lambda o: bucket_plan)


def test_rebuild_replans_once_and_only_when_the_order_changed():
    sizes = [10, 20, 30]

    def planner(order):
        return plan_buckets(sizes, cap_bytes=64, order=list(order))

    rec = Recorder()
    reducer = BucketReducer(rec, planner([2, 1, 0]), 3, planner=planner)
    reducer.rebuild([2, 1, 0])  # the order it already has: nothing allocated
    assert rec.of("allocate") == [("allocate", len(reducer.buckets))]
    reducer.rebuild([0, 1])
    assert rec.of("allocate") == [("allocate", len(reducer.buckets))], "not twice"
    rec = Recorder()
    reducer = BucketReducer(rec, planner([2, 1, 0]), 3, planner=planner)
    reducer.rebuild([0, 1])  # 2 was never seen: it follows
    assert reducer.planned_order() == [0, 1, 2]
    assert len(rec.of("allocate")) == 2
    reducer.begin()
    with pytest.raises(RuntimeError, match="in flight"):
        reducer.set_plan(planner([0, 1, 2]))
