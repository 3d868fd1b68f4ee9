"""Where a step's CPU goes, thread by thread: shardfusion's step against DDP's on the same GPT, on CPU with gloo.

    python -m benchmarks.thread_cpu --variants ddp,sf-outer1,sf-outer2 --reshard after_backward --rounds 3

On 4 gloo ranks sharing the machine's cores the step is CPU-bound, so a variant's step time follows the CPU seconds
its processes spend per step, every thread counted: the training (main) thread, gloo's threads (each process group
has a TCP event loop, ``gloo_tcp_loop``, and its work threads, ``pt_gloo_runloop``), and shardfusion's
replicate-sync thread (the outer all-reduces of HSDP, ``shardfusion/_runtime/replicate_sync.py``). Each rank reads
its threads' user + system time from ``/proc/self/task/*/stat`` before and after the timed steps (Linux only); the
report gives, per variant, the median step, and per thread kind the CPU milliseconds per step summed over the 4
ranks, next to DDP's; and the training thread's CPU by phase of the step (forward, backward, clipping, the optimizer
step), from ``time.thread_time`` around each, summed over the ranks the same way. Variants run interleaved, in
rotated order, ``--rounds`` times; figures are medians over the rounds. The step is `benchmarks/step_worker.py`'s
(forward, backward, clip to 1.0, AdamW, ``zero_grad``), on the ``comm`` regime's GPT (8 blocks, d 256, batch 1,
seq 64) unless ``--regime`` says otherwise; every variant's workers keep freed memory (``shardfusion.cpu_memory``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.rounds import add_run_args, rotated, run_and_store

VARIANTS = {"ddp": ("ddp", 1), "sf-outer1": ("shardfusion", 1), "sf-outer2": ("shardfusion", 2),
            "sf-outer4": ("shardfusion", 4)}
"""name: (step_worker variant, HSDP outer degree of the 4 ranks; outer 4: replicas only)."""
PHASES = ("forward", "backward", "clip", "optimizer")
"""The training thread's phases of a step (``time.thread_time`` around each): forward (the batch drawn included),
backward, clipping, the optimizer step with ``zero_grad``."""


def thread_cpu_s() -> dict[str, tuple[str, float]]:
    """``{thread id: (kind, CPU seconds so far)}`` of this process (Linux ``/proc``); kind ``main`` for the process's
    first thread, the thread's name for gloo's and torch's named threads (``gloo_*``, ``pt_*``), ``python`` for the
    rest (threads started by Python code: shardfusion's replicate-sync thread)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        kind = "main" if tid == str(os.getpid()) else (name if name.startswith(("gloo", "pt_")) else "python")
        out[tid] = (kind, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime, clock ticks
    return out


def _worker(variant: str, regime: str, outer: int, reshard: str, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from benchmarks.spawn import join
    from benchmarks.step_worker import REGIMES, _build

    join("cpu")
    rank = dist.get_rank()
    model, clip = _build(variant, regime, outer, reshard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, seq = REGIMES[regime][:2]
    gen = torch.Generator().manual_seed(43 + rank)
    before, t0 = {}, 0.0
    phases = dict.fromkeys(PHASES, 0.0)  # the training thread's CPU seconds per phase, over the timed steps
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            before, t0 = thread_cpu_s(), time.perf_counter()
            phases = dict.fromkeys(PHASES, 0.0)
        marks = [time.thread_time()]
        tok = torch.randint(0, 256, (batch, seq + 1), generator=gen)  # (B, T+1) int64
        _, loss = model(tok[:, :-1], tok[:, 1:])
        marks.append(time.thread_time())
        loss.backward()
        marks.append(time.thread_time())
        clip()
        marks.append(time.thread_time())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.thread_time())
        for phase, a, b in zip(PHASES, marks, marks[1:]):
            phases[phase] += b - a
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    after = thread_cpu_s()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    kinds: dict[str, float] = {}
    for tid, (kind, cpu) in after.items():
        kinds[kind] = kinds.get(kind, 0.0) + (cpu - before.get(tid, (kind, 0.0))[1]) / steps
    return {"step_s": float(wall) / steps, "cpu_s": kinds, "phase_s": {k: v / steps for k, v in phases.items()}}


def run(args) -> dict:
    from benchmarks.provenance import RunRecord
    from benchmarks.spawn import run_workers

    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rounds: list[dict] = []
    with RunRecord() as record:
        for r in range(args.rounds):
            order = rotated(names, r)
            got = {}
            for name in order:
                variant, outer = VARIANTS[name]
                out = run_workers(_worker, (variant, args.regime, outer, args.reshard, args.warmup, args.steps), 4)
                if out is None:
                    raise SystemExit(f"variant {name} failed")
                kinds: dict[str, float] = {}
                for rank_out in out.values():
                    for kind, cpu in rank_out["cpu_s"].items():
                        kinds[kind] = kinds.get(kind, 0.0) + cpu
                phase_s = {p: sum(o["phase_s"][p] for o in out.values()) for p in PHASES}
                got[name] = {"step_s": out[0]["step_s"], "cpu_s": kinds, "phase_s": phase_s}
            rounds.append(got)
    summary = {}
    for name in names:
        kinds = sorted({k for rd in rounds for k in rd[name]["cpu_s"]})
        summary[name] = {"step_s": statistics.median(rd[name]["step_s"] for rd in rounds),
                         "cpu_s": {k: statistics.median(rd[name]["cpu_s"].get(k, 0.0) for rd in rounds)
                                   for k in kinds}}
        summary[name]["cpu_total_s"] = statistics.median(sum(rd[name]["cpu_s"].values()) for rd in rounds)
        summary[name]["phase_s"] = {p: statistics.median(rd[name]["phase_s"][p] for rd in rounds) for p in PHASES}
    return {"config": vars(args), "env": record.as_dict(), "rounds": rounds, "summary": summary}


def report(result: dict) -> str:
    from benchmarks.provenance import describe

    s, cfg = result["summary"], result["config"]
    base = s.get("ddp")
    kinds = sorted({k for v in s.values() for k in v["cpu_s"]}, key=lambda k: (k != "main", k))
    lines = [f"# CPU per step by thread: {cfg['name']}", "",
             f"4 gloo ranks, `{cfg['regime']}` regime, sharded variants resharded {cfg['reshard']}; "
             f"{cfg['rounds']} rounds x ({cfg['warmup']} warm-up + {cfg['steps']} timed steps), variants "
             "interleaved; medians over rounds. CPU: milliseconds per step, summed over the 4 ranks "
             "(`/proc/self/task/*/stat`).", "", describe(result["env"]), "",
             "| variant | step ms | vs DDP | CPU ms (all threads) | vs DDP | " + " | ".join(kinds) + " |",
             "|---|---|---|---|---|" + "---|" * len(kinds)]
    for name, v in s.items():
        ratio = f"{v['step_s'] / base['step_s']:.3f}" if base else "-"
        cratio = f"{v['cpu_total_s'] / base['cpu_total_s']:.3f}" if base else "-"
        cells = " | ".join(f"{1e3 * v['cpu_s'].get(k, 0.0):.1f}" for k in kinds)
        lines.append(f"| {name} | {1e3 * v['step_s']:.1f} | {ratio} | {1e3 * v['cpu_total_s']:.1f} | {cratio} | "
                     f"{cells} |")
    lines += ["", "Thread kinds: `main` (forward, backward, hooks, optimizer), `gloo_tcp_loop` (one per process "
              "group: socket I/O), `pt_gloo_runloop` (gloo's work threads: the collectives' algorithms and "
              "reductions), `python` (the other Python threads: here shardfusion's HSDP replicate-sync thread, "
              "which waits for a reduce-scatter, adds it into the step's gradient, issues the all-reduce).", "",
              "The training thread by phase (CPU ms per step, summed over the 4 ranks; `time.thread_time` around "
              "each phase):", "", "| variant | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for name, v in s.items():
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * v['phase_s'][p]:.1f}" for p in PHASES) + " |")
    return "\n".join(lines + [""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="ddp,sf-outer1,sf-outer2", help=f"from {sorted(VARIANTS)}")
    p.add_argument("--regime", default="comm", choices=("comm", "compute", "tiny"))
    p.add_argument("--reshard", default="after_backward", choices=("after_forward", "after_backward"))
    add_run_args(p, "thread-cpu")
    run_and_store(p, run, report, argv)


if __name__ == "__main__":
    main()
