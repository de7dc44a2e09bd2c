"""A planted hang on 3 ranks, seen by torch's analyzer and by our desync report.

All ranks run all-reduce #1; then rank 0 calls all-reduce #2, rank 1 skips it (it sleeps, as a
rank stuck in its data loader would), rank 2 calls a broadcast instead. Ranks 0 and 2 fail
(their calls disagree); rank 1 learns of it from the Store. Every rank must dump its flight
recorder, torch's analyzer must name rank 1 as missing from collective #2 and rank 2's
broadcast as the mismatch, and every rank must print our report, naming both, within 5 s of
detecting the failure.

The report's logic (pure, over footprints) is also checked on hand-made footprints.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import time

import torch
from mp_pool import run_ranks

from dist_kernels.debug import desync

REPORT_WAIT_S = 10.0  # how long a rank looks for its report (the claim checked is 5 s)


def _wait_for_report(since: int):
    from dist_kernels import debug

    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline:
        found = [r for r in debug.reports() if r["detected_ns"] >= since]
        if found:
            return found[0]
        time.sleep(0.05)
    return None


def _planted_hang():
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    begin = time.time_ns()
    comm = dk.Communicator(timeout=datetime.timedelta(seconds=20))
    t = torch.ones(4)
    comm.all_reduce(t)
    error = None
    try:
        if rank == 0:
            comm.all_reduce(t)
        elif rank == 2:
            comm.broadcast(t, 0)
    except dk.CommError as e:
        error = str(e)
    report = _wait_for_report(begin)
    name = comm._debug_source.name  # "dk:0", or "dk:0:<n>" in a worker that made others before
    path = f"{os.environ['DK_TRACE_FILE']}{rank}"
    with open(path, "rb") as f:
        automatic = pickle.load(f)
    # this communicator alone, for the analyzer: the pool's workers keep other tests' groups
    # (and torch's analyzer, which aligns every group of a dump by record id, would mix them in)
    dk.debug.dump(path, [comm])
    comm.close()
    return error, report, name, automatic


def test_planted_hang_is_named_by_torchs_analyzer_and_our_report(tmp_path):
    prefix = str(tmp_path / "dk_trace_rank_")
    results = run_ranks(3, _planted_hang, env={"DK_TRACE_FILE": prefix}, timeout=180)
    (error0, report0, name, dump0), (error1, report1, _, _), (error2, report2, _, _) = results
    assert error0 is not None and error2 is not None and error1 is None
    ours = [e for e in dump0["entries"] if e["process_group"][0] == name]  # the automatic dump
    assert [(e["profiling_name"], e["state"]) for e in ours] == [
        ("gloo:all_reduce", "completed"),
        ("gloo:all_reduce", "started"),
    ]
    for rank, report in enumerate((report0, report1, report2)):
        assert report is not None, f"rank {rank} printed no report"
        text = report["text"]
        assert text.startswith(f"[rank {rank}] desync report for group {name!r} (3 ranks)"), text
        assert "rank 1 finished collective #1, but didn't join collective #2" in text, text
        assert (
            "collective #2 differs: rank 0 called all_reduce(count=4, float32, sum); "
            "rank 2 called broadcast(count=4, float32, root=0)"
        ) in text, text
        assert report["time_ns"] - report["detected_ns"] < 5e9, (rank, report)
    # every rank dumped; torch's analyzer, unchanged, reads the dumps
    assert sorted(os.listdir(tmp_path)) == [f"dk_trace_rank_{r}" for r in range(3)]
    analyzed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path),
         "--prefix", "dk_trace_rank_", "-o", str(tmp_path / "db.pkl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert analyzed.returncode == 0, analyzed.stderr
    log = analyzed.stdout + analyzed.stderr
    assert "Not all ranks joining collective, sequence number: 2" in log, log
    assert "missing ranks: {1}" in log, log
    with open(tmp_path / "db.pkl", "rb") as f:
        _, db = pickle.load(f)
    first, second = db.collectives
    assert first.pass_check and first.collective_name == "gloo:all_reduce"
    assert not second.pass_check and second.missing_ranks == {1}
    # the analyzer starts from whichever dump it read first: rank 0's view or rank 2's
    ((culprit, mismatched),) = second.mismatch_collectives.items()
    assert culprit in (0, 2)
    calls = {second.collective_name, mismatched.collective_name}
    assert calls == {"gloo:all_reduce", "gloo:broadcast"}
    assert mismatched.type_of_mismatch.state.name == "COLLECTIVE_TYPE_MISMATCH"


def _footprint(scheduled, completed, ops, final=True, failure=""):
    return {
        "host": "h",
        "pid": 1,
        "time_ns": 0,
        "final": final,
        "last_scheduled": scheduled,
        "last_started": scheduled,
        "last_completed": completed,
        "p2p_pending": 0,
        "failure": failure,
        "ops": {str(k): v for k, v in ops.items()},
    }


def test_report_names_laggards_stuck_ranks_and_differences():
    prints = {
        0: _footprint(183, 182, {182: "all_reduce(a)", 183: "all_reduce(b)"}),
        1: _footprint(182, 182, {182: "all_reduce(a)"}),
        2: _footprint(183, 182, {182: "all_reduce(a)", 183: "all_gather(c)"}, final=False),
        3: None,
    }
    text = desync.report("tp", 0, [4, 5, 6, 7], prints, "timeout")
    lines = text.split("\n")
    assert lines[0] == "[rank 4] desync report for group 'tp' (4 ranks) after: timeout"
    assert "\t - rank 7 published no footprint" in lines[1]
    assert (
        "\t - rank 5 finished collective #182, but didn't join collective #183 (count from 1)"
        in lines
    )
    assert "\t - ranks [4, 6] joined but didn't finish collective #183" in lines
    assert (
        "\t - collective #183 differs: rank 4 called all_reduce(b); rank 6 called all_gather(c)"
        in lines
    )
    assert any(
        line.endswith("(its footprint from before the failure: no answer since)") for line in lines
    )


def test_report_when_every_rank_is_even():
    prints = {m: _footprint(5, 5, {5: "barrier(count=0)"}) for m in range(2)}
    text = desync.report("g", 1, [0, 1], prints, "peer died")
    assert "every rank finished collective #5 and scheduled no other" in text
