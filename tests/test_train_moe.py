"""The driver with expert parallelism beyond DDP: ZeRO over the expert groups, and a resume at
another ep than the run that saved (``dk.moe.checkpoint`` behind ``train/checkpoints.py``)."""

import dataclasses
import os

import pytest
import torch
from mp_pool import run_ranks
from test_train import TINY, _cfg, _on_ranks

MOE = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)


def test_driver_zero_over_expert_groups_matches_ddp():
    """--dp 2 --ep 2 --zero 1 / 2 / 3: the experts sharded over their replicas (one rank each
    at dp 2 x ep 2: nothing to shard; the dense weights over both) train as DDP does, to FP32
    rounding (reduce-scatter + all-gather against all-reduce)."""
    cfg = _cfg(dp=2, ep=2, steps=4, global_batch=4, log_every=1, model=MOE)
    ddp = run_ranks(2, _on_ranks, cfg, timeout=300)
    for stage in (1, 2, 3):
        zero = run_ranks(2, _on_ranks, dataclasses.replace(cfg, zero=stage), timeout=300)
        assert zero[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-5, abs=0), stage


def test_driver_resumes_a_zero_run_over_expert_groups_at_another_ep(tmp_path):
    """--zero 1 --ep 2 with checkpoints: 4 steps saved (one ``stage-0`` directory, each rank's
    experts by global id), resumed with --zero 2 at ep 1 (every expert on both ranks, their
    shards read from both saved ranks) to 6, matches 6 straight steps at ep 2 to the float32
    rounding of the two layouts."""
    cfg = _cfg(dp=2, ep=2, zero=1, steps=6, global_batch=4, warmup=1, log_every=3, model=MOE)
    straight = run_ranks(2, _on_ranks, cfg, timeout=300)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=4, **ckpt), timeout=300)
    assert sorted(os.listdir(tmp_path / "step-00000004")) == ["COMPLETE.json", "stage-0"]
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=1, zero=2, **ckpt), timeout=300)
    assert resumed[0]["start"] == 4
    assert resumed[0]["losses"][-1] == pytest.approx(straight[0]["losses"][-1], rel=1e-5, abs=0)


def test_driver_resumes_an_ep2_run_at_ep1(tmp_path):
    """The driver: 4 steps at dp 2 x ep 2 (``stage-0-ep-<r>``), resumed at ep 1 (every expert
    on both ranks, read from both directories) to 6, matches 6 straight steps at ep 2 to the
    float32 rounding of the two layouts (the experts sum their rows in different orders)."""
    cfg = _cfg(dp=2, ep=2, steps=6, global_batch=4, warmup=1, log_every=3, model=MOE)
    straight = run_ranks(2, _on_ranks, cfg, timeout=300)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=4, **ckpt), timeout=300)
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=1, **ckpt), timeout=300)
    assert resumed[0]["start"] == 4
    # logged every 3 steps: the resumed run's one record is step 6
    assert resumed[0]["losses"][-1] == pytest.approx(straight[0]["losses"][-1], rel=1e-5, abs=0)


def test_clip_grad_norm_over_expert_shards_equals_every_expert_local():
    """--clip-grad at dp 2 x ep 2 (each rank its own experts; DDP and ZeRO 2): every step's norm
    equals dp 2 with every expert on both ranks, so each expert counts once."""
    cfg = _cfg(dp=2, steps=3, global_batch=4, log_every=1, clip_grad=0.5, model=MOE)
    local = run_ranks(2, _on_ranks, cfg, timeout=300)
    want = [rec["grad_norm"] for rec in local[0]["records"]]
    assert min(want) > 1.0  # clipped every step
    for zero in (0, 2):
        ep = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=2, zero=zero), timeout=300)
        got = [rec["grad_norm"] for rec in ep[0]["records"]]
        assert got == pytest.approx(want, rel=1e-5, abs=0), zero


def test_recompute_with_expert_parallel_trains_as_without_it():
    """--recompute at dp 2 x ep 2: the MoE blocks run again in backward (the token all-to-all
    and the aux loss included) and training ends on the same bits."""
    cfg = _cfg(dp=2, ep=2, steps=3, global_batch=4, log_every=1, model=MOE)
    plain = run_ranks(2, _on_ranks, cfg, timeout=300)
    again = run_ranks(2, _on_ranks, dataclasses.replace(cfg, recompute=True), timeout=300)
    assert again[0]["losses"] == plain[0]["losses"]
    for a, b in zip(again, plain):
        assert all(torch.equal(a["params"][k], v) for k, v in b["params"].items())
