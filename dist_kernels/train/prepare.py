"""Text files to a file of token ids for ``--data``, with a local Hugging Face tokenizer:

    python -m dist_kernels.train.prepare --tokenizer tok/ --out train.bin corpus/*.txt

nanoGPT's ``prepare.py`` in one command: each file is one document, encoded by
``transformers.AutoTokenizer.from_pretrained(tok/, local_files_only=True)`` (nothing is
downloaded; any tokenizer directory on disk: GPT-2's, Llama's, one trained locally) and followed
by the tokenizer's end-of-sequence id (``--no-eos``: nothing), as nanoGPT appends GPT-2's
``<|endoftext|>``. ``.bin`` writes raw little-endian uint16 (nanoGPT's format; the vocabulary
must fit in 65,536 ids), ``.npy`` a 1-D int32 array. The file is written to a temporary name
and renamed, so a failed run leaves no partial file. The vocabulary size to give the driver
(``--vocab-size``) is printed: the tokenizer's, which can exceed the largest id in the data.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

import numpy as np

from .data import DataError

__all__ = ["prepare"]

_UINT16_IDS = 1 << 16


def _tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise DataError(f"prepare: {directory} is not a tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"prepare: cannot load a tokenizer from {directory}: {e}") from None


def prepare(
    texts: Sequence[str], tokenizer_dir: str, out: str, eos: bool = True
) -> tuple[int, int]:
    """Encodes ``texts`` (paths) into ``out``; returns ``(tokens written, vocabulary size)``."""
    if not out.endswith((".bin", ".npy")):
        raise DataError(f"prepare: {out} must end in .bin (uint16) or .npy (int32)")
    tok = _tokenizer(tokenizer_dir)
    vocab = len(tok)
    if out.endswith(".bin") and vocab > _UINT16_IDS:
        raise DataError(
            f"prepare: the tokenizer has {vocab} ids; .bin holds uint16 (at most "
            f"{_UINT16_IDS}): write .npy"
        )
    end = tok.eos_token_id if eos else None
    if eos and end is None:
        raise DataError("prepare: the tokenizer has no end-of-sequence token: give --no-eos")
    ids: List[np.ndarray] = []
    for path in texts:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"prepare: cannot read {path}: {e}") from None
        doc = tok(text, add_special_tokens=False)["input_ids"] + ([end] if end is not None else [])
        ids.append(np.asarray(doc, dtype=np.int64))
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dist_kernels.train.prepare",
        description="Encode text files with a local Hugging Face tokenizer into a file of "
        "token ids for python -m dist_kernels.train --data (one document per file).",
    )
    parser.add_argument("texts", nargs="+", help="text files, one document each")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory")
    parser.add_argument("--out", required=True, help="OUT.bin (uint16) or OUT.npy (int32)")
    parser.add_argument("--no-eos", action="store_true", help="no end-of-sequence id per file")
    args = parser.parse_args(argv)
    try:
        count, vocab = prepare(args.texts, args.tokenizer, args.out, eos=not args.no_eos)
    except DataError as e:
        print(f"dist_kernels.train.prepare: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {count} tokens of {len(args.texts)} files; train with "
          f"--data {args.out} --vocab-size {vocab}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
