"""``--tie-embeddings``: the output head is the token embedding's tensor (GPT-2, Gemma,
Megatron's default) in every layout the driver trains. One process adds both uses into one
tensor; a pipeline gives its first and last stage a copy each and keeps them equal
(``pipeline/tied.py``); ZeRO, FSDP2, tp and cp hold the one tensor. Every layout must end on
the single process's losses, gradient norms and parameters."""

import dataclasses

import pytest
import torch
from mp_pool import run_ranks
from test_train import (
    SEED,
    TINY,
    _assert_layout_matches,
    _assert_params_close,
    _cfg,
    _key_bias_bound,
    _on_ranks,
    _single,
)
from test_train_reshard import STOP, _saved_then_resumed

from dist_kernels.train import ConfigError
from dist_kernels.train.cli import build_parser, config_from_args, model_flags

TIED = dataclasses.replace(TINY, tie_embeddings=True)
TIED2 = dataclasses.replace(TIED, n_layers=2)  # four stages for the V schedules
CLIP = 0.5
EMBEDDING, HEAD = "0.wte.weight", "2.lm_head.weight"


def _reference(model):
    """One process, global batch 8, clipped: (losses, params, key-bias bound, norms)."""
    print(f"seed {SEED}")
    cfg = _cfg(global_batch=8, clip_grad=CLIP, log_every=1, model=model)
    result = _single(cfg)
    norms = [rec["grad_norm"] for rec in result.records]
    assert min(norms) > CLIP  # every step clipped: a norm counted twice would show
    losses = [rec["loss"] for rec in result.records]
    return losses, result.params, _key_bias_bound(cfg), norms


@pytest.fixture(scope="module")
def tied_reference():
    return _reference(TIED)


def test_tied_head_is_the_embedding_and_trains_otherwise_than_untied(tied_reference):
    """The reference itself: the head ends as the embedding, bit for bit, and the tied model
    trains to other weights than the untied one from the same seed."""
    _, params, _, _ = tied_reference
    assert torch.equal(params[EMBEDDING], params[HEAD])
    untied = _single(_cfg(global_batch=8, clip_grad=CLIP, log_every=1)).params
    assert (untied[EMBEDDING] - params[EMBEDDING]).abs().max() > 1e-3
    assert (untied[HEAD] - params[HEAD]).abs().max() > 1e-3


LAYOUTS = {
    "dp2": (dict(dp=2), 2),
    "dp2-torch": (dict(dp=2, engine="torch"), 2),
    "dp2-zero2": (dict(dp=2, zero=2), 2),
    "dp2-zero3": (dict(dp=2, zero=3), 2),
    "fsdp2": (dict(dp=2, zero=2, engine="torch"), 2),
    "tp2-sp": (dict(tp=2, sequence_parallel=True), 2),
    "cp2": (dict(cp=2), 2),
    "pp2-zb-h1": (dict(pp=2, micro_batch=2, schedule="zb-h1"), 2),
    "dp2xpp2-zero1": (dict(dp=2, pp=2, zero=1, micro_batch=2), 4),
    "tp2xpp2": (dict(tp=2, pp=2, micro_batch=2), 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_model_matches_single_process_in_every_layout(tied_reference, layout):
    """Losses, every step's gradient norm before clipping (the tied weight counted once, though
    a pipeline holds it on two ranks) and every rank's parameters equal the single
    process's to FP32 rounding; a pipeline's two copies end equal."""
    ref_losses, ref_params, key_bound, ref_norms = tied_reference
    layout, world = LAYOUTS[layout]
    engine = layout.get("engine", "dk")
    layout = {k: v for k, v in layout.items() if k != "engine"}
    cfg = _cfg(global_batch=8, clip_grad=CLIP, log_every=1, model=TIED, **layout)
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=240)
    norms = [rec["grad_norm"] for rec in ranks[0]["records"]]
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    if engine == "torch" and cfg.zero:  # FSDP2's parameters are DTensors: the norms say it
        torch.testing.assert_close(ranks[0]["losses"], ref_losses, rtol=1e-5, atol=0)
        return
    _assert_layout_matches(ranks, (ref_losses, ref_params, key_bound), tp=layout.get("tp", 1))
    for r in ranks:
        if EMBEDDING in r["params"] and HEAD in r["params"]:  # one rank holds both uses
            assert torch.equal(r["params"][EMBEDDING], r["params"][HEAD])
    if cfg.pp > 1:  # the first stage's copy and the last's: the same bits
        tp = layout.get("tp", 1)
        for first in range(len(ranks)):
            if EMBEDDING in ranks[first]["params"]:
                last = [r for r in ranks[first + 1 :] if HEAD in r["params"]][first % tp]
                assert torch.equal(ranks[first]["params"][EMBEDDING], last["params"][HEAD])


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_tied_model_with_several_stages_per_rank(schedule):
    """ZB-V puts the first and the last stage on rank 0 (its copies are added there, without
    a message); interleaved 1F1B puts them on ranks 0 and 1."""
    ref_losses, ref_params, key_bound, ref_norms = _reference(TIED2)
    cfg = _cfg(global_batch=8, clip_grad=CLIP, log_every=1, model=TIED2, pp=2, micro_batch=2,
               schedule=schedule)  # fmt: skip
    ranks = run_ranks(2, _on_ranks, cfg, timeout=240)
    norms = [rec["grad_norm"] for rec in ranks[0]["records"]]
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    _assert_layout_matches(ranks, (ref_losses, ref_params, key_bound))
    holder = 0 if schedule == "zb-v" else 1
    assert "3.lm_head.weight" in ranks[holder]["params"]


RESUMES = {
    "pp2->dp2-zero1": (dict(pp=2), dict(dp=2, zero=1)),
    "dp2-zero3->pp2": (dict(dp=2, zero=3), dict(pp=2)),
    "pp2->pp2": (dict(pp=2), dict(pp=2)),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_tied_run_resumes_at_its_layout_or_another(tmp_path, case):
    """Saved after STOP steps and resumed (at another layout: one tensor becomes two copies
    or two copies one): the same losses and parameters as the uninterrupted run, which holds
    only if both copies' AdamW moments came through."""
    saved, resumed = RESUMES[case]
    print(f"seed {SEED}")
    base = _cfg(steps=6, global_batch=8, micro_batch=2, warmup=2, log_every=1, model=TIED)
    straight, again = _saved_then_resumed(tmp_path, base, saved, resumed)
    assert again[0]["start"] == STOP
    torch.testing.assert_close(again[0]["losses"], straight[0]["losses"][STOP:], rtol=1e-5, atol=0)
    bound = _key_bias_bound(dataclasses.replace(base, **resumed))
    for mine, ref in zip(again, straight):
        assert set(mine["params"]) == set(ref["params"])
        _assert_params_close(mine["params"], ref["params"], bound)


def test_tie_flags():
    parse = build_parser().parse_args
    assert not config_from_args(parse([])).model.tie_embeddings  # the driver's default
    assert config_from_args(parse(["--tie-embeddings"])).model.tie_embeddings
    megatron = config_from_args(parse(["--untie-embeddings-and-output-weights"]))
    assert not megatron.model.tie_embeddings
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights and --tie-"):
        config_from_args(parse(["--tie-embeddings", "--untie-embeddings-and-output-weights"]))
    assert "--tie-embeddings" in model_flags(TIED) and "--tie-embeddings" not in model_flags(TINY)
