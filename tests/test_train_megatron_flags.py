"""Megatron-LM's command-line spellings: a ``pretrain_gpt.py`` command line builds the same
TrainConfig as the driver's own flags (the reference: our flags, each meaning written out
here), and the spellings without a counterpart are refused, naming why."""

import dataclasses
import json
import os
import types

import pytest

from dist_kernels.models import GPT
from dist_kernels.moe import MoE
from dist_kernels.train import ConfigError, driver
from dist_kernels.train.cli import build_parser, config_from_args, model_flags
from dist_kernels.train.cli import main as cli_main


def _cfg(argv):
    return config_from_args(build_parser().parse_args(argv))


def test_a_gpt2_pretraining_command_line(tmp_path):
    """Megatron's GPT-2 recipe (scaled down): parallel sizes, shapes, batches, schedule,
    precision, data, intervals, checkpoint directories, distributed optimizer, dropout and
    initialisation, learned absolute positions."""
    ckpt = str(tmp_path / "ckpt")
    vocab, merges = _gpt2_bpe_files(tmp_path, 300)
    megatron = (
        f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file {merges} "
        "--make-vocab-size-divisible-by 128 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --num-layers 4 "
        "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 0.00015 --train-iters 20 "
        "--lr-decay-iters 16 --lr-decay-style cosine --min-lr 1.5e-5 --weight-decay 1e-2 "
        "--lr-warmup-fraction .25 --clip-grad 1.0 --bf16 --split 949,50,1 --log-interval 5 "
        f"--save-interval 10 --eval-interval 10 --eval-iters 2 --save {ckpt} --load {ckpt} "
        "--use-distributed-optimizer --init-method-std 0.006 --hidden-dropout 0.1 "
        "--attention-dropout 0.1 --normalization LayerNorm --position-embedding-type "
        "learned_absolute --untie-embeddings-and-output-weights"
    ).split()
    ours = (
        "--vocab-size 300 --make-vocab-size-divisible-by 128 "
        "--pp 2 --n-layer 4 --d-model 64 --n-head 4 --seq-len 32 --micro-batch 2 "
        "--global-batch 8 --lr 0.00015 --steps 20 --lr-decay-steps 16 --decay cosine "
        "--min-lr-ratio 0.1 --weight-decay 1e-2 --warmup 4 --clip-grad 1.0 --dtype bf16 "
        f"--split 949,50,1 --log-every 5 --checkpoint-every 10 --eval-interval 10 --eval-iters "
        f"2 --checkpoint-dir {ckpt} --resume auto --zero 1 --normalization layernorm "
        "--position-embedding-type learned --dropout 0.1 --attention-dropout 0.1"
    ).split()
    want = _cfg(ours)
    want = dataclasses.replace(want, model=dataclasses.replace(want.model, init_std=0.006))
    got = _cfg(megatron)
    assert got.min_lr_ratio == pytest.approx(0.1, rel=1e-12)
    assert dataclasses.replace(got, min_lr_ratio=0.1) == want


def _gpt2_bpe_files(tmp_path, n: int):
    """GPT2BPETokenizer's files for a vocabulary of ``n`` tokens (byte-level, as GPT-2's)."""
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(n)}))
    merges.write_text("#version: 0.2\nt 0\n")
    return str(vocab), str(merges)


def test_tokenizer_flags_give_the_tokenizers_vocabulary(tmp_path):
    """The vocabulary Megatron's tokenizer has: GPT2BPETokenizer's vocab.json entries,
    HuggingFaceTokenizer's tokens (a local directory), NullTokenizer's ids plus its
    end-of-document id; padded by the driver to --make-vocab-size-divisible-by and tp."""
    vocab, merges = _gpt2_bpe_files(tmp_path, 300)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    assert _cfg(gpt2).vocab_size == 300
    assert _cfg([*gpt2, "--vocab-size", "300"]).vocab_size == 300
    assert _cfg(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]).vocab_size == 101
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(["a tiny corpus, a tiny vocabulary"] * 50, trainer)
    hf_dir = str(tmp_path / "tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(hf_dir)
    hf = _cfg(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir])
    assert hf.vocab_size == bpe.get_vocab_size() > 256
    corpus = types.SimpleNamespace(vocab_size=300)
    for multiple, tp, want in ((64, 1, 320), (128, 2, 384), (48, 1, 336), (48, 32, 384)):
        cfg = dataclasses.replace(_cfg(gpt2), vocab_multiple=multiple, tp=tp)
        assert driver.model_config(cfg, corpus).vocab_size == want, (multiple, tp)


@pytest.mark.parametrize(
    "flags,message",
    [(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "t.model"],
      r"Llama2Tokenizer: .* give --vocab-size N"),
     (["--vocab-file", "v.json"], r"--vocab-file without --tokenizer-type"),
     (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
      r"needs --vocab-file and --merge-file"),
     (["--tokenizer-type", "NullTokenizer"], r"NullTokenizer needs --vocab-size"),
     (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
      r"a local directory \(nothing is downloaded\); got 'gpt2'"),
     (["--make-vocab-size-divisible-by", "0"], r"vocab_multiple must be >= 1")],
)  # fmt: skip
def test_tokenizer_flag_errors(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(flags).check()
    vocab, merges = _gpt2_bpe_files(tmp_path, 300)
    other = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
             merges, "--vocab-size", "50257"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--vocab-size 50257, but .* GPT2BPETokenizer has 300"):
        _cfg(other)


def test_a_llama_moe_command_line():
    """Megatron's Llama / MoE spellings: RMSNorm, rope, grouped queries, experts in every
    layer (Megatron's default --moe-layer-freq 1), full recompute, fp16."""
    megatron = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 4096 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --rotary-base 500000 --group-query-attention "
        "--num-query-groups 2 --disable-bias-linear --num-experts 4 --moe-router-topk 2 "
        "--expert-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --fp16 --context-parallel-size 1 --train-iters 5 "
        "--lr-warmup-iters 2"
    ).split()
    ours = (
        "--n-layer 2 --d-model 64 --n-head 4 --seq-len 32 --swiglu --normalization rmsnorm "
        "--position-embedding-type rope --rotary-base 500000 --num-query-groups 2 "
        "--disable-bias-linear --experts 4 --moe-every 1 --top-k 2 --ep 2 --recompute "
        "--dtype fp16 --cp 1 --steps 5 --warmup 2"
    ).split()
    assert _cfg(megatron) == _cfg(ours)
    assert _cfg(["--group-query-attention"]).model.n_kv_heads == 1  # Megatron's default
    assert _cfg(["--num-experts", "4", "--moe-every", "2"]).model.moe_every == 2
    assert _cfg(["--experts", "4"]).model.moe_every == 2  # ours unchanged


def test_a_nemotron_command_line():
    """Megatron's Nemotron-4 spellings (its examples' model options): squared ReLU, LayerNorm
    of 1 + w, no linear biases, rope over half of each head, grouped queries. The model they
    build is Nemotron's (exports as NemotronForCausalLM)."""
    from dist_kernels.models import GPT
    from dist_kernels.models.hf import to_hf

    megatron = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --squared-relu --normalization LayerNorm "
        "--apply-layernorm-1p --disable-bias-linear --position-embedding-type rope "
        "--rotary-percent 0.5 --group-query-attention --num-query-groups 2 "
        "--untie-embeddings-and-output-weights"
    ).split()
    model = _cfg(megatron).model
    assert (model.squared_relu, model.norm_unit_offset, model.bias, model.norm_biased) == (
        True, True, False, True)  # fmt: skip
    hf, _ = to_hf(model, GPT(model).state_dict())
    assert hf["model_type"] == "nemotron" and hf["hidden_act"] == "relu2"
    assert hf["rope_parameters"]["partial_rotary_factor"] == 0.5


def test_disable_bias_linear_keeps_the_layernorm_biases_as_megatron():
    """Megatron's --disable-bias-linear unbiases its linear layers only (add_bias_linear); its
    LayerNorm always has a bias (RMSNorm none): a Nemotron-style LayerNorm model without
    linear biases has every norm's bias and no other, as Megatron builds it."""
    from dist_kernels.models import GPT

    cfg = _cfg(["--disable-bias-linear", "--normalization", "LayerNorm"]).model
    names = {n for n, _ in GPT(cfg).named_parameters() if n.endswith(".bias")}
    norms = {"ln_1", "ln_2", "ln_f"}
    assert names and all(n.split(".")[-2] in norms for n in names), sorted(names)
    assert len(names) == 2 * cfg.n_layers + 1  # ln_1, ln_2 per block and the final ln_f
    rms = _cfg(["--disable-bias-linear", "--normalization", "RMSNorm"]).model
    assert not [n for n, _ in GPT(rms).named_parameters() if n.endswith(".bias")]
    assert rms.norm_bias is None  # nothing to say: an identity as before
    # the library's own spelling: bias=False alone unbiases the norms too (--no-norm-bias)
    plain = dataclasses.replace(cfg, norm_bias=None)
    assert not [n for n, _ in GPT(plain).named_parameters() if n.endswith(".bias")]
    none = _cfg(["--disable-bias-linear", "--no-norm-bias"]).model
    assert not [n for n, _ in GPT(none).named_parameters() if n.endswith(".bias")]


@pytest.mark.parametrize(
    "freq,layers,want",
    [("1", 3, [1, 1, 1]), ("2", 5, [1, 0, 1, 0, 1]),  # Megatron's: blocks 0, N, 2N, ...
     ("([0]*1+[1]*3)", 4, [0, 1, 1, 1]),  # DeepSeek-V3's dense first block(s)
     ("[1,0]*2", 4, [1, 0, 1, 0])],
)  # fmt: skip
def test_moe_layer_freq_places_the_moe_blocks_as_megatron(freq, layers, want):
    """--moe-layer-freq N|PATTERN: which blocks Megatron makes MoE blocks (its
    moe_layer_pattern), the model's blocks built so; model_flags writes it back."""
    flags = ["--num-experts", "4", "--num-layers", str(layers), "--moe-layer-freq", freq]
    model = _cfg(flags).model
    assert [int(model.is_moe_block(i)) for i in range(layers)] == want
    gpt = GPT(dataclasses.replace(model, vocab_size=64))
    assert [isinstance(b.mlp, MoE) for b in gpt.blocks] == [bool(v) for v in want]
    again = build_parser().parse_args([*model_flags(model), "--num-layers", str(layers)])
    assert config_from_args(again).model.moe_layers == model.moe_layers


@pytest.mark.parametrize(
    "freq,message",
    [("0", r"--moe-layer-freq 0: must be >= 1"), ("[1]*3", r"gives \[1, 1, 1\]: one 0 or 1 per"),
     ("[2]*4", r"one 0 or 1 per block"), ("[__import__('os')]", r"not a list pattern"),
     ("[1]*10**9", r"not a list pattern"), ("x", r"an int or a list pattern")],
)  # fmt: skip
def test_moe_layer_freq_errors(freq, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(["--num-experts", "4", "--num-layers", "4", "--moe-layer-freq", freq])
    with pytest.raises(ConfigError, match=r"--moe-layer-freq and --moe-every"):
        _cfg(["--num-experts", "4", "--moe-every", "2", "--moe-layer-freq", "2"])


def test_load_from_another_directory_resumes_its_newest_checkpoint(tmp_path):
    """--load DIR beside another --save: the newest complete step of DIR; an empty DIR starts
    afresh, as Megatron does."""
    load, save = tmp_path / "pretrained", str(tmp_path / "run")
    for step, complete in ((4, True), (8, True), (12, False)):
        os.makedirs(load / f"step-{step:08d}")
        if complete:
            (load / f"step-{step:08d}" / "COMPLETE.json").write_text("{}")
    cfg = _cfg(["--save", save, "--load", str(load)])
    assert cfg.checkpoint_dir == save and cfg.resume == str(load / "step-00000008")
    assert _cfg(["--save", save, "--load", str(tmp_path / "empty")]).resume is None


@pytest.mark.parametrize(
    "flags,message",
    [(["--recompute-granularity", "selective"], r"selective \(the attention's core only\)"),
     (["--recompute-granularity", "full", "--recompute-method", "block",
       "--recompute-num-layers", "2"], r"only every block recomputed on its own"),
     (["--recompute-num-layers", "1"], r"need --recompute-granularity"),
     (["--hidden-dropout", "0.1", "--dropout", "0"], r"--dropout 0.0 and --hidden-dropout 0.1"),
     (["--min-lr", "1e-5", "--min-lr-ratio", "0.2"], r"--min-lr and --min-lr-ratio"),
     (["--lr-warmup-fraction", "0.1", "--warmup", "3"], r"--lr-warmup-fraction and"),
     (["--max-position-embeddings", "64", "--seq-length", "32"], r"the table here has"),
     (["--save", "a", "--checkpoint-dir", "b"], r"--save and --checkpoint-dir"),
     (["--load", "a", "--resume", "auto"], r"--load and --resume"),
     (["--num-experts", "4", "--experts", "8"], r"--num-experts 4 and --experts 8")],
)  # fmt: skip
def test_spellings_without_a_counterpart_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(flags)


def test_the_driver_runs_a_megatron_command_line(tmp_path, capsys):
    """The command itself, one process: trains and writes its checkpoint where --save says."""
    ckpt = str(tmp_path / "ckpt")
    argv = (
        "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --log-interval 1 "
        f"--save-interval 2 --save {ckpt} --no-progress"
    ).split()
    assert cli_main(argv) == 0
    assert os.path.isfile(os.path.join(ckpt, "step-00000002", "COMPLETE.json"))
    assert "final loss" in capsys.readouterr().out
