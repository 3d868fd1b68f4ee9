"""Memory of shardfusion against PyTorch FSDP2 on the same GPT, built eagerly and on the meta device, in one run.

    python benchmarks/memory.py                        # CPU: 4 gloo workers, a 25.4M-parameter GPT, 2 AdamW steps
    python benchmarks/memory.py --model-size issue     # the issue's GPT: 101.6M parameters, 387 MiB in fp32
    python benchmarks/memory.py --model-size tiny --world-size 2 --steps 1   # smoke run (seconds)

Variants: ``shardfusion-eager``, ``shardfusion-meta``, ``fsdp2-eager``, ``fsdp2-meta`` (see ``wrap_variant``). Each
one runs in W worker processes started for it alone (``benchmarks/spawn.py``), so that its high-water marks are its
own; with ``--repeats`` the variants are interleaved, the order rotated by one each repeat. Every rank samples its
memory at the end of each phase:

- ``baseline``: after the imports and the process groups the library needs (the global group, shardfusion's
  ``Topology`` or FSDP2's device mesh), before any model exists;
- ``build``: ``GPT(config)`` under ``torch.device(<device>)`` (eager) or ``torch.device("meta")`` (meta);
- ``wrap``: the library's ``fully_shard`` (and for FSDP2's meta build its recipe: ``model.to_empty(device=...)``,
  then ``reset_parameters()`` of each module that has one) and the AdamW optimizer;
- ``load``: pretrained weights streamed into the shards from one ``model.safetensors`` that the parent wrote before
  the workers started (an eager GPT under ``--seed + 1``): ``sf.load_safetensors(model, folder)`` for shardfusion;
  for FSDP2 ``torch.distributed.checkpoint.load`` of its sharded state dict with ``HuggingFaceStorageReader``
  (torch's own reader of Hugging Face safetensors folders);
- ``steps``: ``--steps`` training steps (forward, backward, clip to norm 1.0, ``optimizer.step()``, ``zero_grad``).

A sample holds VmHWM (peak resident set size since the process started; it cannot be reset) and VmRSS from
``/proc/self/status``, the bytes of the distinct tensor storages alive (parameters, gradients, optimizer state, the
library's own buffers; at ``steps`` taken just after the last ``optimizer.step()``, before ``zero_grad``), and on CUDA
``torch.cuda.max_memory_allocated`` since the previous sample (the peak statistics are reset at every sample).
``benchmarks/report.py`` (``memory_summary``) turns the per-rank samples into growths over the baseline, ratios and
theory; results: ``<out-dir>/<name>.json`` (raw and summary) and ``<name>.md``.

Host memory: with glibc's default, the threshold from which an allocation gets pages of its own (and gives them back
when freed) rises to the size of the largest such block freed so far, up to 32 MiB; after that, blocks of a unit's
size come from the heap, and what is freed there mostly stays resident, so VmHWM and VmRSS would grow with every
step whatever the library. The workers therefore run with ``MALLOC_MMAP_THRESHOLD_`` fixed (64 KiB by default,
``--malloc-mmap-threshold``; 0 keeps glibc's behaviour): tensors of 64 KiB and more are then mapped and unmapped
one by one, and the resident set follows the live tensors much more closely.

A variant whose wrap raises keeps the error text as its result, and the run goes on with the next variant.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (also in the spawned workers)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent

VARIANTS = ("shardfusion-eager", "shardfusion-meta", "fsdp2-eager", "fsdp2-meta")
"""``<library>-<build>``: library ``shardfusion`` or ``fsdp2``, the model built ``eager`` (on the device) or on
``meta``."""

MMAP_THRESHOLD = 64 * 1024
"""The workers' ``MALLOC_MMAP_THRESHOLD_`` by default (bytes; see the module doc)."""

MODEL_SIZES = {
    # For smoke tests only.
    "tiny": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64},
    # The default: 25.4M parameters (97.0 MiB in fp32); its steps take seconds, the workers' start most of the run.
    "small": {"n_layer": 8, "d_model": 512, "n_head": 8, "seq_len": 128},
    # The model: 101.6M parameters (387.4 MiB in fp32).
    "issue": {"n_layer": 8, "d_model": 1024, "n_head": 16, "seq_len": 512},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES),
                   help="GPT shape: " + "; ".join(f"{k}: {v}" for k, v in MODEL_SIZES.items()))
    p.add_argument("--n-layer", type=int, default=None, help="override the size's number of blocks")
    p.add_argument("--d-model", type=int, default=None, help="override the size's width")
    p.add_argument("--n-head", type=int, default=None, help="override the size's attention heads")
    p.add_argument("--seq-len", type=int, default=None, help="override the size's context (position table) length")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (<= the model's seq_len)")
    p.add_argument("--steps", type=int, default=2, help="AdamW steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=1, help="rounds over all variants, each in fresh processes")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--world-size", type=int, default=None, help="workers (default: 4 on CPU, one per GPU)")
    p.add_argument("--outer", type=int, default=1, help="HSDP replicas (outer degree); inner = world / outer")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per worker (default: cores / workers, at least 1)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=MMAP_THRESHOLD,
                   help="MALLOC_MMAP_THRESHOLD_ of the workers, in bytes: glibc then maps every allocation from this "
                        "size up on its own and returns it on free (see the module doc); 0 leaves the environment "
                        "as it is (glibc's dynamic threshold)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--name", default=None, help="result file stem (default: memory-<device>-<model size>)")
    p.add_argument("--out-dir", "--out", default=str(REPO / "benchmarks" / "results"),
                   help="folder of the .json and .md")
    args = p.parse_args(argv)
    for name in args.variants.split(","):
        if name not in VARIANTS:
            p.error(f"--variants: unknown variant {name!r}; pick from {VARIANTS}")
    if args.repeats < 1 or args.steps < 1 or args.batch < 1 or args.seq < 1:
        p.error("--repeats, --steps, --batch and --seq must be >= 1")
    if args.world_size is not None and (args.world_size < 1 or args.world_size % args.outer):
        p.error(f"--world-size must be a positive multiple of --outer ({args.outer})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False; use --device cpu")
    shape = {**MODEL_SIZES[args.model_size],
             **{k: v for k in ("n_layer", "d_model", "n_head", "seq_len") if (v := getattr(args, k)) is not None}}
    if args.seq > shape["seq_len"]:
        p.error(f"--seq {args.seq} is longer than the model's seq_len {shape['seq_len']}")
    args.shape = shape
    return args


# ---- worker -----------------------------------------------------------------------------------------------------
def _proc_status() -> dict[str, int]:
    """VmHWM and VmRSS of this process in bytes (0 where /proc/self/status lacks them)."""
    out = {"VmHWM": 0, "VmRSS": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in out:
                    out[key] = int(value.split()[0]) * 1024  # kB
    except OSError:
        pass
    return out


def sample(device: torch.device, live: dict[str, int] | None = None) -> dict:
    """This process's memory now (see the module doc); on CUDA, resets the peak statistics for the next phase."""
    gc.collect()
    status = _proc_status()
    out = {"hwm_bytes": status["VmHWM"], "rss_bytes": status["VmRSS"], "live": live or {"total": 0},
           "time_s": time.perf_counter()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _model_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Live bytes of a model not wrapped yet: its parameters' distinct storages (none on the meta device)."""
    from benchmarks.measure import persistent_bytes

    out = persistent_bytes({"params": [p for p in model.parameters() if not p.is_meta]})
    out["total"] = sum(out.values())
    return out


def shardfusion_meta_kwargs(device: torch.device) -> dict:
    """Keywords for ``sf.fully_shard`` on a meta-device model: the device to materialize it on (each module's own
    ``reset_parameters`` initializes it, as eager construction does)."""
    return {"device": device}


def wrap_variant(library: str, build: str, model, ctx):
    """The model wrapped by ``library`` (``benchmarks.variants.wrap``), materialized when built on ``meta``.

    - ``shardfusion-meta``: ``sf.fully_shard(model, topo, units=(Block,), **shardfusion_meta_kwargs(device))``.
    - ``fsdp2-meta``: FSDP2's recipe: ``fully_shard`` per Block then the root on the meta model, then
      ``model.to_empty(device=...)`` and ``reset_parameters()`` of every submodule that has one, then the root's
      ``GPT.reset_parameters()`` last (the GPT's own initialisation, which the submodules' defaults would otherwise
      overwrite); the optimizer is built afterwards, over the materialized parameters.
    """
    from benchmarks.variants import _adamw, wrap

    if library == "shardfusion":
        return wrap("shardfusion", model, ctx, **(shardfusion_meta_kwargs(ctx.device) if build == "meta" else {}))
    b = wrap("fsdp2", model, ctx)
    if build == "meta":
        model.to_empty(device=ctx.device)
        with torch.no_grad():
            for m in model.modules():
                if m is not model and callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
            model.reset_parameters()
        b.optimizer = _adamw(model)
    return b


def load_weights(library: str, model, folder: str) -> None:
    """Stream ``folder/model.safetensors`` into the sharded ``model``: each rank reads what its shards need."""
    if library == "shardfusion":
        import shardfusion as sf

        sf.load_safetensors(model, folder)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)  # DTensors over the model's own storage: loaded in place
    state.pop("lm_head.weight", None)  # tied to wte.weight, which the file holds once
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))


def write_weights(shape: dict, seed: int, folder: Path) -> str:
    """The pretrained weights every variant loads: an eager GPT under ``seed``, a tied weight once."""
    from safetensors.torch import save_file
    from shardfusion.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**shape))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.named_parameters()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return str(folder)


def _context(library: str, device: torch.device, opts: dict):
    """The process groups ``library`` needs, in a ``benchmarks.variants.Context``."""
    import shardfusion as sf
    from benchmarks.variants import Context

    world, outer = dist.get_world_size(), opts["outer"]
    inner = world // outer
    topo = mesh = None
    if library == "shardfusion":
        topo = sf.Topology(sharding=-1, fsdp_outer_degree=outer)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = (init_device_mesh(device.type, (inner,), mesh_dim_names=("shard",)) if outer == 1 else
                init_device_mesh(device.type, (outer, inner), mesh_dim_names=("replicate", "shard")))
    return Context(device=device, topo=topo, mesh=mesh, param_dtype=None, seed=opts["seed"])


def worker(variant: str, opts: dict) -> dict:
    """One rank of one variant: its samples per phase, its losses, the error that stopped it (if any)."""
    import torch.distributed.fsdp  # noqa: F401 - imported before the baseline, as shardfusion is
    from shardfusion.models.gpt import GPT, GPTConfig

    from benchmarks.compare import Regime, _batches
    from benchmarks.spawn import join
    from benchmarks.variants import live, step

    library, build = variant.split("-")
    device = join(opts["device"])
    ctx = _context(library, device, opts)
    rank = dist.get_rank()
    out: dict = {"rank": rank, "phases": {"baseline": sample(device)}, "losses": [], "error": None}
    phases = out["phases"]
    shape = opts["shape"]
    config = GPTConfig(**shape)
    torch.manual_seed(opts["seed"])
    with torch.device("meta" if build == "meta" else device):
        model = GPT(config)
    phases["build"] = sample(device, _model_bytes(model))
    try:
        b = wrap_variant(library, build, model, ctx)
    except Exception as error:  # noqa: BLE001 - every rank raises alike before any collective: the variant's result
        out["error"] = {"phase": "wrap", "text": f"{type(error).__name__}: {error}"}
    else:
        del model
        phases["wrap"] = sample(device, live(b))
        load_weights(library, b.model, opts["weights"])
        phases["load"] = sample(device, live(b))
        regime = Regime(batch=opts["batch"], seq=opts["seq"], n_layer=shape["n_layer"], d_model=shape["d_model"],
                        n_head=shape["n_head"])
        batches = _batches(regime, opts["steps"], opts["seed"], rank, device)
        after: dict = {}
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            loss = step(b, x, y, after_optimizer=(lambda: after.update(live(b))) if last else None)
            out["losses"].append(float(loss))
        phases["steps"] = sample(device, after)
    dist.barrier()
    dist.destroy_process_group()
    return out


# ---- parent -----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    from benchmarks import report
    from benchmarks.memory import worker as entry  # pickled by module name for the spawned workers
    from benchmarks.provenance import RunRecord
    from benchmarks.spawn import run_workers, under_torchrun
    from benchmarks.variants import unit_sizes
    from shardfusion.models.gpt import GPT, GPTConfig

    args = parse_args(argv)
    if under_torchrun():
        print("memory.py starts fresh workers for every variant: run it with python, not under torchrun",
              file=sys.stderr)
        return 2
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    world = args.world_size or (max(1, torch.cuda.device_count()) if device == "cuda" else 4)
    if world % args.outer:
        print(f"--outer {args.outer} does not divide the world size {world}", file=sys.stderr)
        return 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    name = args.name or f"memory-{device}-{args.model_size}"
    variants = args.variants.split(",")
    weights = tempfile.TemporaryDirectory(prefix="sf-memory-")
    opts = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "steps": args.steps, "device": device,
            "outer": args.outer, "seed": args.seed,
            "weights": write_weights(args.shape, args.seed + 1, Path(weights.name))}
    root, blocks = unit_sizes(GPTConfig(**args.shape))
    record, env = RunRecord().__enter__(), {}  # commit and load (benchmarks/provenance.py)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if args.malloc_mmap_threshold > 0:  # read by glibc when a process starts: the workers', not this one's
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    env["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    runs: dict[str, list] = {v: [] for v in variants}
    for r in range(args.repeats):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            t = time.time()
            results = run_workers(entry, (v, opts), world)
            run = {"wall_s": time.time() - t}
            if results is None:
                run["failed"] = "a worker failed (its error is printed above)"
            else:
                run["ranks"] = [results[i] for i in sorted(results)]
            runs[v].append(run)
            err = (run.get("ranks") or [{}])[0].get("error") or {}
            print(f"repeat {r} {v}: {run['wall_s']:.1f} s" + (f" ({err['phase']}: {err['text']})" if err else "")
                  + (f" ({run['failed']})" if "failed" in run else ""), flush=True)
    weights.cleanup()
    record.__exit__(None, None, None)
    env = {**record.as_dict(), **env}
    cfg = {**{k: v for k, v in vars(args).items() if k not in ("shape", "out_dir", "name")}, "device": device,
           "world_size": world, "inner": world // args.outer, "threads": threads, "variants": variants}
    with torch.device("meta"):
        largest = max(p.numel() for p in GPT(GPTConfig(**args.shape)).parameters())
    raw = {"benchmark": "memory", "name": name, "config": cfg, "shape": args.shape, "env": env,
           "unit_numel": {"root": root, "blocks": blocks}, "largest_tensor_numel": largest, "runs": runs}
    js, md = report.write_memory(raw, Path(args.out_dir))
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0 if all("failed" not in run for rs in runs.values() for run in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
