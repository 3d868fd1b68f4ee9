"""The bytes each variant of ``benchmarks/zeropp.py`` should send over the link, per node and optimizer step.

The layout: 2 nodes x 2 ranks (ranks 0, 1 on node 0; 2, 3 on node 1), one sharding group of all 4 ranks. ``P_b``:
the blocks' parameter elements, ``P_r``: the root unit's (embeddings, final norm; the tied head counts once),
``P = P_b + P_r``, ``T``: the tied embedding's elements. fp32: 4 bytes per element; the int8 wire (qwZ, qgZ): 1 byte
per element and one fp32 scale per block of ``B = 256`` elements, ``q = 1 + 4/B`` bytes per element (about
``(1 + 4/256) / 4`` of fp32). Padding of the shards to whole rows is left out (a few hundred elements).

The algorithms gloo runs, on this ring of 4 ranks over 2 nodes (2 of its 4 hops cross):

- **all-gather** of ``N`` bytes (a ring): each rank sends ``3/4 N`` to its neighbour; one rank per node has its
  neighbour on the other node: ``3/4 N`` per node.
- **reduce-scatter of shardfusion** (an all-to-all of the ``N/4`` chunks on gloo): each rank sends 2 of its 3
  chunks to the other node: ``2 x 2 x N/4 = N`` per node.
- **reduce-scatter of FSDP2 and DeepSpeed** (gloo runs it as a ring all-reduce of the full input): ``2 x 3/4 N``
  per rank over the ring, half of its hops crossing: ``3/2 N`` per node.

Per variant (``fwd``: the forward's gathers, ``bwd``: the backward's, ``rs``: the gradients' reduce-scatter):

- ``sf-fsdp``: fwd ``3/4 x 4P``, bwd ``3/4 x 4P_b`` (the root stays gathered from forward to backward), rs ``4P``.
- ``sf-qwz`` (``--all-gather-dtype int8``): the gathers at ``q`` bytes per element: fwd ``3/4 qP``, bwd
  ``3/4 qP_b``, rs ``4P``.
- ``sf-hpz`` (``--secondary-shard``): the backward gathers from the secondary shard within the node: bwd 0.
- ``sf-qgz`` (``--grad-comm-dtype int8``): the reduce-scatter's all-to-all in int8: rs ``qP``. A hierarchical
  scheme (within the node at full precision, then across quantized) would send half: ``qP/2``.
- ``sf-zeropp``: fwd ``3/4 qP``, bwd 0, rs ``qP``.
- ``fsdp2``: fwd ``3/4 x 4P``, bwd ``3/4 x 4P_b`` (its root is not resharded after forward), rs ``3/2 x 4P``.
- ``ds-zero3``: every module's parameters gathered for its forward and again for its backward, the tied weight
  once per use: fwd and bwd ``3/4 x 4(P + T)`` each, rs ``3/2 x 4P``.
- ``ds-hpz`` (``zero_hpz_partition_size`` 2): the first forward use over all ranks, the rest (tied reuse,
  backward) from the secondary partition in the node: fwd ``3/4 x 4P``, bwd 0, rs ``3/2 x 4P``.
- ``ds-qwz``, ``ds-qgz``, ``ds-zeropp``: what DeepSpeed would send with its quantized kernels (int8 with a scale per
  group, taken as ``q``): gathers at ``q``; for ``ds-qgz`` its all-to-all reduce-scatter, hierarchical (within the
  node, then across): rs ``qP/2``. DeepSpeed refuses them on CPU (no quantizer kernel), so nothing is measured.
"""

from __future__ import annotations

from typing import Optional

BLOCK = 256
"""Elements per int8 block (``shardfusion._runtime.compress.DEFAULT_BLOCK_SIZE``): one fp32 scale each."""
Q = 1 + 4 / BLOCK
"""Bytes per element of the int8 wire, scales included."""

# variant: (bytes per element of the gathers, whether the backward gathers cross, reduce-scatter bytes per element
#           per node (P elements), whether the tied weight is gathered per use, formula)
_TERMS: dict[str, tuple[float, bool, float, bool, str]] = {
    "sf-fsdp": (4, True, 4, False, "3/4 x 4(P + P_b) + 4P"),
    "sf-qwz": (Q, True, 4, False, "3/4 x q(P + P_b) + 4P"),
    "sf-hpz": (4, False, 4, False, "3/4 x 4P + 4P"),
    "sf-qgz": (4, True, Q, False, "3/4 x 4(P + P_b) + qP"),
    "sf-zeropp": (Q, False, Q, False, "3/4 x qP + qP"),
    "fsdp2": (4, True, 6, False, "3/4 x 4(P + P_b) + 3/2 x 4P"),
    "ds-zero3": (4, True, 6, True, "3/4 x 4 x 2(P + T) + 3/2 x 4P"),
    "ds-hpz": (4, False, 6, False, "3/4 x 4P + 3/2 x 4P"),
    "ds-qwz": (Q, True, 6, True, "3/4 x q x 2(P + T) + 3/2 x 4P"),
    "ds-qgz": (4, True, Q / 2, True, "3/4 x 4 x 2(P + T) + qP/2"),
    "ds-zeropp": (Q, False, Q / 2, False, "3/4 x qP + qP/2"),
}


def formula(variant: str) -> Optional[str]:
    """The variant's link bytes per node and step as a formula (the module doc's symbols), None if unknown."""
    terms = _TERMS.get(variant)
    return None if terms is None else terms[4]


def link_bytes(variant: str, root: int, blocks: int, tied: int) -> Optional[dict[str, float]]:
    """Bytes one node sends over the link per step for ``variant`` (module doc): ``{"fwd_all_gather",
    "bwd_all_gather", "reduce_scatter", "total"}``; ``root``, ``blocks``: parameter elements of the root unit and of
    all blocks; ``tied``: the tied embedding's elements. None for a variant without a theory."""
    terms = _TERMS.get(variant)
    if terms is None:
        return None
    gather, bwd_crosses, rs, per_use, _ = terms
    p = root + blocks
    fwd = 0.75 * gather * (p + (tied if per_use else 0))
    if not bwd_crosses:
        bwd = 0.0
    elif variant.startswith("ds-"):  # every module re-gathered, the tied weight per use
        bwd = 0.75 * gather * (p + tied)
    else:  # the root unit stays gathered from forward to backward
        bwd = 0.75 * gather * blocks
    out = {"fwd_all_gather": fwd, "bwd_all_gather": bwd, "reduce_scatter": rs * p}
    out["total"] = sum(out.values())
    return out
