"""The frameworks users bring, on 2 CPU ranks, on "dk" against the same run on gloo.

Two processes (tests/framework_runs.py) run each installed framework on gloo, then on dk,
from the same seed and data; each test here compares the two runs bitwise (with two ranks
a + b is one rounding either way, so torch DDP over dk equals DDP over gloo to the bit:
docs/torch_backend.md) and checks what docs/integrations.md promises (the refusal a
framework gives the name "dk", DDP wrapping, resume from a checkpoint, DeepSpeed's engines:
ZeRO 1-3, MoE, pipeline, AutoTP, Ulysses; Megatron-Core's tensor-parallel layers). A
framework that is not installed is skipped with the reason (`pip install .[integrations]`
installs them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from mp_pool import shm_leaks

pytestmark = pytest.mark.integrations

FRAMEWORKS = (
    "lightning",
    "lightning_fsdp2",
    "accelerate",
    "transformers",
    "transformers_deepspeed",
    "deepspeed_zero",
    "deepspeed_moe",
    "deepspeed_pipe",
    "deepspeed_autotp",
    "deepspeed_ulysses",
    "megatron_tp",
)
WORLD = 2
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs every framework on both backends in one pair of processes; returns a loader."""
    out = tmp_path_factory.mktemp("frameworks")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(TESTS_DIR), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(TESTS_DIR, "framework_runs.py"),
                str(out),
                str(r),
                str(WORLD),
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


def _replicas_agree(ranks) -> bool:
    """Both ranks ended on the same parameters (the engine kept its replicas identical)."""
    first, second = ranks[0]["params"], ranks[1]["params"]
    return all(torch.equal(first[k], second[k]) for k in first)


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
    assert _replicas_agree(dk)
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
    assert _replicas_agree(dk)
    assert not torch.equal(dk[0]["losses"], dk[1]["losses"])


def test_transformers_trainer_on_a_dk_group_made_first_equals_gloo(runs):
    result = runs("transformers")
    gloo, dk = result["gloo"], result["dk"]
    # TrainingArguments hands ddp_backend to accelerate, which refuses it
    assert "backend dk is not available" in dk[0]["refusal"], dk[0]["refusal"]
    assert [r["wrapped"] for r in dk] == ["DistributedDataParallel"] * WORLD
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    assert _replicas_agree(dk)


def test_transformers_trainer_with_deepspeed_on_a_dk_group_made_first_equals_gloo(runs):
    result = runs("transformers_deepspeed")
    gloo, dk = result["gloo"], result["dk"]
    assert [r["wrapped"] for r in dk] == ["DeepSpeedEngine"] * WORLD
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    assert _replicas_agree(dk)
    assert not torch.equal(dk[0]["losses"][0], dk[0]["losses"][-1])


def test_deepspeed_zero_stages_on_dk_equal_gloo(runs):
    result = runs("deepspeed_zero")
    gloo, dk = result["gloo"], result["dk"]
    assert [r["group_backend"] for r in dk] == ["dk"] * WORLD
    runs_ = [k for k in dk[0] if k.startswith("stage")]
    assert len(runs_) == 6, runs_  # stages 1-3, FP32 and BF16
    for key in runs_:
        _same([r[key] for r in gloo], [r[key] for r in dk], "losses")
        _same([r[key] for r in gloo], [r[key] for r in dk], "params")
        assert _replicas_agree([r[key] for r in dk]), key
        losses = dk[0][key]["losses"]
        assert not torch.equal(losses[0], losses[-1]), key
    for stage in (1, 2, 3):  # saved halfway, loaded into a fresh engine: the straight run's end
        for r in dk:
            run = r[f"stage{stage}-float32"]
            for name, value in run["params"].items():
                assert torch.equal(value, run["resumed_params"][name]), (stage, name)


def test_deepspeed_moe_expert_parallel_on_dk_equals_gloo(runs):
    result = runs("deepspeed_moe")
    gloo, dk = result["gloo"], result["dk"]
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    # experts sharded over the ep group: each rank its own; dense weights replicated
    names = dk[0]["params"]
    expert = [k for k in names if ".experts." in k]
    dense = [k for k in names if ".experts." not in k]
    assert expert and dense
    assert all(torch.equal(dk[0]["params"][k], dk[1]["params"][k]) for k in dense)
    assert not any(torch.equal(dk[0]["params"][k], dk[1]["params"][k]) for k in expert)


def test_deepspeed_pipeline_module_on_dk_equals_gloo(runs):
    result = runs("deepspeed_pipe")
    gloo, dk = result["gloo"], result["dk"]
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    # two stages, one a rank: the layers are split between them
    assert set(dk[0]["params"]).isdisjoint(dk[1]["params"])
    assert not torch.equal(dk[0]["losses"][0], dk[0]["losses"][-1])


def test_deepspeed_autotp_training_on_dk_equals_gloo(runs):
    result = runs("deepspeed_autotp")
    gloo, dk = result["gloo"], result["dk"]
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
    # the projections are sharded over the two tp ranks, the first loss is the unsharded
    # model's (a single-process forward of the same model and tokens, in the run)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert dk[0]["params"][q].shape == (32 // WORLD, 32)
    assert not torch.equal(dk[0]["params"][q], dk[1]["params"][q])
    for r in dk:
        assert abs(float(r["losses"][0]) - float(r["unsharded_first_loss"])) < 1e-5


def test_deepspeed_ulysses_attention_on_dk_matches_float64_attention(runs):
    result = runs("deepspeed_ulysses")
    gloo, dk = result["gloo"], result["dk"]
    print("seed", dk[0]["seed"])
    for r in dk:
        assert torch.allclose(r["out"], r["ref_out"], rtol=0, atol=1e-12)
        assert torch.allclose(r["grads"], r["ref_grads"], rtol=0, atol=1e-12)
    _same(gloo, dk, "out")
    _same(gloo, dk, "grads")


def test_megatron_core_tensor_parallel_layers_on_dk_match_float64_and_gloo(runs):
    result = runs("megatron_tp")
    gloo, dk = result["gloo"], result["dk"]
    for r in dk:
        # float32 layers against the float64 unsharded model, 3 SGD steps
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6)
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], ref.float(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(dk[0]["params"]["up.weight"], dk[1]["params"]["up.weight"])  # shards
    _same(gloo, dk, "losses")
    _same(gloo, dk, "params")
