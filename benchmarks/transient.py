"""The transient memory of `benchmarks/compare.py`'s variants, part by part at the peak, for `benchmarks/report.py`.

Each variant runs one instrumented step under ``shardfusion.live_memory.LiveMemory`` (``compare._peak_live``); the
rank with the largest peak reports what its live tensor bytes were at that moment:

- ``params``, ``grads``, ``optimizer``: the tensors kept from step to step (the persistent part);
- ``full_params`` / ``full_grads``: gathered parameters and full-size gradients, with the units they belong to
  (``""`` the root: embeddings, final norm, tied head; ``blocks.<i>``); for DeepSpeed the gathered modules' data and
  the gradients of the full parameters (its reduce bucket holds them, so it is here);
- ``comm_buffers``: buffers passed to a collective that are none of the above (a reduce-scatter's receive buffer or
  cast input, FSDP2's reduce-scatter input, a copy of the gradients);
- ``activations``: made by the forward and still alive; ``optimizer_step``: made by the clipping and the optimizer
  step; ``other``: the rest of backward (gradients of activations, temporaries of the ops).

Transient = peak - persistent, where persistent is measured after ``optimizer.step()`` (``compare._instrument``) as
in the issue's table; the parts of the peak other than the persistent ones add up to the same figure up to the
gradients a variant allocates in its first backward.
"""

from __future__ import annotations

PARTS = ("full_params", "full_grads", "activations", "comm_buffers", "optimizer_step", "other")
PERSISTENT = ("params", "grads", "optimizer")
LABELS = {"full_params": "full params", "full_grads": "full grads", "activations": "activations",
          "comm_buffers": "comm buffers", "optimizer_step": "optimizer step", "other": "other"}
PEER = "deepspeed"
"""The variant shardfusion's transient is held against (the issue's target: at most DeepSpeed ZeRO-3's)."""


def summarize(live: dict, persistent_total: int, grad_bound: float | None) -> dict:
    """A variant's transient: ``peak``, ``persistent``, ``transient`` (bytes), ``parts`` at the peak, ``units``
    (``{part: {unit: bytes}}``), ``rank`` (the rank with the largest peak), ``grads_vs_bound``: full gradient bytes
    at the peak over ``grad_bound`` (None without a bound)."""
    parts = live.get("parts", {})
    out = {"peak": live["peak_bytes"], "persistent": persistent_total,
           "transient": live["peak_bytes"] - persistent_total, "parts": parts, "units": live.get("units", {}),
           "rank": live.get("rank")}
    out["grads_vs_bound"] = parts.get("full_grads", 0) / grad_bound if grad_bound and parts else None
    return out


def add_ratios(rows: dict) -> None:
    """``transient_vs_deepspeed`` in every row that has a transient, when ``deepspeed`` ran."""
    peer = rows.get(PEER, {}).get("transient_memory")
    for row in rows.values():
        mine = row.get("transient_memory")
        if mine and peer and peer["transient"] > 0:
            row["transient_memory"]["vs_deepspeed"] = mine["transient"] / peer["transient"]


def targets(rows: dict) -> list[dict]:
    """shardfusion's transient against DeepSpeed's: [{"target", "value", "met"}] (none when either is missing)."""
    mine = rows.get("shardfusion", {}).get("transient_memory") or {}
    if mine.get("vs_deepspeed") is None:
        return []
    return [{"target": "transient memory (peak - persistent) <= DeepSpeed ZeRO-3's", "value": mine["vs_deepspeed"],
             "met": mine["vs_deepspeed"] <= 1.0}]


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _units(units: dict) -> str:
    if not units:
        return ""
    return " (" + ", ".join(f"{name or 'root'} {_mb(b)}" for name, b in sorted(units.items())) + ")"


def markdown(rows: dict) -> list[str]:
    """The breakdown of one regime: a sentence and :func:`table` (markdown lines; empty when no variant has one)."""
    lines = table(rows)
    if not lines:
        return []
    return ["Transient memory at the peak (live tensor bytes of the rank with the largest peak, MB; transient = "
            "peak - persistent; the parts are those alive at that moment, see benchmarks/transient.py):", "",
            *lines, ""]


def table(rows: dict) -> list[str]:
    """The breakdown table of one regime's variants (``summary[regime]["variants"]``): one row per variant with a
    ``transient_memory``, MiB; the full buffers name their units, the full gradients their ratio to the bound."""
    have = {v: r["transient_memory"] for v, r in rows.items() if r.get("transient_memory")}
    if not have:
        return []
    lines = ["| variant | persistent | peak live | transient | vs DeepSpeed | "
             + " | ".join(LABELS[p] for p in PARTS) + " |", "|" + "---|" * (5 + len(PARTS))]
    for v, t in have.items():
        ratio = t.get("vs_deepspeed")
        cells = [v, _mb(t["persistent"]), _mb(t["peak"]), _mb(t["transient"]),
                 "-" if ratio is None else f"{ratio:.3f}"]
        for p in PARTS:
            cell = _mb(t["parts"].get(p)) + _units(t["units"].get(p, {}))
            if p == "full_grads" and t.get("grads_vs_bound") is not None:
                cell += f"; {t['grads_vs_bound']:.2f} x bound"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return lines
