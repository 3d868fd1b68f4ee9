"""Communication accounting: what each recorded collective is for, what it sends, how much crosses nodes.

[Note: communication accounting]
While a :class:`shardfusion.comm.CommCounter` is active, every collective shardfusion issues appends a
``CommRecord`` (``comm.py``). On top of its op, group ranks and logical size, a record carries:

- ``category``: what the collective is for, one of ``CATEGORIES``, from its op and the *kinds* of the group it ran
  on (``CATEGORY_RULES``). ``Topology`` names every group it creates with the kinds it serves
  (``comm.label_group``): one group object can serve several kinds (e.g. ``fsdp_inner`` and ``expert_inner`` when
  ep is 1), so a label is a tuple of kinds, ordered by ``LABEL_PRIORITY``. The reduce-scatter twins are
  ``fsdp_inner_reduce``, ``expert_inner_reduce`` and ``moe_sharding_reduce``; the default group is ``world``.
- ``wire_bytes``: the bytes this rank sends, by the ring algorithm (``G`` = group size, ``N`` = logical bytes)::

      all_gather      (G-1)/G * N     N = the gathered (full) tensor; every rank sends G-1 shards
      reduce_scatter  (G-1)/G * N     N = the (full) input; every rank sends G-1 partial shards
      all_reduce      2(G-1)/G * N    a reduce-scatter then an all-gather of N
      broadcast       (G-1)/G * N     a pipelined chain: G-1 ranks forward N; shared out over the G ranks
      all_to_all      exact           the input rows this rank sends to the other ranks (not the rows it keeps)

  These are the volumes of the bandwidth-optimal algorithms (NCCL's rings, gloo's ring and halving-doubling
  all-reduce send the same amounts); per rank, averaged over the group. A tree or a different algorithm moves about
  as much per rank but along other links.
- cross-node bytes (``cross_node_bytes``, computed per counter: it depends on ``ranks_per_node``): node of global
  rank ``r`` is ``r // ranks_per_node``. For the ring-modelled ops, the ring visits the group's ranks in group
  order (ascending for Topology's groups) and wraps around: of its ``G`` hops, ``k`` join ranks on different nodes,
  and ``wire_bytes * k / G`` is counted (every hop carries the same volume; the group's cross-node total is shared
  out equally over its ranks). With nodes made of consecutive ranks this is the node-aware ring that NCCL builds:
  ``k`` is the number of nodes the group spans (0 for one node). For the all-to-all: exactly the bytes sent to
  ranks on other nodes. ``ranks_per_node=None`` means one node: 0.
- ``wait_s``: host seconds the calling thread spent in the collective: the call itself, plus for an asynchronous
  one the time inside ``wait()`` on the handle ``comm`` returned. On CUDA (NCCL) collectives are enqueued on a
  stream and ``wait()`` only makes the current stream wait, so this is host time only, not the time the GPU spent
  communicating.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any, Optional

CATEGORIES = ("inner_all_gather", "inner_reduce_scatter", "replicate_all_reduce", "ep_all_to_all", "context_parallel",
              "other")
"""Accounting categories, in report order."""

INNER_KINDS = frozenset({"fsdp_inner", "expert_inner", "sharding", "moe_sharding",
                         "fsdp_inner_reduce", "expert_inner_reduce", "moe_sharding_reduce"})
"""Groups a flat buffer is sharded over (``moe_sharding``/``sharding`` when not split into outer x inner, e.g.
``expert_policy="shard"``), and their reduce-scatter twins."""

REPLICATE_KINDS = frozenset({"replicate", "fsdp_outer", "expert_outer", "dp", "data_parallel", "expert_data_parallel",
                             "dense_replicas", "expert_replicas", "expert_shard_replicate"})
"""Groups of ranks holding the same shard (``dp``: the replicate group of experts under ``expert_policy="shard"``;
``data_parallel`` / ``expert_data_parallel``: that of parameters kept whole by ``replicate_filter``)."""

CATEGORY_RULES: dict[str, tuple[frozenset, str]] = {
    "all_gather": (INNER_KINDS, "inner_all_gather"),
    "reduce_scatter": (INNER_KINDS, "inner_reduce_scatter"),
    "all_reduce": (REPLICATE_KINDS, "replicate_all_reduce"),
    "all_to_all": (frozenset({"ep"}), "ep_all_to_all"),
}
# "context_parallel" (the K/V all-gathers of context-parallel attention and their gradients' reduce-scatters) is
# given explicitly by the caller (shardfusion.context_parallel): the context group may be an inner group's too.
"""``op -> (kinds, category)``: a collective of ``op`` on a group serving any of ``kinds`` is in ``category``;
anything else (the clipping scalar over ``world``, broadcasts, unlabeled groups) is ``"other"``."""

LABEL_PRIORITY = ("fsdp_inner", "expert_inner", "moe_sharding", "sharding", "fsdp_inner_reduce",
                  "expert_inner_reduce", "moe_sharding_reduce", "replicate", "fsdp_outer", "expert_outer", "dp", "ep",
                  "data_parallel", "expert_data_parallel", "dense_replicas", "expert_replicas", "expert_shard_replicate",
                  "pp", "context", "sep", "cp", "mp", "world")
"""Order of the kinds in a group's label: the role the runtime uses the group for comes first."""

FIELDS = ("count", "bytes", "wire_bytes", "cross_node_bytes", "wait_s")
"""Figures per category in :func:`summarize`."""


def order_kinds(kinds: Iterable[str]) -> tuple[str, ...]:
    """``kinds`` without repeats, in ``LABEL_PRIORITY`` order (unknown kinds last, in their given order)."""
    unique = list(dict.fromkeys(kinds))
    rank = {k: i for i, k in enumerate(LABEL_PRIORITY)}
    return tuple(sorted(unique, key=lambda k: (rank.get(k, len(rank)), unique.index(k))))


def category(op: str, kinds: Iterable[str]) -> str:
    """The accounting category of ``op`` on a group serving ``kinds`` (see ``CATEGORY_RULES``)."""
    rule = CATEGORY_RULES.get(op)
    return rule[1] if rule is not None and rule[0].intersection(kinds) else "other"


def wire_bytes(op: str, group_size: int, nbytes: int, send_bytes: Optional[tuple[int, ...]] = None,
               index: int = 0) -> float:
    """Bytes one rank sends for ``op`` on a group of ``group_size`` (see [Note: communication accounting]).

    ``nbytes`` is the record's logical size; for ``"all_to_all"``, ``send_bytes`` are the bytes for each group rank
    and ``index`` is this rank's place in the group (its own share is not sent).

    Raises:
        ValueError: an unknown ``op``, or ``"all_to_all"`` without ``send_bytes``.
    """
    g = group_size
    if op in ("all_gather", "reduce_scatter", "broadcast"):
        return (g - 1) * nbytes / g
    if op == "all_reduce":
        return 2 * (g - 1) * nbytes / g
    if op == "all_to_all":
        if send_bytes is None:
            raise ValueError("wire_bytes: all_to_all needs send_bytes (bytes for each group rank)")
        return float(sum(b for j, b in enumerate(send_bytes) if j != index))
    raise ValueError(f"wire_bytes: unknown op {op!r}")


@functools.lru_cache(maxsize=64)  # a step's collectives run over a few groups (of up to a dry run's million ranks)
def ring_crossings(group_ranks: tuple[int, ...], ranks_per_node: Optional[int]) -> int:
    """Hops of the ring over ``group_ranks`` (in order, wrapping around) that join ranks on different nodes."""
    if ranks_per_node is None or len(group_ranks) < 2:
        return 0
    nodes = [r // ranks_per_node for r in group_ranks]
    return sum(a != b for a, b in zip(nodes, nodes[1:] + nodes[:1]))


def cross_node_bytes(record: Any, ranks_per_node: Optional[int]) -> float:
    """The part of ``record.wire_bytes`` that crosses nodes (see [Note: communication accounting])."""
    if ranks_per_node is None:
        return 0.0
    if record.send_bytes is not None:  # an all-to-all, or a reduce-scatter issued as one (gloo)
        node = record.rank // ranks_per_node
        return float(sum(b for peer, b in zip(record.group_ranks, record.send_bytes)
                         if peer // ranks_per_node != node))
    return record.wire_bytes * ring_crossings(record.group_ranks, ranks_per_node) / len(record.group_ranks)


def ranks_per_node_from_env() -> Optional[int]:
    """``LOCAL_WORLD_SIZE`` (set by torchrun and the elastic launcher) as an int, or None (one node) if unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def check_ranks_per_node(ranks_per_node: Optional[int]) -> Optional[int]:
    """``ranks_per_node`` itself if it is None or an int >= 1.

    Raises:
        ValueError: anything else.
    """
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                       or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node must be an int >= 1 or None (one node), got {ranks_per_node!r}")
    return ranks_per_node


def empty_summary() -> dict[str, dict[str, float]]:
    """``{category: {field: 0}}`` for every category and field."""
    return {c: {f: 0 if f in ("count", "bytes") else 0.0 for f in FIELDS} for c in CATEGORIES}


def summarize(records: Iterable[Any], ranks_per_node: Optional[int]) -> dict[str, dict[str, float]]:
    """Per category (every one of ``CATEGORIES``, in order): ``count``, ``bytes`` (logical), ``wire_bytes``,
    ``cross_node_bytes`` and ``wait_s`` summed over ``records``."""
    out = empty_summary()
    for r in records:
        row = out[r.category]
        row["count"] += 1
        row["bytes"] += r.nbytes
        row["wire_bytes"] += r.wire_bytes
        row["cross_node_bytes"] += cross_node_bytes(r, ranks_per_node)
        row["wait_s"] += r.wait_s
    return out
