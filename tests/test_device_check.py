"""benchmarks/device_check.sh's own plumbing, on CPU: ``DK_DEVICE_CHECK_DRY=1`` runs every step
with a stand-in command, so the steps, the time budget, the statuses, the report and $OUT are
tested before a GPU ever runs the script.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STEPS = [
    "precheck",
    "driver",
    "toolchain",
    "device",
    "build",
    "info",
    "gpu_tests",
    "bench_ws1",
    "bench_ws2",
    "bench_kernels",
]
REFERENCE_BUDGET_S = 480
#: The step shares at the reference budget, as the script sets them (the test checks the sum).
SHARES = {
    "precheck": 5,
    "driver": 10,
    "toolchain": 10,
    "device": 20,
    "build": 150,
    "info": 15,
    "gpu_tests": 160,
    "bench_ws1": 30,
    "bench_ws2": 45,
    "bench_kernels": 35,
}


def _share(name: str, budget: int) -> int:
    """The script's share_of: the share scaled to the budget, at least 1 s."""
    return max(1, SHARES[name] * budget // REFERENCE_BUDGET_S)


pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils' timeout",
)


def _env(out: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DK_DEVICE_CHECK")}
    env.update(
        DK_DEVICE_CHECK_DRY="1",
        OUT=str(out),
        PYTHON=sys.executable,
        DK_CHECK_RESULTS_DIR=str(out / "results"),
        TMPDIR=str(out.parent),  # the script's work folder, even if a test kills the script
    )
    env.pop("DK_CHECK_BUDGET_S", None)
    env.update(extra)
    return env


def _dry_run(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir()
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env=_env(out, **extra),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _report(directory: Path) -> dict:
    (path,) = directory.glob("*-dry-run.json")
    return json.loads(path.read_text())


def test_dry_run_passes_every_step_and_writes_log_and_report(tmp_path):
    result = _dry_run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    report = _report(out)
    assert [s["name"] for s in report["steps"]] == STEPS
    assert all(s["status"] == "ok" for s in report["steps"]), report["steps"]
    assert report["final"] and report["passed"] and report["budget_s"] == REFERENCE_BUDGET_S
    # The shares fill the budget and no more: the check fits one 10-minute device command (run
    # with a timeout of about 540 s), and a step whose predecessors ended at once gets their
    # unused seconds on top of its own share.
    assert sum(SHARES.values()) == REFERENCE_BUDGET_S <= 8 * 60
    # The script counts whole seconds from its start, setup included: on a busy machine the
    # clock may tick once or twice before a step begins (CI saw the first step's 5 s share
    # start with 4 s left), so a limit may fall short of its share by that much, no more.
    for s in report["steps"]:
        assert s["limit_s"] >= SHARES[s["name"]] - 2, s
    log = (out / "device_check.log").read_text()
    for name, share in SHARES.items():  # DK_DEVICE_CHECK_DRY=1 prints the budget's fit
        assert re.search(rf"^{name} +{share}s ", log, re.M), name
    # What comes back from the device: at most 8 files, no stale report of another name.
    names = sorted(p.name for p in out.iterdir() if p.is_file())
    assert len(names) == 3 and len([n for n in names if n.endswith("-dry-run.json")]) == 1, names
    assert "device check passed" in log and "NCCL_DEBUG=WARN" in log
    md = next(out.glob("*-dry-run.md")).read_text()
    assert "Result: **passed**" in md and "| gpu_tests | ok |" in md
    assert _report(out / "results") == report  # and the copy for benchmarks/results/
    commands = {s["name"]: s["command"] for s in report["steps"]}
    # World size 1 is one rank; two ranks share the GPU over sockets, one NCCL_HOSTID each.
    assert "--nproc 1" in commands["bench_ws1"]
    assert "NCCL_NET=Socket" in commands["bench_ws2"]
    assert "--nproc_per_node=2" in commands["bench_ws2"]
    assert f"--json {out}/bench_ws2.json" in commands["bench_ws2"]
    assert "--durations=10" in commands["gpu_tests"]
    # pytest's per-test timeout is shorter than the step's limit: a hang ends in a summary.
    timeout = int(re.search(r"--timeout=(\d+)", commands["gpu_tests"]).group(1))
    assert timeout < report["steps"][STEPS.index("gpu_tests")]["limit_s"]
    assert "DK_REQUIRE_GPU=1" in commands["gpu_tests"]


def test_failure_timeout_and_skips_are_reported(tmp_path):
    # Budget 12 s: bench_kernels's deadline is the budget's end, when its stand-in is killed.
    result = _dry_run(
        tmp_path,
        DK_CHECK_BUDGET_S="12",
        DK_DEVICE_CHECK_DRY_FAIL="driver",
        DK_DEVICE_CHECK_DRY_HANG="bench_kernels",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    status = {s["name"]: s["status"] for s in _report(tmp_path / "out")["steps"]}
    assert status["driver"] == "failed" and status["bench_kernels"] == "timeout", status
    assert status["gpu_tests"] == "ok"
    md = next((tmp_path / "out").glob("*-dry-run.md")).read_text()
    assert "Result: **FAILED**" in md
    assert "device check FAILED" in (tmp_path / "out" / "device_check.log").read_text()


def test_a_hung_step_leaves_the_later_steps_their_share(tmp_path):
    """gpu_tests hangs until its deadline; the benchmarks after it still get their own shares,
    and gpu_tests itself got the seconds the steps before it left unused. (48 s: at 24 s the
    build's stand-in had 2 s, which a python start on a loaded 2-core machine can exceed.)"""
    budget = 48
    result = _dry_run(tmp_path, DK_CHECK_BUDGET_S=str(budget), DK_DEVICE_CHECK_DRY_HANG="gpu_tests")
    assert result.returncode == 1, result.stdout + result.stderr
    steps = {s["name"]: s for s in _report(tmp_path / "out")["steps"]}
    assert steps["gpu_tests"]["status"] == "timeout", steps  # every step's report if not
    assert steps["gpu_tests"]["limit_s"] > _share("gpu_tests", budget)  # carried over
    for name in ("bench_ws1", "bench_ws2", "bench_kernels"):
        # Its share, less at most a second of the reports written between steps.
        assert steps[name]["status"] == "ok", steps[name]
        assert steps[name]["limit_s"] >= _share(name, budget) - 1, steps[name]
    assert sum(s["seconds"] for s in steps.values()) <= budget


def test_a_slow_step_passes_its_unused_time_on(tmp_path):
    """A step that takes 3 s of its share: the next step's limit is its own share plus the rest."""
    budget = 48
    result = _dry_run(tmp_path, DK_CHECK_BUDGET_S=str(budget), DK_DEVICE_CHECK_DRY_SLOW="build:3")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = {s["name"]: s for s in _report(tmp_path / "out")["steps"]}
    assert steps["build"]["status"] == "ok" and steps["build"]["seconds"] >= 3
    unused = _share("build", budget) - steps["build"]["seconds"]
    assert steps["info"]["limit_s"] >= _share("info", budget) + unused - 2, steps["info"]


def test_failed_build_skips_the_steps_that_need_it(tmp_path):
    result = _dry_run(tmp_path, DK_DEVICE_CHECK_DRY_FAIL="build")
    assert result.returncode == 1
    status = {s["name"]: s["status"] for s in _report(tmp_path / "out")["steps"]}
    assert status["build"] == "failed"
    for name in ("info", "gpu_tests", "bench_ws1", "bench_ws2", "bench_kernels"):
        assert status[name] == "skipped", status


def test_report_and_log_reach_out_while_the_check_runs(tmp_path):
    """A check killed mid-way (the device command's time limit) still leaves what ran."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        env=_env(out, DK_DEVICE_CHECK_DRY_HANG="gpu_tests"),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        names, log = [], ""
        while time.monotonic() < deadline and not ("info" in names and "gpu_tests (" in log):
            time.sleep(0.2)
            log = (out / "device_check.log").read_text()
            try:
                names = [s["name"] for s in _report(out)["steps"]]
            except (ValueError, json.JSONDecodeError):
                continue  # not written yet
        assert "info" in names, names
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    report = _report(out)
    assert not report["final"]
    assert "running (partial report" in next(out.glob("*-dry-run.md")).read_text()
    assert "gpu_tests (limit" in (out / "device_check.log").read_text()
    assert not (out / "results").exists()  # benchmarks/results/ gets only the final report


def test_gpu_tier_runs_the_two_rank_tests_last():
    """pytest -m gpu (the gpu_tests step) orders every single-process test before the two-rank
    ones (tests/conftest.py), so a two-rank hang cannot keep the others from reporting."""
    files = ["tests/test_gpu.py", "tests/test_torch_backend.py", "tests/test_kernels.py"]
    command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu"]
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    two_ranks = [i for i, name in enumerate(ids) if "two_ranks" in name or "cuda_routes" in name]
    assert result.returncode == 0 and len(two_ranks) >= 6, result.stdout + result.stderr
    assert two_ranks == list(range(len(ids) - len(two_ranks), len(ids))), ids
