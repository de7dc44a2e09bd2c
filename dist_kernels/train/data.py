"""A corpus built locally (no downloads) and a layout-independent sampler.

The corpus is a text file the user names (characters are the tokens), or else this package's
own Python sources and, in a source checkout, its ``docs/`` and README: a few hundred
kilobytes of English and code, enough for a small model's loss to fall visibly in a few
hundred steps. Or it is a file of token ids a tokenizer wrote beforehand (:class:`TokenCorpus`):
``.bin``, raw little-endian uint16 (nanoGPT's ``prepare.py`` format), or ``.npy``, any integer
array; it is memory-mapped, so its size is the disk's business, not the ranks' memory.

Sampling is a pure function of ``(seed, step)``: step ``t`` draws ``global_batch`` window
offsets from a generator seeded with ``seed`` and ``t``, and replica ``d`` takes the slice
``[d * per_replica, (d + 1) * per_replica)`` of them, micro-batch ``k`` the ``k``-th
``micro_batch`` of that slice::

    step t offsets:  | replica 0: mb0 mb1 | replica 1: mb0 mb1 |     (dp=2, grad_accum=2)

So the samples of a step do not depend on the layout: a run resumed on another ``dp`` (same
global batch) sees the same data, and the position in the data is the number of global samples
already consumed, ``step x global_batch``.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MIN_CHARS = 1024


class DataError(ValueError):
    """The corpus cannot be read or is too small for the sequence length."""


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


@dataclass
class TokenCorpus:
    """A file of token ids (``TOKEN_SUFFIXES``), memory-mapped, and its vocabulary size."""

    tokens: np.ndarray  # [n], any integer dtype, memory-mapped
    vocab_size: int
    description: str

    @classmethod
    def build(cls, path: str, seq_len: int, vocab_size: int = 0) -> TokenCorpus:
        """``vocab_size`` 0: the largest id + 1 (read once); else every id must be below it."""
        if not os.path.isfile(path):
            raise DataError(f"data: {path!r} does not exist or is not a file")
        try:
            if path.endswith(".npy"):
                tokens = np.load(path, mmap_mode="r")
            else:
                tokens = np.memmap(path, dtype="<u2", mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"data: cannot read tokens from {path}: {e}") from None
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
        return cls(tokens, vocab_size or high + 1, f"{path} ({len(tokens)} tokens)")

    def fingerprint(self) -> str:
        """Identifies the corpus in checkpoints: its size, vocabulary and both ends."""
        digest = hashlib.sha256(f"{len(self.tokens)}:{self.vocab_size}".encode())
        for part in (self.tokens[:_FINGERPRINT_EDGE], self.tokens[-_FINGERPRINT_EDGE:]):
            digest.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]


def build_corpus(path: Optional[str], seq_len: int, vocab_size: int = 0) -> Corpus:
    """A :class:`TokenCorpus` for a token file (by its suffix), else a :class:`CharCorpus`."""
    if path is not None and path.endswith(TOKEN_SUFFIXES):
        return TokenCorpus.build(path, seq_len, vocab_size)
    if vocab_size:
        raise DataError(
            f"data: vocab_size({vocab_size}) is for files of token ids "
            f"({', '.join(TOKEN_SUFFIXES)}); a text corpus's vocabulary is its characters"
        )
    return CharCorpus.build(path, seq_len)


Corpus = Union[CharCorpus, TokenCorpus]


def split(corpus: Corpus, valid_fraction: float) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """``(train span, validation span)`` of token indices: the validation text is the
    corpus's last ``valid_fraction``, so no training window overlaps it."""
    n = len(corpus.tokens)
    cut = n - max(1, round(n * valid_fraction))
    return (0, cut), (cut, n)


class Sampler:
    """Windows of ``seq_len + 1`` characters, chosen by ``(seed, step)`` only, from the tokens
    of ``span`` (default: the whole corpus)."""

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        global_batch: int,
        seed: int,
        span: Optional[Tuple[int, int]] = None,
    ) -> None:
        lo, hi = span if span is not None else (0, len(corpus.tokens))
        if hi - lo < seq_len + 2:
            raise DataError(
                f"data: tokens [{lo}, {hi}) of {corpus.description} hold {hi - lo} "
                f"characters; a window needs {seq_len + 2} (seq_len {seq_len}): a larger "
                "corpus or valid_fraction"
            )
        self.tokens, self.seq_len = corpus.tokens[lo:hi], seq_len
        self.global_batch, self.seed = global_batch, seed

    def step_offsets(self, step: int) -> torch.Tensor:
        """The ``global_batch`` window offsets of optimizer step ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = len(self.tokens) - self.seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=gen)

    def batch(self, step: int, first: int, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets ``[count, seq_len]`` of samples
        ``first .. first + count`` of step ``step``."""
        offsets = self.step_offsets(step)[first : first + count]
        index = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]
        if isinstance(self.tokens, torch.Tensor):
            windows = self.tokens[index]
        else:  # a token file: only these windows are read from the mapping
            windows = torch.from_numpy(self.tokens[index.numpy()].astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def replica_batch(
        self, step: int, dp_rank: int, per_replica: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """All samples of replica ``dp_rank`` in step ``step`` (its micro-batches, in order)."""
        return self.batch(step, dp_rank * per_replica, per_replica)
