"""``--data 0.25 a.bin 0.75 b.bin``: a weighted blend of token files (Megatron's
``--data-path``), sampled by ``(seed, step)`` alone like a single corpus."""

import dataclasses

import numpy as np
import pytest
import torch
from mp_pool import run_ranks
from test_train import SEED, _cfg, _on_ranks

from dist_kernels.train import ConfigError, data, train
from dist_kernels.train.cli import build_parser, config_from_args


def _files(tmp_path):
    """Two token files with disjoint ids: a.npy in [0, 40), b.bin in [40, 80)."""
    rng = np.random.default_rng(SEED)
    a, b = str(tmp_path / "a.npy"), str(tmp_path / "b.bin")
    np.save(a, rng.integers(0, 40, size=3000).astype(np.int64))
    rng.integers(40, 80, size=5000).astype("<u2").tofile(b)
    return a, b


def test_a_blend_draws_each_file_in_proportion_and_real_windows(tmp_path):
    """Over 200 steps of 16 samples, the share of windows from b.bin is 0.75 within four
    binomial standard deviations; every window is a contiguous run of its file."""
    print(f"seed {SEED}")
    a, b = _files(tmp_path)
    corpus = data.BlendedCorpus.build([(1.0, a), (3.0, b)], seq_len=16)
    assert corpus.weights == [0.25, 0.75] and corpus.vocab_size == 80
    sampler = data.Sampler(corpus, 16, global_batch=16, seed=SEED)
    from_b, total = 0, 0
    tokens_a, tokens_b = np.load(a), np.fromfile(b, dtype="<u2").astype(np.int64)
    for step in range(200):
        inputs, targets = sampler.batch(step, 0, 16)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        in_b = inputs[:, 0] >= 40
        assert torch.equal(in_b, (inputs >= 40).all(dim=1))  # never two files in a window
        from_b += int(in_b.sum())
        total += 16
        if step < 5:  # each window is its file's, at its offset
            files, offsets = sampler.step_windows(step)
            for row, (f, o) in enumerate(zip(files.tolist(), offsets.tolist())):
                source = tokens_b if f == 1 else tokens_a
                assert torch.equal(inputs[row], torch.from_numpy(source[o : o + 16]))
    share, sigma = from_b / total, (0.75 * 0.25 / total) ** 0.5
    print(f"share from b.bin {share:.4f} (want 0.75 +- {4 * sigma:.4f})")
    assert abs(share - 0.75) < 4 * sigma


def test_a_blend_trains_alike_in_every_layout_and_resumes_exactly(tmp_path):
    """dp 2 trains the blend as one process does; a blend with validation resumes bitwise;
    the single-corpus stream is untouched by blends (a one-file 'blend' is the file)."""
    a, b = _files(tmp_path)
    cfg = _cfg(global_batch=8, data=None, data_blend=((0.4, a), (0.6, b)))
    single = train(dataclasses.replace(cfg, steps=3).with_layout(1))
    dp2 = run_ranks(2, _on_ranks, dataclasses.replace(cfg, dp=2), timeout=180)
    torch.testing.assert_close(
        dp2[0]["losses"], [r["loss"] for r in single.records], rtol=1e-5, atol=0
    )
    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpt"), resume="auto")
    run = dataclasses.replace(cfg, steps=6, eval_interval=3, log_every=1)
    straight = run_ranks(2, _on_ranks, dataclasses.replace(run, dp=2), timeout=180)
    run_ranks(2, _on_ranks, dataclasses.replace(run, dp=2, stop_after=3, **ckpt), timeout=180)
    resumed = run_ranks(2, _on_ranks, dataclasses.replace(run, dp=2, **ckpt), timeout=180)
    assert resumed[0]["losses"] == straight[0]["losses"][3:]
    assert resumed[0]["evals"][-1] == straight[0]["evals"][-1]
    one = data.Sampler(data.BlendedCorpus.build([(1.0, a)], 16), 16, 8, SEED)
    plain = data.Sampler(data.build_corpus(a, 16), 16, 8, SEED)
    assert torch.equal(one.batch(4, 0, 8)[0], plain.batch(4, 0, 8)[0])


def test_blend_flags_and_errors(tmp_path):
    a, b = _files(tmp_path)
    parse = lambda *argv: config_from_args(build_parser().parse_args(list(argv)))  # noqa: E731
    cfg = parse("--data-path", "0.3", a, "0.7", b)
    assert cfg.data is None and cfg.data_blend == ((0.3, a), (0.7, b))
    assert parse("--data", a).data == a
    with pytest.raises(ConfigError, match=r"--data: a blend is weight / file pairs, got 3"):
        parse("--data", "0.3", a, b)
    with pytest.raises(ConfigError, match=r"a blend is weight / file pairs"):
        parse("--data", a, b)  # no weights
    with pytest.raises(data.DataError, match=r"a blend needs positive weights"):
        data.BlendedCorpus.build([(0.0, a), (1.0, b)], 16)
    text = tmp_path / "t.txt"
    text.write_text("hello " * 100)
    with pytest.raises(data.DataError, match=r"t.txt in a blend is not a file of token ids"):
        data.BlendedCorpus.build([(1.0, a), (1.0, str(text))], 16)
    with pytest.raises(data.DataError, match=r"outside \[0, vocab_size\(50\)\)"):
        data.BlendedCorpus.build([(1.0, a), (1.0, b)], 16, vocab_size=50)
    with pytest.raises(ConfigError, match=r"give one of them"):
        _cfg(data=a, data_blend=((1.0, b),)).with_layout(1)
