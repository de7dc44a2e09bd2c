"""The model structure every rank must share, compared before anything is broadcast.

``describe_parameters`` and ``first_description_mismatch`` are pure (``name shape dtype``
lines in, the first mismatch out); :func:`check_structure` all-gathers the lines and raises
the same error on every rank.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch


def describe_parameters(named: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
    """``name shape dtype`` lines that must agree across ranks before parameters are broadcast."""
    return [f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for name, t in named]


def first_description_mismatch(per_rank: Sequence[Sequence[str]]) -> Optional[str]:
    """None when all ranks describe the same model, else the first differing entry and ranks."""
    longest = max(len(d) for d in per_rank)
    for position in range(longest):
        entries = [d[position] if position < len(d) else "<missing>" for d in per_rank]
        if len(set(entries)) > 1:
            differing = [r for r, e in enumerate(entries) if e != entries[0]]
            shown = "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
            return (
                f"DistributedDataParallel: models differ across ranks at entry {position} "
                f"(ranks {differing} differ from rank 0): {shown}"
            )
    return None


def check_structure(comm: Any, module: torch.nn.Module, trainable: Sequence[torch.Tensor]) -> None:
    """Raises ValueError on every rank when the ranks' models differ (names, shapes, dtypes,
    which parameters are frozen), or when no parameter requires a gradient (collective)."""
    _check_models_agree(comm, module)
    _check_trainable(comm.rank, module, trainable)


def _check_models_agree(comm: Any, module: torch.nn.Module) -> None:
    """Raises ValueError on every rank when parameter/buffer names or shapes differ."""
    if comm.world_size == 1:
        return
    named = list(module.named_parameters())
    entries = [  # requires_grad decides the bucket plan: it must agree too
        entry + ("" if p.requires_grad else " frozen")
        for entry, (_, p) in zip(describe_parameters(named), named)
    ]
    entries += ["buffer " + e for e in describe_parameters(list(module.named_buffers()))]
    per_rank = _all_gather_bytes(comm, "\n".join(entries).encode())
    message = first_description_mismatch([b.decode().split("\n") for b in per_rank])
    if message:
        raise ValueError(f"[rank {comm.rank}] {message}")


def _check_trainable(rank: int, module: torch.nn.Module, trainable: Sequence[torch.Tensor]) -> None:
    """ValueError when no parameter requires a gradient: there is nothing to average.

    Runs after :func:`_check_models_agree`, so every rank has the same structure and raises
    alike (a local check first would leave the other ranks waiting in that collective).
    """
    if trainable:
        return
    frozen = len(list(module.parameters()))
    buffers = len(list(module.named_buffers()))
    if frozen:
        what = f"none of the module's {frozen} parameters requires a gradient"
    elif buffers:
        what = f"the module has {buffers} buffer(s) but no parameters"
    else:
        what = "the module has no parameters and no buffers"
    raise ValueError(
        f"[rank {rank}] DistributedDataParallel: {what}, so there are no gradients to "
        "average (torch DDP refuses such a module too). Do not wrap it"
        + (", or unfreeze the parameters to train first" if frozen else "")
        + ("; to keep buffers equal on every rank, broadcast them from rank 0" if buffers else "")
        + "."
    )


def _all_gather_bytes(comm: Any, data: bytes) -> List[bytes]:
    world_size = comm.world_size
    dev = torch.device(getattr(comm, "device", "cpu"))
    lengths = torch.zeros(world_size, dtype=torch.int64, device=dev)
    comm.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=dev))
    longest = int(lengths.max())
    if longest == 0:
        return [b""] * world_size
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(dev)
    out = torch.zeros(world_size * longest, dtype=torch.uint8, device=dev)
    comm.all_gather(out, mine)
    chunks = out.view(world_size, longest).cpu()
    return [bytes(chunks[r, : int(lengths[r])].tolist()) for r in range(world_size)]
