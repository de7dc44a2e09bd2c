"""Megatron's indexed dataset: a ``PREFIX.bin`` of token ids and a ``PREFIX.idx`` describing it.

What Megatron-LM's ``tools/preprocess_data.py`` writes and ``--data-path PREFIX`` reads
(``megatron/core/datasets/indexed_dataset.py``), so a corpus tokenized for Megatron trains here
as it is, and one prepared here trains there. The index, all little-endian::

    magic   b"MMIDIDX\\x00\\x00"          9 bytes
    version uint64 = 1
    dtype   uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count S uint64, document count D uint64
    int32[S] sequence lengths (tokens), int64[S] sequence byte offsets in .bin,
    int64[D] document indices: the sequence index each document starts at, then S

and the ``.bin`` is the sequences' ids back to back in that dtype (uint16 below 65,500 ids,
int32 above: Megatron's choice). The dtype lives only in the index: read as nanoGPT's raw uint16,
an int32 corpus would silently become pairs of wrong ids, so a ``.bin`` beside a ``.idx`` is
always read through the index.

The training sampler reads the ``.bin`` as one stream of tokens (Megatron's GPT dataset also
concatenates documents, their separators being the end-of-document ids the preprocessing
appended); the document starts are kept for the train / validation cut.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

__all__ = [
    "DataError",
    "IndexedTokens",
    "indexed_prefix",
    "read_indexed",
    "write_indexed",
    "optimal_dtype",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODES = {np.dtype(t): code for code, t in _DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
_UINT16_CARDINALITY = 65500  # below it Megatron writes uint16, else int32


class DataError(ValueError):
    """A corpus cannot be read or is too small for the sequence length (``data.DataError``:
    defined here, the lowest of the data modules, so that no import goes upward)."""


def optimal_dtype(vocab_size: int) -> type:
    """The dtype Megatron stores ids of a ``vocab_size`` vocabulary in."""
    return np.uint16 if vocab_size < _UINT16_CARDINALITY else np.int32


def indexed_prefix(path: str) -> Optional[str]:
    """The Megatron prefix ``path`` names (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` with
    both files present), else ``None``."""
    prefix = path[: -len(".bin")] if path.endswith((".bin", ".idx")) else path
    if os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
        return prefix
    return None


@dataclass
class IndexedTokens:
    """A Megatron indexed dataset: its ids as one memory-mapped stream, and its documents."""

    prefix: str
    tokens: np.ndarray  # [n] in the file's dtype, memory-mapped
    sequence_lengths: np.ndarray  # int32 [S]
    document_starts: np.ndarray  # int64 [D]: the token offset each document starts at, then n

    @property
    def n_documents(self) -> int:
        return len(self.document_starts) - 1


def read_indexed(prefix: str) -> IndexedTokens:
    """Reads ``prefix``'s index and maps its ``.bin``; a ``DataError`` naming the file for
    anything that is not a well-formed text dataset."""
    idx = prefix + ".idx"
    try:  # mapped, not read: a corpus of 10^8 documents has an index of gigabytes
        raw = np.memmap(idx, dtype=np.uint8, mode="r") if os.path.getsize(idx) else np.zeros(0)
    except (OSError, ValueError) as e:
        raise DataError(f"data: cannot read {idx}: {e}") from None
    if len(raw) < _HEADER.size or bytes(raw[:9]) != MAGIC:
        raise DataError(
            f"data: {idx} is not a Megatron index: it does not start with {MAGIC!r} (a file "
            "of python -m dist_kernels.train.prepare --output-prefix or Megatron's "
            "preprocess_data.py)"
        )
    _, version, code, n_seq, n_doc = _HEADER.unpack(bytes(raw[: _HEADER.size]))
    if version != VERSION:
        raise DataError(f"data: {idx} is index version {version}; this reader knows {VERSION}")
    if code not in _DTYPES or np.dtype(_DTYPES[code]).kind == "f":
        name = np.dtype(_DTYPES[code]).name if code in _DTYPES else f"code {code}"
        raise DataError(f"data: {idx} stores {name} values; token ids are integers")
    dtype = np.dtype(_DTYPES[code])
    body = 4 * n_seq + 8 * n_seq + 8 * n_doc
    extra = len(raw) - _HEADER.size - body
    if extra == n_seq and n_seq:
        raise DataError(f"data: {idx} has a mode per sequence (a multimodal dataset); not text")
    if extra != 0:
        raise DataError(
            f"data: {idx} holds {len(raw)} bytes where {n_seq} sequences and {n_doc} document "
            f"indices take {_HEADER.size + body}: truncated or corrupt"
        )
    at = _HEADER.size
    lengths = raw[at : at + 4 * n_seq].view("<i4")
    pointers = raw[at + 4 * n_seq : at + 12 * n_seq].view("<i8")
    documents = raw[at + 12 * n_seq : at + body].view("<i8")
    _check_layout(idx, dtype, lengths, pointers, documents)
    tokens = _map_bin(prefix + ".bin", dtype, int(lengths.sum(dtype=np.int64)))
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])[documents]
    return IndexedTokens(prefix, tokens, np.array(lengths, dtype=np.int32), starts)


def _check_layout(idx, dtype, lengths, pointers, documents) -> None:
    """Sequences back to back in order (the stream the sampler reads), documents ordered."""
    if (lengths < 0).any():
        raise DataError(f"data: {idx} has a negative sequence length")
    expected = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dtype.itemsize
    if len(lengths) and not np.array_equal(pointers, expected[: len(lengths)]):
        first = int(np.flatnonzero(pointers != expected[: len(lengths)])[0])
        raise DataError(
            f"data: {idx}: sequence {first} starts at byte {int(pointers[first])} of the .bin "
            f"where the sequences before it end at byte {int(expected[first])}; only datasets "
            "whose sequences lie back to back can be read as a token stream"
        )
    ordered = len(documents) >= 1 and documents[0] == 0 and documents[-1] == len(lengths)
    if not ordered or (np.diff(documents) < 0).any():
        raise DataError(
            f"data: {idx}: the document indices must rise from 0 to the sequence count "
            f"({len(lengths)}); got {documents[:4].tolist()} ... {documents[-2:].tolist()}"
        )


def _map_bin(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise DataError(f"data: cannot read {path}: {e}") from None
    if size != count * dtype.itemsize:
        raise DataError(
            f"data: {path} holds {size} bytes; its index describes {count} {dtype.name} ids "
            f"({count * dtype.itemsize} bytes): truncated, or the .bin of another index"
        )
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", shape=(count,))


def write_indexed(prefix: str, documents: Iterable[np.ndarray], vocab_size: int) -> int:
    """Writes ``documents`` (one id array each, one sequence per document, as Megatron's
    preprocessing writes a document it does not split into sentences) as ``prefix.bin`` and
    ``prefix.idx``; returns the token count. Both files are written under temporary names and
    renamed, the index last, so a reader never finds an index without its whole ``.bin``."""
    dtype = np.dtype(optimal_dtype(vocab_size)).newbyteorder("<")
    paths = {ext: f"{prefix}.tmp{os.getpid()}{ext}" for ext in (".bin", ".idx")}
    lengths = []
    try:
        with open(paths[".bin"], "wb") as out:
            for doc in documents:
                ids = np.asarray(doc)
                if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                    raise DataError(
                        f"prepare: ids in [{int(ids.min())}, {int(ids.max())}] do not fit a "
                        f"vocabulary of {vocab_size}"
                    )
                out.write(ids.astype(dtype).tobytes())
                lengths.append(ids.size)
        _write_index(paths[".idx"], dtype, np.asarray(lengths, dtype=np.int64))
        os.replace(paths[".bin"], prefix + ".bin")
        os.replace(paths[".idx"], prefix + ".idx")
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.remove(path)
    return int(sum(lengths))


def _write_index(path: str, dtype: np.dtype, lengths: np.ndarray) -> None:
    n = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype("<i8") * dtype.itemsize
    with open(path, "wb") as out:
        out.write(_HEADER.pack(MAGIC, VERSION, _CODES[np.dtype(dtype.type)], n, n + 1))
        out.write(lengths.astype("<i4").tobytes())
        out.write(pointers[:n].astype("<i8").tobytes())
        out.write(np.arange(n + 1, dtype="<i8").tobytes())
