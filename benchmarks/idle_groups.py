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
import time

import torch

from benchmarks.rounds import add_run_args, interleaved, paired_summary, run_and_store

VARIANTS = ("ddp", "ddp+idle", "ddp+idle-shared")


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
    rounds, env = interleaved(_worker, VARIANTS, args.rounds, lambda name: (name, args.groups, args.warmup, args.steps),
                              args.steps, keep=("threads",))
    summary = paired_summary(rounds, VARIANTS)
    for name in VARIANTS:
        summary[name]["threads"] = rounds[-1][name]["threads"]
    return {"config": vars(args), "env": env, "rounds": rounds, "summary": summary}


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
    add_run_args(p, "idle-groups", rounds=4)
    run_and_store(p, run, report, argv)


if __name__ == "__main__":
    main()
