"""Across real host boundaries: 2 emulated hosts (network, mount, UTS, IPC and PID namespaces:
each with its own /dev/shm, hostname and processes, joined by a veth bridge) under
``torchrun --nnodes 2``.

One launch of 2 hosts x 2 ranks runs every collective check (also on one rank per host) and
the engine checks (tests/multihost_checks.py); each engine is held to its single-host test's
reference and tolerance. Separate launches: the training driver (``--dp 2 --tp 2``), a host
killed mid-collective, and torchrun --max-restarts resuming after a host is lost. Skipped, with
the reason, where namespaces are not available (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated import ROOT, EmulatedHosts, launch_checks, skip_reason  # noqa: E402

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

ENGINE_CHECKS = ["collectives", "dk_backend", "ddp", "zero", "pipeline", "tensor_parallel"]


@pytest.fixture(scope="module")
def results():
    """Every check of ENGINE_CHECKS, from one launch of 2 hosts x 2 ranks."""
    return launch_checks(ENGINE_CHECKS, hosts=2, nproc_per_host=2, timeout=1200)


# ------------------------------------------------------------------ collectives


def test_collectives_exact_and_identical_on_every_rank(results):
    """Every dtype and op, reduce_scatter / all_gather / broadcast / all_to_all / p2p / async,
    on 2 hosts x 2 and x 1 ranks, in every hierarchical kind: exact against float64 (checked
    on the ranks) and bitwise identical across ranks."""
    per_rank = results["collectives"].ok()
    keys = per_rank[0].keys()
    assert {label for label, _ in keys} == {"x2", "x1"}
    for key in keys:
        ranks = [0, 1, 2, 3] if key[0] == "x2" else None
        groups = [ranks] if ranks else [[0, 2], [1, 3]]
        for group in groups:
            digests = [per_rank[r][key] for r in group]
            assert all(d == digests[0] for d in digests), f"{key}: ranks {group} differ"


# ------------------------------------------------------------------ engines


def test_torch_ddp_and_fsdp2_over_dk(results):
    import test_ddp as td

    for rank, r in results["dk_backend"].ok().items():
        assert r["ddp_moved"] and r["ddp_vs_gloo"] < td.FP32_RTOL, (rank, r)
        assert r["fsdp2"] is True  # within test_torch_backend's bound of the single process


def test_ddp_matches_single_process_and_torch_ddp(results):
    import test_ddp as td

    per_rank = results["ddp"].ok()
    for name, case in per_rank[0].items():
        print(name, case)
        assert case["vs_single"] < td.FP32_RTOL and case["vs_torch"] < td.FP32_RTOL, name
    for name in per_rank[0]:
        assert len({per_rank[r][name]["digest"] for r in per_rank}) == 1, f"{name}: ranks differ"


def test_zero_stages_match_single_process(results):
    import multihost_checks as mc
    import test_zero as tz

    per_rank = results["zero"].ok()
    for i, (stage, opt_name, options) in enumerate(mc.ZERO_CASES):
        diff = max(per_rank[r]["zero12"][i]["diff"] for r in per_rank)
        print(f"stage {stage} {opt_name} {options}: {diff:.2e}")
        assert diff < tz.tolerance(opt_name, options), (stage, opt_name, options, diff)
    for i, (opt_name, options) in enumerate(mc.STAGE3_CASES):
        rows = [per_rank[r]["zero3"][i] for r in per_rank]
        diff = max(row["diff"] for row in rows)
        print(f"stage 3 {opt_name} {options}: {diff:.2e}")
        # test_zero_stage3's bounds: FP32 rounding, or BF16 SGD
        assert diff < (1e-5 if "dtype" not in options else 1e-2), (opt_name, options, diff)
        assert all(row["freed"] and not row["grads_kept"] and row["within"] for row in rows)


def test_pipeline_stages_on_different_hosts_match_single_process(results):
    per_rank = results["pipeline"].ok()
    for out in per_rank.values():
        for rank, schedule, ckpt, diff, loss_diff, _ in out["stages"]:
            assert diff < 1e-12 and loss_diff < 1e-12, (rank, schedule, ckpt, diff, loss_diff)
        for rank, name, mesh, diff, _, _, by_ddp in out["hybrid"]:
            assert diff < 1e-5 and by_ddp, (rank, name, mesh, diff)  # test_pipeline_runtime's


def test_tensor_parallel_kept_on_a_host_and_warned_across(results):
    per_rank = results["tensor_parallel"].ok()
    for rank, out in per_rank.items():
        assert out["tp_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["warned_inside"] == [], out["warned_inside"]
        assert max(out["diffs"].values()) < 1e-12, out["diffs"]
        (message,) = out["warned_across"]
        assert "tp groups [[0, 1, 2, 3]] span hosts" in message, message
        assert "host0: ranks [0, 1]" in message and "host1: ranks [2, 3]" in message, message


# ------------------------------------------------------------------ faults


def test_host_killed_mid_collective_every_survivor_raises_naming_it():
    """host1 SIGKILLed (torchrun agent and ranks) while the ranks loop on all-reduces: both
    ranks of host0 raise CommError naming host1 and its ranks, within the 60 s timeout."""
    killed_at = {}

    def kill_when_ready(cluster, out_dir):
        deadline = time.monotonic() + 300
        while not all(os.path.exists(os.path.join(out_dir, f"ready.{r}")) for r in range(4)):
            assert time.monotonic() < deadline, "ranks never got ready"
            time.sleep(0.2)
        time.sleep(1.0)  # well inside the loop of all-reduces
        killed_at["t"] = time.time()
        cluster.kill_host(1)
        while not all(os.path.exists(os.path.join(out_dir, f"host_loss.{r}.pkl")) for r in (0, 1)):
            assert time.monotonic() < deadline + 120, "survivors never raised"
            time.sleep(0.2)

    results = launch_checks(["host_loss"], hosts=2, nproc_per_host=2, during=kill_when_ready)
    for rank in (0, 1):
        assert rank in results["host_loss"], results["host_loss"].errors.get(rank)
        r = results["host_loss"][rank]
        print(rank, r)
        assert r["type"] == "CommError"
        assert "host1 (ranks 2, 3)" in r["error"], r["error"]
        assert r["raised_at"] - killed_at["t"] < 60.0


# ------------------------------------------------------------------ training driver


def _driver_args(steps, out, extra=()):
    return [
        "-m",
        "dist_kernels.train",
        "--dp",
        "2",
        "--tp",
        "2",
        "--steps",
        str(steps),
        "--micro-batch",
        "2",
        "--global-batch",
        "8",
        "--lr",
        "3e-3",
        "--warmup",
        "1",
        "--seed",
        "1234",
        "--no-progress",
        "--data",  # test_train's frozen corpus, which its one-process reference reads
        os.path.join(ROOT, "tests", "data", "corpus.txt"),
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--d-model",
        "32",
        "--seq-len",
        "16",
        "--json",
        str(out),
        *extra,
    ]


def _records(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


STEPS = 6


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The driver, dp 2 x tp 2 over 2 hosts x 2 ranks, uninterrupted."""
    out = tmp_path_factory.mktemp("driver") / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT}
    with EmulatedHosts(2) as cluster:
        procs = cluster.torchrun(_driver_args(STEPS, out), nproc_per_host=2, env=env)
        cluster.wait(procs, 900)
    assert all(p.proc.returncode == 0 for p in procs), "\n".join(p.output for p in procs)
    return _records(out)


def test_driver_dp2_tp2_across_hosts_matches_single_process(straight_run):
    import test_train as tt

    cfg = tt._cfg(global_batch=8, steps=STEPS)
    reference = [rec["loss"] for rec in tt._single(cfg).records]
    losses = [rec["loss"] for rec in straight_run]
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)  # test_train's bound


def test_driver_resumes_after_a_host_is_lost_and_restarted(straight_run, tmp_path):
    """torchrun --max-restarts 1 (c10d rendezvous on host0): host1's ranks hold once the
    step-3 checkpoint is complete (multihost_checks.driver), so host0's ranks wait for them in
    step 4; host1 is SIGKILLed, host0's agent sees its workers fail and restarts them into a
    new round, host1 is started again and joins it; the job resumes from the checkpoint and
    ends on the uninterrupted run's loss."""
    import multihost_checks as mc

    out, ckpt, held = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "held"
    held.mkdir()
    extra = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--resume", "auto"]
    argv = [mc.__file__, "--driver", *_driver_args(STEPS, out, extra)[2:]]
    env = {**os.environ, "PYTHONPATH": ROOT}
    with EmulatedHosts(2) as cluster:
        first = {**env, mc.HOLD_ENV: f"3:{held}"}
        procs = cluster.torchrun(argv, nproc_per_host=2, env=env, max_restarts=1, hosts=[0])
        procs += cluster.torchrun(argv, nproc_per_host=2, env=first, max_restarts=1, hosts=[1])
        deadline = time.monotonic() + 600
        while len(list(held.iterdir())) < 2:
            assert time.monotonic() < deadline, "host1's ranks never reached the step-3 hold"
            assert all(p.proc.poll() is None for p in procs), "a torchrun ended early"
            time.sleep(0.2)
        cluster.kill_host(1)
        procs[1].proc.wait()
        procs += cluster.torchrun(argv, nproc_per_host=2, env=env, max_restarts=1, hosts=[1])
        cluster.wait([procs[0], procs[2]], 900)
    logs = "\n".join(p.output for p in procs)
    ends = "\n".join(f"--- host process {i}:\n{p.output[-3000:]}" for i, p in enumerate(procs))
    assert procs[0].proc.returncode == 0 and procs[2].proc.returncode == 0, ends
    assert "resumed from" in logs, logs[-6000:]
    records = _records(out)
    assert [r["step"] for r in records][-3:] == list(range(4, STEPS + 1)), records
    assert records[-1]["loss"] == pytest.approx(straight_run[-1]["loss"], rel=1e-6, abs=0)


def test_the_harness_tears_down_its_namespaces():
    """After every launch above, nothing of this process is left in `ip netns`."""
    import subprocess

    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = [line for line in listing.splitlines() if line.startswith(f"dk-{os.getpid()}-")]
    assert mine == [], mine
