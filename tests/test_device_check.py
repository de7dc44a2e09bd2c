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
REFERENCE_BUDGET_S = 360

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
    # The limits fill the budget and no more: the check fits one 10-minute device command.
    assert sum(s["limit_s"] for s in report["steps"]) == REFERENCE_BUDGET_S
    assert REFERENCE_BUDGET_S <= 6 * 60
    log = (out / "device_check.log").read_text()
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
    # Budget 36 s scales every limit by 1/10: bench_kernels gets 2 s, then its stand-in is killed.
    result = _dry_run(
        tmp_path,
        DK_CHECK_BUDGET_S="36",
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
