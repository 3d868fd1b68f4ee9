"""The dry run's report lines that judge a layout (see [Note: dry run] in ``shardfusion.dry_run``): a memory
budget's verdict per kind of rank, the cost model's time split into bandwidth and latency terms, and the warning
when inner groups span nodes."""

from __future__ import annotations

from shardfusion.plan import _size
from shardfusion.probe import Bandwidth
from shardfusion.topology import Degrees, _inner_kinds_spanning_nodes, outer_degree_within_nodes


PART_NAMES = {"full_params": "gathered params", "full_grads": "full gradient buffers",
              "secondary_params": "secondary shards (hpZ)", "activations": "activations",
              "comm_buffers": "collective buffers", "optimizer_step": "optimizer step temporaries",
              "other": "backward temporaries"}
"""How the report names the parts of ``shardfusion.live_memory.PARTS`` that are not kept from step to step."""


def _peak_line(r) -> str:
    """``transient T (a later step peaks at P): gathered params X (root a, blocks.6 b), full gradient buffers Y (...),
    ...``: a ``RankFigures``' transient peak by part (largest first) with the units whose full buffers are alive then;
    with ``bounds`` the other end's transient when it differs."""
    m, units = r.memory, r.transient_peak.get("units", {})
    parts = [(k, v) for k, v in r.transient_peak.get("parts", {}).items() if k in PART_NAMES and v]
    text = ", ".join(f"{PART_NAMES[k]} {_size(v)}" + (" (" + ", ".join(
        f"{name or 'root'} {_size(b)}" for name, b in sorted(units.get(k, {}).items())) + ")" if units.get(k) else "")
                     for k, v in sorted(parts, key=lambda kv: -kv[1]))
    slow = m.get("transient_slow")
    end = f" (none complete before waited for: {_size(slow)})" if slow is not None and slow != m["transient"] else ""
    steady = m["params"] + m["grads"] + m["optimizer"] + m["transient"]
    return (f"transient {_size(m['transient'])}{end} (a later step peaks at {_size(steady)}): "
            f"{text or 'nothing'}")


def _verdict(b: dict) -> str:
    """One line of ``shardfusion.dry_run.RankFigures.budget``'s dict: fits (with headroom) or does not fit (by how much), and the largest
    parts of the peak."""
    def judge(fits: bool, headroom: float) -> str:
        return f"fits, {_size(headroom)} headroom" if fits else f"does not fit by {_size(-headroom)}"

    names = PART_NAMES
    text = f"budget {_size(b['budget'])} per rank: {judge(b['fits'], b['headroom'])} at the peak"
    if "fits_slow" in b:
        text += f" (slow end: {judge(b['fits_slow'], b['headroom_slow'])})"
    largest = ", ".join(f"{names.get(k, k)} {_size(v)}" for k, v in b["largest"][:3] if v)
    return text + (f"; largest parts of the peak: {largest}" if largest else "")


def link_terms(candidate, bandwidth: Bandwidth) -> list[str]:
    """Two lines that split the cost model's serial time within and across nodes (``candidate``: a
    :class:`~shardfusion.plan.Candidate`) into its bandwidth term (bytes / bandwidth) and its latency term (ring steps
    x latency per step, the steps per op; see [Note: the outer-degree cost model] in ``shardfusion.plan``), and say
    which dominates: ``across nodes T ms = bytes B MB / 25.00 GB/s = t ms + latency N ring steps x 15 us = l ms
    (all_reduce N): latency-bound``."""
    lines = []
    for where, bw, latency in (("within", bandwidth.within, bandwidth.latency_within),
                               ("across", bandwidth.across, bandwidth.latency_across)):
        total_bytes, total_s, steps = 0.0, 0.0, {}
        for op, t in candidate.traffic.items():
            nbytes, seconds = getattr(t, f"{where}_bytes"), getattr(t, f"{where}_s")
            total_bytes += nbytes
            total_s += seconds
            # the model's time is bytes / bandwidth + steps x latency: the steps are what the bytes leave
            steps[op] = round((seconds - nbytes / bw) / latency) if latency else 0
        byte_s = total_bytes / bw
        n = sum(steps.values())
        bound = "latency-bound" if n * latency > byte_s else "bandwidth-bound"
        per_op = ", ".join(f"{op} {k:,}" for op, k in steps.items() if k)
        lines.append(f"{where} nodes {total_s * 1e3:.3f} ms = bytes {total_bytes / 1e6:.3f} MB / {bw / 1e9:.2f} GB/s "
                     f"= {byte_s * 1e3:.3f} ms + latency {n:,} ring steps x {latency * 1e6:g} us = "
                     f"{n * latency * 1e3:.3f} ms" + (f" ({per_op})" if per_op else "")
                     + (f": {bound}" if total_s else ""))
    return lines


def _layout_notes(degrees: Degrees, ranks_per_node: int) -> list[str]:
    """A warning when inner groups span nodes (the README's rule: inner within a node), with the degree that
    would keep them within one (:func:`~shardfusion.topology.outer_degree_within_nodes`)."""
    spanning = _inner_kinds_spanning_nodes(degrees, ranks_per_node)
    if not spanning:
        return []
    block = degrees.inner * degrees.sep * degrees.cp * degrees.mp
    nodes = -(-block // ranks_per_node)
    better = outer_degree_within_nodes(degrees, ranks_per_node)
    fix = (f"fsdp_outer_degree {better} keeps each within a node" if better is not None else
           f"no outer degree keeps them within a node: ep x sep x cp x mp = "
           f"{degrees.ep * degrees.sep * degrees.cp * degrees.mp} ranks do not divide the {ranks_per_node} of a node")
    return [f"the inner groups span nodes (inner {degrees.inner}: blocks of {block} ranks over "
            f"{nodes}{'+' if block % ranks_per_node else ''} nodes of {ranks_per_node}): their all-gathers and "
            f"reduce-scatters cross the network; {fix}"]
