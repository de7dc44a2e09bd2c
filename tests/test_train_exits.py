"""Stopping on purpose: ``--exit-signal-handler`` (SIGTERM) and ``--exit-duration-in-mins``
(``train/exits.py``). Every rank stops after the same step with a checkpoint, and the resumed
run ends where the uninterrupted one does."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import torch
from mp_pool import run_ranks
from test_train import CORPUS, SEED, _cfg, _on_ranks

from dist_kernels.train import train
from dist_kernels.train.checkpoints import newest_complete

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigterm_on_one_rank_stops_every_rank_after_that_step(tmp_path):
    """Rank 1 gets SIGTERM after step 3 of 8 (dp 2): both ranks stop after step 3, the step
    is logged and checkpointed, and the resumed run ends bitwise on the straight run."""
    cfg = _cfg(dp=2, steps=8, global_batch=4, log_every=5, checkpoint_dir=str(tmp_path))
    straight = run_ranks(2, _on_ranks, dataclasses.replace(cfg, checkpoint_dir=None), timeout=180)
    stopped = run_ranks(
        2, _on_ranks,
        dataclasses.replace(cfg, exit_signal_handler=True, signal_after=(1, 3)), timeout=180,
    )  # fmt: skip
    assert [r["exit_reason"] for r in stopped] == ["SIGTERM", "SIGTERM"]
    assert stopped[0]["records"][-1]["step"] == 3  # logged although log_every is 5
    assert newest_complete(str(tmp_path)) == str(tmp_path / "step-00000003")
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, resume="auto"), timeout=180)
    assert resumed[0]["start"] == 3 and resumed[0]["exit_reason"] is None
    for k, v in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][k], v), k


def test_one_process_restores_the_sigterm_handler_and_obeys_the_time_budget(tmp_path):
    """In this process: the handler is ours only during the run; a budget already spent
    stops the run after its first step, with a checkpoint of it."""
    before = signal.getsignal(signal.SIGTERM)
    cfg = _cfg(steps=6, global_batch=2, checkpoint_dir=str(tmp_path / "a"))
    result = train(
        dataclasses.replace(cfg, exit_signal_handler=True, signal_after=(0, 2)).with_layout(1)
    )
    assert result.exit_reason == "SIGTERM" and result.records[-1]["step"] == 2
    assert signal.getsignal(signal.SIGTERM) is before
    spent = dataclasses.replace(cfg, exit_duration_in_mins=1e-9, checkpoint_dir=str(tmp_path / "b"))
    result = train(spent.with_layout(1))
    assert result.exit_reason == "--exit-duration-in-mins 1e-09"
    assert newest_complete(str(tmp_path / "b")) == str(tmp_path / "b" / "step-00000001")
    plain = train(dataclasses.replace(cfg, checkpoint_dir=None).with_layout(1))
    assert plain.exit_reason is None and plain.records[-1]["step"] == 6


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_command_line_stops_on_a_real_sigterm_and_resumes(tmp_path):
    """``python -m dist_kernels.train --dp 2 --exit-signal-handler``: SIGTERM to the launcher
    (as a scheduler sends it) reaches the ranks; the command exits 0 after a checkpoint of the
    step they stopped after, and ``--resume auto`` finishes the run."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    common = ["--dp", "2", "--micro-batch", "2", "--n-layer", "1", "--n-head", "2",
              "--d-model", "32", "--seq-len", "16", "--seed", str(SEED), "--no-progress",
              "--data", CORPUS, "--checkpoint-dir", ckpt, "--log-every", "1",
              "--json", log]  # fmt: skip
    cmd = [sys.executable, "-m", "dist_kernels.train", *common, "--steps", "100000",
           "--exit-signal-handler"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(_records(log)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_records(log)) >= 3, "the run did not start"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.decode()
    assert proc.returncode == 0, text
    stopped = _records(log)[-1]["step"]
    print(f"stopped after step {stopped}")
    assert f"stopped after step {stopped} of 100000 (SIGTERM)" in text
    assert newest_complete(ckpt) == os.path.join(ckpt, f"step-{stopped:08d}")
    # two more steps on the saved schedule (its horizon of 100000 kept)
    finish = [sys.executable, "-m", "dist_kernels.train", *common, "--steps",
              str(stopped + 2), "--resume", "auto",
              "--use-checkpoint-opt-param-scheduler"]  # fmt: skip
    done = subprocess.run(finish, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _records(log)[-1]["step"] == stopped + 2
