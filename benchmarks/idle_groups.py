"""What idle gloo process groups cost a training step, and what one shared transport device saves.

    python -m benchmarks.idle_groups --rounds 4 --name idle-groups

Every gloo process group that torch creates runs a TCP event loop thread that wakes every 10 ms, also when its
group never communicates; a ``Topology`` creates about a dozen groups per rank, some of one rank ([Note: one gloo
device for many groups] in ``shardfusion/_runtime/gloo_device.py``). This runs DDP's step of the ``comm`` regime's
GPT on 4 gloo ranks (`benchmarks/step_worker.py`'s step) in three variants, interleaved in rotated order:

- ``ddp``: as it is;
- ``ddp+idle``: with ``--groups`` process groups of one rank each beside it (created as torch creates them, each
  with its own device and loop thread), never used;
- ``ddp+idle-shared``: the same groups created inside ``shared_gloo_device()`` (one device, one loop thread).

Per variant: the median step (the slowest rank's) and the CPU seconds per step summed over the ranks (every thread,
``time.process_time``), and their paired ratios to ``ddp`` (each round's ratio, then the median).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

VARIANTS = ("ddp", "ddp+idle", "ddp+idle-shared")
RESULTS = Path(__file__).resolve().parent / "results"


def _worker(variant: str, groups: int, warmup: int, steps: int) -> dict:
    import contextlib

    import torch.distributed as dist

    from benchmarks.spawn import join
    from benchmarks.step_worker import REGIMES, _build
    from shardfusion._runtime.gloo_device import shared_gloo_device

    join("cpu")
    world = dist.get_world_size()
    idle = []
    with shared_gloo_device() if variant == "ddp+idle-shared" else contextlib.nullcontext():
        for _ in range(groups if variant != "ddp" else 0):  # one group of one rank per rank, each call
            idle.append(dist.new_subgroups_by_enumeration([[r] for r in range(world)])[0])
    model, clip = _build("ddp", "comm", 1, "after_backward")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, seq = REGIMES["comm"][:2]
    gen = torch.Generator().manual_seed(43 + dist.get_rank())
    wall, cpu = [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        tok = torch.randint(0, 256, (batch, seq + 1), generator=gen)  # (B, T+1) int64
        _, loss = model(tok[:, :-1], tok[:, 1:])
        loss.backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"wall_s": wall, "cpu_s": cpu, "threads": len(os.listdir("/proc/self/task"))}


def run(args) -> dict:
    from benchmarks.provenance import RunRecord
    from benchmarks.spawn import run_workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rounds: list[dict] = []
    with RunRecord() as record:
        for r in range(args.rounds):
            got = {}
            for name in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                out = run_workers(_worker, (name, args.groups, args.warmup, args.steps), 4)
                if out is None:
                    raise SystemExit(f"variant {name} failed")
                got[name] = {
                    "wall_s": statistics.median(max(o["wall_s"][i] for o in out.values()) for i in range(args.steps)),
                    "cpu_s": statistics.median(sum(o["cpu_s"][i] for o in out.values()) for i in range(args.steps)),
                    "threads": out[0]["threads"]}
            rounds.append(got)
    summary = {}
    for name in VARIANTS:
        summary[name] = {key: statistics.median(rd[name][key] for rd in rounds) for key in ("wall_s", "cpu_s")}
        summary[name]["threads"] = rounds[-1][name]["threads"]
        for key in ("wall_s", "cpu_s"):
            summary[name][f"{key}_vs_ddp"] = statistics.median(rd[name][key] / rd["ddp"][key] for rd in rounds)
    return {"config": vars(args), "env": record.as_dict(), "rounds": rounds, "summary": summary}


def report(result: dict) -> str:
    from benchmarks.provenance import describe

    s, cfg = result["summary"], result["config"]
    lines = [f"# Idle gloo groups beside a step: {cfg['name']}", "",
             f"DDP's comm-regime step on 4 gloo ranks, with {cfg['groups']} idle one-rank groups per rank beside it "
             f"or not; {cfg['rounds']} rounds x ({cfg['warmup']} warm-up + {cfg['steps']} timed steps), variants "
             "interleaved; medians, ratios paired per round.", "", describe(result["env"]), "",
             "| variant | threads (rank 0) | step ms | vs ddp | CPU ms per step (4 ranks) | vs ddp |",
             "|---|---|---|---|---|---|"]
    for name, v in s.items():
        lines.append(f"| {name} | {v['threads']} | {1e3 * v['wall_s']:.1f} | {v['wall_s_vs_ddp']:.3f} | "
                     f"{1e3 * v['cpu_s']:.1f} | {v['cpu_s_vs_ddp']:.3f} |")
    return "\n".join(lines + [""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--name", default="idle-groups")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    from benchmarks.provenance import write_result

    result = run(args)
    write_result(Path(args.out_dir), args.name, result, report(result))


if __name__ == "__main__":
    main()
