"""``python -m dist_kernels.train.export``: one file of unsharded weights from a checkpoint of
any layout, and ``--init-from`` that file at any other layout."""

import dataclasses
import os

import pytest
import torch
from mp_pool import run_ranks
from test_train import (
    SEED,
    TINY,
    _assert_params_close,
    _cfg,
    _key_bias_bound,
    _on_ranks,
    _single,
)

from dist_kernels.models import GPT, GPTConfig
from dist_kernels.train import ConfigError, data, driver
from dist_kernels.train.cli import preflight
from dist_kernels.train.export import _gpt_names, consolidate, export, load_exported
from dist_kernels.train.export import main as export_main
from dist_kernels.train.model import build_model

MOE = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)
LAYERS2 = dataclasses.replace(TINY, n_layers=2)


def _exported_as_sequential(path):
    """An exported file's weights under the driver's nn.Sequential names (as runs report)."""
    payload = torch.load(path, weights_only=True)
    names = {g: s for s, g in _gpt_names(GPT(GPTConfig(**payload["config"]))).items()}
    return {names[k]: v for k, v in payload["model"].items()}


def _run_and_export(tmp_path, cfg, world):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(world, _on_ranks, dataclasses.replace(cfg, checkpoint_dir=ckpt), timeout=300)
    out = str(tmp_path / "model.pt")
    assert export_main([os.path.join(ckpt, f"step-{cfg.steps:08d}"), out]) == 0
    return out


@pytest.mark.parametrize(
    "layout,world,model",
    [(dict(tp=2, pp=2, micro_batch=2), 4, TINY), (dict(dp=2, zero=3), 2, TINY),
     (dict(tp=2, sequence_parallel=True, zero=2, dp=2), 4, TINY),
     (dict(pp=2, schedule="zb-v", micro_batch=2), 2, LAYERS2)],
    ids=["tp2xpp2", "dp2-zero3", "dp2xtp2-sp-zero2", "pp2-zb-v"],
)  # fmt: skip
def test_export_of_a_sharded_run_is_the_single_process_model(tmp_path, layout, world, model):
    """Stages, tensor shards (joined along their split dimension), ZeRO shards and V-shaped
    stage placement: the exported weights are the single process's trained model."""
    print(f"seed {SEED}")
    cfg = _cfg(global_batch=8, model=model, **layout)
    out = _run_and_export(tmp_path, cfg, world)
    ref = _single(cfg)
    exported = _exported_as_sequential(out)
    assert set(exported) == set(ref.params)
    _assert_params_close(exported, ref.params, _key_bias_bound(cfg))
    # and the file loads into a plain GPT, strictly
    payload = torch.load(out, weights_only=True)
    GPT(GPTConfig(**payload["config"])).load_state_dict(payload["model"])
    assert payload["step"] == cfg.steps


@pytest.mark.parametrize("zero", [0, 1], ids=["ddp", "zero1"])
def test_export_gathers_experts_from_every_ep_rank(tmp_path, zero):
    """dp 2 x ep 2 (each rank saved its own two experts; with ZeRO one directory whose shards
    name them by global id): the file holds all four, equal to the run with every expert on
    every rank."""
    cfg = _cfg(dp=2, global_batch=8, model=MOE)
    out = _run_and_export(tmp_path, dataclasses.replace(cfg, ep=2, zero=zero), 2)
    local = run_ranks(2, _on_ranks, cfg, timeout=300)[0]["params"]
    exported = _exported_as_sequential(out)
    assert set(exported) == set(local) and any(".experts.3." in k for k in exported)
    _assert_params_close(exported, local, _key_bias_bound(cfg))


def _first_loss_of(cfg, state):
    """The loss of the first global batch on a GPT holding ``state``, on one process, written
    without the driver's engines."""
    corpus = data.CharCorpus.build(cfg.data, cfg.model.block_size)
    model_cfg = driver.model_config(cfg, corpus)
    model, loss_fn = build_model(model_cfg, cfg.seed, init_state=state)
    one = dataclasses.replace(cfg, dp=1, tp=1, pp=1, grad_accum=0).with_layout(1)
    sampler = driver.samplers(one, corpus)[0]
    inputs, targets = sampler.replica_batch(0, 0, one.global_batch)
    with torch.no_grad():
        parts = zip(inputs.split(one.micro_batch), targets.split(one.micro_batch))
        return sum(loss_fn(model(x), y).item() for x, y in parts) / one.grad_accum


def test_init_from_an_export_at_another_layout(tmp_path):
    """Trained at tp 2 x pp 2, exported, started from at dp 2 and on one process: both begin
    at the loss of the exported weights on the first batch, and train alike; without the file
    the first loss is the seed's model's."""
    cfg = _cfg(global_batch=8, tp=2, pp=2, micro_batch=2)
    out = _run_and_export(tmp_path, cfg, 4)
    fresh = _cfg(global_batch=8, init_from=out)
    want = _first_loss_of(fresh, load_exported(out))
    single = _single(fresh)
    dp2 = run_ranks(2, _on_ranks, dataclasses.replace(fresh, dp=2), timeout=300)[0]
    assert single.records[0]["loss"] == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(
        dp2["losses"], [r["loss"] for r in single.records], rtol=1e-5, atol=0
    )
    seeded = _single(_cfg(global_batch=8))
    assert abs(seeded.records[0]["loss"] - want) > 1e-2  # the file changed the start


def test_export_and_init_from_errors(tmp_path):
    cfg = _cfg(global_batch=8, dp=2)
    out = _run_and_export(tmp_path, cfg, 2)
    wider = _cfg(global_batch=8, init_from=out, model=dataclasses.replace(TINY, dim=64))
    another = r"init_from: .* holds another model: dim=32 \(this run: 64\)"
    with pytest.raises(ConfigError, match=another):
        _single(wider)
    with pytest.raises(ConfigError, match=another):
        preflight(dataclasses.replace(wider, dp=2), 2)  # the command line, before any rank
    junk = tmp_path / "junk.pt"
    torch.save({"weights": 1}, junk)
    with pytest.raises(ConfigError, match=r"is not a file of python -m dist_kernels.train.export"):
        load_exported(str(junk))
    incomplete = tmp_path / "ckpt" / f"step-{cfg.steps:08d}"
    bare = tmp_path / "bare"  # a record and no stage directories
    bare.mkdir()
    os.rename(incomplete / "COMPLETE.json", bare / "COMPLETE.json")
    with pytest.raises(ConfigError, match=r"is not a complete checkpoint"):
        consolidate(str(incomplete))
    assert export_main([str(incomplete), str(tmp_path / "x.pt")]) == 2
    assert not (tmp_path / "x.pt").exists()
    with pytest.raises(ConfigError, match=r"no stage-\* directories"):
        export(str(bare), str(tmp_path / "y.pt"))
