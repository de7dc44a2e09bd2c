"""Megatron-LM's command line, as far as it has a counterpart here: a ``pretrain_gpt.py``
invocation runs as written. Plain aliases sit on the driver's own flags (``--num-layers`` on
``--n-layer``, ...; ``cli.py``); this module adds the spellings that mean something else here
or several things (:func:`add_megatron_spellings`) and turns them into the driver's flags
(:func:`from_megatron`), refusing, with the reason, what contradicts a flag of ours or has no
counterpart."""

from __future__ import annotations

import argparse
import ast
import json
import os
from typing import Tuple

from .config import ConfigError, TrainConfig


def add_megatron_spellings(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags that are not plain aliases of ours (those are on the flags
    themselves: --num-layers, --hidden-size, --micro-batch-size, --train-iters, ...), so that
    a pretrain_gpt.py command line runs here; :func:`from_megatron` turns them into ours."""
    g = p.add_argument_group("Megatron-LM's spellings (translated to the flags above)")
    add = g.add_argument
    add("--num-experts", type=int, default=None, help="--experts N with --moe-every 1")
    add(
        "--moe-layer-freq",
        default=None,
        metavar="N|PATTERN",
        help="MoE blocks: N, blocks 0, N, 2N, ...; or a pattern of one 1 (MoE) or 0 per block, "
        "'([0]*3+[1]*29)' (Megatron's)",
    )
    add(
        "--tokenizer-type",
        choices=(*_TOKENIZER_SIZE_FROM, *_TOKENIZERS_REFUSED),
        default=None,
        help="the vocabulary's size from the tokenizer's files (the data: token ids)",
    )
    add("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    add("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    add("--tokenizer-model", default=None, help="HuggingFaceTokenizer's local directory")
    add("--bf16", dest="dtype", action="store_const", const="bf16", help="--dtype bf16")
    add("--fp16", dest="dtype", action="store_const", const="fp16", help="--dtype fp16")
    add("--min-lr", type=float, default=None, help="--min-lr-ratio MIN_LR / --lr")
    add(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="--warmup as this fraction of the decay horizon",
    )
    add("--save", default=None, metavar="DIR", help="--checkpoint-dir DIR")
    add("--load", default=None, metavar="DIR", help="resume from DIR's newest checkpoint")
    add("--recompute-granularity", choices=("full", "selective"), default=None)
    add("--recompute-method", choices=("uniform", "block"), default=None)
    add("--recompute-num-layers", type=int, default=None)
    add("--use-distributed-optimizer", action="store_true", help="--zero 1")
    add("--hidden-dropout", type=float, default=None, help="--dropout (Megatron: 0.1 by default)")
    add("--init-method-std", type=float, default=None, help="the weights' initial std")
    add("--group-query-attention", action="store_true", help="--num-query-groups (default 1)")
    add("--max-position-embeddings", type=int, default=None, help="the model's positions")
    add(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="the driver's default (Megatron ties them unless given; here --tie-embeddings)",
    )


def from_megatron(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with Megatron-LM's spellings turned into the driver's flags; a ConfigError
    where one contradicts a flag of ours or has no counterpart."""
    out = argparse.Namespace(**vars(args))
    d = TrainConfig()
    out.moe_every = args.moe_every
    if args.num_experts is not None:
        if args.experts and args.experts != args.num_experts:
            raise ConfigError(f"--num-experts {args.num_experts} and --experts {args.experts}")
        out.experts = args.num_experts
        out.moe_every = 1 if args.moe_every is None else args.moe_every  # every layer, as there
    if out.moe_every is None:
        out.moe_every = 2
    out.moe_layers = None
    if args.moe_layer_freq is not None:
        if args.moe_every is not None:
            raise ConfigError("--moe-layer-freq and --moe-every both place the MoE blocks")
        out.moe_layers = moe_layer_pattern(args.moe_layer_freq, args.n_layer)
    if args.untie_embeddings_and_output_weights and args.tie_embeddings:
        raise ConfigError("--untie-embeddings-and-output-weights and --tie-embeddings: give one")
    if args.min_lr is not None:
        if args.min_lr_ratio != d.min_lr_ratio:
            raise ConfigError("--min-lr and --min-lr-ratio both set the final rate: give one")
        out.min_lr_ratio = args.min_lr / args.lr
    if args.lr_warmup_fraction is not None:
        if args.warmup != d.warmup:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters / --warmup: give one")
        out.warmup = round(args.lr_warmup_fraction * (args.lr_decay_steps or args.steps))
    out.vocab_size = tokenizer_vocab_size(args)
    _checkpoint_dirs(args, out)
    _recompute(args, out)
    if args.use_distributed_optimizer and not args.zero:
        out.zero = 1  # optimizer state sharded over the data-parallel ranks
    if args.hidden_dropout is not None:
        if args.dropout is not None and args.dropout != args.hidden_dropout:
            raise ConfigError(
                f"--dropout {args.dropout} and --hidden-dropout {args.hidden_dropout}: give one"
            )
        out.dropout = args.hidden_dropout
    if args.group_query_attention and args.num_query_groups is None:
        out.num_query_groups = 1  # Megatron's default number of groups
    max_pos = args.max_position_embeddings
    if max_pos is not None and max_pos != args.seq_len and args.position_embedding_type != "rope":
        raise ConfigError(
            f"--max-position-embeddings {max_pos} with learned positions: the table here has "
            f"--seq-length ({args.seq_len}) rows"
        )
    return out


def moe_layer_pattern(text: str, n_layers: int) -> Tuple[int, ...]:
    """Megatron's ``--moe-layer-freq``: an int N (blocks 0, N, 2N, ... are MoE blocks) or a
    Python list expression of one 1 (MoE) or 0 (dense) per block, ``([0]*3+[1]*29)``, read as
    data (lists of ints, ``+`` and ``*`` only; nothing is executed)."""
    text = text.strip()
    if "[" not in text:
        try:
            every = int(text)
        except ValueError:
            raise ConfigError(f"--moe-layer-freq {text!r}: an int or a list pattern") from None
        if every < 1:
            raise ConfigError(f"--moe-layer-freq {every}: must be >= 1")
        return tuple(int(i % every == 0) for i in range(n_layers))
    try:
        pattern = _pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as e:
        raise ConfigError(f"--moe-layer-freq {text!r}: not a list pattern ({e})") from None
    if not isinstance(pattern, list) or len(pattern) != n_layers or set(pattern) - {0, 1}:
        raise ConfigError(
            f"--moe-layer-freq {text!r} gives {pattern}: one 0 or 1 per block, "
            f"--num-layers {n_layers} in all"
        )
    return tuple(pattern)


def _pattern_value(node: ast.AST):
    """The value of a list-pattern expression's node: int and list literals, ``+``, ``*``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if max(len(v) if isinstance(v, list) else v for v in (left, right)) > 1 << 20:
            raise ValueError("too long for a pattern of blocks")  # ([1]*10**12 needs no RAM)
        return left * right
    raise ValueError(f"{ast.dump(node)[:40]} is not allowed")


# Megatron's --tokenizer-type values whose vocabulary size is read here from their files
_TOKENIZER_SIZE_FROM = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
# ... and those whose files need a library not required here: give --vocab-size
_TOKENIZERS_REFUSED = (
    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer",
)  # fmt: skip


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary's size Megatron's tokenizer flags give (its tokenizer's ``vocab_size``),
    or ``--vocab-size`` without them. The data here is token ids already (``prepare`` writes
    them), so the tokenizer is read for its size alone: GPT2BPETokenizer's ``vocab.json``
    entries; HuggingFaceTokenizer's ``len()`` of a local directory (nothing is downloaded);
    NullTokenizer's ``--vocab-size`` ids plus its end-of-document id."""
    kind, given = args.tokenizer_type, args.vocab_size
    files = {"--vocab-file": args.vocab_file, "--merge-file": args.merge_file,
             "--tokenizer-model": args.tokenizer_model}  # fmt: skip
    if kind is None:
        named = [flag for flag, value in files.items() if value is not None]
        if named:
            raise ConfigError(f"{', '.join(named)} without --tokenizer-type")
        return given
    if kind in _TOKENIZERS_REFUSED:
        raise ConfigError(
            f"--tokenizer-type {kind}: its model file needs a library this package does not "
            "require; give --vocab-size N (its vocabulary's size) instead"
        )
    if kind == "NullTokenizer":
        if not given:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return given + 1  # ids 0..N-1 and its end-of-document id N
    size = _gpt2_bpe_size(args) if kind == "GPT2BPETokenizer" else _hf_tokenizer_size(args)
    if given and given != size:
        raise ConfigError(f"--vocab-size {given}, but the --tokenizer-type {kind} has {size}")
    return size


def _gpt2_bpe_size(args: argparse.Namespace) -> int:
    if args.vocab_file is None or args.merge_file is None:
        raise ConfigError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if not os.path.isfile(args.merge_file):
        raise ConfigError(f"--merge-file {args.merge_file}: no such file")
    try:
        with open(args.vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--vocab-file {args.vocab_file}: {e}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ConfigError(f"--vocab-file {args.vocab_file}: not a token -> id JSON object")
    return len(vocab)


def _hf_tokenizer_size(args: argparse.Namespace) -> int:
    path = args.tokenizer_model
    if path is None or not os.path.isdir(path):
        raise ConfigError(
            f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR, a local "
            f"directory (nothing is downloaded); got {path!r}"
        )
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (ImportError, OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer-model {path}: {e}") from None


def _checkpoint_dirs(args: argparse.Namespace, out: argparse.Namespace) -> None:
    """--save DIR as --checkpoint-dir; --load DIR as --resume from DIR's newest checkpoint
    (``auto`` when it is the --save directory; nothing there: a fresh start, as Megatron)."""
    from .checkpoints import newest_complete

    if args.save is not None:
        if args.checkpoint_dir not in (None, args.save):
            raise ConfigError("--save and --checkpoint-dir name different directories")
        out.checkpoint_dir = args.save
    if args.load is None:
        return
    if args.resume is not None:
        raise ConfigError("--load and --resume both say what to resume: give one")
    if out.checkpoint_dir in (None, args.load):
        out.checkpoint_dir, out.resume = args.load, "auto"
    else:
        out.resume = newest_complete(args.load)


def _recompute(args: argparse.Namespace, out: argparse.Namespace) -> None:
    """Megatron's full recompute of every layer is --recompute; other settings have none."""
    if args.recompute_granularity is None:
        if args.recompute_method or args.recompute_num_layers:
            raise ConfigError(
                "--recompute-method / --recompute-num-layers need --recompute-granularity"
            )
        return
    if args.recompute_granularity == "selective":
        raise ConfigError(
            "--recompute-granularity selective (the attention's core only) has no counterpart "
            "here: --recompute-granularity full recomputes every block"
        )
    method, layers = args.recompute_method or "uniform", args.recompute_num_layers or 1
    if (method, layers) != ("uniform", 1):
        raise ConfigError(
            f"--recompute-method {method} --recompute-num-layers {layers}: only every block "
            "recomputed on its own (uniform, 1) has a counterpart here"
        )
    out.recompute = True
