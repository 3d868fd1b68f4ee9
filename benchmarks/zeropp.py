"""ZeRO++'s three ideas across an emulated slow link: one sharding group of 4 ranks over 2 nodes x 2 ranks.

    python -m benchmarks.zeropp      # the full run: 200mbit, 1gbit, unlimited; 3 rounds; then the loss curves
    python -m benchmarks.zeropp --quick --name zeropp-cpu-quick  # 1 round, 1 warm-up + 2 timed steps, no curves
    python -m benchmarks.zeropp --rates 200mbit --variants sf-fsdp,sf-qwz --out-dir /tmp/x

Results: ``benchmarks/results/<name>.{json,md}`` (``zeropp_report``), then (``--loss-steps``, default 200) the loss
curves of ``benchmarks/zeropp_loss.py`` as ``<loss-name>.{json,md,png}``; the theory of the link bytes:
``benchmarks/zeropp_theory.py``; the page: docs/zeropp.md. Needs root (network namespaces, docs/network-emulation.md).

The model, batches and step are ``benchmarks/link.py``'s (the dense GPT of 8 blocks x d 256, 6.4M parameters,
batch 1, seq 64, fp32, AdamW, clip 1.0; ``benchmarks/variants.py``'s step). The variants (`VARIANTS`):

- shardfusion, built by the training job's own mapping from its flags (`shardfusion.train.config.parse_args` and
  `resolve`, then `parallelize.topology` and `parallelize.shard`, as every mode of the job builds): ``BASE_FLAGS``
  (``--fsdp-outer-degree 1 --ranks-per-node 2``) plus, per variant, the flags of one idea (``--all-gather-dtype int8``:
  qwZ, ``--secondary-shard``: hpZ, ``--grad-comm-dtype int8``: qgZ) or all three. A variant whose flags the job
  rejects (not built yet in this checkout) is skipped with a ``flag not available`` line and the job's message;
- FSDP2 (``torch.distributed.fsdp.fully_shard`` over a 1-D mesh of the 4 ranks);
- DeepSpeed ZeRO-3 (as ``benchmarks/compare.py`` runs it on CPU with gloo), and with each ZeRO++ option of its
  config (``zero_hpz_partition_size`` 2, ``zero_quantized_weights``, ``zero_quantized_gradients``) and all three. A
  variant DeepSpeed refuses on CPU is recorded with its error (type and message) and left out of later rounds.

Rounds: each round is one job per link rate (rates rotated each round) in a fresh emulated cluster; in a job the
variants run in turn, their order rotated by the round, each on a fresh model under the same seed and batches:
warm-up steps, a barrier, each node's veth ``tx_bytes``, a barrier, the timed steps (the slowest rank's time per
step; shardfusion's inside a ``CommCounter`` over nodes of 2), a barrier, the counters again. So every ratio, within
a rate and across rates, is paired by round.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.provenance import RunRecord, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RATES = "200mbit,1gbit,unlimited"
BASE_FLAGS = ("--experts", "0", "--fsdp-outer-degree", "1", "--ranks-per-node", "2")
"""The job's flags every shardfusion variant shares: the dense GPT, one sharding group over both nodes of 2."""
QWZ, HPZ, QGZ = ("--all-gather-dtype", "int8"), ("--secondary-shard",), ("--grad-comm-dtype", "int8")

# name: (library, job flags (shardfusion) or DeepSpeed zero_optimization keys, label)
VARIANTS: dict[str, tuple[str, object, str]] = {
    "sf-fsdp": ("shardfusion", (), "shardfusion FSDP, fp32"),
    "sf-qwz": ("shardfusion", QWZ, "qwZ (--all-gather-dtype int8)"),
    "sf-hpz": ("shardfusion", HPZ, "hpZ (--secondary-shard)"),
    "sf-qgz": ("shardfusion", QGZ, "qgZ (--grad-comm-dtype int8)"),
    "sf-zeropp": ("shardfusion", QWZ + HPZ + QGZ, "qwZ + hpZ + qgZ"),
    "fsdp2": ("fsdp2", None, "FSDP2 fully_shard"),
    "ds-zero3": ("deepspeed", {}, "DeepSpeed ZeRO-3"),
    "ds-hpz": ("deepspeed", {"zero_hpz_partition_size": 2}, "DeepSpeed ZeRO++ hpZ"),
    "ds-qwz": ("deepspeed", {"zero_quantized_weights": True}, "DeepSpeed ZeRO++ qwZ"),
    "ds-qgz": ("deepspeed", {"zero_quantized_gradients": True}, "DeepSpeed ZeRO++ qgZ"),
    "ds-zeropp": ("deepspeed", {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                                "zero_quantized_gradients": True}, "DeepSpeed ZeRO++ (all three)"),
}
REFERENCE = "sf-fsdp"
ALL_THREE = "sf-zeropp"


def job_flags(variant: str) -> list[str]:
    """The training job's flags of a shardfusion variant."""
    return [*BASE_FLAGS, *VARIANTS[variant][1]]


def flag_problem(flags: Sequence[str]) -> Optional[str]:
    """None when the training job accepts ``flags`` (after ``BASE_FLAGS``), else its one-line message (e.g.
    ``unrecognized arguments: --secondary-shard``)."""
    from shardfusion.train.config import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args([*BASE_FLAGS, *flags])
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return lines[-1].split("error: ", 1)[-1] if lines else "rejected"
    return None


# ---- worker (under torchrun, one per rank) ----------------------------------------------------------------------
def _build(variant: str, model, ctx, topo_cache: dict):
    """``model`` wrapped as ``variant`` (a ``benchmarks.variants.Built``)."""
    import torch

    import shardfusion as sf
    from shardfusion.models.gpt import Block
    from shardfusion.train import parallelize

    from benchmarks.variants import MAX_NORM, Built, wrap

    lib, spec, _ = VARIANTS[variant]
    if lib == "fsdp2":
        return wrap("fsdp2", model, ctx)
    if lib == "deepspeed":
        ctx.deepspeed_zero = dict(spec)
        return wrap("deepspeed", model, ctx)
    job, topo = job_topology(variant, topo_cache)
    parallelize.shard(model, topo, job.parallelism, job.precision, units=(Block,))
    return Built("shardfusion", model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                 lambda: sf.clip_grad_norm_(model, MAX_NORM), note=" ".join(job_flags(variant)))


def job_topology(variant: str, cache: dict):
    """``(the resolved job of a shardfusion variant's flags, its sf.Topology)``, as the job builds them; a topology
    is made once per set of keywords (``cache``), its groups shared by the variants. Collective."""
    from shardfusion.train import parallelize
    from shardfusion.train.config import parse_args, resolve

    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    job = resolve(parse_args(job_flags(variant)), device="cpu", world_size=world, ranks_per_node=local,
                  world=f"torchrun's world size {world}")
    rpn = parallelize.topology_ranks_per_node(job.run, world)
    key = json.dumps(parallelize.topology_degrees(job.parallelism, job.pipeline, rpn), sort_keys=True)
    if key not in cache:
        cache[key] = parallelize.topology(job.parallelism, job.pipeline, rpn)
    return job, cache[key]


def _where(error: Exception, frames: int = 2) -> str:
    """The innermost ``frames`` frames of ``error``'s traceback, ``package/path.py:line function``, innermost last
    (paths from the package root: site-packages stripped)."""
    import traceback

    out = []
    for f in traceback.extract_tb(error.__traceback__)[-frames:]:
        path = f.filename.split("site-packages/")[-1].replace(str(REPO) + "/", "")
        out.append(f"{path}:{f.lineno} {f.name}")
    return " -> ".join(out)


def _agree_on_error(error: Optional[str]) -> Optional[str]:
    """The first rank's error of a step that may fail on every rank (DeepSpeed's refusals), the same on all."""
    import torch.distributed as dist

    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _measure(variant: str, b, batches: list, opts: dict) -> dict:
    """Warm-up, then the timed steps between the veth counters (module doc); rank 0 gets the figures."""
    import torch
    import torch.distributed as dist

    import shardfusion as sf
    from benchmarks.link import _read_tx
    from benchmarks.variants import step

    local = int(os.environ["LOCAL_WORLD_SIZE"])
    dist.barrier()
    tx0 = _read_tx()
    dist.barrier()
    counter = (sf.comm.CommCounter(ranks_per_node=local) if VARIANTS[variant][0] == "shardfusion"
               else contextlib.nullcontext())
    durations, losses = [], []
    with counter:
        for x, y in batches:
            t0 = time.perf_counter()
            losses.append(float(step(b, x, y)))
            durations.append(time.perf_counter() - t0)
    dist.barrier()
    tx1 = _read_tx()
    t = torch.tensor(durations, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    acct = None
    if not isinstance(counter, contextlib.nullcontext):
        acct = {c: row["cross_node_bytes"] for c, row in counter.summary().items()}
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, {"tx": None if tx0 is None else tx1 - tx0, "acct": acct})
    out = {"step_s": t.tolist(), "losses": losses, "link_bytes": [g["tx"] for g in got if g["tx"] is not None]}
    if acct is not None:  # per node: {category: bytes over the timed steps}
        out["accounting"] = [{c: sum(got[i]["acct"][c] for i in range(n * local, (n + 1) * local)) for c in acct}
                             for n in range(len(got) // local)]
    return out


def worker(opts: dict) -> Optional[dict]:
    """One rank's round at one link rate; rank 0 returns ``{"variants": {name: figures or {"refused": error}},
    "unit_numel", "shape", ...}``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardfusion.models.gpt import GPT, GPTConfig

    from benchmarks.compare import REGIMES, Regime, _batches
    from benchmarks.spawn import join
    from benchmarks.variants import Context, step, unit_sizes

    device = join("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    regime = Regime(**opts["shape"]) if opts.get("shape") else REGIMES[opts["regime"]]
    config = GPTConfig(n_layer=regime.n_layer, n_head=regime.n_head, d_model=regime.d_model, seq_len=regime.seq)
    root, blocks = unit_sizes(config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    batches = _batches(regime, opts["warmup"] + opts["steps"], opts["seed"], rank, device)
    variants, topo_cache, res = list(opts["variants"]), {}, {}
    _, topo = job_topology(REFERENCE, topo_cache)  # the layout (DeepSpeed reads its outer degree: 1)
    k = opts.get("rotate", 0) % max(1, len(variants))
    for v in variants[k:] + variants[:k]:
        ctx = Context(device=device, topo=topo, mesh=mesh, param_dtype=None, seed=opts["seed"])
        torch.manual_seed(opts["seed"])
        b, error = None, None
        try:  # DeepSpeed may refuse an option on CPU at init or in the first backward: on every rank alike
            b = _build(v, GPT(config), ctx, topo_cache)
            for x, y in batches[:opts["warmup"]]:
                step(b, x, y)
        except Exception as e:  # noqa: BLE001 (recorded, with its type and place, as the variant's result)
            error = f"{type(e).__name__}: {e} (at {_where(e)})".strip()
        error = _agree_on_error(error)
        if error is not None:
            res[v] = {"refused": error}
            if rank == 0:
                print(f"[{opts['rate']}] {v}: refused: {error}", flush=True)
        else:
            res[v] = _measure(v, b, batches[opts["warmup"]:], opts)
            if rank == 0:
                n = opts["steps"]
                print(f"[{opts['rate']}] round {opts.get('rotate', 0)} {v}: median "
                      f"{statistics.median(res[v]['step_s']):.3f} s, link "
                      f"{[round(x / n / 1e6, 2) for x in res[v]['link_bytes']]} MB/step per node", flush=True)
        del b
        gc.collect()
    dist.barrier()
    if rank != 0:
        return None
    return {"variants": res, "unit_numel": {"root": root, "blocks": blocks, "tied": config.vocab_size *
                                            config.d_model}, "shape": dict(regime.__dict__)}


def worker_main(opts_path: str, out_path: str) -> None:
    from benchmarks.spawn import end_process

    result = worker(json.loads(Path(opts_path).read_text()))
    if result is not None:
        Path(out_path).write_text(json.dumps(result))
    end_process(0)


# ---- parent -----------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zeropp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated link rates (tc units, or unlimited)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant at every rate")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    p.add_argument("--quick", action="store_true", help="1 round, 1 warm-up step, 2 timed steps, no loss curves")
    p.add_argument("--loss-steps", type=int, default=200, help="then benchmarks.zeropp_loss with this many steps "
                   "(0: not)")
    p.add_argument("--loss-name", default="zeropp-loss")
    p.add_argument("--regime", default="comm", help="a regime of benchmarks/compare.py")
    p.add_argument("--shape", default=None, help="a JSON Regime instead of --regime (the tests' tiny GPT)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job before it is killed")
    p.add_argument("--name", default="zeropp-cpu")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.steps, args.loss_steps = 1, 1, 2, 0
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; pick from {','.join(VARIANTS)}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--rounds and --steps must be >= 1 and --warmup >= 0, got {args.rounds}, {args.steps}, "
                f"{args.warmup}")
    from benchmarks.netcluster import parse_rate

    for rate in args.rates.split(","):
        try:
            parse_rate(rate)
        except ValueError as e:
            p.error(f"--rates: {e}")
    return args


def available(variants: list[str]) -> tuple[list[str], dict[str, str]]:
    """``(the variants that can run here, {skipped variant: why})``: a shardfusion variant whose flags the job
    rejects (``flag not available``), the DeepSpeed variants without DeepSpeed."""
    import importlib.util

    runnable, skipped = [], {}
    ds_missing = (None if importlib.util.find_spec("deepspeed") is not None
                  else "deepspeed is not installed; pip install -e '.[bench]'")
    for v in variants:
        lib = VARIANTS[v][0]
        problem = None
        if lib == "shardfusion":
            problem = flag_problem(VARIANTS[v][1])
        elif lib == "deepspeed":
            problem = ds_missing
        if problem is None:
            runnable.append(v)
        else:
            skipped[v] = (f"flag not available: {' '.join(VARIANTS[v][1])} (the job says: {problem})"
                          if lib == "shardfusion" else problem)
    return runnable, skipped


def _merge(into: dict, more: dict) -> None:
    """One job's results (one rate, one round) into the run's ``rates[rate]``."""
    for v, vr in more["variants"].items():
        mine = into["variants"].setdefault(v, {"rounds": []})
        if "refused" in vr:
            mine["refused"] = vr["refused"]
        else:
            mine["rounds"].append(vr)
    into["qdisc"] = [{k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}
                     for a, b in zip(into.get("qdisc") or [{}] * len(more["qdisc"]), more["qdisc"])]
    into["jobs"] = into.get("jobs", 0) + 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1], argv[2])
        return 0
    from benchmarks.link import run_rate
    from benchmarks.netcluster import ClusterError, netns_available
    from benchmarks.zeropp_report import markdown, summarize

    args = parse_args(argv)
    ok, why = netns_available()
    if not ok:
        print(f"benchmarks.zeropp: cannot emulate the two nodes here: {why}", file=sys.stderr)
        return 2
    variants, skipped = available(args.variants.split(","))
    for v, why in skipped.items():
        print(f"benchmarks.zeropp: skipped {v}: {why}", flush=True)
    rates_in = args.rates.split(",")
    opts = {"warmup": args.warmup, "steps": args.steps, "regime": args.regime, "seed": args.seed,
            "shape": json.loads(args.shape) if args.shape else None}
    rates: dict = {}
    refused: dict[str, str] = {}
    with RunRecord() as record:
        for r in range(args.rounds):
            for rate in rates_in[r % len(rates_in):] + rates_in[:r % len(rates_in)]:
                todo = [v for v in variants if v not in refused]
                print(f"benchmarks.zeropp: round {r}, link {rate}", flush=True)
                try:
                    got = run_rate(rate, {**opts, "variants": todo, "rotate": r}, args.timeout,
                                   module="benchmarks.zeropp")
                except ClusterError as e:
                    print(f"benchmarks.zeropp: the job at {rate} failed:\n{e}", file=sys.stderr)
                    return 1
                refused.update({v: vr["refused"] for v, vr in got["variants"].items() if "refused" in vr})
                name = got["link"]["rate"]
                entry = rates.setdefault(name, {"link": got["link"], "variants": {}})
                for key in ("unit_numel", "shape"):
                    entry[key] = got[key]
                _merge(entry, got)
    raw = {"name": args.name, "config": {**opts, "rounds": args.rounds, "rates": list(rates), "nodes": 2,
                                         "nproc_per_node": 2, "base_flags": list(BASE_FLAGS)},
           "env": {**record.as_dict(), "command": "python -m benchmarks.zeropp " + " ".join(argv)},
           "rates": rates, "skipped": skipped, "refused": refused}
    raw["summary"] = summarize(raw)
    write_result(Path(args.out_dir), args.name, raw, markdown(raw))
    print(f"wrote {Path(args.out_dir) / args.name}.json and .md")
    if args.loss_steps:
        from benchmarks import zeropp_loss

        return zeropp_loss.main(["--steps", str(args.loss_steps), "--name", args.loss_name, "--out-dir",
                                 args.out_dir])
    return 0


if __name__ == "__main__":
    sys.exit(main())
