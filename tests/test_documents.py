"""Documents packed into one sample, kept apart (``GPT.document_masking``; the driver's
``--reset-attention-mask``, ``--reset-position-ids``, ``--eod-mask-loss``): a packed sample gives
every document the logits the model gives that document run alone (float64), the boundaries
against a loop written here, and the driver at dp 2 and tp 2 with sequence parallelism as one
process, its first loss the separately-run documents' cross entropy without the EOD targets."""

import dataclasses

import numpy as np
import pytest
import torch
from mp_pool import run_ranks
from test_train import LLAMA_TINY, SEED, _cfg, _on_ranks

from dist_kernels.models import GPT, GPTConfig
from dist_kernels.models.documents import document_positions
from dist_kernels.train import ConfigError, data, driver

EOD = 0
SMALL = dict(n_layers=2, n_heads=4, dim=32, block_size=32, vocab_size=50)
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding="rope", bias=False)
MODELS = {
    "gpt2-learned-positions": GPTConfig(**SMALL),
    "llama-gqa-rope": GPTConfig(**SMALL, **LLAMA, n_kv_heads=2),
    "llama-rope-yarn": GPTConfig(**SMALL, **LLAMA, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "mistral-window-5": GPTConfig(**SMALL, **LLAMA, sliding_window=5),  # both masks at once
}  # fmt: skip


def _packed(seed, rows=3, length=32):
    """``[rows, length]`` ids: documents of 1-12 tokens (ids 1..49), each ended by EOD, cut at
    the row's end (a row may start and end mid-document); row 0 starts with an EOD."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        ids = [EOD] if r == 0 else []
        while len(ids) < length:
            n = int(torch.randint(1, 13, (1,), generator=gen))
            ids += torch.randint(1, 50, (n,), generator=gen).tolist() + [EOD]
        out.append(ids[:length])
    return torch.tensor(out)


def _segments(row):
    """``(start, end)`` of each document of ``row``: an EOD ends (and belongs to) its own."""
    spans, start = [], 0
    for t, token in enumerate(row.tolist()):
        if token == EOD:
            spans.append((start, t + 1))
            start = t + 1
    if start < len(row):
        spans.append((start, len(row)))
    return spans


def test_document_positions_against_a_loop():
    ids = _packed(SEED, rows=6)
    ids[3] = torch.arange(1, 33)  # no EOD at all
    ids[4, -1] = EOD
    print(f"seed {SEED}")
    document, position = document_positions(ids, EOD)
    for b, row in enumerate(ids):
        for d, (start, end) in enumerate(_segments(row)):
            assert document[b, start:end].tolist() == [d] * (end - start), (b, d)
            assert position[b, start:end].tolist() == list(range(end - start)), (b, d)


def _alone(gpt, ids):
    """Logits of every document of every row run on its own, at the rows' places."""
    out = torch.empty(*ids.shape, gpt.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for b, row in enumerate(ids):
            for start, end in _segments(row):
                out[b, start:end] = gpt(row[start:end].unsqueeze(0))[0]
    return out


def _gpt(config, seed=SEED):
    torch.manual_seed(seed)
    return GPT(config).double().eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_sample_gives_each_document_its_own_logits(name):
    """Both resets: each document's logits in the packed sample are those it has alone;
    without them the later documents' differ (they see the earlier ones)."""
    print(f"seed {SEED}")
    ids = _packed(SEED + 1)
    plain = _gpt(MODELS[name])
    want = _alone(plain, ids)
    with torch.no_grad():
        unmasked = plain(ids)
        masked = _gpt(MODELS[name]).document_masking(EOD)(ids)
    torch.testing.assert_close(masked, want, rtol=0, atol=1e-12)
    assert (unmasked - want).abs().max() > 1e-3


def test_the_mask_alone_suffices_for_rope_but_not_for_learned_positions():
    """Rope's scores depend on relative positions only, so the mask alone gives each document
    its own logits; a learned table needs the positions reset too; the positions alone still
    let a document see the ones before it."""
    ids = _packed(SEED + 2)
    for name, mask_only_exact in (("llama-gqa-rope", True), ("gpt2-learned-positions", False)):
        want = _alone(_gpt(MODELS[name]), ids)
        with torch.no_grad():
            mask_only = _gpt(MODELS[name]).document_masking(EOD, reset_position_ids=False)(ids)
            positions_only = _gpt(MODELS[name]).document_masking(EOD, reset_attention_mask=False)(
                ids
            )
        error = float((mask_only - want).abs().max())
        assert (error < 1e-12) == mask_only_exact, (name, error)
        assert (positions_only - want).abs().max() > 1e-3, name


def test_recomputed_blocks_read_the_same_masks():
    """Activation recomputation runs the blocks again in backward: the gradients equal those
    without it, bit for bit, though another batch's masks would differ."""
    config = MODELS["llama-gqa-rope"]
    ids, targets = _packed(SEED + 3), _packed(SEED + 4)
    grads = []
    for recompute in (False, True):
        gpt = _gpt(config).train().document_masking(EOD)
        gpt.recompute_blocks(recompute)
        gpt(ids, targets).backward()
        grads.append([p.grad for p in gpt.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_document_masking_refusals():
    from dist_kernels.models.documents import DocumentMasking

    with pytest.raises(ValueError, match=r"eod must be a token id \(int >= 0\), got -1"):
        DocumentMasking(-1)
    with pytest.raises(ValueError, match=r"neither the attention mask nor the positions reset"):
        DocumentMasking(0, reset_attention_mask=False, reset_position_ids=False)
    gpt = GPT(MODELS["llama-gqa-rope"]).document_masking(EOD)
    with pytest.raises(ValueError, match=r"ring attention has no per-document or windowed mask"):
        gpt.context_parallel(object())
    base = _cfg(reset_attention_mask=True)
    with pytest.raises(ConfigError, match=r"reset_attention_mask: needs eod_token"):
        base.with_layout(1)
    for layout in (dict(cp=2), dict(pp=2)):
        with pytest.raises(ConfigError, match=r"ring attention has no per-document mask, and a"):
            dataclasses.replace(base, eod_token=0, **layout).with_layout(2)


def _token_file(tmp_path):
    """Documents (ids 1..63), each ended by EOD 0, in runs of short ones (1-3 tokens) and of
    long ones (20-60): a 32-token window holds anywhere from none to a dozen EODs."""
    rng = np.random.default_rng(SEED)
    ids = []
    while len(ids) < 6000:
        short = (len(ids) // 200) % 2 == 0
        n = int(rng.integers(1, 4)) if short else int(rng.integers(20, 61))
        ids += rng.integers(1, 64, size=n).tolist() + [EOD]
    path = str(tmp_path / "docs.npy")
    np.save(path, np.array(ids, dtype=np.int64))
    return path


def test_driver_keeps_documents_apart_in_every_layout(tmp_path):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss: the first step's loss is
    the cross entropy of each document run alone, the predictions made at EOD tokens left
    out; tp 2 with sequence parallelism, and dp 2, train as one process; with
    --calculate-per-token-loss the loss is that mean however the batch is split."""
    from dist_kernels.train.cli import build_parser, config_from_args, preflight

    tokens = _token_file(tmp_path)
    flags = ["--data", tokens, "--vocab-size", "64", "--eod-token", "0", "--reset-attention-mask",
             "--reset-position-ids", "--eod-mask-loss", "--normalization", "rmsnorm", "--swiglu",
             "--position-embedding-type", "rope", "--seq-len", "32"]  # fmt: skip
    parsed = config_from_args(build_parser().parse_args(flags))
    model = dataclasses.replace(parsed.model, n_layers=2, dim=32)
    cfg = _cfg(
        model=model, data=tokens, vocab_size=64, global_batch=4, micro_batch=4, steps=3,
        **{k: getattr(parsed, k) for k in ("eod_token", "reset_attention_mask",
                                           "reset_position_ids", "eod_mask_loss")},
    )  # fmt: skip
    single = run_ranks(1, _on_ranks, cfg, timeout=300)[0]
    one = cfg.with_layout(1)
    corpus = data.build_corpus(tokens, 32, 64)
    inputs, targets = driver.samplers(one, corpus)[0].replica_batch(0, 0, one.global_batch)
    logits = _alone(_gpt(driver.model_config(one, corpus), one.seed), inputs)  # the driver's init
    kept = inputs != EOD
    assert 0 < int((~kept).sum()) < kept.numel()
    want = torch.nn.functional.cross_entropy(logits[kept], targets[kept]).item()
    assert single["losses"][0] == pytest.approx(want, rel=1e-5)
    every = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(every - want) > 5 * 1e-5 * want  # the EOD targets' share is visible
    unmasked = run_ranks(1, _on_ranks, dataclasses.replace(cfg, eod_mask_loss=False), timeout=300)
    assert unmasked[0]["losses"][0] == pytest.approx(every, rel=1e-5)
    tp2 = dict(tp=2, sequence_parallel=True, dp=1)
    ranks = run_ranks(2, _on_ranks, dataclasses.replace(cfg, **tp2), timeout=300)
    torch.testing.assert_close(ranks[0]["losses"], single["losses"], rtol=1e-5, atol=0)
    # each micro-batch's loss is the mean over its own kept targets (Megatron's without
    # --calculate-per-token-loss), so dp 2 equals one process of the same micro-batches
    halves = dataclasses.replace(cfg, micro_batch=2)
    accumulated = run_ranks(1, _on_ranks, halves, timeout=300)[0]
    ranks = run_ranks(2, _on_ranks, dataclasses.replace(halves, dp=2), timeout=300)
    torch.testing.assert_close(ranks[0]["losses"], accumulated["losses"], rtol=1e-5, atol=0)
    print(f"losses: {accumulated['losses']} (two micro-batches' means)")
    # --calculate-per-token-loss: the mean over every kept target of the global batch, however
    # it is split: two micro-batches, dp 2, and a pipeline (EOD targets masked, no resets)
    per_token = dataclasses.replace(cfg, calculate_per_token_loss=True)
    split = run_ranks(1, _on_ranks, dataclasses.replace(per_token, micro_batch=2), timeout=300)
    assert split[0]["losses"][0] == pytest.approx(want, rel=1e-5)
    whole = run_ranks(1, _on_ranks, per_token, timeout=300)[0]
    print(f"losses: {whole['losses']} (per token)")
    assert abs(whole["losses"][-1] - accumulated["losses"][-1]) > 1e-3  # the weighting matters
    torch.testing.assert_close(split[0]["losses"], whole["losses"], rtol=1e-5, atol=0)
    ranks = run_ranks(
        2, _on_ranks, dataclasses.replace(per_token, micro_batch=2, dp=2), timeout=300
    )
    torch.testing.assert_close(ranks[0]["losses"], whole["losses"], rtol=1e-5, atol=0)
    unreset = dataclasses.replace(per_token, reset_attention_mask=False, reset_position_ids=False)
    alone = run_ranks(1, _on_ranks, unreset, timeout=300)[0]
    piped = dict(pp=2, micro_batch=2, dp=1)
    ranks = run_ranks(2, _on_ranks, dataclasses.replace(unreset, **piped), timeout=300)
    torch.testing.assert_close(ranks[0]["losses"], alone["losses"], rtol=1e-5, atol=0)
    with pytest.raises(ConfigError, match=r"--eod-token 64 is not in the data's vocabulary of 64"):
        preflight(dataclasses.replace(cfg, eod_token=64), 1)
    for other in (dict(cp=2, reset_attention_mask=False, reset_position_ids=False),
                  dict(model=dataclasses.replace(model, n_experts=4))):  # fmt: skip
        with pytest.raises(ConfigError, match=r"calculate_per_token_loss with cp\(\d\) > 1 or MoE"):
            dataclasses.replace(per_token, micro_batch=2, **other).with_layout(2)


@pytest.mark.parametrize(
    "layout,world",
    [(dict(tp=2, sequence_parallel=True), 2), (dict(pp=2, micro_batch=2), 2),
     (dict(dp=2, zero=3), 2)],
    ids=["tp2-sp", "pp2", "dp2-zero3"],
)  # fmt: skip
def test_driver_with_a_sliding_window_trains_as_one_process(layout, world):
    """--sliding-window 5 (a 16-token sequence): the layouts train to one process's losses;
    cp is refused (ring attention has no windowed mask)."""
    model = dataclasses.replace(LLAMA_TINY, sliding_window=5)
    cfg = _cfg(global_batch=8, model=model)
    single = run_ranks(1, _on_ranks, cfg, timeout=300)[0]
    plain = run_ranks(1, _on_ranks, _cfg(global_batch=8, model=LLAMA_TINY), timeout=300)[0]
    assert single["losses"] != plain["losses"]  # the window is narrower than the sequence
    ranks = run_ranks(world, _on_ranks, dataclasses.replace(cfg, **layout), timeout=300)
    torch.testing.assert_close(ranks[0]["losses"], single["losses"], rtol=1e-5, atol=0)
    with pytest.raises(ConfigError, match=r"sliding_window\(5\) with cp\(2\) > 1"):
        dataclasses.replace(cfg, cp=2).with_layout(2)
