"""python -m dist_kernels.train: layouts against a single-process run of the same global batch,
exact resume, resharded resume, stragglers, bad input, elastic recovery under torchrun.

Tiny model (1 block, width 32, 16 characters), a few steps; the ranks come from the shared
pools. The reference is the same driver on one process without any engine: the whole global
batch as micro-batches of the same size, plain torch AdamW.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Dict
from unittest import mock

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_pool import run_ranks  # noqa: E402
from test_gpt_tp import shard_of  # noqa: E402

from dist_kernels import lr as dk_lr  # noqa: E402
from dist_kernels.models import GPTConfig  # noqa: E402
from dist_kernels.optim import FusedAdamW  # noqa: E402
from dist_kernels.train import (  # noqa: E402
    ConfigError,
    TrainConfig,
    data,
    driver,
    metrics,
    train,
)
from dist_kernels.train.cli import build_parser, config_from_args, preflight  # noqa: E402
from dist_kernels.train.cli import main as cli_main  # noqa: E402
from dist_kernels.train.model import build_model  # noqa: E402
from dist_kernels.train.stragglers import StragglerDetector  # noqa: E402

SEED = 1234
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = GPTConfig(n_layers=1, n_heads=2, dim=32, block_size=16, tie_embeddings=False)
# Thresholds far above scheduling noise on a loaded 2-core machine, far below the injected delay
STRAGGLER = dict(straggler_threshold=0.5, straggler_min_ms=25.0, straggler_patience=2)
# The matmul probe each rank reports in the layout tests, patched to a known value: rank r
# reports (r + 1) x PEAK_FLOPS, so the record's peak is a sum the test can write down.
PEAK_FLOPS = 1e9
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the driver keeps
# The tests' corpus: a frozen text file. The driver's default corpus is the package's own
# sources, which every change to the package changes, and with them the samples: a layout
# test's Adam-amplified rounding then passed or failed with the edit of an unrelated file.
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
# fp16 with a first loss scale far too large for FP16 and a short growth window: the first
# steps overflow (skipped, the scale halved each time), then the scale grows and overflows
# again, so the run exercises every decision of the loss scaler.
FP16 = dict(dtype="fp16", initial_loss_scale=2.0**20, loss_scale_window=2, steps=10)


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model=TINY,
        steps=3,
        micro_batch=2,
        lr=3e-3,
        warmup=1,
        seed=SEED,
        progress=False,
        data=CORPUS,
        **STRAGGLER,
    )
    base.update(kw)
    return TrainConfig(**base)


def _on_ranks(cfg: TrainConfig, engine: str = "dk"):
    """Runs on every pool rank: the resolved config trained; rank results made picklable.

    Besides the driver's results, the rank reports what it consumed, counted outside the
    driver: every sample its sampler handed out, ``(step, index in the global batch) ->
    tokens``; and the wall time of the whole run. The matmul probe reports a known peak."""
    import torch.distributed as dist

    rank = dist.get_rank()
    consumed = {}
    real_batch = data.Sampler.batch

    def counting_batch(sampler, step, first, count):
        inputs, targets = real_batch(sampler, step, first, count)
        for i in range(count):
            consumed[(step, first + i)] = inputs[i].numel()
        return inputs, targets

    built = []  # the models the driver builds: the whole one, then (sharded) this rank's
    real_build = driver.build_model

    def recording_build(*args, **kwargs):
        model, loss = real_build(*args, **kwargs)
        built.append(model)
        return model, loss

    fused_steps = [0]  # calls of a fused AdamW kernel: ours or torch's (--optimizer fused-adamw)
    real_kernel, real_torch_fused = FusedAdamW._run_kernel, torch._fused_adamw_

    def counting_kernel(*args, **kwargs):
        fused_steps[0] += 1
        return real_kernel(*args, **kwargs)

    def counting_torch_fused(*args, **kwargs):
        fused_steps[0] += 1
        return real_torch_fused(*args, **kwargs)

    peak = mock.patch.object(driver, "matmul_peak_flops", lambda **_: (rank + 1) * PEAK_FLOPS)
    build = mock.patch.object(driver, "build_model", recording_build)
    kernel = mock.patch.object(FusedAdamW, "_run_kernel", counting_kernel)
    torch_fused = mock.patch.object(torch, "_fused_adamw_", counting_torch_fused)
    if cfg.compile:
        torch._dynamo.reset()  # this worker's earlier compiles neither serve nor count
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with mock.patch.object(data.Sampler, "batch", counting_batch), peak, build, kernel, torch_fused:
        start = time.perf_counter()
        r = train(cfg.with_layout(dist.get_world_size()), engine)
        wall_s = time.perf_counter() - start
    return {
        "losses": [rec["loss"] for rec in r.records],
        "records": r.records,
        "stragglers": [(s.rank, s.phase, s.interval) for s in r.stragglers],
        "params": r.params,
        "evals": r.evals,
        "test": r.test,
        "start": r.start_step,
        "consumed": consumed,
        "wall_s": wall_s,
        # whether the model trained had its sequence split over tp (--sequence-parallel)
        "sequence_parallel": any(
            getattr(m, "sequence_parallel", False) for m in built[-1].modules()
        ),
        "fused_steps": fused_steps[0],
        "exit_reason": r.exit_reason,
        # graphs dynamo compiled during the run (0 unless something was torch.compiled)
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
    }


def _one_process(cfg: TrainConfig) -> TrainConfig:
    """``cfg``'s model, data and global batch on one process without any engine."""
    one = dict(dp=1, tp=1, cp=1, pp=1, zero=0, grad_accum=0, sequence_parallel=False)
    return dataclasses.replace(cfg, **one).with_layout(1)


def _single(cfg: TrainConfig):
    """The reference: one process, the same global batch."""
    return train(_one_process(cfg))


def _initial_params(cfg: TrainConfig) -> Dict[str, torch.Tensor]:
    """The parameters every run of ``cfg`` starts from (the driver's model and seed)."""
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model, _ = build_model(driver.model_config(cfg, corpus), cfg.seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _key_bias_mask(numel: int) -> torch.Tensor:
    """Where the key biases sit in a fused qkv bias: the middle of each head's [q, k, v]
    (dist_kernels.models.GPT lays the fused qkv out head by head)."""
    mask = torch.zeros(numel, dtype=torch.bool)
    hd = TINY.dim // TINY.n_heads
    for h in range(TINY.n_heads):
        mask[h * 3 * hd + hd : h * 3 * hd + 2 * hd] = True
    return mask


def _key_bias_noise(cfg: TrainConfig) -> float:
    """The largest key-bias gradient of ``cfg``'s steps, from the initial parameters on one
    process in FP32: pure rounding, since the exact gradient is zero (softmax ignores a
    constant added to every key)."""
    cfg = _one_process(cfg)
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model, loss_fn = build_model(driver.model_config(cfg, corpus), cfg.seed)
    sampler = data.Sampler(corpus, cfg.model.block_size, cfg.global_batch, cfg.seed)
    bias = model[1].attn.qkv.bias
    key = _key_bias_mask(bias.numel())
    noise = 0.0
    for step in range(cfg.steps):
        model.zero_grad()
        inputs, targets = sampler.replica_batch(step, 0, cfg.global_batch)
        for x, y in zip(inputs.split(cfg.micro_batch), targets.split(cfg.micro_batch)):
            (loss_fn(model(x), y) / cfg.grad_accum).backward()
        noise = max(noise, bias.grad[key].abs().max().item())
    return noise


def _key_bias_bound(cfg: TrainConfig) -> float:
    """How far two runs' key biases may drift apart under AdamW: pure rounding, bounded.

    Adam moves an element by ``lr |m_hat| / (sqrt(v_hat) + eps)`` a step, and ``|m_hat|`` (a
    bias-corrected mean of past gradients) is at most their largest magnitude ``G``: so a step
    moves a key bias by at most ``lr G / eps``, and ``steps`` steps by ``steps lr G / eps``
    (the rate is at most ``lr``: warm-up and decay only lower it). ``G`` is the rounding noise
    of :func:`_key_bias_noise`; a layout sums the same micro-batch gradients in another order,
    which we allow to double it. The two runs drift independently: ``(1 + 2) G`` in all.
    With lr 3e-3, 3 steps and G ~ 2e-11 that is ~5e-5, against ~7.7e-3 that training moves
    the other parameters."""
    return cfg.steps * cfg.lr * 3 * _key_bias_noise(cfg) / ADAM_EPS


def _assert_params_close(mine, ref, key_bound, tp_rank=0, rtol=1e-5, atol=3e-5):
    """A rank's parameters (its stage; its tensor shard) after AdamW steps, against the same
    parameters of a reference run, to FP32 rounding as Adam propagates it.

    Adam divides each gradient by its own root mean square, so the rounding in a tiny gradient
    (an embedding row of a rare character) moves its parameter by a fraction of ``lr``: the
    callers' ``atol`` is 1% of one step (3e-5 at lr 3e-3), ``rtol`` FP32 rounding accumulated
    over a few steps. The key third of ``qkv.bias`` has no gradient but rounding noise at all:
    it is held to ``key_bound`` (:func:`_key_bias_bound`)."""
    assert mine and set(mine) <= set(ref), (sorted(mine), sorted(ref))
    for k, x in mine.items():
        y = shard_of(ref[k], x, tp_rank)
        if k.endswith("qkv.bias"):
            key = shard_of(_key_bias_mask(ref[k].numel()), x, tp_rank)
            assert (x[key] - y[key]).abs().max() <= key_bound, k
            x, y = x[~key], y[~key]
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def _counted_flops_per_token(cfg: TrainConfig) -> int:
    """Training FLOPs per token of ``cfg``'s model, counted by torch's FlopCounterMode over one
    forward and backward (attention on the math backend, whose matmuls it sees), plus 6 per
    ``nn.Linear`` bias: the driver counts a bias as a matmul parameter (6 N, Kaplan et al.),
    while the counter sees only the addmm's product."""
    cfg = _one_process(cfg)
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model, loss_fn = build_model(driver.model_config(cfg, corpus), cfg.seed)
    sampler = data.Sampler(corpus, cfg.model.block_size, cfg.global_batch, cfg.seed)
    inputs, targets = sampler.batch(0, 0, cfg.micro_batch)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn(model(inputs), targets).backward()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    biases = sum(m.bias.numel() for m in linears if m.bias is not None)
    total = counter.get_total_flops()
    assert total % inputs.numel() == 0, (total, inputs.shape)
    return total // inputs.numel() + 6 * biases


def test_flops_per_token_follows_the_heads_width_and_the_routed_experts():
    """--kv-channels wider than d_model / heads, and MoE blocks (each token through top_k of
    the experts): the driver's FLOPs per token (6 N + 12 L T n_heads head_dim, N counting
    top_k experts) equals torch's count, as it does for the default model."""
    from dist_kernels.train.model import flops_per_token

    moe = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)
    every_other = dataclasses.replace(TINY, n_experts=8, top_k=1, moe_every=2)
    shared = dataclasses.replace(moe, moe_ffn_hidden_size=48, moe_shared_expert_gate=True,
                                 moe_shared_expert_intermediate_size=24)  # fmt: skip
    for model in (TINY, dataclasses.replace(TINY, kv_channels=32), moe, every_other, shared):
        cfg = _cfg(model=model)
        one = _one_process(cfg)
        corpus = data.CharCorpus.build(one.data, model.block_size)
        built, _ = build_model(driver.model_config(one, corpus), one.seed)
        formula = flops_per_token(driver.model_config(one, corpus), built)
        assert formula == _counted_flops_per_token(cfg), model


def _assert_metrics(ranks, cfg: TrainConfig) -> None:
    """tokens/s, samples/s, FLOPs per token, MFU and scaling efficiency of every record,
    against counts made outside the driver: the samples and tokens the ranks' samplers handed
    out for that step (a sample read by several ranks, tp or pp, counts once), the FLOPs of the
    model counted by torch, and the known peak each rank's probe reported. The step time is
    the record's own; the steps' sum must fit in the run's wall time."""
    consumed = {}
    for r in ranks:
        consumed.update(r["consumed"])
    world = len(ranks)
    peak = sum((rank + 1) * PEAK_FLOPS for rank in range(world))
    flops_per_token = _counted_flops_per_token(cfg)
    records = ranks[0]["records"]
    assert [rec["step"] for rec in records] == list(range(1, cfg.steps + 1))  # log_every 1
    for rec in records:
        step = rec["step"] - 1
        tokens = sum(n for (s, _), n in consumed.items() if s == step)
        samples = sum(1 for s, _ in consumed if s == step)
        step_s = rec["step_ms"] / 1e3
        assert rec["tokens_per_s"] == pytest.approx(tokens / step_s, rel=1e-9), (rec, tokens)
        assert rec["samples_per_s"] == pytest.approx(samples / step_s, rel=1e-9), rec
        assert rec["flops_per_token"] == flops_per_token, rec
        assert rec["peak_flops"] == pytest.approx(peak, rel=1e-12), rec
        mfu = tokens / step_s * flops_per_token / peak
        assert rec["mfu"] == pytest.approx(mfu, rel=1e-9), (rec, mfu)
        if cfg.reference_tokens_per_s:
            ideal = world * cfg.reference_tokens_per_s
            assert rec["scaling_efficiency"] == pytest.approx(tokens / step_s / ideal, rel=1e-9)
    assert sum(rec["step_ms"] for rec in records) / 1e3 <= ranks[0]["wall_s"]


@pytest.fixture(scope="module")
def reference():
    """Single-process losses and parameters of the global batch 8 used by the layout tests,
    and the key-bias bound of those runs."""
    print(f"seed {SEED}")
    cfg = _cfg(global_batch=8)
    result = _single(cfg)
    assert len(result.records) == cfg.steps
    bound = _key_bias_bound(cfg)
    print(f"key-bias bound {bound:.2e}")
    return [rec["loss"] for rec in result.records], result.params, bound


# ------------------------------------------------------------------ layouts


@pytest.mark.parametrize("engine", ["dk", "torch"])
def test_dp2_matches_single_process(reference, engine):
    ref_losses, ref_params, key_bound = reference
    cfg = _cfg(dp=2, global_batch=8, reference_tokens_per_s=1000.0)
    ranks = run_ranks(2, _on_ranks, cfg, engine, timeout=180)
    losses = ranks[0]["losses"]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for r in ranks:
        _assert_params_close(r["params"], ref_params, key_bound)
    # the check sees a wrong answer: the reference shifted by one step is far off
    assert abs(losses[1] - ref_losses[0]) > 1e-3
    rec = ranks[0]["records"][-1]
    for key in ("step", "loss", "lr", "tokens_per_s", "step_ms", "mfu", "forward_ms",
                "backward_ms", "comm_ms", "optimizer_ms", "peak_mem_mb"):  # fmt: skip
        assert key in rec, key
    assert rec["comm_ms"] is not None and rec["comm_ms"] >= 0
    assert len(rec["peak_mem_mb"]) == 2
    _assert_metrics(ranks, cfg)
    assert ranks[0]["stragglers"] == []  # no delay: nobody named


def _assert_layout_matches(ranks, reference, tp: int = 1) -> None:
    """Losses of rank 0 (the record), and every rank's updated parameters (its stage, its
    tensor shard: tensor-parallel ranks are adjacent) against the single-process run."""
    ref_losses, ref_params, key_bound = reference
    torch.testing.assert_close(ranks[0]["losses"], ref_losses, rtol=1e-5, atol=0)
    for rank, r in enumerate(ranks):
        _assert_params_close(r["params"], ref_params, key_bound, tp_rank=rank % tp)
    # every parameter of the model is checked by some rank
    assert set().union(*(r["params"] for r in ranks)) == set(ref_params)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp2_matches_single_process(reference, schedule):
    cfg = _cfg(pp=2, global_batch=8, micro_batch=2, schedule=schedule)
    ranks = run_ranks(2, _on_ranks, cfg, timeout=180)
    assert ranks[0]["records"][-1]["forward_ms"] is None  # inside the schedule: not split out
    _assert_layout_matches(ranks, reference)
    _assert_metrics(ranks, cfg)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_pp2_v_schedules_match_single_process(schedule):
    """Two stages per rank in a V (rank 0 holds the first and the last): a two-block model,
    so that the four stages have a layer each, against its own single-process run."""
    cfg = _cfg(pp=2, global_batch=8, micro_batch=2, schedule=schedule,
               model=dataclasses.replace(TINY, n_layers=2))  # fmt: skip
    single = _single(cfg)
    reference = ([rec["loss"] for rec in single.records], single.params, _key_bias_bound(cfg))
    ranks = run_ranks(2, _on_ranks, cfg, timeout=180)
    _assert_layout_matches(ranks, reference)
    # rank 0 holds the first stage and the last (the V's way back), rank 1 the two blocks
    assert {k.split(".")[0] for k in ranks[0]["params"]} == {"0", "3"}, sorted(ranks[0]["params"])
    assert {k.split(".")[0] for k in ranks[1]["params"]} == {"1", "2"}, sorted(ranks[1]["params"])


def test_dp2_x_tp1_x_pp2_matches_single_process(reference):
    """4 ranks: two pipelines of two stages, their stage gradients averaged by DDP."""
    cfg = _cfg(dp=2, pp=2, global_batch=8, micro_batch=2)
    _assert_layout_matches(run_ranks(4, _on_ranks, cfg, timeout=240), reference)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_dp2_x_pp2_zero1_matches_single_process(reference, schedule):
    """4 ranks: two pipelines of two stages, each stage's optimizer state sharded over its two
    replicas (ZeRO-1); the micro-batches' gradients add up locally and the optimizer's step
    reduce-scatters them. zb-h1 computes weight gradients apart from input gradients."""
    cfg = _cfg(dp=2, pp=2, zero=1, global_batch=8, micro_batch=2, schedule=schedule)
    _assert_layout_matches(run_ranks(4, _on_ranks, cfg, timeout=240), reference)


SP = dict(sequence_parallel=True)


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2), dict(dp=2, tp=2), dict(dp=2, tp=2, **SP), dict(tp=2, pp=2, micro_batch=2, **SP),
     dict(tp=2, cp=2, **SP)],
    ids=["tp2", "dp2xtp2", "dp2xtp2-sp", "tp2xpp2-sp", "tp2xcp2-sp"],
)  # fmt: skip
def test_tensor_parallel_matches_single_process(reference, layout):
    """tp 2 alone and with dp; with sequence parallelism (the sequence split over the tp
    ranks between the tensor-parallel layers) beside dp, a pipeline (each tp rank's sequence
    shard sent to the same tp rank of the next stage) and cp."""
    world = layout.get("dp", 1) * layout["tp"] * layout.get("pp", 1) * layout.get("cp", 1)
    cfg = _cfg(global_batch=8, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, timeout=240)
    assert all(r["sequence_parallel"] == cfg.sequence_parallel for r in ranks)
    _assert_layout_matches(ranks, reference, tp=layout["tp"])
    _assert_metrics(ranks, cfg)


@pytest.mark.parametrize(
    "layout",
    [dict(cp=2), dict(dp=2, cp=2), dict(cp=2, pp=2), dict(cp=2, zero=2), dict(cp=2, zero=3)],
    ids=["cp2", "dp2xcp2", "cp2xpp2", "cp2-zero2", "cp2-zero3"],
)
def test_context_parallel_matches_single_process(reference, layout):
    """The sequence split over cp ranks (ring attention), gradients averaged over dp x cp."""
    world = layout.get("dp", 1) * layout["cp"] * layout.get("pp", 1)
    cfg = _cfg(global_batch=8, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, timeout=240)
    _assert_layout_matches(ranks, reference)
    _assert_metrics(ranks, cfg)


@pytest.mark.parametrize("zero", [2, 3])
def test_dp2_zero_matches_single_process(reference, zero):
    """ZeRO 2, and 3 (parameters sharded: the result gathers them, a collective)."""
    ref_losses, ref_params, key_bound = reference
    ranks = run_ranks(2, _on_ranks, _cfg(dp=2, zero=zero, global_batch=8), timeout=180)
    torch.testing.assert_close(ranks[0]["losses"], ref_losses, rtol=1e-5, atol=0)
    for r in ranks:
        _assert_params_close(r["params"], ref_params, key_bound)


def test_dp2_x_tp2_zero3_matches_single_process(reference):
    """4 ranks: ZeRO 3 over the data-parallel pairs of tensor-parallel shards."""
    cfg = _cfg(dp=2, tp=2, zero=3, global_batch=8)
    _assert_layout_matches(run_ranks(4, _on_ranks, cfg, timeout=240), reference, tp=2)


@pytest.mark.parametrize(
    "layout",
    [dict(dp=2, zero=3), dict(dp=2, pp=2, zero=1), dict(dp=2, zero=2, **FP16), dict(pp=2, **FP16)],
    ids=["dp2-zero3", "dp2xpp2-zero1", "dp2-zero2-fp16", "pp2-fp16"],
)
def test_zero_resume_is_exact(tmp_path, layout):
    """ZeRO 3 on 2 ranks, ZeRO 1 on two pipelines of two stages, and fp16 (ZeRO 2; a
    pipeline): N steps straight == N / 2 steps, stop, resume to N, bitwise (the checkpoint
    holds each rank's shard of the optimizer state, at stage 3 of the parameters, and the
    loss scaler's state; one directory per pipeline stage)."""
    world = layout.get("dp", 1) * layout.get("pp", 1)
    cfg = _cfg(**{**dict(steps=6, global_batch=4, warmup=2, log_every=1), **layout})
    straight = run_ranks(world, _on_ranks, cfg, timeout=180)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    stop = cfg.steps // 2
    run_ranks(world, _on_ranks, dataclasses.replace(cfg, stop_after=stop, **ckpt), timeout=180)
    resumed = run_ranks(world, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=180)
    assert resumed[0]["start"] == stop
    if cfg.dtype == "fp16":  # the loss scaler resumed too: the same scales and skips
        scales = [(r["loss_scale"], r["skipped_steps"]) for r in straight[0]["records"]]
        print(f"(scale, skipped) per step {scales}")
        assert len({s for s, _ in scales[stop - 1 :]}) > 1  # the scale moves after the resume
        assert [(r["loss_scale"], r["skipped_steps"]) for r in resumed[0]["records"]] == scales[
            stop:
        ]
    for r in range(world):
        for k, v in straight[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), (r, k)


# --clip-grad small enough to clip every step of these runs (their norms are ~3-5)
CLIP = 0.5


@pytest.fixture(scope="module")
def clipped_reference():
    """The single-process run of global batch 8 with --clip-grad: losses, parameters, the
    key-bias bound and the norm of every step before clipping."""
    cfg = _cfg(global_batch=8, clip_grad=CLIP, log_every=1)
    result = _single(cfg)
    norms = [rec["grad_norm"] for rec in result.records]
    print(f"single-process grad norms {norms}")
    assert min(norms) > 2 * CLIP  # every step clipped
    losses = [rec["loss"] for rec in result.records]
    return losses, result.params, _key_bias_bound(cfg), norms


@pytest.mark.parametrize(
    "layout,world",
    [
        (dict(dp=2), 2),
        (dict(dp=2, engine="torch"), 2),
        (dict(dp=2, zero=2), 2),
        (dict(dp=2, zero=3), 2),
        (dict(dp=2, zero=2, engine="torch"), 2),
        (dict(pp=2, micro_batch=2), 2),
        (dict(dp=2, tp=2), 4),
        (dict(dp=2, tp=2, zero=1), 4),
        (dict(dp=2, pp=2, zero=1, micro_batch=2), 4),
        (dict(cp=2), 2),
    ],
    ids=["dp2", "dp2-torch", "dp2-zero2", "dp2-zero3", "fsdp2", "pp2", "dp2xtp2",
         "dp2xtp2-zero1", "dp2xpp2-zero1", "cp2"],
)  # fmt: skip
def test_clip_grad_norm_is_the_whole_models_in_every_layout(clipped_reference, layout, world):
    """--clip-grad: each step's norm (before clipping) equals the single process's, to FP32
    rounding: every element counted once over replicas, tensor shards and stages; and the
    clipped training ends on the single process's parameters."""
    ref_losses, ref_params, key_bound, ref_norms = clipped_reference
    engine = layout.pop("engine", "dk")
    cfg = _cfg(global_batch=8, clip_grad=CLIP, log_every=1, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=240)
    norms = [rec["grad_norm"] for rec in ranks[0]["records"]]
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    if engine == "dk":  # torch's FSDP2 returns DTensors: checked against dk by the norms
        _assert_layout_matches(ranks, (ref_losses, ref_params, key_bound), tp=layout.get("tp", 1))


@pytest.fixture(scope="module")
def fp16_references():
    """torch's GradScaler on one process and under torch DDP at dp 2: per replica batch (8 or
    4), the losses, the parameters, and each step's loss scale and skip.

    A micro-batch's loss is divided by the accumulation count, not by dp (as in torch, Megatron
    and DeepSpeed), so the gradients a rank scales are larger the smaller its share of the
    batch: at dp 2 they are twice one process's, which moves the overflow threshold by exactly
    one halving of the scale. Each layout is held to the reference with its replica batch."""
    refs = {}
    for dp in (1, 2):
        cfg = _cfg(global_batch=8, log_every=1, dp=dp, **FP16)
        if dp == 1:
            single = _single(dataclasses.replace(cfg, engine="torch"))
            losses, params, records = (
                [r["loss"] for r in single.records],
                single.params,
                single.records,
            )
        else:
            rank0 = run_ranks(2, _on_ranks, cfg, "torch", timeout=180)[0]
            losses, params, records = rank0["losses"], rank0["params"], rank0["records"]
        scales = [(rec["loss_scale"], rec["skipped_steps"]) for rec in records]
        print(f"dp {dp}, torch GradScaler: (scale, skipped) per step {scales}")
        skipped = [s for _, s in scales]
        assert skipped[0] == 1 and 0 in skipped and skipped.count(1) >= 2  # skips, then steps
        refs[8 // dp] = (losses, params, scales)
    assert refs[8][2] != refs[4][2]  # the replica batch matters: the references differ
    return refs


WD = 0.5  # large enough that decaying a norm's weight (1.0) moves it far beyond rounding


def _trained_by_hand(cfg: TrainConfig, decayed) -> Dict[str, torch.Tensor]:
    """``cfg``'s model trained on one process by a loop written here: torch's AdamW with
    weight decay on the parameters ``decayed(name, p)`` picks, none on the rest."""
    from dist_kernels.train.engines import make_scheduler, peak_lr

    cfg = _one_process(cfg)
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model, loss_fn = build_model(driver.model_config(cfg, corpus), cfg.seed)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decayed(n, p)], "weight_decay": WD},
        {"params": [p for n, p in named if not decayed(n, p)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=peak_lr(cfg), betas=(0.9, 0.95), eps=ADAM_EPS)
    sched = make_scheduler(cfg, opt, 0)
    sampler = data.Sampler(corpus, cfg.model.block_size, cfg.global_batch, cfg.seed)
    for step in range(cfg.steps):
        inputs, targets = sampler.replica_batch(step, 0, cfg.global_batch)
        for x, y in zip(inputs.split(cfg.micro_batch), targets.split(cfg.micro_batch)):
            (loss_fn(model(x), y) / cfg.grad_accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weight_decay_spares_biases_and_norms(reference):
    """--weight-decay decays matrices and embeddings only (nanoGPT's rule, Megatron's
    default): one process equals a loop written here with torch's AdamW in those two groups,
    not one that decays everything; and dp 2 with ZeRO-2, pp 2, torch's DDP and FSDP2 train as
    that process."""
    cfg = _cfg(global_batch=8, weight_decay=WD)
    ran = _single(cfg).params
    rule = _trained_by_hand(cfg, lambda name, p: p.dim() >= 2)
    everything = _trained_by_hand(cfg, lambda name, p: True)
    for k, v in rule.items():
        torch.testing.assert_close(ran[k], v, rtol=1e-6, atol=1e-7, msg=k)
    norm = "1.ln_1.weight"
    print(f"{norm}: {ran[norm].mean():.6f} spared, {everything[norm].mean():.6f} decayed")
    # decayed, every element shrinks by ~sum_t(lr_t) x WD x 1.0 (~3.7e-3 here), far above rounding
    assert (ran[norm] - everything[norm]).abs().min() > cfg.lr * WD
    key_bound = _key_bias_bound(cfg)
    losses = [rec["loss"] for rec in _single(cfg).records]
    for layout, engine in ((dict(dp=2, zero=2), "dk"), (dict(pp=2), "dk"),
                           (dict(dp=2), "torch"), (dict(dp=2, zero=2), "torch")):  # fmt: skip
        run = dataclasses.replace(cfg, **layout)
        ranks = run_ranks(2, _on_ranks, run, engine, timeout=240)
        torch.testing.assert_close(ranks[0]["losses"], losses, rtol=1e-5, atol=0)
        if not (engine == "torch" and run.zero):  # FSDP2's are DTensors: checked by the losses
            for r in ranks:
                _assert_params_close(r["params"], ran, key_bound)


@pytest.mark.parametrize(
    "decay,more",
    [("linear", {}), ("wsd", {}), ("wsd", dict(wsd_decay_steps=4, wsd_decay_style="minus_sqrt"))],
    ids=["linear", "wsd-default-20pct", "wsd-4-minus-sqrt"],
)
def test_each_decay_style_sets_every_steps_rate(decay, more):
    """--decay linear / wsd: each step's logged rate is the peak times dk.lr's factor of that
    step (wsd's decay over the last 20% of the steps unless given)."""
    cfg = _cfg(steps=10, warmup=2, log_every=1, decay=decay, **more)
    rates = [r["lr"] for r in _single(cfg).records]
    if decay == "linear":
        factor = dk_lr.warmup_linear_factor(2, 10, cfg.min_lr_ratio)
    else:
        decay_steps = more.get("wsd_decay_steps", 2)  # 20% of 10
        style = more.get("wsd_decay_style", "linear")
        factor = dk_lr.warmup_stable_decay_factor(2, 10, decay_steps, cfg.min_lr_ratio, style)
    assert rates == pytest.approx([cfg.lr * factor(s) for s in range(10)], rel=1e-12)
    assert len(set(rates)) >= 3  # warm-up, peak, decay
    with pytest.raises(ConfigError, match=r"wsd_decay_steps\(9\) must be in \[0, steps\(10\)"):
        _cfg(steps=10, warmup=2, decay="wsd", wsd_decay_steps=9).with_layout(1)


def _rates_of_applied_steps(cfg: TrainConfig, skipped) -> list:
    """Each step's learning rate by the formulas of dist_kernels/lr.py (warm-up, then cosine),
    at the number of updates applied before it: a skipped step leaves the next one's rate
    where it was (Megatron's and DeepSpeed's schedules count applied updates)."""
    warmup, total, low = cfg.warmup, cfg.steps, cfg.min_lr_ratio
    rates, applied = [], 0
    for skip in skipped:
        if applied < warmup:
            factor = (applied + 1) / warmup
        else:
            progress = min(1.0, (applied - warmup) / (total - warmup))
            factor = low + (1 - low) * (1 + math.cos(math.pi * progress)) / 2
        rates.append(cfg.lr * factor)
        applied += 0 if skip else 1
    return rates


@pytest.mark.parametrize(
    "layout,world",
    [(dict(dp=2), 2), (dict(dp=2, zero=2), 2), (dict(dp=2, zero=2, engine="torch"), 2),
     (dict(pp=2, micro_batch=2), 2), (dict(tp=2), 2), (dict(dp=2, tp=2), 4),
     (dict(dp=2, pp=2, zero=1, micro_batch=2), 4)],
    ids=["dp2", "dp2-zero2", "fsdp2", "pp2", "tp2", "dp2xtp2", "dp2xpp2-zero1"],
)  # fmt: skip
def test_fp16_loss_scaling_matches_torch_grad_scaler(fp16_references, layout, world):
    """--dtype fp16: every layout takes the decisions of torch's GradScaler at its replica
    batch (the same scale each step, the same steps skipped: an overflow on any rank, shard or
    stage skips the step on all), and trains to its losses and parameters."""
    engine = layout.pop("engine", "dk")
    cfg = _cfg(global_batch=8, log_every=1, **FP16, **layout)
    ref_losses, ref_params, ref_scales = fp16_references[8 // layout.get("dp", 1)]
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=240)
    scales = [(rec["loss_scale"], rec["skipped_steps"]) for rec in ranks[0]["records"]]
    assert scales == ref_scales
    rates = [rec["lr"] for rec in ranks[0]["records"]]
    assert rates == pytest.approx(_rates_of_applied_steps(cfg, [s for _, s in scales]), rel=1e-12)
    torch.testing.assert_close(ranks[0]["losses"], ref_losses, rtol=1e-3, atol=0)
    if engine == "dk":  # FSDP2's parameters are DTensors: checked by the losses
        init = _initial_params(cfg)
        for rank, r in enumerate(ranks):
            tp_rank = rank % layout.get("tp", 1)
            moved, off = 0.0, 0.0
            for k, x in r["params"].items():
                moved += (shard_of(ref_params[k] - init[k], x, tp_rank)).square().sum().item()
                off += (x - shard_of(ref_params[k], x, tp_rank)).square().sum().item()
            print(f"rank {rank}: parameters off by {off**0.5:.2e}, moved {moved**0.5:.2e}")
            # FP16 rounding, which Adam amplifies where a gradient is near zero, leaves a few
            # elements up to ~lr apart; a step taken or skipped differently moves them all
            assert off**0.5 < 0.05 * moved**0.5


@pytest.mark.parametrize(
    "layout,world",
    [(dict(dp=2), 2), (dict(dp=2, zero=3), 2), (dict(dp=2, tp=2), 4), (dict(cp=2), 2),
     (dict(pp=2, micro_batch=2), 2)],
    ids=["dp2", "dp2-zero3", "dp2xtp2", "cp2", "pp2"],
)  # fmt: skip
def test_recompute_trains_as_without_it(reference, layout, world):
    """--recompute (every block's forward run again in backward) trains to the same bits as
    the same layout without it, and so to the single process's parameters."""
    cfg = _cfg(global_batch=8, **layout)
    plain = run_ranks(world, _on_ranks, cfg, timeout=240)
    again = run_ranks(world, _on_ranks, dataclasses.replace(cfg, recompute=True), timeout=240)
    assert again[0]["losses"] == plain[0]["losses"]
    for r, (a, b) in enumerate(zip(again, plain)):
        assert a["params"].keys() == b["params"].keys()
        for k, v in b["params"].items():
            assert torch.equal(a["params"][k], v), (r, k)
    _assert_layout_matches(again, reference, tp=layout.get("tp", 1))


# Llama's choices: RMSNorm, SwiGLU, rotary position embedding, no biases (so the key-bias
# rounding bound of the GPT-2 model does not apply: every parameter is held to the tolerance)
LLAMA_TINY = dataclasses.replace(
    TINY,
    normalization="rmsnorm",
    swiglu=True,
    position_embedding="rope",
    bias=False,
    n_heads=4,
    n_kv_heads=2,  # grouped-query attention: one group per tp rank at tp 2
)


def _model_reference(model: GPTConfig):
    """One process training ``model`` on the layout tests' global batch: (losses, params, key
    bias bound 0: the Llama family has no biases)."""
    print(f"seed {SEED}")
    result = _single(_cfg(global_batch=8, model=model))
    return [rec["loss"] for rec in result.records], result.params, 0.0


@pytest.fixture(scope="module")
def llama_reference():
    return _model_reference(LLAMA_TINY)


@pytest.mark.parametrize(
    "layout,world",
    [(dict(dp=2), 2), (dict(dp=2, zero=3), 2), (dict(tp=2, sequence_parallel=True), 2),
     (dict(cp=2), 2), (dict(pp=2, micro_batch=2), 2), (dict(dp=2, tp=2), 4)],
    ids=["dp2", "dp2-zero3", "tp2-sp", "cp2", "pp2", "dp2xtp2"],
)  # fmt: skip
def test_llama_style_model_matches_single_process(llama_reference, layout, world):
    """--normalization rmsnorm --swiglu --position-embedding-type rope: every layout trains
    the Llama-style model to the single process's losses and parameters (rotary angles from
    the global positions under cp; the SwiGLU gate column-parallel beside fc under tp)."""
    cfg = _cfg(global_batch=8, model=LLAMA_TINY, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, timeout=240)
    _assert_layout_matches(ranks, llama_reference, tp=layout.get("tp", 1))
    assert not any("wpe" in k or k.endswith("bias") for r in ranks for k in r["params"])
    assert any(k.endswith("mlp.gate.weight") for r in ranks for k in r["params"])


# Gemma 3's choices on the Llama-style model: norms of 1 + w (also the per-head q / k norms),
# norms of the branches' outputs, scaled embeddings, GeGLU with tanh GELU, its own attention
# scale, and a window of 4 over 16 positions in the first of every two blocks, whose rope has
# its own base
GEMMA_TINY = dataclasses.replace(
    LLAMA_TINY, n_layers=2, norm_unit_offset=True, post_norms=True, qk_norm=True,
    embedding_multiplier=32**0.5, glu_activation="gelu", gelu_approximate="tanh",
    softmax_scale=0.3, sliding_window=4, global_attention_every=2, rope_local_theta=100.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def gemma_reference():
    return _model_reference(GEMMA_TINY)


@pytest.mark.parametrize(
    "layout,world",
    [(dict(dp=2, zero=3), 2), (dict(tp=2, sequence_parallel=True), 2),
     (dict(pp=2, micro_batch=2), 2)],
    ids=["dp2-zero3", "tp2-sp", "pp2"],
)  # fmt: skip
def test_gemma_style_model_matches_single_process(gemma_reference, layout, world):
    """--apply-layernorm-1p --post-norms --geglu --embedding-multiplier --softmax-scale
    --global-attention-every --rotary-base-local: every layout trains to the single
    process's losses and parameters (the output norms sequence-parallel under tp with SP).
    The soft-caps under tp: test_gpt_tp.py, in float64."""
    cfg = _cfg(global_batch=8, model=GEMMA_TINY, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, timeout=240)
    _assert_layout_matches(ranks, gemma_reference, tp=layout.get("tp", 1))
    assert any(k.endswith("post_mlp_norm.weight") for r in ranks for k in r["params"])


# OLMo 2's block on the Llama-style model: no pre-norms, the branches' outputs normalised,
# the query / key norms over all the heads' features at once
OLMO2_TINY = dataclasses.replace(
    LLAMA_TINY, pre_norms=False, post_norms=True, qk_norm=True, qk_norm_scope="all"
)


@pytest.fixture(scope="module")
def olmo2_reference():
    return _model_reference(OLMO2_TINY)


@pytest.mark.parametrize(
    "layout,world",
    [(dict(dp=2, zero=3), 2), (dict(cp=2), 2), (dict(pp=2, micro_batch=2), 2)],
    ids=["dp2-zero3", "cp2", "pp2"],
)  # fmt: skip
def test_olmo2_style_model_matches_single_process(olmo2_reference, layout, world):
    """--no-pre-norms --post-norms --qk-layernorm --qk-norm-scope all: every layout trains to
    the single process's losses and parameters; tp is refused (a rank holds only its heads)."""
    cfg = _cfg(global_batch=8, model=OLMO2_TINY, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, timeout=240)
    _assert_layout_matches(ranks, olmo2_reference, tp=1)
    assert not any(".ln_1." in k for r in ranks for k in r["params"])
    with pytest.raises(ConfigError, match=r"qk_norm_scope 'all' with tp\(2\) > 1"):
        _cfg(global_batch=8, model=OLMO2_TINY, tp=2).with_layout(2)


# Nemotron's block: LayerNorms of 1 + w keeping their biases, no linear biases, a squared-ReLU
# MLP, rope over half of each head
NEMOTRON_TINY = dataclasses.replace(
    TINY, normalization="layernorm", norm_unit_offset=True, bias=False, norm_bias=True,
    squared_relu=True, position_embedding="rope", rotary_percent=0.5,
)  # fmt: skip


@pytest.mark.parametrize(
    "layout,world", [(dict(tp=2, sequence_parallel=True), 2), (dict(pp=2, micro_batch=2), 2)],
    ids=["tp2-sp", "pp2"],
)  # fmt: skip
def test_nemotron_style_model_matches_single_process(layout, world):
    """--squared-relu --apply-layernorm-1p --disable-bias-linear --rotary-percent 0.5: the
    LayerNorms' biases sequence-parallel under tp with SP; every layout trains as one process."""
    reference = _model_reference(NEMOTRON_TINY)
    ranks = run_ranks(world, _on_ranks, _cfg(global_batch=8, model=NEMOTRON_TINY, **layout),
                      timeout=240)  # fmt: skip
    _assert_layout_matches(ranks, reference, tp=layout.get("tp", 1))
    assert any(k.endswith("ln_1.bias") for r in ranks for k in r["params"])


def test_gemma_style_options_change_the_model():
    """Each option changes the loss of the same weights (none is silently ignored), and
    the unit-offset norm's weights start at 0 and multiply by 1 + w."""
    from dist_kernels.models import GPT

    torch.manual_seed(SEED)
    ids = torch.randint(0, 64, (2, 16))
    base = dataclasses.replace(
        GEMMA_TINY, vocab_size=64, attn_logit_softcapping=0.5, final_logit_softcapping=1.0
    )
    full = GPT(base)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = full.state_dict()
    torch.set_grad_enabled(False)
    want = full(ids, ids)
    options = dict(post_norms=False, embedding_multiplier=1.0, glu_activation="silu",
                   softmax_scale=None, global_attention_every=0, rope_local_theta=None,
                   norm_unit_offset=False, attn_logit_softcapping=None,
                   final_logit_softcapping=None)  # fmt: skip
    for key, value in options.items():
        other = GPT(dataclasses.replace(base, **{key: value}))
        other.load_state_dict(state, strict=False)
        assert float(other(ids, ids)) != pytest.approx(float(want), rel=1e-6), key
    norm = GPT(base).blocks[0].ln_1
    assert torch.equal(norm.weight, torch.zeros(32))
    x = torch.randn(3, 32, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.fill_(0.5)
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + base.norm_eps)
    torch.testing.assert_close(norm.double()(x), rms * 1.5)
    torch.set_grad_enabled(True)


COMPILE = dict(compile=True, compile_backend="aot_eager")


@pytest.mark.parametrize(
    "layout,world,engine",
    [(dict(dp=2), 2, "dk"), (dict(dp=2), 2, "torch"), (dict(dp=2, zero=3), 2, "dk"),
     (dict(dp=2, tp=2, sequence_parallel=True), 4, "dk"), (dict(cp=2), 2, "dk"),
     (dict(pp=2, micro_batch=2), 2, "dk"), (dict(dp=2, compile_backend="inductor"), 2, "dk")],
    ids=["dp2", "dp2-torch-ddp", "dp2-zero3", "dp2xtp2-sp", "cp2", "pp2", "dp2-inductor"],
)  # fmt: skip
def test_compile_trains_as_the_single_process(reference, layout, world, engine):
    """--compile (every block torch.compiled; aot_eager, and inductor, torch's default, once):
    dynamo compiled graphs on every rank, and the run trains to the single process's losses
    and parameters, as the eager layouts do: the engines' hooks, ZeRO-3's per-block gathers,
    the tensor-parallel and ring-attention collectives (run eagerly between graphs) and the
    pipeline's stages all work around compiled blocks."""
    cfg = _cfg(global_batch=8, **{**COMPILE, **layout})
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=300)
    graphs = [r["compiled_graphs"] for r in ranks]
    # every rank compiled its blocks; at pp 2 the one block of TINY is on one stage only
    assert (sum(graphs) > 0) if layout.get("pp", 1) > 1 else all(graphs), graphs
    _assert_layout_matches(ranks, reference, tp=layout.get("tp", 1))


def test_llama_style_flags_reach_the_model():
    from dist_kernels.train.cli import build_parser, config_from_args

    argv = ["--normalization", "rmsnorm", "--swiglu", "--position-embedding-type", "rope",
            "--rotary-base", "500", "--num-query-groups", "2"]  # fmt: skip
    model = config_from_args(build_parser().parse_args(argv)).model
    assert (model.normalization, model.swiglu, model.position_embedding, model.rope_theta,
            model.n_kv_heads) == ("rmsnorm", True, "rope", 500.0, 2)  # fmt: skip
    with pytest.raises(ConfigError, match=r"n_kv_heads\(2\) is not a multiple of tp\(4\)"):
        _cfg(tp=4, model=dataclasses.replace(TINY, n_heads=4, n_kv_heads=2)).with_layout(4)
    default = config_from_args(build_parser().parse_args([])).model
    assert (default.normalization, default.swiglu, default.position_embedding) == (
        "layernorm", False, "learned"
    )  # fmt: skip
    odd = ["--position-embedding-type", "rope", "--d-model", "36", "--n-head", "4"]
    with pytest.raises(ValueError, match=r"head size 9 \(dim\(36\) / n_heads\(4\)\) is odd"):
        config_from_args(build_parser().parse_args(odd))


@pytest.mark.parametrize(
    "layout,world,engine",
    [(dict(dp=2), 2, "dk"), (dict(dp=2), 2, "torch"), (dict(dp=2, zero=2), 2, "dk"),
     (dict(dp=2, zero=2), 2, "torch"), (dict(dp=2, zero=3), 2, "dk"),
     (dict(pp=2, micro_batch=2), 2, "dk"), (dict(dp=2, pp=2, zero=1, micro_batch=2), 4, "dk")],
    ids=["dp2", "dp2-torch-ddp", "dp2-zero2", "dp2-fsdp2", "dp2-zero3", "pp2", "dp2xpp2-zero1"],
)  # fmt: skip
def test_fused_adamw_trains_as_the_single_process(reference, layout, world, engine):
    """--optimizer fused-adamw: our engines step with dk.optim.FusedAdamW (ZeRO: on each
    shard), torch's with AdamW(fused=True) (FSDP2: on DTensors); a fused kernel ran on every
    rank every step, and the run ends at the single process's losses and parameters (which
    torch's per-tensor AdamW trained)."""
    cfg = _cfg(global_batch=8, optimizer="fused-adamw", **layout)
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=240)
    assert all(r["fused_steps"] >= cfg.steps for r in ranks), [r["fused_steps"] for r in ranks]
    if engine == "dk":  # FSDP2's parameters are DTensors: checked by the losses
        _assert_layout_matches(ranks, reference)
    else:
        torch.testing.assert_close(ranks[0]["losses"], reference[0], rtol=1e-5, atol=0)
    plain = run_ranks(world, _on_ranks, _cfg(global_batch=8, **layout), engine, timeout=240)
    assert all(r["fused_steps"] == 0 for r in plain)  # the default is torch's unfused AdamW


def _token_twin(tmp_path, suffix: str) -> str:
    """The test corpus's characters as token ids (the ids CharCorpus gives them) in a token
    file: ``.bin`` (uint16) or ``.npy`` (int32)."""
    corpus = data.CharCorpus.build(CORPUS, TINY.block_size)
    ids = corpus.tokens.numpy()
    path = str(tmp_path / f"corpus{suffix}")
    if suffix == ".bin":
        ids.astype("<u2").tofile(path)
    else:
        np.save(path, ids.astype(np.int32))
    return path


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_token_file_trains_as_its_text(tmp_path, suffix):
    """A file of token ids holding the test corpus's character ids trains bit for bit as the
    text does (same ids, same vocabulary, same windows), at dp 2 with validation; the size of
    the vocabulary is the largest id + 1 unless given."""
    corpus = data.CharCorpus.build(CORPUS, TINY.block_size)
    tokens = _token_twin(tmp_path, suffix)
    assert data.build_corpus(tokens, 16).vocab_size == corpus.vocab_size
    cfg = _cfg(dp=2, global_batch=8, eval_interval=3)
    text = run_ranks(2, _on_ranks, cfg, timeout=180)
    given = dataclasses.replace(cfg, data=tokens, vocab_size=corpus.vocab_size)
    ids = run_ranks(2, _on_ranks, given, timeout=180)
    assert ids[0]["losses"] == text[0]["losses"]
    assert ids[0]["evals"] == text[0]["evals"]
    for k, v in text[0]["params"].items():
        assert torch.equal(ids[0]["params"][k], v), k


def test_token_file_errors_and_identity(tmp_path):
    tokens = _token_twin(tmp_path, ".bin")
    with pytest.raises(
        data.DataError, match=r"token ids in \[0, \d+\], outside \[0, vocab_size\(10\)\)"
    ):
        data.build_corpus(tokens, 16, vocab_size=10)
    with pytest.raises(data.DataError, match=r"vocab_size\(300\) is for files of token ids"):
        data.build_corpus(CORPUS, 16, vocab_size=300)
    square = str(tmp_path / "square.npy")
    np.save(square, np.zeros((4, 4), dtype=np.int64))
    with pytest.raises(data.DataError, match=r"token ids are a 1-D integer array"):
        data.build_corpus(square, 16)
    short = str(tmp_path / "short.bin")
    np.arange(10, dtype="<u2").tofile(short)
    with pytest.raises(data.DataError, match=r"has 10 tokens; need at least 18"):
        data.build_corpus(short, 16)
    # a checkpoint of one token file does not resume on another (one id changed at the end)
    before = data.build_corpus(tokens, 16).fingerprint()
    ids = np.fromfile(tokens, dtype="<u2")
    ids[-1] = (ids[-1] + 1) % 5
    ids.tofile(tokens)
    assert data.build_corpus(tokens, 16).fingerprint() != before


def test_compile_errors():
    with pytest.raises(ConfigError, match=r"compile with schedule='zb-h1': the schedule splits"):
        TrainConfig(pp=2, grad_accum=4, schedule="zb-h1", compile=True).with_layout(2)
    with pytest.raises(ConfigError, match=r"compile_backend='aot_eager' without compile"):
        TrainConfig(compile_backend="aot_eager").check()
    with pytest.raises(ConfigError, match=r"compile_backend must be one of \[.*'inductor'"):
        TrainConfig(compile=True, compile_backend="no-such-backend").check()
    TrainConfig(pp=2, grad_accum=4, schedule="1f1b", compile=True).with_layout(2)  # allowed


def test_recompute_runs_each_block_again_in_backward_and_saves_less():
    """What --recompute switches on, seen from outside: every block's forward runs twice per
    step (forward, then again in backward), and autograd keeps fewer bytes for backward."""
    from dist_kernels.models.gpt import Block

    cfg = dataclasses.replace(TINY, n_layers=2, vocab_size=32)
    ids = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(SEED))
    seen = {}
    for recompute in (False, True):
        model, loss_fn = build_model(cfg, SEED, recompute=recompute)
        calls, saved = [0], [0]
        real = Block._forward

        def counting(self, x, real=real, calls=calls):
            calls[0] += 1
            return real(self, x)

        def pack(t, saved=saved):
            saved[0] += t.numel() * t.element_size()
            return t

        with mock.patch.object(Block, "_forward", counting):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
        seen[recompute] = (calls[0], saved[0], loss.item())
    print(seen)
    assert seen[False][0] == 2 and seen[True][0] == 4  # 2 blocks; each again in backward
    assert seen[True][1] < seen[False][1]
    assert seen[True][2] == seen[False][2]


def test_clip_grad_errors():
    with pytest.raises(ConfigError, match=r"clip_grad must be >= 0"):
        TrainConfig(clip_grad=-1.0).check()


def test_every_option_a_user_sets_has_a_flag():
    """Each TrainConfig field but the model (its own flags) and the test-only ones reaches the
    config from the command line: given a value other than its default, the config has it."""
    from dist_kernels.train.cli import build_parser, config_from_args

    argv = [
        "--weight-decay", "0.1", "--min-lr-ratio", "0.05", "--straggler-min-ms", "5",
        "--straggler-patience", "3", "--straggler-threshold", "0.2", "--dtype", "fp16",
        "--initial-loss-scale", "1024", "--loss-scale-window", "100", "--hysteresis", "2",
        "--min-loss-scale", "2", "--clip-grad", "1.0", "--recompute", "--sequence-parallel",
        "--compile", "--compile-backend", "aot_eager", "--optimizer", "fused-adamw",
        "--adam-beta1", "0.8", "--adam-beta2", "0.99", "--adam-eps", "1e-6",
        "--vocab-size", "300", "--lr-decay-style", "wsd", "--lr-wsd-decay-steps", "3",
        "--lr-wsd-decay-style", "cosine", "--keep-last", "2", "--exit-signal-handler",
        "--exit-duration-in-mins", "30", "--eod-token", "3", "--reset-attention-mask",
        "--reset-position-ids", "--eod-mask-loss", "--calculate-per-token-loss",
    ]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    want = dict(weight_decay=0.1, min_lr_ratio=0.05, straggler_min_ms=5.0, straggler_patience=3,
                straggler_threshold=0.2, dtype="fp16", initial_loss_scale=1024.0,
                loss_scale_window=100, hysteresis=2, min_loss_scale=2.0, clip_grad=1.0,
                recompute=True, sequence_parallel=True, compile=True,
                compile_backend="aot_eager", optimizer="fused-adamw", adam_beta1=0.8,
                adam_beta2=0.99, adam_eps=1e-6, vocab_size=300, decay="wsd",
                wsd_decay_steps=3, wsd_decay_style="cosine", keep_last=2,
                exit_signal_handler=True, exit_duration_in_mins=30.0, eod_token=3,
                reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True,
                calculate_per_token_loss=True)  # fmt: skip
    assert {k: getattr(cfg, k) for k in want} == want
    default = config_from_args(build_parser().parse_args([]))
    assert all(getattr(default, k) != v for k, v in want.items())  # each flag changed something
    # and no field is left without a flag (the model has --n-layer etc.; the rest are tests')
    import inspect

    source = inspect.getsource(config_from_args)
    unset = [f.name for f in dataclasses.fields(TrainConfig) if f"{f.name}=" not in source]
    assert unset == [], unset
    with pytest.raises(ConfigError, match=r"weight_decay must be >= 0, got -0.1"):
        TrainConfig(weight_decay=-0.1).check()
    with pytest.raises(ConfigError, match=r"min_lr_ratio must lie in \[0, 1\], got 2.0"):
        TrainConfig(min_lr_ratio=2.0).check()
    one_of = r"optimizer must be one of \['adamw', 'fused-adamw', 'muon'\]"
    with pytest.raises(ConfigError, match=one_of):
        TrainConfig(optimizer="lamb").check()
    with pytest.raises(ConfigError, match=r"adam_beta2 must lie in \[0, 1\), got 1.0"):
        TrainConfig(adam_beta2=1.0).check()
    with pytest.raises(ConfigError, match=r"adam_eps must be > 0, got 0.0"):
        TrainConfig(adam_eps=0.0).check()


def test_sequence_parallel_errors():
    with pytest.raises(ConfigError, match=r"sequence_parallel splits the sequence over tp ranks"):
        TrainConfig(sequence_parallel=True).with_layout(2)
    moe = dataclasses.replace(TINY, n_experts=4)
    with pytest.raises(ConfigError, match=r"sequence_parallel with MoE blocks: each tp rank"):
        TrainConfig(tp=2, sequence_parallel=True, model=moe).with_layout(2)
    odd = dataclasses.replace(TINY, block_size=18)
    with pytest.raises(
        ConfigError, match=r"block_size\(18\) is not a multiple of tp\(2\) x cp\(2\)"
    ):
        TrainConfig(tp=2, cp=2, sequence_parallel=True, model=odd).with_layout(4)


def test_loss_scaling_errors():
    with pytest.raises(ConfigError, match=r"hysteresis, min_loss_scale: loss scaling is for "):
        TrainConfig(hysteresis=2, min_loss_scale=2.0).check()
    with pytest.raises(ConfigError, match=r"hysteresis: engine='torch' scales with torch's"):
        TrainConfig(dtype="fp16", hysteresis=2, engine="torch").check()
    with pytest.raises(ConfigError, match=r"min_loss_scale\(8.0\) must lie in \[0, "):
        TrainConfig(dtype="fp16", initial_loss_scale=4.0, min_loss_scale=8.0).check()
    with pytest.raises(ConfigError, match=r"loss_scale_window must be an int >= 1, got 0"):
        TrainConfig(dtype="fp16", loss_scale_window=0).check()
    TrainConfig(dtype="fp16", hysteresis=2, min_loss_scale=2.0).check()  # ours has both


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_above_1_with_a_pipeline_is_refused(zero):
    with pytest.raises(ConfigError, match=rf"zero\({zero}\) with pp\(2\) > 1: .* use zero\(1\)"):
        TrainConfig(dp=2, pp=2, zero=zero).with_layout(4)


def test_matmul_peak_is_the_flops_it_ran_over_the_time_it_took(monkeypatch):
    """The probe behind MFU: FLOPs counted by torch over a clock that ticks 1 ms a read."""
    reads = []

    def clock():
        reads.append(len(reads) * 1e-3)
        return reads[-1]

    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    size = 48
    with FlopCounterMode(display=False) as counter:
        peak = metrics.matmul_peak_flops.__wrapped__(size=size, seconds=0.01)
    timed = counter.get_total_flops() - 2 * size**3  # its one warm-up matmul is not timed
    assert timed > 0 and peak == pytest.approx(timed / (reads[-1] - reads[0]), rel=1e-12)


def test_lr_scaling_reaches_the_optimizer():
    """sqrt scaling from a base batch of 2 to 8 doubles the peak rate; each record holds the
    rate its step used (half of it in the first of 2 warm-up steps)."""
    cfg = _cfg(steps=3, global_batch=8, lr_scaling="sqrt", lr_base_batch=2, warmup=2)
    cfg = dataclasses.replace(cfg, decay="constant")
    records = train(cfg.with_layout(1)).records
    assert [r["lr"] for r in records] == pytest.approx([3e-3, 6e-3, 6e-3], rel=1e-12)


# ------------------------------------------------------------------ stragglers


def test_straggler_named_within_three_intervals():
    cfg = _cfg(dp=2, steps=4, simulate_straggler=(1, 120.0))
    ranks = run_ranks(2, _on_ranks, cfg, timeout=180)
    reports = ranks[0]["stragglers"]
    assert reports, "the delayed rank was not reported"
    rank, phase, interval = reports[0]
    assert (rank, phase) == (1, "forward") and interval <= 3, reports
    assert all(r == 1 for r, _, _ in reports)


def test_straggler_detector_logic():
    det = StragglerDetector(threshold=0.3, min_ms=2.0, patience=2)
    phases = [{"forward": 1.0, "backward": 2.0, "comm": 5.0, "optimizer": 1.0}] * 3
    slow = [dict(phases[0]), dict(phases[0], optimizer=9.0), dict(phases[0])]
    assert det.observe(1, [10.0, 20.0, 10.0], slow, ["h"] * 3) == []  # one interval: not yet
    new = det.observe(2, [10.0, 20.0, 10.0], slow, ["h0", "h1", "h2"])
    assert [(r.rank, r.host, r.phase, r.interval) for r in new] == [(1, "h1", "optimizer", 2)]
    assert det.observe(3, [10.0, 20.0, 10.0], slow, ["h"] * 3) == []  # reported once
    calm = StragglerDetector(0.3, 2.0, 2)
    for i in range(5):  # 1 ms over the median: below min_ms
        assert calm.observe(i, [10.0, 11.0, 10.0], phases, ["h"] * 3) == []


def _poisoned_run(cfg: TrainConfig, rank_to_poison: int, at_step: int):
    """Runs on every pool rank: ``rank_to_poison`` writes NaN into a parameter right after
    its optimizer step ``at_step`` (a divergence, made to order). Returns the error text."""
    import torch.distributed as dist

    rank, real, calls = dist.get_rank(), torch.optim.AdamW.step, [0]

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls[0] += 1
        if rank == rank_to_poison and calls[0] == at_step:
            with torch.no_grad():
                self.param_groups[0]["params"][-1].fill_(float("nan"))
        return out

    with mock.patch.object(torch.optim.AdamW, "step", poisoned):
        try:
            train(cfg.with_layout(dist.get_world_size()))
        except FloatingPointError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize("layout", [dict(dp=2), dict(pp=2, micro_batch=2)], ids=["dp2", "pp2"])
def test_a_diverged_run_stops_on_every_rank_naming_the_step(layout):
    """A NaN in rank 1's parameters after step 2: step 3's loss is NaN there (and on the
    pipeline's every rank), and every rank raises FloatingPointError at that step's log,
    naming it and the ranks, instead of training on NaN (or hanging on a rank that stopped)."""
    cfg = _cfg(global_batch=8, steps=6, log_every=1, **layout)
    errors = run_ranks(2, _poisoned_run, cfg, 1, 2, timeout=180)
    print(errors)
    ranks = "[1]" if "dp" in layout else "[0, 1]"  # a pipeline's loss is every stage's
    for text in errors:
        assert text is not None and f"not finite from step 3 on rank(s) {ranks}" in text, text
    clean = run_ranks(2, _poisoned_run, cfg, 1, 99, timeout=180)  # never poisoned: no error
    assert clean == [None, None]


# ------------------------------------------------------------------ validation

EVAL = dict(eval_interval=2, eval_iters=2, steps=4, log_every=1)
EVAL_FLAGS = ["--eval-interval", "2", "--eval-iters", "2", "--steps", "4"]


def _plain_validation_loss(
    cfg: TrainConfig, params: Dict[str, torch.Tensor], held_out: str = "valid"
) -> float:
    """The validation (or test) loss of ``params`` computed here, with nothing of the driver's
    but the split: the model's forward in plain torch, the mean cross-entropy over the
    held-out windows of every validation batch."""
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model, _ = build_model(driver.model_config(cfg, corpus), cfg.seed)
    model.load_state_dict(params)
    spans = data.split(corpus, cfg.valid_fraction, cfg.test_fraction)
    span = spans[1] if held_out == "valid" else spans[2]
    sampler = data.Sampler(corpus, cfg.model.block_size, cfg.global_batch, cfg.seed, span)
    losses = []
    with torch.no_grad():
        for k in range(cfg.eval_iters):
            x, y = sampler.batch(k, 0, cfg.global_batch)
            logits = model(x).double()
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    return float(torch.stack(losses).mean())


@pytest.fixture(scope="module")
def valid_reference():
    """One process with validation every 2 steps: its validation losses, checked against a
    plain forward of its final parameters."""
    cfg = _cfg(global_batch=8, **EVAL)
    single = _single(cfg)
    losses = [e["valid_loss"] for e in single.evals]
    assert [e["step"] for e in single.evals] == [2, 4]
    plain = _plain_validation_loss(_one_process(cfg), single.params)
    print(f"validation losses {losses}; plain forward of the final parameters {plain}")
    assert losses[-1] == pytest.approx(plain, rel=1e-6)
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)  # training moved it
    return losses


@pytest.mark.parametrize(
    "layout,world",
    [(dict(dp=2), 2), (dict(dp=2, zero=3), 2), (dict(dp=2, zero=2, engine="torch"), 2),
     (dict(pp=2, micro_batch=2), 2), (dict(pp=2, micro_batch=2, schedule="zb-v",
     model=dataclasses.replace(TINY, n_layers=2)), 2), (dict(dp=2, tp=2), 4), (dict(cp=2), 2),
     (dict(dp=2, pp=2, zero=1, micro_batch=2), 4)],
    ids=["dp2", "dp2-zero3", "fsdp2", "pp2", "pp2-zb-v", "dp2xtp2", "cp2", "dp2xpp2-zero1"],
)  # fmt: skip
def test_validation_loss_in_every_layout_equals_one_process(valid_reference, layout, world):
    """--eval-interval: every layout's validation losses (forward only, each replica its share
    of the held-out batches; a pipeline's forward-only pass) equal one process's. The V
    schedule runs another model: against its own one-process run."""
    engine = layout.pop("engine", "dk")
    cfg = _cfg(global_batch=8, **EVAL, **layout)
    want = valid_reference
    if "model" in layout:
        want = [e["valid_loss"] for e in _single(cfg).evals]
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=240)
    got = [e["valid_loss"] for e in ranks[0]["evals"]]
    assert [e["step"] for e in ranks[0]["evals"]] == [2, 4]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_split_holds_out_a_test_share_for_one_loss_at_the_end():
    """Megatron's --split 90,6,4: training windows stop before the validation text, which
    stops before the test text; the test loss, once at the end, is a plain forward of the
    final parameters over the test windows, and dp 2 gives one process's."""
    args = build_parser().parse_args(["--split", "90,6,4", *EVAL_FLAGS])
    cfg = config_from_args(args)
    assert (cfg.valid_fraction, cfg.test_fraction) == (0.06, 0.04)
    cfg = _cfg(global_batch=8, **EVAL, valid_fraction=0.06, test_fraction=0.04)
    single = _single(cfg)
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    train_span, valid_span, test_span = data.split(corpus, 0.06, 0.04)
    n = len(corpus.tokens)
    assert train_span[1] == valid_span[0] and valid_span[1] == test_span[0]
    assert test_span == (n - round(n * 0.04), n)
    seen = driver.samplers(_one_process(cfg), corpus).train
    high = max(int(seen.step_offsets(s).max()) for s in range(cfg.steps))
    assert high + cfg.model.block_size + 1 <= train_span[1]  # never a held-out token
    test = single.test
    assert test is not None and test["step"] == cfg.steps and single.summary["test_loss"]
    plain = _plain_validation_loss(_one_process(cfg), single.params, "test")
    print(f"test loss {test['test_loss']}; plain forward {plain}")
    assert test["test_loss"] == pytest.approx(plain, rel=1e-6)
    assert test["test_loss"] != pytest.approx(single.evals[-1]["valid_loss"], rel=1e-4)
    ranks = run_ranks(2, _on_ranks, dataclasses.replace(cfg, dp=2), timeout=180)
    assert ranks[0]["test"]["test_loss"] == pytest.approx(test["test_loss"], rel=1e-5)
    stopped = train(dataclasses.replace(_one_process(cfg), stop_after=2))
    assert stopped.test is None  # the test is of the finished run only


@pytest.mark.parametrize(
    "flags,want",
    [(["--split", "969, 30, 1"], (0.03, 0.001)), (["--split", "98/2"], (0.02, 0.0)),
     (["--split", "100"], (0.05, 0.0)), (["--split", "95,0,5"], (0.05, 0.05))],
)  # fmt: skip
def test_split_flag_reads_megatrons_forms(flags, want):
    cfg = config_from_args(build_parser().parse_args(flags))
    assert (cfg.valid_fraction, cfg.test_fraction) == pytest.approx(want)


@pytest.mark.parametrize(
    "flags,message",
    [(["--split", "90,10", "--valid-fraction", "0.2"], r"both set the validation share"),
     (["--split", "a,b"], r"expected weights such as 969,30,1"),
     (["--split", "0,5,5"], r"the training share above 0"),
     (["--split", "1,2,3,4"], r"one to three weights"),
     (["--split", "95,0,5", "--eval-interval", "2"], r"gives validation no share")],
)  # fmt: skip
def test_split_flag_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(build_parser().parse_args(flags))


def test_evaluate_runs_in_eval_mode_and_puts_train_back():
    """The engines' validation forward switches dropout off (the driver's own models have none,
    so the layout tests cannot see it): the same held-out batch twice gives the same loss, that
    of the model's eval-mode forward, and the model is in train mode afterwards."""
    from dist_kernels.train.engines import DataParallel
    from dist_kernels.train.model import lm_loss

    cfg = _one_process(_cfg(global_batch=4, **EVAL))
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    sized = driver.model_config(cfg, corpus)
    model, loss = build_model(dataclasses.replace(sized, dropout=0.5), SEED)
    engine = DataParallel(cfg, model, loss, "dk", None, 0)
    _, valid_span, _ = data.split(corpus, cfg.valid_fraction)
    sampler = data.Sampler(corpus, cfg.model.block_size, cfg.global_batch, cfg.seed, valid_span)
    first, second = engine.evaluate(sampler, 0), engine.evaluate(sampler, 0)
    assert model.training and all(m.training for m in model.modules())
    x, y = sampler.batch(0, 0, cfg.global_batch)  # two micro-batches of 2
    model.eval()
    with torch.no_grad():
        parts = [float(lm_loss(model)(model(x[i : i + 2]), y[i : i + 2])) for i in (0, 2)]
    model.train()
    assert first == second == pytest.approx(sum(parts) / 2, rel=1e-6)
    with torch.no_grad():  # and dropout is on in train mode: the check can fail
        noisy = float(lm_loss(model)(model(x[:2]), y[:2]))
    assert noisy != pytest.approx(parts[0], rel=1e-6)


def test_validation_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"eval_iters must be an int >= 1, got 0"):
        TrainConfig(eval_iters=0).check()
    with pytest.raises(ConfigError, match=r"valid_fraction must lie in \(0, 1\), got 1.0"):
        TrainConfig(valid_fraction=1.0).check()
    text = tmp_path / "small.txt"
    text.write_text("abcdefgh" * 200)  # 1,600 characters: 0.5% is 8, less than a window
    corpus = data.CharCorpus.build(str(text), 16)
    _, valid, _ = data.split(corpus, 0.005)
    assert valid == (1592, 1600)
    with pytest.raises(data.DataError, match=r"tokens \[1592, 1600\) of .* hold 8 characters; "):
        data.Sampler(corpus, 16, 4, 0, span=valid)


def test_validation_run_resumes_with_its_split_only(tmp_path):
    """A run with --eval-interval holds text out of training, and its checkpoint records the
    cut: the command line's preflight lets the same run resume, and refuses one without
    validation (it would train on other text), before any rank starts."""
    cfg = _cfg(dp=2, global_batch=8, checkpoint_dir=str(tmp_path), **EVAL)
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=2), timeout=180)
    again = dataclasses.replace(cfg, resume="auto")
    assert preflight(again, 2).eval_interval == 2
    with pytest.raises(ConfigError, match=r"written with data='[0-9a-f]+:train\d+'; this run"):
        preflight(dataclasses.replace(again, eval_interval=0), 2)
    resumed = run_ranks(2, _on_ranks, again, timeout=180)
    assert resumed[0]["start"] == 2 and [e["step"] for e in resumed[0]["evals"]] == [4]


def test_validation_leaves_training_alone():
    """Validating after every step or only at the end: the same training losses and
    parameters, bitwise (eval mode and no gradient, put back; the same held-out split)."""
    often = run_ranks(2, _on_ranks, _cfg(dp=2, global_batch=8, **EVAL), timeout=180)
    once = run_ranks(
        2, _on_ranks, _cfg(dp=2, global_batch=8, **{**EVAL, "eval_interval": 100}), timeout=180
    )
    assert len(often[0]["evals"]) == 2 and [e["step"] for e in once[0]["evals"]] == [4]
    assert often[0]["losses"] == once[0]["losses"]
    assert often[0]["evals"][-1]["valid_loss"] == once[0]["evals"][-1]["valid_loss"]
    for a, b in zip(often, once):
        assert all(torch.equal(a["params"][k], v) for k, v in b["params"].items())


# ------------------------------------------------------------------ checkpoints


def test_resume_is_exact(tmp_path):
    """10 steps straight == 6 steps, stop, resume to 10: bitwise, on 2 FP32 CPU ranks."""
    cfg = _cfg(dp=2, steps=10, global_batch=4, warmup=2, log_every=5)
    straight = run_ranks(2, _on_ranks, cfg, timeout=180)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    first = run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=6, **ckpt), timeout=180)
    assert first[0]["start"] == 0 and os.path.isfile(tmp_path / "step-00000006" / "COMPLETE.json")
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=180)
    assert resumed[0]["start"] == 6
    for k, v in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][k], v), k
    assert resumed[0]["losses"][-1] == straight[0]["losses"][-1]
    # and the comparison can fail: the 6-step parameters differ from the 10-step ones
    assert not all(torch.equal(first[0]["params"][k], v) for k, v in straight[0]["params"].items())


@pytest.mark.parametrize("zero", [2, 3])
def test_resume_on_fewer_ranks_reshards(tmp_path, zero):
    """ZeRO-2 (and 3) on 4 ranks for 4 steps, resumed on 2 ranks to 8 (global batch kept,
    accumulation doubled): equal to 8 steps on 2 ranks within FP32 rounding."""
    cfg = _cfg(zero=zero, steps=8, global_batch=8, micro_batch=2, log_every=4)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(4, _on_ranks, dataclasses.replace(cfg, stop_after=4, **ckpt), timeout=240)
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=180)
    straight = run_ranks(2, _on_ranks, cfg, timeout=180)
    assert resumed[0]["start"] == 4
    key_bound = _key_bias_bound(cfg)
    _assert_params_close(resumed[0]["params"], straight[0]["params"], key_bound)
    torch.testing.assert_close(
        resumed[0]["losses"][-1], straight[0]["losses"][-1], rtol=1e-5, atol=0
    )


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    """--keep-last 2 with a checkpoint every step: after 5 steps (at dp 2) only steps 4 and 5
    are left, and the run resumes from them to the straight run's parameters."""
    cfg = _cfg(dp=2, steps=7, global_batch=4, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=5, keep_last=2), timeout=180)
    assert sorted(os.listdir(tmp_path)) == ["step-00000004", "step-00000005"]
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, resume="auto"), timeout=180)
    straight = run_ranks(2, _on_ranks, dataclasses.replace(cfg, checkpoint_dir=None), timeout=180)
    assert resumed[0]["start"] == 5
    for k, v in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][k], v), k
    # the resumed run keeps all (keep_last 0, the default): 6 and 7 join 4 and 5
    assert sorted(os.listdir(tmp_path)) == [f"step-{s:08d}" for s in (4, 5, 6, 7)]


def test_prune_removes_old_and_torn_checkpoints_only(tmp_path):
    from dist_kernels.train.checkpoints import COMPLETE, newest_complete, prune

    # complete: 1, 3, 4; torn (no COMPLETE.json): 2 (superseded) and 5 (newer than any complete)
    for step, complete in ((1, True), (2, False), (3, True), (4, True), (5, False)):
        os.makedirs(tmp_path / f"step-{step:08d}" / "stage-0")
        if complete:
            (tmp_path / f"step-{step:08d}" / COMPLETE).write_text("{}")
    (tmp_path / "notes").mkdir()  # not a step directory: left alone
    removed = prune(str(tmp_path), keep=1)
    assert sorted(os.path.basename(p) for p in removed) == [
        "step-00000001", "step-00000002", "step-00000003"
    ]  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-00000004", "step-00000005"]
    assert newest_complete(str(tmp_path)) == str(tmp_path / "step-00000004")
    assert prune(str(tmp_path / "notes"), keep=1) == []  # no checkpoints: nothing to do


def test_resume_auto_skips_an_incomplete_checkpoint(tmp_path):
    from dist_kernels.train.checkpoints import COMPLETE, newest_complete

    assert newest_complete(str(tmp_path / "missing")) is None
    for step, complete in ((3, True), (6, False), (12, True), (20, False)):
        os.makedirs(tmp_path / f"step-{step:08d}" / "stage-0")
        if complete:
            (tmp_path / f"step-{step:08d}" / COMPLETE).write_text("{}")
    (tmp_path / "step-junk").mkdir()
    assert newest_complete(str(tmp_path)) == str(tmp_path / "step-00000012")


# ------------------------------------------------------------------ bad input


def test_batch_arithmetic_errors():
    with pytest.raises(
        ConfigError, match=r"global_batch\(96\) != micro_batch\(4\) x grad_accum\(8\) x dp\(2\)"
    ):
        TrainConfig(dp=2, micro_batch=4, grad_accum=8, global_batch=96).with_layout(2)
    with pytest.raises(ConfigError, match=r"dp\(3\) x tp\(1\) x pp\(1\) != world_size\(2\)"):
        TrainConfig(dp=3).with_layout(2)
    with pytest.raises(
        ConfigError, match=r"world_size\(3\) is not a multiple of tp\(1\) x pp\(2\)"
    ):
        TrainConfig(pp=2).with_layout(3)
    with pytest.raises(
        ConfigError, match=r"global_batch\(10\) is not a multiple of micro_batch\(4\) x dp\(2\) = 8"
    ):
        TrainConfig(dp=2, micro_batch=4, global_batch=10).with_layout(2)
    with pytest.raises(ConfigError, match=r"zero\(2\) shards over data-parallel ranks"):
        TrainConfig(zero=2).with_layout(1)
    with pytest.raises(
        ConfigError, match=r"dp\(2\) x tp\(1\) x cp\(2\) x pp\(1\) != world_size\(2\)"
    ):
        TrainConfig(dp=2, cp=2).with_layout(2)
    with pytest.raises(ConfigError, match=r"block_size\(16\) is not a multiple of 2 x cp\(3\) = 6"):
        TrainConfig(cp=3, model=TINY).with_layout(3)
    with pytest.raises(ConfigError, match=r"engine='torch' supports cp=1 only"):
        TrainConfig(cp=2, engine="torch", model=TINY).with_layout(2)
    ok = TrainConfig(dp=2, micro_batch=4, global_batch=32).with_layout(2)
    assert ok.grad_accum == 4


def test_pipeline_schedule_errors_before_any_rank_starts(capsys):
    with pytest.raises(ConfigError, match=r"dualpipe-v needs n_microbatches \(1\) >= 2 x"):
        TrainConfig(pp=2, schedule="dualpipe-v", micro_batch=4, global_batch=4).with_layout(2)
    with pytest.raises(
        ConfigError, match=r"zb-v runs 4 stages on pp\(2\) ranks .* n_layers\(1\) \+ 2 = 3"
    ):
        TrainConfig(pp=2, schedule="zb-v", micro_batch=2, global_batch=8, model=TINY).with_layout(2)
    with pytest.raises(ConfigError, match=r"pp\(4\) ranks \(1 per rank\) .* = 3 layers"):
        TrainConfig(pp=4, micro_batch=2, global_batch=8, model=TINY).with_layout(4)
    with pytest.raises(SystemExit) as exited:  # argparse's choices
        cli_main(["--pp", "2", "--schedule", "zb-x"])
    assert exited.value.code == 2 and "invalid choice: 'zb-x'" in capsys.readouterr().err
    assert cli_main(["--pp", "2", "--schedule", "dualpipe-v", "--global-batch", "4"]) == 2
    assert "dualpipe-v needs n_microbatches (1)" in capsys.readouterr().err


def test_cli_errors_before_any_rank_starts(tmp_path, capsys):
    missing = str(tmp_path / "nope.txt")
    assert cli_main(["--dp", "2", "--data", missing]) == 2
    assert f"data: {missing!r} does not exist" in capsys.readouterr().err
    assert (
        cli_main(["--dp", "2", "--micro-batch", "4", "--grad-accum", "8", "--global-batch", "96"])
        == 2
    )
    assert (
        "global_batch(96) != micro_batch(4) x grad_accum(8) x dp(2) = 64" in capsys.readouterr().err
    )


def test_model_is_a_gpt_config_the_driver_can_train(capsys):
    """The driver's model config is dk.models.GPTConfig: the CLI maps its options onto it and
    a shape GPTConfig refuses is a CLI error (a tied head is trained: test_train_tied.py;
    dropout: test_train_dropout.py)."""
    assert TrainConfig().model == GPTConfig(
        block_size=64, n_layers=2, n_heads=4, dim=128, tie_embeddings=False
    )
    assert cli_main(["--d-model", "30", "--n-head", "4"]) == 2
    assert "GPTConfig: dim(30) % n_heads(4) != 0" in capsys.readouterr().err


def test_checkpoint_of_another_model_is_refused(tmp_path):
    cfg = _cfg(steps=1, checkpoint_dir=str(tmp_path), resume="auto")
    train(cfg.with_layout(1))
    other = dataclasses.replace(cfg, steps=4, model=dataclasses.replace(TINY, dim=64))
    with pytest.raises(ConfigError, match="was written with model="):
        preflight(other, 1)
    with pytest.raises(ConfigError, match=r"global_batch\(2\); this run has global_batch\(4\)"):
        preflight(dataclasses.replace(cfg, steps=4, global_batch=4), 1)
    # the same model resumes (longer, on the saved schedule: its horizon of 1 step kept)
    preflight(dataclasses.replace(cfg, steps=4, lr_decay_steps=1), 1)


# ------------------------------------------------------------------ elastic recovery


def test_torchrun_restart_after_sigkill_matches_uninterrupted(tmp_path):
    """torchrun --max-restarts 1: rank 1 SIGKILLed after the step-3 checkpoint; the restarted
    group resumes there and ends on the uninterrupted run's loss. Also checks --json and --plot."""
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    steps, model = 6, ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "16"]
    common = ["--steps", str(steps), "--micro-batch", "2", "--lr", "3e-3", "--warmup", "1",
              "--seed", str(SEED), "--no-progress", "--data", CORPUS, *model]  # fmt: skip
    out, png = tmp_path / "log.jsonl", tmp_path / "run.png"
    cmd = ["torchrun", "--standalone", "--max-restarts", "1", "--nproc-per-node", "2",
           "-m", "dist_kernels.train", *common,
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3",
           "--resume", "auto", "--kill-after-checkpoint", "1:3", "--json", str(out),
           "--plot", str(png)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # the first attempt logged steps 1-3; the restart appended 4-6 after resuming at 3
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert png.stat().st_size > 10_000
    cfg = _cfg(dp=2, steps=steps)
    straight = run_ranks(2, _on_ranks, cfg, timeout=180)
    assert records[-1]["loss"] == pytest.approx(straight[0]["losses"][-1], rel=1e-6, abs=0)


def test_ep2_matches_dp2_with_every_expert_local():
    """--dp 2 --ep 2 --experts 4: the experts sharded over the two ranks train as with every
    expert on every rank (dp 2, ep 1: the same per-rank routing and aux loss); the metrics
    carry tokens per expert (over the ep group) and the drop rate."""
    model = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)
    local = run_ranks(2, _on_ranks, _cfg(dp=2, global_batch=8, model=model), timeout=180)
    sharded = run_ranks(2, _on_ranks, _cfg(dp=2, ep=2, global_batch=8, model=model), timeout=180)
    # float32: the two layouts sum each expert's rows in different orders (~1e-7 relative).
    torch.testing.assert_close(sharded[0]["losses"], local[0]["losses"], rtol=1e-5, atol=0)
    rec = sharded[0]["records"][-1]
    tokens = 2 * 2 * TINY.block_size * 2  # ep ranks x micro_batch x seq x top_k
    assert [sum(layer) for layer in rec["moe_tokens_per_expert"]] == [tokens] * TINY.n_layers
    assert rec["moe_drop_rate"] == 0.0 and rec["moe_imbalance"] >= 1.0
    # and compiled (the MoE exchange runs eagerly between the compiled router and the rest)
    compiled = run_ranks(
        2, _on_ranks, _cfg(dp=2, ep=2, global_batch=8, model=model, **COMPILE), timeout=300
    )
    assert all(r["compiled_graphs"] > 0 for r in compiled)
    torch.testing.assert_close(compiled[0]["losses"], sharded[0]["losses"], rtol=1e-5, atol=0)
    with pytest.raises(ConfigError, match=r"experts\(3\) must be a positive multiple of ep\(2\)"):
        _cfg(dp=2, ep=2, model=dataclasses.replace(TINY, n_experts=3)).with_layout(2)


def test_ep2_resume_is_exact(tmp_path):
    """dp 2 x ep 2: each ep rank checkpoints its own experts (``stage-0-ep-<r>``); 4 steps,
    stop, resume to 6 equals 6 straight, bitwise, on both ranks (each holds other experts)."""
    model = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)
    cfg = _cfg(dp=2, ep=2, steps=6, global_batch=4, warmup=1, log_every=3, model=model)
    straight = run_ranks(2, _on_ranks, cfg, timeout=180)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=4, **ckpt), timeout=180)
    assert sorted(os.listdir(tmp_path / "step-00000004")) == [
        "COMPLETE.json", "stage-0-ep-0", "stage-0-ep-1"
    ]  # fmt: skip
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=180)
    for rank in range(2):
        assert resumed[rank]["start"] == 4
        for k, v in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][k], v), (rank, k)
