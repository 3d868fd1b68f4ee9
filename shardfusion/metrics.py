"""What a training run writes to its output folder: metrics.jsonl, loss.png, summary.json.

metrics.jsonl holds one JSON object per line. Training records (one per optimizer step) carry
`step, loss, grad_norm, lr, tokens_per_s, elapsed_s`; evaluation records carry `step, val_loss, elapsed_s`, where
`step` counts the optimizer steps done (0: before training). Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TRAIN_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s")
"""Keys of every training record in metrics.jsonl."""

VAL_KEYS = ("step", "val_loss", "elapsed_s")
"""Keys of every evaluation record in metrics.jsonl."""


class MetricsLog:
    """Appends records to OUT/metrics.jsonl and keeps them in memory for the plot and the summary."""

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.jsonl"
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []
        self.path.write_text("")

    def _append(self, record: dict[str, Any], keys, store: list, kind: str) -> None:
        missing = set(keys) - set(record)
        if missing:
            raise ValueError(f"{kind} record lacks {sorted(missing)}")
        store.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def log_train(self, **record: Any) -> None:
        """Append one training-step record (keys ``TRAIN_KEYS`` at least) to memory and ``metrics.jsonl``.

        Raises:
            ValueError: a required key is missing (the message lists them).
        """
        self._append(record, TRAIN_KEYS, self.train, "training")

    def log_val(self, **record: Any) -> None:
        """Append one evaluation record (keys ``VAL_KEYS`` at least) to memory and ``metrics.jsonl``.

        Raises:
            ValueError: a required key is missing (the message lists them).
        """
        self._append(record, VAL_KEYS, self.val, "evaluation")


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, evaluation records) from a metrics.jsonl file."""
    train, val = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (val if "val_loss" in record else train).append(record)
    return train, val


def plot_losses(log: MetricsLog, path: Path, title: str = "") -> None:
    """Training loss per step and validation loss per evaluation, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if log.train:
        ax.plot([r["step"] for r in log.train], [r["loss"] for r in log.train], lw=1, alpha=0.8, label="train")
    if log.val:
        ax.plot([r["step"] for r in log.val], [r["val_loss"] for r in log.val], "o-", lw=2, label="val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(log: MetricsLog, *, total_s: float, train_s: float, steps: int, num_params: int, layout: str,
              sample: str | None) -> dict[str, Any]:
    """The run's headline figures as a JSON-ready dict."""
    first_val = log.val[0]["val_loss"] if log.val else math.nan
    final_val = log.val[-1]["val_loss"] if log.val else math.nan
    drop = 100.0 * (first_val - final_val) / first_val if log.val and first_val else math.nan
    tail = [r["loss"] for r in log.train[-10:]]
    return {
        "final_train_loss": log.train[-1]["loss"] if log.train else math.nan,
        "final_train_loss_mean10": sum(tail) / len(tail) if tail else math.nan,
        "first_val_loss": first_val,
        "final_val_loss": final_val,
        "val_loss_drop_pct": drop,
        "total_s": total_s,
        "train_s": train_s,
        "steps": steps,
        "steps_per_s": steps / train_s if train_s > 0 else math.nan,
        "tokens_per_s": (sum(r["tokens_per_s"] for r in log.train[1:]) / max(1, len(log.train) - 1)
                         if log.train else math.nan),
        "num_params": num_params,
        "layout": layout,
        "sample": sample,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few human-readable lines."""
    lines = [
        "=" * 72,
        f"layout           {summary['layout']}",
        f"parameters       {summary['num_params']:,}",
        f"steps            {summary['steps']} in {summary['train_s']:.1f} s "
        f"({summary['steps_per_s']:.2f} steps/s, {summary['tokens_per_s']:,.0f} tokens/s); "
        f"total {summary['total_s']:.1f} s",
        f"train loss       {summary['final_train_loss']:.4f} (last 10 steps: "
        f"{summary['final_train_loss_mean10']:.4f})",
        f"val loss         {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f} "
        f"({summary['val_loss_drop_pct']:.1f}% lower)",
    ]
    if summary.get("sample") is not None:
        lines += ["sample (validation prompt ⟫ generated):", "-" * 72, summary["sample"], "-" * 72]
    return "\n".join(lines)
