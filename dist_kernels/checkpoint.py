"""Resharding checkpoints of sharded training: save on N ranks, load on any M, any stage.

    dk.checkpoint.save(path, model=model, optimizer=opt, scaler=scaler, extra={"epoch": 3})
    extra = dk.checkpoint.load(path, model=model, optimizer=opt, scaler=scaler)

A checkpoint is a directory::

    manifest.json                 written last (atomic rename): names every file with its
                                  SHA-256 and size; a checkpoint exists only through it
    layout.<tag>.json             readable layout: world size, stage, per flat group the
                                  parameters (name, shape, dtype, flat offset) and every rank's
                                  segments, optimizer state keys, step, scaler state
    meta.<tag>.pt                 rank 0: optimizer hyper-parameters, scaler state, model
                                  buffers and unsharded parameters, the caller's ``extra``
    shard-<r>-of-<n>.<tag>.pt     rank r: its master parameter slices and optimizer state

Every file is written to a temporary name, fsynced and renamed; the manifest is renamed over the
previous one last and the directory fsynced, and only then are the previous checkpoint's files
removed. A crash at any point before that rename leaves the previous checkpoint whole.

Loading maps pieces by parameter name and element offset: each rank re-plans its shard for the
current world size, reads only the saved shards that overlap it, verifies their checksums, and
assembles everything before touching the model or optimizer, so a bad checkpoint raises
:class:`CheckpointError` and changes nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import secrets
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["CheckpointError", "save", "load", "load_whole", "read_model", "read_whole"]

FORMAT = "dist_kernels.checkpoint/1"
MANIFEST = "manifest.json"
_DIGEST = 32  # SHA-256 bytes


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model / optimizer."""


# ----------------------------------------------------------------------------- file I/O


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file, fsync and rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _publish_manifest(directory: str, manifest: Dict[str, Any]) -> None:
    """The commit point of a save: the manifest replaces the previous one atomically."""
    _write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1).encode())
    _fsync_dir(directory)


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _read_verified(directory: str, manifest: Dict[str, Any], name: str) -> bytes:
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{directory}: the manifest does not list {name}")
    try:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot read {name}: {e}") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"{directory}: {name} is corrupt ({len(data)} bytes, expected {entry['bytes']}; "
            "SHA-256 differs from the manifest)"
        )
    return data


def _read_manifest(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no checkpoint ({MANIFEST} is missing)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _file_names(tag: str, world_size: int) -> Tuple[str, str, List[str]]:
    shards = [f"shard-{r}-of-{world_size}.{tag}.pt" for r in range(world_size)]
    return f"layout.{tag}.json", f"meta.{tag}.pt", shards


def _remove_stale(directory: str, keep: List[str]) -> None:
    """Removes files of earlier checkpoints (only names this module writes)."""
    for name in os.listdir(directory):
        ours = name.startswith(("shard-", "layout.", "meta.", f"{MANIFEST}.tmp"))
        if ours and name not in keep:
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass


# ----------------------------------------------------------------------------- layout


def _param_names(model: Optional[torch.nn.Module], optimizer: Any) -> Dict[int, str]:
    """id(parameter) -> name; without a model, the optimizer's own slot names. MoE experts go
    by their global id (``experts.<global id>``), so a checkpoint's names do not depend on
    the ep it was saved at."""
    if model is not None:
        from .moe.checkpoint import global_key

        rename = global_key(model)
        return {id(p): rename(n) for n, p in model.named_parameters(remove_duplicate=False)}
    return {id(p): s.name for fg in optimizer.flat_groups for s, p in zip(fg.plan.slots, fg.params)}


def _expert_test(model: Optional[torch.nn.Module]):
    """Whether a saved name is an MoE expert's (held by some rank, not necessarily this one)."""
    if model is None:
        return lambda name: False
    from .moe.checkpoint import expert_key_test

    return expert_key_test(model)


def _params_record(fg: Any, names: Dict[int, str]) -> List[Dict[str, Any]]:
    params = []
    for slot, p in zip(fg.plan.slots, fg.params):
        if id(p) not in names:
            raise ValueError("model: a parameter of the optimizer is not in the model")
        params.append(
            {
                "name": names[id(p)],
                "shape": list(slot.shape),
                "offset": slot.offset,
                "dtype": str(fg.dtype).replace("torch.", ""),
            }
        )
    return params


def _segments_record(fg: Any, names: Dict[int, str], rank: int) -> List[List[Any]]:
    """Rank ``rank`` (of the group's communicator)'s pieces: [name, start, length, offset]."""
    return [
        [names[id(fg.params[s.slot])], s.param_start, s.length, s.shard_offset]
        for s in fg.plan.segments(rank)
    ]


def _expert_records(optimizer: Any, names: Dict[int, str]) -> List[Dict[str, Any]]:
    """This rank's flat groups sharded over ``expert_comm`` (its own experts, by global name):
    parameters and this rank's pieces. Every rank's go into the layout (rank 0 gathers them)."""
    return [
        {
            "group": g,
            "key": fg.plan.key,
            "params": _params_record(fg, names),
            "segments": _segments_record(fg, names, fg.comm.rank),
        }
        for g, fg in enumerate(optimizer.flat_groups)
        if fg.comm is not optimizer.comm
    ]


def _group_records(
    optimizer: Any, names: Dict[int, str], experts: List[List[Dict[str, Any]]]
) -> List[Dict[str, Any]]:
    """Per flat group: parameters and the pieces of every rank of ``optimizer.comm`` (the
    shard file's index), by parameter name. A dense group's pieces follow from rank 0's plan;
    an expert group's (``experts[r]``: rank r's :func:`_expert_records`) differ from ep rank to
    ep rank: its parameters are every rank's experts, its pieces each rank's own."""
    records = []
    by_group = defaultdict(list)
    for rank_records in experts:
        for record in rank_records:
            by_group[record["group"]].append(record)
    for g, fg in enumerate(optimizer.flat_groups):
        record = {"key": fg.plan.key, "numel": fg.plan.numel, "shard_numel": fg.plan.shard_numel}
        if fg.comm is optimizer.comm:
            record["params"] = _params_record(fg, names)
            record["segments"] = [_segments_record(fg, names, r) for r in range(fg.plan.world_size)]
        else:
            ranks = by_group[g]
            if len(ranks) != optimizer.world_size or any(r["key"] != fg.plan.key for r in ranks):
                raise ValueError(f"flat group {fg.plan.key}: the ranks' expert groups disagree")
            union = {p["name"]: {**p, "offset": None} for r in ranks for p in r["params"]}
            record.update(
                experts=True,
                params=[union[n] for n in sorted(union)],
                segments=[r["segments"] for r in ranks],
            )
        records.append(record)
    return records


def _gather_json(comm: Any, world_size: int, value: Any) -> List[Any]:
    """Every rank's JSON-able ``value``, in rank order (two all-gathers: sizes, then bytes)."""
    data = json.dumps(value).encode()
    if world_size == 1:
        return [value]
    sizes = _all_gather_rows(comm, world_size, torch.tensor([len(data)], dtype=torch.int64))
    width = int(sizes.max())
    row = torch.zeros(width, dtype=torch.uint8)
    row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = _all_gather_rows(comm, world_size, row)
    return [json.loads(bytes(rows[r, : int(sizes[r, 0])].tolist())) for r in range(world_size)]


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


# ----------------------------------------------------------------------------- save


def save(
    path: str,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    scaler: Any = None,
    extra: Any = None,
) -> None:
    """Writes a checkpoint of ``model`` and a :class:`dist_kernels.ShardedOptimizer`.

    Collective when ``optimizer`` is given: every rank calls it with the same ``path`` (a
    directory on a file system all ranks see). Each rank writes its own shard; rank 0 writes
    the layout, the metadata and, last, the manifest. Returns when the checkpoint is complete on
    every rank; raises on every rank if any rank failed, leaving the previous checkpoint intact.

    Args:
        path: checkpoint directory (created if missing; a previous checkpoint is replaced).
        model: the model; its parameter names identify the pieces, its buffers and parameters
            the optimizer does not manage are saved whole by rank 0.
        optimizer: the ShardedOptimizer (None: save ``model`` alone, from this process).
        scaler: a loss scaler with ``state_dict()`` (optional).
        extra: any picklable object, returned by :func:`load`.
    """
    if model is None and optimizer is None:
        raise ValueError("save: give a model, an optimizer or both")
    if optimizer is None:
        _save_model_only(path, model, scaler, extra)
        return
    comm, rank, world_size = optimizer.comm, optimizer.rank, optimizer.world_size
    os.makedirs(path, exist_ok=True)
    tag = _agree_on_tag(comm, world_size)
    layout_name, meta_name, shard_names = _file_names(tag, world_size)
    names = _param_names(model, optimizer)
    digest = torch.zeros(_DIGEST + 8, dtype=torch.uint8)
    error: Optional[BaseException] = None
    experts: List[Dict[str, Any]] = []
    try:
        experts = _expert_records(optimizer, names)
        data = _serialize(_shard_payload(optimizer, rank))
        _write_atomic(os.path.join(path, shard_names[rank]), data)
        digest[:_DIGEST] = torch.frombuffer(
            bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8
        )
        digest[_DIGEST:] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
        error = e
        digest.fill_(255)
    digests = _all_gather_rows(comm, world_size, digest)
    every_experts = _gather_json(comm, world_size, experts)
    status = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        state = (optimizer, model, names, every_experts, scaler, extra)
        status[0] = _commit(path, tag, state, digests, (layout_name, meta_name, shard_names))
    if world_size > 1:
        comm.broadcast(status, 0)
    if error is not None:
        raise CheckpointError(f"[rank {rank}] save to {path}: writing the shard failed") from error
    if int(status[0]) != 0:
        raise CheckpointError(
            f"[rank {rank}] save to {path}: a rank failed; the previous checkpoint is unchanged"
        )


def _agree_on_tag(comm: Any, world_size: int) -> str:
    tag = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    if world_size > 1:
        comm.broadcast(tag, 0)
    return f"{int(tag[0]):016x}"


def _all_gather_rows(comm: Any, world_size: int, row: torch.Tensor) -> torch.Tensor:
    if world_size == 1:
        return row.view(1, -1).clone()
    out = torch.zeros(world_size * row.numel(), dtype=row.dtype)
    comm.all_gather(out, row)
    return out.view(world_size, -1)


def _shard_payload(optimizer: Any, rank: int) -> Dict[str, Any]:
    groups = []
    for g, fg in enumerate(optimizer.flat_groups):
        master, elementwise, replicated = optimizer.shard_tensors(g)
        replicated = {
            k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in replicated.items()
        }
        groups.append(
            {"key": fg.plan.key, "master": master, "state": elementwise, "replicated": replicated}
        )
    return {"format": FORMAT, "rank": rank, "world_size": optimizer.world_size, "groups": groups}


def _commit(path, tag, state, digests, file_names) -> int:
    """Rank 0: writes layout and metadata, then publishes the manifest. Returns 0 or 1.
    ``state``: (optimizer, model, names, every rank's expert records, scaler, extra);
    ``file_names``: (layout, meta, shards)."""
    optimizer, model, names, experts, scaler, extra = state
    layout_name, meta_name, shard_names = file_names
    if bool((digests == 255).all(dim=1).any()):
        return 1  # some rank failed to write its shard
    files = {}
    for r, name in enumerate(shard_names):
        size = int(digests[r, _DIGEST:].clone().view(torch.int64)[0])
        files[name] = {"sha256": bytes(digests[r, :_DIGEST].tolist()).hex(), "bytes": size}
    managed = {id(p) for p in optimizer._all_params()}
    scaler_state = scaler.state_dict() if scaler is not None else None
    meta = {
        "optimizer_class": type(optimizer.optim).__name__,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.optim.param_groups
        ],
        "scaler": scaler_state,
        "model_rest": _model_rest(model, managed),
        "extra": extra,
    }
    _, first_state, first_replicated = optimizer.shard_tensors(0)
    step = first_replicated.get("step")
    layout = {
        "format": FORMAT,
        "world_size": optimizer.world_size,
        "stage": optimizer.stage,
        "optimizer_class": meta["optimizer_class"],
        "state_keys": sorted(first_state),
        "step": float(step) if step is not None else None,
        "scaler": _jsonable(scaler_state),
        "groups": _group_records(optimizer, names, experts),
    }
    for name, data in ((layout_name, json.dumps(layout).encode()), (meta_name, _serialize(meta))):
        _write_atomic(os.path.join(path, name), data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest = {
        "format": FORMAT,
        "tag": tag,
        "world_size": optimizer.world_size,
        "layout": layout_name,
        "meta": meta_name,
        "shards": shard_names,
        "files": files,
    }
    _publish_manifest(path, manifest)
    _remove_stale(path, [MANIFEST, *files])
    return 0


def _model_rest(model: Optional[torch.nn.Module], managed: set) -> Dict[str, torch.Tensor]:
    """The model's state the optimizer does not shard: buffers and unmanaged parameters."""
    if model is None:
        return {}
    managed_names = {
        n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in managed
    }
    return {
        k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in managed_names
    }


def _save_model_only(path: str, model: torch.nn.Module, scaler: Any, extra: Any) -> None:
    os.makedirs(path, exist_ok=True)
    tag = f"{secrets.randbits(62):016x}"
    _, meta_name, _ = _file_names(tag, 1)
    meta = {
        "optimizer_class": None,
        "param_groups": [],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "model_rest": _model_rest(model, set()),
        "extra": extra,
    }
    data = _serialize(meta)
    _write_atomic(os.path.join(path, meta_name), data)
    files = {meta_name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    manifest = {
        "format": FORMAT,
        "tag": tag,
        "world_size": 1,
        "layout": None,
        "meta": meta_name,
        "shards": [],
        "files": files,
    }
    _publish_manifest(path, manifest)
    _remove_stale(path, [MANIFEST, *files])


# ----------------------------------------------------------------------------- load


def load(
    path: str,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    scaler: Any = None,
) -> Any:
    """Restores a checkpoint written by :func:`save`, on any world size and either stage.

    Parameters, optimizer moments and step counts are resharded for ``optimizer``'s current
    layout; without an optimizer the full parameters are assembled into ``model``. Everything
    is read and verified (checksums, names, shapes, dtypes) before anything is changed.

    Returns:
        the ``extra`` object given to :func:`save`.

    Raises:
        CheckpointError: missing or corrupt files, or a checkpoint of another model or
            optimizer; the model and optimizer are then unchanged.
    """
    manifest, meta, layout = _read_header(path)
    if scaler is not None and meta["scaler"] is None:
        raise CheckpointError(
            f"{path}: a scaler was given but the checkpoint holds no scaler state"
        )
    if optimizer is not None:
        plan = _agreed(
            optimizer, lambda: _plan_optimizer_load(path, manifest, layout, meta, model, optimizer)
        )
    elif model is not None:
        plan = _plan_model_load(path, manifest, layout, meta, model)
    else:
        plan = None
    if plan is not None:
        plan()
    if scaler is not None:
        scaler.load_state_dict(meta["scaler"])
    return meta["extra"]


def _read_header(path: str) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[Any]]:
    """The manifest, the verified meta record and the verified layout (None: not sharded)."""
    manifest = _read_manifest(path)
    meta = torch.load(
        io.BytesIO(_read_verified(path, manifest, manifest["meta"])), weights_only=False
    )
    layout = None
    if manifest["layout"] is not None:
        layout = json.loads(_read_verified(path, manifest, manifest["layout"]))
    return manifest, meta, layout


def read_model(path: str) -> Tuple[Dict[str, torch.Tensor], Any]:
    """``(state dict, extra)`` of a checkpoint's model, read and verified, applied to nothing:
    the parameters a ShardedOptimizer saved assembled from every shard, beside the rest. For
    a caller that maps the keys first (``dk.moe.checkpoint``: experts across ep sizes)."""
    state, _, _, extra = read_whole(path, optimizer=False)
    return state, extra


def read_whole(
    path: str, optimizer: bool = True
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, Any]], Dict[str, Dict[str, Any]], Any]:
    """``(model state dict, optimizer state by parameter name, hyper-parameters by parameter
    name, extra)`` of a
    checkpoint, read and verified, assembled from every shard and applied to nothing: what a
    caller needs to load it into another layout than the saving one's (another tensor or
    pipeline split: ``dist_kernels.train``'s resume). Each parameter's optimizer state holds
    its element-wise tensors (``exp_avg``...) in the parameter's shape and the replicated
    values (``step``...) of the flat group that held it; its hyper-parameters are its param
    group's. A checkpoint of a model alone has no optimizer state (empty dicts)."""
    manifest, meta, layout = _read_header(path)
    state = dict(meta["model_rest"])
    per_param: Dict[str, Dict[str, Any]] = {}
    options: Dict[str, Dict[str, Any]] = {}
    pieces, reader = _saved_pieces(layout), _ShardReader(path, manifest)
    keys = ["master", *(layout["state_keys"] if optimizer and layout is not None else ())]
    for name, (shape, dtype) in _saved_params(layout).items():
        numel = math.prod(shape)
        dst = {k: torch.zeros(numel, dtype=torch.float32) for k in keys}
        if _fill(dst, 0, name, 0, numel, pieces, reader, keys) != numel:
            raise CheckpointError(f"{path}: parameter {name} is not fully covered by the shards")
        state[name] = dst.pop("master").view(shape).to(getattr(torch, dtype))
        if optimizer:
            replicated, options[name] = _replicated_for(name, pieces, reader, meta, layout)
            replicated = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in replicated.items()
            }  # the group's values, each parameter its own copy (optimizers step them in place)
            per_param[name] = {**replicated, **{k: v.view(shape) for k, v in dst.items()}}
    return state, per_param, options, meta["extra"]


def load_whole(
    optimizer: Any,
    model: Optional[torch.nn.Module],
    state_of: Callable[[torch.Tensor], Dict[str, Any]],
    options_of: Callable[[torch.Tensor], Dict[str, Any]],
) -> None:
    """Loads a ShardedOptimizer from whole per-parameter state, as :func:`read_whole` returns
    it after the caller mapped it onto this layout: ``state_of(param)`` gives the parameter's
    value (``"master"``), its element-wise optimizer state in its shape and its replicated
    state (``step``); ``options_of(param)`` its param group's hyper-parameters (those of a
    flat group's first parameter are the group's). Each rank copies its own shard's
    elements out of them. Collective; raises on every rank, changing nothing, if any rank
    lacks something."""
    names = _param_names(model, optimizer)

    def prepare():
        shards = []
        for fg in optimizer.flat_groups:
            segments = list(fg.plan.segments(fg.comm.rank))  # experts: the rank in expert_comm
            whole = [state_of(fg.params[s.slot]) for s in segments]
            first = whole[0] if whole else {}
            elementwise = sorted(
                k for k, v in first.items() if k != "master" and _is_full(v, first)
            )
            dst = {
                k: torch.zeros(fg.plan.shard_numel, dtype=torch.float32)
                for k in ("master", *elementwise)
            }
            for seg, state in zip(segments, whole):
                for key in dst:
                    if key not in state:
                        raise CheckpointError(
                            f"[rank {optimizer.rank}] load: {names[id(fg.params[seg.slot])]} has "
                            f"no {key!r} (flat group {fg.plan.key} needs it for every parameter)"
                        )
                    src = state[key].reshape(-1)[seg.param_start : seg.param_start + seg.length]
                    dst[key][seg.shard_offset : seg.shard_offset + seg.length].copy_(src)
            replicated = {k: v for k, v in first.items() if k != "master" and k not in dst}
            shards.append((dst.pop("master"), dst, replicated, options_of(fg.params[0])))
        return shards

    optimizer.load_shard_tensors(_agreed(optimizer, prepare))


def _is_full(value: Any, state: Dict[str, Any]) -> bool:
    """Whether ``value`` is element-wise state: a tensor shaped like the parameter."""
    master = state.get("master")
    return isinstance(value, torch.Tensor) and master is not None and value.shape == master.shape


def _agreed(optimizer: Any, prepare):
    """Runs ``prepare`` on every rank; raises on every rank if it failed on any (the apply step
    that follows is collective, so no rank may go on alone)."""
    failed = torch.zeros(1, dtype=torch.float32)
    error: Optional[BaseException] = None
    try:
        result = prepare()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
        error, result = e, None
        failed.fill_(1.0)
    if optimizer.world_size > 1:
        from .dtypes import ReduceOp

        optimizer.comm.all_reduce(failed, op=ReduceOp.MAX)
    if error is not None:
        raise error
    if float(failed[0]) > 0:
        raise CheckpointError(
            f"[rank {optimizer.rank}] load: another rank failed to read the "
            "checkpoint; nothing was changed"
        )
    return result


def _saved_pieces(layout: Dict[str, Any]) -> Dict[str, List[Tuple[int, int, int, int, int]]]:
    """name -> [(saved rank, saved group, param_start, length, shard_offset)]."""
    pieces: Dict[str, List[Tuple[int, int, int, int, int]]] = defaultdict(list)
    for gi, group in enumerate(layout["groups"] if layout is not None else ()):
        for rank, segments in enumerate(group["segments"]):
            for name, start, length, offset in segments:
                pieces[name].append((rank, gi, start, length, offset))
    return pieces


def _saved_params(layout: Optional[Dict[str, Any]]) -> Dict[str, Tuple[List[int], str]]:
    if layout is None:
        return {}
    return {p["name"]: (p["shape"], p["dtype"]) for g in layout["groups"] for p in g["params"]}


def _check_params(
    path: str,
    saved: Dict[str, Tuple[List[int], str]],
    current: Dict[str, torch.Tensor],
    elsewhere=lambda name: False,
) -> None:
    """Names, shapes and dtypes agree; ``elsewhere(name)``: a saved parameter this rank need
    not hold (an MoE expert of another ep rank)."""
    problems = []
    for name in sorted(set(current) - set(saved)):
        problems.append(f"missing in checkpoint: {name}")
    for name in sorted(set(saved) - set(current)):
        if not elsewhere(name):
            problems.append(f"not in the model: {name}")
    for name in sorted(set(saved) & set(current)):
        shape, dtype = saved[name]
        p = current[name]
        if list(p.shape) != shape or str(p.dtype).replace("torch.", "") != dtype:
            problems.append(
                f"{name}: saved {dtype}{shape}, model has "
                f"{str(p.dtype).replace('torch.', '')}{list(p.shape)}"
            )
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 8 else ""
        )
        raise CheckpointError(f"{path}: checkpoint does not match the model: {shown}")


class _ShardReader:
    """Reads saved shards on demand, each once, verifying its checksum."""

    def __init__(self, path: str, manifest: Dict[str, Any]) -> None:
        self.path, self.manifest, self.cache = path, manifest, {}

    def __call__(self, rank: int) -> Dict[str, Any]:
        if rank not in self.cache:
            name = self.manifest["shards"][rank]
            data = _read_verified(self.path, self.manifest, name)
            self.cache[rank] = torch.load(io.BytesIO(data), weights_only=True)
        return self.cache[rank]


def _fill(
    dst: Dict[str, torch.Tensor],
    dst_offset: int,
    name: str,
    start: int,
    length: int,
    pieces,
    reader: _ShardReader,
    keys: List[str],
) -> int:
    """Copies elements [start, start + length) of parameter ``name`` (master values and the
    element-wise state ``keys``) from the saved shards into ``dst``; returns elements copied."""
    copied = 0
    for rank, gi, s_start, s_length, s_offset in pieces.get(name, ()):
        lo, hi = max(start, s_start), min(start + length, s_start + s_length)
        if lo >= hi:
            continue
        group = reader(rank)["groups"][gi]
        src_lo = s_offset + (lo - s_start)
        out_lo = dst_offset + (lo - start)
        for key in keys:
            src = group["master"] if key == "master" else group["state"].get(key)
            if src is None:
                raise CheckpointError(f"{reader.path}: saved shard {rank} lacks state {key!r}")
            dst[key][out_lo : out_lo + hi - lo].copy_(src[src_lo : src_lo + hi - lo])
        copied += hi - lo
    return copied


def _plan_optimizer_load(path, manifest, layout, meta, model, optimizer):
    """Reads and assembles this rank's new shards; returns a function that applies them."""
    if layout is None:
        raise CheckpointError(f"{path}: holds a model only, no optimizer state")
    if meta["optimizer_class"] != type(optimizer.optim).__name__:
        raise CheckpointError(
            f"{path}: saved with {meta['optimizer_class']}, the optimizer "
            f"is {type(optimizer.optim).__name__}"
        )
    names = _param_names(model, optimizer)
    current = {names[id(p)]: p for p in optimizer._all_params() if id(p) in names}
    if len(current) != sum(len(fg.params) for fg in optimizer.flat_groups):
        raise CheckpointError("model: the optimizer's parameters are not all in the model")
    _check_params(path, _saved_params(layout), current, _expert_test(model))
    pieces, reader = _saved_pieces(layout), _ShardReader(path, manifest)
    keys = ["master", *layout["state_keys"]]
    new_shards, new_states = [], []
    for fg in optimizer.flat_groups:
        dst = {k: torch.zeros(fg.plan.shard_numel, dtype=torch.float32) for k in keys}
        expected = copied = 0
        first_name = None
        for seg in fg.plan.segments(fg.comm.rank):  # experts: the rank in expert_comm
            name = names[id(fg.params[seg.slot])]
            first_name = first_name or name
            copied += _fill(
                dst, seg.shard_offset, name, seg.param_start, seg.length, pieces, reader, keys
            )
            expected += seg.length
        if copied != expected:
            raise CheckpointError(
                f"{path}: the saved shards cover {copied} of the {expected} "
                f"elements of flat group {fg.plan.key} on rank {optimizer.rank}"
            )
        replicated, group_options = _replicated_for(first_name, pieces, reader, meta, layout)
        new_shards.append(dst.pop("master"))
        new_states.append((dst, replicated, group_options))
    rest = meta["model_rest"]

    def apply() -> None:
        optimizer.load_shard_tensors(
            [
                (master, state, replicated, options)
                for master, (state, replicated, options) in zip(new_shards, new_states)
            ]
        )
        if model is not None and rest:
            model.load_state_dict(rest, strict=False)

    return apply


def _replicated_for(name, pieces, reader, meta, layout):
    """Replicated state (``step``...) and hyper-parameters of the saved group holding ``name``."""
    if name is None or name not in pieces:
        return {}, {}
    rank, gi = pieces[name][0][0], pieces[name][0][1]
    replicated = dict(reader(rank)["groups"][gi]["replicated"])
    options = meta["param_groups"][gi] if gi < len(meta["param_groups"]) else {}
    return replicated, options


def _plan_model_load(path, manifest, layout, meta, model):
    """Assembles full parameters from every saved shard (model only, no optimizer)."""
    rest = meta["model_rest"]
    saved = _saved_params(layout)
    # a sharded layout names parameters as _param_names does (experts by global id); a model
    # saved alone keeps its own state-dict keys in model_rest
    rename = _param_names(model, None) if layout is not None else {}
    named = {rename.get(id(p), n): p for n, p in model.named_parameters()}
    current = {n: p for n, p in named.items() if n in saved or n not in rest}
    _check_params(path, saved, current, _expert_test(model))
    pieces, reader = _saved_pieces(layout), _ShardReader(path, manifest)
    values = {}
    for name, p in current.items():
        dst = {"master": torch.zeros(p.numel(), dtype=torch.float32)}
        if _fill(dst, 0, name, 0, p.numel(), pieces, reader, ["master"]) != p.numel():
            raise CheckpointError(f"{path}: parameter {name} is not fully covered by the shards")
        values[name] = dst["master"].view(p.shape).to(p.dtype)

    def apply() -> None:
        with torch.no_grad():
            for name, value in values.items():
                current[name].copy_(value)
        if rest:
            model.load_state_dict(rest, strict=False)

    return apply
