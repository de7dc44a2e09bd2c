"""Text files to token ids for ``--data``, with a local Hugging Face tokenizer:

    python -m dist_kernels.train.prepare --tokenizer tok/ --out train.bin corpus/*.txt
    python -m dist_kernels.train.prepare --tokenizer tok/ --output-prefix data/web web.jsonl

Each text file is one document; a ``.jsonl`` file (JSON lines, what Megatron's
``preprocess_data.py`` reads) holds one document per line, its text under ``--json-keys``
(default ``text``). Documents are encoded by
``transformers.AutoTokenizer.from_pretrained(tok/, local_files_only=True)`` (nothing is
downloaded; any tokenizer directory on disk: GPT-2's, Llama's, one trained locally) and each is
followed by the tokenizer's end-of-sequence id (``--no-eos``: nothing), as nanoGPT appends
GPT-2's ``<|endoftext|>`` and Megatron's ``--append-eod`` the end-of-document id.

Outputs:

* ``--out OUT.bin``: raw little-endian uint16 (nanoGPT's format; the vocabulary must fit in
  65,536 ids); ``--out OUT.npy``: a 1-D int32 array;
* ``--output-prefix P``: Megatron's indexed dataset, ``P_{key}_document.bin`` and ``.idx`` per
  JSON key (``P_text_document`` for text files), named as ``preprocess_data.py`` names them:
  ``--data P_text_document`` here, ``--data-path P_text_document`` in Megatron.

Files are written under temporary names and renamed, so a failed run leaves no partial file.
The vocabulary size to give the driver (``--vocab-size``) is printed: the tokenizer's, which can
exceed the largest id in the data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .data import DataError
from .indexed import write_indexed

__all__ = ["prepare", "prepare_indexed"]

_UINT16_IDS = 1 << 16


def _tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise DataError(f"prepare: {directory} is not a tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"prepare: cannot load a tokenizer from {directory}: {e}") from None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"prepare: cannot read {path}: {e}") from None


def _is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def documents(texts: Sequence[str], key: str = "text") -> Iterator[str]:
    """The documents of ``texts`` in order: a text file whole, a JSON-lines file's ``key``
    of each line."""
    for path in texts:
        if not _is_jsonl(path):
            yield _read(path)
            continue
        for number, line in enumerate(_read(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"prepare: {path} line {number} is not JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DataError(f"prepare: {path} line {number} has no string under {key!r}")
            yield record[key]


def _encoder(tokenizer_dir: str, eos: bool):
    """``(encode one document to ids, vocabulary size)``."""
    tok = _tokenizer(tokenizer_dir)
    end = tok.eos_token_id if eos else None
    if eos and end is None:
        raise DataError("prepare: the tokenizer has no end-of-sequence token: give --no-eos")
    tail = [end] if end is not None else []

    def encode(text: str) -> np.ndarray:
        return np.asarray(tok(text, add_special_tokens=False)["input_ids"] + tail, np.int64)

    return encode, len(tok)


def prepare(
    texts: Sequence[str], tokenizer_dir: str, out: str, eos: bool = True, json_key: str = "text"
) -> Tuple[int, int]:
    """Encodes ``texts`` (paths) into ``out``; returns ``(tokens written, vocabulary size)``."""
    if not out.endswith((".bin", ".npy")):
        raise DataError(f"prepare: {out} must end in .bin (uint16) or .npy (int32)")
    encode, vocab = _encoder(tokenizer_dir, eos)
    if out.endswith(".bin") and vocab > _UINT16_IDS:
        raise DataError(
            f"prepare: the tokenizer has {vocab} ids; .bin holds uint16 (at most "
            f"{_UINT16_IDS}): write .npy or --output-prefix (Megatron's format)"
        )
    ids: List[np.ndarray] = [encode(text) for text in documents(texts, json_key)]
    tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    tmp = f"{out}.tmp{os.getpid()}{os.path.splitext(out)[1]}"
    try:
        if out.endswith(".bin"):
            tokens.astype("<u2").tofile(tmp)
        else:
            np.save(tmp, tokens.astype(np.int32))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return len(tokens), vocab


def prepare_indexed(
    texts: Sequence[str],
    tokenizer_dir: str,
    output_prefix: str,
    eos: bool = True,
    json_keys: Sequence[str] = ("text",),
) -> Tuple[Dict[str, int], int]:
    """Encodes ``texts`` into Megatron indexed datasets, one per key (text files give the key
    ``text``); returns ``({prefix written: tokens}, vocabulary size)``."""
    if not json_keys:
        raise DataError("prepare: --json-keys names no key")
    if len(json_keys) > 1 and not all(_is_jsonl(p) for p in texts):
        raise DataError("prepare: several --json-keys need .jsonl inputs (a text file has one)")
    encode, vocab = _encoder(tokenizer_dir, eos)
    written = {}
    for key in json_keys:
        prefix = f"{output_prefix}_{key}_document"
        docs = (encode(text) for text in documents(texts, key))
        written[prefix] = write_indexed(prefix, docs, vocab)
    return written, vocab


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dist_kernels.train.prepare",
        description="Encode text files (one document each) or JSON-lines files (one document "
        "per line) with a local Hugging Face tokenizer into token ids for python -m "
        "dist_kernels.train --data.",
    )
    parser.add_argument("texts", nargs="+", help="text files, or .jsonl files")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="OUT.bin (uint16) or OUT.npy (int32)")
    out.add_argument(
        "--output-prefix",
        help="write Megatron's indexed dataset PREFIX_{key}_document.bin / .idx per JSON key",
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="the keys of a .jsonl line to encode"
    )
    parser.add_argument("--no-eos", action="store_true", help="no end-of-sequence id per document")
    parser.add_argument(
        "--append-eod", action="store_true", help="an end-of-sequence id per document (default)"
    )
    args = parser.parse_args(argv)
    if args.no_eos and args.append_eod:
        parser.error("--no-eos and --append-eod contradict each other")
    try:
        if args.out is not None:
            if len(args.json_keys) != 1:
                raise DataError("prepare: --out writes one key; several need --output-prefix")
            count, vocab = prepare(
                args.texts, args.tokenizer, args.out, not args.no_eos, args.json_keys[0]
            )
            written = {args.out: count}
        else:
            written, vocab = prepare_indexed(
                args.texts, args.tokenizer, args.output_prefix, not args.no_eos, args.json_keys
            )
    except DataError as e:
        print(f"dist_kernels.train.prepare: error: {e}", file=sys.stderr)
        return 2
    for name, count in written.items():
        print(f"wrote {name}: {count} tokens of {len(args.texts)} files; train with "
              f"--data {name} --vocab-size {vocab}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
