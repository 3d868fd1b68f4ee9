"""shardfusion HSDP vs PyTorch FSDP2 HSDP vs DDP on the same GPT and data, in one run.

    python benchmarks/compare.py                      # CPU: 4 gloo workers, HSDP 2 x 2, regimes comm and compute
    python benchmarks/compare.py --device cuda        # one worker per GPU, NCCL
    python benchmarks/compare.py --regimes tiny --repeats 1 --warmup 0 --steps 1   # smoke run (seconds)

It starts its own workers (torch's elastic launcher API, `benchmarks/spawn.py`; under torchrun each process is one
worker). For every regime, each repeat runs every variant in turn (the order rotates by one each repeat), each on a
fresh model under the same seed: W warm-up steps, a barrier, N timed steps. A step's time is the slowest rank's; the
reported time is the median over all timed steps of all repeats. After its first repeat's timed steps each variant
runs untimed, instrumented steps: one under a dispatch mode that records every collective and samples the
alive full buffers at every op, one that measures the persistent tensors after `optimizer.step()`, one under
`shardfusion.live_memory.LiveMemory` that finds the peak live tensor bytes and what they were at that moment (by
part and unit: `benchmarks/transient.py`), and on CUDA one between `reset_peak_memory_stats` and
`max_memory_allocated`. Results: `<out-dir>/<name>.json` (raw and summary) and
`<name>.md`; see benchmarks/README.md for how to read them.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (also in the spawned workers)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Regime:
    """A model and batch shape (per rank)."""

    batch: int
    seq: int
    n_layer: int
    d_model: int
    n_head: int


REGIMES = {
    # Communication-bound: little compute per parameter gathered.
    "comm": Regime(batch=1, seq=64, n_layer=8, d_model=256, n_head=4),
    # Compute-bound: 32 x the tokens per step, half the layers.
    "compute": Regime(batch=8, seq=256, n_layer=4, d_model=256, n_head=4),
    # For smoke tests only.
    "tiny": Regime(batch=1, seq=16, n_layer=2, d_model=32, n_head=2),
}


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.variants import ALL_VARIANTS, VARIANTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--regimes", default="comm,compute", help=f"comma-separated, from {sorted(REGIMES)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, from " + ",".join(ALL_VARIANTS) + " (the DeepSpeed ones need the bench "
                        "extra: pip install -e '.[bench]')")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all variants")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant per repeat")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per repeat")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=None, help="local workers (default: 4 on CPU, one per GPU)")
    p.add_argument("--outer", type=int, default=2, help="HSDP replicas (outer degree); inner = world / outer")
    p.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: FSDP2 MixedPrecisionPolicy(bf16, reduce fp32), shardfusion MixedPrecisionPolicy("
                        "param_dtype=bf16, grad_comm_dtype=fp32), DDP under autocast")
    p.add_argument("--reshard", default="after_forward", choices=("after_forward", "after_backward"),
                   help="when the sharded variants free a block's gathered parameters: after its forward (ZeRO-3; "
                        "gathered again for backward) or after its backward (FSDP2: reshard_after_forward=False)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="shardfusion's prefetch depth (units gathered ahead; fully_shard's default is 1)")
    p.add_argument("--units", default="block", choices=("block", "linear"),
                   help="unit granularity of shardfusion and FSDP2: one per block, or one per linear layer of the "
                        "blocks (DeepSpeed ZeRO-3's granularity); see benchmarks.variants.UNITS")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per worker, the same for every variant (default: cores / workers, at least 1)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--name", default=None, help="result file stem (default: <device>-<param dtype>)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--profile", action="store_true",
                   help="after the benchmark, profile 2 steps of each variant on rank 0 (torch.profiler and cProfile "
                        "tables next to the results)")
    args = p.parse_args(argv)
    for name in args.regimes.split(","):
        if name not in REGIMES:
            p.error(f"--regimes: unknown regime {name!r}; pick from {sorted(REGIMES)}")
    for name in args.variants.split(","):
        if name not in ALL_VARIANTS:
            p.error(f"--variants: unknown variant {name!r}; pick from {ALL_VARIANTS}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.prefetch < 0:
        p.error("--repeats and --steps must be >= 1, --warmup and --prefetch >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False; use --device cpu")
    return args


# ---- worker -----------------------------------------------------------------------------------------------------
def _ranks(group) -> tuple[int, ...]:
    if group is None:
        return (dist.get_rank(),)
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(regime: Regime, n: int, seed: int, rank: int, device: torch.device) -> list[tuple]:
    """n (x, y) pairs of random token ids (B, T) for this rank; the same for every variant."""
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    out = []
    for _ in range(n):
        tok = torch.randint(0, 256, (regime.batch, regime.seq + 1), generator=gen)  # (B, T+1)
        out.append((tok[:, :-1].to(device), tok[:, 1:].to(device)))  # (B, T) each
    return out


def _gather_max(d: dict) -> dict:
    """Element-wise max over ranks of a flat dict of numbers (all_gather_object: works on gloo and NCCL)."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, d)
    return {k: max(g[k] for g in got) for k in d}


def _instrument(b, batch, device: torch.device, want_cross_check: bool) -> dict:
    """Untimed steps (see the module doc): collectives and transient peaks, persistent bytes, the peak live bytes
    and their parts (``_peak_live``, from the rank with the largest peak), the CUDA peak."""
    import shardfusion as sf
    from benchmarks.measure import CollectiveRecorder
    from benchmarks.variants import persistent, step

    peaks: dict[str, int] = {}

    def sample() -> None:
        for k, v in b.sample_transient().items():
            if v > peaks.get(k, -1):
                peaks[k] = v

    rec = CollectiveRecorder(on_op=sample)
    # The recorder is a dispatch mode, which is thread-local: on CPU shardfusion issues the replicate all-reduces
    # overlapped with backward from a worker thread, unseen by it, so this step runs them at the step boundary (the
    # same collectives, on this thread); the variant's own setting is put back afterwards.
    state = getattr(b.model, "_sf_state", None)
    saved = None if state is None else state.is_last_backward
    if state is not None:
        sf.set_is_last_backward(b.model, False)
    with sf.comm.CommCounter() as counter, rec:
        step(b, *batch)
    if state is not None:
        sf.set_is_last_backward(b.model, saved)
    _sync(device)
    out: dict = {"collectives": [c.as_dict() for c in rec.collectives]}
    if want_cross_check:  # shardfusion's own count against the dispatch-level one
        from collections import Counter
        ours = Counter(r.op for r in counter.records)
        seen = Counter(c.kind for c in rec.collectives)
        out["cross_check"] = {"comm_counter": dict(ours), "dispatch": dict(seen),
                              "agree": all(seen.get(k, 0) == n for k, n in ours.items())}
    pers: dict = {}
    step(b, *batch, after_optimizer=lambda: pers.update(persistent(b)))
    mem: dict = {"persistent": _gather_max(pers), "transient": _gather_max(peaks) if peaks else {},
                 "live": _gather_at_max(_peak_live(b, batch), "peak_bytes")}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step(b, *batch)
        _sync(device)
        mem["cuda"] = _gather_max({"allocated_before_bytes": base,
                                   "peak_allocated_bytes": torch.cuda.max_memory_allocated(device)})
    out["memory"] = mem
    return out


def _peak_live(b, batch) -> dict:
    """One untimed step under ``shardfusion.live_memory.LiveMemory``: the largest live tensor bytes of this rank
    (``peak_bytes``) and what they were at that moment (``parts``, ``units``), the same instrument for every variant.
    Registered before the step: the parameters, gradients and optimizer state (each variant's ``persistent``
    tensors) and the library's own buffers (``variants.library_tensors``); during it, every tensor an op returns.
    The parts: those of ``variants.memory_watch`` (read again at every op: shardfusion's and FSDP2's full buffers are
    resized in place), then the rest by origin: the buffers of collectives, what the forward made (activations),
    what the clipping and optimizer step made, the rest of backward (``other``); ``units``: per part
    ``full_params`` / ``full_grads``, the bytes of each unit alive at the peak. What it cannot see: tensors made off
    this thread or inside a library's C++ code without an op (DDP's buckets are its gradients, seen), and the
    allocator's slack."""
    from shardfusion.live_memory import LiveMemory
    from benchmarks.variants import library_tensors, memory_watch, persistent_tensors, step

    import shardfusion as sf

    tracker = LiveMemory(memory_watch(b))
    tracker.add(persistent_tensors(b)() + library_tensors(b))
    state = getattr(b.model, "_sf_state", None)  # as for the recorder: the replicate all-reduces on this thread
    saved = None if state is None else state.is_last_backward
    if state is not None:
        sf.set_is_last_backward(b.model, False)

    def on_phase(part: str) -> None:
        tracker.phase = part

    gc.collect()  # garbage in reference cycles would otherwise die at a moment the step does not set
    with tracker:
        tracker.reset_peak()
        step(b, *batch, on_phase=on_phase)
    if state is not None:
        sf.set_is_last_backward(b.model, saved)
    peak = tracker.peak
    return {"peak_bytes": peak.total, "parts": dict(peak.parts), "units": peak.units}


def _gather_at_max(d: dict, key: str) -> dict:
    """The dict of the rank whose ``d[key]`` is the largest (all_gather_object), with ``rank`` added."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, d)
    rank = max(range(len(got)), key=lambda r: got[r][key])
    return {**got[rank], "rank": rank}


def _run_regime(name: str, regime: Regime, variants: list[str], opts: dict, ctx) -> dict:
    from shardfusion.models.gpt import GPTConfig
    from benchmarks.variants import build, step, unit_sizes

    rank, device = dist.get_rank(), ctx.device
    config = GPTConfig(n_layer=regime.n_layer, n_head=regime.n_head, d_model=regime.d_model, seq_len=regime.seq)
    root, blocks = unit_sizes(config, opts["units"])
    batches = _batches(regime, opts["warmup"] + opts["steps"], opts["seed"], rank, device)
    res = {v: {"step_s": [], "losses": []} for v in variants}
    for r in range(opts["repeats"]):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            if res[v].get("skipped"):
                continue
            try:
                b = build(v, config, ctx)
            except NotImplementedError as e:
                res[v]["skipped"] = str(e)
                continue
            for x, y in batches[:opts["warmup"]]:
                step(b, x, y)
            _sync(device)
            dist.barrier()
            durations, losses = [], []
            for x, y in batches[opts["warmup"]:]:
                t0 = time.perf_counter()
                losses.append(step(b, x, y))
                _sync(device)
                durations.append(time.perf_counter() - t0)
            t = torch.tensor(durations, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res[v]["step_s"].append(t.tolist())
            res[v]["losses"].append([float(loss) for loss in losses])
            if r == 0:
                res[v].update(_instrument(b, batches[0], device, v == "shardfusion"))
                res[v]["note"] = b.note
                if opts["profile"]:
                    res[v]["profile"] = _profile(b, batches, device, f"{opts['name']}.profile.{name}.{v}",
                                                 Path(opts["out_dir"]))
            del b
            gc.collect()
            if rank == 0:
                print(f"[{name}] repeat {r} {v}: median {sorted(res[v]['step_s'][-1])[len(durations) // 2]:.3f} s",
                      flush=True)
    for v in variants:
        if res[v]["losses"]:
            res[v]["loss_first_last"] = [res[v]["losses"][0][0], res[v]["losses"][0][-1]]
    tied = config.vocab_size * config.d_model if config.tie_embeddings else 0  # used by wte and lm_head
    return {"shape": asdict(regime), "unit_numel": {"root": root, "blocks": blocks, "tied": tied}, "variants": res}


def _profile(b, batches, device: torch.device, stem: str, out_dir: Path) -> dict:
    """Two steps on every rank; rank 0 profiles them with torch.profiler and cProfile and writes the tables."""
    import cProfile
    import io
    import pstats

    from benchmarks.variants import step

    if dist.get_rank() != 0:
        for x, y in batches[:2]:
            step(b, x, y)
        _sync(device)
        return {}
    out_dir.mkdir(parents=True, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        step(b, *batches[0])
        _sync(device)
    torch_path = out_dir / f"{stem}.torch.txt"
    torch_path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    pr = cProfile.Profile()
    pr.enable()
    step(b, *batches[1])
    _sync(device)
    pr.disable()
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf).sort_stats("tottime")
    stats.print_stats(35)
    stats.print_callers("wait|zeros|reduce_scatter_single|all_gather_single|allreduce")  # where the waits come from
    py_path = out_dir / f"{stem}.cprofile.txt"
    py_path.write_text(buf.getvalue())
    return {"torch_table": str(torch_path), "cprofile_table": str(py_path)}


def worker(opts: dict) -> dict | None:
    """One rank's whole benchmark; rank 0 returns the raw results, other ranks None."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardfusion as sf
    from benchmarks.spawn import join
    from benchmarks.variants import Context

    device = join(opts["device"])
    world = dist.get_world_size()
    outer = opts["outer"]
    if world % outer:
        raise ValueError(f"--outer {outer} does not divide the world size {world}")
    inner = world // outer
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=outer)
    mesh = init_device_mesh(device.type, (outer, inner), mesh_dim_names=("replicate", "shard"))
    dtype = torch.bfloat16 if opts["param_dtype"] == "bf16" else None
    ctx = Context(device=device, topo=topo, mesh=mesh, param_dtype=dtype, reshard_policy=opts["reshard"],
                  prefetch=opts["prefetch"], seed=opts["seed"], units=opts["units"])
    groups = {"inner": _ranks(topo.get_fsdp_inner_group()) if inner > 1 else (dist.get_rank(),),
              "outer": _ranks(topo.get_replicate_group()) if outer > 1 else (dist.get_rank(),),
              "world": tuple(range(world))}
    regimes = {}
    for name in opts["regimes"]:
        regimes[name] = _run_regime(name, REGIMES[name], opts["variants"], opts, ctx)
    dist.barrier()
    result = None
    if dist.get_rank() == 0:
        result = {"regimes": regimes, "groups": groups, "inner": inner, "world_size": world,
                  "backend": dist.get_backend(), "threads": torch.get_num_threads()}
    dist.destroy_process_group()
    return result


# ---- parent -----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    from benchmarks import report
    from benchmarks.provenance import RunRecord
    from benchmarks.compare import worker as entry  # pickled by module name for the spawned workers
    from benchmarks.spawn import end_process, run_workers, under_torchrun

    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    nproc = args.nproc or (max(1, torch.cuda.device_count()) if device == "cuda" else 4)
    threads = args.threads or max(1, (os.cpu_count() or 1) // nproc)
    name = args.name or f"{device}-{args.param_dtype}"
    opts = {"regimes": args.regimes.split(","), "variants": args.variants.split(","), "repeats": args.repeats,
            "warmup": args.warmup, "steps": args.steps, "device": device, "outer": args.outer,
            "param_dtype": args.param_dtype, "reshard": args.reshard, "prefetch": args.prefetch, "seed": args.seed,
            "units": args.units,
            "profile": args.profile, "name": name,
            "out_dir": args.out_dir}
    with RunRecord() as record:
        if under_torchrun():
            os.environ.setdefault("OMP_NUM_THREADS", str(threads))
            res = entry(opts)
            if res is None:
                end_process(0)
        else:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            results = run_workers(entry, (opts,), nproc)
            if results is None:
                return 1
            res = results[0]
    env = {**record.as_dict(), "command": "python -m benchmarks.compare " + " ".join(
        argv if argv is not None else sys.argv[1:])}
    cfg = {**{k: v for k, v in opts.items() if k not in ("regimes", "variants")}, "regimes": opts["regimes"],
           "variants": opts["variants"], "world_size": res["world_size"], "inner": res["inner"],
           "backend": res["backend"], "threads": res["threads"], "prefetch_depth": args.prefetch}
    raw = {"name": name, "config": cfg, "env": env, "groups": res["groups"], "regimes": res["regimes"]}
    js, md = report.write(raw, Path(args.out_dir))
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
