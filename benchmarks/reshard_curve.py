"""Step time against peak memory of shardfusion's reshard policy by budget, beside FSDP2 and DDP, in one run.

    python -m benchmarks.reshard_curve                 # CPU: 4 gloo workers, HSDP 2 x 2, the comm regime
    python -m benchmarks.reshard_curve --regime tiny --repeats 1 --warmup 0 --steps 1 --out-dir /tmp/x  # smoke

The model and batches are `benchmarks/compare.py`'s (a dense GPT, per-rank batch and sequence of the regime, AdamW,
clipping to 1.0; the comm regime: 6.4M parameters, 1 x 64 tokens per rank, communication-bound on one node). The
budgets are the cost model's needs (`sf.plan(..., reshard_policy="auto")` on the same layout: the memory estimate
with the first k blocks kept gathered, k = 0 .. blocks), one point per distinct need: the budget that keeps no block
(after_forward), one, two, ... and all (after_backward). Each point is `sf.fully_shard(..., reshard_policy="auto",
memory_budget=need)`; beside them FSDP2 with `reshard_after_forward=True` and `False` on each block (the root left at
its default, as in compare.py) over the same 2-D mesh, and DDP. Every repeat runs every variant in turn (the order
rotates by one each repeat), each on a fresh model under the same seed: W warm-up steps, a barrier, N timed steps; a
step's time is the slowest rank's, a variant's time the median over all its timed steps. Each variant then runs
one untimed step under `LiveMemory` (the largest live tensor bytes of a rank: compare.py's
instrument, the same for every variant), one that samples its full parameter and gradient buffers at every op, and
one that counts its persistent bytes, after every repeat (the peaks move with when the asynchronous collectives
complete: the medians over repeats are reported, the peak live with its range). Writes
`<out-dir>/<name>.json`, `.md` and `.png` (step time against peak live memory; needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (also in the spawned workers)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
FSDP2 = {"fsdp2-raf-true": "after_forward", "fsdp2-raf-false": "after_backward"}
"""The FSDP2 variants: name -> the compare.py reshard setting (``reshard_after_forward`` True / False)."""


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.compare import REGIMES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--regime", default="comm", choices=sorted(REGIMES))
    p.add_argument("--n-layer", type=int, default=None, help="blocks of the GPT (default: the regime's)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all variants")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant per repeat")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per repeat")
    p.add_argument("--nproc", type=int, default=4, help="local gloo workers")
    p.add_argument("--outer", type=int, default=2, help="HSDP replicas (outer degree); inner = world / outer")
    p.add_argument("--prefetch", type=int, default=1, help="shardfusion's prefetch depth")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--name", default="reshard-auto-curve", help="result file stem")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.nproc < 1 or args.nproc % args.outer:
        p.error("--repeats and --steps must be >= 1, --warmup >= 0, --outer must divide --nproc")
    if args.n_layer is not None and args.n_layer < 1:
        p.error(f"--n-layer must be >= 1, got {args.n_layer}")
    return args


def budgets(config, world: int, outer: int, prefetch: int) -> tuple[list[int], int]:
    """The distinct memory needs per rank (bytes) of the cost model with the first k blocks kept, k = 0 .. blocks,
    ascending: the budgets of the shardfusion points; and the model's parameter count."""
    import shardfusion as sf
    from shardfusion.models.gpt import GPT, Block

    with torch.device("meta"):
        model = GPT(config)
    plan = sf.plan(model, units=(Block,), world_size=world, local_world_size=world, prefetch=prefetch,
                   bandwidth=sf.Bandwidth(within=1e9, across=1e9), max_memory_per_rank=2**62,
                   reshard_policy="auto", outer_degrees=[outer], backend="gloo")
    return sorted(set(plan.chosen.reshard.needs)), sum(p.numel() for p in model.parameters())


def _build(variant: dict, config, ctx):
    """A fresh GPT under the seed, wrapped as ``variant`` ({"kind": shardfusion | fsdp2 | ddp, ...})."""
    from shardfusion.models.gpt import GPT
    from benchmarks.variants import wrap

    torch.manual_seed(ctx.seed)
    model = GPT(config).to(ctx.device)
    if variant["kind"] == "shardfusion":
        return wrap("shardfusion", model, dataclasses.replace(ctx, reshard_policy="auto"),
                    memory_budget=variant["budget"])
    return wrap(variant["kind"], model, dataclasses.replace(ctx, reshard_policy=variant.get("reshard",
                                                                                          "after_forward")))


def _transient(b, batch) -> dict:
    """One untimed step sampling the library's alive full buffers at every op (compare.py's instrument): the peak
    bytes of gathered parameters and of full gradient buffers (max over ranks; 0 for DDP, which has none). The
    replicate all-reduces run at the step boundary in this step (the sampler is a dispatch mode of this thread)."""
    import shardfusion as sf
    from benchmarks.compare import _gather_max
    from benchmarks.measure import CollectiveRecorder
    from benchmarks.variants import step

    peaks = {"full_param_bytes": 0, "full_grad_bytes": 0}

    def sample() -> None:
        for k, v in b.sample_transient().items():
            if k in peaks and v > peaks[k]:
                peaks[k] = v

    state = getattr(b.model, "_sf_state", None)
    saved = None if state is None else state.is_last_backward
    if state is not None:
        sf.set_is_last_backward(b.model, False)
    with CollectiveRecorder(on_op=sample):
        step(b, *batch)
    if state is not None:
        sf.set_is_last_backward(b.model, saved)
    return _gather_max(peaks)


def _measure(b, batch) -> dict:
    """One untimed step's peak live bytes (compare.py's instrument), one's peak gathered parameters and full
    gradients (`_transient`) and the persistent bytes (max over ranks); for shardfusion the auto choice and the
    all-gathers of a step."""
    import shardfusion as sf
    from benchmarks.compare import _gather_max, _peak_live
    from benchmarks.variants import persistent, step

    pers: dict = {}
    out = dict(_transient(b, batch))
    if b.name == "shardfusion":
        with sf.comm.CommCounter() as counter:
            step(b, *batch, after_optimizer=lambda: pers.update(persistent(b)))
        out["all_gathers"] = counter.count("all_gather")
        choice = sf.reshard_choice(b.model)
        out.update(kept=len(choice.kept), estimate_bytes=choice.memory_bytes, fits=choice.fits)
    else:
        step(b, *batch, after_optimizer=lambda: pers.update(persistent(b)))
    out["persistent_bytes"] = _gather_max({"total": pers["total"]})["total"]
    out["peak_live_bytes"] = _gather_max(_peak_live(b, batch))["peak_bytes"]
    return out


def worker(opts: dict) -> dict | None:
    """One rank's whole run; rank 0 returns the raw results, other ranks None."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardfusion as sf
    from shardfusion.models.gpt import GPTConfig
    from benchmarks.compare import REGIMES, _batches
    from benchmarks.spawn import join
    from benchmarks.variants import Context, step

    device = join("cpu")
    world, outer = dist.get_world_size(), opts["outer"]
    regime = REGIMES[opts["regime"]]
    if opts["n_layer"] is not None:
        regime = dataclasses.replace(regime, n_layer=opts["n_layer"])
    config = GPTConfig(n_layer=regime.n_layer, n_head=regime.n_head, d_model=regime.d_model, seq_len=regime.seq)
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=outer)
    mesh = init_device_mesh("cpu", (outer, world // outer), mesh_dim_names=("replicate", "shard"))
    ctx = Context(device=device, topo=topo, mesh=mesh, param_dtype=None, prefetch=opts["prefetch"], seed=opts["seed"])
    needs, num_params = budgets(config, world, outer, opts["prefetch"])
    variants = {f"auto-{i}": {"kind": "shardfusion", "budget": b} for i, b in enumerate(needs)}
    variants.update({name: {"kind": "fsdp2", "reshard": r} for name, r in FSDP2.items()})
    variants["ddp"] = {"kind": "ddp"}
    names = list(variants)
    batches = _batches(regime, opts["warmup"] + opts["steps"], opts["seed"], dist.get_rank(), device)
    res = {v: {**variants[v], "step_s": [], "losses": []} for v in names}
    for r in range(opts["repeats"]):
        k = r % len(names)
        for v in names[k:] + names[:k]:
            b = _build(variants[v], config, ctx)
            for x, y in batches[:opts["warmup"]]:
                step(b, x, y)
            dist.barrier()
            durations, losses = [], []
            for x, y in batches[opts["warmup"]:]:
                t0 = time.perf_counter()
                losses.append(float(step(b, x, y)))
                durations.append(time.perf_counter() - t0)
            t = torch.tensor(durations, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res[v]["step_s"].append(t.tolist())
            res[v]["losses"].append(losses)
            measured = _measure(b, batches[0])  # every repeat: the peaks move with when collectives complete
            for key in ("peak_live_bytes", "full_param_bytes", "full_grad_bytes"):
                res[v].setdefault(key, []).append(measured.pop(key))
            res[v].update(measured)
            del b
            gc.collect()
            if dist.get_rank() == 0:
                print(f"repeat {r} {v}: median {statistics.median(t.tolist()):.3f} s", flush=True)
    dist.barrier()
    out = None
    if dist.get_rank() == 0:
        out = {"variants": res, "needs": needs, "world_size": world, "inner": world // outer, "outer": outer,
               "shape": dataclasses.asdict(regime), "num_params": num_params}
    dist.destroy_process_group()
    return out


def summarize(raw: dict) -> dict[str, list[dict]]:
    """``{"points": [...], "peers": [...]}``: a row per shardfusion budget (by budget) and per peer (FSDP2 True,
    False, DDP): ``label``, the median step (s), its ratio to FSDP2 reshard_after_forward=True's and to DDP's
    (paired: the median over repeats of the ratio of the two variants' medians within one repeat), peak live and
    persistent MB (the peak: the median over repeats, and its range), the peaks of gathered parameters and of full
    gradient buffers (MB, medians over repeats), the first and last loss; for shardfusion the budget and its
    estimate (MB), the blocks kept and the all-gathers of a step."""
    v = raw["variants"]
    per_repeat = {name: [statistics.median(rep) for rep in d["step_s"]] for name, d in v.items()}

    def paired(name: str, peer: str) -> float:
        return statistics.median(a / b for a, b in zip(per_repeat[name], per_repeat[peer]))

    blocks = raw["shape"]["n_layer"]
    points, peers = [], []
    for name, d in v.items():
        row = {"variant": name, "step_s": statistics.median(s for rep in d["step_s"] for s in rep),
               "vs_fsdp2_raf_true": paired(name, "fsdp2-raf-true"), "vs_ddp": paired(name, "ddp"),
               "peak_live_mb": statistics.median(d["peak_live_bytes"]) / 1e6,
               "peak_live_range_mb": [min(d["peak_live_bytes"]) / 1e6, max(d["peak_live_bytes"]) / 1e6],
               "persistent_mb": d["persistent_bytes"] / 1e6,
               "full_params_mb": statistics.median(d["full_param_bytes"]) / 1e6,
               "full_grads_mb": statistics.median(d["full_grad_bytes"]) / 1e6,
               "loss_first": d["losses"][0][0], "loss_last": d["losses"][0][-1]}
        if d["kind"] == "shardfusion":
            row.update(label=f"shardfusion auto, {d['kept']}/{blocks} kept", budget_mb=d["budget"] / 1e6,
                       kept=d["kept"], estimate_mb=d["estimate_bytes"] / 1e6, all_gathers=d["all_gathers"])
            points.append(row)
        else:
            row["label"] = ("DDP" if d["kind"] == "ddp" else
                            f"FSDP2 reshard_after_forward={d['reshard'] == 'after_forward'}")
            peers.append(row)
    return {"points": sorted(points, key=lambda r: r["budget_mb"]), "peers": peers}


def markdown(result: dict) -> str:
    """The result as the markdown report."""
    from benchmarks.provenance import describe

    cfg, env, shape = result["config"], result["env"], result["shape"]
    lines = [f"# Reshard policy by budget: step time against peak memory ({result['name']})", "",
             f"{result['world_size']} ranks (cpu, gloo), HSDP inner {result['inner']} x outer {result['outer']}; GPT "
             f"of {shape['n_layer']} blocks x d {shape['d_model']} ({result['num_params'] / 1e6:.2f}M parameters), "
             f"batch {shape['batch']} x {shape['seq']} tokens per rank (regime {cfg['regime']}), fp32, AdamW, clip "
             f"1.0; shardfusion prefetch {cfg['prefetch']}. {cfg['repeats']} repeats x ({cfg['warmup']} warm-up + "
             f"{cfg['steps']} timed steps) per variant, interleaved (rotated each repeat). Step: the median over "
             "steps and repeats of the slowest rank's step; ratios paired (the median over repeats of the ratio "
             "within one repeat). Peak live: the largest live tensor bytes of a rank in one untimed step after each "
             "repeat (benchmarks/compare.py's instrument), the median over repeats and its range.", "",
             f"Machine: {env['cpu_count']} CPUs, torch {env['torch']}. {describe(env)}", "",
             f"Command: `{env['command']}`", "",
             "| variant | budget MB | estimate MB | peak live MB (min-max) | persistent MB | gathered params MB | "
             "full grads MB | step s | vs FSDP2 raf=True | vs DDP | all-gathers/step | loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["points"] + result["peers"]:
        budget, estimate = (f"{r['budget_mb']:.3f}", f"{r['estimate_mb']:.3f}") if "budget_mb" in r else ("-", "-")
        low, high = r["peak_live_range_mb"]
        lines.append(f"| {r['label']} | {budget} | {estimate} | {r['peak_live_mb']:.2f} ({low:.2f}-{high:.2f}) | "
                     f"{r['persistent_mb']:.2f} | {r['full_params_mb']:.2f} | {r['full_grads_mb']:.2f} | "
                     f"{r['step_s']:.3f} | {r['vs_fsdp2_raf_true']:.2f} | {r['vs_ddp']:.2f} | "
                     f"{r.get('all_gathers', '-')} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} |")
    lines += ["", "The budgets are the cost model's needs with 0, 1, 2, ... blocks kept (`sf.plan(..., "
              "reshard_policy=\"auto\")`); a need that equals the next one's keeps them all (the estimate counts "
              "the prefetch + 2 largest resharded blocks, so keeping the last ones costs no more). The estimate "
              "does not count activations; the peak live memory does. Gathered params and full grads: the peaks of "
              "the library's full parameter and gradient buffers alive at once in one step (compare.py's transient "
              "sampling; FSDP2's read from its internals, best effort)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Step time (s) against peak live memory (MB): shardfusion's points joined in budget order, FSDP2's two, DDP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = result["points"]
    ax.plot([r["peak_live_mb"] for r in points], [r["step_s"] for r in points], "o-", label="shardfusion auto")
    for r in points:
        ax.annotate(f"{r['kept']} kept", (r["peak_live_mb"], r["step_s"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    for r, marker in zip(result["peers"], ("s", "D", "^")):
        ax.plot(r["peak_live_mb"], r["step_s"], marker, label=r["label"])
    ax.set_xlabel("peak live memory per rank (MB)")
    ax.set_ylabel("step time (s, median)")
    ax.set_title(f"{result['world_size']} ranks, HSDP {result['inner']} x {result['outer']}, regime "
                 f"{result['config']['regime']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from benchmarks.provenance import RunRecord, write_result
    from benchmarks.reshard_curve import worker as entry  # pickled by module name for the spawned workers
    from benchmarks.spawn import run_workers

    args = parse_args(argv)
    opts = {k: getattr(args, k) for k in ("regime", "n_layer", "repeats", "warmup", "steps", "outer", "prefetch",
                                          "seed")}
    with RunRecord() as record:
        os.environ["OMP_NUM_THREADS"] = "1"
        results = run_workers(entry, (opts,), args.nproc)
        if results is None:
            return 1
    raw = results[0]
    env = {**record.as_dict(), "command": "python -m benchmarks.reshard_curve " + " ".join(
        argv if argv is not None else sys.argv[1:])}
    result = {"name": args.name, "config": opts, "env": env, **raw}
    result.update(summarize(raw))
    out = Path(args.out_dir)
    write_result(out, args.name, result, markdown(result))
    try:
        plot(result, out / f"{args.name}.png")
    except ImportError as error:  # matplotlib: the train extra
        print(f"no plot: {error}")
    print(f"wrote {out / args.name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
