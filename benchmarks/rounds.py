"""What the interleaved CPU benchmarks share: rotated rounds, per-step medians over the ranks, the command line.

Used by `benchmarks/comm_floor.py`, `benchmarks/idle_groups.py` and `benchmarks/thread_cpu.py`: each round runs every
variant once, in an order rotated by one per round, so a drift of the machine's load hits all variants alike.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Callable, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` in round ``round_index``'s order: rotated left by the round index."""
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


def step_medians(out: dict, steps: int) -> dict[str, float]:
    """From the ranks' results ``{rank: {"wall_s": [per step], "cpu_s": [per step]}}``: the median over the steps of
    the slowest rank's wall time and of the CPU seconds summed over the ranks."""
    return {"wall_s": statistics.median(max(o["wall_s"][i] for o in out.values()) for i in range(steps)),
            "cpu_s": statistics.median(sum(o["cpu_s"][i] for o in out.values()) for i in range(steps))}


def add_run_args(p: argparse.ArgumentParser, name: str, rounds: int = 3) -> None:
    """The arguments every interleaved benchmark takes: ``--rounds``, ``--warmup``, ``--steps`` (timed steps per run),
    ``--name`` (of the stored result) and ``--out-dir``."""
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--name", default=name)
    p.add_argument("--out-dir", default=str(RESULTS))


def run_and_store(p: argparse.ArgumentParser, run: Callable, report: Callable, argv=None) -> None:
    """Parse ``argv``, ``run(args)``, and store the result as ``<out-dir>/<name>.json`` and its ``report`` as
    ``.md`` (``benchmarks.provenance.write_result``)."""
    from benchmarks.provenance import write_result

    args = p.parse_args(argv)
    result = run(args)
    write_result(Path(args.out_dir), args.name, result, report(result))


def paired_summary(rounds: list[dict], names: Sequence[str], keys: Sequence[str] = ("wall_s", "cpu_s"),
                   base: str = "ddp") -> dict[str, dict[str, float]]:
    """Per variant and key: the median over the rounds, and ``<key>_vs_<base>``, the median of the rounds' ratios to
    ``base`` in the same round (a paired ratio: each round's variants share the load of their minutes)."""
    summary = {}
    for name in names:
        summary[name] = {key: statistics.median(rd[name][key] for rd in rounds) for key in keys}
        for key in keys:
            summary[name][f"{key}_vs_{base}"] = statistics.median(rd[name][key] / rd[base][key] for rd in rounds)
    return summary


def interleaved(worker: Callable, names: Sequence[str], rounds: int, args_of: Callable[[str], tuple], steps: int,
                keep: Sequence[str] = ()) -> tuple[list[dict], dict]:
    """Run ``worker(*args_of(name))`` on 4 local gloo ranks for every variant ``name``, ``rounds`` times in rotated
    order, under a ``RunRecord``: ``(rounds, env)``, each round ``{name: step_medians(...) plus rank 0's keys in
    keep}``, ``env`` the record's provenance. The worker returns per-step ``wall_s`` and ``cpu_s`` lists.

    Raises:
        SystemExit: a variant's workers failed.
    """
    import os

    from benchmarks.provenance import RunRecord
    from benchmarks.spawn import run_workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    done: list[dict] = []
    with RunRecord() as record:
        for r in range(rounds):
            got = {}
            for name in rotated(names, r):
                out = run_workers(worker, args_of(name), 4)
                if out is None:
                    raise SystemExit(f"variant {name} failed")
                got[name] = {**step_medians(out, steps), **{k: out[0][k] for k in keep}}
            done.append(got)
    return done, record.as_dict()
