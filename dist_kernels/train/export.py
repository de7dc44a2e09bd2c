"""One file of unsharded weights from a training checkpoint, whatever its layout:

    python -m dist_kernels.train.export ckpt/step-00000100 model.pt
    python -m dist_kernels.train ... --init-from model.pt    # any layout, any world size

A checkpoint of the driver (``checkpoints.py``) is one directory per pipeline stage, tensor
shard and (without ZeRO) ep rank, each holding its part of the model under the model's own
layer names; ZeRO's directories hold every data-parallel shard, which ``dk.checkpoint`` puts
together. Exporting reads every directory on one process, takes MoE experts from the ep ranks
that held them (``dk.moe.checkpoint``, global ids), joins the tensor-parallel shards along the
dimension they were split (the one where a shard's shape differs from the whole model's,
shards in tp-rank order; a weight every tp rank holds whole must be equal on all of them),
and writes ``{"format", "config", "step", "model"}``: the state dict of
``dist_kernels.models.GPT(GPTConfig(**config))`` under the GPT's names, ready for
``GPT.load_state_dict`` or for ``--init-from`` (Megatron's checkpoint converter and
torchtitan's DCP consolidation do this job for theirs). The optimizer state is not exported: a
run started from the file begins a new optimizer, as Megatron's ``--finetune`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from .. import checkpoint as dk_checkpoint
from ..models import GPT, GPTConfig
from ..moe import checkpoint as moe_checkpoint
from ..tensor_parallel.shard import tied_names
from .checkpoints import read_record
from .config import ConfigError

FORMAT = "dist_kernels.models.GPT"
_SHARD = re.compile(r"^stage-(\d+)(?:-tp-(\d+))?(?:-ep-(\d+))?$")

__all__ = [
    "FORMAT",
    "Consolidated",
    "consolidate",
    "consolidate_training",
    "export",
    "export_hf",
    "load_exported",
]


def _config(record: Dict[str, Any], path: str) -> GPTConfig:
    desc = dict(record["identity"]["model"])
    if desc.pop("kind", None) != FORMAT:
        raise ConfigError(f"export: {path} holds no {FORMAT} (its model is {desc})")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in desc.items() if k in known})


def _shard_dirs(path: str) -> Dict[Tuple[int, int, int], str]:
    """``(stage, tp rank, ep rank) -> directory`` of a step directory."""
    found = {}
    for name in sorted(os.listdir(path)):
        match = _SHARD.match(name)
        if match and os.path.isdir(os.path.join(path, name)):
            stage, tp, ep = (int(g) if g is not None else 0 for g in match.groups())
            found[(stage, tp, ep)] = os.path.join(path, name)
    if not found:
        raise ConfigError(f"export: {path} has no stage-* directories")
    return found


class _Part(NamedTuple):
    """One checkpoint directory's contents under the model's nn.Sequential names."""

    model: Dict[str, torch.Tensor]  # experts by local index unless the run was sharded
    optimizer: Dict[str, Dict[str, Any]]  # per parameter, experts by global id
    options: Dict[str, Dict[str, Any]]  # per parameter: its param group's hyper-parameters
    extra: Dict[str, Any]


def _read_part(directory: str, sharded: bool, known: Set[str], optimizer: bool) -> _Part:
    """A directory of ZeRO's shards (``sharded``) or of one replica's model and torch
    optimizer state dict (``checkpoints.save``)."""
    if sharded:
        state, per_param, options, extra = dk_checkpoint.read_whole(directory, optimizer)
    else:
        state, extra = dk_checkpoint.read_model(directory)
        per_param, options = _torch_optimizer_state(directory, extra) if optimizer else ({}, {})
    return _Part(
        {_model_key(k, known): v for k, v in state.items()},
        {_model_key(k, known): v for k, v in per_param.items()},
        {_model_key(k, known): v for k, v in options.items()},
        extra,
    )


def _torch_optimizer_state(directory: str, extra: Dict[str, Any]):
    """``(state by parameter name, hyper-parameters by parameter name)`` of the torch
    optimizer state dict a replica saved beside its model, named by the saved
    ``param_names``."""
    if "param_names" not in extra or "optimizer" not in extra:
        raise ConfigError(f"{directory} records no optimizer state by parameter name")
    return moe_checkpoint.named_optimizer_state(extra["optimizer"], extra["param_names"])


def _per_tp_rank(
    path: str, sequential: torch.nn.Module, identity: Dict[str, Any], optimizer: bool = False
) -> Tuple[List[_Part], _Part]:
    """For each tp rank, the whole model's state (and optimizer state) as that rank holds it
    (every stage, every expert), under the nn.Sequential's names; and the first directory
    read (its hyper-parameters and ``extra``)."""
    dirs = _shard_dirs(path)
    tp, pp = int(identity["tp"]), int(identity["pp"])
    sharded = bool(identity.get("sharded"))
    ep = 1 if sharded else int(identity.get("ep", 1))
    stages = sorted({s for s, _, _ in dirs})
    if len(stages) != pp or {t for _, t, _ in dirs} != set(range(tp)):
        raise ConfigError(
            f"export: {path} has stages {stages} and tp ranks "
            f"{sorted({t for _, t, _ in dirs})}; its record says pp({pp}), tp({tp})"
        )
    cache: Dict[str, _Part] = {}
    known = set(sequential.state_dict())
    tied = tied_names(sequential)

    def read(key: Tuple[int, int, int]) -> _Part:
        if key not in dirs:
            raise ConfigError(f"export: {path} lacks stage {key[0]}, tp rank {key[1]}, ep {key[2]}")
        if dirs[key] not in cache:
            cache[dirs[key]] = _read_part(dirs[key], sharded, known, optimizer)
        return cache[dirs[key]]

    ranks = []
    for t in range(tp):

        def ep_rank_state(e: int, t: int = t) -> Dict[str, torch.Tensor]:
            merged: Dict[str, torch.Tensor] = {}
            for s in stages:
                merged.update(read((s, t, e)).model)
            return _with_tied(merged, tied)

        model = moe_checkpoint.reshard_state(sequential, ep, ep_rank_state)
        per_param: Dict[str, Dict[str, Any]] = {}
        options: Dict[str, Dict[str, Any]] = {}
        for e in range(ep):  # names by global expert id: each expert from the rank holding it
            for s in stages:
                part = read((s, t, e))
                for name, state in part.optimizer.items():
                    per_param.setdefault(name, state)
                for name, hyper in part.options.items():
                    options.setdefault(name, hyper)
        ranks.append(_Part(model, _with_tied(per_param, tied), _with_tied(options, tied), {}))
    return ranks, read(min(dirs))


def _with_tied(saved: Dict[str, Any], tied: List[List[str]]) -> Dict[str, Any]:
    """``saved`` with every name of a tied parameter present. One process saves the tensor
    (and ZeRO its shards and moments) under one name; a pipeline saves a copy per stage under
    each stage's name (equal: the copies are kept equal)."""
    out = dict(saved)
    for names in tied:
        present = [n for n in names if n in saved]
        for name in names:
            if present and name not in out:
                out[name] = saved[present[0]]
    return out


def _model_key(key: str, known: Set[str]) -> str:
    """A saved key under the model's names: a rank holding several stages (interleaved 1F1B,
    ZB-V, DualPipeV) saved an nn.ModuleList of them, whose index leads each key
    ("1.3.lm_head.weight"); each stage keeps the model's layer names after it."""
    if key in known:
        return key
    tail = key.split(".", 1)[-1]
    return tail if tail in known else key


def _join(name: str, shards: Sequence[torch.Tensor], whole: torch.Size) -> torch.Tensor:
    """The tensor-parallel shards of one tensor, joined where they were split."""
    first = shards[0]
    if first.shape == whole:  # held whole by every tp rank: they must agree
        for t, other in enumerate(shards[1:], 1):
            if not torch.equal(other, first):
                raise ConfigError(
                    f"export: {name} is held whole by every tp rank but tp rank {t}'s copy "
                    "differs from tp rank 0's"
                )
        return first
    split = [d for d, (a, b) in enumerate(zip(first.shape, whole)) if a != b]
    joined = torch.cat(list(shards), dim=split[0]) if len(split) == 1 else None
    if joined is None or joined.shape != whole:
        raise ConfigError(
            f"export: {name}: {len(shards)} tp shards of shape {tuple(first.shape)} do not "
            f"make the model's {tuple(whole)}"
        )
    return joined


def _gpt_names(gpt: GPT) -> Dict[str, str]:
    """nn.Sequential name -> GPT name ("0.wte.weight" -> "embedding.wte.weight")."""
    module_names = {id(m): n for n, m in gpt.named_modules()}
    out = {}
    for index, child in enumerate(gpt.as_sequential()):
        for key in child.state_dict():
            out[f"{index}.{key}"] = f"{module_names[id(child)]}.{key}"
    return out


def _join_state(name: str, shards: Sequence[Dict[str, Any]], whole: torch.Size) -> Dict[str, Any]:
    """One parameter's optimizer state from its tp shards: element-wise tensors joined as the
    parameter is; the rest (``step``) equal on every tp rank."""
    out = {}
    for key, value in shards[0].items():
        values = [s.get(key) for s in shards]
        if any(v is None for v in values):
            raise ConfigError(f"export: the optimizer state of {name} lacks {key!r} on a tp rank")
        if isinstance(value, torch.Tensor):
            out[key] = _join(f"{name} ({key})", values, whole if value.dim() else value.shape)
        elif any(v != value for v in values):
            raise ConfigError(f"export: {name}'s optimizer {key!r} differs between tp ranks")
        else:
            out[key] = value
    return out


@dataclasses.dataclass
class Consolidated:
    """A checkpoint of any layout as one process sees it: the whole model and, per parameter,
    the whole optimizer state (GPT names, experts by global id)."""

    config: GPTConfig
    step: int
    model: Dict[str, torch.Tensor]
    optimizer: Dict[str, Dict[str, Any]]  # exp_avg, exp_avg_sq in the parameter's shape; step
    options: Dict[str, Dict[str, Any]]  # per parameter: its param group's hyper-parameters
    extra: Dict[str, Any]  # the saving run's: "updates", "loss_scaler"
    names: Dict[str, str]  # the driver's nn.Sequential names -> GPT's


def consolidate_training(path: str, optimizer: bool = True) -> Consolidated:
    """:class:`Consolidated` of a complete step directory (every rank's files are read)."""
    record = read_record(path, "export")
    config = _config(record, path)
    with torch.random.fork_rng(devices=[]):  # only its shapes and names are used
        gpt = GPT(config)
    sequential = gpt.as_sequential()
    whole = {k: v.shape for k, v in sequential.state_dict().items()}
    ranks, first = _per_tp_rank(path, sequential, record["identity"], optimizer)
    names = _gpt_names(gpt)
    state = {names[k]: _join(k, [r.model[k] for r in ranks], shape) for k, shape in whole.items()}
    per_param, options = {}, {}
    for k, _ in sequential.named_parameters(remove_duplicate=False):  # a tied one by each name
        if k in ranks[0].options:  # tp rank 0's (one param group's, like every tp rank's)
            options[names[k]] = ranks[0].options[k]
        held = [r.optimizer.get(k) for r in ranks]
        if all(h is None for h in held):
            continue  # no step has touched it (torch keeps no state for it)
        if any(h is None for h in held):
            raise ConfigError(f"export: {path}: only some tp ranks hold optimizer state of {k}")
        per_param[names[k]] = _join_state(k, held, whole[k])
    return Consolidated(config, int(record["step"]), state, per_param, options, first.extra, names)


def consolidate(path: str) -> Tuple[GPTConfig, int, Dict[str, torch.Tensor]]:
    """``(config, step, state dict under GPT's names)`` of a complete step directory."""
    whole = consolidate_training(path, optimizer=False)
    return whole.config, whole.step, whole.model


def export(path: str, out: str) -> Dict[str, Any]:
    """Writes :func:`consolidate`'s result to ``out`` (atomically); returns what it wrote."""
    config, step, state = consolidate(path)
    payload = {"format": FORMAT, "config": dataclasses.asdict(config), "step": step}
    payload["model"] = state
    tmp = f"{out}.tmp{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, out)
    return payload


def load_exported(path: str, config: Optional[GPTConfig] = None) -> Dict[str, torch.Tensor]:
    """The state dict of an exported file, or of a local Hugging Face model directory (GPT-2
    or Llama, :mod:`dist_kernels.models.hf`); with ``config``, checked to be that model's
    (a Hugging Face model's vocabulary padded and position table cut to ``config``'s)."""
    if os.path.isdir(path):
        return _load_hf(path, config)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"init_from: cannot read {path}: {e}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ConfigError(f"init_from: {path} is not a file of python -m dist_kernels.train.export")
    if config is not None:
        _check_same_model(path, payload["config"], dataclasses.asdict(config))
    return payload["model"]


def _check_same_model(path: str, saved: Dict[str, Any], mine: Dict[str, Any]) -> None:
    """Refuses a file whose model fields ``saved`` differ from this run's ``mine``."""
    differ = {k: (v, mine.get(k)) for k, v in saved.items() if mine.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}={a!r} (this run: {b!r})" for k, (a, b) in differ.items())
        raise ConfigError(f"init_from: {path} holds another model: {detail}")


# what only training uses, or what _fit_hf adapts: not compared with a Hugging Face model
# (and the MoE losses' coefficients: training settings, the run's own)
_HF_FREE = ("dropout", "attention_dropout", "init_std", "vocab_size", "block_size",
            "tie_embeddings", "moe_aux_loss_coeff", "moe_z_loss_coeff",
            "moe_router_bias_update_rate")  # fmt: skip


def _architecture(config: GPTConfig) -> Dict[str, Any]:
    """What must agree between a Hugging Face model and the run's, equivalent spellings made
    one (the MLP's hidden size; key / value heads)."""
    out = {k: v for k, v in dataclasses.asdict(config).items() if k not in _HF_FREE}
    for k in ("mlp_ratio", "ffn_hidden_size", "moe_ffn_hidden_size", "n_kv_heads"):
        del out[k]
    dense = any(not config.is_moe_block(i) for i in range(config.n_layers))
    sizes = {"ffn_dim": config.ffn_dim} if dense else {}  # what is built: no dense MLP, no size
    if config.n_experts:
        sizes["moe_ffn_dim"] = config.moe_ffn_dim
    # a LayerNorm's bias as built (RMSNorm has none, whatever the fields say)
    out["norm_bias"] = config.norm_biased if config.normalization == "layernorm" else None
    return {**out, **sizes, "kv_heads": config.kv_heads}


def _load_hf(path: str, config: Optional[GPTConfig]) -> Dict[str, torch.Tensor]:
    """A Hugging Face model directory as GPT's state dict, fitted to ``config``."""
    from ..models import hf

    try:
        hf_config, state = hf.load_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"init_from: {path}: {e}") from None
    if config is None:
        return state
    try:
        _check_same_model(path, _architecture(hf_config), _architecture(config))
    except ConfigError as e:
        from .cli import model_flags

        flags = " ".join(model_flags(hf_config))
        raise ConfigError(f"{e}; its model is the driver's {flags}") from None
    return _fit_hf(path, hf_config, state, config)


def _fit_hf(path: str, hf_config: GPTConfig, state, config: GPTConfig):
    """The run's vocabulary is padded to a multiple of 64 (``driver.model_config``): the
    embedding and head get zero rows for the padding ids (which never occur; their logits are
    0, as Megatron's converters pad). A learned position table longer than the run's
    sequence keeps its first rows (nanoGPT's ``crop_block_size``). A model whose head is its
    embedding (GPT-2) trains tied with ``--tie-embeddings``, else its head starts as a copy of
    the embedding; a head of its own cannot be tied to the embedding (refused)."""
    vocab, rows = hf_config.vocab_size, config.vocab_size
    if config.tie_embeddings and not torch.equal(
        state["embedding.wte.weight"], state["head.lm_head.weight"]
    ):
        raise ConfigError(
            f"init_from: {path} has an output head of its own (tie_word_embeddings false) and "
            "this run ties it to the embedding: drop --tie-embeddings"
        )
    if hf_config.tie_embeddings and not config.tie_embeddings:
        warnings.warn(
            f"init_from: {path} ties its output head to the embedding; this run trains the head "
            "as a copy, apart from it (--tie-embeddings keeps them one tensor)",
            stacklevel=2,
        )
    theirs, ours = (
        (hf_config.dropout, hf_config.attn_dropout),
        (config.dropout, config.attn_dropout),
    )
    if theirs != ours:  # a fine-tuning recipe usually keeps the model's rates
        warnings.warn(
            f"init_from: {path} is configured with dropout {theirs[0]} and attention dropout "
            f"{theirs[1]}; this run trains with {ours[0]} and {ours[1]} (--dropout and "
            "--attention-dropout set them)",
            stacklevel=2,
        )
    if vocab > rows:
        raise ConfigError(
            f"init_from: {path} has a vocabulary of {vocab} and this run {rows}: give "
            f"--vocab-size {vocab} (a token file's ids must be the model's tokenizer's)"
        )
    if config.position_embedding == "learned" and hf_config.block_size < config.block_size:
        raise ConfigError(
            f"init_from: {path} has {hf_config.block_size} positions and this run "
            f"--seq-len {config.block_size}"
        )
    out = dict(state)
    for key in ("embedding.wte.weight", "head.lm_head.weight"):
        out[key] = torch.cat([state[key], state[key].new_zeros(rows - vocab, config.dim)])
        # (cat copies: a tied model's head and embedding are one tensor no longer)
    if "embedding.wpe.weight" in out:
        out["embedding.wpe.weight"] = state["embedding.wpe.weight"][: config.block_size].clone()
    return out


def export_hf(path: str, out: str) -> GPTConfig:
    """Writes a Hugging Face model directory (``config.json``, ``model.safetensors``) of a
    complete step directory, atomically (a temporary directory renamed); returns the config."""
    from ..models import hf

    config, _, state = consolidate(path)
    tmp = f"{out.rstrip(os.sep)}.tmp{os.getpid()}"
    try:
        hf.save_pretrained(tmp, config, state)
    except ValueError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"export: {e}") from None
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    return config


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dist_kernels.train.export",
        description="Write the unsharded GPT weights of a training checkpoint (any pp, tp, ep, "
        "ZeRO): one file for GPT.load_state_dict or --init-from, or a Hugging Face model.",
    )
    parser.add_argument("step_dir", help="a complete step directory: <checkpoint-dir>/step-N")
    parser.add_argument("out", help="the file (--format dk) or directory (--format hf) to write")
    parser.add_argument(
        "--format",
        choices=("dk", "hf"),
        default="dk",
        help="dk: one file for --init-from / GPT.load_state_dict; hf: a Hugging Face model "
        "directory (GPT2LMHeadModel or LlamaForCausalLM) for from_pretrained",
    )
    args = parser.parse_args(argv)
    try:
        if args.format == "hf":
            config = export_hf(args.step_dir, args.out)
            print(f"wrote {args.out}: a Hugging Face model of {dataclasses.asdict(config)}")
            return 0
        payload = export(args.step_dir, args.out)
    except (ConfigError, dk_checkpoint.CheckpointError, KeyError) as e:
        print(f"dist_kernels.train.export: error: {e}", file=sys.stderr)
        return 2
    numel = sum(t.numel() for t in payload["model"].values())
    print(f"wrote {args.out}: step {payload['step']}, {len(payload['model'])} tensors, "
          f"{numel} values")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
