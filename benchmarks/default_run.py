"""The default training run (`make train`, `python -m shardfusion.train` with no flags), stored as a result.

    python -m benchmarks.default_run                   # ~3 minutes on 2 cores; writes benchmarks/results/default-run.*
    python -m benchmarks.default_run --name x -- --steps 20   # flags after -- go to the job (a smoke run)

The job runs as a user starts it, in a fresh output folder, under `benchmarks.provenance.RunRecord` (commit and the
machine's load while it ran). Stored: the job's summary.json figures that the README quotes (parameters, the
validation loss before and after training in nats per token, which is nats per byte for the default byte-level
tokenizer, tokens per second, seconds), the evaluation curve, and the command. Tokens per second move with the
machine's load: read them with ``env.load_during``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))
from benchmarks.provenance import RunRecord, describe, write_result  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SUMMARY_KEYS = ("first_val_loss", "final_val_loss", "first_val_bpb", "final_val_bpb", "final_train_loss",
                "tokens_per_s", "steps", "steps_per_s", "train_s", "total_s", "num_params", "layout")
"""The figures of the job's summary.json kept in the result."""


def run(job_args: list[str], out: Path) -> dict[str, Any]:
    """Run ``python -m shardfusion.train --out OUT --no-progress JOB_ARGS``; returns the result record (raises
    RuntimeError with the job's output tail when it fails)."""
    command = [sys.executable, "-m", "shardfusion.train", "--out", str(out), "--no-progress", *job_args]
    with RunRecord() as record:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the training job failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"name": None, "command": "python -m shardfusion.train" + "".join(f" {a}" for a in job_args),
            "env": record.as_dict(),
            "summary": {**{k: summary[k] for k in SUMMARY_KEYS if k in summary},
                        "num_active_params": config.get("num_active_params"), "world_size": config.get("world_size"),
                        "tokens_per_step": config.get("tokens_per_step")},
            "val_curve": [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    return "\n".join([
        f"# The default training run: {result['name']}", "",
        f"`{result['command']}` ({s['layout']}).", "", describe(result["env"]), "",
        "| figure | value |", "|---|---|",
        f"| parameters (active per token) | {s['num_params']:,} ({s['num_active_params']:,}) |",
        f"| validation loss, nats per token, before -> after | {s['first_val_loss']:.4f} -> "
        f"{s['final_val_loss']:.4f} |",
        f"| steps, training seconds | {s['steps']}, {s['train_s']:.1f} s |",
        f"| tokens/s (mean over steps after the first) | {s['tokens_per_s']:,.0f} |",
        f"| wall seconds (start-up included) | {result['env']['wall_s']:.0f} s |", ""])


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="default-run", help="result file name under --out-dir (default-run)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(own)
    with tempfile.TemporaryDirectory(prefix="shardfusion-default-run-") as tmp:
        result = run(job_args, Path(tmp) / "out")
    result["name"] = args.name
    write_result(Path(args.out_dir), args.name, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
