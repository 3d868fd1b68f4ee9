"""Training runs of the job side by side: their loss curves on one plot and a table of the final losses.

Used for the compressed outer all-reduce (``--outer-comm-dtype``): the same ``make train`` run with fp32 and with
int8 on the wire, compared step by step::

    make train ARGS='--out runs/outer-fp32'
    make train ARGS='--out runs/outer-int8 --outer-comm-dtype int8'
    .venv/bin/python -m benchmarks.loss_curves runs/outer-fp32 runs/outer-int8 --labels fp32,int8 \\
        --out benchmarks/results/outer-comm-loss

writes ``<out>.png`` (training loss per step and validation loss per evaluation of every run) and ``<out>.md``
(final training loss, averaged over the last ``--tail`` steps, and final validation loss of each run, with the
relative difference against the first run, or per run against the run ``--baselines`` names: the same seed's
reference). ``--val-only`` plots the validation losses alone (for many runs). Needs matplotlib (the ``train`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of ``run/metrics.jsonl``."""
    train, val = [], []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            train.append(rec)
        if "val_loss" in rec:
            val.append(rec)
    if not train:
        raise ValueError(f"{run}/metrics.jsonl has no training steps")
    return train, val


def summarize(runs: list[Path], labels: list[str], tail: int, baselines: list[int] | None = None) -> list[dict]:
    """One row per run: its final training loss (mean over the last ``tail`` steps), final validation loss and
    their relative differences against its baseline run (``baselines[i]``: an index into ``runs``; default the
    first run for every row, e.g. the same seed's reference run when the runs are seeds)."""
    rows = []
    for run, label in zip(runs, labels):
        train, val = read_metrics(run)
        last = [r["loss"] for r in train[-tail:]]
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
        rows.append({"label": label, "run": str(run), "steps": train[-1]["step"],
                     "train_tail": sum(last) / len(last), "val_last": val[-1]["val_loss"] if val else None,
                     "outer_comm_dtype": config.get("outer_comm_dtype"),
                     "fsdp_outer_degree": config.get("fsdp_outer_degree")})
    for i, row in enumerate(rows):
        base = rows[baselines[i] if baselines else 0]
        row["baseline"] = base["label"]
        row["train_rel"] = row["train_tail"] / base["train_tail"] - 1
        row["val_rel"] = (None if row["val_last"] is None or base["val_last"] is None
                          else row["val_last"] / base["val_last"] - 1)
    return rows


def plot(runs: list[Path], labels: list[str], path: Path, val_only: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.5) if val_only else (7, 4.5))
    for run, label in zip(runs, labels):
        train, val = read_metrics(run)
        if val_only:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", lw=1.5, ms=3, label=label)
            continue
        line, = ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.8,
                        label=f"{label} train")
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", lw=1.5, color=line.get_color(),
                    label=f"{label} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    if val_only:
        ax.set_title("validation loss")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rows: list[dict], tail: int) -> str:
    out = [f"| run | outer degree | outer_comm_dtype | steps | train loss (mean of last {tail}) | vs baseline | "
           "last val loss | vs baseline | baseline |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = "-" if r["val_last"] is None else f"{r['val_last']:.4f}"
        val_rel = "-" if r["val_rel"] is None else f"{100 * r['val_rel']:+.2f}%"
        out.append(f"| {r['label']} | {r['fsdp_outer_degree']} | {r['outer_comm_dtype']} | {r['steps']} | "
                   f"{r['train_tail']:.4f} | {100 * r['train_rel']:+.2f}% | {val} | {val_rel} | {r['baseline']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loss_curves", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (--out of the job); the first is the baseline")
    p.add_argument("--labels", default=None, help="comma-separated, one per run (default: the folder names)")
    p.add_argument("--tail", type=int, default=10, help="steps averaged for the final training loss (default 10)")
    p.add_argument("--out", type=Path, required=True, help="path without suffix: writes OUT.png and OUT.md")
    p.add_argument("--baselines", default=None,
                   help="comma-separated, per run the index of the run it is compared with (default: 0 for all)")
    p.add_argument("--val-only", action="store_true", help="plot the validation losses only")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        p.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    if args.tail < 1:
        p.error(f"--tail must be >= 1, got {args.tail}")
    baselines = [int(i) for i in args.baselines.split(",")] if args.baselines else None
    if baselines is not None and (len(baselines) != len(args.runs) or
                                  not all(0 <= i < len(args.runs) for i in baselines)):
        p.error(f"--baselines needs {len(args.runs)} indices in 0 .. {len(args.runs) - 1}, got {args.baselines}")
    rows = summarize(args.runs, labels, args.tail, baselines)
    plot(args.runs, labels, args.out.with_suffix(".png"), val_only=args.val_only)
    text = report(rows, args.tail)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text, end="")
    print(f"wrote {args.out.with_suffix('.png')}, .md, .json")


if __name__ == "__main__":
    main()
