"""What gloo's network loop threads cost a pair exchange, scheduled as torch leaves them or as batch work.

    python -m benchmarks.gloo_spin --rounds 4 --name gloo-spin

A gloo TCP pair has one lock; a thread that sends holds it while it writes the whole message, and the loop thread
that reads the same socket only tries it and polls again at once ([Note: gloo loop threads as batch work] in
``shardfusion/_runtime/gloo_device.py``). This times the exchange that HSDP's inner pairs run for every unit (the
all-gather of a pair through ``shardfusion.comm``: a send of this rank's shard, a receive of the peer's) on 4 gloo
ranks in two pairs, ``--numel`` fp32 elements per shard (400,000: 1.6 MB, a block of the `comm` regime's GPT under
HSDP 2 x 2), in two variants, interleaved in rotated order:

- ``torch``: the pair groups made as torch makes them (their loop threads scheduled as torch leaves them);
- ``batch``: the same groups made inside ``shared_gloo_device()``, whose loop threads run as ``SCHED_BATCH``.

Per variant: the median exchange (the slowest rank's wall time) and the CPU seconds per exchange summed over the
ranks (every thread, ``time.process_time``), and their paired ratios to ``torch``. Linux only (the policy).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from benchmarks.rounds import add_run_args, interleaved, paired_summary, run_and_store

VARIANTS = ("torch", "batch")


def _worker(variant: str, numel: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from benchmarks.spawn import join
    from shardfusion import comm
    from shardfusion._runtime.gloo_device import shared_gloo_device

    join("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    with shared_gloo_device() if variant == "batch" else contextlib.nullcontext():
        pair = dist.new_subgroups_by_enumeration([[r, r + 1] for r in range(0, world, 2)])[0]
    shard = torch.full((numel,), float(rank))  # (S,) fp32
    full = torch.empty(2 * numel)  # (2S,)
    wall, cpu = [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        comm.all_gather(full, shard, pair)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    first = rank - rank % 2
    if not (torch.equal(full[:numel], torch.full((numel,), float(first)))
            and torch.equal(full[numel:], torch.full((numel,), float(first + 1)))):
        raise RuntimeError(f"rank {rank}: the exchange gathered wrong values")
    return {"wall_s": wall, "cpu_s": cpu}


def run(args) -> dict:
    rounds, env = interleaved(_worker, VARIANTS, args.rounds, lambda name: (name, args.numel, args.warmup, args.steps),
                              args.steps)
    return {"config": vars(args), "env": env, "rounds": rounds,
            "summary": paired_summary(rounds, VARIANTS, base="torch")}


def report(result: dict) -> str:
    from benchmarks.provenance import describe

    s, cfg = result["summary"], result["config"]
    lines = [f"# gloo pair exchange by loop-thread scheduling: {cfg['name']}", "",
             f"4 gloo ranks in 2 pairs; each exchange gathers {cfg['numel']} fp32 elements per rank over its pair "
             f"(`shardfusion.comm.all_gather`); {cfg['rounds']} rounds x ({cfg['warmup']} warm-up + {cfg['steps']} "
             "timed exchanges), variants interleaved; medians, ratios paired per round.", "",
             describe(result["env"]), "",
             "| variant | exchange ms | vs torch | CPU ms per exchange (4 ranks) | vs torch |", "|---|---|---|---|---|"]
    for name, v in s.items():
        lines.append(f"| {name} | {1e3 * v['wall_s']:.3f} | {v['wall_s_vs_torch']:.3f} | {1e3 * v['cpu_s']:.3f} | "
                     f"{v['cpu_s_vs_torch']:.3f} |")
    return "\n".join(lines + [""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=400_000)
    add_run_args(p, "gloo-spin", rounds=4)
    run_and_store(p, run, report, argv)


if __name__ == "__main__":
    main()
