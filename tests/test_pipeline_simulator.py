"""The pipeline simulator, the schedule table and ``python -m dist_kernels.pipeline``: pure."""

import random

import pytest

import dist_kernels as dk
from dist_kernels.pipeline.__main__ import main
from dist_kernels.pipeline.actions import Kind
from dist_kernels.pipeline.profiling import average_profiles
from dist_kernels.pipeline.schedules import SCHEDULES, build_schedule
from dist_kernels.pipeline.simulator import bubble_formula, simulate
from dist_kernels.pipeline.table import schedule_table

RANKS = range(1, 9)
MICROBATCHES = range(1, 17)
EQUAL = {"F": 1.0, "B": 1.0, "W": 1.0}


def test_paper_bubble_formulas_exactly_at_equal_times():
    """Zero Bubble Pipeline Parallelism's bubbles at F = B = W, as the paper counts them (idle
    inside a rank's span over its compute): 1F1B (p-1)/m, ZB-H1 (p-1)/(3m) (for m >= p, where
    its steady state exists), ZB-H2 and ZB-V 0 (from m >= 2p - 1, enough to fill the warm-up
    with forwards). Unit times make every
    quantity an exact binary fraction, so the quotients compare bitwise."""
    for p in RANKS:
        for m in MICROBATCHES:
            assert simulate("1f1b", p, m, times=EQUAL).bubble_rate == (p - 1) / m, (p, m)
            if m >= p:
                assert simulate("zb-h1", p, m, times=EQUAL).bubble_rate == (p - 1) / (3 * m)
            if m >= 2 * p - 1:
                assert simulate("zb-h2", p, m, times=EQUAL).bubble_rate == 0.0, (p, m)
                assert simulate("zb-v", p, m, times=EQUAL).bubble_rate == 0.0, (p, m)
            if m >= 2 * p:  # DualPipeV: p - 1 - r idle chunk slots on rank r, of 6m
                sim = simulate("dualpipe-v", p, m, times=EQUAL)
                assert sim.bubble_rate == (p - 1) / (6 * m), (p, m)


def test_gpipe_1f1b_and_interleaved_textbook_bubble_under_several_costs():
    """The share of the step: (p-1)/(m+p-1) for GPipe and 1F1B whatever the costs; Megatron's
    (p-1)/(v m + p - 1) for interleaved 1F1B (v = 2, 3 stages per rank)."""
    costs = [EQUAL, {"F": 1.0, "BW": 1.0}, {"F": 1.0, "B": 3.0, "W": 0.5}]
    for p in RANKS:
        for m in MICROBATCHES:
            for times in costs:
                for name in ("gpipe", "1f1b"):
                    sim = simulate(name, p, m, times=times)
                    assert sim.bubble_fraction == pytest.approx(bubble_formula(p, m), abs=1e-12)
            if m % p == 0:
                for v in (2, 3):
                    sim = simulate("interleaved-1f1b", p, m, stages_per_rank=v)
                    expected = (p - 1) / (v * m + p - 1)
                    assert sim.bubble_fraction == pytest.approx(expected, abs=1e-12), (p, m, v)


def test_step_time_of_one_rank_share_per_action():
    """At F = B = W = 1 per rank's share: 1F1B 3(m + p - 1), ZB-H1 and ZB-H2 3m + p - 1 (the
    single-step lower bound: rank p - 1 cannot start earlier), ZB-V 3m + (p - 1)/2 (its
    stages are half a rank's share, so the ramp halves)."""
    for p in RANKS:
        for m in range(2 * p, 17):
            assert simulate("1f1b", p, m).step_time == 3 * (m + p - 1)
            assert simulate("zb-h1", p, m).step_time == 3 * m + p - 1
            assert simulate("zb-h2", p, m).step_time == 3 * m + p - 1
            assert simulate("zb-v", p, m).step_time == 3 * m + (p - 1) / 2


def test_peak_activations():
    """1F1B holds p - s on stage s; ZB-H1 keeps 1F1B's peak (p, on every stage); ZB-H2 at
    most 2p - 1; ZB-V at most p per rank of half-size stages (1F1B's memory), DualPipeV
    p + 1/2; interleaved 1F1B at most v p chunks on a stage (v = 2)."""
    for p in RANKS:
        for m in range(2 * p, 17):
            one = simulate("1f1b", p, m)
            assert one.peak_activations == tuple(p - s for s in range(p))
            assert simulate("zb-h1", p, m).peak_activations == (p,) * p
            assert max(simulate("zb-h2", p, m).peak_activations) <= 2 * p - 1
            assert max(simulate("zb-v", p, m).peak_memory) <= p
            assert simulate("gpipe", p, m).peak_memory == (float(m),) * p
            assert max(simulate("dualpipe-v", p, m).peak_memory) == p + 0.5
            if m % p == 0:
                assert max(simulate("interleaved-1f1b", p, m).peak_activations) <= 2 * p


def _dataflow_step_time(schedule, cost, p2p) -> float:
    """Step time from the compute steps alone, independently of the simulator: each starts
    when its rank is free and the steps it needs have ended (plus p2p from another rank)."""
    end = {}
    clock = [0.0] * schedule.n_ranks
    pending = [[a for a in acts if a.kind.is_compute] for acts in schedule.actions]
    last = schedule.n_stages - 1
    while any(pending):
        for r, steps in enumerate(pending):
            while steps:
                a = steps[0]
                needs = []
                if a.kind is Kind.FORWARD and a.stage > 0:
                    needs.append((Kind.FORWARD, a.stage - 1))
                if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and a.stage < last:
                    needs.append(("grad", a.stage + 1))
                got = [end.get((k, s, a.microbatch)) for k, s in needs]
                if None in got:
                    break
                lags = [p2p if schedule.rank_of(s) != r else 0.0 for _, s in needs]
                start = max([clock[r]] + [t + lag for t, lag in zip(got, lags)])
                clock[r] = start + cost(a)
                end[a.key] = clock[r]
                if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                    end[("grad", a.stage, a.microbatch)] = clock[r]
                steps.pop(0)
    return max(clock)


def test_step_time_matches_a_plain_dataflow_with_random_times_and_latency():
    """Random per-stage times and a transfer latency: the simulator's step time equals the
    dataflow of the compute steps (the runtime's sends never block, and each peer's messages
    are taken in order, so nothing else delays a step)."""
    seed = 20261202
    print("seed", seed)
    rng = random.Random(seed)
    for name in SCHEDULES:
        for p, m in ((2, 8), (3, 6), (4, 8)):
            schedule = build_schedule(name, p, m)
            n = schedule.n_stages
            times = {k: [rng.uniform(0.5, 2.0) for _ in range(n)] for k in ("F", "B", "W")}
            p2p = rng.uniform(0.0, 0.5)
            sim = simulate(schedule, times=times, p2p=p2p)
            expected = _dataflow_step_time(schedule, lambda a, t=times: _cost(a, t), p2p)
            assert sim.step_time == pytest.approx(expected)


def _cost(a, times) -> float:
    if a.kind is Kind.BACKWARD:
        return times["B"][a.stage] + times["W"][a.stage]
    of = {Kind.FORWARD: "F", Kind.BACKWARD_INPUT: "B", Kind.BACKWARD_WEIGHT: "W"}
    return times[of[a.kind]][a.stage]


def test_transfer_costs_in_closed_form():
    """One micro-batch through 2 ranks: F, a transfer, F, B, a transfer, B; a send costs its
    thread ``send``, its message arrives ``p2p`` later, and a receive costs ``recv``."""
    times = {"F": 1.0, "B": 2.0, "W": 3.0, "send": 0.25, "recv": 0.125}
    sim = simulate("1f1b", 2, 1, times=times, p2p=0.5)
    assert sim.step_time == 1.0 + 0.25 + 0.5 + 0.125 + 1.0 + 5.0 + 0.25 + 0.5 + 0.125 + 5.0
    # per-stage times: stage 0 fast, stage 1 slow
    sim = simulate("1f1b", 2, 1, times={"F": [1.0, 4.0], "BW": [2.0, 8.0]})
    assert sim.step_time == 1.0 + 4.0 + 8.0 + 2.0
    assert sim.bubble_fraction == pytest.approx(1 - 15.0 / 30.0)
    # a step's own cost outside its actions (the loss broadcast, ...): once, as bubble
    sim = simulate("1f1b", 2, 1, times={"F": [1.0, 4.0], "BW": [2.0, 8.0], "step": 5.0})
    assert sim.step_time == 1.0 + 4.0 + 8.0 + 2.0 + 5.0
    assert sim.bubble_fraction == pytest.approx(1 - 15.0 / 40.0)


def test_zb_v_timeline_by_hand():
    """ZB-V on 2 ranks, one micro-batch, a different time for every stage and action: rank 0
    holds stages 0 and 3, rank 1 stages 1 and 2 (handed over in memory: no transfer, no
    cost). Every start and end computed by hand from send 0.5, recv 0.25, p2p 0.125."""
    times = {"F": [1.0, 2.0, 3.0, 4.0], "B": [5.0, 6.0, 7.0, 8.0], "W": [9.0, 10.0, 11.0, 12.0]}
    times.update(send=0.5, recv=0.25, step=0.75)
    sim = simulate("zb-v", 2, 1, times=times, p2p=0.125)
    drawn = [[(start, end, a.label(True)) for start, end, a in rank] for rank in sim.timeline]
    assert drawn[0] == [
        (0.0, 1.0, "0F0"),  # then SA0: 1.5, there at 1.625
        (7.75, 11.75, "3F0"),  # RA0 there at 7.5, + recv
        (11.75, 19.75, "3I0"),  # then SG0: 20.25, there at 20.375
        (20.25, 32.25, "3W0"),
        (45.5, 50.5, "0I0"),  # RG0 there at 45.25, + recv
        (50.5, 59.5, "0W0"),
    ]
    assert drawn[1] == [
        (1.875, 3.875, "1F0"),  # RA0 there at 1.625, + recv
        (3.875, 6.875, "2F0"),  # in memory; then SA0: 7.375, there at 7.5
        (20.625, 27.625, "2I0"),  # RG0 there at 20.375, + recv
        (27.625, 38.625, "2W0"),
        (38.625, 44.625, "1I0"),  # in memory; then SG0: 45.125, there at 45.25
        (45.125, 55.125, "1W0"),
    ]
    assert sim.step_time == 59.5 + 0.75


def test_average_profiles_of_several_moments():
    """Profiles taken one step at a time between timed steps, combined: the mean of each time
    (per stage), the least receive, the median latency."""

    def profile(f, send, recv, step, p2p):
        return {"times": {"F": f, "send": send, "recv": recv, "step": step}, "p2p": p2p}

    rounds = [
        profile([1.0, 2.0], 0.5, 0.25, 1.0, 0.125),
        profile([3.0, 6.0], 1.5, 0.0625, 2.0, 0.5),
        profile([2.0, 1.0], 1.0, 0.125, 3.0, 0.25),
    ]
    assert average_profiles(rounds) == profile([2.0, 3.0], 1.0, 0.0625, 2.0, 0.25)
    assert average_profiles(rounds[:1]) == rounds[0]
    with pytest.raises(ValueError, match="at least one"):
        average_profiles([])


def test_simulate_arguments():
    with pytest.raises(ValueError, match="unknown key.*'X'"):
        simulate("1f1b", 2, 2, times={"X": 1.0})
    with pytest.raises(ValueError, match=r"times\['F'\]: 1 values for 2 stages"):
        simulate("1f1b", 2, 2, times={"F": [1.0]})
    with pytest.raises(ValueError, match="must be >= 0"):
        simulate("1f1b", 2, 2, times={"W": -1.0})
    with pytest.raises(ValueError, match="needs n_stages and n_microbatches"):
        simulate("1f1b")
    assert dk.pipeline.simulate is simulate


def test_schedule_table_prints_every_step():
    for name in SCHEDULES:
        for p, m in ((2, 4), (3, 6)):
            table = schedule_table(name, p, m)
            print(table)
            lines = table.splitlines()
            assert lines[0].startswith(f"{name}: {p} ranks") and len(lines) == p + 1
            schedule = build_schedule(name, p, m)
            for kind in ("F", "I", "W", "B"):
                drawn = sum(cell.endswith(f"{kind}{mb}") for line in lines[1:]
                            for cell in line.split() for mb in range(m))  # fmt: skip
                assert drawn == sum(a.kind.value == kind for acts in schedule.actions
                                    for a in acts), (name, kind)  # fmt: skip
    assert "2F3" in schedule_table("interleaved-1f1b", 2, 4)
    print(build_schedule("1f1b", 2, 3).format_rank(0))
    assert build_schedule("1f1b", 2, 3).format_rank(0).startswith("F0 SA0")


def test_command_line_table(capsys):
    main(["--stages", "2,4", "--schedules", "1f1b,zb-h1,zb-v", "--times", "F=1,B=1,W=1"])
    out = capsys.readouterr().out
    print(out)
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[2]) for r in rows] == [
        (p, s) for p in ("2", "4") for s in ("1f1b", "zb-h1", "zb-v")
    ]
    zb_h1_4 = rows[4]
    assert float(zb_h1_4[3]) == 3 * 8 + 3 and zb_h1_4[4] == f"{33 / 27:.2f}x"
    with pytest.raises(SystemExit):
        main(["--schedules", "zigzag"])


class _Recording:
    """Rank 1's side of gather_times: keeps what it would all-reduce."""

    rank, world_size = 1, 2

    def __init__(self):
        self.sent = []

    def all_reduce(self, t):
        self.sent.append(t.clone())


class _Summing:
    """Rank 0's side: each all-reduce adds rank 1's tensor of the same call."""

    rank, world_size = 0, 2

    def __init__(self, others):
        self.others = list(others)

    def all_reduce(self, t):
        t += self.others.pop(0)


def test_profile_step_cost_takes_the_loss_broadcast_of_the_last_rank_to_reach_it():
    """The root of a 1F1B step finishes first and waits in the loss broadcast for rank 0's
    last backward; that wait is on the simulator's timeline already, so the step's own cost
    takes the broadcast as the rank that reached it last saw it (the shorter), and the
    largest of the ranks' split-and-send costs."""
    from dist_kernels.pipeline.profiling import ActionTimer, gather_times

    root, other = ActionTimer(), ActionTimer()
    root.step_costs = [(0.10, 1.30), (0.10, 1.50)]  # (split + wait for sends, broadcast)
    other.step_costs = [(0.20, 0.05), (0.20, 0.07)]
    root.compute[("F", 1)] = [1.0]
    other.compute[("F", 0)] = [2.0]
    recording = _Recording()
    gather_times(other, 2, recording)
    times = gather_times(root, 2, _Summing(recording.sent))
    assert times["step"] == pytest.approx(0.20 + 0.06)
    assert times["F"] == [2.0, 1.0]
