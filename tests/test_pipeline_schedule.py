"""Pipeline schedules, the checker and partitioning: pure planning, no processes."""

import random

import pytest
import torch.nn as nn

from dist_kernels.pipeline.actions import Action, Kind, Schedule
from dist_kernels.pipeline.checker import ScheduleError, check_schedule, runtime_order
from dist_kernels.pipeline.partition import build_stage, format_partition, plan_partition
from dist_kernels.pipeline.schedules import SCHEDULES, build_schedule

RANKS = range(1, 9)
MICROBATCHES = range(1, 17)
F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


def _count(schedule: Schedule, kind: Kind) -> int:
    return sum(a.kind is kind for acts in schedule.actions for a in acts)


def _allowed(name: str, p: int, m: int) -> bool:
    if name == "interleaved-1f1b":
        return m % p == 0
    if name == "dualpipe-v":
        return m >= 2 * p
    return True


def _every_schedule():
    for name in SCHEDULES:
        for p in RANKS:
            for m in MICROBATCHES:
                if _allowed(name, p, m):
                    yield name, p, m


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_passes_the_checker_with_each_step_once(name):
    """1-8 ranks, 1-16 micro-batches: the fake runtime runs every list to the end, and every
    stage runs each micro-batch's forward once and its backward once (a B, or an I and a W)."""
    for _, p, m in (c for c in _every_schedule() if c[0] == name):
        schedule = build_schedule(name, p, m)
        check_schedule(schedule)
        per_rank = 2 if name in ("interleaved-1f1b", "zb-v", "dualpipe-v") else 1
        assert schedule.n_stages == p * per_rank
        steps = {}
        for rank, acts in enumerate(schedule.actions):
            for a in acts:
                if a.kind.is_compute:
                    assert schedule.rank_of(a.stage) == rank
                    steps.setdefault((a.stage, a.microbatch), []).append(a.kind)
        assert len(steps) == schedule.n_stages * m, (p, m)
        for kinds in steps.values():
            assert sorted(kinds) in (sorted([F, B]), sorted([F, I, W])), (p, m, kinds)
        split = name.startswith("zb") or name == "dualpipe-v"
        assert schedule.splits_backward == (split and _count(schedule, W) > 0)


def test_1f1b_is_the_textbook_order():
    """Rank r warms up with min(p - r - 1, m) forwards, then alternates one forward and one
    backward, then drains: at most p - r micro-batches' activations held (Narayanan et al.)."""
    for p in RANKS:
        for m in MICROBATCHES:
            schedule = build_schedule("1f1b", p, m)
            for rank, acts in enumerate(schedule.actions):
                order = [(a.kind, a.microbatch) for a in acts if a.kind.is_compute]
                warmup = min(p - rank - 1, m)
                expected = [(F, i) for i in range(warmup)]
                for i in range(m - warmup):
                    expected += [(F, warmup + i), (B, i)]
                expected += [(B, i) for i in range(m - warmup, m)]
                assert order == expected, (p, m, rank, order)


def test_v_placement_puts_two_stages_on_each_rank():
    schedule = build_schedule("zb-v", 4, 8)
    assert [schedule.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert build_schedule("interleaved-1f1b", 4, 8).stages_of(1) == [1, 5]


def test_transfers_pair_up_on_each_channel():
    for name in ("1f1b", "zb-h1"):
        schedule = build_schedule(name, 4, 6)
        for rank, acts in enumerate(schedule.actions):
            for a in acts:
                if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
                    assert a.peer == rank + 1
                if a.kind in (Kind.SEND_GRAD, Kind.RECV_ACT):
                    assert a.peer == rank - 1
        assert _count(schedule, Kind.SEND_ACT) == _count(schedule, Kind.RECV_ACT) == 3 * 6
        assert _count(schedule, Kind.SEND_GRAD) == _count(schedule, Kind.RECV_GRAD) == 3 * 6
    # V: stage p - 1 hands its activation to stage p on the same rank: no transfer
    schedule = build_schedule("zb-v", 2, 3)
    assert _count(schedule, Kind.SEND_ACT) == 2 * 3  # stages 0 -> 1 and 2 -> 3


def _blocking_replay(schedule: Schedule) -> None:
    """Replays the lists with blocking transfers on both ends (a send waits for its receive),
    independently of the checker: the builder promises lists from one global execution."""
    pos = [0] * schedule.n_ranks
    acts = schedule.actions
    while True:
        moved = False
        for r in range(schedule.n_ranks):
            while pos[r] < len(acts[r]) and acts[r][pos[r]].kind.is_compute:
                pos[r] += 1
                moved = True
            if pos[r] < len(acts[r]) and acts[r][pos[r]].kind.is_send:
                a = acts[r][pos[r]]
                theirs = acts[a.peer][pos[a.peer]] if pos[a.peer] < len(acts[a.peer]) else None
                if theirs is not None and theirs.kind.is_recv and theirs.peer == r:
                    assert (theirs.stage, theirs.microbatch) == (
                        a.stage + (1 if a.kind is Kind.SEND_ACT else -1),
                        a.microbatch,
                    ), (r, a, theirs)
                    pos[r] += 1
                    pos[a.peer] += 1
                    moved = True
        if all(pos[r] == len(acts[r]) for r in range(schedule.n_ranks)):
            return
        assert moved, f"{schedule.name}: blocking replay stuck at {pos}"


def test_lists_replay_with_blocking_transfers():
    for name, p, m in _every_schedule():
        if p <= 4 and m <= 8:
            _blocking_replay(build_schedule(name, p, m))


def test_each_send_right_behind_its_step():
    """The runtime sends in list order (an isend), so the builder puts every send right behind
    the compute step producing its tensor (receives may sit between them)."""
    for name, p, m in _every_schedule():
        if p > 4:
            continue
        for acts in build_schedule(name, p, m).actions:
            order = runtime_order(acts)
            assert order == [a for a in acts if not a.kind.is_recv]
            for before, send in zip(order, order[1:]):
                if send.kind.is_send:
                    assert before.kind in (F, B, I) and before.stage == send.stage, (name, p, m)
                    assert before.microbatch == send.microbatch


# ----------------------------------------------------------------------------- the checker


def _with_rank_actions(schedule: Schedule, rank: int, actions) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return Schedule(
        schedule.name,
        schedule.n_ranks,
        schedule.n_stages,
        schedule.n_microbatches,
        tuple(lists),
        schedule.placement,
    )


def _swap(actions, i: int, j: int):
    acts = list(actions)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def _index(actions, kind: Kind, mb: int) -> int:
    return next(i for i, a in enumerate(actions) if a.kind is kind and a.microbatch == mb)


def test_checker_rejects_a_deadlock():
    # Rank 0 sends micro-batch 0's activation only after its backward, which waits for the
    # gradient rank 1 can only make from that activation.
    one = build_schedule("1f1b", 2, 1)
    acts = [a for a in one.actions[0] if a.kind is not Kind.SEND_ACT]
    with pytest.raises(ScheduleError, match="1f1b: deadlock; rank 0: backward of stage 0, "
                       "micro-batch 0 waits .recv-grad.*rank 1: forward of stage 1"):  # fmt: skip
        check_schedule(_with_rank_actions(one, 0, [*acts, Action(Kind.SEND_ACT, 0, 0, 1)]))
    # A planted bad zero-bubble schedule: rank 0 holds micro-batch 1's activation back until
    # the end, behind the I that needs rank 1's gradient of it.
    zb = build_schedule("zb-h1", 2, 2)
    acts = [a for a in zb.actions[0] if a.key != (Kind.SEND_ACT, 0, 1)]
    with pytest.raises(ScheduleError, match="zb-h1: deadlock"):
        check_schedule(_with_rank_actions(zb, 0, [*acts, Action(Kind.SEND_ACT, 0, 1, 1)]))


def test_checker_rejects_use_before_produce():
    zb = build_schedule("zb-h1", 2, 3)
    acts = zb.actions[1]
    i, w = _index(acts, I, 0), _index(acts, W, 0)
    with pytest.raises(ScheduleError, match="rank 1, weight-gradient backward of stage 1, "
                       "micro-batch 0: weight gradient before its I"):  # fmt: skip
        check_schedule(_with_rank_actions(zb, 1, _swap(acts, i, w)))
    with pytest.raises(ScheduleError, match="backward before its forward"):
        gpipe = build_schedule("gpipe", 1, 2)
        check_schedule(_with_rank_actions(gpipe, 0, [Action(B, 0, 0), *gpipe.actions[0]]))
    one = build_schedule("1f1b", 2, 2)
    acts = list(one.actions[1])
    first_send = next(i for i, a in enumerate(acts) if a.kind is Kind.SEND_GRAD)
    moved = [acts[first_send], *acts[:first_send], *acts[first_send + 1 :]]
    with pytest.raises(ScheduleError, match="sends before the step that produces it"):
        check_schedule(_with_rank_actions(one, 1, moved))
    # Rank 1 expects micro-batch 1 first while rank 0 sends micro-batch 0.
    i, j = [k for k, a in enumerate(acts) if a.kind is Kind.RECV_ACT][:2]
    with pytest.raises(ScheduleError, match="on that channel"):
        check_schedule(_with_rank_actions(one, 1, _swap(acts, i, j)))
    # A V stage hands over in memory: stage 4 of rank 3 needs stage 3's forward first.
    v = build_schedule("zb-v", 4, 8)
    acts = v.actions[3]
    f3, f4 = _index(acts, F, 0), next(k for k, a in enumerate(acts) if a.key == (F, 4, 0))
    with pytest.raises(ScheduleError, match="from stage 3 .this rank. is not computed yet"):
        check_schedule(_with_rank_actions(v, 3, _swap(acts, f3, f4)))


def test_checker_rejects_double_frees_and_leftovers():
    zb = build_schedule("zb-h1", 2, 2)
    acts = list(zb.actions[0])
    w0 = _index(acts, W, 0)
    with pytest.raises(ScheduleError, match="runs twice"):
        check_schedule(_with_rank_actions(zb, 0, acts[: w0 + 1] + [acts[w0]] + acts[w0 + 1 :]))
    # A full backward after the split halves frees the activations a second time.
    twice = acts + [Action(W, 0, 1)]
    twice[_index(twice, W, 1)] = Action(B, 0, 1)
    with pytest.raises(ScheduleError, match="input gradient of this micro-batch was computed"):
        check_schedule(_with_rank_actions(zb, 0, twice))
    # W after a full B: the activations are gone.
    one = build_schedule("1f1b", 1, 2)
    with pytest.raises(ScheduleError, match="weight gradient its backward ran in full already"):
        check_schedule(_with_rank_actions(one, 0, [*one.actions[0], Action(W, 0, 0)]))
    with pytest.raises(ScheduleError, match="weight-gradient backward of stage 0, micro-batch 1 "
                       "never runs"):  # fmt: skip
        check_schedule(_with_rank_actions(zb, 0, [a for a in acts if a.key != (W, 0, 1)]))
    gpipe = build_schedule("gpipe", 1, 2)
    with pytest.raises(ScheduleError, match="never runs"):
        check_schedule(_with_rank_actions(gpipe, 0, gpipe.actions[0][:-1]))
    with pytest.raises(ScheduleError, match="stage 1 belongs to rank 1"):
        two = build_schedule("1f1b", 2, 1)
        check_schedule(_with_rank_actions(two, 0, [Action(F, 1, 0), *two.actions[0]]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(TypeError, match="n_ranks must be an int"):
        build_schedule("1f1b", 2.0, 2)
    with pytest.raises(ValueError, match="1f1b has 1 stage.s. per rank"):
        build_schedule("1f1b", 2, 2, stages_per_rank=2)
    with pytest.raises(ValueError, match="zb-v has 2 stage.s. per rank"):
        build_schedule("zb-v", 2, 2, stages_per_rank=3)
    with pytest.raises(ValueError, match=r"dualpipe-v needs n_microbatches \(7\) >= 2 x"):
        build_schedule("dualpipe-v", 4, 7)
    with pytest.raises(ValueError, match=r"n_microbatches \(6\).*\(4\)"):
        build_schedule("interleaved-1f1b", 4, 6)


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
