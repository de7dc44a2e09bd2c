"""Pipeline schedules and partitioning: pure planning, no processes."""

import random

import pytest
import torch.nn as nn

from dist_kernels.pipeline.partition import build_stage, format_partition, plan_partition
from dist_kernels.pipeline.runtime import _eager_sends
from dist_kernels.pipeline.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    bubble_formula,
    build_schedule,
    schedule_table,
    simulate,
)

RANKS = range(1, 9)
MICROBATCHES = range(1, 17)


def _count(schedule: Schedule, kind: Kind) -> int:
    return sum(a.kind is kind for acts in schedule.actions for a in acts)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_valid_with_textbook_bubble(name):
    for p in RANKS:
        for m in MICROBATCHES:
            schedule = build_schedule(name, p, m)
            report = simulate(schedule)
            assert _count(schedule, Kind.FORWARD) == p * m == _count(schedule, Kind.BACKWARD)
            assert report.bubble_fraction == pytest.approx(bubble_formula(p, m), abs=1e-12), (p, m)
            # Bubble from a different cost model must match too (B twice as slow as F).
            slow_b = simulate(schedule, forward_cost=1.0, backward_cost=2.0)
            assert slow_b.bubble_fraction == pytest.approx(bubble_formula(p, m), abs=1e-12)
            peak = report.peak_live_activations
            if name == "gpipe":
                assert all(v == m for v in peak.values()), (p, m, peak)
            else:
                assert all(v <= p for v in peak.values()), (p, m, peak)
                assert all(v <= min(m, p - s) for s, v in peak.items()), (p, m, peak)


def test_interleaved_valid_and_smaller_bubble():
    for p in RANKS:
        for m in MICROBATCHES:
            if m % p:
                with pytest.raises(ValueError, match=rf"n_microbatches \({m}\).*\({p}\)"):
                    build_schedule("interleaved-1f1b", p, m)
                continue
            for v in (2, 3):
                schedule = build_schedule("interleaved-1f1b", p, m, stages_per_rank=v)
                assert schedule.n_stages == p * v
                report = simulate(schedule)
                assert _count(schedule, Kind.FORWARD) == p * v * m
                # Megatron-LM's figure: the warm-up bubble shrinks by the stages per rank.
                expected = (p - 1) / (v * m + p - 1)
                assert report.bubble_fraction == pytest.approx(expected, abs=1e-12), (p, m, v)
                assert max(report.peak_live_activations.values()) <= min(m, p) * v


def test_transfers_pair_up_on_each_channel():
    schedule = build_schedule("1f1b", 4, 6)
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
                assert a.peer == rank + 1
            if a.kind in (Kind.SEND_GRAD, Kind.RECV_ACT):
                assert a.peer == rank - 1
    assert _count(schedule, Kind.SEND_ACT) == _count(schedule, Kind.RECV_ACT) == 3 * 6


def _with_rank_actions(schedule: Schedule, rank: int, actions) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return Schedule(
        schedule.name, schedule.n_ranks, schedule.n_stages, schedule.n_microbatches, tuple(lists)
    )


_SENDS = (Kind.SEND_ACT, Kind.SEND_GRAD)
_RECVS = (Kind.RECV_ACT, Kind.RECV_GRAD)


def _run_async(schedule: Schedule):
    """Executes a schedule the way the runtime does, independently of simulate(): per rank,
    one thread runs computes and sends in ``_eager_sends`` order; sends never block (isend);
    a compute step whose input is not here takes receives in list order until it is (each
    receive takes the head of its channel, which must be the item it expects). Returns the
    actions left undone on each rank (all empty = no deadlock) and the first channel
    mismatch, if any."""
    p = len(schedule.actions)
    order = [_eager_sends(acts) for acts in schedule.actions]
    recvs = [[a for a in acts if a.kind in _RECVS] for acts in schedule.actions]
    channels = {}  # (src, dst) -> list of (kind, stage, mb) in flight, oldest first
    have = [set() for _ in range(p)]  # received or produced here: (kind, stage, mb)
    pos, rpos = [0] * p, [0] * p

    def receive_one(r):
        """Takes rank r's next receive if its message is there: True, False, or an error."""
        a = recvs[r][rpos[r]]
        queue = channels.get((a.peer, r), [])
        if not queue:
            return False
        got = queue.pop(0)
        want = (Kind.SEND_ACT, a.stage - 1, a.microbatch)
        if a.kind is Kind.RECV_GRAD:
            want = (Kind.SEND_GRAD, a.stage + 1, a.microbatch)
        if got != want:
            return f"rank {r} expected {want}, got {got}"
        have[r].add((a.kind, a.stage, a.microbatch))
        rpos[r] += 1
        return True

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(order[r]):
                a = order[r][pos[r]]
                if a.kind in _SENDS:
                    channels.setdefault((r, a.peer), []).append((a.kind, a.stage, a.microbatch))
                else:
                    need = None
                    if a.kind is Kind.FORWARD and a.stage > 0:
                        need = (Kind.RECV_ACT, a.stage, a.microbatch)
                    if a.kind is Kind.BACKWARD and a.stage < schedule.n_stages - 1:
                        need = (Kind.RECV_GRAD, a.stage, a.microbatch)
                    blocked = False
                    while need is not None and need not in have[r]:
                        if rpos[r] >= len(recvs[r]):
                            return None, f"rank {r}: no receive left for {need}"
                        took = receive_one(r)
                        if isinstance(took, str):
                            return None, took
                        if not took:
                            blocked = True
                            break
                        progress = True
                    if blocked:
                        break
                    # An output for a stage on this same rank arrives without a transfer.
                    out_stage = a.stage + 1 if a.kind is Kind.FORWARD else a.stage - 1
                    if 0 <= out_stage < schedule.n_stages and schedule.rank_of(out_stage) == r:
                        kind = Kind.RECV_ACT if a.kind is Kind.FORWARD else Kind.RECV_GRAD
                        have[r].add((kind, out_stage, a.microbatch))
                pos[r] += 1
                progress = True
    left = [order[r][pos[r] :] + recvs[r][rpos[r] :] for r in range(p)]
    return left, None


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_runtime_order_async_sends_never_deadlock(name):
    """The runtime's order (computes and eager isends, receives taken in list order when a step
    needs one) finishes every schedule; the eager order keeps every compute step in place."""
    moved = 0
    for p in RANKS:
        for m in MICROBATCHES:
            if name == "interleaved-1f1b" and m % p:
                continue
            schedule = build_schedule(name, p, m)
            left, mismatch = _run_async(schedule)
            assert mismatch is None, (p, m, mismatch)
            assert all(not rest for rest in left), (p, m, left)
            for acts in schedule.actions:
                eager = _eager_sends(acts)
                planned = [a for a in acts if a.kind not in _RECVS]
                assert sorted(map(repr, eager)) == sorted(map(repr, planned))
                assert [a for a in eager if a.kind.is_compute] == [
                    a for a in planned if a.kind.is_compute
                ]
                moved += eager != planned
    if name == "interleaved-1f1b":  # the others already plan every send right after its step
        assert moved > 0


def test_validator_rejects_backward_before_forward():
    schedule = build_schedule("gpipe", 1, 2)
    bad = _with_rank_actions(schedule, 0, [Action(Kind.BACKWARD, 0, 0), *schedule.actions[0]])
    with pytest.raises(ScheduleError, match="backward before its forward"):
        simulate(bad)


def test_validator_rejects_deadlock_and_mismatch():
    schedule = build_schedule("1f1b", 2, 2)
    acts = list(schedule.actions[1])
    # Rank 1 sends its gradient before receiving the activation it comes from.
    first_send = next(i for i, a in enumerate(acts) if a.kind is Kind.SEND_GRAD)
    moved = [acts[first_send], *acts[:first_send], *acts[first_send + 1 :]]
    with pytest.raises(ScheduleError, match="sends before the step that produces it"):
        simulate(_with_rank_actions(schedule, 1, moved))
    # Rank 1 expects micro-batch 1 first while rank 0 sends micro-batch 0.
    swapped = list(acts)
    i, j = [k for k, a in enumerate(acts) if a.kind is Kind.RECV_ACT][:2]
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="on that channel"):
        simulate(_with_rank_actions(schedule, 1, swapped))
    # Both ranks receive first: nobody ever sends.
    r0 = [Action(Kind.RECV_GRAD, 0, 0, 1), *schedule.actions[0]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(_with_rank_actions(schedule, 0, r0))


def test_validator_rejects_missing_and_duplicate_steps():
    schedule = build_schedule("gpipe", 1, 2)
    with pytest.raises(ScheduleError, match="never runs"):
        simulate(_with_rank_actions(schedule, 0, schedule.actions[0][:-1]))
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate(_with_rank_actions(schedule, 0, schedule.actions[0] + schedule.actions[0][-1:]))


def test_schedule_table_prints_every_step():
    for name, m in (("gpipe", 3), ("1f1b", 5), ("interleaved-1f1b", 4)):
        table = schedule_table(name, 2, m)
        print(table)
        lines = table.splitlines()
        assert lines[0].startswith(name) and len(lines) == 3
        assert sum(line.count("F") for line in lines[1:]) == sum(
            a.kind is Kind.FORWARD for acts in build_schedule(name, 2, m).actions for a in acts
        )
    assert "2F3" in schedule_table("interleaved-1f1b", 2, 4)
    print(build_schedule("1f1b", 2, 3).format_rank(0))
    assert build_schedule("1f1b", 2, 3).format_rank(0).startswith("F0 SA0")


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(TypeError, match="n_ranks must be an int"):
        build_schedule("1f1b", 2.0, 2)
    with pytest.raises(ValueError, match="stages_per_rank"):
        build_schedule("1f1b", 2, 2, stages_per_rank=2)


# ----------------------------------------------------------------------------- partitioning


def _model(widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def test_split_points_and_balance_agree():
    model = _model([4, 8, 8, 8, 2])  # 8 children
    by_points = plan_partition(model, 3, split_points=[2, 5])
    by_names = plan_partition(model, 3, split_points=["2", "5"])
    by_balance = plan_partition(model, 3, balance=[2, 3, 3])
    assert [(s.start, s.stop) for s in by_points] == [(0, 2), (2, 5), (5, 8)]
    assert by_points == by_names == by_balance
    print(format_partition(model, by_points))
    stage = build_stage(model, by_points[1])
    assert list(stage) == list(model)[2:5]
    assert stage[0].weight is model[2].weight


def test_partition_by_parameter_count_is_optimal():
    seed = 1234
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(20):
        widths = [rng.randint(1, 12) for _ in range(rng.randint(3, 7))]
        model = _model(widths)
        n_stages = rng.randint(1, len(model))
        spans = plan_partition(model, n_stages)
        assert [s.start for s in spans][0] == 0 and spans[-1].stop == len(model)
        assert all(s.stop > s.start for s in spans)
        best = min(
            max(
                sum(p.numel() for layer in list(model)[a:b] for p in layer.parameters())
                for a, b in zip((0, *cuts), (*cuts, len(model)))
            )
            for cuts in _all_cuts(len(model), n_stages)
        )
        assert max(s.n_params for s in spans) == best


def _all_cuts(n, k):
    import itertools

    return itertools.combinations(range(1, n), k - 1)


def test_partition_errors_show_the_numbers():
    model = _model([4, 4, 4])  # 4 children
    with pytest.raises(ValueError, match=r"2 \+ 1 = 3 != 4 layers"):
        plan_partition(model, 2, balance=[2, 1])
    with pytest.raises(ValueError, match="make 3 stages, the pipeline has 2"):
        plan_partition(model, 2, split_points=[1, 2])
    with pytest.raises(ValueError, match="rise strictly"):
        plan_partition(model, 2, split_points=[0])
    with pytest.raises(ValueError, match="no child named"):
        plan_partition(model, 2, split_points=["fc9"])
    with pytest.raises(ValueError, match="cannot split 4 layers into 5"):
        plan_partition(model, 5)
    with pytest.raises(TypeError, match="nn.Sequential"):
        plan_partition(nn.Linear(2, 2), 1)
