"""The driver with ``--optimizer muon``: one process equals torch.optim.Muon + AdamW written by
hand; every layout (dp with either engine, tp, pp, dp x tp, cp, ep) trains as one process, with
Newton-Schulz dealt over the replicas; resumes, also at another layout; bad combinations refused."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from mp_pool import run_ranks
from test_train import (
    ADAM_EPS,
    FP16,
    TINY,
    _assert_layout_matches,
    _cfg,
    _key_bias_bound,
    _on_ranks,
    _one_process,
    _single,
)

from dist_kernels.models import GPTConfig
from dist_kernels.optim import muon as muon_module
from dist_kernels.train import ConfigError, data, driver
from dist_kernels.train.cli import build_parser, config_from_args
from dist_kernels.train.model import build_model

WD = 0.1
MOE = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)


def _muon_cfg(**kw):
    """FP32 Newton-Schulz: the layouts then agree to FP32 rounding (module docstring of
    dk.optim.muon; BF16 turns a last-bit gradient difference into 1% of a step)."""
    base = dict(global_batch=8, optimizer="muon", weight_decay=WD, muon_ns_dtype="fp32")
    return _cfg(**{**base, **kw})


def _on_ranks_counting(cfg, engine="dk"):
    """:func:`_on_ranks`, and how many matrices this rank ran Newton-Schulz on."""
    calls = [0]
    real = muon_module.newton_schulz

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    with mock.patch.object(muon_module, "newton_schulz", counting):
        result = _on_ranks(cfg, engine)
    return {**result, "newton_schulz": calls[0]}


@pytest.fixture(scope="module")
def reference():
    cfg = _muon_cfg()
    single = _single(cfg)
    return [r["loss"] for r in single.records], single.params, _key_bias_bound(cfg)


def _hidden(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 2 and not any(k in name for k in ("wte", "wpe", "lm_head"))


def test_one_process_equals_torch_muon_and_adamw_by_hand():
    """The default (BF16 Newton-Schulz) on one process, against a loop written here with
    torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest: same bits."""
    cfg = _one_process(_cfg(global_batch=8, optimizer="muon", weight_decay=WD))
    ours = _single(cfg)
    from dist_kernels.train.engines import make_scheduler, peak_lr

    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model, loss_fn = build_model(driver.model_config(cfg, corpus), cfg.seed)
    named = list(model.named_parameters())
    lr = peak_lr(cfg)
    muon = torch.optim.Muon(
        [p for n, p in named if _hidden(n, p)], lr=lr, weight_decay=WD,
        adjust_lr_fn="match_rms_adamw",
    )  # fmt: skip
    adamw = torch.optim.AdamW(
        [{"params": [p for n, p in named if p.dim() == 2 and not _hidden(n, p)]},
         {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=ADAM_EPS, weight_decay=WD,
    )  # fmt: skip
    schedules = [make_scheduler(cfg, opt, 0) for opt in (muon, adamw)]
    sampler = data.Sampler(corpus, cfg.model.block_size, cfg.global_batch, cfg.seed)
    for step in range(cfg.steps):
        inputs, targets = sampler.replica_batch(step, 0, cfg.global_batch)
        for x, y in zip(inputs.split(cfg.micro_batch), targets.split(cfg.micro_batch)):
            (loss_fn(model(x), y) / cfg.grad_accum).backward()
        for opt, schedule in zip((muon, adamw), schedules):
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
    by_hand = {k: v.detach() for k, v in model.state_dict().items()}
    assert set(by_hand) == set(ours.params)
    for name, value in by_hand.items():
        assert torch.equal(ours.params[name], value), name


@pytest.mark.parametrize(
    "layout, world, engine",
    [(dict(dp=2), 2, "dk"), (dict(dp=2), 2, "torch"), (dict(tp=2), 2, "dk"),
     (dict(pp=2, micro_batch=2), 2, "dk"), (dict(dp=2, tp=2), 4, "dk"),
     (dict(cp=2), 2, "dk")],
    ids=["dp2", "dp2-torch-ddp", "tp2", "pp2", "dp2xtp2", "cp2"],
)  # fmt: skip
def test_layouts_train_as_one_process(reference, layout, world, engine):
    """Each layout ends at one process's losses and parameters; our engine's replicas share
    Newton-Schulz's matrices (each ran by one of them), torch's run every one everywhere."""
    print("seed", _cfg().seed)
    cfg = _muon_cfg(**layout)
    ranks = run_ranks(world, _on_ranks_counting, cfg, engine, timeout=300)
    _assert_layout_matches(ranks, reference, tp=layout.get("tp", 1))
    per_step = [r["newton_schulz"] / cfg.steps for r in ranks]
    matrices = 4 * TINY.n_layers  # qkv, proj, fc and proj of each block
    tp = layout.get("tp", 1)
    # ours: each matrix once per step on one replica (on each of its tp ranks, which join
    # it); torch's DDP: on every rank
    assert sum(per_step) == matrices * (tp if engine == "dk" else world), per_step
    if engine == "dk" and world // (tp * layout.get("pp", 1)) > 1:  # replicas split the work
        assert 0 < min(per_step) and max(per_step) < matrices, per_step


def test_split_qkv_at_tp2_trains_as_one_process():
    """--muon-split-qkv (a GQA model: two query heads per key / value head): tp 2 x dp 2 ends
    at one process's losses and parameters with the same flag."""
    model = dataclasses.replace(TINY, n_heads=4, n_kv_heads=2, bias=False)  # no key biases
    cfg = _muon_cfg(muon_split_qkv=True, model=model)
    single = _single(cfg)
    reference = ([r["loss"] for r in single.records], single.params, 0.0)  # no biases
    ranks = run_ranks(4, _on_ranks, dataclasses.replace(cfg, dp=2, tp=2), timeout=300)
    _assert_layout_matches(ranks, reference, tp=2)
    whole = _single(dataclasses.replace(cfg, muon_split_qkv=False))
    assert whole.records[-1]["loss"] != single.records[-1]["loss"]  # the flag did something


def test_fp16_with_zero1_skips_and_scales_as_replicated_state():
    """fp16 with a loss scale that overflows first, at dp 2: --zero 1 skips the same steps at
    the same scales as --zero 0 (every replica decides on the same reduced gradients) and ends
    on the same bits."""
    cfg = _muon_cfg(dp=2, log_every=1, **FP16)
    replicated = run_ranks(2, _on_ranks, cfg, timeout=300)[0]
    sharded = run_ranks(2, _on_ranks, dataclasses.replace(cfg, zero=1), timeout=300)[0]
    scales = [(r["loss_scale"], r["skipped_steps"]) for r in replicated["records"]]
    assert [(r["loss_scale"], r["skipped_steps"]) for r in sharded["records"]] == scales
    assert 0 < sum(skipped for _, skipped in scales) < cfg.steps  # some steps skipped, not all
    assert sharded["losses"] == replicated["losses"]


def test_expert_parallel_trains_as_every_expert_local():
    """--dp 2 --ep 2: each rank steps its own experts (dealt over their replicas, here the rank
    alone) and the dense matrices over dp; the run equals dp 2 with every expert on both
    ranks to FP32 rounding."""
    cfg = _muon_cfg(dp=2, steps=3, global_batch=4, log_every=1, model=MOE)
    local = run_ranks(2, _on_ranks, cfg, timeout=300)
    ep = run_ranks(2, _on_ranks, dataclasses.replace(cfg, ep=2), timeout=300)
    assert ep[0]["losses"] == pytest.approx(local[0]["losses"], rel=1e-5, abs=0)
    assert local[0]["losses"][-1] < local[0]["losses"][0]


def test_resume_is_exact_and_reshards(tmp_path):
    """Saved after 2 of 4 steps at pp 2: resumed at pp 2 it ends on the uninterrupted run's
    bits; resumed at tp 2 (the momentum buffers cut as the matrices) at the tp 2 run's
    losses to FP32 rounding."""
    cfg = _muon_cfg(pp=2, micro_batch=2, steps=4, log_every=1)
    straight = run_ranks(2, _on_ranks, cfg, timeout=300)
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, stop_after=2, **ckpt), timeout=300)
    again = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **ckpt), timeout=300)
    assert again[0]["start"] == 2 and again[0]["losses"] == straight[0]["losses"][2:]
    tp_cfg = _muon_cfg(tp=2, steps=4, log_every=1)
    tp_straight = run_ranks(2, _on_ranks, tp_cfg, timeout=300)
    step2 = dataclasses.replace(tp_cfg, resume=str(tmp_path / "step-00000002"))
    tp_resumed = run_ranks(2, _on_ranks, step2, timeout=300)
    assert tp_resumed[0]["start"] == 2
    assert tp_resumed[0]["losses"] == pytest.approx(tp_straight[0]["losses"][2:], rel=1e-5, abs=0)


@pytest.mark.parametrize(
    "layout, world",
    [(dict(dp=2), 2), (dict(dp=2, pp=2, micro_batch=2), 4), (dict(dp=2, ep=2), 2)],
    ids=["dp2", "dp2xpp2", "dp2xep2-moe"],
)
def test_zero1_deals_the_state_and_trains_as_replicated(tmp_path, layout, world):
    """--zero 1 --optimizer muon: each replica holds the state of the parameters dealt to it
    (Muon's matrices and AdamW's alike) and the run equals --zero 0 bit for bit (the same
    operations on the same values); its checkpoint (consolidated on every replica) resumes
    exactly, under --zero 1 and under --zero 0."""
    model = MOE if "ep" in layout else TINY
    cfg = _muon_cfg(steps=4, log_every=1, model=model, **layout)
    replicated = run_ranks(world, _on_ranks, cfg, timeout=300)
    zero1 = dataclasses.replace(cfg, zero=1)
    sharded = run_ranks(world, _on_ranks, zero1, timeout=300)
    assert sharded[0]["losses"] == replicated[0]["losses"]
    for a, b in zip(sharded, replicated):
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(world, _on_ranks, dataclasses.replace(zero1, stop_after=2, **ckpt), timeout=300)
    step2 = str(tmp_path / "step-00000002")
    for zero in (1, 0):
        resumed = run_ranks(
            world, _on_ranks, dataclasses.replace(cfg, zero=zero, resume=step2), timeout=300
        )
        assert resumed[0]["start"] == 2 and resumed[0]["losses"] == replicated[0]["losses"][2:]


def _rank_state_held(cfg):
    """Elements of optimizer state this rank holds after training ``cfg``."""
    from dist_kernels.train import driver as train_driver

    held = []
    real = train_driver.build_engine

    def build(*args, **kwargs):
        engine = real(*args, **kwargs)
        held.append(engine)
        return engine

    with mock.patch.object(train_driver, "build_engine", build):
        _on_ranks(cfg)
    opt = held[-1].optimizer
    return sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())


def test_zero1_holds_about_half_the_state_at_dp2():
    cfg = _muon_cfg(dp=2, steps=2)
    replicated = run_ranks(2, _rank_state_held, cfg, timeout=300)
    sharded = run_ranks(2, _rank_state_held, dataclasses.replace(cfg, zero=1), timeout=300)
    assert replicated[0] == replicated[1]
    for mine in sharded:
        assert 0.3 * replicated[0] < mine < 0.7 * replicated[0], (sharded, replicated)


def test_refused_combinations(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer\(muon\) with zero\(2\)"):
        _muon_cfg(dp=2, zero=2).with_layout(2)
    with pytest.raises(ConfigError, match=r"engine\(torch\)"):
        _muon_cfg(dp=2, zero=1, engine="torch").with_layout(2)
    with pytest.raises(ConfigError, match="muon_tp_mode"):
        _muon_cfg(muon_tp_mode="distributed").with_layout(1)
    # an AdamW checkpoint does not resume under Muon (its state would load into Muon's)
    cfg = _cfg(global_batch=8, steps=3, checkpoint_dir=str(tmp_path), resume="auto")
    _single(dataclasses.replace(cfg, stop_after=1))
    with pytest.raises(ConfigError, match="optimizer='adamw'"):
        _single(dataclasses.replace(cfg, optimizer="muon"))


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(
        ["--optimizer", "muon", "--muon-momentum", "0.9", "--no-muon-nesterov",
         "--muon-num-ns-steps", "6", "--muon-adjust-lr", "original", "--muon-tp-mode",
         "blockwise", "--muon-ns-dtype", "fp32", "--muon-split-qkv"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.optimizer, cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps) == (
        "muon",
        0.9,
        False,
        6,
    )
    assert (cfg.muon_adjust_lr, cfg.muon_tp_mode, cfg.muon_ns_dtype) == (
        "original",
        "blockwise",
        "fp32",
    )
    assert isinstance(cfg.model, GPTConfig)
