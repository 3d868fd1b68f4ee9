"""Muon on a sharded model, three ways side by side: each block matrix whole on one owner rank (``whole_params``),
every block matrix whole on every rank (``replicate_filter``: every rank runs Newton-Schulz on every matrix), and
AdamW element-sharded (no filter); step time, memory and gathered bytes per rank, owner balance, against theory.

    python -m benchmarks.whole_params --nproc 4 --models dense,moe [--n-layer 4 --d-model 256 --seq 128 --batch 2]

The same GPT (seed 0; q, k, v separate) and the same batches in every variant, on CPU with gloo. Muon (torch's,
bf16 Newton-Schulz) updates the 2-D weights of the blocks (``blocks.*``: attention, MLP, router, experts), AdamW the
rest (embeddings, norms, biases), as the public Muon recipes do; clipping by global norm every step. Variants:

- ``whole``: ``fully_shard(..., whole_params=is_block_matrix)``: each matrix lies whole on one owner rank of its
  shard group; Muon on every rank's fragments (the matrix on its owner, ``(0, n)`` elsewhere), AdamW on the rest.
- ``replicated``: ``fully_shard(..., replicate_filter=is_block_matrix)``: each matrix whole on every rank, its
  gradient all-reduced; every rank runs Muon on every matrix.
- ``adamw``: ``fully_shard(...)`` with no filter; AdamW on every (element-sharded) fragment.

Per rank, the medians over ``--steps`` steps after ``--warmup`` ones (a barrier before each step, not timed):
``fwd+bwd`` (forward, backward and ``sf.finish_grad_sync``: the gradients are reduced), ``muon`` and ``adamw`` (the
two optimizers' ``step()``), ``opt`` (both), ``total`` (the whole step: fwd+bwd, clipping, both steps, zero_grad).
Memory per rank: the bytes of the distinct storages behind the parameters (fragments: their shards, padding
included), the gradients and the optimizer states, after a step with the gradients still there; and the process's
peak RSS (``ru_maxrss``), meaningful when each variant runs in processes of its own (``--launch per-variant``, the
default). Bytes per step by category from ``sf.comm.CommCounter`` over one more step. Writes
``benchmarks/results/whole-params.md`` (and ``.json`` beside it), one section per model (``--append``: after the
runs already there). docs/whole-params-benchmark.md explains the columns and the theory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

from benchmarks.spawn import join, run_workers

RESULTS = Path(__file__).resolve().parent / "results" / "whole-params.md"
VARIANTS = ("whole", "replicated", "adamw")
LABELS = {"whole": "(a) Muon, whole_params (one owner)", "replicated": "(b) Muon, replicate_filter (every rank)",
          "adamw": "(c) AdamW, element-sharded"}
MUON_LR, ADAMW_LR, WEIGHT_DECAY, MAX_NORM = 0.02, 1e-3, 0.1, 1.0
TIMES = ("fwd_bwd", "muon", "adamw", "opt", "total")


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    """The parameters Muon updates: the 2-D weights of the blocks (attention, MLP, router, experts)."""
    return name.startswith("blocks.") and p.dim() == 2


def _config(opts: dict, model: str):
    from shardfusion.models import GPTConfig
    experts = opts["experts"] if model == "moe" else 0
    return GPTConfig(n_layer=opts["n_layer"], n_head=opts["n_head"], d_model=opts["d_model"], seq_len=opts["seq"],
                     fused_qkv=False, n_experts=experts, top_k=1, tie_embeddings=True)


def _storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (data pointers; a storage counts once)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def _memory(model, muon, adamw) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer states (distinct storages)."""
    seen: set = set()
    params = list(model.parameters())  # (b)'s 2-D views share these storages
    out = {"params": _storage_bytes(params, seen), "grads": _storage_bytes([p.grad for p in params], seen)}
    for key, opt in (("muon_state", muon), ("adamw_state", adamw)):
        out[key] = _storage_bytes([v for st in opt.state.values() for v in st.values()], seen) if opt else 0
    out["total"] = sum(out.values())
    return out


def _gather_prediction(model) -> dict:
    """Bytes the all-gathers of one step should move by the layout: each sharded buffer's padded elements x its
    element size, the first (root) unit gathered once (it is not resharded after forward), every other unit twice
    (forward, and again for backward); and the elements of the owner-layout buffers."""
    from shardfusion._runtime.state import sharded_state

    total = 0
    for i, unit in enumerate(sharded_state(model).units):
        for buffer in unit.groups:
            if buffer.layout.shard_count > 1:
                total += (1 if i == 0 else 2) * buffer.layout.padded_numel * buffer.shard.element_size()
    return {"all_gather_bytes": total}


def _measure(opts: dict, model_kind: str, variant: str) -> dict:
    import torch.distributed as dist

    import shardfusion as sf
    from shardfusion.models import GPT, Block

    ep = opts["ep"] if model_kind == "moe" else 1
    topo = sf.Topology(sharding=dist.get_world_size(), ep=ep)
    config = _config(opts, model_kind)
    torch.manual_seed(0)
    model = GPT(config, ep_group=topo.get_group("ep") if config.n_experts else None)
    model = sf.fully_shard(model, topo, units=(Block,),
                           whole_params=is_block_matrix if variant == "whole" else None,
                           replicate_filter=is_block_matrix if variant == "replicated" else None)
    named = list(model.named_parameters())
    shapes = _full_shapes(model)
    views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (b): (2-D view for Muon, the kept-whole fragment)
    if variant == "adamw":
        muon, adamw = None, torch.optim.AdamW([p for _, p in named], lr=ADAMW_LR, weight_decay=WEIGHT_DECAY)
    else:
        chosen = {n for n, p in named if is_block_matrix(n, torch.empty(shapes.get(n, p.shape), device="meta"))}
        if variant == "whole":
            matrices = [p for n, p in named if n in chosen]
        else:  # replicate_filter keeps the matrix whole, but Muon refuses fragments outside whole_params: it gets a
            # parameter view of the fragment's storage
            views = [(torch.nn.Parameter(p.detach().view(shapes[n])), p) for n, p in named if n in chosen]
            matrices = [v for v, _ in views]
        muon = torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=WEIGHT_DECAY, adjust_lr_fn="original")
        adamw = torch.optim.AdamW([p for n, p in named if n not in chosen], lr=ADAMW_LR, weight_decay=WEIGHT_DECAY)
    rank = dist.get_rank()

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * step + topo.data_parallel_rank)
        data = torch.randint(0, 256, (opts["batch"], opts["seq"] + 1), generator=g)  # (B, T + 1) int64
        return data[:, :-1], data[:, 1:]

    times = {k: [] for k in TIMES}
    losses, memory = [], None

    def step(i: int, record: bool):
        nonlocal memory
        x, y = batch(i)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)[1]
        loss.backward()
        sf.finish_grad_sync(model)
        t1 = time.perf_counter()
        sf.clip_grad_norm_(model, MAX_NORM)
        t2 = time.perf_counter()
        if muon is not None:
            for view, frag in views:  # (b): the gradient as the view's (same storage, no copy)
                view.grad = frag.grad.view(view.shape)
            muon.step()
        t3 = time.perf_counter()
        adamw.step()
        t4 = time.perf_counter()
        if memory is None:
            memory = _memory(model, muon, adamw)  # gradients and states both there
        for opt in (muon, adamw):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        for _, frag in views:
            frag.grad = None
        t5 = time.perf_counter()
        losses.append(float(loss.detach()))
        if record:
            for k, v in zip(TIMES, (t1 - t0, t3 - t2, t4 - t3, t4 - t2, t5 - t0)):
                times[k].append(v)

    for i in range(opts["warmup"]):
        step(i, False)
    for i in range(opts["warmup"], opts["warmup"] + opts["steps"]):
        step(i, True)
    with sf.comm.CommCounter() as counter:
        step(opts["warmup"] + opts["steps"], False)
    out = {"rank": rank, "median_s": {k: statistics.median(v) for k, v in times.items()},
           "times_s": times, "losses": losses, "memory": memory, "comm": counter.summary(),
           "prediction": _gather_prediction(model),
           "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # ru_maxrss: KiB on Linux
           "layout": topo.describe()}
    if variant == "whole":
        out["balance"] = sf.owner_balance(model)
        out["kinds"] = _numel_by_kind(model)
    if variant != "adamw":  # the Muon matrices this rank holds whole (elements, Newton-Schulz cost), and all of them
        from shardfusion._runtime.layout import newton_schulz_cost
        held = [p for p in muon.param_groups[0]["params"] if p.numel()]
        out["muon_numel"] = sum(p.numel() for p in held)
        out["muon_cost"] = sum(newton_schulz_cost(tuple(p.shape)) for p in held)
        out["matrix_numel"] = sum(_numel(shapes.get(n, p.shape)) for n, p in named if n in chosen)
    full = sf.full_state_dict(model, buffers=False)  # collective: every rank
    if rank == 0:
        out["params_total"] = sum(_numel(s) for s in shapes.values())
        out["final_params"] = full  # for the (a) against (b) agreement; left out of the .json
    return out


def _numel_by_kind(model) -> dict:
    """Per kind of shard group (``dense``, ``expert``): the elements of the whole (owner-layout) matrices and of the
    rest this rank's model holds, and the group's size."""
    from shardfusion._runtime.state import named_fragments

    out: dict = {}
    for f in named_fragments(model):
        kind = "expert" if f.buffer.is_expert else "dense"
        acc = out.setdefault(kind, {"matrix": 0, "rest": 0, "group_size": f.buffer.layout.shard_count})
        acc["matrix" if f.buffer.owner_layout else "rest"] += _numel(f.shape)
    return out


def _full_shapes(model) -> dict:
    from shardfusion._runtime.state import named_fragments
    return {f.name: f.shape for f in named_fragments(model)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _worker(opts: dict, jobs: list[tuple[str, str]]) -> dict:
    join("cpu")
    torch.set_num_threads(1)
    return {f"{m}/{v}": _measure(opts, m, v) for m, v in jobs}


def _run(opts: dict) -> dict | None:
    """``{"model/variant": [per-rank result]}``; each variant in fresh processes with ``--launch per-variant``."""
    jobs = [(m, v) for m in opts["models"] for v in VARIANTS]
    batches = [[j] for j in jobs] if opts["launch"] == "per-variant" else [jobs]
    results: dict = {}
    for batch in batches:
        got = run_workers(_worker, (opts, batch), opts["nproc"])
        if got is None:
            return None
        for key in got[0]:
            results[key] = [got[r][key] for r in sorted(got)]
    return results


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def _mib(b: float) -> str:
    return f"{b / 2 ** 20:.2f}"


def _slowest(rows: list[dict], key: str) -> float:
    """The largest per-rank median of ``key``: the step waits for the slowest rank."""
    return max(r["median_s"][key] for r in rows)


def _section(opts: dict, model_kind: str, results: dict) -> tuple[str, dict]:
    rows = {v: results[f"{model_kind}/{v}"] for v in VARIANTS}
    a, b, c = rows["whole"], rows["replicated"], rows["adamw"]
    cfg = _config(opts, model_kind)
    lines = [f"## {model_kind}: n_layer {cfg.n_layer}, d_model {cfg.d_model}, n_head {cfg.n_head}, seq {cfg.seq_len}"
             f", batch {opts['batch']} per rank" + (f", {cfg.n_experts} experts (top 1), ep {opts['ep']}"
                                                    if cfg.n_experts else "") + "\n",
             f"{a[0]['layout']}; {a[0]['params_total']:,} parameters, of which {a[0]['matrix_numel']:,} in the block "
             f"matrices (Muon). Medians over {opts['steps']} steps after {opts['warmup']} warm-up steps; times in ms, "
             "bytes in MiB.\n",
             "| variant | rank | fwd+bwd | muon step | adamw step | opt step | total | params | grads | opt state "
             "| params+grads+state | max RSS |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        for r in rows[v]:
            m, t = r["memory"], r["median_s"]
            lines.append(f"| {LABELS[v]} | {r['rank']} | {_ms(t['fwd_bwd'])} | {_ms(t['muon'])} | {_ms(t['adamw'])} "
                         f"| {_ms(t['opt'])} | {_ms(t['total'])} | {_mib(m['params'])} | {_mib(m['grads'])} "
                         f"| {_mib(m['muon_state'] + m['adamw_state'])} | {_mib(m['total'])} "
                         f"| {_mib(r['maxrss_bytes']) if opts['launch'] == 'per-variant' else 'n/a'} |")
    lines += ["", "Bytes per step (rank 0, `sf.comm.CommCounter`; payload bytes, and what a ring sends per rank):\n",
              "| variant | all-gather count | all-gather bytes | reduce-scatter bytes | all-reduce bytes | wire bytes "
              "per rank (all) |", "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        s = rows[v][0]["comm"]
        wire = sum(x["wire_bytes"] for x in s.values())
        lines.append(f"| {LABELS[v]} | {s['inner_all_gather']['count']:.0f} | {s['inner_all_gather']['bytes']:,.0f} "
                     f"| {s['inner_reduce_scatter']['bytes']:,.0f} | {s['replicate_all_reduce']['bytes']:,.0f} "
                     f"| {wire:,.0f} |")
    lines += ["", "Owner balance of (a) (`sf.owner_balance`; cost = Newton-Schulz multiply-adds per iteration, "
              "max(m, n) x min(m, n)^2):\n",
              "| shard group | cost per shard | elements per shard | cost_imbalance | numel_imbalance | padding "
              "(elements) | padding_fraction |", "|---|---|---|---|---|---|---|"]
    balance = a[0]["balance"]
    for kind, rep in balance.items():
        lines.append(f"| {kind} | {', '.join(f'{x:,}' for x in rep['cost'])} | "
                     f"{', '.join(f'{x:,}' for x in rep['numel'])} | {rep['cost_imbalance']:.3f} | "
                     f"{rep['numel_imbalance']:.3f} | {rep['padding']:,} | {rep['padding_fraction']:.4f} |")

    # Theory. Newton-Schulz work: (a)'s slowest rank runs it on the matrices it owns, every rank of (b) on all the
    # matrices it holds (with ep > 1 its ep rank's experts): the cost of the matrices each rank's Muon holds.
    ns_share = max(r["muon_cost"] for r in a) / max(r["muon_cost"] for r in b)
    muon_state = {v: max(r["memory"]["muon_state"] for r in rows[v]) for v in ("whole", "replicated")}
    owned_max = max(r["muon_numel"] for r in a)
    matrix_numel = a[0]["matrix_numel"]
    mem = {v: max(r["memory"]["total"] for r in rows[v]) for v in VARIANTS}
    # params + grads: 4 bytes each of the rank's shards (padding included); Muon: 4 bytes (momentum) per owned
    # element; AdamW: 8 bytes (exp_avg, exp_avg_sq) per element of the rest's shards.
    # Per kind of shard group (dense; experts on their expert inner group of G_k ranks).
    kinds = a[0]["kinds"]
    theory_a = 4 * owned_max + sum((8 * (k["matrix"] + balance.get(kind, {}).get("padding", 0)) + 16 * k["rest"])
                                   / k["group_size"] for kind, k in kinds.items())
    theory_b = sum(12 * k["matrix"] + 16 * k["rest"] / k["group_size"] for k in kinds.values())
    gathered = {v: rows[v][0]["comm"]["inner_all_gather"]["bytes"] for v in VARIANTS}
    predicted = {v: rows[v][0]["prediction"]["all_gather_bytes"] for v in VARIANTS}
    pf = max(rep["padding_fraction"] for rep in balance.values())
    ratios = {
        "muon_step_a_over_b": (_slowest(a, "muon") / _slowest(b, "muon"), ns_share),
        "opt_step_a_over_b": (_slowest(a, "opt") / _slowest(b, "opt"), None),
        "muon_state_a_over_b": (muon_state["whole"] / muon_state["replicated"], owned_max / matrix_numel),
        "memory_a_over_b": (mem["whole"] / mem["replicated"], theory_a / theory_b),
        "fwd_bwd_a_over_c": (_slowest(a, "fwd_bwd") / _slowest(c, "fwd_bwd"), 1.0),
        "total_a_over_c": (_slowest(a, "total") / _slowest(c, "total"), None),
        "total_a_over_b": (_slowest(a, "total") / _slowest(b, "total"), None),
        "gathered_a_over_c": (gathered["whole"] / gathered["adamw"], predicted["whole"] / predicted["adamw"]),
    }
    lines += ["", "Ratios (times: the slowest rank's median; memory: the largest rank):\n",
              "| ratio | measured | theory | theory from |", "|---|---|---|---|",
              _ratio("(a)/(b) Muon step time", ratios["muon_step_a_over_b"],
                     "the slowest owner's share of the Newton-Schulz cost, max(cost) / sum(cost) (1/W when balanced)"),
              _ratio("(a)/(b) optimizer step time (Muon + AdamW)", ratios["opt_step_a_over_b"],
                     "between the Muon ratio and 1: AdamW on the rest is the same in both"),
              _ratio("(a)/(b) Muon state bytes", ratios["muon_state_a_over_b"],
                     "the largest owner's matrix elements / all matrix elements (1/W when balanced)"),
              _ratio("(a)/(b) params+grads+state bytes", ratios["memory_a_over_b"],
                     "(a) sum over kinds of (8 (M + pad) + 16 R) / G, + 4 M_r, against (b) sum of 12 M + 16 R / G "
                     "(per kind of shard group, dense or expert, of G ranks: M its matrix elements, R the rest, pad "
                     "the owner layouts' padding; M_r the largest owner's matrix elements; fp32, alignment of the "
                     "element-sharded buffers ignored)"),
              _ratio("(a)/(c) fwd+bwd time", ratios["fwd_bwd_a_over_c"],
                     f"the same compute; (a) gathers 1 + padding more bytes (padding_fraction {pf:.4f})"),
              _ratio("(a)/(c) step time", ratios["total_a_over_c"], "Muon's Newton-Schulz against AdamW's update"),
              _ratio("(a)/(b) step time", ratios["total_a_over_b"], ""),
              _ratio("(a)/(c) all-gather bytes", ratios["gathered_a_over_c"],
                     f"the layouts' padded elements (root unit gathered once, blocks twice); the owner buffers alone "
                     f"1 / (1 - padding_fraction) = {1 / (1 - pf):.4f}")]
    checks = {v: gathered[v] == predicted[v] for v in VARIANTS}
    lines.append("")
    lines.append("Layout prediction of the all-gather bytes " + (
        "matches the measured bytes in every variant." if all(checks.values())
        else f"differs from the measured bytes: {checks}, predicted {predicted}, measured {gathered}."))
    agree = _agreement(a[0]["final_params"], b[0]["final_params"])
    lines.append(f"(a) and (b) do the same arithmetic (one Muon step per matrix, on its owner or on every rank): after "
                 f"the {opts['warmup'] + opts['steps'] + 1} steps their parameters differ by at most "
                 f"{agree['matrices']:.1e} on the matrices (at `{agree['matrices_at']}`) and {agree['rest']:.1e} on "
                 f"the rest (at `{agree['rest_at']}`): fp32 rounding of the gradient reduction order, through Muon's "
                 "bf16 Newton-Schulz" + (", and with experts, tokens whose top-1 expert flips with it." if cfg.n_experts
                                         else "."))
    first = {v: rows[v][0]["losses"][0] for v in VARIANTS}
    last = {v: rows[v][0]["losses"][-1] for v in VARIANTS}
    lines.append(f"First loss (rank 0): {', '.join(f'{v} {first[v]:.4f}' for v in VARIANTS)} (same model, same "
                 f"data); last: {', '.join(f'{v} {last[v]:.4f}' for v in VARIANTS)}.")
    summary = {"ratios": {k: {"measured": m, "theory": t} for k, (m, t) in ratios.items()},
               "gather_prediction_matches": checks, "balance": balance, "params_max_diff_a_b": agree}
    return "\n".join(lines) + "\n", summary


def _agreement(x: dict, y: dict) -> dict:
    """The largest absolute difference between two full state dicts, on the block matrices and on the rest."""
    out = {"matrices": 0.0, "rest": 0.0, "matrices_at": "", "rest_at": ""}
    for name, t in x.items():
        key = "matrices" if is_block_matrix(name, t) else "rest"
        diff = float((t - y[name]).abs().max()) if t.numel() else 0.0
        if diff >= out[key]:
            out[key], out[f"{key}_at"] = diff, name
    return out


def _ratio(what: str, pair: tuple, source: str) -> str:
    measured, theory = pair
    return f"| {what} | {measured:.3f} | {'' if theory is None else f'{theory:.3f}'} | {source} |"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--experts", type=int, default=4, help="experts per block of the moe model")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree of the moe model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--launch", choices=("per-variant", "once"), default="per-variant",
                        help="fresh processes per variant (max RSS per variant) or one launch for all")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the markdown report (a .json beside it)")
    parser.add_argument("--append", action="store_true",
                        help="append this run (command, machine, sections) to the report instead of replacing it")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    opts = vars(parser.parse_args(argv))
    opts["models"] = [m for m in opts["models"].split(",") if m]
    for m in opts["models"]:
        if m not in ("dense", "moe"):
            parser.error(f"--models: unknown model {m!r} (dense, moe)")
    if opts["steps"] < 1 or opts["warmup"] < 0:
        parser.error(f"--steps({opts['steps']}) must be >= 1 and --warmup({opts['warmup']}) >= 0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = _load()
    t0 = time.time()
    results = _run(opts)
    if results is None:
        return 1
    cmd = ["python -m benchmarks.whole_params", f"--nproc {opts['nproc']}", f"--models {','.join(opts['models'])}",
           f"--n-layer {opts['n_layer']}", f"--d-model {opts['d_model']}", f"--n-head {opts['n_head']}",
           f"--seq {opts['seq']}", f"--batch {opts['batch']}", f"--experts {opts['experts']}", f"--ep {opts['ep']}",
           f"--warmup {opts['warmup']}", f"--steps {opts['steps']}", f"--launch {opts['launch']}"]
    title = "# Muon with whole parameters: one owner rank against every rank, and AdamW element-sharded\n"
    head = [f"`{' '.join(cmd)}`\n",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores shared by "
            f"{opts['nproc']} gloo ranks (OMP_NUM_THREADS=1 each), torch {torch.__version__}; load average "
            f"(1, 5, 15 min) {load_before} before, {_load()} after; {time.time() - t0:.0f} s. With more ranks than "
            "cores the absolute times are noisy and inflated; the ratios and the theory are what to read.\n"]
    sections, summary = [], {}
    for m in opts["models"]:
        text, summary[m] = _section(opts, m, results)
        sections.append(text)
    text = "\n".join(head) + "\n" + "\n".join(sections)
    print(text)
    if not opts["no_write"]:
        out = opts["out"]
        out.parent.mkdir(parents=True, exist_ok=True)
        old = out.read_text() if opts["append"] and out.exists() else ""
        out.write_text((old + "\n---\n\n" if old.startswith(title) else title + "\n") + text)
        run = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.items()}, "summary": summary,
               "results": {k: [{f: v for f, v in r.items() if f != "final_params"} for r in rows]
                           for k, rows in results.items()}}
        js = out.with_suffix(".json")
        runs = json.loads(js.read_text())["runs"] if opts["append"] and js.exists() and old.startswith(title) else []
        data = {"benchmark": "whole_params", "runs": runs + [run], **run}  # the latest run also at the top level
        js.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
