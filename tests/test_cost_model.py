"""The fitted cost model end to end: --calibrate writes a model that auto then decides by, and
the projection to 1,024 ranks against NCCL's published figures. No timing is asserted: the
calibration's own prediction errors are printed, for the quiet-machine rerun."""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_pool import run_ranks  # noqa: E402

from dist_kernels.bench import projection as pj  # noqa: E402
from dist_kernels.comm import cost_model as cm  # noqa: E402


def _calibrate(path):
    from dist_kernels.bench import calibrate, cli

    args = cli.parse_args(
        [
            "--calibrate",
            "--calibrate-out",
            path,
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "16",
            "--calib-blocks",
            "1",
            "--calib-iters",
            "5",
        ]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        calibrate.run_rank(args, "test")
    return out.getvalue()


def test_calibrate_writes_every_algorithm_of_the_host(tmp_path):
    path = str(tmp_path / "model.json")
    out = run_ranks(2, _calibrate, path, timeout=300)[0]  # rank 0 prints
    model = cm.load_model(path)
    assert sorted(model.shm[2]) == sorted(f"{c}/{a}" for c, a in cm.FITTED_ORDER)
    for link in model.shm[2].values():
        assert link.alpha_us >= 0 and link.beta_us_per_byte >= 0
        assert link.alpha_us + link.beta_us_per_byte > 0
    assert len(model.fitted_costs(2)) == 28 and model.meta["command"] == "test"
    # the Communicator's own cost per call, measured beside the links, for 2 ranks only
    assert list(model.call_us) == [2] and model.call_us[2] >= 0
    assert "# fit the Communicator's own cost per call" in out
    # the check prints one row per size (8 B, 128 B, 2 KiB, 32 KiB) with what auto runs
    rows = [line for line in out.splitlines() if line.startswith("#  ") and "one_shot" in line]
    assert len(rows) >= 4, out


def test_calibrate_on_one_rank_checks_what_it_runs(tmp_path):
    """One rank fits nothing on its host (no peer) but still times and prints what auto runs
    at every size (the check's own rounds) instead of failing on the measurements it lacks."""
    out = run_ranks(1, _calibrate, str(tmp_path / "one.json"), timeout=300)[0]
    rows = [line.split() for line in out.splitlines() if line.startswith("#  ") and "|" not in line]
    sizes = [row[1] for row in rows if row[1].isdigit()]
    assert sizes == ["8", "128", "2048", "32768"], out
    assert "# check: worst" in out


def test_call_cost_prices_a_communicator_call_and_survives_the_file(tmp_path):
    """``call_us[n]`` adds to a Communicator call's price on a host of n ranks only, and is
    written and read back with the links."""
    link = cm.Link(2.0, 1e-3)
    model = cm.CostModel(shm={2: {"all_reduce/ring": link}}, call_us={2: 1.25})
    steps, nbytes = cm.terms("all_reduce", "ring", 2, 4096)
    assert model.call_us_of("all_reduce", 2, 4096, "ring") == 1.25 + link.us(steps, nbytes)
    assert model.call_us_of("all_reduce", 4, 4096, "ring") == model.shm_link(
        4, "all_reduce", "ring"
    ).us(*cm.terms("all_reduce", "ring", 4, 4096))
    back = cm.load_model(cm.save_model(model, str(tmp_path / "m.json")))
    assert back.call_us == {2: 1.25} and back.shm[2]["all_reduce/ring"] == link
    # a file written before call_us existed loads with none
    assert cm.CostModel.from_json({"shm": {}, "inter": {}}).call_us == {}


def _block_order(iters_cap):
    from dist_kernels.bench import calibrate

    order = []
    calls = [(lambda k=k: order.append(k), iters_cap) for k in "abc"]
    times = calibrate._timed_all(calls, blocks=2)
    return order, times


def test_calibration_blocks_go_round_every_measurement():
    """The timed blocks alternate between measurements (a, b, c, a, b, c), after one first
    timing of each that sets its calls per block (capped by the call's own cap), so that a
    change in the machine's speed reaches every size alike."""
    from dist_kernels.bench import calibrate

    per_first = 1 + calibrate.WARMUP  # the first timing of each call
    per_block = calibrate.WARMUP + 7  # a block: untimed calls, then the capped timed ones
    for order, times in run_ranks(2, _block_order, 7):
        first, rounds = order[: 3 * per_first], order[3 * per_first :]
        assert first == [k for k in "abc" for _ in range(per_first)]
        expected = [k for _ in range(2) for k in "abc" for _ in range(per_block)]
        assert rounds == expected
        assert len(times) == 3 and all(t >= 0 for t in times)


def _auto_choices(path, sizes):
    import dist_kernels as dk

    os.environ["DK_COST_MODEL"] = path
    try:
        with dk.Communicator() as comm:
            return [comm._backend.impl.resolve_all_reduce(s // 4, 0, 0) for s in sizes]
    finally:
        os.environ.pop("DK_COST_MODEL")


def test_auto_decides_by_the_fitted_model(tmp_path):
    """A model whose tree is free and the others dear makes auto pick the tree at every size
    (the built-in model picks one-shot and the ring at 2 ranks): the extension prices each
    algorithm with its own fitted link."""
    dear, free = cm.Link(1e6, 1.0), cm.Link(1e-3, 1e-9)
    links = {f"{c}/{a}": (free if a == "tree" else dear) for c, a in cm.FITTED_ORDER}
    path = cm.save_model(cm.CostModel(shm={2: links}), str(tmp_path / "tree.json"))
    sizes = [8, 4096, 1 << 20]
    fitted, builtin = (
        run_ranks(2, _auto_choices, path, sizes)[0],
        run_ranks(2, _auto_choices, str(tmp_path / "none.json"), sizes)[0],
    )
    assert fitted == [2, 2, 2], fitted  # 2 = tree
    assert 2 not in builtin, builtin


def test_an_oversubscribed_host_sends_large_messages_in_one_chunk():
    """The same model chunks a 64 MiB all-reduce on hosts with a core per rank and not on
    oversubscribed ones (their stages share the cores: no overlap to gain); a forced chunk
    count still wins."""
    free_cores = cm.HierarchySettings().choose("all_reduce", 2, 2, 64 << 20, ["gloo"])
    crowded = cm.HierarchySettings(oversubscribed=True)
    ops = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
    chosen = [crowded.choose(op, 2, 2, 64 << 20, ["gloo"]) for op in ops]
    forced = cm.HierarchySettings(oversubscribed=True, kind="multi_leader", chunks=4)
    print(free_cores, chosen)
    assert free_cores.kind == "multi_leader" and free_cores.chunks > 1
    assert all(c.chunks == 1 for c in chosen), chosen
    assert forced.choose("all_reduce", 2, 2, 64 << 20, ["gloo"]).chunks == 4


# ------------------------------------------------------------------ projection


def test_projection_follows_nccls_latency_model():
    """NCCL's tuning model (src/graph/tuning.cc): ring latency = base + (nsteps - nInterSteps)
    intra + nInterSteps inter, nsteps = 2(n-1), nInterSteps = 2(nNodes-1); tree = base +
    2((ppn - 1) intra + log2i(nNodes) inter). The projection's 8-byte times are those."""
    links = pj.NCCL_H100
    for n in pj.WORLD_SIZES:
        nodes = n // 8
        ring = 8.4 + (2 * (n - 1) - 2 * (nodes - 1)) * 3.4 + 2 * (nodes - 1) * 9.6
        tree = 8.4 + 2 * (7 * 3.4 + int(math.log2(nodes)) * 9.6)
        assert pj.ring_us(links, n, 8, 0) == pytest.approx(ring)
        assert pj.tree_us(links, n, 8, 0) == pytest.approx(tree)


def test_projection_reproduces_the_published_figures_and_growth():
    rows = {(r["ranks"], r["bytes"]): r for r in pj.table(pj.NCCL_H100, sizes=(8, 8 << 30))}
    # nccl-tests on 8 x H100: ~365 GB/s ring busbw at large sizes
    assert rows[(8, 8 << 30)]["ring"]["busbw"] == pytest.approx(365, rel=0.01)
    # small messages: the ring grows with n, the tree with log n
    ring = [rows[(n, 8)]["ring"]["us"] for n in pj.WORLD_SIZES]
    tree = [rows[(n, 8)]["tree"]["us"] for n in pj.WORLD_SIZES]
    assert ring[-1] / ring[-2] == pytest.approx(2, rel=0.02)  # 512 -> 1024 ranks: doubled
    assert all(b - a == pytest.approx(2 * 9.6) for a, b in zip(tree[1:], tree[2:]))
    # large messages across hosts: every GPU's NIC carries 1/8 of the data in the hierarchical
    # path, so it beats one ring paced by one NIC per step
    far = rows[(1024, 8 << 30)]
    assert far["hierarchical"]["busbw"] > 2 * far["ring"]["busbw"]
