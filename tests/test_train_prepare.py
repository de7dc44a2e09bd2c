"""``python -m dist_kernels.train.prepare``: text to token ids with a local Hugging Face
tokenizer, then the whole offline path a user takes: tokenize, train, export to Hugging Face,
generate with ``transformers``. The tokenizer is trained here (``tokenizers``' BPE on the test
corpus): nothing is downloaded."""

import os

import numpy as np
import pytest
import torch
from test_train import CORPUS, SEED, _cfg

from dist_kernels.models import GPT, GPTConfig
from dist_kernels.train import data, train
from dist_kernels.train.data import DataError
from dist_kernels.train.export import consolidate
from dist_kernels.train.export import main as export_main
from dist_kernels.train.prepare import main as prepare_main
from dist_kernels.train.prepare import prepare

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE of 300 ids trained on the test corpus, saved as transformers saves
    a fast tokenizer."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([CORPUS], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    fast.save_pretrained(directory)
    return directory, bpe


def _documents(tmp_path):
    """The test corpus cut in two documents."""
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    half = len(text) // 2
    paths = []
    for i, part in enumerate((text[:half], text[half:])):
        paths.append(str(tmp_path / f"doc{i}.txt"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(part)
    return paths, (text[:half], text[half:])


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_prepare_writes_the_tokenizers_ids_and_an_eos_per_document(tmp_path, tokenizer_dir, suffix):
    directory, bpe = tokenizer_dir
    paths, texts = _documents(tmp_path)
    out = str(tmp_path / f"train{suffix}")
    assert prepare_main(["--tokenizer", directory, "--out", out, *paths]) == 0
    eos = bpe.token_to_id(EOS)
    want = np.concatenate([np.asarray(bpe.encode(t).ids + [eos]) for t in texts])
    got = np.fromfile(out, dtype="<u2") if suffix == ".bin" else np.load(out)
    assert got.dtype == (np.dtype("<u2") if suffix == ".bin" else np.int32)
    assert np.array_equal(got.astype(np.int64), want)
    assert int((got == eos).sum()) == 2 and got[-1] == eos
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]  # no temporary file left
    count, _ = prepare(paths, directory, str(tmp_path / "plain.npy"), eos=False)
    assert count == len(want) - 2


def test_prepare_errors(tmp_path, tokenizer_dir):
    directory, _ = tokenizer_dir
    paths, _ = _documents(tmp_path)
    with pytest.raises(DataError, match=r"must end in .bin \(uint16\) or .npy"):
        prepare(paths, directory, str(tmp_path / "x.txt"))
    with pytest.raises(DataError, match=r"is not a tokenizer directory"):
        prepare(paths, str(tmp_path / "nothing"), str(tmp_path / "x.bin"))
    with pytest.raises(DataError, match=r"cannot read .*missing.txt"):
        prepare([str(tmp_path / "missing.txt")], directory, str(tmp_path / "x.bin"))
    assert not os.path.exists(tmp_path / "x.bin")
    assert prepare_main(["--tokenizer", directory, "--out", str(tmp_path / "y.csv"), *paths]) == 2


def test_prepare_writes_megatrons_indexed_dataset(tmp_path, tokenizer_dir):
    """--output-prefix: Megatron-Core's own reader finds one document per text file and per
    JSON line, each the tokenizer's ids and the EOS, under Megatron's file names; two JSON
    keys make two datasets; the driver reads them."""
    import json
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    directory, bpe = tokenizer_dir
    paths, texts = _documents(tmp_path)
    lines = [{"text": t[:200], "title": t[200:230]} for t in texts + ("a short one",)]
    jsonl = str(tmp_path / "web.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(line) for line in lines) + "\n\n")
    eos = bpe.token_to_id(EOS)
    encode = lambda t: np.asarray(bpe.encode(t).ids + [eos])  # noqa: E731
    prefix = str(tmp_path / "out" / "corpus")
    os.makedirs(os.path.dirname(prefix))
    argv = ["--tokenizer", directory, "--output-prefix", prefix, "--append-eod"]
    assert prepare_main([*argv, *paths, jsonl]) == 0
    theirs = megatron.IndexedDataset(prefix + "_text_document")
    want = [encode(t) for t in texts] + [encode(line["text"]) for line in lines]
    assert len(theirs) == len(want) == 5
    for i, doc in enumerate(want):
        assert np.array_equal(theirs[i].astype(np.int64), doc)
    assert theirs.index.dtype == np.uint16  # Megatron's choice for 300 ids
    assert data.build_corpus(prefix + "_text_document", 16).vocab_size <= 300
    assert prepare_main([*argv[:-1], jsonl, "--json-keys", "text", "title"]) == 0
    titles = megatron.IndexedDataset(prefix + "_title_document")
    for i, line in enumerate(lines):
        assert np.array_equal(titles[i].astype(np.int64), encode(line["title"]))
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp" in n]
    with open(jsonl, "a", encoding="utf-8") as f:
        f.write('{"body": "no text key"}\n')
    with pytest.raises(DataError, match=r"web.jsonl line 5 has no string under 'text'"):
        data_out = str(tmp_path / "x.npy")
        prepare([jsonl], directory, data_out)
    assert not os.path.exists(data_out)
    assert prepare_main([*argv[:-1], *paths, "--json-keys", "text", "title"]) == 2
    with pytest.raises(SystemExit):
        prepare_main([*argv, "--no-eos", *paths])


def test_tokenize_train_export_and_generate_offline(tmp_path, tokenizer_dir):
    """prepare -> train a Llama-style model 4 steps on the ids -> export --format hf ->
    transformers loads it with the tokenizer and generates; its first-batch loss from the
    exported weights equals ours."""
    directory, bpe = tokenizer_dir
    paths, _ = _documents(tmp_path)
    tokens = str(tmp_path / "train.bin")
    prepare(paths, directory, tokens)
    model = GPTConfig(n_layers=2, n_heads=4, n_kv_heads=2, dim=32, block_size=32,
                      normalization="rmsnorm", swiglu=True, position_embedding="rope",
                      bias=False, tie_embeddings=False)  # fmt: skip
    ckpt = str(tmp_path / "ckpt")
    cfg = _cfg(steps=4, global_batch=4, model=model, data=tokens, vocab_size=300,
               checkpoint_dir=ckpt)  # fmt: skip
    result = train(cfg.with_layout(1))
    out = str(tmp_path / "hf")
    assert export_main([os.path.join(ckpt, "step-00000004"), out, "--format", "hf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    prompt = tok("def train(", return_tensors="pt")
    torch.manual_seed(SEED)
    generated = hf.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    print("generated:", repr(tok.decode(generated[0])))
    # the exported model's loss on a batch of the run's data equals our model's
    sampler = data.Sampler(data.build_corpus(tokens, 32, 300), 32, 4, SEED)
    inputs, targets = sampler.batch(0, 0, 4)
    with torch.no_grad():
        logits = hf(inputs).logits[..., :300]  # the padding ids' columns: the vocab is 320
        theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert hf.config.vocab_size == 320 and result.records
    config, _, state = consolidate(os.path.join(ckpt, "step-00000004"))
    gpt = GPT(config)
    gpt.load_state_dict(state)
    with torch.no_grad():
        ours = torch.nn.functional.cross_entropy(
            gpt(inputs)[..., :300].flatten(0, 1), targets.flatten()
        )
    assert theirs.item() == pytest.approx(ours.item(), rel=1e-5)
