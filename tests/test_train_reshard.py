"""``--resume`` at another layout than the run that saved: another pp, tp, pipeline schedule,
ZeRO on or off (``train/reshard.py``). The resumed run must continue as the uninterrupted run
at the new layout does: the same losses and parameters to the FP32 rounding of the first
steps' other layout, which holds only if the weights, every AdamW moment and step count, the
schedule's position and the data position all came through the cut."""

import dataclasses
import os

import pytest
import torch
from mp_pool import run_ranks
from test_gpt_tp import shard_of
from test_train import (
    FP16,
    LLAMA_TINY,
    SEED,
    TINY,
    _assert_params_close,
    _cfg,
    _initial_params,
    _key_bias_bound,
    _on_ranks,
)

from dist_kernels.train import ConfigError
from dist_kernels.train.checkpoints import layout_change
from dist_kernels.train.cli import preflight
from dist_kernels.train.reshard import _cut

LAYERS2 = dataclasses.replace(TINY, n_layers=2)
MOE = dataclasses.replace(TINY, n_experts=4, top_k=2, moe_every=1)
STOP = 3
WD = dict(weight_decay=0.5)


def _world(layout):
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)


def _saved_then_resumed(tmp_path, base, saved, resumed):
    """``(straight run at the resumed layout, the resumed run)``: ``base`` trained to STOP at
    layout ``saved`` with a checkpoint, then resumed to the end at layout ``resumed``."""
    ckpt = dict(checkpoint_dir=str(tmp_path), resume="auto")
    first = dataclasses.replace(base, stop_after=STOP, **saved, **ckpt)
    run_ranks(_world(saved), _on_ranks, first, timeout=300)
    then = dataclasses.replace(base, **resumed)
    straight = run_ranks(_world(resumed), _on_ranks, then, timeout=300)
    again = run_ranks(_world(resumed), _on_ranks, dataclasses.replace(then, **ckpt), timeout=300)
    return straight, again


CASES = {
    "tp2xpp2->dp2": (dict(tp=2, pp=2), dict(dp=2), TINY, {}),
    "pp2-1f1b->tp2-sp": (dict(pp=2), dict(tp=2, sequence_parallel=True), TINY, {}),
    "dp2-zero2->pp2-zb-v": (dict(dp=2, zero=2), dict(pp=2, schedule="zb-v"), LAYERS2, {}),
    "dp2->dp2xtp2-zero3": (dict(dp=2), dict(dp=2, tp=2, zero=3), TINY, {}),
    "pp2-1f1b->pp2-interleaved": (
        dict(pp=2), dict(pp=2, schedule="interleaved-1f1b"), LAYERS2, {},
    ),
    "dp2xep2-zero1->pp2": (dict(dp=2, ep=2, zero=1), dict(pp=2), MOE, {}),
    "tp2xcp2-llama->pp2": (dict(tp=2, cp=2), dict(pp=2), LLAMA_TINY, {}),
    # fp16: layouts whose overflow decisions agree (dp 2 skips step 3 where pp 2 does not:
    # FP16's rounding differs between layouts, and an overflow is a yes or no)
    "pp2-fp16->tp2": (dict(pp=2), dict(tp=2), TINY, FP16),
    # weight decay: two param groups (none on biases and norms), each keeps its own
    "dp2-zero1-wd->tp2xpp2": (dict(dp=2, zero=1), dict(tp=2, pp=2), TINY, WD),
    "tp2-wd->dp2-zero3": (dict(tp=2), dict(dp=2, zero=3), TINY, WD),
    "dp2xep2-wd->dp2": (dict(dp=2, ep=2), dict(dp=2), MOE, WD),  # ep only: by name
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_layout_continues_the_run(tmp_path, case):
    """Saved at one layout after STOP steps, resumed at another to the end: every logged loss
    (and with fp16 every loss scale and skip) and every parameter of every rank equal the
    uninterrupted run at the new layout to FP32 rounding (AdamW with fresh moments, a
    schedule restarted or data replayed would each move them by orders of magnitude more)."""
    saved, resumed, model, more = CASES[case]
    print(f"seed {SEED}")
    base = dict(steps=6, global_batch=8, micro_batch=2, warmup=2, log_every=1, model=model)
    base = _cfg(**{**base, **more})
    straight, again = _saved_then_resumed(tmp_path, base, saved, resumed)
    assert again[0]["start"] == STOP
    if base.dtype == "fp16":
        _assert_fp16_continues(base, resumed, straight, again)
        return
    torch.testing.assert_close(again[0]["losses"], straight[0]["losses"][STOP:], rtol=1e-5, atol=0)
    bias = model.bias and not model.swiglu  # no key-bias bound without biases (LLAMA_TINY)
    bound = _key_bias_bound(dataclasses.replace(base, **resumed)) if bias else 0.0
    for r, (mine, ref) in enumerate(zip(again, straight)):
        assert set(mine["params"]) == set(ref["params"]), r
        _assert_params_close(mine["params"], ref["params"], bound)


def _assert_fp16_continues(base, resumed, straight, again):
    """fp16: the loss scaler resumed (the same scales and skips, exactly), and the losses and
    parameters as close as two fp16 layouts get (``test_train``'s fp16 criterion: FP16's
    rounding, which Adam amplifies where a gradient is near zero, leaves a few elements up to
    ~lr apart)."""
    scales = [(r["loss_scale"], r["skipped_steps"]) for r in straight[0]["records"]]
    print(f"(scale, skipped) per step {scales}")
    assert len({s for s, _ in scales[STOP - 1 :]}) > 1  # the scale moves after the resume
    assert [(r["loss_scale"], r["skipped_steps"]) for r in again[0]["records"]] == scales[STOP:]
    torch.testing.assert_close(again[0]["losses"], straight[0]["losses"][STOP:], rtol=1e-3, atol=0)
    init = _initial_params(dataclasses.replace(base, **resumed))
    tp = resumed.get("tp", 1)
    for rank, (mine, ref) in enumerate(zip(again, straight)):
        moved = off = 0.0
        for k, x in mine["params"].items():
            moved += (ref["params"][k] - shard_of(init[k], x, rank % tp)).square().sum().item()
            off += (x - ref["params"][k]).square().sum().item()
        print(f"rank {rank}: parameters off by {off**0.5:.2e}, moved {moved**0.5:.2e}")
        assert off**0.5 < 0.05 * moved**0.5


def test_layout_change_names_what_changed():
    saved = dict(pp=2, tp=1, schedule="1f1b", sharded=False)
    assert layout_change(saved, dict(saved)) is None
    now = dict(pp=1, tp=2, schedule=None, sharded=True)  # no schedule without a pipeline
    assert layout_change(saved, now) == "pp 2 -> 1, tp 1 -> 2, sharded False -> True"
    assert layout_change(saved, dict(saved, schedule="zb-v")) == "schedule 1f1b -> zb-v"
    # a record written before a key existed was written at this run's value
    assert layout_change(dict(pp=2, tp=1), dict(now, pp=2, tp=1)) is None


def test_cut_takes_the_tp_ranks_slice_or_refuses():
    whole = torch.arange(24.0).view(4, 6)
    assert torch.equal(_cut(whole, torch.Size([4, 3]), 1, 2, "w"), whole[:, 3:])
    assert torch.equal(_cut(whole, torch.Size([2, 6]), 0, 2, "w"), whole[:2])
    assert _cut(whole, whole.shape, 1, 2, "w") is whole  # held whole by every tp rank
    with pytest.raises(ConfigError, match=r"resume: w is \(4, 2\) on this rank.*tp\(2\)"):
        _cut(whole, torch.Size([4, 2]), 0, 2, "w")  # 6 is not 2 slices of 2
    with pytest.raises(ConfigError, match=r"not tp\(2\) slices of it along one dimension"):
        _cut(whole, torch.Size([2, 3]), 0, 2, "w")


def test_preflight_accepts_another_layout_and_still_refuses_another_model(tmp_path):
    """The command line's check before any rank starts: another pp / tp / ZeRO is a resume
    now; another model or global batch is still refused."""
    cfg = _cfg(steps=4, global_batch=4, checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(2, _on_ranks, dataclasses.replace(cfg, pp=2, stop_after=2), timeout=300)
    assert os.path.isfile(tmp_path / "step-00000002" / "COMPLETE.json")
    preflight(dataclasses.replace(cfg, tp=2), 2)
    preflight(dataclasses.replace(cfg, dp=2, zero=3), 2)
    with pytest.raises(ConfigError, match="was written with model="):
        preflight(dataclasses.replace(cfg, tp=2, model=dataclasses.replace(TINY, dim=64)), 2)


def test_a_checkpoint_older_than_a_model_field_still_resumes(tmp_path):
    """A record written before a GPTConfig field existed lacks it; the model that wrote it had
    the field's default, so a run at the default resumes it and a run off the default does
    not (the missing field is compared as its default)."""
    import json

    cfg = _cfg(steps=4, global_batch=4, checkpoint_dir=str(tmp_path), resume="auto")
    run_ranks(1, _on_ranks, dataclasses.replace(cfg, stop_after=2), timeout=300)
    record_path = tmp_path / "step-00000002" / "COMPLETE.json"
    record = json.loads(record_path.read_text())
    for field in ("ffn_hidden_size", "gelu_approximate"):
        del record["identity"]["model"][field]
    record_path.write_text(json.dumps(record))
    preflight(cfg, 1)
    tanh = dataclasses.replace(cfg, model=dataclasses.replace(TINY, gelu_approximate="tanh"))
    with pytest.raises(ConfigError, match="was written with model="):
        preflight(tanh, 1)
