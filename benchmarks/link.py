"""Side by side across an emulated network link: shardfusion HSDP, FSDP and DiLoCo, FSDP2 HSDP and FSDP, DDP, on two
nodes.

    python -m benchmarks.link                               # 100mbit, 1gbit, unlimited; 2 nodes x 2 ranks (root)
    python -m benchmarks.link --rates 200mbit,1gbit --quick # 1 repeat, 1 warm-up + 2 timed steps per variant
    python -m benchmarks.link --rates 200mbit --variants sf-hsdp,ddp --out-dir /tmp/x   # a subset elsewhere
    python -m benchmarks.link --rates 200mbit,unlimited --variants sf-hsdp,sf-diloco-8,ddp  # DiLoCo vs one node

Results: benchmarks/results/link-cpu.{json,md} (raw and summary; the markdown report).

Every link rate gets a fresh :class:`benchmarks.netcluster.EmulatedCluster` (two network namespaces, a veth pair,
a tbf on each end) and one job of 2 nodes x 2 ranks (torchrun per node, gloo; ranks 0-1 on node 0, 2-3 on node 1).
The model is the comm-bound GPT of ``benchmarks/compare.py`` (regime ``comm``: batch 1, seq 64, 8 layers, d 256,
6.5M parameters), built, wrapped and stepped by ``benchmarks/variants.py`` (AdamW, clip 1.0, fp32):

- ``sf-hsdp``: shardfusion HSDP, outer 2 (across nodes) x inner 2 (within a node); ``set_is_last_backward`` never
  called (the library's default schedule of the replicate all-reduce);
- ``sf-hsdp-last``: the same with ``sf.set_is_last_backward(model, True)`` before every step;
- ``sf-fsdp``: shardfusion FSDP over the 4 ranks (outer 1);
- ``fsdp2-hsdp``: FSDP2 ``fully_shard`` over the mesh (replicate 2, shard 2); ``fsdp2-fsdp``: over a 1-D mesh of 4;
- ``ddp``: DistributedDataParallel over the 4 ranks;
- ``sf-hsdp-bf16``, ``sf-hsdp-int8``: ``sf-hsdp`` with ``fully_shard(..., outer_comm_dtype=torch.bfloat16 / "int8")``,
  run only when ``fully_shard`` takes that keyword (else skipped with a note);
- ``sf-diloco-8``, ``sf-diloco-32``: ``sf-hsdp`` (default schedule) plus ``sf.DiLoCo(model, topo, every=H)`` with
  H = 8 / 32 (fp32 pseudo-gradients, the outer defaults: Nesterov 0.9, lr 0.7, one fragment): one replica per node,
  no gradient all-reduce between the nodes; ``DiLoCo.step()`` runs after every ``optimizer.step()`` (before
  ``zero_grad``, inside the timed step), and every H-th step it carries the outer all-reduce of the pseudo-gradients
  over the replicate group (the nodes); ``sf-diloco-8-int8``, ``sf-diloco-32-int8``: H = 8 / 32 with
  ``DiLoCo(..., comm_dtype="int8")``
  (``fully_shard`` itself gets no compression keyword). Run only when ``shardfusion`` has ``DiLoCo``.

For each rate, each repeat runs every variant in turn (order rotated by one each repeat), each on a fresh model under
the same seed and the same batches: W warm-up steps, a barrier, node 0's and node 1's veth ``tx_bytes`` read (local
rank 0 of each node, in its namespace), a barrier, N timed steps, a barrier, the counters again. A step's time is the
slowest rank's; the reported time is the median over every timed step of every repeat. Link bytes per step: the veth
delta over the timed steps / N (the barriers add a few hundred bytes).

DiLoCo variants are timed over whole periods: their N is ``max(--steps, H)`` rounded up to a multiple of H, N
consecutive steps right after the warm-up (with the warm-up's steps counted by ``DiLoCo``, as in training), so
exactly N / H of the timed steps carry an outer step, whichever step the period starts at; the worker records for
each timed step whether it did (``outer_step``). Their batches are the same as everyone's, continued (the batch
list is made long enough for the longest window). Their figure is the *mean* step time over the window (the median
is an inner step: it hides the outer steps), with the median inner step and the mean outer step beside it, and the
ratio of means against ``sf-hsdp`` and ``ddp`` at the same rate and against the "one node" reference, ``sf-hsdp``
at rate ``unlimited`` (the two nodes without a rate limit stand in for one node: a job on one machine would have
other ranks and another topology); n/a when that rate was not run. For the shardfusion variants the timed steps
run inside a ``sf.comm.CommCounter``: its cross-node bytes (shardfusion/accounting.py: node of rank r is r // 2; ring
hops that join nodes, exact all-to-all bytes), summed over a node's ranks, are set next to that node's veth bytes.
In the first repeat each variant also runs one untimed step under ``benchmarks.measure.CollectiveRecorder``: every
collective of any library, with the cross-node bytes of the algorithm gloo runs (ring all-gather and all-reduce;
FSDP2's reduce-scatter as gloo's full all-reduce; shardfusion's reduce-scatter as the all-to-all it issues on gloo);
for a DiLoCo variant the recorded step is an inner step, then one outer step (``DiLoCo.sync`` of every fragment,
out of schedule: the model is dropped after) is recorded apart, and the modelled bytes per step are inner + outer / H.

Ratios: against DDP and FSDP2 HSDP (ratio of medians, and the median over repeats of the within-repeat ratio), and
against the link floor: the node's link bytes per step / the rate (the time the link needs for them at full rate).
At 200 Mbit/s the targets include, per DiLoCo variant, its mean step within 1.15 x the one-node reference's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.provenance import RunRecord, describe  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NODES, NPROC_PER_NODE = 2, 2
DEFAULT_RATES = "100mbit,1gbit,unlimited"

# name: (library variant of benchmarks/variants.py, outer degree, set_is_last_backward before each step,
#        fully_shard keywords as (key, value name) (except DILOCO_KEYS), label)
VARIANTS = {
    "sf-hsdp": ("shardfusion", 2, False, {}, "shardfusion HSDP 2x2, default"),
    "sf-hsdp-last": ("shardfusion", 2, True, {}, "same, set_is_last_backward(True) each step"),
    "sf-fsdp": ("shardfusion", 1, False, {}, "shardfusion FSDP (outer 1)"),
    "fsdp2-hsdp": ("fsdp2", 2, False, {}, "FSDP2 HSDP"),
    "fsdp2-fsdp": ("fsdp2", 1, False, {}, "FSDP2 FSDP"),
    "ddp": ("ddp", 1, False, {}, "DDP"),
    # Optional (the bench extra): DeepSpeed ZeRO-3 over all ranks, and hpZ with its secondary partition in the node.
    "ds-zero3": ("deepspeed", 1, False, {}, "DeepSpeed ZeRO-3 (over all ranks)"),
    "ds-hpz": ("ds-hpz", 2, False, {}, "DeepSpeed ZeRO++ hpZ (secondary partition in the node)"),
    "sf-hsdp-bf16": ("shardfusion", 2, False, {"outer_comm_dtype": "bf16"}, "shardfusion HSDP, outer bf16"),
    "sf-hsdp-int8": ("shardfusion", 2, False, {"outer_comm_dtype": "int8"}, "shardfusion HSDP, outer int8"),
    "sf-diloco-8": ("shardfusion", 2, False, {"diloco": 8}, "shardfusion DiLoCo H=8"),
    "sf-diloco-32": ("shardfusion", 2, False, {"diloco": 32}, "shardfusion DiLoCo H=32"),
    "sf-diloco-8-int8": ("shardfusion", 2, False, {"diloco": 8, "diloco_comm_dtype": "int8"},
                         "shardfusion DiLoCo H=8, int8 pseudo-gradients"),
    "sf-diloco-32-int8": ("shardfusion", 2, False, {"diloco": 32, "diloco_comm_dtype": "int8"},
                          "shardfusion DiLoCo H=32, int8 pseudo-gradients"),
}
OPTIONAL = ("ds-zero3", "ds-hpz")
"""Variants left out by default: they need DeepSpeed."""
COMPRESSED = ("sf-hsdp-bf16", "sf-hsdp-int8")
DILOCO_KEYS = ("diloco", "diloco_comm_dtype")
"""Spec keys that are not ``fully_shard``'s: ``"diloco": H`` makes a ``sf.DiLoCo(model, topo, every=H)`` after
``fully_shard``, ``"diloco_comm_dtype"`` its ``comm_dtype`` (value names as for ``fully_shard``: ``"bf16"``,
``"int8"``)."""
DILOCO = tuple(v for v, spec in VARIANTS.items() if "diloco" in spec[3])
ONE_NODE_RATE = "unlimited"
"""The one-node stand-in of the DiLoCo table: ``sf-hsdp`` at this rate (the two nodes with no rate limit)."""
ONE_NODE_REF = "sf-hsdp"
DILOCO_VS_ONE_NODE = 1.15
TARGETS_RATE = "200mbit"
"""The issue's targets are stated at 200 Mbit/s."""


def has_outer_comm_dtype() -> bool:
    """Whether ``shardfusion.fully_shard`` takes an ``outer_comm_dtype`` keyword."""
    import shardfusion as sf

    return "outer_comm_dtype" in inspect.signature(sf.fully_shard).parameters


def has_diloco() -> bool:
    """Whether ``shardfusion`` has ``DiLoCo``."""
    import shardfusion as sf

    return hasattr(sf, "DiLoCo")


def _dtype(value):
    import torch

    return torch.bfloat16 if value == "bf16" else value


def _fs_kwargs(spec: dict) -> dict:
    """A spec's ``fully_shard`` keywords (all but ``DILOCO_KEYS``), value names turned into dtypes."""
    return {k: _dtype(v) for k, v in spec.items() if k not in DILOCO_KEYS}


def diloco_every(variant: str) -> Optional[int]:
    """H of a DiLoCo variant, else None."""
    return VARIANTS[variant][3].get("diloco")


def timed_steps(variant: str, steps: int) -> int:
    """Timed steps per repeat: ``steps``, or for a DiLoCo variant ``max(steps, H)`` rounded up to a multiple of H
    (whole periods: exactly one step in H carries an outer step)."""
    h = diloco_every(variant)
    return steps if h is None else -(-max(steps, h) // h) * h


# ---- worker (under torchrun, one per rank) ----------------------------------------------------------------------
def _read_tx() -> Optional[int]:
    """This node's veth tx_bytes (local rank 0 only; the namespace's /sys is the node's), else None."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def _per_node(values: list, local: int) -> list:
    """Sum a per-rank list over each node's ranks (consecutive ranks per node)."""
    return [sum(values[n * local:(n + 1) * local]) for n in range(len(values) // local)]


def _modelled_cross(collectives, lib: str, local: int) -> float:
    """Cross-node bytes this rank sends for ``collectives`` (benchmarks.measure.Collective) under the algorithms gloo
    runs (see the module doc)."""
    import torch.distributed as dist

    from shardfusion.accounting import ring_crossings

    me = dist.get_rank()
    total = 0.0
    for c in collectives:
        ranks, g, n = tuple(c.ranks), len(c.ranks), c.nbytes
        if g < 2:
            continue
        if c.kind == "reduce_scatter" and lib == "shardfusion":  # an all-to-all of the N/g chunks
            total += n / g * sum(1 for r in ranks if r // local != me // local)
            continue
        if c.kind == "reduce_scatter":  # gloo: a full all-reduce of the input
            wire = 2 * (g - 1) / g * n
        elif c.kind == "all_reduce":
            wire = 2 * (g - 1) / g * n
        else:  # all_gather, broadcast
            wire = (g - 1) / g * n
        total += wire * ring_crossings(ranks, local) / g
    return total


def worker(opts: dict) -> Optional[dict]:
    """One rank's benchmark at one link rate; rank 0 returns the raw results."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardfusion as sf
    from shardfusion.models.gpt import GPT, GPTConfig

    from benchmarks.compare import REGIMES, Regime, _batches
    from benchmarks.measure import CollectiveRecorder
    from benchmarks.spawn import join
    from benchmarks.variants import Context, step, unit_sizes, wrap

    device = join("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    regime = Regime(**opts["shape"]) if opts.get("shape") else REGIMES[opts["regime"]]  # shape: tests' tiny GPTs
    config = GPTConfig(n_layer=regime.n_layer, n_head=regime.n_head, d_model=regime.d_model, seq_len=regime.seq)
    root, blocks = unit_sizes(config)
    contexts = {}
    for outer in sorted({VARIANTS[v][1] for v in opts["variants"]}):
        topo = sf.Topology(sharding=-1, fsdp_outer_degree=outer)
        mesh = (init_device_mesh("cpu", (outer, world // outer), mesh_dim_names=("replicate", "shard")) if outer > 1
                else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
        contexts[outer] = Context(device=device, topo=topo, mesh=mesh, param_dtype=None, seed=opts["seed"])
    variants = list(opts["variants"])
    n_timed = {v: timed_steps(v, opts["steps"]) for v in variants}  # opts["steps"], or whole DiLoCo periods
    # the same batches for every variant; a longer list only continues the sequence (benchmarks.compare._batches)
    longest = max(n_timed.values(), default=opts["steps"])
    batches = _batches(regime, opts["warmup"] + longest + 1, opts["seed"], rank, device)
    res: dict = {v: {"step_s": [], "link_bytes": [], "accounting": [], "losses": [], "timed_steps": n_timed[v]}
                 for v in variants}
    for v in variants:
        if diloco_every(v) is not None:
            res[v]["outer_step"] = []  # per repeat: per timed step, whether it carried the outer step
    for r in range(opts["repeats"]):
        k = (r + opts.get("rotate", 0)) % len(variants)  # rotate: this job's repeat number under --interleave-rates
        for v in variants[k:] + variants[:k]:
            lib, outer, per_step_last, spec, _ = VARIANTS[v]
            n = n_timed[v]
            timed = batches[opts["warmup"]:opts["warmup"] + n]
            torch.manual_seed(opts["seed"])
            model = GPT(config)
            b = wrap(lib, model, contexts[outer], **({"last_backward": None} if lib == "shardfusion" else {}),
                     **_fs_kwargs(spec))
            diloco = None
            carried: list = []  # DiLoCo: per step since the last clear, whether it carried the outer step
            if "diloco" in spec:
                diloco = sf.DiLoCo(b.model, contexts[outer].topo, every=spec["diloco"],
                                   comm_dtype=_dtype(spec.get("diloco_comm_dtype")))
                # Warm the outer step as the warm-up steps warm the inner ones: inner steps never touch the
                # replicate group, so its first all-reduce would pay gloo's first-use costs inside the timed window.
                # The replicas are still identical here: every pseudo-gradient is zero and the sync changes nothing.
                for f in range(len(diloco.fragments)):
                    diloco.sync(f)

            def one(x, y):
                if per_step_last:
                    sf.set_is_last_backward(b.model, True)
                if diloco is None:
                    return step(b, x, y)
                return step(b, x, y, after_optimizer=lambda: carried.append(bool(diloco.step())))

            for x, y in batches[:opts["warmup"]]:
                one(x, y)
            carried.clear()
            dist.barrier()
            tx0 = _read_tx()
            dist.barrier()
            counter = sf.comm.CommCounter(ranks_per_node=local) if lib == "shardfusion" else contextlib.nullcontext()
            durations, losses = [], []
            with counter:
                for x, y in timed:
                    t0 = time.perf_counter()
                    losses.append(one(x, y))
                    durations.append(time.perf_counter() - t0)
            dist.barrier()
            tx1 = _read_tx()
            t = torch.tensor(durations, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            acct = None
            if lib == "shardfusion":
                summ = counter.summary()
                acct = {c: row["cross_node_bytes"] for c, row in summ.items()}
            got: list = [None] * world
            dist.all_gather_object(got, {"tx": None if tx0 is None else tx1 - tx0, "acct": acct})
            res[v]["step_s"].append(t.tolist())
            res[v]["losses"].append([float(loss) for loss in losses])
            if diloco is not None:
                res[v]["outer_step"].append(list(carried))
            res[v]["link_bytes"].append([g["tx"] for g in got if g["tx"] is not None])  # node by node
            if acct is not None:  # per node: {category: bytes over the timed steps}
                cats = list(acct)
                res[v]["accounting"].append([{c: sum(got[i]["acct"][c] for i in range(n * local, (n + 1) * local))
                                              for c in cats} for n in range(world // local)])
            if r == 0 and opts.get("record", True):
                rec = CollectiveRecorder()
                if lib == "shardfusion":
                    # a dispatch mode is thread-local: the overlapped all-reduces, issued from shardfusion's worker
                    # thread, would not be seen; at the step boundary they run on this thread (same collectives)
                    sf.set_is_last_backward(b.model, False)
                with rec:
                    step(b, *batches[opts["warmup"] + n])  # the batch after the timed ones (no DiLoCo step)
                mine = _modelled_cross(rec.collectives, lib, local)
                outer_mine, outer_rec = 0.0, None
                if diloco is not None:  # one outer step apart, out of schedule (the model is dropped after)
                    outer_rec = CollectiveRecorder()
                    with outer_rec:
                        for f in range(len(diloco.fragments)):
                            diloco.sync(f)
                    outer_mine = _modelled_cross(outer_rec.collectives, lib, local)
                allm: list = [None] * world
                dist.all_gather_object(allm, (mine, outer_mine))
                if diloco is None:
                    res[v]["modelled_cross_bytes_per_step"] = _per_node([m for m, _ in allm], local)
                else:
                    h = diloco.every
                    res[v]["modelled_cross_bytes_per_step"] = _per_node([m + o / h for m, o in allm], local)
                    res[v]["modelled_inner_cross_bytes_per_step"] = _per_node([m for m, _ in allm], local)
                    res[v]["modelled_outer_cross_bytes"] = _per_node([o for _, o in allm], local)
                    res[v]["outer_collectives"] = len(outer_rec.collectives)
                res[v]["collectives_per_step"] = len(rec.collectives)
                res[v]["note"] = b.note
                if diloco is not None:
                    res[v]["note"] += (f"; sf.DiLoCo(every={diloco.every}, comm_dtype="
                                       f"{spec.get('diloco_comm_dtype')!r}), step() after every optimizer step")
            del b, model, diloco
            gc.collect()
            if rank == 0:
                med = statistics.median(res[v]["step_s"][-1])
                extra = ""
                if "outer_step" in res[v]:
                    extra = (f", mean {statistics.mean(res[v]['step_s'][-1]):.3f} s over {n} steps "
                             f"({sum(res[v]['outer_step'][-1])} outer)")
                print(f"[{opts['rate']}] repeat {r} {v}: median {med:.3f} s{extra}, link "
                      f"{[round(x / n / 1e6, 2) for x in res[v]['link_bytes'][-1]]} MB/step per node",
                      flush=True)
    dist.barrier()
    if rank != 0:
        return None
    return {"variants": res, "unit_numel": {"root": root, "blocks": blocks}, "shape": dict(regime.__dict__),
            "world_size": world, "local_world_size": local, "backend": str(dist.get_backend()),
            "threads": torch.get_num_threads()}


def worker_main(opts_path: str, out_path: str) -> None:
    from benchmarks.spawn import end_process

    opts = json.loads(Path(opts_path).read_text())
    result = worker(opts)
    if result is not None:
        Path(out_path).write_text(json.dumps(result))
    end_process(0)


# ---- parent -----------------------------------------------------------------------------------------------------
def _follow(cluster, procs, log: Path, timeout: float, prefix: str) -> None:
    """Echo node 0's progress lines (those starting with ``prefix``) while the job runs; then
    :meth:`EmulatedCluster.wait` (raises on a failure)."""
    deadline = time.monotonic() + timeout
    pos = 0
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if log.exists():
            text = log.read_text(errors="replace")
            for line in text[pos:].splitlines(keepends=True):
                if line.startswith(prefix) and line.endswith("\n"):
                    print("  " + line, end="", flush=True)
            pos = len(text) if text.endswith("\n") else text.rfind("\n") + 1
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
            break
        time.sleep(0.5)
    cluster.wait(procs, max(1.0, deadline - time.monotonic()))


def run_rate(rate: str, opts: dict, timeout: float, module: str = "benchmarks.link") -> dict:
    """One job at one link rate in a fresh emulated cluster: ``python -m <module> --worker OPTS OUT`` on every rank
    (this benchmark's, or another one's built the same way, e.g. ``benchmarks.plan_check``); the worker's raw
    results plus the link's settings."""
    from benchmarks.netcluster import EmulatedCluster

    prefix = module.rsplit(".", 1)[-1] + "-"
    with EmulatedCluster(nodes=NODES, rate=rate) as cluster, tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        opts = {**opts, "rate": cluster.rate}
        opts_path, out_path = Path(tmp) / "opts.json", Path(tmp) / "out.json"
        opts_path.write_text(json.dumps(opts))
        procs = cluster.torchrun(["-m", module, "--worker", str(opts_path), str(out_path)],
                                 nproc_per_node=NPROC_PER_NODE, env={"PYTHONPATH": str(REPO)}, log_dir=tmp, cwd=REPO)
        _follow(cluster, procs, Path(tmp) / "node0.log", timeout, f"[{cluster.rate}]")
        raw = json.loads(out_path.read_text())
        raw["link"] = cluster.describe()
        raw["qdisc"] = cluster.qdisc_stats()
    return raw


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(raw: dict) -> dict:
    """Per rate and variant: median step time, ratios, link bytes per step per node (veth), the accounting's and
    the model's cross-node bytes per step, the floor; per rate the DiLoCo table (`_diloco_rows`) and the targets."""
    per_rate = {}
    for rate, rr in raw["rates"].items():
        bps = rr["link"]["rate_bps"]
        rows = {}
        for v, vr in rr["variants"].items():
            if not vr["step_s"]:
                continue
            steps = vr.get("timed_steps", raw["config"]["steps"])  # per repeat (older results: the config's)
            times = [t for rep in vr["step_s"] for t in rep]
            nodes = len(vr["link_bytes"][0])
            link = [_median([rep[n] / steps for rep in vr["link_bytes"]]) for n in range(nodes)]
            row = {"label": VARIANTS[v][4], "median_step_s": _median(times), "min_step_s": min(times),
                   "max_step_s": max(times), "n_steps": len(times), "timed_steps": steps,
                   "mean_step_s": statistics.mean(times),
                   "mean_per_repeat_s": [statistics.mean(rep) for rep in vr["step_s"]],
                   "median_per_repeat_s": [_median(rep) for rep in vr["step_s"]],
                   "link_bytes_per_step": link,
                   "modelled_cross_bytes_per_step": vr.get("modelled_cross_bytes_per_step"),
                   "loss_first_last": [vr["losses"][0][0], vr["losses"][0][-1]], "note": vr.get("note", "")}
            if vr["accounting"]:
                per_node = [_median([sum(rep[n].values()) / steps for rep in vr["accounting"]]) for n in range(nodes)]
                by_cat = {c: statistics.mean(rep[0][c] for rep in vr["accounting"]) / steps
                          for c in vr["accounting"][0][0]}
                row["accounting_cross_bytes_per_step"] = per_node
                row["accounting_by_category_node0"] = {c: b for c, b in by_cat.items() if b}
                row["link_vs_accounting"] = [a / b if b else None for a, b in zip(link, per_node)]
            if bps:
                row["floor_s"] = max(link) * 8 / bps
                row["vs_floor"] = row["median_step_s"] / row["floor_s"] if row["floor_s"] else None
            rows[v] = row
        for v, row in rows.items():
            for peer in ("ddp", "fsdp2-hsdp"):
                p = rows.get(peer)
                if p is None:
                    continue
                row[f"vs_{peer}"] = row["median_step_s"] / p["median_step_s"]
                pairs = [a / b for a, b in zip(row["median_per_repeat_s"], p["median_per_repeat_s"]) if a and b]
                row[f"vs_{peer}_paired"] = _median(pairs)
        per_rate[rate] = (bps, rows)
    one_node = per_rate.get(ONE_NODE_RATE, (None, {}))[1].get(ONE_NODE_REF)
    out = {}
    for rate, (bps, rows) in per_rate.items():
        diloco = _diloco_rows(raw["rates"][rate], rows, one_node, bool(raw["config"].get("interleave_rates")))
        out[rate] = {"rate_bps": bps, "variants": rows, "diloco": diloco, "targets": _targets(rate, rows, diloco)}
    return out


def _diloco_rows(rr: dict, rows: dict, one_node: Optional[dict], interleaved: bool = False) -> dict:
    """Per DiLoCo variant at one rate: the mean step over the timed window (whole periods), the median inner step,
    the mean outer step, link bytes per step per node, and the ratios of means against ``sf-hsdp`` and ``ddp`` at
    this rate (and paired: the median over repeats of the ratio of the repeat's means) and against ``one_node``
    (``sf-hsdp``'s row at ``ONE_NODE_RATE``, or None: n/a), paired too when ``interleaved`` (the rates ran repeat by
    repeat)."""
    out = {}
    for v, row in rows.items():
        h = diloco_every(v)
        vr = rr["variants"][v]
        if h is None or "outer_step" not in vr:
            continue
        times = [t for rep in vr["step_s"] for t in rep]
        flags = [f for rep in vr["outer_step"] for f in rep]
        inner = [t for t, f in zip(times, flags) if not f]
        outer = [t for t, f in zip(times, flags) if f]
        d = {"label": row["label"], "every": h, "comm_dtype": VARIANTS[v][3].get("diloco_comm_dtype") or "fp32",
             "timed_steps": row["timed_steps"], "outer_steps_per_repeat": [sum(rep) for rep in vr["outer_step"]],
             "outer_step_indices": [[i for i, f in enumerate(rep) if f] for rep in vr["outer_step"]],
             "mean_step_s": row["mean_step_s"], "median_inner_step_s": _median(inner),
             "mean_outer_step_s": statistics.mean(outer) if outer else None,
             "link_bytes_per_step": row["link_bytes_per_step"]}
        for key, peer in (("sf-hsdp", rows.get("sf-hsdp")), ("ddp", rows.get("ddp")), ("one_node", one_node)):
            d[f"vs_{key}"] = row["mean_step_s"] / peer["mean_step_s"] if peer else None
            # the one-node reference ran at another rate: paired only when the rates were interleaved repeat by
            # repeat (--interleave-rates), so that repeat i of both ran minutes apart at most
            if key != "one_node" or interleaved:
                pairs = ([a / b for a, b in zip(row["mean_per_repeat_s"], peer["mean_per_repeat_s"]) if a and b]
                         if peer else [])
                d[f"vs_{key}_paired"] = _median(pairs)
            else:
                d["vs_one_node_paired"] = None
        out[v] = d
    return out


def _targets(rate: str, rows: dict, diloco: Optional[dict] = None) -> list[dict]:
    """The issue's targets, at 200 Mbit/s only."""
    if rate != TARGETS_RATE:
        return []
    diloco = diloco or {}
    out = []

    def ratio(v, peer):
        return rows[v].get(f"vs_{peer}") if v in rows and peer in rows else None

    for v, peer, lim in (("sf-hsdp", "ddp", 0.7), ("sf-hsdp", "fsdp2-hsdp", 0.85), ("sf-hsdp-int8", "ddp", 0.45)):
        val = ratio(v, peer)
        out.append({"target": f"{v} step <= {lim} x {peer}", "value": val, "met": None if val is None else val <= lim})
    if "sf-hsdp-int8" in rows and "sf-hsdp" in rows:
        val = max(rows["sf-hsdp-int8"]["link_bytes_per_step"]) / max(rows["sf-hsdp"]["link_bytes_per_step"])
    else:
        val = None
    out.append({"target": "sf-hsdp-int8 link bytes <= 0.35 x sf-hsdp", "value": val,
                "met": None if val is None else val <= 0.35})
    for v in DILOCO:  # "DiLoCo step within 1.15 x of the same run on one node"; paired when the rates interleaved
        paired = diloco[v].get("vs_one_node_paired") if v in diloco else None
        val = paired if paired is not None else (diloco[v]["vs_one_node"] if v in diloco else None)
        out.append({"target": f"{v} mean step <= {DILOCO_VS_ONE_NODE} x one node ({ONE_NODE_REF} at "
                              f"{ONE_NODE_RATE}, mean{', paired' if paired is not None else ''})", "value": val,
                    "met": None if val is None else val <= DILOCO_VS_ONE_NODE})
    return out


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def markdown(raw: dict, summary: dict) -> str:
    cfg, env = raw["config"], raw["env"]
    first = next(iter(raw["rates"].values()))
    shape = first["shape"]
    params = first["unit_numel"]["root"] + sum(first["unit_numel"]["blocks"])
    link = first["link"]
    windows = {v: vr["timed_steps"] for rr in raw["rates"].values() for v, vr in rr["variants"].items()
               if diloco_every(v) is not None and "timed_steps" in vr}
    diloco_steps = ("" if not windows else " (DiLoCo: " + ", ".join(f"{v} {n}" for v, n in windows.items())
                    + " timed steps, whole periods of H)")
    lines = [f"# Across an emulated link: {raw['name']}", "",
             f"{NODES} emulated nodes x {NPROC_PER_NODE} ranks (network namespaces joined by a veth pair, a tbf on "
             f"each end: burst/limit {link['tbf'] or 'none'} bytes at the first limited rate, MTU {link['mtu']}; see "
             f"docs/network-emulation.md), gloo, {first['threads']} thread per rank. GPT {shape['n_layer']} layers, d "
             f"{shape['d_model']}, batch {shape['batch']}, seq {shape['seq']} ({params / 1e6:.2f}M parameters, fp32); "
             f"AdamW, clip 1.0. {cfg['repeats']} repeats x ({cfg['warmup']} warm-up + {cfg['steps']} timed steps) "
             f"per variant{diloco_steps}, variants interleaved (rotated each repeat). Step time: the median over "
             f"steps and repeats of the slowest rank's step.", "",
             f"Machine: {env['cpu_count']} CPUs, torch {env['torch']}; load average before {env['load_before']}, "
             f"after {env['load_after']}; wall {env['wall_s']:.0f} s.", ""]
    if env.get("commit"):
        lines += [describe(env), ""]
    if cfg.get("interleave_rates"):
        lines += [f"Rates interleaved: each repeat is one job per rate (rates rotated each repeat), so the ratios "
                  f"against the one-node reference are paired: the median over repeats of the ratio within one "
                  f"repeat.", ""]
    names = [v for v in VARIANTS if any(v in s["variants"] for s in summary.values())]
    lines += ["## Median step time (s)", "", "| link | " + " | ".join(VARIANTS[v][4] for v in names) + " |",
              "|---|" + "---|" * len(names)]
    for rate, s in summary.items():
        lines.append(f"| {rate} | " + " | ".join(_f(s["variants"].get(v, {}).get("median_step_s")) for v in names)
                     + " |")
    lines.append("")
    for rate, s in summary.items():
        lines += [f"## {rate}", "",
                  "| variant | step s (median) | min-max | vs DDP (paired) | vs FSDP2 HSDP (paired) | link MB/step "
                  "node 0, 1 (veth) | accounting MB/step node 0, 1 | veth / accounting | modelled MB/step (gloo) "
                  "| floor s | vs floor | loss first -> last |",
                  "|---|" + "---|" * 11]
        for v, row in s["variants"].items():
            lk = ", ".join(_mb(x) for x in row["link_bytes_per_step"])
            ac = ", ".join(_mb(x) for x in row.get("accounting_cross_bytes_per_step") or []) or "-"
            agree = ", ".join(_f(x, ".4f") for x in row.get("link_vs_accounting") or []) or "-"
            mod = ", ".join(_mb(x) for x in row.get("modelled_cross_bytes_per_step") or []) or "-"
            loss = row["loss_first_last"]
            lines.append(
                f"| {row['label']} | {_f(row['median_step_s'])} | {_f(row['min_step_s'])}-{_f(row['max_step_s'])} | "
                f"{_f(row.get('vs_ddp'), '.2f')} ({_f(row.get('vs_ddp_paired'), '.2f')}) | "
                f"{_f(row.get('vs_fsdp2-hsdp'), '.2f')} ({_f(row.get('vs_fsdp2-hsdp_paired'), '.2f')}) | {lk} | {ac} | "
                f"{agree} | {mod} | {_f(row.get('floor_s'))} | {_f(row.get('vs_floor'), '.2f')} | "
                f"{loss[0]:.4f} -> {loss[1]:.4f} |")
        if s.get("diloco"):
            lines += _diloco_markdown(rate, s["diloco"], ONE_NODE_RATE in summary)
        if s["targets"]:
            lines += ["", "Targets (issue 13, at 200 Mbit/s; the DiLoCo rows: \"DiLoCo step within 1.15 x "
                      f"of the same run on one node\", with {ONE_NODE_REF} at {ONE_NODE_RATE} standing in for one "
                      "node):", "", "| target | value | met |", "|---|---|---|"]
            for t in s["targets"]:
                met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
                lines.append(f"| {t['target']} | {_f(t['value'], '.3f')} | {met} |")
        drops = [q.get("drops", 0) for q in raw["rates"][rate]["qdisc"]]
        lines += ["", f"tbf drops over the whole job (node 0, 1): {drops}.", ""]
    lines += ["Columns: *link MB/step* is the veth `tx_bytes` of each node over the timed steps / steps (10^6 bytes); "
              "*accounting* is shardfusion's `CommCounter` cross-node bytes over the same steps, summed over the "
              "node's ranks (shardfusion variants only); *modelled* is one recorded step's collectives with the "
              "cross-node bytes of the algorithms gloo runs; *floor* is the larger node's link bytes / the rate; "
              "*vs floor* the step time over it. DiLoCo rows: their median is an inner step's; their figure is the "
              "mean, in the DiLoCo table.", ""]
    notes = list(dict.fromkeys(n for n in raw.get("notes", [])))
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _diloco_markdown(rate: str, rows: dict, have_one_node: bool) -> list[str]:
    """The DiLoCo table of one rate (`_diloco_rows`)."""
    ref = "" if have_one_node else f" (n/a here: rate {ONE_NODE_RATE} was not run)"
    lines = ["", f"DiLoCo at {rate}: the mean step over the timed window, whole periods of H steps of which one "
             f"carries the outer all-reduce (the median is an inner step and hides it); ratios are of means. "
             f"\"One node\": {ONE_NODE_REF} at {ONE_NODE_RATE}, the two emulated nodes without a rate limit "
             f"standing in for one node{ref}.", "",
             "| variant | H | pseudo-gradient | timed steps (outer) | step s (mean) | inner step s (median) | "
             "outer step s (mean) | link MB/step node 0, 1 (veth) | vs sf-hsdp (paired) | vs DDP (paired) | "
             "vs one node (paired) |", "|---|" + "---|" * 10]
    for row in rows.values():
        lk = ", ".join(_mb(x) for x in row["link_bytes_per_step"])
        outer = ", ".join(str(n) for n in row["outer_steps_per_repeat"])
        one = "n/a" if row["vs_one_node"] is None else _f(row["vs_one_node"], ".2f")
        if row.get("vs_one_node_paired") is not None:
            one += f" ({_f(row['vs_one_node_paired'], '.2f')})"
        lines.append(
            f"| {row['label']} | {row['every']} | {row['comm_dtype']} | {row['timed_steps']} ({outer}) | "
            f"{_f(row['mean_step_s'])} | {_f(row['median_inner_step_s'])} | {_f(row['mean_outer_step_s'])} | {lk} | "
            f"{_f(row['vs_sf-hsdp'], '.2f')} ({_f(row['vs_sf-hsdp_paired'], '.2f')}) | "
            f"{_f(row['vs_ddp'], '.2f')} ({_f(row['vs_ddp_paired'], '.2f')}) | {one} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.link", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated link rates (tc units, or unlimited)")
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in OPTIONAL),
                   help="comma-separated, from " + ",".join(VARIANTS) + " (" + ",".join(OPTIONAL) + " need the bench "
                        "extra: pip install -e '.[bench]')")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per repeat (DiLoCo variants: "
                   "max(steps, H) rounded up to a multiple of H)")
    p.add_argument("--quick", action="store_true", help="1 repeat, 1 warm-up step, 2 timed steps")
    p.add_argument("--interleave-rates", action="store_true",
                   help="one job per rate and repeat, rates rotated each repeat: ratios across rates (vs one node) "
                        "are then paired")
    p.add_argument("--regime", default="comm", help="a regime of benchmarks/compare.py")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per link rate before the job is killed")
    p.add_argument("--name", default="link-cpu")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 1, 2
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; pick from {','.join(VARIANTS)}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--repeats and --steps must be >= 1 and --warmup >= 0, got {args.repeats}, {args.steps}, "
                f"{args.warmup}")
    from benchmarks.compare import REGIMES
    from benchmarks.netcluster import parse_rate

    if args.regime not in REGIMES:
        p.error(f"--regime: unknown regime {args.regime!r}; pick from {sorted(REGIMES)}")
    for rate in args.rates.split(","):
        try:
            parse_rate(rate)
        except ValueError as e:
            p.error(f"--rates: {e}")
    return args


def _rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def _merge(into: dict, more: dict) -> dict:
    """One rate's raw results with another job's repeats at that rate appended (--interleave-rates)."""
    for v, vr in more["variants"].items():
        mine = into["variants"][v]
        for key in ("step_s", "link_bytes", "accounting", "losses", "outer_step"):
            if key in vr:
                mine.setdefault(key, []).extend(vr[key])
    into["qdisc"] = [{k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}} for a, b in zip(into["qdisc"], more["qdisc"])]
    into["jobs"] = into.get("jobs", 1) + 1
    return into


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1], argv[2])
        return 0
    from benchmarks.netcluster import ClusterError, netns_available

    args = parse_args(argv)
    ok, why = netns_available()
    if not ok:
        print(f"benchmarks.link: cannot emulate the two nodes here: {why}", file=sys.stderr)
        return 2
    variants, notes = args.variants.split(","), []
    if not has_outer_comm_dtype():
        skipped = [v for v in variants if v in COMPRESSED]
        variants = [v for v in variants if v not in COMPRESSED]
        if skipped:
            notes.append(f"skipped {', '.join(skipped)}: shardfusion.fully_shard has no outer_comm_dtype keyword in "
                         f"this checkout")
            print(f"benchmarks.link: {notes[-1]}", flush=True)
    if not has_diloco():
        skipped = [v for v in variants if v in DILOCO]
        variants = [v for v in variants if v not in DILOCO]
        if skipped:
            notes.append(f"skipped {', '.join(skipped)}: shardfusion has no DiLoCo in this checkout")
            print(f"benchmarks.link: {notes[-1]}", flush=True)
    opts = {"variants": variants, "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps,
            "regime": args.regime, "seed": args.seed}
    rates: dict = {}
    jobs = ([(rate, {**opts, "rotate": r, "repeats": 1, "record": r == 0})
             for r in range(args.repeats) for rate in _rotated(args.rates.split(","), r)]
            if args.interleave_rates else [(rate, opts) for rate in args.rates.split(",")])
    with RunRecord() as record:
        for rate, job in jobs:
            print(f"benchmarks.link: link {rate}", flush=True)
            try:
                r = run_rate(rate, job, args.timeout)
            except ClusterError as e:
                print(f"benchmarks.link: the job at {rate} failed:\n{e}", file=sys.stderr)
                return 1
            name = r["link"]["rate"]
            rates[name] = _merge(rates[name], r) if name in rates else r
    env = {**record.as_dict(), "command": "python -m benchmarks.link " + " ".join(argv)}
    raw = {"name": args.name, "config": {**opts, "rates": list(rates), "nodes": NODES,
                                         "nproc_per_node": NPROC_PER_NODE, "interleave_rates": args.interleave_rates},
           "env": env, "rates": rates, "notes": notes}
    summary = summarize(raw)
    text = markdown(raw, summary)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{args.name}.json", out / f"{args.name}.md"
    js.write_text(json.dumps({**raw, "summary": summary}, indent=1))
    md.write_text(text)
    print(text)
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
