"""The figures and the report of ``benchmarks/zeropp.py``: per link rate and variant the median step, the ratios
(against fp32 FSDP, against DeepSpeed's best variant that ran, against the same variant on the unlimited link; each
also paired by round: the median over rounds of the ratio within a round), the link bytes per node and step from the
veth counters against shardfusion's accounting and the theory (``benchmarks/zeropp_theory.py``), and the issue's
targets. ``summary["table"]`` holds one record per (rate, variant) for the docs' quoted table."""

from __future__ import annotations

import statistics
from typing import Any, Optional

from benchmarks.provenance import describe
from benchmarks.zeropp import ALL_THREE, REFERENCE, VARIANTS
from benchmarks.zeropp_theory import formula, link_bytes

UNLIMITED = "unlimited"
TARGET_RATE = "200mbit"
STEP_TARGET, BYTES_TARGET = 0.4, 0.3
"""The issue's goals with all three ideas on, at 200 Mbit/s: step <= 0.4 x fp32 FSDP's (and <= DeepSpeed's best),
link bytes <= 0.3 x fp32 FSDP's."""


def _median(xs: list) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _paired(a: list, b: list) -> Optional[float]:
    """The median over rounds of the ratio of round medians (rounds in the same order; missing ones dropped)."""
    return _median([x / y for x, y in zip(a, b) if x and y])


def _row(v: str, vr: dict, numel: dict, steps: int) -> dict:
    """One variant's figures at one rate, from its rounds."""
    rounds = vr["rounds"]
    times = [t for r in rounds for t in r["step_s"]]
    nodes = len(rounds[0]["link_bytes"])
    link = [_median([r["link_bytes"][n] / steps for r in rounds]) for n in range(nodes)]
    theory = link_bytes(v, numel["root"], sum(numel["blocks"]), numel["tied"])
    row = {"variant": v, "label": VARIANTS[v][2], "median_step_s": _median(times), "min_step_s": min(times),
           "max_step_s": max(times), "n_steps": len(times), "per_round_s": [_median(r["step_s"]) for r in rounds],
           "link_bytes_per_step": link, "link_mb": max(link) / 1e6,
           "theory": theory, "theory_mb": None if theory is None else theory["total"] / 1e6,
           "formula": formula(v), "loss_first_last": [rounds[0]["losses"][0], rounds[0]["losses"][-1]]}
    row["link_vs_theory"] = row["link_mb"] / row["theory_mb"] if row["theory_mb"] else None
    if all("accounting" in r for r in rounds):
        acct = [_median([sum(r["accounting"][n].values()) / steps for r in rounds]) for n in range(nodes)]
        row["accounting_bytes_per_step"] = acct
        row["accounting_mb"] = max(acct) / 1e6
        row["accounting_by_category"] = {c: statistics.mean(r["accounting"][0][c] for r in rounds) / steps
                                         for c in rounds[0]["accounting"][0] if rounds[0]["accounting"][0][c]}
    return row


def _ratios(rows: dict, unlimited: dict) -> None:
    """Each row's ratios: against ``REFERENCE`` (step and link bytes), DeepSpeed's best (the DeepSpeed variant with
    the lowest median step at this rate) and the same variant on the unlimited link."""
    ref = rows.get(REFERENCE)
    ds = [r for v, r in rows.items() if VARIANTS[v][0] == "deepspeed"]
    best = min(ds, key=lambda r: r["median_step_s"]) if ds else None
    for row in rows.values():
        for key, peer in (("fsdp", ref), ("ds_best", best), ("unlimited", unlimited.get(row["variant"]))):
            row[f"vs_{key}"] = row["median_step_s"] / peer["median_step_s"] if peer else None
            row[f"vs_{key}_paired"] = _paired(row["per_round_s"], peer["per_round_s"]) if peer else None
        row["ds_best"] = best["variant"] if best else None
        row["link_vs_fsdp"] = row["link_mb"] / ref["link_mb"] if ref and ref["link_mb"] else None


TABLE_FIGURES = ("median_step_s", "vs_fsdp_paired", "vs_ds_best_paired", "vs_unlimited_paired", "link_mb",
                 "accounting_mb", "theory_mb", "link_vs_fsdp")
"""The figures of each record of ``summary["table"]`` (rounded to 3 decimals; ``"-"`` where there is none)."""


def _shown(x: Optional[float]) -> Any:
    return "-" if x is None else round(x, 3)


def summarize(raw: dict) -> dict:
    """Per rate the rows (`_row`, `_ratios`), the table for the docs and the targets."""
    steps = raw["config"]["steps"]
    per_rate = {}
    for rate, rr in raw["rates"].items():
        per_rate[rate] = {v: _row(v, vr, rr["unit_numel"], steps) for v, vr in rr["variants"].items()
                          if vr.get("rounds")}
    unlimited = per_rate.get(UNLIMITED, {})
    for rows in per_rate.values():
        _ratios(rows, unlimited)
    table = [{"rate": rate, "variant": row["variant"], "label": row["label"],
              **{k: _shown(row.get(k)) for k in TABLE_FIGURES}}
             for rate, rows in per_rate.items() for row in rows.values()]
    return {"rates": per_rate, "table": table, "targets": targets(per_rate)}


def targets(per_rate: dict) -> list[dict]:
    """The issue's goals for all three ideas (`STEP_TARGET`, `BYTES_TARGET` at `TARGET_RATE`) and, at 1 Gbit/s,
    the ratio to the unlimited step (reported, no limit); a value is None when a variant did not run."""
    rows = per_rate.get(TARGET_RATE, {})
    row = rows.get(ALL_THREE, {})
    out = [{"target": f"{ALL_THREE} step <= {STEP_TARGET} x {REFERENCE} at {TARGET_RATE} (paired)",
            "value": row.get("vs_fsdp_paired"), "limit": STEP_TARGET},
           {"target": f"{ALL_THREE} step <= DeepSpeed's best at {TARGET_RATE} (paired)",
            "value": row.get("vs_ds_best_paired"), "limit": 1.0},
           {"target": f"{ALL_THREE} link bytes <= {BYTES_TARGET} x {REFERENCE}'s at {TARGET_RATE}",
            "value": row.get("link_vs_fsdp"), "limit": BYTES_TARGET}]
    gbit = per_rate.get("1gbit", {}).get(ALL_THREE, {})
    out.append({"target": f"{ALL_THREE} step at 1gbit / its unlimited step (paired; reported)",
                "value": gbit.get("vs_unlimited_paired"), "limit": None})
    for t in out:
        t["met"] = None if t["value"] is None or t["limit"] is None else t["value"] <= t["limit"]
    return out


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(raw: dict) -> str:
    """The report: provenance, setup, skipped and refused variants (with the error), the step table per rate, the
    details per rate (bytes against accounting and theory), the targets."""
    summary, cfg = raw["summary"], raw["config"]
    first = next(iter(raw["rates"].values()), None)
    lines = [f"# ZeRO++ across an emulated link: {raw['name']}", "", describe(raw["env"]), "",
             f"Command: `{raw['env'].get('command')}`.", ""]
    if first is not None:
        s, numel = first["shape"], first["unit_numel"]
        params = numel["root"] + sum(numel["blocks"])
        lines += [f"2 emulated nodes x 2 ranks (docs/network-emulation.md), gloo, one sharding group of 4 over both "
                  f"nodes (job flags `{' '.join(cfg['base_flags'])}`). GPT {s['n_layer']} blocks x d {s['d_model']}, "
                  f"batch {s['batch']}, seq {s['seq']} ({params / 1e6:.2f}M parameters, fp32), AdamW, clip 1.0. "
                  f"{cfg['rounds']} rounds x ({cfg['warmup']} warm-up + {cfg['steps']} timed steps) per variant; a "
                  f"round is one job per rate, variants rotated. Step: the median over steps and rounds of the "
                  f"slowest rank's step; ratios are paired by round (median over rounds of the ratio within one).", ""]
    for v, why in raw.get("skipped", {}).items():
        lines.append(f"- skipped `{v}`: {why}")
    for v, why in raw.get("refused", {}).items():
        lines.append(f"- `{v}` refused on CPU: `{why[:400]}`")
    lines.append("")
    rates = summary["rates"]
    names = [v for v in VARIANTS if any(v in rows for rows in rates.values())]
    lines += ["## Median step time (s)", "", "| link | " + " | ".join(VARIANTS[v][2] for v in names) + " |",
              "|---|" + "---|" * len(names)]
    for rate, rows in rates.items():
        lines.append(f"| {rate} | " + " | ".join(_f(rows.get(v, {}).get("median_step_s")) for v in names) + " |")
    for rate, rows in rates.items():
        lines += ["", f"## {rate}", "", "| variant | step s | min-max | vs fp32 FSDP | vs DeepSpeed best | "
                  "vs unlimited | link MB/step node 0, 1 | accounting MB | theory MB | link / theory | "
                  "link / fp32 FSDP | loss first -> last |", "|---|" + "---|" * 11]
        for row in rows.values():
            lines.append(
                f"| {row['label']} | {_f(row['median_step_s'])} | {_f(row['min_step_s'])}-{_f(row['max_step_s'])} "
                f"| {_f(row['vs_fsdp_paired'], '.2f')} | {_f(row['vs_ds_best_paired'], '.2f')} "
                f"({row['ds_best'] or '-'}) | {_f(row['vs_unlimited_paired'], '.2f')} | "
                f"{', '.join(_f(b / 1e6, '.2f') for b in row['link_bytes_per_step'])} | "
                f"{_f(row.get('accounting_mb'), '.2f')} | {_f(row['theory_mb'], '.2f')} | "
                f"{_f(row['link_vs_theory'], '.3f')} | {_f(row['link_vs_fsdp'], '.3f')} | "
                f"{row['loss_first_last'][0]:.4f} -> {row['loss_first_last'][1]:.4f} |")
        drops = [q.get("drops", 0) for q in raw["rates"][rate].get("qdisc", [])]
        lines += ["", f"tbf drops (node 0, 1): {drops}."]
    lines += ["", "## Theory (bytes per node and step; benchmarks/zeropp_theory.py)", "",
              "| variant | formula |", "|---|---|"]
    lines += [f"| {v} | {formula(v)} |" for v in VARIANTS]
    lines += ["", "## Targets (issue 37)", "", "| target | value | met |", "|---|---|---|"]
    for t in summary["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {_f(t['value'])} | {met} |")
    return "\n".join(lines) + "\n"
