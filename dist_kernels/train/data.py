"""A corpus built locally (no downloads) and a layout-independent sampler.

The corpus is a text file the user names (characters are the tokens), or else this package's
own Python sources and, in a source checkout, its ``docs/`` and README: a few hundred
kilobytes of English and code, enough for a small model's loss to fall visibly in a few
hundred steps. Or it is a file of token ids a tokenizer wrote beforehand (:class:`TokenCorpus`):
``.bin``, raw little-endian uint16 (nanoGPT's ``prepare.py`` format), ``.npy``, any integer
array, or Megatron's indexed dataset (``PREFIX`` naming ``PREFIX.bin`` and ``PREFIX.idx``, the
dtype read from the index: ``indexed.py``); it is memory-mapped, so its size is the disk's
business, not the ranks' memory.

Sampling is a pure function of ``(seed, step)``: step ``t`` draws ``global_batch`` window
offsets from a generator seeded with ``seed`` and ``t``, and replica ``d`` takes the slice
``[d * per_replica, (d + 1) * per_replica)`` of them, micro-batch ``k`` the ``k``-th
``micro_batch`` of that slice::

    step t offsets:  | replica 0: mb0 mb1 | replica 1: mb0 mb1 |     (dp=2, grad_accum=2)

So the samples of a step do not depend on the layout: a run resumed on another ``dp`` (same
global batch) sees the same data, and the position in the data is the number of global samples
already consumed, ``step x global_batch``.

A blend of token files (:class:`BlendedCorpus`, Megatron's ``--data-path 0.3 a 0.7 b``) draws,
from the same generator, each sample's file with the normalised weights, then its offset in
that file: still a function of ``(seed, step)``.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .indexed import DataError, IndexedTokens, indexed_prefix, read_indexed

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MIN_CHARS = 1024


def default_sources() -> List[str]:
    """The files of the default corpus, in a fixed order: the package's own Python sources.

    Only what ships inside the package: an installed copy and a source checkout then build the
    same corpus, so runs and checkpoints agree whichever copy a rank imports (the checkout's
    docs, absent from an installed copy, once made the two disagree).
    """
    return sorted(glob.glob(os.path.join(_PACKAGE_DIR, "**", "*.py"), recursive=True))


def read_text(path: Optional[str]) -> Tuple[str, str]:
    """``(text, description)`` of the corpus: ``path``, or the default sources."""
    if path is not None:
        if not os.path.isfile(path):
            raise DataError(f"data: {path!r} does not exist or is not a file")
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(), path
    files = default_sources()
    parts = []
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n".join(parts), f"{len(files)} files of dist_kernels' own sources"


@dataclass
class CharCorpus:
    """The corpus as token ids, with its vocabulary (sorted distinct characters)."""

    tokens: torch.Tensor  # int64 [n]
    vocab: str
    description: str

    @classmethod
    def build(cls, path: Optional[str], seq_len: int) -> CharCorpus:
        text, description = read_text(path)
        if len(text) < max(_MIN_CHARS, seq_len + 2):
            raise DataError(
                f"data: {description} has {len(text)} characters; need at least "
                f"{max(_MIN_CHARS, seq_len + 2)} for seq_len({seq_len})"
            )
        vocab = "".join(sorted(set(text)))
        table = {c: i for i, c in enumerate(vocab)}
        tokens = torch.tensor([table[c] for c in text], dtype=torch.int64)
        return cls(tokens, vocab, description)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def fingerprint(self) -> str:
        """Identifies the corpus in checkpoints (resuming on other data is refused)."""
        digest = hashlib.sha256(self.vocab.encode())
        digest.update(str(self.tokens.numel()).encode())
        return digest.hexdigest()[:16]


TOKEN_SUFFIXES = (".bin", ".npy")
_FINGERPRINT_EDGE = 1 << 16  # tokens hashed at each end of a token file


def is_token_file(path: str) -> bool:
    """Whether ``path`` names token ids (a suffix of ``TOKEN_SUFFIXES`` or a Megatron prefix)
    rather than text."""
    return path.endswith(TOKEN_SUFFIXES) or indexed_prefix(path) is not None


def _load_tokens(path: str) -> Tuple[np.ndarray, Optional[IndexedTokens]]:
    """The ids of a token file, memory-mapped, and its Megatron index if it has one."""
    prefix = indexed_prefix(path)
    if prefix is not None:  # before .bin: the index says the dtype (int32 above 65,500 ids)
        indexed = read_indexed(prefix)
        return indexed.tokens, indexed
    if not os.path.isfile(path):
        raise DataError(f"data: {path!r} does not exist or is not a file")
    try:
        if path.endswith(".npy"):
            return np.load(path, mmap_mode="r"), None
        return np.memmap(path, dtype="<u2", mode="r"), None
    except (OSError, ValueError) as e:
        raise DataError(f"data: cannot read tokens from {path}: {e}") from None


@dataclass
class TokenCorpus:
    """A file of token ids (``TOKEN_SUFFIXES`` or a Megatron prefix), memory-mapped, and its
    vocabulary size."""

    tokens: np.ndarray  # [n], any integer dtype, memory-mapped
    vocab_size: int
    description: str
    document_starts: Optional[np.ndarray] = None  # a Megatron index's: each document's offset

    @classmethod
    def build(cls, path: str, seq_len: int, vocab_size: int = 0) -> TokenCorpus:
        """``vocab_size`` 0: the largest id + 1 (read once); else every id must be below it."""
        tokens, indexed = _load_tokens(path)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(
                f"data: {path} holds {tokens.dtype} of shape {tokens.shape}; token ids are a "
                "1-D integer array"
            )
        if len(tokens) < seq_len + 2:
            raise DataError(
                f"data: {path} has {len(tokens)} tokens; need at least {seq_len + 2} for "
                f"seq_len({seq_len})"
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or (vocab_size and high >= vocab_size):
            raise DataError(
                f"data: {path} holds token ids in [{low}, {high}], outside [0, "
                f"vocab_size({vocab_size or high + 1}))"
            )
        if indexed is None:
            return cls(tokens, vocab_size or high + 1, f"{path} ({len(tokens)} tokens)")
        described = (
            f"{indexed.prefix} (Megatron indexed dataset: {len(tokens)} {tokens.dtype.name} "
            f"tokens, {indexed.n_documents} documents)"
        )
        return cls(tokens, vocab_size or high + 1, described, indexed.document_starts)

    def fingerprint(self) -> str:
        """Identifies the corpus in checkpoints: its size, vocabulary and both ends."""
        digest = hashlib.sha256(f"{len(self.tokens)}:{self.vocab_size}".encode())
        for part in (self.tokens[:_FINGERPRINT_EDGE], self.tokens[-_FINGERPRINT_EDGE:]):
            digest.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]


def build_corpus(path: Optional[str], seq_len: int, vocab_size: int = 0) -> Corpus:
    """A :class:`TokenCorpus` for a token file (by its suffix), else a :class:`CharCorpus`."""
    if path is not None and is_token_file(path):
        return TokenCorpus.build(path, seq_len, vocab_size)
    if vocab_size:
        raise DataError(
            f"data: vocab_size({vocab_size}) is for files of token ids "
            f"({', '.join(TOKEN_SUFFIXES)}, a Megatron prefix); a text corpus's vocabulary is "
            "its characters"
        )
    return CharCorpus.build(path, seq_len)


@dataclass
class BlendedCorpus:
    """Token files sampled in proportion to their weights (normalised to sum to 1)."""

    parts: List[TokenCorpus]
    weights: List[float]
    vocab_size: int
    description: str

    @classmethod
    def build(cls, blend: Sequence[Tuple[float, str]], seq_len: int, vocab_size: int = 0):
        """``blend``: ``(weight, token file)`` pairs; ``vocab_size`` 0: the largest id of any
        file + 1."""
        if not blend or any(not (w > 0 and math.isfinite(w)) for w, _ in blend):
            raise DataError(f"data: a blend needs positive weights, got {list(blend)}")
        for _, path in blend:
            if not is_token_file(path):
                raise DataError(
                    f"data: {path} in a blend is not a file of token ids "
                    f"({', '.join(TOKEN_SUFFIXES)}, a Megatron prefix): blends are of "
                    "tokenized files"
                )
        parts = [TokenCorpus.build(path, seq_len, vocab_size) for _, path in blend]
        total = sum(w for w, _ in blend)
        weights = [w / total for w, _ in blend]
        vocab = vocab_size or max(p.vocab_size for p in parts)
        described = ", ".join(f"{w:.3g} x {p.description}" for w, p in zip(weights, parts))
        return cls(parts, weights, vocab, f"a blend of {described}")

    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.vocab_size}".encode())
        for w, part in zip(self.weights, self.parts):
            digest.update(f"{w!r}:{part.fingerprint()}".encode())
        return digest.hexdigest()[:16]


Corpus = Union[CharCorpus, TokenCorpus, BlendedCorpus]
Span = Tuple[int, int]


def build_blend(
    path: Optional[str], blend: Sequence[Tuple[float, str]], seq_len: int, vocab_size: int = 0
) -> Corpus:
    """The corpus of ``--data``: one file (:func:`build_corpus`) or a weighted blend."""
    if blend:
        return BlendedCorpus.build(blend, seq_len, vocab_size)
    return build_corpus(path, seq_len, vocab_size)


def _at_document(part: TokenCorpus | CharCorpus, cut: int, below: int) -> int:
    """``cut`` moved to the nearest document start below ``below`` when the corpus knows its
    documents (a Megatron index), so that no document lies on both sides (Megatron splits by
    documents)."""
    n = len(part.tokens)
    starts = getattr(part, "document_starts", None)
    if starts is None or not 0 < cut < n:
        return cut
    inner = starts[(starts > 0) & (starts < below)]
    return int(inner[np.abs(inner - cut).argmin()]) if len(inner) else cut


def _split_one(part, valid_fraction: float, test_fraction: float) -> Tuple[Span, Span, Span]:
    n = len(part.tokens)
    test = n - max(1, round(n * test_fraction)) if test_fraction else n
    valid = test - max(1, round(n * valid_fraction)) if valid_fraction else test
    test = _at_document(part, test, n)
    valid = _at_document(part, min(valid, test), test) if valid_fraction else test
    return (0, valid), (valid, test), (test, n)


def split(corpus: Corpus, valid_fraction: float, test_fraction: float = 0.0):
    """``(train, validation, test)`` spans of token indices, in that order (Megatron's
    ``--split``): the test text is the corpus's last ``test_fraction``, the validation text
    the ``valid_fraction`` before it (whole documents where they are known), so no training
    window overlaps either; a fraction of 0 gives an empty span. A blend: a list of spans
    each, every file split so."""
    if isinstance(corpus, BlendedCorpus):
        spans = [_split_one(p, valid_fraction, test_fraction) for p in corpus.parts]
        return tuple([s[i] for s in spans] for i in range(3))
    return _split_one(corpus, valid_fraction, test_fraction)


class Sampler:
    """Windows of ``seq_len + 1`` characters, chosen by ``(seed, step)`` only, from the tokens
    of ``span`` (default: the whole corpus; a blend: one span per file)."""

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        global_batch: int,
        seed: int,
        span=None,
    ) -> None:
        parts = corpus.parts if isinstance(corpus, BlendedCorpus) else [corpus]
        blended = isinstance(corpus, BlendedCorpus)
        spans = span if blended and span is not None else [span] * len(parts)
        self.parts = []
        for part, part_span in zip(parts, spans):
            lo, hi = part_span if part_span is not None else (0, len(part.tokens))
            if hi - lo < seq_len + 2:
                raise DataError(
                    f"data: tokens [{lo}, {hi}) of {part.description} hold {hi - lo} "
                    f"characters; a window needs {seq_len + 2} (seq_len {seq_len}): a larger "
                    "corpus, valid_fraction or test_fraction"
                )
            self.parts.append(part.tokens[lo:hi])
        self.weights = getattr(corpus, "weights", [1.0])
        self.tokens, self.seq_len = self.parts[0], seq_len
        self.global_batch, self.seed = global_batch, seed

    def step_windows(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(file, offset)`` of each of the ``global_batch`` windows of step ``step`` (the
        file is 0 but in a blend, whose draw of files comes first from the same generator)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if len(self.parts) == 1:  # one corpus: the offsets alone, as before blends existed
            high = len(self.tokens) - self.seq_len - 1
            offsets = torch.randint(0, high, (self.global_batch,), generator=gen)
            return torch.zeros_like(offsets), offsets
        weights = torch.tensor(self.weights, dtype=torch.float64)
        files = torch.multinomial(weights, self.global_batch, replacement=True, generator=gen)
        highs = torch.tensor([len(p) - self.seq_len - 1 for p in self.parts], dtype=torch.float64)
        uniform = torch.rand(self.global_batch, generator=gen, dtype=torch.float64)
        return files, (uniform * highs[files]).long()

    def step_offsets(self, step: int) -> torch.Tensor:
        """The ``global_batch`` window offsets of optimizer step ``step`` (in their files)."""
        return self.step_windows(step)[1]

    def batch(self, step: int, first: int, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets ``[count, seq_len]`` of samples
        ``first .. first + count`` of step ``step``."""
        files, offsets = (t[first : first + count] for t in self.step_windows(step))
        span = torch.arange(self.seq_len + 1)
        rows = []
        for f in files.unique().tolist():  # each file's windows (one file unless a blend)
            mine = (files == f).nonzero().flatten()
            index = offsets[mine][:, None] + span[None, :]
            tokens = self.parts[f]
            if isinstance(tokens, torch.Tensor):
                windows = tokens[index]
            else:  # a token file: only these windows are read from the mapping
                windows = torch.from_numpy(tokens[index.numpy()].astype(np.int64))
            rows.append((mine, windows))
        out = torch.empty(count, self.seq_len + 1, dtype=rows[0][1].dtype)
        for mine, windows in rows:
            out[mine] = windows
        return out[:, :-1].contiguous(), out[:, 1:].contiguous()

    def replica_batch(
        self, step: int, dp_rank: int, per_replica: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """All samples of replica ``dp_rank`` in step ``step`` (its micro-batches, in order)."""
        return self.batch(step, dp_rank * per_replica, per_replica)
