"""The frameworks users bring, on 2 CPU ranks, on "dk" against the same run on gloo.

Two processes (tests/framework_runs.py) run each installed framework on gloo, then on dk,
from the same seed and data; each test here compares the two runs bitwise (with two ranks
a + b is one rounding either way, so torch DDP over dk equals DDP over gloo to the bit:
docs/torch_backend.md) and checks what docs/integrations.md promises (the refusal a
framework gives the name "dk", DDP wrapping, resume from a checkpoint). A framework that is
not installed is skipped with the reason (`pip install .[integrations]` installs them).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from mp_pool import shm_leaks

pytestmark = pytest.mark.integrations

FRAMEWORKS = ("lightning", "lightning_fsdp2", "accelerate", "transformers")
WORLD = 2
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _free_port_base() -> int:
    """A free port from the kernel for Lightning's own env:// rendezvous (it makes the group
    itself); the next ones serve its later runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs every framework on both backends in one pair of processes; returns a loader."""
    out = tmp_path_factory.mktemp("frameworks")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(TESTS_DIR), "OMP_NUM_THREADS": "1"}
    port = _free_port_base()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(TESTS_DIR, "framework_runs.py"),
                str(out),
                str(r),
                str(WORLD),
                str(port),
                *FRAMEWORKS,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=600)[0])
        finally:
            proc.kill()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(logs)

    def load(name):
        per_backend = {}
        for backend in ("gloo", "dk"):
            ranks = [torch.load(out / f"{name}-{backend}-{r}.pt") for r in range(WORLD)]
            for r, result in enumerate(ranks):
                if "skip" in result:
                    pytest.skip(result["skip"])
                assert "error" not in result, f"{name} on {backend}, rank {r}:\n{result['error']}"
            per_backend[backend] = ranks
        return per_backend

    yield load
    assert shm_leaks() == []


def _same(gloo, dk, key):
    for r, (a, b) in enumerate(zip(gloo, dk)):
        if isinstance(a[key], dict):
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, r, name)
        else:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (key, r)


def test_lightning_ddp_strategy_dk_equals_gloo_with_validation_and_resume(runs):
    result = runs("lightning")
    gloo, dk = result["gloo"], result["dk"]
    assert [r["group_backend"] for r in dk] == ["dk"] * WORLD
    for key in ("losses", "params", "val_loss"):
        _same(gloo, dk, key)
    for r in dk:  # resumed from the epoch-1 checkpoint, it ends where the straight run did
        for name, value in r["params"].items():
            assert torch.equal(value, r["resumed_params"][name]), name
    # DDP kept the replicas identical; the run moved them (the check can fail)
    assert all(torch.equal(dk[0]["params"][k], dk[1]["params"][k]) for k in dk[0]["params"])
    assert not torch.equal(dk[0]["losses"][0], dk[0]["losses"][-1])


def test_lightning_model_parallel_strategy_fsdp2_dk_equals_gloo(runs):
    result = runs("lightning_fsdp2")
    gloo, dk = result["gloo"], result["dk"]
    assert [r["group_backend"] for r in dk] == ["dk"] * WORLD
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    assert not torch.equal(dk[0]["losses"][0], dk[0]["losses"][-1])


def test_accelerate_on_a_dk_group_made_first_equals_gloo(runs):
    result = runs("accelerate")
    gloo, dk = result["gloo"], result["dk"]
    assert "backend dk is not available" in dk[0]["refusal"], dk[0]["refusal"]
    assert [r["wrapped"] for r in dk] == ["DistributedDataParallel"] * WORLD
    again, clash = dk[0]["helper"]  # dk.init_process_group: a second call is fine, another
    assert again and "already exists with backend 'dk'" in clash, clash  # backend is not
    # the traps docs/integrations.md names: accelerate says "gloo" of the dk group it uses,
    # and without cpu=True it does not wrap the model at all (on gloo neither)
    assert dk[0]["state_backend"] == "gloo", dk[0]["state_backend"]
    assert {r["wrapped_without_cpu_flag"] for r in gloo + dk} == {"Sequential"}
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    # each rank trained on its own shard, DDP averaged: the replicas agree, the losses do not
    assert all(torch.equal(dk[0]["params"][k], dk[1]["params"][k]) for k in dk[0]["params"])
    assert not torch.equal(dk[0]["losses"], dk[1]["losses"])


def test_transformers_trainer_on_a_dk_group_made_first_equals_gloo(runs):
    result = runs("transformers")
    gloo, dk = result["gloo"], result["dk"]
    # TrainingArguments hands ddp_backend to accelerate, which refuses it
    assert "backend dk is not available" in dk[0]["refusal"], dk[0]["refusal"]
    assert [r["wrapped"] for r in dk] == ["DistributedDataParallel"] * WORLD
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    assert all(torch.equal(dk[0]["params"][k], dk[1]["params"][k]) for k in dk[0]["params"])
