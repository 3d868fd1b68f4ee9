"""What a training run writes to its output folder: metrics.jsonl, loss.png, summary.json.

metrics.jsonl holds one JSON object per line. Training records (one per optimizer step) carry
`step, loss, grad_norm, lr, tokens_per_s, elapsed_s` (`loss` is the cross-entropy); a GPT-MoE's also carry
`aux_loss, tokens_per_expert, load_balance, worst_layer_balance` (see `expert_balance`), and every one carries
`comm`: the step's collectives on rank 0 per accounting category (`comm_step_record`). Evaluation records carry
`step, val_loss, val_bpb, elapsed_s`, where `step` counts the optimizer steps done (0: before training: the
pretrained model's figures with --init-from), `val_loss` is the mean cross-entropy in nats per token and `val_bpb`
the same loss in bits per byte of text (comparable across tokenizers; docs/data.md). The first training record
after a resume also carries `resumed_from_step`. Only rank 0 writes (each replica group's under fault tolerance);
`MetricsLog` also sends each record to the experiment trackers of --log (`shardfusion.train.trackers`,
docs/trackers.md). loss.png marks the run's events on the loss curves (`run_events`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from shardfusion.accounting import CATEGORIES
from shardfusion.train import run_folder
from shardfusion.train.trackers import open_trackers, scalars

TRAIN_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s")
"""Keys of every training record in metrics.jsonl."""

VAL_KEYS = ("step", "val_loss", "val_bpb", "elapsed_s")
"""Keys of every evaluation record in metrics.jsonl."""

MOE_KEYS = ("aux_loss", "tokens_per_expert", "load_balance", "worst_layer_balance")
"""Further keys of every training record of a GPT-MoE run."""

COMM_FIELDS = ("count", "wire_bytes", "cross_node_bytes", "wait_s")
"""Figures per accounting category in a training record's `comm` (see `comm_step_record`)."""

CATEGORY_NAMES = {"inner_all_gather": "inner all-gather", "inner_reduce_scatter": "inner reduce-scatter",
                  "replicate_all_reduce": "replicate all-reduce", "ep_all_to_all": "ep all-to-all",
                  "context_parallel": "context K/V gather", "other": "other"}
"""How the printed summary names each accounting category."""


def comm_step_record(summary: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """A training record's `comm` from one step's `CommCounter.summary()`: for every category of
    `shardfusion.accounting.CATEGORIES` (in order, zeros included), the `COMM_FIELDS`: collectives issued, bytes this
    rank sent (ring formulas), the part of them that crossed nodes, and host seconds spent waiting for them."""
    return {cat: {f: summary[cat][f] for f in COMM_FIELDS} for cat in CATEGORIES}


def comm_per_step(train: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The mean over `train` records of each category's `COMM_FIELDS` (records without `comm` are skipped)."""
    steps = [r["comm"] for r in train if "comm" in r]
    return {cat: {f: sum(s[cat][f] for s in steps) / len(steps) if steps else math.nan for f in COMM_FIELDS}
            for cat in CATEGORIES}


def expert_balance(load: list[list[int]]) -> dict[str, Any]:
    """Load-balance figures of one step from `load`, the (L, E) token assignments per MoE layer and expert, summed
    over the data-parallel ranks.

    Returns `tokens_per_expert` (the E counts summed over the layers), `load_balance` (max / mean of those counts)
    and `worst_layer_balance` (the largest max / mean of one layer's counts). A balance of 1.0 is a perfectly even
    load; E / top_k means every token went to the same top_k experts.
    """
    def ratio(counts: list[int]) -> float:
        mean = sum(counts) / len(counts) if counts else 0.0
        return max(counts) / mean if mean > 0 else math.nan

    totals = [sum(column) for column in zip(*load)]
    return {"tokens_per_expert": totals, "load_balance": ratio(totals),
            "worst_layer_balance": max((ratio(layer) for layer in load), default=math.nan)}


class MetricsLog:
    """Appends records to OUT/metrics.jsonl and keeps them in memory for the plot and the summary; with ``log``
    (``--log``'s tracker names, `shardfusion.train.trackers`) also writes each record to those experiment trackers,
    with ``config`` (the run's config.json) as their hyperparameters. Only the process that writes metrics.jsonl
    makes one (rank 0; each replica group's rank 0 under fault tolerance).

    A new log starts the file empty. `resume_step` continues a run resumed from the checkpoint of that step: the
    file's records up to that step are kept (and loaded); the later ones, which the resumed run computes again, and
    lines a crash left unreadable move to OUT/metrics.dropped.jsonl (appended, never deleted). The first training
    record after a resume carries ``resumed_from_step`` (the checkpoint's step), so the run's resume points stay in
    metrics.jsonl (the loss plot marks them). A tracker that held nothing of this run first receives the kept
    records. `close` closes the trackers.
    """

    def __init__(self, out: Path, resume_step: Optional[int] = None, *, log: Sequence[str] = (),
                 config: Optional[dict[str, Any]] = None) -> None:
        self.path = out / run_folder.METRICS
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []
        self.dropped = 0
        """Records moved to metrics.dropped.jsonl by a resume."""
        self._resumed_from = resume_step
        if resume_step is None or not self.path.exists():
            self.path.write_text("")
        else:
            self._resume(out, resume_step)
        self.trackers = open_trackers(log, out, config or {}, resume_step)
        """The experiment trackers each record also goes to (`shardfusion.train.trackers.Tracker`)."""
        for tracker in self.trackers:
            if tracker.fresh:
                for record in sorted(self.train + self.val, key=lambda r: r["step"]):
                    tracker.log(scalars(record), record["step"])

    def _resume(self, out: Path, resume_step: int) -> None:
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a crash while it was written
                dropped.append(line)
                continue
            if record["step"] <= resume_step:
                kept.append(line)
                (self.val if "val_loss" in record else self.train).append(record)
            else:
                dropped.append(line)
        if dropped:
            with (out / run_folder.METRICS_DROPPED).open("a") as f:
                f.write("".join(line + "\n" for line in dropped))
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self.dropped = len(dropped)

    def _append(self, record: dict[str, Any], keys, store: list, kind: str) -> None:
        missing = set(keys) - set(record)
        if missing:
            raise ValueError(f"{kind} record lacks {sorted(missing)}")
        store.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(scalars(record), record["step"])

    def log_train(self, **record: Any) -> None:
        """Append one training-step record (keys ``TRAIN_KEYS`` at least) to memory and ``metrics.jsonl`` (the
        first after a resume adds ``resumed_from_step``) and write it to the trackers.

        Raises:
            ValueError: a required key is missing (the message lists them).
        """
        if self._resumed_from is not None:
            record = {**record, "resumed_from_step": self._resumed_from}
        self._append(record, TRAIN_KEYS, self.train, "training")
        self._resumed_from = None

    def log_val(self, **record: Any) -> None:
        """Append one evaluation record (keys ``VAL_KEYS`` at least) to memory and ``metrics.jsonl`` and write it
        to the trackers.

        Raises:
            ValueError: a required key is missing (the message lists them).
        """
        self._append(record, VAL_KEYS, self.val, "evaluation")

    def log_image(self, path: Path) -> None:
        """Write the PNG at ``path`` (the loss plot) to the trackers, at the last step logged."""
        step = max((r["step"] for r in self.train + self.val), default=0)
        for tracker in self.trackers:
            tracker.image(path, step)

    def close(self) -> None:
        """Close the trackers (metrics.jsonl is closed after every record); the log takes no records after."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, evaluation records) from a metrics.jsonl file."""
    train, val = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (val if "val_loss" in record else train).append(record)
    return train, val


EVENTS = {
    "outer_sync": ("outer sync (DiLoCo)", dict(marker="^", color="tab:purple")),
    "group_lost": ("replica group lost", dict(ls="--", color="tab:red")),
    "group_joined": ("replica group joined", dict(ls="--", color="tab:green")),
    "discarded": ("step discarded", dict(marker="x", color="tab:red")),
    "recovered": ("recovered from a peer", dict(ls="-.", color="tab:olive")),
    "resumed": ("resumed from checkpoint", dict(ls=":", color="black")),
}
"""The events `plot_losses` marks, by `run_events` key: their legend label and style. Those with a marker are
drawn on the training-loss curve; the others are vertical lines across the panel."""


def run_events(train: list[dict[str, Any]], ft: Optional[dict[str, Any]] = None) -> dict[str, list[int]]:
    """The steps of a run's events (keys of `EVENTS`) from its training records and, under fault tolerance, the
    summary's ``fault_tolerance`` record ``ft`` (`shardfusion.train.job_ft.FTRun.report`, this process's):

    - ``outer_sync``: the steps after which DiLoCo ran an outer step (``outer_synced`` not empty);
    - ``group_lost`` / ``group_joined``: the first step with fewer / more replica groups in the quorum than the
      step before (``ft_participants``);
    - ``discarded``: the steps the quorum discarded (and trained again), from ``ft``;
    - ``recovered``: the steps at which this group received a live peer's state, from ``ft``;
    - ``resumed``: the checkpoint steps the run resumed from (``resumed_from_step``, `MetricsLog`).
    """
    events: dict[str, list[int]] = {key: [] for key in EVENTS}
    before = None
    for r in train:
        if r.get("outer_synced"):
            events["outer_sync"].append(r["step"])
        if "resumed_from_step" in r:
            events["resumed"].append(r["resumed_from_step"])
        now = r.get("ft_participants")
        if before is not None and now is not None and now != before:
            events["group_lost" if now < before else "group_joined"].append(r["step"])
        before = now if now is not None else before
    if ft is not None:
        events["discarded"] = sorted({d["step"] for d in ft.get("discarded", [])})
        events["recovered"] = sorted({r["step"] for r in ft.get("recoveries", [])})
    return events


def _draw_events(ax: Any, train: list[dict[str, Any]], events: dict[str, list[int]]) -> None:
    """Mark ``events`` (`run_events`) on ``ax``: markers on the training-loss curve, or vertical lines."""
    loss_at = {r["step"]: r["loss"] for r in train}
    for key, steps in events.items():
        if not steps:
            continue
        label, style = EVENTS[key]
        if "marker" in style:
            # a discarded step has no record (it was trained again): mark it at the step before's loss
            ys = [loss_at.get(s, loss_at.get(s - 1, math.nan)) for s in steps]
            ax.plot(steps, ys, ls="none", ms=6, label=label, **style)
        else:
            for i, step in enumerate(steps):
                ax.axvline(step, lw=1, alpha=0.7, label=label if i == 0 else None, **style)


def plot_losses(log: MetricsLog, path: Path, title: str = "", ft: Optional[dict[str, Any]] = None) -> Any:
    """Training loss per step and validation loss per evaluation, in one PNG at ``path``, with the run's events
    on the same step axis (`run_events`: DiLoCo's outer syncs, replica groups lost and joined, discarded steps and
    recoveries under fault tolerance (``ft``: the summary's ``fault_tolerance`` record), resume points); for a
    GPT-MoE run a second panel below shows the auxiliary (load-balancing) loss and the load balance per step. The
    plot also goes to the log's experiment trackers (`MetricsLog.log_image`). Returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = bool(log.train) and "aux_loss" in log.train[0]
    if moe:
        fig, (ax, ax_moe) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=(2, 1))
        steps = [r["step"] for r in log.train]
        ax_moe.plot(steps, [r["aux_loss"] for r in log.train], lw=1, label="aux loss")
        ax_moe.plot(steps, [r["load_balance"] for r in log.train], lw=1, label="load balance (max / mean)")
        ax_moe.plot(steps, [r["worst_layer_balance"] for r in log.train], lw=1, alpha=0.7,
                    label="worst layer's balance")
        ax_moe.set_xlabel("optimizer step")
        ax_moe.grid(alpha=0.3)
        ax_moe.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.set_xlabel("optimizer step")
    if log.train:
        ax.plot([r["step"] for r in log.train], [r["loss"] for r in log.train], lw=1, alpha=0.8, label="train")
    if log.val:
        ax.plot([r["step"] for r in log.val], [r["val_loss"] for r in log.val], "o-", lw=2, label="val")
    _draw_events(ax, log.train, run_events(log.train, ft))
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.log_image(path)
    return fig


def summarize(log: MetricsLog, *, total_s: float, train_s: float, steps: int, num_params: int, layout: str,
              sample: str | None, experts: dict[str, Any] | None = None,
              comm: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's headline figures as a JSON-ready dict.

    `comm` describes the accounting (`ranks_per_node`, `nodes`, `ranks_per_node_from`); the summary then holds it
    under "comm", with `per_step` (`comm_per_step`: the mean per step of each category's figures, rank 0's, over the
    `steps` records that have them: those of runs this one resumed included) and
    the totals per step over the categories: `wire_bytes_per_step`, `cross_node_bytes_per_step`, `wait_s_per_step`.

    For a GPT-MoE run, `experts` describes the model (e.g. `n_experts, top_k, ep, num_active_params`); the summary
    then holds it under "experts", with the last step's `aux_loss`, `tokens_per_expert`, `load_balance` and
    `worst_layer_balance` (see `expert_balance`) and the mean aux loss of the last 10 steps added."""
    first_val = log.val[0]["val_loss"] if log.val else math.nan
    final_val = log.val[-1]["val_loss"] if log.val else math.nan
    first_bpb = log.val[0].get("val_bpb", math.nan) if log.val else math.nan  # records of older runs lack it
    final_bpb = log.val[-1].get("val_bpb", math.nan) if log.val else math.nan
    drop = 100.0 * (first_val - final_val) / first_val if log.val and first_val else math.nan
    tail = [r["loss"] for r in log.train[-10:]]
    if experts is not None:
        last = log.train[-1] if log.train else {}
        aux_tail = [r["aux_loss"] for r in log.train[-10:]]
        experts = {**experts,
                   "final_aux_loss": last.get("aux_loss", math.nan),
                   "final_aux_loss_mean10": sum(aux_tail) / len(aux_tail) if aux_tail else math.nan,
                   "tokens_per_expert": last.get("tokens_per_expert"),
                   "load_balance": last.get("load_balance", math.nan),
                   "worst_layer_balance": last.get("worst_layer_balance", math.nan)}
    if comm is not None:
        per_step = comm_per_step(log.train)
        comm = {**comm, "per_step": per_step, "steps": sum("comm" in r for r in log.train),
                **{f"{f}_per_step": sum(row[f] for row in per_step.values())
                   for f in ("wire_bytes", "cross_node_bytes", "wait_s")}}
    return {
        "final_train_loss": log.train[-1]["loss"] if log.train else math.nan,
        "final_train_loss_mean10": sum(tail) / len(tail) if tail else math.nan,
        "first_val_loss": first_val,
        "final_val_loss": final_val,
        "val_loss_drop_pct": drop,
        "first_val_bpb": first_bpb,
        "final_val_bpb": final_bpb,
        "total_s": total_s,
        "train_s": train_s,
        "steps": steps,
        "steps_per_s": steps / train_s if train_s > 0 else math.nan,
        "tokens_per_s": (sum(r["tokens_per_s"] for r in log.train[1:]) / max(1, len(log.train) - 1)
                         if log.train else math.nan),
        "num_params": num_params,
        "layout": layout,
        "experts": experts,
        "comm": comm,
        "sample": sample,
    }


def _format_bytes(n: float) -> str:
    """``n`` bytes in B, kB, MB or GB (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_comm(comm: dict[str, Any], steps: int) -> list[str]:
    """The summary's communication table: per category, per step (mean), rank 0's figures."""
    rpn: Optional[int] = comm["ranks_per_node"]
    nodes = (f"{comm['nodes']} node{'s' if comm['nodes'] != 1 else ''} of {rpn} ranks" if rpn is not None
             else "one node")
    lines = [f"comm per step    rank 0, mean of {steps} steps; {nodes} ({comm['ranks_per_node_from']})",
             f"  {'':22s} {'count':>7s} {'on the wire':>12s} {'across nodes':>13s} {'waited':>10s}"]
    for cat, row in comm["per_step"].items():
        count = row["count"]
        count_text = f"{count:.0f}" if float(count).is_integer() else f"{count:.1f}"
        lines.append(f"  {CATEGORY_NAMES.get(cat, cat):22s} {count_text:>7s} {_format_bytes(row['wire_bytes']):>12s} "
                     f"{_format_bytes(row['cross_node_bytes']):>13s} {1e3 * row['wait_s']:>7.1f} ms")
    lines.append(f"  {'total':22s} {'':>7s} {_format_bytes(comm['wire_bytes_per_step']):>12s} "
                 f"{_format_bytes(comm['cross_node_bytes_per_step']):>13s} {1e3 * comm['wait_s_per_step']:>7.1f} ms")
    return lines


def format_pipeline(pipeline: dict[str, Any]) -> list[str]:
    """The summary's pipeline lines (a --pp run: `shardfusion.train.job_pipeline.PipelineRun.report`): the schedule
    and the bubble, then per pp rank its stages, parameters, memory, collectives and point-to-point sends per step."""
    p = pipeline
    lines = [f"pipeline         pp {p['pp']}, {p['schedule']}, {p['stages']} stages ({p['stages_per_rank']} per "
             f"rank), {p['microbatches']} micro-batches of {p['microbatch_sequences']} sequences per data-parallel "
             f"rank; bubble {p['bubble_fraction_theory']:.3f} in theory, {p['bubble_fraction_measured']:.3f} "
             f"measured"]
    for r in p["per_pp_rank"]:
        collectives = sum(row["wire_bytes"] for row in r["comm_per_step"].values())
        lines.append(f"  pp rank {r['pp_rank']} (stages {', '.join(map(str, r['stages']))}): {r['num_params']:,} "
                     f"parameters; shards {_format_bytes(r['param_shard_bytes'])}, optimizer state "
                     f"{_format_bytes(r['optimizer_state_bytes'])}, peak {_format_bytes(r['peak_memory_bytes'])} "
                     f"({r['peak_memory']}); per step {_format_bytes(collectives)} collectives, "
                     f"{_format_bytes(r['p2p_per_step']['wire_bytes'])} P2P; bubble "
                     f"{r['bubble_fraction_measured']:.3f} measured")
    return lines


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
        f"({summary['val_loss_drop_pct']:.1f}% lower) nats/token",
    ]
    if not math.isnan(summary.get("final_val_bpb", math.nan)):
        lines.append(f"val bits/byte    {summary.get('first_val_bpb', math.nan):.4f} -> "
                     f"{summary['final_val_bpb']:.4f}")
    moe = summary.get("experts")
    if moe is not None:
        lines += [
            f"experts          {moe['n_experts']} per layer, top-{moe['top_k']}, ep {moe['ep']}; "
            f"{moe['num_active_params']:,} parameters active per token",
            f"aux loss         {moe['final_aux_loss']:.4f} (last 10 steps: {moe['final_aux_loss_mean10']:.4f})",
            f"tokens/expert    {moe['tokens_per_expert']} (last step, all layers); balance max/mean "
            f"{moe['load_balance']:.3f}, worst layer {moe['worst_layer_balance']:.3f} (1.0 = even)",
        ]
    if summary.get("comm") is not None:
        lines += format_comm(summary["comm"], summary["comm"].get("steps", summary["steps"]))
    if summary.get("pipeline") is not None:
        lines += format_pipeline(summary["pipeline"])
    if summary.get("fault_tolerance") is not None:
        from shardfusion.train.job_ft import format_ft  # noqa: PLC0415 (job_ft imports the training stack)
        lines += format_ft(summary["fault_tolerance"])
    if summary.get("sample") is not None:
        lines += ["sample (validation prompt ⟫ generated):", "-" * 72, summary["sample"], "-" * 72]
    return "\n".join(lines)
