"""Turn the raw measurements of `benchmarks/compare.py` into a summary (medians, ratios, theory, targets) and a
markdown report, and those of `benchmarks/memory.py` (`memory_summary`, `memory_markdown`) and `benchmarks/pipeline.py`
(`pipeline_summary`, `pipeline_markdown`) likewise, at the end.
Pure functions of the raw JSON, so a report can be rebuilt from a saved run:

    python -m benchmarks.report benchmarks/results/cpu-fp32.json     # rewrites cpu-fp32.md

Theory, per rank and per step, with P_u the unpadded parameter elements of unit u (blocks and the root), P their sum,
I the inner (shard) group size, O the outer (replicate) group size, W = I * O, b_p / b_g the bytes per element of the
gathered parameters / of the reduced gradients:
* all-gather (inner): every block twice (forward, and again for backward after resharding), the root once (it stays
  gathered from forward to backward), each at the ring volume (I-1)/I * P_u * b_p: 2 * n_blocks + 1 collectives;
* reduce-scatter (inner): each unit once, (I-1)/I * P_u * b_g: n_blocks + 1 collectives;
* all-reduce (outer): each unit's gradient shard once, 2(O-1)/O * P_u/I * b_g: n_blocks + 1 collectives;
* DDP: the full gradient all-reduced over the world, 2(W-1)/W * P * b_g (in as many collectives as it has buckets).
DeepSpeed ZeRO-3 (optional variants; see `deepspeed_theory`) gathers module by module, so its counts are not
predicted, only its bytes; T is the tied embedding's elements (the GPT's one parameter used by two modules, the
embedding and the lm head, hence gathered for each use):
* `deepspeed` (partitioned over W): all-gather (world) 2(W-1)/W * (P + T) * b_p under after_forward (every module's
  parameters gathered for its forward and again for its backward), (W-1)/W * P * b_p under after_backward;
  reduce-scatter (world) (W-1)/W * P * b_g;
* `ds-hpz` (hpZ, secondary partition over the inner group): the first forward use of each parameter gathered over
  the world, (W-1)/W * P * b_p; every later use (the tied head's forward, all of backward) from the secondary
  partition over the inner group, (I-1)/I * (P + 2T) * b_p; reduce-scatter (world) as `deepspeed`;
* `ds-mics` (MiCS, partitioned over the inner group, replicated over the outer): all-gather (inner)
  2(I-1)/I * (P + T) * b_p, reduce-scatter (inner) (I-1)/I * P * b_g, all-reduce (outer) of the gradient partition
  at every step 2(O-1)/O * P/I * b_g: HSDP's volumes, the tied weight's extra gathers aside.
Collectives of fewer than SMALL_NUMEL elements (gradient-norm scalars) are counted apart and left out of the ratios.
Persistent memory per rank: (4 parameter + 4 gradient + 8 AdamW) bytes * P / I for the sharded variants (* P for DDP,
* P / W for `deepspeed` and `ds-hpz`).
Transient full buffers of a sharded variant: the root's plus (1 + prefetch depth) blocks' at a time (with blocks
resharded after backward instead, all blocks' parameters may be gathered at once: the bound is the whole model; the
gradient bound stays (1 + depth) blocks; shardfusion's gradient buffers stay within the root's and one block's,
docs/benchmarks.md). The transient memory (peak live - persistent) and the parts of the peak: benchmarks/transient.py.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from benchmarks import transient
from benchmarks.provenance import describe

SMALL_NUMEL = 1024
"""Collectives below this many elements (norm scalars) are reported apart from the bulk traffic."""

PERSISTENT_BYTES_PER_PARAM = 16
"""fp32 parameter + fp32 gradient + AdamW's two fp32 moments."""

TARGETS = {
    # regime: (max step time / FSDP2, max step time / DDP)
    "comm": (0.6, 1.25),
    "compute": (0.9, 1.25),
}
BYTES_TARGET = 1.01

GLOO_REDUCE_SCATTER_FACTOR = 2
"""torch's gloo backend runs a reduce-scatter as a clone of the input, a full all-reduce and a copy of the local
chunk (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``): twice the ring reduce-scatter's bytes."""
PERSISTENT_TARGET = 1.05

_CATEGORIES = (("all_gather", "inner"), ("reduce_scatter", "inner"), ("all_reduce", "outer"), ("all_reduce", "world"))


DEEPSPEED_VARIANTS = ("deepspeed", "ds-mics", "ds-hpz")


def deepspeed_theory(variant: str, P: int, T: int, inner: int, outer: int, b_p: int, b_g: int,
                     after_forward: bool = True) -> dict:
    """Per-rank ring bytes per step of DeepSpeed ZeRO-3 variant ``variant`` (see the module doc), as
    {"op/group": {"count": None, "wire_bytes"}}: ``P`` parameter elements (a tied weight once), ``T`` the tied
    weight's elements (0 if none), ``inner`` x ``outer`` ranks, ``b_p`` / ``b_g`` bytes per gathered parameter /
    reduced gradient element; ``after_forward``: parameters released after each module's forward (else kept
    gathered until backward: every parameter gathered once)."""
    W = inner * outer

    def ring(g: int) -> float:
        return (g - 1) / g

    out: dict = {}
    if variant == "ds-mics":
        gathered = 2 * (P + T) if after_forward else P
        if inner > 1:
            out["all_gather/inner"] = {"count": None, "wire_bytes": ring(inner) * gathered * b_p}
            out["reduce_scatter/inner"] = {"count": None, "wire_bytes": ring(inner) * P * b_g}
        if outer > 1:
            out["all_reduce/outer"] = {"count": None, "wire_bytes": 2 * ring(outer) * P / inner * b_g}
        return out
    if W > 1:
        out["reduce_scatter/world"] = {"count": None, "wire_bytes": ring(W) * P * b_g}
        if variant == "ds-hpz" and after_forward and inner > 1:
            out["all_gather/world"] = {"count": None, "wire_bytes": ring(W) * P * b_p}
            out["all_gather/inner"] = {"count": None, "wire_bytes": ring(inner) * (P + 2 * T) * b_p}
        else:
            out["all_gather/world"] = {"count": None,
                                       "wire_bytes": ring(W) * (2 * (P + T) if after_forward else P) * b_p}
    return out


def persistent_shards(variant: str, inner: int, outer: int) -> int:
    """Over how many ranks a variant partitions parameters, gradients and optimizer state: 1 for DDP, W for flat
    ZeRO-3 (``deepspeed``, ``ds-hpz``: its secondary copy is freed at every optimizer step), I otherwise."""
    if variant == "ddp":
        return 1
    if variant in ("deepspeed", "ds-hpz"):
        return inner * outer
    return inner


def theory(variant: str, root: int, blocks: list[int], inner: int, outer: int, b_p: int, b_g: int,
           gathers_per_block: int = 2, tied: int = 0) -> dict:
    """Theoretical collectives per step (see the module doc): {"op/group": {"count", "wire_bytes"}}.
    ``gathers_per_block``: 2 when blocks reshard after forward, 1 when they stay gathered until backward. ``tied``:
    elements of the tied embedding (DeepSpeed variants only)."""
    P = root + sum(blocks)
    W = inner * outer
    if variant in DEEPSPEED_VARIANTS:
        return deepspeed_theory(variant, P, tied, inner, outer, b_p, b_g, gathers_per_block == 2)
    if variant == "ddp":  # over the world, which group_label names "inner" when the inner group is the world
        key = "all_reduce/inner" if outer == 1 and inner > 1 else "all_reduce/world"
        return {key: {"count": None, "wire_bytes": 2 * (W - 1) / W * P * b_g if W > 1 else 0.0}}
    out = {}
    n_units = len(blocks) + 1
    if inner > 1:
        out["all_gather/inner"] = {"count": gathers_per_block * len(blocks) + 1,
                                   "wire_bytes": (inner - 1) / inner * (gathers_per_block * sum(blocks) + root) * b_p}
        out["reduce_scatter/inner"] = {"count": n_units, "wire_bytes": (inner - 1) / inner * P * b_g}
    if outer > 1:
        out["all_reduce/outer"] = {"count": n_units, "wire_bytes": 2 * (outer - 1) / outer * P / inner * b_g}
    return out


def group_label(ranks: tuple, groups: dict[str, tuple]) -> str:
    """The name of the group with a collective's ranks: "inner", "outer", any other name in ``groups`` (e.g. "pp"),
    "world", in that order when groups coincide; "other" when none has them."""
    names = ["inner", "outer", *[k for k in groups if k not in ("inner", "outer", "world")], "world"]
    for name in names:
        if name in groups and tuple(ranks) == tuple(groups[name]):
            return name
    return "other"


def collective_table(collectives: list[dict], groups: dict[str, tuple], small_kinds=None) -> dict:
    """{"op/group" (+ "/small" below SMALL_NUMEL): {"count", "wire_bytes", "bytes"}} from Collective dicts.
    ``small_kinds``: the ops whose small collectives are set apart (default: all); DeepSpeed gathers and
    reduce-scatters module by module, so its LayerNorm gathers are small but part of the parameter traffic."""
    from benchmarks.measure import wire_bytes

    table: dict[str, dict] = {}
    for c in collectives:
        key = f"{c['kind']}/{group_label(tuple(c['ranks']), groups)}"
        if c["numel"] < SMALL_NUMEL and (small_kinds is None or c["kind"] in small_kinds):
            key += "/small"
        row = table.setdefault(key, {"count": 0, "wire_bytes": 0.0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += c["numel"] * c["elem_size"]
        row["wire_bytes"] += wire_bytes(c["kind"], c["numel"] * c["elem_size"], len(c["ranks"]))
    return table


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(raw: dict) -> dict:
    """Per regime and variant: timing, collectives against theory, memory against theory, targets (shardfusion)."""
    cfg = raw["config"]
    inner, outer = cfg["inner"], cfg["outer"]
    b_p = 2 if cfg["param_dtype"] == "bf16" else 4
    b_g = 4
    out = {}
    for regime, r in raw["regimes"].items():
        root, blocks = r["unit_numel"]["root"], r["unit_numel"]["blocks"]
        P = root + sum(blocks)
        tokens = r["shape"]["batch"] * r["shape"]["seq"] * cfg["world_size"]
        rows = {}
        for v, vr in r["variants"].items():
            if vr.get("skipped"):
                rows[v] = {"skipped": vr["skipped"]}
                continue
            steps = [t for rep in vr["step_s"] for t in rep]
            med = _median(steps)
            row = {"median_step_s": med, "min_step_s": min(steps), "max_step_s": max(steps), "n_steps": len(steps),
                   "median_per_repeat_s": [_median(rep) for rep in vr["step_s"]],
                   "tokens_per_s": tokens / med if med else None, "loss_first_last": vr.get("loss_first_last")}
            table = collective_table(vr["collectives"], raw["groups"],
                                     ("all_reduce",) if v in DEEPSPEED_VARIANTS else None)
            th = theory(v, root, blocks, inner, outer, b_p, b_g,
                        2 if cfg.get("reshard", "after_forward") == "after_forward" else 1,
                        r["unit_numel"].get("tied", 0))
            for key, t in th.items():
                got = table.get(key, {"count": 0, "wire_bytes": 0.0, "bytes": 0})
                got["theory_count"] = t["count"]
                got["theory_wire_bytes"] = t["wire_bytes"]
                got["ratio"] = got["wire_bytes"] / t["wire_bytes"] if t["wire_bytes"] else None
                table[key] = got
            row["collectives"] = table
            row["wire_bytes_total"] = sum(c["wire_bytes"] for c in table.values())
            row["backend_wire_bytes_total"] = sum(
                c["wire_bytes"] * (GLOO_REDUCE_SCATTER_FACTOR if k.startswith("reduce_scatter") and v != "shardfusion"
                                   and cfg["backend"] == "gloo" else 1) for k, c in table.items())
            mem = vr["memory"]
            ideal = PERSISTENT_BYTES_PER_PARAM * P / persistent_shards(v, inner, outer)
            row["persistent_bytes"] = mem["persistent"]
            row["persistent_theory_bytes"] = ideal
            row["persistent_ratio"] = mem["persistent"]["total"] / ideal
            row["transient"] = mem.get("transient", {})
            grad_bound = None
            if v != "ddp":
                depth = cfg.get("prefetch_depth", 1)
                window = min(len(blocks), 1 + depth)
                grad_bound = b_p * (root + window * max(blocks))
                if cfg.get("reshard", "after_forward") == "after_forward":
                    row["transient_blocks_bound"], param_bound = window, grad_bound
                else:
                    row["transient_blocks_bound"], param_bound = len(blocks), b_p * (root + sum(blocks))
                row["transient_bound_bytes"] = param_bound
                for key, peak_key, bound in (("transient_ratio", "full_param_bytes", param_bound),
                                             ("transient_grad_ratio", "full_grad_bytes", grad_bound)):
                    peak = row["transient"].get(peak_key)
                    row[key] = peak / bound if peak is not None else None
            if "cuda" in mem:
                row["cuda"] = mem["cuda"]
            row["peak_live_bytes"] = mem.get("live", {}).get("peak_bytes")
            if "parts" in mem.get("live", {}):
                row["transient_memory"] = transient.summarize(mem["live"], mem["persistent"]["total"],
                                                              None if v == "ddp" else grad_bound)
            rows[v] = row
        _ratios(rows)
        transient.add_ratios(rows)
        out[regime] = {"shape": r["shape"], "params": P, "unit_numel": r["unit_numel"], "tokens_per_step": tokens,
                       "loss_max_abs_diff": _loss_spread(r["variants"]),
                       "variants": rows, "targets": _targets(regime, rows, len(blocks) + 1, inner, outer)
                       + transient.targets(rows)}
    return out


def _loss_spread(variants: dict) -> float | None:
    """Largest difference between two variants' losses at the same step of the same repeat (same model, same data:
    it should be float noise)."""
    runs = [vr["losses"] for vr in variants.values() if vr.get("losses")]
    diffs = [abs(a - b) for x in runs for y in runs for rx, ry in zip(x, y) for a, b in zip(rx, ry)]
    return max(diffs) if diffs else None


def _ratios(rows: dict) -> None:
    """``vs_<peer>``: ratio of the median step times; ``vs_<peer>_paired``: the median over repeats of the ratio of
    the two variants' medians within a repeat (they ran minutes apart at most: robust to slow changes of load);
    ``vs_<peer>_per_repeat``: those ratios, one per repeat."""
    for v, row in rows.items():
        if "median_step_s" not in row:
            continue
        for peer in ("fsdp2", "ddp", "deepspeed"):
            p = rows.get(peer, {}).get("median_step_s")
            row[f"vs_{peer}"] = row["median_step_s"] / p if p else None
            mine, theirs = row["median_per_repeat_s"], rows.get(peer, {}).get("median_per_repeat_s") or []
            pairs = [a / b for a, b in zip(mine, theirs) if a and b]
            row[f"vs_{peer}_paired"] = _median(pairs)
            row[f"vs_{peer}_per_repeat"] = pairs  # the spread of the paired ratio, for a loaded machine


def _targets(regime: str, rows: dict, n_units: int, inner: int, outer: int) -> list[dict]:
    """shardfusion's targets: [{"target", "value", "met"}] (None: not measurable in this run)."""
    sf = rows.get("shardfusion", {})
    if "median_step_s" not in sf:
        return []
    out = []
    if regime in TARGETS:
        lim_fsdp, lim_ddp = TARGETS[regime]
        for peer, lim in (("fsdp2", lim_fsdp), ("ddp", lim_ddp)):
            val = sf.get(f"vs_{peer}")
            out.append({"target": f"step time <= {lim} x {peer}", "value": val,
                        "met": None if val is None else val <= lim})
    for key in ("all_gather/inner", "reduce_scatter/inner", "all_reduce/outer"):
        row = sf["collectives"].get(key)
        if row and row.get("ratio") is not None:
            out.append({"target": f"{key} bytes <= {BYTES_TARGET} x theory", "value": row["ratio"],
                        "met": row["ratio"] <= BYTES_TARGET})
    if outer > 1:
        n = sf["collectives"].get("all_reduce/outer", {}).get("count", 0)
        out.append({"target": f"one outer all-reduce per unit per step ({n_units})", "value": n, "met": n == n_units})
    out.append({"target": f"persistent memory <= {PERSISTENT_TARGET} x theory", "value": sf["persistent_ratio"],
                "met": sf["persistent_ratio"] <= PERSISTENT_TARGET})
    blocks = sf["transient"].get("blocks_unsharded")
    if blocks is not None:
        lim = sf["transient_blocks_bound"]
        out.append({"target": f"blocks unsharded at once <= bound ({lim})", "value": blocks,
                    "met": blocks <= lim})
    for key, label in (("transient_ratio", "parameter"), ("transient_grad_ratio", "gradient")):
        if sf.get(key) is not None:  # the bound's slack: row padding (shards cut on row boundaries)
            out.append({"target": f"peak full {label} buffers / bound <= {BYTES_TARGET}", "value": sf[key],
                        "met": sf[key] <= BYTES_TARGET})
    return out


# ---- markdown ---------------------------------------------------------------------------------------------------
def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _yes(met) -> str:
    return "n/a" if met is None else ("yes" if met else "**no**")


_COLUMNS = ("variant", "step s (median)", "min-max", "tokens/s", "vs FSDP2 (paired)", "vs DDP (paired)",
            "collectives (count/theory)",
            "bytes vs theory", "wire MB/step (ring; backend)", "persistent MB (x theory)", "peak live MB",
            "transient full params MB (x bound)", "full grads MB (x bound)", "loss first -> last")


def _columns(rows: dict) -> tuple[str, ...]:
    """The table's columns; "vs DeepSpeed" only when the ``deepspeed`` variant ran."""
    if "median_step_s" not in rows.get("deepspeed", {}):
        return _COLUMNS
    i = _COLUMNS.index("vs DDP (paired)") + 1
    return _COLUMNS[:i] + ("vs DeepSpeed (paired)",) + _COLUMNS[i:]


def _row(v: str, row: dict, columns: tuple[str, ...] = _COLUMNS) -> str:
    """One variant's line of a regime table."""
    if "skipped" in row:
        return f"| {v} | skipped: {row['skipped']} |" + " |" * (len(columns) - 2)
    counts, ratios = [], []
    ops = Counter(k.split("/")[0] for k, c in row["collectives"].items() if c.get("ratio") is not None)
    for key, c in sorted(row["collectives"].items()):
        th = c.get("theory_count")
        counts.append(f"{key} {c['count']}" + (f"/{th}" if th is not None else ""))
        if c.get("ratio") is not None:
            op = key.split("/")[0]
            ratios.append(f"{key if ops[op] > 1 else op} {c['ratio']:.4f}")
    tr = row["transient"]
    trans = grads = "-"
    if tr:
        trans = (f"{_mb(tr.get('full_param_bytes'))} ({_f(row.get('transient_ratio'), '.2f')}; "
                 f"{tr.get('blocks_unsharded', '-')} blocks)")
        grads = f"{_mb(tr.get('full_grad_bytes'))} ({_f(row.get('transient_grad_ratio'), '.2f')})"
    loss = row.get("loss_first_last") or [None, None]
    cells = [v, _f(row["median_step_s"]), f"{_f(row['min_step_s'])}-{_f(row['max_step_s'])}",
             _f(row["tokens_per_s"], ".0f"),
             f"{_f(row.get('vs_fsdp2'), '.2f')} ({_f(row.get('vs_fsdp2_paired'), '.2f')})",
             f"{_f(row.get('vs_ddp'), '.2f')} ({_f(row.get('vs_ddp_paired'), '.2f')})",
             *([f"{_f(row.get('vs_deepspeed'), '.2f')} ({_f(row.get('vs_deepspeed_paired'), '.2f')})"]
               if "vs DeepSpeed (paired)" in columns else []),
             "<br>".join(counts), "<br>".join(ratios) or "-",
             f"{_mb(row['wire_bytes_total'])}; {_mb(row['backend_wire_bytes_total'])}",
             f"{_mb(row['persistent_bytes']['total'])} ({row['persistent_ratio']:.4f})",
             _mb(row.get("peak_live_bytes")), trans, grads,
             f"{_f(loss[0], '.4f')} -> {_f(loss[1], '.4f')}"]
    return "| " + " | ".join(cells) + " |"


def markdown(raw: dict, summary: dict) -> str:
    """The report: a header with the setup and the machine, then per regime a table and shardfusion's targets."""
    cfg, env = raw["config"], raw["env"]
    title = "shardfusion vs FSDP2 vs DDP" + (
        " vs DeepSpeed" if set(cfg.get("variants", ())) & set(DEEPSPEED_VARIANTS) else "")
    lines = [f"# {title}: {raw['name']}", "",
             f"{cfg['world_size']} ranks ({cfg['device']}, {cfg['backend']}), HSDP inner {cfg['inner']} x outer "
             f"{cfg['outer']}, units: {'one per ' + cfg.get('units', 'block')}, resharded {cfg.get('reshard', 'after_forward')}, shardfusion prefetch "
             f"{cfg.get('prefetch_depth', 1)}; parameters {cfg['param_dtype']}; AdamW, clip 1.0; random token ids "
             f"(seed {cfg['seed']}, the same batches for every variant). {cfg['repeats']} repeats x ({cfg['warmup']} "
             f"warm-up + {cfg['steps']} timed steps) per variant, variants interleaved (rotated each repeat). Step "
             f"time: the median over steps and repeats of the slowest rank's step. {cfg['threads']} thread(s) per "
             f"worker. Loss: first and last timed step of the first repeat.",
             "", f"Machine: {env['cpu_count']} CPUs, torch {env['torch']}; load average before {env['load_before']}, "
             f"after {env['load_after']}; wall {env.get('wall_s', 0):.0f} s.", ""]
    if env.get("commit"):
        lines += [describe(env), ""]
    for regime, s in summary.items():
        shape = s["shape"]
        lines += [f"## {regime}: batch {shape['batch']}, seq {shape['seq']}, {shape['n_layer']} layers, d "
                  f"{shape['d_model']} ({s['params'] / 1e6:.2f}M parameters, {s['tokens_per_step']} tokens per step)",
                  "", f"Largest loss difference between variants at the same step: {_f(s['loss_max_abs_diff'], '.1e')}.",
                  ""]
        columns = _columns(s["variants"])
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += [_row(v, row, columns) for v, row in s["variants"].items()]
        lines += [""] + transient.markdown(s["variants"])
        if s["targets"]:
            lines += ["", "shardfusion targets:", "", "| target | value | met |", "|---|---|---|"]
            for t in s["targets"]:
                val = _f(t["value"], ".4f") if isinstance(t["value"], float) else t["value"]
                lines.append(f"| {t['target']} | {val} | {_yes(t['met'])} |")
        lines.append("")
    if cfg["backend"] == "gloo":
        lines += ["Wire bytes: `ring` is the bandwidth-optimal volume of the collectives issued (what the ratios "
                  f"use); `backend` counts gloo's reduce-scatter as the full all-reduce it runs "
                  f"({GLOO_REDUCE_SCATTER_FACTOR} x the ring volume); shardfusion issues its reduce-scatters on gloo "
                  f"as all-to-alls (the ring volume).", ""]
    notes = [n for r in raw["regimes"].values() for v, vr in r["variants"].items() if vr.get("note")
             for n in [f"{v}: {vr['note']}"]]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in dict.fromkeys(notes)] + [""]
    return "\n".join(lines)


def write(raw: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<name>.json`` (raw and summary) and ``<name>.md`` under ``out_dir``; returns both paths."""
    summary = summarize(raw)
    return _write_files(raw, summary, markdown(raw, summary), out_dir)


def _write_files(raw: dict, summary: dict, text: str, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{raw['name']}.json", out_dir / f"{raw['name']}.md"
    js.write_text(json.dumps({**raw, "summary": summary}, indent=1))
    md.write_text(text)
    return js, md


# ---- benchmarks/memory.py -----------------------------------------------------------------------------------------
MEMORY_PHASES = ("build", "wrap", "load", "steps")
"""The phases reported, each against the ``baseline`` sample (after imports and process groups)."""


def memory_theory(build: str, P: int, U: int, inner: int, b: int = 4, T: int = 0) -> dict[str, dict[str, float]]:
    """Per phase, bytes per rank: ``peak`` (the least the phase must hold at once), ``hwm`` (the largest ``peak`` so
    far: VmHWM never goes down) and ``live`` (tensors alive at the phase's sample), for ``P`` parameters in ``b``
    bytes each, ``U`` the largest unit's, ``T`` the largest tensor's, over ``inner`` shards.

    build: eager ``4P`` (the model), meta 0. wrap: eager ``4P + 4U`` (the model plus one unit's full buffer being
    sharded), meta ``4P/I + 4U`` (the shards plus one unit's full buffer); alive afterwards: the shards ``4P/I``.
    load: the shards plus one tensor's slab read from the file, ``4P/I + 4T``; alive afterwards: the shards.
    steps: ``16P/I`` (fp32 parameter, gradient and AdamW's two moments, sharded) plus one unit's full parameters and
    full gradient ``8U`` while it runs; alive after ``optimizer.step()``: ``16P/I``."""
    peak = {"build": b * P if build == "eager" else 0.0,
            "wrap": (b * P if build == "eager" else b * P / inner) + b * U,
            "load": b * P / inner + b * T,
            "steps": 4 * b * P / inner + 2 * b * U}
    live = {"build": peak["build"], "wrap": b * P / inner, "load": b * P / inner, "steps": 4 * b * P / inner}
    out, hwm = {}, 0.0
    for phase in MEMORY_PHASES:
        hwm = max(hwm, peak[phase])
        out[phase] = {"peak": peak[phase], "hwm": hwm, "live": live[phase]}
    return out


def _rank_growth(ranks: list[dict], phase: str, key: str, base_key: str | None = None) -> int | None:
    """Largest over ranks of ``phases[phase][key] - phases["baseline"][base_key or key]`` (None: not sampled)."""
    got = [r["phases"][phase][key] - r["phases"]["baseline"][base_key or key] for r in ranks
           if phase in r["phases"] and key in r["phases"][phase]]
    return max(got) if got else None


def memory_summary(raw: dict) -> dict:
    """Per variant and phase (see ``memory_theory``): the medians over repeats of the largest rank's growth of VmHWM
    and VmRSS over its baseline, its live tensor bytes, its CUDA peak over the baseline's allocated bytes; the
    ratios to the model size ``4P``, to theory and (shardfusion) to FSDP2's same build."""
    cfg = raw["config"]
    root, blocks = raw["unit_numel"]["root"], raw["unit_numel"]["blocks"]
    P, U = root + sum(blocks), max([root, *blocks])
    T = raw.get("largest_tensor_numel", 0)
    model_bytes = 4 * P
    rows: dict[str, dict] = {}
    for v, runs in raw["runs"].items():
        library, build = v.split("-")
        theory = memory_theory(build, P, U, cfg["inner"], T=T)
        ok = [run["ranks"] for run in runs if "ranks" in run]
        row: dict = {"library": library, "build": build, "failed": sum("ranks" not in run for run in runs),
                     "error": next((r["error"] for ranks in ok for r in ranks if r.get("error")), None),
                     "wall_s": [run["wall_s"] for run in runs],
                     "losses": ok[0][0]["losses"] if ok else [],
                     "baseline": {k: max(r["phases"]["baseline"][k] for ranks in ok for r in ranks) if ok else None
                                  for k in ("hwm_bytes", "rss_bytes")},
                     "phases": {}}
        for phase in MEMORY_PHASES:
            if not ok or any(phase not in r["phases"] for ranks in ok for r in ranks):
                continue
            ph: dict = {}
            for key, got in (("hwm_growth_bytes", [_rank_growth(ranks, phase, "hwm_bytes") for ranks in ok]),
                             ("rss_growth_bytes", [_rank_growth(ranks, phase, "rss_bytes") for ranks in ok]),
                             ("live_bytes", [max(r["phases"][phase]["live"]["total"] for r in ranks) for ranks in ok]),
                             ("cuda_peak_growth_bytes", [_rank_growth(ranks, phase, "cuda_peak_bytes",
                                                                      "cuda_allocated_bytes") for ranks in ok])):
                got = [g for g in got if g is not None]
                ph[key] = _median(got)
            ph["live_by_group"] = max((r["phases"][phase]["live"] for ranks in ok for r in ranks),
                                      key=lambda d: d.get("total", 0))
            previous = MEMORY_PHASES[MEMORY_PHASES.index(phase) - 1] if phase != MEMORY_PHASES[0] else "baseline"
            ph["seconds"] = _median([max(r["phases"][phase]["time_s"] - r["phases"][previous]["time_s"]
                                         for r in ranks) for ranks in ok])
            th = theory[phase]
            ph.update({"theory_peak_bytes": th["peak"], "theory_hwm_bytes": th["hwm"], "theory_live_bytes": th["live"],
                       "x_model": ph["hwm_growth_bytes"] / model_bytes,
                       "x_theory": ph["hwm_growth_bytes"] / th["hwm"] if th["hwm"] else None,
                       "live_x_theory": ph["live_bytes"] / th["live"] if th["live"] else None})
            row["phases"][phase] = ph
        rows[v] = row
    for v, row in rows.items():  # shardfusion against FSDP2 with the same build
        peer = rows.get(f"fsdp2-{row['build']}") if row["library"] != "fsdp2" else None
        for phase, ph in row["phases"].items():
            theirs = (peer or {}).get("phases", {}).get(phase, {}).get("hwm_growth_bytes")
            ph["x_fsdp2"] = ph["hwm_growth_bytes"] / theirs if theirs else None
    return {"params": P, "model_bytes": model_bytes, "largest_unit_numel": U, "variants": rows}


_MEMORY_COLUMNS = ("variant", "phase", "peak RSS growth MB (VmHWM)", "x model (4P)", "x FSDP2 (same build)",
                   "theory MB", "x theory", "RSS growth MB (VmRSS)", "live tensors MB (x theory)")


def memory_markdown(raw: dict, summary: dict) -> str:
    """The memory report: the setup, one table (variant x phase), the theory and the caveats."""
    cfg, env, shape = raw["config"], raw["env"], raw["shape"]
    P, U, I = summary["params"], summary["largest_unit_numel"], cfg["inner"]
    cuda = any("cuda_peak_growth_bytes" in ph and ph["cuda_peak_growth_bytes"] is not None
               for row in summary["variants"].values() for ph in row["phases"].values())
    columns = _MEMORY_COLUMNS + (("CUDA peak MB",) if cuda else ())
    backend = "NCCL" if cfg["device"] == "cuda" else "gloo"
    lines = [f"# Memory: shardfusion vs FSDP2: {raw['name']}", "",
             f"{cfg['world_size']} ranks ({cfg['device']}, {backend}), inner {I} x outer {cfg['outer']}; GPT "
             f"{shape['n_layer']} layers, d {shape['d_model']}, {shape['n_head']} heads, seq_len {shape['seq_len']}: "
             f"P = {P / 1e6:.2f}M parameters, model 4P = {_mb(4 * P)} MB in fp32, largest unit {_mb(4 * U)} MB. "
             f"{cfg['steps']} AdamW steps (clip 1.0) of batch {cfg['batch']} x seq {cfg['seq']} per rank. Every "
             f"variant in {cfg['world_size']} fresh processes; {cfg['repeats']} repeat(s), variants interleaved. "
             f"{cfg['threads']} thread(s) per worker.", "",
             f"Machine: {env['cpu_count']} CPUs, torch {env['torch']}; load average before {env['load_before']}, "
             f"after {env['load_after']}; wall {env.get('wall_s', 0):.0f} s ("
             + ", ".join(f"{v} {sum(row['wall_s']):.0f} s" for v, row in summary["variants"].items())
             + "); workers' MALLOC_MMAP_THRESHOLD_: "
             + (f"{env['MALLOC_MMAP_THRESHOLD_']} bytes" if env.get("MALLOC_MMAP_THRESHOLD_") else
                "unset (glibc's dynamic threshold)") + ".", "", *([describe(env), ""] if env.get("commit") else []),
             "Each figure: the largest rank's, over its own baseline (after imports and process groups), the median "
             "over repeats. MB = 2^20 bytes.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for v, row in summary["variants"].items():
        for phase in MEMORY_PHASES:
            ph = row["phases"].get(phase)
            if ph is None:
                if row["error"] and phase == row["error"]["phase"]:
                    text = row["error"]["text"].replace("|", "\\|").replace("\n", " ")
                    lines.append(f"| {v} | {phase} | error: {text} |" + " |" * (len(columns) - 3))
                elif row["failed"] and phase == MEMORY_PHASES[0]:
                    lines.append(f"| {v} | - | a worker failed in {row['failed']} repeat(s) |" +
                                 " |" * (len(columns) - 3))
                continue
            cells = [v, phase, _mb(ph["hwm_growth_bytes"]), _f(ph["x_model"], ".2f"), _f(ph["x_fsdp2"], ".2f"),
                     _mb(ph["theory_hwm_bytes"]), _f(ph["x_theory"], ".2f"), _mb(ph["rss_growth_bytes"]),
                     f"{_mb(ph['live_bytes'])} ({_f(ph['live_x_theory'], '.2f')})"]
            if cuda:
                cells.append(_mb(ph["cuda_peak_growth_bytes"]))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Theory, bytes per rank (P parameters, U the largest unit's, T the largest tensor's, I the inner "
              "degree, fp32):", "",
              "| phase | eager build | meta build | alive at the sample |", "|---|---|---|---|",
              "| build | 4P (the model) | 0 | the same |",
              "| wrap | 4P + 4U (the model and one unit's full buffer) | 4P/I + 4U (the shards and one unit's full "
              "buffer) | 4P/I |",
              "| load | 4P/I + 4T (the shards and one tensor's slab read from the file) | the same | 4P/I |",
              "| steps | 16P/I + 8U | 16P/I + 8U | 16P/I (after `optimizer.step()`) |", "",
              "16P/I: the fp32 parameter, gradient and AdamW's two moments, sharded; 8U: one unit's full parameters "
              "and full gradient while it runs. The theory column is the largest of the phases so far, since VmHWM "
              "never goes down: the peak of an eager build stays in every later row. Activations, the allocator's "
              "and the libraries' bookkeeping are not in the theory.", "",
              "Caveats: VmHWM is the process's peak resident set since it started and cannot be reset, so a phase "
              "shows only what rises above all earlier phases; VmRSS shows what is resident at the sample, freed "
              "memory that the C allocator keeps included (less of it with a fixed MALLOC_MMAP_THRESHOLD_); the "
              "live tensor bytes are the storages' sizes (allocated, whether touched or not) of the tensors "
              "reachable from the model, its optimizer and the library's buffers, at the sample only.", ""]
    baselines = [(v, row["baseline"]) for v, row in summary["variants"].items() if row["baseline"]["hwm_bytes"]]
    if baselines:
        lines += ["Baselines (largest rank): " + "; ".join(
            f"{v} VmHWM {_mb(b['hwm_bytes'])} MB, VmRSS {_mb(b['rss_bytes'])} MB" for v, b in baselines) + ".", ""]
    return "\n".join(lines)


def write_memory(raw: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write a memory run's ``<name>.json`` (raw and summary) and ``<name>.md`` under ``out_dir``."""
    summary = memory_summary(raw)
    return _write_files(raw, summary, memory_markdown(raw, summary), out_dir)


# ---- benchmarks/pipeline.py ---------------------------------------------------------------------------------------
def pipeline_theory(units: list, stages: list[int], num_stages: int, micro: int, reshard: str, inner: int,
                    outer: int, p2p_numel: int, b: int = 4) -> dict:
    """Per rank and step, for the units it holds (``[kind, elements, stage]``, kind "root" or "block") and its
    ``stages`` out of ``num_stages``, at ``micro`` micro-batches: {"op/group": {"count", "wire_bytes"}}.

    all-gather (inner): per micro-batch every unit in its forward, and every block again in its backward under
    ``after_forward`` (the root unit stays gathered from forward to backward); under ``after_backward`` every unit once
    per micro-batch (gathered in forward, kept until that micro-batch's backward). ``all_gather/inner@once`` is the
    least any policy can do: each unit once per step (the stage kept gathered from its first forward to the end of
    the step). reduce-scatter (inner): each unit once per step. all-reduce (outer): each unit's shard once per step.
    P2P: per micro-batch each stage sends its output to the next stage (all but the last) and the gradient of its
    input to the previous one (all but the first), ``p2p_numel`` elements each, and receives as many."""
    blocks = [n for kind, n, _ in units if kind == "block"]
    roots = [n for kind, n, _ in units if kind == "root"]
    P = sum(blocks) + sum(roots)
    per_block = 2 if reshard == "after_forward" else 1
    out: dict = {}
    if inner > 1:
        f = (inner - 1) / inner * b
        out["all_gather/inner"] = {"count": micro * (per_block * len(blocks) + len(roots)),
                                   "wire_bytes": f * micro * (per_block * sum(blocks) + sum(roots))}
        out["all_gather/inner@once"] = {"count": len(blocks) + len(roots), "wire_bytes": f * P}
        out["reduce_scatter/inner"] = {"count": len(blocks) + len(roots), "wire_bytes": f * P}
    if outer > 1:
        out["all_reduce/outer"] = {"count": len(blocks) + len(roots),
                                   "wire_bytes": 2 * (outer - 1) / outer * P / inner * b}
    sends = micro * sum((s < num_stages - 1) + (s > 0) for s in stages)
    out["p2p_send/pp"] = {"count": sends, "wire_bytes": sends * p2p_numel * b}
    out["p2p_recv/pp"] = {"count": sends, "wire_bytes": 0.0}
    return out


def bubble_theory(pp: int, micro: int, stages_per_rank: int) -> float:
    """The idle fraction of a step of equal stages and free communication: ``(p-1) / (v*m + p-1)`` (GPipe and 1F1B
    with v = 1; interleaved 1F1B with v stages per rank)."""
    return (pp - 1) / (stages_per_rank * micro + pp - 1)


def in_flight_theory(schedule: str, micro: int, pp: int, pp_rank: int) -> int | None:
    """Micro-batches whose activations a stage holds at once: GPipe all ``m``; 1F1B ``min(m, p - stage)``; None for
    the interleaved schedule (not modelled here)."""
    if schedule == "gpipe":
        return micro
    if schedule == "1f1b":
        return min(micro, pp - pp_rank)
    return None


def _merge_small(table: dict) -> dict:
    """A rank's collective table with "/small" dropped from every key but the all-reduces' (P2P and gathers of a tiny
    model stay counted with their kind); rows that then share a key are added."""
    out: dict = {}
    for key, row in table.items():
        k = key if key.startswith("all_reduce") else key.replace("/small", "")
        acc = out.setdefault(k, {"count": 0, "wire_bytes": 0.0, "bytes": 0})
        for f in ("count", "wire_bytes", "bytes"):
            acc[f] += row[f]
    return out


def pipeline_summary(raw: dict) -> dict:
    """Per case and variant: step time (median over repeats and steps of the slowest rank), its ratio to the other
    library (and the paired ratio), the pipeline's measured bubble against theory, and per stage (pp rank) the
    collectives against ``pipeline_theory``, where the all-gathers ran, and memory."""
    cfg = raw["config"]
    pp, inner, outer = cfg["pp"], cfg["inner"], cfg["outer"]
    ranks = sorted(raw["ranks"], key=lambda r: r["rank"])
    tokens = cfg["mb_rows"] * cfg["seq"] * (cfg["world_size"] // pp)  # per micro-batch, over the stage's replicas
    p2p_numel = cfg["mb_rows"] * cfg["seq"] * cfg["d_model"]
    out: dict = {}
    for c in cfg["cases"]:
        name = f"{c['schedule']}-M{c['micro']}-{c['reshard']}"
        v_per = 2 if c["schedule"] == "interleaved" else 1
        num_stages = pp * v_per
        rows: dict = {}
        for v in cfg["variants"]:
            per_rank = [r["results"][name][v] for r in ranks]
            err = next((x["error"] for x in per_rank if x.get("error")), None)
            if err or not per_rank[0]["steps"]:
                rows[v] = {"error": err or "no steps"}
                continue
            reps = len(per_rank[0]["steps"])
            step_s, pipe_s, per_rep = [], [], []
            bubbles: dict[int, list] = {}
            cores = []
            for i in range(reps):
                n = len(per_rank[0]["steps"][i])
                rep = []
                for j in range(n):
                    ts = [x["steps"][i][j] for x in per_rank]
                    t = max(s["step_s"] for s in ts)
                    rep.append(t)
                    pipe_s.append(max(s["pipe_s"] for s in ts))
                    cores.append(sum(s["cpu_s"] for s in ts) / t)
                    for r, s in zip(ranks, ts):
                        bubbles.setdefault(r["pp_rank"], []).append(1 - s["busy_s"] / s["pipe_s"])
                step_s += rep
                per_rep.append(_median(rep))
            med = _median(step_s)
            last = next(x for r, x in zip(ranks, per_rank) if r["pp_rank"] == (num_stages - 1) % pp
                        and r["dp_rank"] == 0)
            row = {"median_step_s": med, "min_step_s": min(step_s), "max_step_s": max(step_s), "n_steps": len(step_s),
                   "median_per_repeat_s": per_rep, "median_pipe_s": _median(pipe_s),
                   "tokens_per_s": tokens * c["micro"] / med,
                   "cores_busy": _median(cores),
                   "bubble_by_stage": {k: _median(b) for k, b in sorted(bubbles.items())},
                   "losses": last["losses"][0], "stages": {}}
            row["bubble_measured"] = statistics.mean(row["bubble_by_stage"].values())
            for k in sorted(bubbles):
                mine = [(r, x) for r, x in zip(ranks, per_rank) if r["pp_rank"] == k]
                r0, x0 = mine[0]
                units = r0["units"][name]
                held = list(range(k, num_stages, pp))
                th = pipeline_theory(units, held, num_stages, c["micro"], c["reshard"], inner, outer, p2p_numel)
                tables = [_merge_small(x["collectives"]) for _, x in mine]
                counts = [{q: t[q]["count"] for q in t} for t in tables]
                table = tables[0]
                for key, t in th.items():
                    got = table.get(key.split("@")[0], {"count": 0, "wire_bytes": 0.0, "bytes": 0})
                    table[key] = {**got, "theory_count": t["count"], "theory_wire_bytes": t["wire_bytes"],
                                  "ratio": got["wire_bytes"] / t["wire_bytes"] if t["wire_bytes"] else None,
                                  "count_ratio": got["count"] / t["count"] if t["count"] else None}
                mem = [x["memory"] for _, x in mine]
                trans = [x["transient"] for _, x in mine]
                P = sum(n for _, n, _ in units)
                stage = {"stages": held, "units": units, "collectives": table,
                         "same_on_every_rank_of_the_stage": all(n == counts[0] for n in counts),
                         "by_phase": x0["by_phase"],
                         "cross_check": x0.get("cross_check"),
                         "live_before_bytes": max(m["live_before_bytes"] for m in mem),
                         "step_peak_growth_bytes": max(m["step_peak_growth_bytes"] for m in mem),
                         "peak_bytes": max(m["live_before_bytes"] + m["step_peak_growth_bytes"] for m in mem),
                         "peak_at": max(mem, key=lambda m: m["live_before_bytes"] + m["step_peak_growth_bytes"])
                         .get("step_peak_at", "-"),
                         "persistent_bytes": max(m["persistent_bytes"] for m in mem),
                         "persistent_theory_bytes": PERSISTENT_BYTES_PER_PARAM * P / inner,
                         "full_param_bytes": max(t.get("full_param_bytes", 0) for t in trans),
                         "full_grad_bytes": max(t.get("full_grad_bytes", 0) for t in trans),
                         "blocks_unsharded": max(t.get("blocks_unsharded", 0) for t in trans),
                         "in_flight_theory": in_flight_theory(c["schedule"], c["micro"], pp, k)}
                stage["persistent_ratio"] = stage["persistent_bytes"] / stage["persistent_theory_bytes"]
                row["stages"][k] = stage
            rows[v] = row
        for v, row in rows.items():  # the other library is the peer
            peer = next((rows[q] for q in rows if q != v and "median_step_s" in rows[q]), None)
            if "median_step_s" not in row or peer is None:
                continue
            row["vs_peer"] = row["median_step_s"] / peer["median_step_s"]
            row["vs_peer_paired"] = _median([a / b for a, b in zip(row["median_per_repeat_s"],
                                                                   peer["median_per_repeat_s"]) if a and b])
        losses = [row["losses"] for row in rows.values() if row.get("losses")]
        diffs = [abs(a - b) for x in losses for y in losses for a, b in zip(x, y) if a is not None and b is not None]
        out[name] = {**c, "stages_per_rank": v_per, "bubble_theory": bubble_theory(pp, c["micro"], v_per),
                     "loss_max_abs_diff": max(diffs) if diffs else None, "variants": rows}
    return {"cases": out}


def _pp_cell(row: dict, fn) -> str:
    """One figure per stage, joined by " / " (stage 0 first)."""
    return " / ".join(fn(s) for _, s in sorted(row["stages"].items(), key=lambda kv: int(kv[0])))


def _count_cell(table: dict, key: str) -> str:
    c = table.get(key)
    if c is None:
        return "-"
    th = c.get("theory_count")
    return f"{c['count']}" + (f"/{th}" if th is not None else "")


def pipeline_markdown(raw: dict, summary: dict) -> str:
    """The report: setup, then step times and bubbles, collectives per stage, memory per stage, and the reshard
    policies under 1F1B side by side."""
    cfg, env = raw["config"], raw["env"]
    pp, inner, outer = cfg["pp"], cfg["inner"], cfg["outer"]
    lines = [f"# Pipeline parallel: shardfusion vs FSDP2 stages: {raw['name']}", "",
             f"{cfg['world_size']} gloo ranks: pp {pp} x sharding {cfg['world_size'] // pp} (inner {inner} x outer "
             f"{outer}). GPT {cfg['n_layer']} layers, d {cfg['d_model']}, {cfg['n_head']} heads, untied head, split "
             f"by `split_gpt` into pp x v stages (v = 2 for the interleaved schedule). Each data-parallel rank of a "
             f"stage takes M micro-batches of {cfg['mb_rows']} x {cfg['seq']} tokens per step (seed {cfg['seed']}, "
             f"the same for both variants). AdamW (lr {cfg['lr']}), clipping to {cfg['max_norm']} by the norm over "
             f"the whole model. {cfg['repeats']} repeats x ({cfg['warmup']} warm-up + {cfg['steps']} timed steps) "
             f"per variant, cases rotated and the two variants swapped each repeat. {cfg['threads']} thread(s) per "
             "worker.", "",
             f"Machine: {env['cpu_count']} CPUs, torch {env['torch']}; load average before {env['load_before']}, "
             f"after {env['load_after']}; wall {env.get('wall_s', 0):.0f} s. Command: `{cfg.get('command', '')}`.",
             *([describe(env)] if env.get("commit") else []),
             "", "MB = 2^20 bytes. Per-stage figures are given as stage 0 / stage 1 (the pp ranks; under the "
             "interleaved schedule pp rank 0 holds stages 0 and 2, pp rank 1 stages 1 and 3).", ""]
    lines += ["## Step time and bubble", "",
              "| case | variant | step s (median) | min-max | vs peer (paired) | schedule.step s | bubble theory | "
              "bubble measured (per stage) | cores busy | loss first -> last |", "|" + "---|" * 10]
    for name, case in summary["cases"].items():
        for v, row in case["variants"].items():
            if "error" in row:
                lines.append(f"| {name} | {v} | error: {row['error'].replace('|', '/')} |" + " |" * 7)
                continue
            loss = row["losses"]
            lines.append("| " + " | ".join([
                name, v, _f(row["median_step_s"]), f"{_f(row['min_step_s'])}-{_f(row['max_step_s'])}",
                f"{_f(row.get('vs_peer'), '.2f')} ({_f(row.get('vs_peer_paired'), '.2f')})",
                _f(row["median_pipe_s"]), _f(case["bubble_theory"], ".2f"),
                f"{_f(row['bubble_measured'], '.2f')} (" + " / ".join(
                    _f(b, ".2f") for _, b in sorted(row["bubble_by_stage"].items(), key=lambda kv: int(kv[0]))) + ")",
                _f(row["cores_busy"], ".2f"), f"{_f(loss[0], '.4f')} -> {_f(loss[-1], '.4f')}"]) + " |")
    lines += ["", "Largest loss difference between the variants of a case at the same step: " + ", ".join(
        f"{n} {_f(c['loss_max_abs_diff'], '.1e')}" for n, c in summary["cases"].items()) + ".", ""]
    lines += ["## Collectives per step, per stage", "",
              "count/theory; bytes: the measured ring bytes per rank over the theory's (`benchmarks/report.py`, "
              "`pipeline_theory`). `AG where`: the stage action the all-gathers ran in (F forward, B backward, "
              "R the schedule's `perform_reduce_grad`, `between`: outside any stage action, issued by the "
              "schedule). `AG once`: the all-gathers against one per unit per step.", "",
              "| case | variant | stage | all-gathers | AG bytes x theory | AG once (count x) | AG where | "
              "reduce-scatters | RS bytes x theory | outer all-reduces (bytes x theory) | "
              "P2P sends (MB sent, x theory) | "
              "P2P receives | small all-reduces |", "|" + "---|" * 13]
    for name, case in summary["cases"].items():
        for v, row in case["variants"].items():
            if "error" in row:
                continue
            for k, s in sorted(row["stages"].items(), key=lambda kv: int(kv[0])):
                t = s["collectives"]
                where = Counter()
                for key, n in s["by_phase"].items():
                    op, _, at = key.partition("@")
                    if op.startswith("all_gather"):
                        where[at] += n
                once = t.get("all_gather/inner@once", {})
                send = t.get("p2p_send/pp", {})
                small = ", ".join(f"{key.split('/')[1]} {c['count']}" for key, c in sorted(t.items())
                                  if key.endswith("/small"))
                lines.append("| " + " | ".join([
                    name, v, f"{k} (stages {','.join(map(str, s['stages']))})", _count_cell(t, "all_gather/inner"),
                    _f(t.get("all_gather/inner", {}).get("ratio"), ".4f"),
                    f"{once.get('count', '-')}/{once.get('theory_count', '-')} ({_f(once.get('count_ratio'), '.2f')})",
                    ", ".join(f"{at} {n}" for at, n in sorted(where.items())) or "-",
                    _count_cell(t, "reduce_scatter/inner"), _f(t.get("reduce_scatter/inner", {}).get("ratio"), ".4f"),
                    _count_cell(t, "all_reduce/outer") + (
                        f" ({_f(t['all_reduce/outer'].get('ratio'), '.4f')})" if "all_reduce/outer" in t else ""),
                    f"{_count_cell(t, 'p2p_send/pp')} ({_mb(send.get('wire_bytes'))}, {_f(send.get('ratio'), '.4f')})",
                    _count_cell(t, "p2p_recv/pp"), small or "-"]) + " |")
    lines += ["", "## Memory per stage", "",
              "Bytes on the largest rank of each stage. `before`: distinct storages of the parameters and the AdamW "
              "state at the start of a step (gradients freed); `step peak`: the largest running sum of the CPU "
              "allocation events of one step (`torch.profiler`, `profile_memory=True`) over its start: activations, "
              "gathered parameters, gradients; `peak` = before + step peak; `peak at`: where in the step it was "
              "reached (`B0:3`: stage 0's backward of micro-batch 3; `schedule`: between stage actions); "
              "`persistent`: parameters, gradients and "
              "AdamW state after `optimizer.step()`, against 16 P_stage / I; `full params`/`full grads`: the largest "
              "total of the library's full-size buffers sampled after every op, and how many blocks were gathered "
              "at once; `in flight`: the micro-batches whose activations a stage holds at once in theory.", "",
              "| case | variant | stage | before MB | step peak MB | peak MB | peak at | persistent MB (x theory) | "
              "full params MB (blocks) | full grads MB | in flight |", "|" + "---|" * 11]
    for name, case in summary["cases"].items():
        for v, row in case["variants"].items():
            if "error" in row:
                continue
            for k, s in sorted(row["stages"].items(), key=lambda kv: int(kv[0])):
                lines.append("| " + " | ".join([
                    name, v, str(k), _mb(s["live_before_bytes"]), _mb(s["step_peak_growth_bytes"]),
                    _mb(s["peak_bytes"]), s["peak_at"], f"{_mb(s['persistent_bytes'])} ({s['persistent_ratio']:.4f})",
                    f"{_mb(s['full_param_bytes'])} ({s['blocks_unsharded']})", _mb(s["full_grad_bytes"]),
                    "-" if s["in_flight_theory"] is None else str(s["in_flight_theory"])]) + " |")
    study = [(n, c) for n, c in summary["cases"].items() if c["schedule"] == "1f1b"]
    if len({c["reshard"] for _, c in study}) > 1:
        lines += ["", "## Reshard policy between micro-batches (1F1B)", "",
                  "shardfusion's `reshard_policy` (FSDP2: `reshard_after_forward` True / False) at each micro-batch "
                  "count; per stage: all-gathers per step and their MB sent per rank, peak memory.", "",
                  "| M | policy | variant | all-gathers (stage 0 / 1) | AG MB sent | step s (median) | "
                  "vs after_forward | peak MB | full params MB |", "|" + "---|" * 9]
        for name, c in sorted(study, key=lambda nc: (nc[1]["micro"], nc[1]["reshard"])):
            for v, row in c["variants"].items():
                if "error" in row:
                    continue
                base = summary["cases"].get(f"1f1b-M{c['micro']}-after_forward", {}).get("variants", {}).get(v, {})
                ratio = (row["median_step_s"] / base["median_step_s"]) if base.get("median_step_s") else None
                lines.append("| " + " | ".join([
                    str(c["micro"]), c["reshard"], v,
                    _pp_cell(row, lambda s: _count_cell(s["collectives"], "all_gather/inner")),
                    _pp_cell(row, lambda s: _mb(s["collectives"].get("all_gather/inner", {}).get("wire_bytes"))),
                    _f(row["median_step_s"]), _f(ratio, ".2f"), _pp_cell(row, lambda s: _mb(s["peak_bytes"])),
                    _pp_cell(row, lambda s: _mb(s["full_param_bytes"]))]) + " |")
    lines.append("")
    return "\n".join(lines)



def write_pipeline(raw: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write a pipeline run's ``<name>.json`` (raw and summary) and ``<name>.md`` under ``out_dir``."""
    summary = pipeline_summary(raw)
    return _write_files(raw, summary, pipeline_markdown(raw, summary), out_dir)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    data.pop("summary", None)
    writer = {"memory": write_memory, "pipeline": write_pipeline}.get(data.get("benchmark"), write)
    print(writer(data, path.parent)[1].read_text())
