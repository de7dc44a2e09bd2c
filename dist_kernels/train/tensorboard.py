"""``--tensorboard DIR``: the metrics of every logged interval as TensorBoard scalars (rank 0),
through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package).

Tags: ``loss``, ``lr``, ``throughput/tokens_per_s``, ``throughput/samples_per_s``, ``mfu``,
``time/step_ms`` and ``time/<phase>_ms`` (forward, backward, comm, optimizer; absent when the
engine does not measure a phase), ``memory/peak_mb`` (the largest rank's) and
``time/step_ms_max_rank`` / ``time/step_ms_min_rank`` (the slowest and fastest rank's).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .metrics import PHASES


def scalars(record: Dict[str, Any]) -> Dict[str, float]:
    """The scalars of one metrics record (pure)."""
    out = {
        "loss": record["loss"],
        "lr": record["lr"],
        "throughput/tokens_per_s": record["tokens_per_s"],
        "throughput/samples_per_s": record["samples_per_s"],
        "mfu": record["mfu"],
        "time/step_ms": record["step_ms"],
        "memory/peak_mb": max(record["peak_mem_mb"]),
        "time/step_ms_max_rank": max(record["rank_step_ms"]),
        "time/step_ms_min_rank": min(record["rank_step_ms"]),
    }
    for phase in PHASES:
        if record.get(f"{phase}_ms") is not None:
            out[f"time/{phase}_ms"] = record[f"{phase}_ms"]
    if record.get("grad_norm") is not None:  # --clip-grad
        out["grad_norm"] = record["grad_norm"]
    if record.get("loss_scale") is not None:  # fp16
        out["loss_scale"] = record["loss_scale"]
        out["skipped_steps"] = record["skipped_steps"]
    return {tag: float(value) for tag, value in out.items()}


class TensorBoardLog:
    """A SummaryWriter on ``directory`` (None: nothing is written)."""

    def __init__(self, directory: Optional[str]) -> None:
        self._writer = None
        if directory is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=directory)

    def write(self, record: Dict[str, Any]) -> None:
        self._add(scalars(record), record["step"])

    def write_eval(self, record: Dict[str, Any], split: str = "valid") -> None:
        """A validation or test record: ``valid/loss`` and ``valid/ppl`` (Megatron's
        "validation"), or ``test/loss`` and ``test/ppl``."""
        self._add({f"{split}/{k}": record[f"{split}_{k}"] for k in ("loss", "ppl")}, record["step"])

    def _add(self, values: Dict[str, float], step: int) -> None:
        if self._writer is None:
            return
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
