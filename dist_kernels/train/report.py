"""What rank 0 shows at the end: the summary table (engines side by side) and the plot."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from .config import TrainConfig

_COLUMNS = (
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("step ms", "step_ms", "{:.2f}"),
    ("forward", "forward_ms", "{:.2f}"),
    ("backward", "backward_ms", "{:.2f}"),
    ("comm", "comm_ms", "{:.3f}"),
    ("optimizer", "optimizer_ms", "{:.2f}"),
    ("MFU", "mfu", "{:.2%}"),
    ("final loss", "final_loss", "{:.4f}"),
    ("valid loss", "valid_loss", "{:.4f}"),
    ("test loss", "test_loss", "{:.4f}"),
    ("peak MB", "peak_mem_mb", "{:.0f}"),
)


def _cell(fmt: str, value: Optional[float]) -> str:
    return "-" if value is None else fmt.format(value)


def summary_table(cfg: TrainConfig, results: Sequence[Any]) -> str:
    """One row per engine: means over the logged intervals after the first; times in ms per
    step (comm = exposed communication)."""
    header = ["engine", *(name for name, _, _ in _COLUMNS)]
    rows = [
        [r.engine, *(_cell(fmt, r.summary.get(key)) for _, key, fmt in _COLUMNS)] for r in results
    ]
    if len(results) == 2 and all(r.summary.get("tokens_per_s") for r in results):
        a, b = (r.summary for r in results)
        ratio = ["dk/torch", f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x"]
        for _, key, _ in _COLUMNS[1:6]:
            ok = a.get(key) is not None and b.get(key)
            ratio.append(f"{a[key] / b[key]:.2f}x" if ok else "-")
        rows.append(ratio + [""] * (len(header) - len(ratio)))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda row: "  ".join(str(c).rjust(w) for c, w in zip(row, widths))  # noqa: E731
    experts = f"ep={cfg.ep} experts={cfg.model.n_experts} " if cfg.model.n_experts else ""
    layout = (
        f"dp={cfg.dp} tp={cfg.tp} cp={cfg.cp} pp={cfg.pp} zero={cfg.zero} {experts}"
        f"global_batch={cfg.global_batch} "
        f"(micro_batch {cfg.micro_batch} x grad_accum {cfg.grad_accum} x dp {cfg.dp}) "
        f"seq_len={cfg.model.block_size} dtype={cfg.dtype}"
    )
    return "\n".join([layout, line(header), *map(line, rows)])


def plot(path: str, results: Sequence[Any]) -> None:
    """Loss (and validation loss) and tokens/s against step, and per-rank busy time, in one
    figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tok, ax_rank) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        steps = [rec["step"] for rec in r.records]
        ax_loss.plot(steps, [rec["loss"] for rec in r.records], label=r.engine)
        if r.evals:  # --eval-interval: the held-out loss as markers on the same axes
            ax_loss.plot(
                [e["step"] for e in r.evals],
                [e["valid_loss"] for e in r.evals],
                "o--",
                label=f"{r.engine} validation",
            )
        ax_tok.plot(steps, [rec["tokens_per_s"] for rec in r.records], label=r.engine)
        per_rank: List[List[float]] = list(zip(*(rec["rank_busy_ms"] for rec in r.records)))
        for rank, times in enumerate(per_rank):
            ax_rank.plot(steps, times, label=f"{r.engine} rank {rank}")
    for ax, title, ylabel in (
        (ax_loss, "loss", "cross-entropy (nats)"),
        (ax_tok, "throughput", "tokens/s"),
        (ax_rank, "per-rank busy time (step - exposed comm)", "ms"),
    ):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
