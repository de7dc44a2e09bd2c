"""``--dropout``: masks hashed from (seed, step, site, sample, element) instead of drawn from a
generator's stream (``dk.models.dropout``), so every layout the driver trains draws the single
process's masks element for element: data parallelism with its gradient accumulation (global
sample indices), tensor parallelism (global head indices; global positions on sequence
shards), pipelines (the micro-batch a schedule action computes), recomputation, resumes.
Every layout must end on the single process's losses and parameters."""

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

from dist_kernels.models import GPT
from dist_kernels.models import dropout as dk_dropout
from dist_kernels.train import ConfigError
from dist_kernels.train.cli import build_parser, config_from_args

DROP = dataclasses.replace(TINY, dropout=0.2)
DROP2 = dataclasses.replace(DROP, n_layers=2)  # four stages for the V schedule
HIDDEN = dataclasses.replace(DROP, attention_dropout=0.0)


# Adam's eps far above the FP32 rounding of a gradient: a dropped element zeroes its share of
# a gradient, and at eps 1e-8 an element left near zero turns its rounding (a layout sums in
# another order) into a whole Adam step (cp 2: one weight of 4,096 off by 9 % of a step,
# its hidden unit rarely active). At 1e-6 such an element moves in proportion to its
# gradient, and every parameter is held to the layout tests' 1 % of a step.
ADAM_EPS = 1e-6


def _dcfg(**kw):
    return _cfg(**{"global_batch": 8, "adam_eps": ADAM_EPS, **kw})


def _reference(model, **kw):
    print(f"seed {SEED}")
    cfg = _dcfg(model=model, **kw)
    result = _single(cfg)
    return _losses(result), result.params, _key_bias_bound(cfg)


def _losses(result):
    return [rec["loss"] for rec in result.records]


@pytest.fixture(scope="module")
def dropout_reference():
    return _reference(DROP)


def test_dropout_changes_training_and_accumulation_keeps_the_masks(dropout_reference):
    """The reference itself: dropout moves the losses away from the same run without it (the
    masks are applied), and one process accumulating 4 micro-batches draws the masks of one
    batch of 8 (each sample keeps its index in the global batch)."""
    losses, params, bound = dropout_reference
    plain = _losses(_single(_dcfg()))
    assert max(abs(a - b) for a, b in zip(losses, plain)) > 1e-3
    accumulated = _single(_dcfg(micro_batch=8, model=DROP))
    _assert_layout_matches([{"losses": _losses(accumulated), "params": accumulated.params}],
                           (losses, params, bound))  # fmt: skip


LAYOUTS = {
    "dp2": (dict(dp=2), 2),
    "dp2-torch": (dict(dp=2, engine="torch"), 2),
    "dp2-zero3": (dict(dp=2, zero=3), 2),
    "fsdp2": (dict(dp=2, zero=2, engine="torch"), 2),
    "tp2": (dict(tp=2), 2),
    "tp2-sp-recompute": (dict(tp=2, sequence_parallel=True, recompute=True), 2),
    "pp2-1f1b": (dict(pp=2, micro_batch=2), 2),
    "pp2-zb-h1": (dict(pp=2, micro_batch=2, schedule="zb-h1"), 2),
    "dp2xtp2": (dict(dp=2, tp=2), 4),
    "dp2xpp2": (dict(dp=2, pp=2, micro_batch=2), 4),
    # ring attention has no dropout of the probabilities: the hidden dropout only
    "cp2": (dict(cp=2, model=HIDDEN), 2),
    "tp2xcp2-sp": (dict(tp=2, cp=2, sequence_parallel=True, model=HIDDEN), 4),
}


@pytest.fixture(scope="module")
def hidden_reference():
    return _reference(HIDDEN)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropout_matches_single_process_in_every_layout(dropout_reference, hidden_reference,
                                                        layout):  # fmt: skip
    layout, world = LAYOUTS[layout]
    engine = layout.get("engine", "dk")
    layout = {k: v for k, v in layout.items() if k != "engine"}
    layout.setdefault("model", DROP)
    reference = hidden_reference if layout["model"] is HIDDEN else dropout_reference
    cfg = _dcfg(**layout)
    ranks = run_ranks(world, _on_ranks, cfg, engine, timeout=240)
    if engine == "torch" and cfg.zero:  # FSDP2's parameters are DTensors: the losses say it
        torch.testing.assert_close(ranks[0]["losses"], reference[0], rtol=1e-5, atol=0)
        return
    _assert_layout_matches(ranks, reference, tp=layout.get("tp", 1))


def test_dropout_with_a_v_schedule_and_recomputed_stages():
    """ZB-V: rank 0 runs the first and the last stage, their actions for different
    micro-batches interleaved; stages recomputed in backward draw their forward's masks."""
    reference = _reference(DROP2)
    cfg = _dcfg(model=DROP2, pp=2, micro_batch=2, schedule="zb-v",
               recompute=True)  # fmt: skip
    _assert_layout_matches(run_ranks(2, _on_ranks, cfg, timeout=240), reference)


def test_dropout_run_resumed_in_another_layout_continues_the_same_masks(tmp_path):
    """Stopped after step STOP on dp2 and resumed on pp2: no generator state is saved, and the
    resumed steps draw what the uninterrupted pp2 run draws."""
    print(f"seed {SEED}")
    base = _dcfg(model=DROP, steps=STOP + 2, log_every=1)
    straight, again = _saved_then_resumed(tmp_path, base, dict(dp=2), dict(pp=2, micro_batch=2))
    assert again[0]["start"] == STOP
    torch.testing.assert_close(again[0]["losses"], straight[0]["losses"][STOP:], rtol=1e-5, atol=0)
    bound = _key_bias_bound(base)
    for mine, ref in zip(again, straight):
        _assert_params_close(mine["params"], ref["params"], bound)


def test_hidden_and_attention_rates_act_apart(dropout_reference, hidden_reference):
    """Each rate drops its own sites: the hidden dropout alone, the attention's alone and both
    train three different ways."""
    attention_only = dataclasses.replace(TINY, attention_dropout=0.2)
    assert attention_only.attn_dropout == 0.2 and attention_only.dropout == 0.0
    only = _losses(_single(_dcfg(model=attention_only)))
    runs = [dropout_reference[0], hidden_reference[0], only]
    for i in range(3):
        for j in range(i):
            assert max(abs(a - b) for a, b in zip(runs[i], runs[j])) > 1e-4, (i, j)


def test_dropout_refusals_and_flags():
    with pytest.raises(ConfigError, match=r"attention dropout\(0.2\) with cp\(2\) > 1"):
        _cfg(model=DROP, cp=2).with_layout(2)
    _cfg(model=HIDDEN, cp=2).with_layout(2)  # the hidden dropout alone is fine
    parse = build_parser().parse_args
    model = config_from_args(parse(["--dropout", "0.1"])).model
    assert (model.dropout, model.attn_dropout) == (0.1, 0.1)
    megatron = config_from_args(parse(["--hidden-dropout", "0.1", "--attention-dropout", "0"]))
    assert (megatron.model.dropout, megatron.model.attn_dropout) == (0.1, 0.0)
    with pytest.raises(ConfigError, match="give one"):
        config_from_args(parse(["--dropout", "0.2", "--hidden-dropout", "0.1"]))
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\), got 1.0"):
        dataclasses.replace(TINY, attention_dropout=1.0)


def test_counter_masks_against_an_integer_reference_and_their_rate():
    """The tensor hash equals lowbias32 written with Python's unbounded integers, element by
    element; the kept share is 1 - p; a slice of the coordinates draws the slice's masks."""
    seed = SEED
    print(f"seed {seed}")
    key = dk_dropout.site_key(seed, 3, 5)
    coords = [torch.arange(2, 5), torch.arange(7), torch.arange(40)]
    keep = dk_dropout.keep_mask(key, coords, 0.3)

    def reference(*index):
        h = key
        for i in index:
            h ^= i
            h ^= h >> 16
            h = (h * 0x7FEB352D) % 2**32
            h ^= h >> 15
            h = (h * 0x846CA68B) % 2**32
            h ^= h >> 16
        return h >= round(0.3 * 2**32)

    for i in range(3):
        for j in range(7):
            for k in range(40):
                assert bool(keep[i, j, k]) == reference(i + 2, j, k)
    big = dk_dropout.keep_mask(key, [torch.arange(256), torch.arange(4096)], 0.3)
    assert abs(big.double().mean().item() - 0.7) < 3e-3  # 1M draws: sigma 4.6e-4
    part = dk_dropout.keep_mask(key, [torch.arange(100, 130), torch.arange(4000, 4096)], 0.3)
    assert torch.equal(part, big[100:130, 4000:])
    attention = [torch.arange(3), torch.arange(2, 6), torch.arange(9), torch.arange(9)]
    assert torch.equal(dk_dropout.keep_mask(key, attention, 0.3),  # the kernel's last step
                       dk_dropout.keep_mask_reference(key, attention, 0.3))  # fmt: skip
    other = dk_dropout.keep_mask(dk_dropout.site_key(seed, 4, 5), coords, 0.3)
    assert not torch.equal(other, keep)  # another step, other masks


def test_model_outside_the_keys_is_torch_dropout_and_eval_is_exact():
    torch.manual_seed(SEED)
    model = GPT(DROP).double()
    ids = torch.randint(0, DROP.vocab_size, (4, 8))
    torch.manual_seed(1)
    a = model(ids)
    torch.manual_seed(1)
    assert torch.equal(model(ids), a)  # torch's stream: reseeded, the same draw
    with dk_dropout.dropout_keys(SEED, 0):
        whole = model(ids)
        assert torch.equal(model(ids), whole)  # keyed: no stream consumed
    with dk_dropout.dropout_keys(SEED, 0, first_sample=2):
        assert torch.equal(model(ids[2:]), whole[2:])  # samples 2, 3 keep their masks
    model.eval()
    with dk_dropout.dropout_keys(SEED, 0):
        evaluated = model(ids)
    torch.manual_seed(SEED)
    plain = GPT(dataclasses.replace(DROP, dropout=0.0)).double().eval()
    plain.load_state_dict(model.state_dict())
    assert torch.equal(evaluated, plain(ids))


MOE = dataclasses.replace(DROP, n_experts=4, top_k=2, moe_every=1)


def test_moe_block_output_is_dropped_as_a_dense_mlps():
    """Megatron's hidden dropout follows an MoE as it follows the MLP: the block's feed-forward
    output is the MoE's with the dense MLP's site mask (sample, position, feature) applied."""
    torch.manual_seed(SEED)
    block = GPT(MOE).blocks[0]
    x = torch.randn(8, 4, MOE.dim)  # [s, b, h]
    with dk_dropout.dropout_keys(SEED, 2, first_sample=4):
        out = block._ffn(x)
        plain = block.mlp(x)
    coords = [torch.arange(4, 8), torch.arange(8), torch.arange(MOE.dim)]
    keep = dk_dropout.keep_mask_reference(dk_dropout.site_key(SEED, 2, 3), coords, MOE.dropout)
    torch.testing.assert_close(out, dk_dropout.apply_mask(plain, keep.permute(1, 0, 2), 0.2))
    assert (out == 0).any() and not (plain == 0).any()


def test_moe_dropout_at_pp2_and_at_ep2():
    """The MoE GPT with dropout: at pp 2 equal to one process; at dp 2 x ep 2 equal to dp 2 with
    every expert local (the experts' tokens come back to their samples' masks)."""
    cfg = _dcfg(micro_batch=2, model=MOE, log_every=1)
    single = _single(cfg)
    piped = run_ranks(2, _on_ranks, dataclasses.replace(cfg, pp=2), timeout=300)
    _assert_layout_matches(piped, (_losses(single), single.params, _key_bias_bound(cfg)))
    local = run_ranks(2, _on_ranks, dataclasses.replace(cfg, dp=2), timeout=300)
    sharded = run_ranks(2, _on_ranks, dataclasses.replace(cfg, dp=2, ep=2), timeout=300)
    torch.testing.assert_close(sharded[0]["losses"], local[0]["losses"], rtol=1e-5, atol=0)
    for r in sharded:
        dense = {k: v for k, v in r["params"].items() if ".experts." not in k}
        _assert_params_close(dense, local[0]["params"], _key_bias_bound(cfg))


def test_dropout_benchmark_runs_and_prints_its_ratios():
    """benchmarks/bench_dropout.py at toy sizes: both tables, every row."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_dropout.py"), "--iters", "1",
         "--warmup", "0", "--dim", "64", "--seq", "32", "--heads", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("counter/torch") == 2 and "bernoulli ms" in out.stdout
    assert "[8, 1024, 1024]" in out.stdout
