"""``--data PREFIX``: Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and
written here, checked both ways against Megatron-Core's own ``IndexedDataset`` and
``IndexedDatasetBuilder``; the driver trains on it as on the same ids in a ``.npy``."""

import dataclasses
import os
import struct
import warnings

import numpy as np
import pytest
import torch
from test_train import SEED, _cfg

from dist_kernels.train import data, indexed, train
from dist_kernels.train.cli import build_parser, config_from_args
from dist_kernels.train.data import DataError

with warnings.catch_warnings():  # Megatron-Core warns that Apex / Transformer Engine are absent
    warnings.simplefilter("ignore")
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _documents(high: int, lengths=(300, 3, 1200, 1, 700)):
    """Random documents of ids below ``high``; the seed is printed."""
    print(f"seed {SEED}, ids below {high}")
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, high, size=n) for n in lengths]


def _megatron_writes(prefix: str, docs, dtype) -> None:
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype,high", [(np.uint16, 50_000), (np.int32, 128_256)])
def test_megatrons_files_read_as_their_ids_and_documents(tmp_path, dtype, high):
    """Written by Megatron's builder: the corpus is the documents' ids back to back (an int32
    corpus too, which a raw uint16 read would turn into pairs of wrong ids), by any of the
    three names, with Megatron's document boundaries."""
    docs = _documents(high)
    prefix = str(tmp_path / "web_text_document")
    _megatron_writes(prefix, docs, dtype)
    want = np.concatenate(docs)
    theirs = megatron.IndexedDataset(prefix)
    starts = np.concatenate([[0], np.cumsum(theirs.sequence_lengths)])[theirs.document_indices]
    for name in (prefix, prefix + ".bin", prefix + ".idx"):
        corpus = data.build_corpus(name, seq_len=16)
        assert corpus.tokens.dtype == dtype
        assert np.array_equal(np.asarray(corpus.tokens, dtype=np.int64), want)
        assert np.array_equal(corpus.document_starts, starts)
        assert corpus.vocab_size == int(want.max()) + 1
        assert "5 documents" in corpus.description
    if dtype == np.int32:  # what the nanoGPT reading would have made of it
        assert not np.array_equal(np.fromfile(prefix + ".bin", dtype="<u2")[: len(want)], want)
    window = data.Sampler(data.build_corpus(prefix, 16), 16, 4, SEED)
    files, offsets = window.step_windows(0)
    inputs, targets = window.batch(0, 0, 4)
    for row, o in enumerate(offsets.tolist()):
        assert torch.equal(inputs[row], torch.from_numpy(want[o : o + 16].astype(np.int64)))
        assert torch.equal(targets[row], torch.from_numpy(want[o + 1 : o + 17].astype(np.int64)))


@pytest.mark.parametrize("vocab", [32_000, 65_499, 65_500, 151_936])
def test_our_files_read_in_megatron_with_its_dtype(tmp_path, vocab):
    """write_indexed: Megatron's reader returns each document, in the dtype Megatron itself
    picks for the vocabulary; no temporary file is left."""
    docs = _documents(vocab, lengths=(10, 0, 33, 5))
    prefix = str(tmp_path / "ours")
    assert indexed.write_indexed(prefix, docs, vocab) == sum(len(d) for d in docs)
    theirs = megatron.IndexedDataset(prefix)
    assert theirs.index.dtype == megatron.DType.optimal_dtype(vocab)
    assert len(theirs) == len(docs)
    for i, doc in enumerate(docs):
        assert np.array_equal(theirs[i].astype(np.int64), doc)
    assert list(theirs.document_indices) == list(range(len(docs) + 1))
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx"]
    with pytest.raises(DataError, match=r"do not fit a vocabulary of 100"):
        indexed.write_indexed(str(tmp_path / "bad"), [np.array([5, 100])], 100)
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx"]  # nothing half-written


def test_validation_holds_out_whole_documents(tmp_path):
    """With validation, the cut moves to the document start nearest the token cut: no
    document is both trained and validated on. A corpus of one document keeps the token cut."""
    docs = _documents(1000, lengths=(400, 250, 100, 300))  # 1,050 tokens
    prefix = str(tmp_path / "d")
    _megatron_writes(prefix, docs, np.uint16)
    corpus = data.build_corpus(prefix, 16)
    assert data.split(corpus, 0.2) == (
        (0, 750),
        (750, 1050),
        (1050, 1050),
    )  # token cut 840: start 750 nearer
    assert data.split(corpus, 0.05) == (
        (0, 750),
        (750, 1050),
        (1050, 1050),
    )  # 998: 750 is the last start
    assert data.split(corpus, 0.45) == ((0, 650), (650, 1050), (1050, 1050))  # 578: 650 nearer
    # --split 70,20,10: the test cut 945 moves to 750, then the validation cut 735 to the
    # nearest start below it
    assert data.split(corpus, 0.2, 0.1) == ((0, 650), (650, 750), (750, 1050))
    one = str(tmp_path / "one")
    _megatron_writes(one, [np.concatenate(docs)], np.uint16)
    assert data.split(data.build_corpus(one, 16), 0.2) == ((0, 840), (840, 1050), (1050, 1050))
    npy = str(tmp_path / "same.npy")
    np.save(npy, np.concatenate(docs))
    assert data.split(data.build_corpus(npy, 16), 0.2) == ((0, 840), (840, 1050), (1050, 1050))


def test_the_driver_trains_on_a_prefix_as_on_the_same_ids(tmp_path):
    """--data PREFIX (and a blend of prefixes) trains to the same losses, bit for bit, as the
    same ids in .npy files; the command line takes Megatron's names."""
    docs = _documents(90, lengths=(900, 40, 1500))
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    _megatron_writes(a, docs[:2], np.uint16)
    _megatron_writes(b, docs[2:], np.int32)
    a_npy, b_npy = str(tmp_path / "a.npy"), str(tmp_path / "b.npy")
    np.save(a_npy, np.concatenate(docs[:2]))
    np.save(b_npy, docs[2])
    cfg = _cfg(global_batch=4, vocab_size=90, steps=3).with_layout(1)
    losses = lambda c: [r["loss"] for r in train(c).records]  # noqa: E731
    assert losses(dataclasses.replace(cfg, data=a)) == losses(dataclasses.replace(cfg, data=a_npy))
    blend = dict(data=None, data_blend=((0.3, a), (0.7, b)))
    same = dict(data=None, data_blend=((0.3, a_npy), (0.7, b_npy)))
    assert losses(dataclasses.replace(cfg, **blend)) == losses(dataclasses.replace(cfg, **same))
    args = build_parser().parse_args(["--data-path", "0.3", a, "0.7", b, "--vocab-size", "90"])
    assert config_from_args(args).data_blend == ((0.3, a), (0.7, b))


def _header(code=8, version=1, n_seq=1, n_doc=2, magic=indexed.MAGIC) -> bytes:
    return struct.pack("<9sQBQQ", magic, version, code, n_seq, n_doc)


def _index_body(lengths, pointers, documents) -> bytes:
    return (
        np.asarray(lengths, "<i4").tobytes()
        + np.asarray(pointers, "<i8").tobytes()
        + np.asarray(documents, "<i8").tobytes()
    )


@pytest.mark.parametrize(
    "index,bin_bytes,message",
    [
        (b"not an index at all, no", 8, r"d.idx is not a Megatron index"),
        (_header(version=2) + _index_body([4], [0], [0, 1]), 8, r"index version 2"),
        (_header(code=7) + _index_body([4], [0], [0, 1]), 16, r"stores float32 values"),
        (_header(code=9) + _index_body([4], [0], [0, 1]), 8, r"stores code 9 values"),
        (_header() + _index_body([4], [0], [0, 1])[:-3], 8, r"truncated or corrupt"),
        (_header() + _index_body([4], [0], [0, 1]) + b"\0", 8, r"multimodal"),
        (_header() + _index_body([4], [0], [0, 1]), 6, r"d.bin holds 6 bytes.* 4 uint16 ids"),
        (
            _header(n_seq=2, n_doc=3) + _index_body([2, 2], [0, 8], [0, 1, 2]),
            8,
            r"sequence 1 starts at byte 8 .* end at byte 4",
        ),
        (_header(n_doc=2) + _index_body([4], [0], [1, 1]), 8, r"document indices must rise"),
    ],
)
def test_a_bad_index_is_refused_naming_the_file(tmp_path, index, bin_bytes, message):
    prefix = str(tmp_path / "d")
    with open(prefix + ".idx", "wb") as f:
        f.write(index)
    with open(prefix + ".bin", "wb") as f:
        f.write(bytes(bin_bytes))
    with pytest.raises(DataError, match=message):
        data.build_corpus(prefix, 1)


def test_a_megatron_multimodal_dataset_is_refused(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16, multimodal=True)
    builder.add_document(torch.arange(40), [40], modes=[0])
    builder.finalize(prefix + ".idx")
    with pytest.raises(DataError, match=r"mm.idx has a mode per sequence"):
        data.build_corpus(prefix, 8)
