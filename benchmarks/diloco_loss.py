"""DiLoCo's outer optimizer against synchronous HSDP on the default training run, at equal tokens, paired.

The default run of the job (`python -m shardfusion.train` with no flags, what ``make train`` runs: the small MoE
preset, 4 ranks as HSDP 2 x 2, 200 steps, the same global batches in every run) three ways, seed by seed:

- ``sync``: as it is (``--outer-sync every-step``, one gradient all-reduce across the replicas per step);
- ``diloco``: ``--outer-sync diloco`` with the job's defaults (H = --outer-every, the default outer optimizer);
- ``diloco-paper``: the same with the paper's outer optimizer (``--outer-lr 0.7 --outer-momentum 0.9``).

The variants are interleaved (seed 42: sync, diloco, diloco-paper; then 43; then 44), so a load that changes during
the benchmark touches every variant alike; the losses do not depend on the load (fixed seeds, CPU, gloo), the
seconds do. The table gives each run's final validation loss, its ratio to the synchronous run of its seed, and the
means over the seeds with the ratio of the means: the figure the job's default is chosen by (within 3 % of the
synchronous runs' mean; docs/slow-links.md)::

    python -m benchmarks.diloco_loss            # 9 runs, about 30 minutes on a quiet 2-core machine

writes ``benchmarks/results/diloco-loss.json`` (every figure, the commit, the machine and its load before and
after each run), ``.md`` (the table), ``.png`` (the validation curves; needs matplotlib, the ``train`` extra) and
each run's ``config.json`` and ``summary.json`` under ``benchmarks/results/diloco-runs/<variant>-<seed>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.loss_curves import plot
from benchmarks.provenance import write_result

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
VARIANTS = {
    "sync": ("synchronous (every step)", []),
    "diloco": ("DiLoCo, the job's defaults", ["--outer-sync", "diloco"]),
    "diloco-paper": ("DiLoCo, the paper's outer optimizer (lr 0.7, Nesterov 0.9)",
                     ["--outer-sync", "diloco", "--outer-lr", "0.7", "--outer-momentum", "0.9"]),
}
"""name: (label, the flags added to the default run)."""
BASELINE = "sync"
GOAL = 0.03
"""The job's default DiLoCo ends within this fraction of the synchronous runs' mean final validation loss."""


def git_commit() -> dict:
    """The commit the benchmark ran at, and whether the work tree had changes to tracked files."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def load() -> list[float]:
    """The machine's load averages over 1, 5 and 15 minutes."""
    return [round(x, 2) for x in os.getloadavg()]


def train(variant: str, seed: int, out: Path, extra: list[str]) -> dict:
    """One default run of the job (plus the variant's flags) in ``out``; returns its figures.

    Raises:
        RuntimeError: the run failed (its last output lines).
    """
    command = [sys.executable, "-m", "shardfusion.train", "--seed", str(seed), "--out", str(out), "--no-progress",
               *VARIANTS[variant][1], *extra]
    before, t0 = load(), time.time()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall_s, after = time.time() - t0, load()
    if result.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                           f"{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    outer = summary.get("outer_sync")
    return {"variant": variant, "seed": seed, "flags": command[3:], "final_val_loss": summary["final_val_loss"],
            "first_val_loss": summary["first_val_loss"], "final_train_loss_mean10": summary["final_train_loss_mean10"],
            "outer_sync": outer, "replicate_bytes_per_step":
                summary["comm"]["per_step"]["replicate_all_reduce"]["wire_bytes"],
            "tokens_per_s": summary["tokens_per_s"], "wall_s": round(wall_s, 1), "load_before": before,
            "load_after": after}


def table(runs: list[dict], variants: list[str], seeds: list[int]) -> dict:
    """Per variant: the final validation loss per seed, its ratio to the baseline of that seed, the mean over the
    seeds and the ratio of the means."""
    by = {(r["variant"], r["seed"]): r["final_val_loss"] for r in runs}
    rows = {}
    for v in variants:
        losses = [by[v, s] for s in seeds]
        mean = sum(losses) / len(losses)
        row = {"label": VARIANTS[v][0], "final_val_loss": dict(zip(map(str, seeds), losses)), "mean": mean}
        if BASELINE in variants:
            base = sum(by[BASELINE, s] for s in seeds) / len(seeds)
            row["ratio_per_seed"] = {str(s): by[v, s] / by[BASELINE, s] for s in seeds}
            row["ratio_of_means"] = mean / base
        outer = next(r["outer_sync"] for r in runs if r["variant"] == v)
        if outer:
            row["outer"] = {k: outer[k] for k in ("every", "lr", "momentum", "fragments", "outer_steps")}
        rows[v] = row
    return rows


def markdown(result: dict) -> str:
    seeds, rows = result["seeds"], result["table"]
    side_by_side = f" (the variants of a seed {result['jobs']} at a time)" if result["jobs"] > 1 else ""
    head = ["# DiLoCo's outer optimizer against synchronous HSDP: the default run, seeds "
            f"{', '.join(map(str, seeds))}", "",
            f"`{result['command']}` at commit {result['commit']['commit'][:12]}"
            f"{' (with uncommitted changes)' if result['commit']['dirty'] else ''}, {result['machine']['cpu_count']}"
            f" CPUs; load (1 min) from {result['load_range'][0]} to {result['load_range'][1]} over the runs. Final "
            "validation loss (nats/byte) of each run, x its seed's synchronous run; the last column: the mean over "
            "the seeds, x the synchronous mean. Runs interleaved seed by seed"
            f"{side_by_side}; run "
            f"folders in `benchmarks/results/{result['runs_dir']}/`.", "",
            "| variant | H | outer lr | outer momentum | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
            "|---|---|---|---|" + "---|" * (len(seeds) + 1)]
    for v, row in rows.items():
        outer = row.get("outer") or {"every": 1, "lr": "-", "momentum": "-"}
        cells = []
        for s in map(str, seeds):
            ratio = row.get("ratio_per_seed", {}).get(s)
            cells.append(f"{row['final_val_loss'][s]:.4f}" + (f" (x{ratio:.3f})" if ratio and v != BASELINE else ""))
        mean = f"{row['mean']:.4f}" + (f" (x{row['ratio_of_means']:.3f})" if v != BASELINE and "ratio_of_means" in row
                                       else "")
        head.append(f"| {row['label']} | {outer['every']} | {outer['lr']} | {outer['momentum']} | "
                    f"{' | '.join(cells)} | {mean} |")
    goal = result.get("goal")
    if goal:
        head += ["", f"The job's default DiLoCo ends at x{goal['ratio_of_means']:.3f} of the synchronous mean: "
                 f"{'within' if goal['met'] else 'NOT within'} the goal of x{1 + GOAL:.2f}."]
    head += ["", f"![validation loss]({result['name']}.png)", ""]
    return "\n".join(head)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diloco_loss", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,43,44", help="comma-separated (default 42,43,44)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    p.add_argument("--name", default="diloco-loss",
                   help="result name under benchmarks/results/ (default diloco-loss; run folders in NAME-runs/ "
                        "unless the name is the default, whose folders are diloco-runs/)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs of one seed at a time (default 1; the variants of a seed run side by side with more, "
                        "in the same load window: the losses do not change, the seconds do)")
    p.add_argument("--extra", default="", help="flags added to every run, space-separated (e.g. '--steps 40' for "
                   "a smoke run; the default run has none)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    extra = args.extra.split()
    command = "python -m benchmarks.diloco_loss" + "".join(
        f" {flag} {value!r}" if " " in value else f" {flag} {value}"
        for flag, value, default in (("--seeds", args.seeds, "42,43,44"), ("--variants", args.variants,
                                     ",".join(VARIANTS)), ("--name", args.name, "diloco-loss"),
                                    ("--jobs", str(args.jobs), "1"), ("--extra", args.extra, "")) if value != default)
    runs_dir = RESULTS / ("diloco-runs" if args.name == "diloco-loss" else f"{args.name}-runs")
    commit = git_commit()  # before the runs: the code they ran
    runs, folders, labels = [], [], []
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    with tempfile.TemporaryDirectory(prefix="diloco-loss-") as work, ThreadPoolExecutor(args.jobs) as pool:
        for seed in seeds:
            outs = [Path(work) / f"{v}-{seed}" for v in variants]
            for v, out, r in zip(variants, outs, pool.map(lambda vo: train(vo[0], seed, vo[1], extra),
                                                         zip(variants, outs))):
                runs.append(r)
                folders.append(out)
                labels.append(f"{v} seed {seed}")
                print(f"{v} seed {seed}: final val loss {r['final_val_loss']:.4f} ({r['wall_s']:.0f} s, load "
                      f"{r['load_before'][0]} -> {r['load_after'][0]})", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        try:
            plot(folders, labels, RESULTS / f"{args.name}.png", val_only=True)
        except ImportError as error:  # matplotlib: the train extra
            print(f"no plot: {error}")
        if runs_dir.exists():
            shutil.rmtree(runs_dir)
        for out in folders:
            (runs_dir / out.name).mkdir(parents=True)
            for name in ("config.json", "summary.json"):
                shutil.copy(out / name, runs_dir / out.name / name)
    rows = table(runs, variants, seeds)
    loads = [x for r in runs for x in (r["load_before"][0], r["load_after"][0])]
    result = {"benchmark": "diloco_loss", "command": command, "commit": commit,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0], "torch": __import__("torch").__version__},
              "name": args.name, "runs_dir": runs_dir.name, "jobs": args.jobs, "seeds": seeds, "variants": variants,
              "extra": extra, "load_range": [min(loads), max(loads)], "runs": runs, "table": rows}
    if "diloco" in rows and "ratio_of_means" in rows["diloco"]:
        ratio = rows["diloco"]["ratio_of_means"]
        result["goal"] = {"ratio_of_means": ratio, "limit": 1 + GOAL, "met": ratio <= 1 + GOAL}
    write_result(RESULTS, args.name, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
