"""What a dry run itself costs at cluster scale: wall time and peak memory of `sf.dry_run` at 1,024, 4,096 and 16,384
ranks, each in a fresh process, with the time of the topology's construction apart.

    python -m benchmarks.dry_run_scale                        # results/dry-run-scale.{json,md}
    python -m benchmarks.dry_run_scale --worlds 1024 --model 7b
    python -m benchmarks.dry_run_scale --job-preset tiny --worlds 65536,262144,1048576,2097152 \
        --name dry-run-scale-tiny                             # the job's --dry-run of --preset tiny

With ``--job-preset`` each world is the training job's own command, ``python -m shardfusion.train --dry-run
--preset P --world W --ranks-per-node 8`` (its default layout: inner = one node), in a fresh process: its wall time,
CPU time and peak RSS, which fit the bookkeeping per rank of ``shardfusion.dry_run.BOOKKEEPING_BYTES_PER_RANK``;
the commit and the machine's load are recorded with the rows.

The job played: a GPT of the shape ``--model`` (``7b``: 32 layers of width 4096, 32 heads, 4,096 tokens, a
32,000-token vocabulary, untied head, 6.7B parameters; ``small``: 4 layers of 128), bf16 compute and fp32 shards,
one sequence per rank per micro-batch, HSDP with inner 8 (one node of 8 ranks) and world / 8 replicas, AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
MODELS = {
    "7b": {"n_layer": 32, "n_head": 32, "d_model": 4096, "seq_len": 4096, "vocab_size": 32000,
           "tie_embeddings": False},
    "small": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128},
}
RANKS_PER_NODE = 8


def child(world: int, model: str) -> dict:
    """One dry run in this (fresh) process; its figures and costs."""
    import resource

    import torch

    import shardfusion as sf
    from shardfusion.models.gpt import GPT, Block, GPTConfig

    t0 = time.perf_counter()
    config = GPTConfig(**MODELS[model])

    def step(m, topo):
        x = torch.randint(0, config.vocab_size, (1, config.seq_len))
        return m(x, x)[1]

    report = sf.dry_run(lambda topo: GPT(config), step, world_size=world, ranks_per_node=RANKS_PER_NODE,
                        topology={"fsdp_outer_degree": world // RANKS_PER_NODE},
                        fully_shard={"units": (Block,), "mp_policy": sf.MixedPrecisionPolicy(
                            param_dtype=torch.bfloat16, grad_comm_dtype=torch.float32)})
    rank = report.ranks[0]
    return {"world": world, "model": model, "params": sum(p.numel() for p in _meta(config).parameters()),
            "wall_s": time.perf_counter() - t0, "dry_run_s": report.seconds, "seconds": rank.seconds,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "memory": rank.memory, "wire_bytes": rank.wire_bytes, "across_bytes": rank.across_bytes,
            "step_s": report.plan.step_s if report.plan is not None else None, "table": report.table()}


def _meta(config):
    import torch

    from shardfusion.models.gpt import GPT

    with torch.device("meta"):
        return GPT(config)


def markdown(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["# The dry run's own cost at cluster scale", "",
             f"{time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPU cores; each world size in a fresh process "
             "(`python -m benchmarks.dry_run_scale`). Model and layout: the module doc of `benchmarks/dry_run_scale.py`.",
             "", "| ranks | parameters | topology s | wrap s | step s (2 passes) | dry run s | process wall s | peak RSS | "
             "played rank: persistent | peak | sent per step | across nodes | predicted comm step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, s = r["memory"], r["seconds"]
        persistent = m["params"] + m["grads"] + m["optimizer"]
        lines.append(f"| {r['world']:,} | {r['params'] / 1e9:.2f}B | {s['topology']:.1f} | {s['wrap']:.1f} | "
                     f"{s['step']:.1f} + {s.get('step_slow', 0):.1f} | {r['dry_run_s']:.1f} | {r['wall_s']:.1f} | {r['max_rss_bytes'] / gib:.2f} GiB"
                     f" | {persistent / gib:.2f} GiB | {m['peak'] / gib:.2f} (slow: {m['peak_slow'] / gib:.2f}) GiB | "
                     f"{r['wire_bytes'] / 1e9:.2f} GB | "
                     f"{r['across_bytes'] / 1e9:.3f} GB | {r['step_s'] * 1e3:.1f} ms |")
    lines += ["", "The report of the largest run:", "", "```", rows[-1]["table"], "```"]
    return "\n".join(lines)


def job_child(world: int, preset: str) -> dict:
    """The job's dry run of ``--preset`` at ``world`` ranks in a fresh process: wall and CPU seconds, peak RSS."""
    import resource
    import re

    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "shardfusion.train", "--dry-run", "--preset", preset, "--world",
                          str(world), "--ranks-per-node", str(RANKS_PER_NODE)], cwd=REPO, check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # this child only: one per parent process (see main)
    itself = re.search(r"dry run itself: ([0-9.]+) s", out.stdout)
    return {"world": world, "preset": preset, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_rss_bytes": usage.ru_maxrss * 1024, "dry_run_s": float(itself.group(1)) if itself else None,
            "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
            "report": out.stdout}


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def job_markdown(rows: list[dict], commit: str) -> str:
    """The rows of ``--job-preset`` as a table, with the RSS slope per rank between the first and the last."""
    first, last = rows[0], rows[-1]
    slope = (last["max_rss_bytes"] - first["max_rss_bytes"]) / max(1, last["world"] - first["world"])
    lines = ["# The job's dry run at up to millions of ranks", "",
             f"{time.strftime('%Y-%m-%d')}; commit {commit}; {os.cpu_count()} CPU cores; each world a fresh "
             f"`python -m shardfusion.train --dry-run --preset {first['preset']} --world W --ranks-per-node "
             f"{RANKS_PER_NODE}` (`python -m benchmarks.dry_run_scale --job-preset {first['preset']}`). The machine "
             "is shared: wall seconds grow with its load (1-minute load average before and after each row); CPU "
             "seconds (user + system) much less.", "",
             "| ranks | process wall s | CPU s | dry run itself s | peak RSS | load before / after |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']:,} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['dry_run_s']:.1f} | "
                     f"{r['max_rss_bytes'] / 2**30:.2f} GiB | {r['load_before'][0]:.1f} / {r['load_after'][0]:.1f} |")
    lines += ["", f"Peak RSS grows by {slope:,.0f} bytes per rank from {first['world']:,} to {last['world']:,} ranks "
              "(shardfusion.dry_run.BOOKKEEPING_BYTES_PER_RANK bounds it, with a margin).", "",
              f"The report at {last['world']:,} ranks:", "", "```", last["report"].strip(), "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1024,4096,16384")
    p.add_argument("--model", default="7b", choices=sorted(MODELS))
    p.add_argument("--name", default="dry-run-scale")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--job-preset", default=None, help="time the job's --dry-run of this preset instead")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(job_child(args.child, args.job_preset) if args.job_preset else child(args.child, args.model)))
        return 0
    if args.job_preset:  # one parent per world, so that RUSAGE_CHILDREN is that world's run alone
        rows = []
        for world in (int(w) for w in args.worlds.split(",")):
            out = subprocess.run([sys.executable, "-m", "benchmarks.dry_run_scale", "--child", str(world),
                                  "--job-preset", args.job_preset], cwd=REPO, check=True, capture_output=True,
                                 text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"world {world}: {rows[-1]['wall_s']:.1f} s wall, {rows[-1]['cpu_s']:.1f} s CPU, "
                  f"{rows[-1]['max_rss_bytes'] / 2**30:.2f} GiB", flush=True)
        commit = _commit()
        out_dir = Path(args.out_dir)
        (out_dir / f"{args.name}.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
        md = job_markdown(rows, commit)
        (out_dir / f"{args.name}.md").write_text(md + "\n")
        print(md)
        return 0
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        out = subprocess.run([sys.executable, "-m", "benchmarks.dry_run_scale", "--child", str(world), "--model",
                              args.model], cwd=REPO, check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"world {world}: {rows[-1]['wall_s']:.1f} s, {rows[-1]['max_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(rows, indent=1))
    md = markdown(rows)
    (out_dir / f"{args.name}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
