"""The driver with expert parallelism beyond DDP: ZeRO over the expert groups, and a resume at
another ep than the run that saved (``dk.moe.checkpoint`` behind ``train/checkpoints.py``)."""

import dataclasses
import os

import pytest
import torch
from mp_pool import run_ranks
from test_train import (
    TINY,
    _assert_params_close,
    _cfg,
    _key_bias_bound,
    _on_ranks,
    _single,
)

MOE = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)
MOE2 = dataclasses.replace(MOE, n_layers=2)  # a MoE block on each stage of two


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


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_moe_pipeline_matches_single_process(schedule):
    """--pp 2 with a MoE block on each stage: each stage backpropagates its own MoE layers'
    aux losses (the first stage's as a root of its own, the last's with the loss), and the
    run equals one process accumulating the same four micro-batches: losses (the aux losses
    included) and every rank's updated parameters. zb-h1 splits each backward in two."""
    cfg = _cfg(pp=2, global_batch=8, micro_batch=2, model=MOE2, log_every=1, schedule=schedule)
    single = _single(cfg)
    ranks = run_ranks(2, _on_ranks, cfg, timeout=300)
    losses = [rec["loss"] for rec in single.records]
    torch.testing.assert_close(ranks[0]["losses"], losses, rtol=1e-5, atol=0)
    for r in ranks:
        _assert_params_close(r["params"], single.params, _key_bias_bound(cfg))
    assert set().union(*(r["params"] for r in ranks)) == set(single.params)


# Megatron's --moe-layer-freq 2 on two blocks: the first an MoE block, the second dense
PATTERN = dataclasses.replace(MOE2, moe_layers=(1, 0))


def test_moe_layer_pattern_trains_as_one_process_at_pp2_and_ep2():
    """A pattern of MoE and dense blocks: at pp 2 (the MoE block on the first stage, a dense
    one on the last) equal to one process; at dp 2 x ep 2 equal to dp 2 with every expert
    local (dense parameters; the expert shards at their global ids)."""
    cfg = _cfg(global_batch=8, micro_batch=2, model=PATTERN, log_every=1)
    single = _single(cfg)
    # the driver's names: child 1 is block 0, child 2 block 1
    assert any(k.startswith("1.mlp.experts.") for k in single.params)
    assert not any(k.startswith("2.mlp.experts.") for k in single.params)
    piped = run_ranks(2, _on_ranks, dataclasses.replace(cfg, pp=2), timeout=300)
    torch.testing.assert_close(
        piped[0]["losses"], [r["loss"] for r in single.records], rtol=1e-5, atol=0
    )
    for r in piped:
        _assert_params_close(r["params"], single.params, _key_bias_bound(cfg))
    local = run_ranks(2, _on_ranks, dataclasses.replace(cfg, dp=2), timeout=300)
    sharded = run_ranks(2, _on_ranks, dataclasses.replace(cfg, dp=2, ep=2), timeout=300)
    torch.testing.assert_close(sharded[0]["losses"], local[0]["losses"], rtol=1e-5, atol=0)
    for r in sharded:
        dense = {k: v for k, v in r["params"].items() if ".experts." not in k}
        _assert_params_close(dense, local[0]["params"], _key_bias_bound(cfg))


def test_moe_layer_pattern_resumes_at_another_ep(tmp_path):
    """The pattern is part of the checkpoint's model (a tuple, a list in its JSON record): a
    resume at ep 1 of an ep 2 run is accepted and continues the uninterrupted run."""
    from test_train_reshard import STOP, _saved_then_resumed

    base = _cfg(steps=6, global_batch=8, micro_batch=2, warmup=2, log_every=1, model=PATTERN)
    straight, again = _saved_then_resumed(tmp_path, base, dict(dp=2, ep=2), dict(dp=2))
    assert again[0]["start"] == STOP
    torch.testing.assert_close(again[0]["losses"], straight[0]["losses"][STOP:], rtol=1e-5, atol=0)


@pytest.mark.parametrize("zero", [0, 1])
def test_moe_pipeline_with_expert_parallel_matches_dp2(zero):
    """dp 2 x pp 2 x ep 2 (4 ranks; with ZeRO-1 too): experts sharded over the ep pair of each
    stage, reduced over their replicas (none here: ep = dp), the dense weights over dp; equal
    to dp 2 with every expert local and no pipeline (the same micro-batches per replica):
    losses, and every dense parameter."""
    cfg = _cfg(dp=2, global_batch=8, micro_batch=2, model=MOE2, log_every=1)
    local = run_ranks(2, _on_ranks, cfg, timeout=300)
    piped = dataclasses.replace(cfg, pp=2, ep=2, zero=zero)
    ranks = run_ranks(4, _on_ranks, piped, timeout=300)
    torch.testing.assert_close(ranks[0]["losses"], local[0]["losses"], rtol=1e-5, atol=0)
    for r in ranks:
        dense = {k: v for k, v in r["params"].items() if ".experts." not in k}
        assert dense
        _assert_params_close(dense, local[0]["params"], _key_bias_bound(cfg))


def test_moe_pipeline_with_expert_parallel_resume_is_exact(tmp_path):
    """dp 2 x pp 2 x ep 2: each (stage, ep rank) saves its own directory, its experts in it;
    6 steps straight == 3, stop, resume to 6, bitwise on every rank."""
    cfg = _cfg(dp=2, pp=2, ep=2, steps=6, global_batch=8, micro_batch=2, model=MOE2, log_every=3)
    straight = run_ranks(4, _on_ranks, cfg, timeout=300)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(4, _on_ranks, dataclasses.replace(cfg, stop_after=3, **ckpt), timeout=300)
    saved = sorted(os.listdir(tmp_path / "step-00000003"))
    assert saved == ["COMPLETE.json", *(f"stage-{s}-ep-{e}" for s in (0, 1) for e in (0, 1))]
    resumed = run_ranks(4, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=300)
    assert resumed[0]["start"] == 3
    for r in range(4):
        for k, v in straight[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), (r, k)


def test_clip_grad_norm_with_pipeline_and_expert_parallel_equals_every_expert_local():
    """--clip-grad at dp 2 x pp 2 x ep 2 (DDP, and ZeRO-1 with its tp / pp norm): every step's
    norm equals dp 2 with every expert on both ranks and no pipeline."""
    cfg = _cfg(dp=2, global_batch=8, micro_batch=2, model=MOE2, log_every=1, clip_grad=0.5)
    local = run_ranks(2, _on_ranks, cfg, timeout=300)
    want = [rec["grad_norm"] for rec in local[0]["records"]]
    assert min(want) > 1.0  # clipped every step
    for zero in (0, 1):
        piped = dataclasses.replace(cfg, pp=2, ep=2, zero=zero)
        got = [
            rec["grad_norm"] for rec in run_ranks(4, _on_ranks, piped, timeout=300)[0]["records"]
        ]
        assert got == pytest.approx(want, rel=1e-5, abs=0), zero


def test_moe_pipeline_resumes_at_another_ep(tmp_path):
    """dp 2 x pp 2 x ep 2 saved at step 3 (``stage-<s>-ep-<r>``), resumed at ep 1 (every
    expert on both replicas of each stage, read from both ep directories of its stage) to 6:
    the losses of 6 straight steps at ep 2, to the float32 rounding of the two layouts."""
    cfg = _cfg(dp=2, pp=2, ep=2, steps=6, global_batch=8, micro_batch=2, model=MOE2, log_every=1)
    straight = run_ranks(4, _on_ranks, cfg, timeout=300)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(4, _on_ranks, dataclasses.replace(cfg, stop_after=3, **ckpt), timeout=300)
    resumed = run_ranks(4, _on_ranks, dataclasses.replace(cfg, ep=1, **ckpt), timeout=300)
    assert resumed[0]["start"] == 3
    torch.testing.assert_close(resumed[0]["losses"], straight[0]["losses"][3:], rtol=1e-5, atol=0)


SHARED = dataclasses.replace(
    MOE, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True
)  # Qwen2-MoE's block: a gated shared expert beside the routed ones


def test_shared_expert_is_dense_under_expert_parallelism(tmp_path):
    """A gated shared expert in every MoE block: at dp 2 x ep 2 (the routed experts split,
    the shared one on both ranks) the run trains as with every expert local, the shared
    expert's weights equal on both ranks (reduced over all of dp, as dense weights are);
    ZeRO-2 over the expert groups trains as DDP; saved at ep 2 and resumed at ep 1, the run
    ends where the straight ep 2 run does (the shared expert read as a dense weight)."""
    cfg = _cfg(dp=2, ep=2, steps=6, global_batch=4, warmup=1, log_every=3, model=SHARED)
    local = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=1), timeout=300)
    sharded = run_ranks(2, _on_ranks, cfg, timeout=300)
    torch.testing.assert_close(sharded[0]["losses"], local[0]["losses"], rtol=1e-5, atol=0)
    shared = [k for k in sharded[0]["params"] if ".shared_expert" in k]
    assert len(shared) == 4 * MOE.n_layers, sorted(sharded[0]["params"])
    for k in shared:
        assert torch.equal(sharded[0]["params"][k], sharded[1]["params"][k]), k
        torch.testing.assert_close(
            sharded[0]["params"][k], local[0]["params"][k], rtol=1e-4, atol=1e-6
        )
    zero = run_ranks(2, _on_ranks, dataclasses.replace(cfg, zero=2), timeout=300)
    assert zero[0]["losses"] == pytest.approx(sharded[0]["losses"], rel=1e-5, abs=0)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=4, **ckpt), timeout=300)
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=1, **ckpt), timeout=300)
    assert resumed[0]["start"] == 4
    assert resumed[0]["losses"][-1] == pytest.approx(sharded[0]["losses"][-1], rel=1e-5, abs=0)


BIASED = dataclasses.replace(
    MOE, n_experts=8, moe_aux_loss_coeff=0.0, moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.01,
)  # fmt: skip


def test_expert_bias_is_the_same_at_every_layout(tmp_path):
    """--moe-router-enable-expert-bias without an aux loss: dp 2 x ep 2 trains as dp 2 with
    every expert local and as one process (each step's counts summed over the replicas: the
    same biases), the biases equal on both ranks and moved, and off the unbiased run; a resume
    is bit for bit the straight run (the bias is checkpointed)."""
    cfg = _cfg(dp=2, ep=2, steps=12, global_batch=8, warmup=1, log_every=1, model=BIASED)
    biased = run_ranks(2, _on_ranks, cfg, timeout=300)
    off = dataclasses.replace(BIASED, moe_router_enable_expert_bias=False)
    plain = run_ranks(2, _on_ranks, dataclasses.replace(cfg, model=off), timeout=300)
    assert biased[0]["losses"][-1] != plain[0]["losses"][-1]
    biases = [k for k in biased[0]["params"] if k.endswith("router.expert_bias")]
    assert len(biases) == MOE.n_layers
    for k in biases:
        assert torch.equal(biased[0]["params"][k], biased[1]["params"][k]), k
        assert biased[0]["params"][k].abs().max() >= 0.01  # it moved
    local = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=1), timeout=300)
    single = run_ranks(1, _on_ranks, dataclasses.replace(cfg, dp=0, ep=1), timeout=300)[0]
    # FP32 layouts sum each expert's rows in their own orders; a rounding that flips one
    # token's choice moves a count across the mean and a bias by the rate, so the runs agree
    # to 1e-3 over 12 steps, not to the last bits
    for other in (local[0], single):
        torch.testing.assert_close(other["losses"], biased[0]["losses"], rtol=1e-3, atol=0)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto", log_every=3)
    straight = run_ranks(2, _on_ranks, dataclasses.replace(cfg, log_every=3), timeout=300)
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=6, **ckpt), timeout=300)
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=300)
    assert resumed[0]["start"] == 6
    for rank in range(2):
        for k, v in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][k], v), (rank, k)
