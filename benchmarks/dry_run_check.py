"""The dry run (`shardfusion.dry_run`) against a measured run of the same step, at W = 4 and W = 8 on this machine.

    python -m benchmarks.dry_run_check                 # results/dry-run-check.{json,md}
    python -m benchmarks.dry_run_check --cases w4-hsdp # one case

For each case the same step (a GPT, built on meta and sharded by `fully_shard`, one forward and backward per
micro-batch, clipping, AdamW) runs twice:

- measured: W gloo worker processes, real tensors and real collectives; each rank runs `measure_step` (live tensor
  bytes by part, `CommCounter`) and, independently, the benchmark's dispatch-level `CollectiveRecorder`, which sees
  every c10d op (its bytes cross-check the counter's); the largest figure over the ranks is kept;
- dry run: `sf.dry_run(..., backend="gloo")` in this process, one fake rank per kind, fake tensors.

Nodes are pretended (`--ranks-per-node`, default 2), so the bytes across nodes are those of a 2-node layout. The
report gives every figure of both, their ratio, and whether it is within 5 % (for a figure the dry run gives as a
range, the full gradient buffers and the peak: whether the measured one lies in it).

The cases `bench-comm`, `bench-compute` and `bench-comm-hsdp` are `benchmarks/compare.py`'s models and batches
(its regimes `comm` and `compute`, FSDP over the 4 ranks, and HSDP 2 x 2). For them the transient memory (the live
bytes beyond the parameters, gradients and optimizer state at its peak) is also checked against the one the
benchmark measured (`--against`, a stored result of compare.py; its `shardfusion` row): `memory transient vs the
benchmark`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.05
MEMORY = ("params", "grads", "optimizer", "full_params", "full_grads", "activations", "peak", "transient")
AGAINST = {1: REPO / "benchmarks" / "results" / "cpu-fp32-peers-fsdp4.json",
           2: REPO / "benchmarks" / "results" / "cpu-fp32-peers-hsdp.json"}
"""compare.py's stored results the `bench-*` cases are checked against, by outer degree."""

# Figures the dry run gives as a range (``dry_run(bounds=True)``: every collective complete as soon as issued, and
# none before it is waited for) when its two ends differ; a measured figure is within when it lies in that range (5 %
# either side). A sharded model frees its full gradient buffers at points fixed by the program ([Note: one gradient
# reduction at a time] in shardfusion/_runtime/scheduler.py), so for these cases both ends agree: one figure.

CASES = {
    # name: (world size, Topology kwargs, GPT shape or a compare.py regime, micro-batches)
    "w4-hsdp": (4, {"fsdp_outer_degree": 2}, {"n_layer": 4, "n_head": 4, "d_model": 128}, 1),
    "w4-fsdp-accum": (4, {}, {"n_layer": 4, "n_head": 4, "d_model": 128}, 2),
    "w8-hsdp": (8, {"fsdp_outer_degree": 2}, {"n_layer": 4, "n_head": 4, "d_model": 128}, 1),
    "w8-moe-ep2": (8, {"fsdp_outer_degree": 2, "ep": 2},
                   {"n_layer": 2, "n_head": 4, "d_model": 128, "n_experts": 4, "top_k": 2}, 1),
    # pipeline: the training job's own stages (PipelineRun: split GPT, fully_shard per stage, torch's 1F1B schedule
    # over 4 micro-batches of the step's rows); both pp stages are played (two kinds of rank)
    "w4-pp2-1f1b": (4, {"pp": 2}, {"n_layer": 4, "n_head": 4, "d_model": 128}, 1),
    # benchmarks/compare.py's regimes (model and batch per rank), at --outer 1 and --outer 2
    "bench-comm": (4, {}, "comm", 1),
    "bench-compute": (4, {}, "compute", 1),
    "bench-comm-hsdp": (4, {"fsdp_outer_degree": 2}, "comm", 1),
}
BATCH, SEQ = 2, 64


def _shape(case: str) -> tuple[dict, int, int]:
    """(GPT shape, batch, sequence length) of a case: its own shape at BATCH x SEQ, or compare.py's regime."""
    shape = CASES[case][2]
    if isinstance(shape, dict):
        return shape, BATCH, SEQ
    from benchmarks.compare import REGIMES

    r = REGIMES[shape]
    return {"n_layer": r.n_layer, "n_head": r.n_head, "d_model": r.d_model}, r.batch, r.seq


def _build(shape: dict, seq: int):
    from shardfusion.models.gpt import GPT, GPTConfig

    config = GPTConfig(seq_len=seq, **shape)
    return lambda topo: GPT(config, ep_group=topo.get_group("ep") if config.n_experts else None)


def _stepper(batch: int, seq: int):
    def step(model, topo):
        x = torch.randint(0, 256, (batch, seq))  # (B, T) token ids; fake tensors in a dry run
        y = torch.randint(0, 256, (batch, seq))
        return model(x, y)[1]

    return step


def _pipeline(world: int, shape: dict, ranks_per_node: int):
    """build and step of a --pp run of the training job (its PipelineRun, through the job's own dry-run step):
    4 micro-batches of 2 x 64 tokens."""
    import shardfusion as sf
    from shardfusion.train.config import parse_args, resolve
    from shardfusion.train.job_dry_run import job_step

    flags = ["--pp", "2", "--experts", "0", "--batch-size", str(4 * BATCH), "--microbatches", "4", "--seq-len",
             str(SEQ), "--n-layer", str(shape["n_layer"]), "--n-head", str(shape["n_head"]), "--d-model",
             str(shape["d_model"])]
    config = resolve(parse_args(flags), device="cpu", world_size=world)
    return job_step(config, ranks_per_node)


def _model(case: str, ranks_per_node: int):
    """(build, step) of a case."""
    world, topo_kwargs = CASES[case][:2]
    shape, batch, seq = _shape(case)
    if topo_kwargs.get("pp", 1) > 1:
        return _pipeline(world, shape, ranks_per_node)
    return _build(shape, seq), _stepper(batch, seq)


def _fully_shard():
    from shardfusion.models.gpt import Block

    return {"units": (Block,)}


def worker(case: str, ranks_per_node: int) -> dict:
    """One measured rank: `measure_step` and the dispatch-level recorder of the same step."""
    import torch.distributed as dist

    import shardfusion as sf
    from benchmarks.measure import CollectiveRecorder
    from benchmarks.spawn import join
    from shardfusion.dry_run import measure_step

    join("cpu")
    world, topo_kwargs, _, micro = CASES[case]
    topo = sf.Topology(**topo_kwargs)
    torch.manual_seed(1 + dist.get_rank())
    rec = CollectiveRecorder()
    build, step = _model(case, ranks_per_node)
    fig = measure_step(build, step, topo, ranks_per_node=ranks_per_node, fully_shard=_fully_shard(),
                       micro_batches=micro, step_context=lambda: rec, step_runs_backward=topo.pp > 1)
    dispatch_wire = sum(c.wire_bytes for c in rec.collectives)  # (the forward-mode agreement uses the store)
    out = {"rank": dist.get_rank(), "pp": topo.pp_rank, "memory": fig.memory, "collectives": fig.collectives,
           "wire_bytes": fig.wire_bytes, "across_bytes": fig.across_bytes, "dispatch_wire_bytes": dispatch_wire}
    dist.barrier()
    dist.destroy_process_group()
    return out


def _totals(collectives: list[dict]) -> dict[str, float]:
    """Per op: wire bytes (all groups), and the across-node bytes of all ops."""
    out: dict[str, float] = {}
    for c in collectives:
        out[f"{c['op']} count"] = out.get(f"{c['op']} count", 0) + c["count"]
        out[f"{c['op']} wire bytes"] = out.get(f"{c['op']} wire bytes", 0.0) + c["wire_bytes"]
    out["across-node bytes"] = sum(c["across_bytes"] for c in collectives)
    return out


def _benchmark_transient(case: str, path: Path) -> dict | None:
    """The transient memory compare.py measured for shardfusion in the regime of a `bench-*` case, from the stored
    result at ``path`` (None when the case is not one, or the file or its row is missing): ``{"bytes", "source"}``."""
    regime = CASES[case][2]
    if isinstance(regime, dict) or not path.exists():
        return None
    summary = json.loads(path.read_text()).get("summary", {})
    row = summary.get(regime, {}).get("variants", {}).get("shardfusion", {}).get("transient_memory")
    if not row:
        return None
    return {"bytes": row["transient"], "source": str(path.relative_to(REPO))}


def run_case(case: str, ranks_per_node: int, against: Path | None = None) -> dict:
    import shardfusion as sf
    from benchmarks.dry_run_check import worker as entry  # pickled by module name for the spawned workers
    from benchmarks.spawn import run_workers

    world, topo_kwargs, _, micro = CASES[case]
    shape = _shape(case)[0]
    t = time.perf_counter()
    results = run_workers(entry, (case, ranks_per_node), world)
    measured_s = time.perf_counter() - t
    if results is None:
        raise RuntimeError(f"{case}: a measured worker failed")
    ranks = [results[r] for r in sorted(results)]
    build, step = _model(case, ranks_per_node)
    t = time.perf_counter()
    dry = sf.dry_run(build, step, world_size=world, ranks_per_node=ranks_per_node, topology=topo_kwargs,
                     fully_shard=_fully_shard(), micro_batches=micro, backend="gloo", plan_model=False,
                     step_runs_backward=topo_kwargs.get("pp", 1) > 1)
    dry_s = time.perf_counter() - t
    rows = []
    for d in dry.ranks:  # one per kind of rank (pp stage); measured: the ranks of that stage
        mine = [r for r in ranks if r["pp"] == d.coordinates["pp"]]
        kind = f"{d.kind}: " if len(dry.ranks) > 1 else ""
        for k in MEMORY:
            slow = d.memory.get(f"{k}_slow")
            rows.append({"figure": f"{kind}memory {k}", "dry": d.memory[k],
                         "bound": slow if slow is not None and slow != d.memory[k] else None,
                         "measured": max(r["memory"][k] for r in mine)})
        measured_totals = [_totals(r["collectives"]) for r in mine]
        for k, v in _totals(d.collectives).items():
            rows.append({"figure": f"{kind}{k}", "dry": v, "measured": max(m.get(k, 0) for m in measured_totals)})
        rows.append({"figure": f"{kind}wire bytes (dispatch recorder)", "dry": d.wire_bytes,
                     "measured": max(r["dispatch_wire_bytes"] for r in mine)})
        bench = _benchmark_transient(case, against or AGAINST.get(topo_kwargs.get("fsdp_outer_degree", 1),
                                                                  Path("-")))
        if bench is not None:  # the benchmark's own measurement (a steady step of compare.py's shardfusion variant)
            rows.append({"figure": f"{kind}memory transient vs the benchmark", "source": bench["source"],
                         "dry": d.memory["transient"], "measured": bench["bytes"]})
    for row in rows:
        m = row["measured"]
        row["ratio"] = row["dry"] / m if m else (1.0 if row["dry"] == 0 else float("inf"))
        row["within"] = abs(row["ratio"] - 1) <= TOLERANCE
        if row.get("bound") is not None:  # a range: from every collective complete at once to none before waited
            low, high = sorted((row["dry"], row["bound"]))
            row["within"] = low * (1 - TOLERANCE) <= m <= high * (1 + TOLERANCE)
            row["figure"] += " (range)"
    batch, seq = _shape(case)[1:]
    return {"case": case, "world_size": world, "topology": topo_kwargs, "model": shape, "micro_batches": micro,
            "batch": batch, "seq": seq,
            "layout": dry.layout, "rows": rows, "measured_s": measured_s, "dry_run_s": dry_s,
            "ranks_spread": {k: [r["memory"][k] for r in ranks] for k in MEMORY}}


def markdown(result: dict) -> str:
    lines = ["# Dry run against a measured run", "",
             f"{result['env']['when']}; torch {result['env']['torch']}; {result['env']['cpu_count']} CPU cores; gloo "
             f"workers, 1 thread each; {result['ranks_per_node']} ranks per pretended node; batch {BATCH} x "
             f"{SEQ} tokens per rank per micro-batch unless a case says otherwise. Memory is live tensor bytes "
             f"(largest over the measured ranks); "
             f"bytes are per rank per optimizer step. Tolerance {TOLERANCE:.0%}. A (range) figure: the dry run's "
             f"step with every collective complete as soon as issued .. with none complete before it is waited for "
             f"(the real one depends on timing); within when the measured figure lies in it, {TOLERANCE:.0%} either "
             f"side.", ""]
    for c in result["cases"]:
        ok = sum(r["within"] for r in c["rows"])
        lines += [f"## {c['case']}: W={c['world_size']}, {c['layout']}, micro-batches {c['micro_batches']}", "",
                  f"model {c['model']}, batch {c.get('batch', BATCH)} x {c.get('seq', SEQ)}; measured run "
                  f"{c['measured_s']:.1f} s (spawn included), dry run "
                  f"{c['dry_run_s']:.1f} s; {ok} of {len(c['rows'])} figures within {TOLERANCE:.0%}.", "",
                  "| figure | dry run | measured | dry / measured | within 5 % |", "|---|---|---|---|---|"]
        for r in c["rows"]:
            fmt = (lambda v: f"{v:.0f}") if "count" in r["figure"] else (lambda v: f"{v / 2**20:.4f} MiB")
            dry, ratio = fmt(r["dry"]), f"{r['ratio']:.4f}"
            if r.get("bound") is not None:  # a range: both ends, and both ends over the measured figure
                dry += f" .. {fmt(r['bound'])}"
                ratio = f"{r['ratio']:.2f} .. {r['bound'] / r['measured']:.2f}" if r["measured"] else "-"
            figure = r["figure"] + (f" ({r['source']})" if r.get("source") else "")
            lines.append(f"| {figure} | {dry} | {fmt(r['measured'])} | {ratio} | "
                         f"{'yes' if r['within'] else '**no**'} |")
        lines.append("")
    return "\n".join(lines)


def rewrite(json_path: Path) -> str:
    """The markdown of a stored result (``--rewrite``), e.g. after a change of the report's layout."""
    md = markdown(json.loads(json_path.read_text()))
    json_path.with_suffix(".md").write_text(md)
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from " + ",".join(CASES))
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--name", default="dry-run-check")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--rewrite", default=None, help="only rewrite the markdown of this stored .json")
    p.add_argument("--against", default=None,
                   help="compare.py result to check the bench-* cases' transient memory against (default: "
                        + ", ".join(f"outer {o}: {v.name}" for o, v in AGAINST.items()) + ")")
    args = p.parse_args(argv)
    if args.rewrite:
        print(rewrite(Path(args.rewrite)))
        return 0
    cases = args.cases.split(",")
    for c in cases:
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r}; pick from {', '.join(CASES)}")
    os.environ["OMP_NUM_THREADS"] = "1"
    result = {"env": {"when": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpu_count": os.cpu_count()},
              "ranks_per_node": args.ranks_per_node, "tolerance": TOLERANCE,
              "cases": [run_case(c, args.ranks_per_node, Path(args.against) if args.against else None)
                        for c in cases]}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / f"{args.name}.md").write_text(md)
    print(md)
    bad = [(c["case"], r["figure"]) for c in result["cases"] for r in c["rows"] if not r["within"]]
    print(f"figures outside {TOLERANCE:.0%}: {bad or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
