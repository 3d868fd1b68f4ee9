"""A secondary copy of a unit's gathered parameters, sharded within the node (``fully_shard(..., secondary_shard=True)``).

[Note: secondary shard]
When a flat buffer's sharding group (``G`` ranks) spans nodes, each of its all-gathers crosses the slow link: once
in forward and, with ``reshard_policy="after_forward"``, once more in backward. ZeRO++'s hpZ (Wang et al., 2023,
"ZeRO++: Extremely Efficient Collective Communication for Giant Model Training") keeps, after the forward's
all-gather, a second copy of the gathered parameters sharded over the ranks of the node only, so the backward's
all-gather stays within the node. Here, per flat buffer (written from the paper's description):

- the *node slice* of a sharding group: its ranks on one node (node of global rank ``r``: ``r // ranks_per_node``,
  ``Topology.ranks_per_node``), ``L`` of them, in ascending rank order; every node slice of every group of the
  buffer's kind (``fsdp_inner``, ``expert_inner`` or ``moe_sharding``) must have the same ``L`` (else
  ``ValueError``). One process group per node slice, created once per topology, on every rank, in one order
  (:func:`node_plans`), labelled ``<kind>_node`` for the accounting;
- the *wire copy* of a forward's all-gather: what arrived, in the all-gather's wire format: the full buffer itself
  (``(P,)`` in ``param_dtype``) when ``all_gather_dtype`` is None, else the gathered packed rows (``(G * row,)``
  int8 for int8 / fp8, ``(G * S,)`` bf16 / fp16: ``gather_wire.gather_buffer``);
- ``copy``  # (W / L,) the ``j``-th ``1/L`` of the wire copy (``j``: this rank's index in its node slice), in the
  wire format. Made by a forward's all-gather of a unit that reshards after forward (taken from the wire copy when
  it arrives, or from the full buffer at the reshard when the wire is ``param_dtype``), with grad enabled, outside
  backward. Alive until the next all-gather of the buffer: in backward that all-gather is the node slice's
  all-gather of the copies (each rank's ``j``-th part, in slice order: the wire copy again, bitwise), dequantized
  into the full buffer as the forward's was, so the backward computes with bitwise the forward's parameters; the
  copy is freed when it completes. Any other gather (a forward) or a reshard that does not keep it (end of backward,
  a forward without grad, a load) frees it.

Each forward makes the copy again: the parameters do not change between a forward and its backward, but they may
between micro-batches' forwards only through the user (the optimizer steps once per step), and a copy made from the
gather that just ran is valid by construction; keeping it across micro-batches would save ``m - 1`` cross-node
all-gathers per step of ``m`` micro-batches but hold every unit's copy through the backward and the optimizer step.

Nothing changes when no group of the kind spans nodes, for a buffer kept whole, or for a unit not resharded after
forward (it keeps its full buffer until backward: nothing to gather again). ``L = 1`` (every rank of a group on its
own node) keeps the whole wire copy: the backward's gather is a local copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from shardfusion import comm
from shardfusion._runtime import gather_wire
from shardfusion._runtime.gloo_device import shared_gloo_device

SHARD_KINDS = ("fsdp_inner", "expert_inner", "moe_sharding")
"""The kinds of group a flat buffer is sharded over (``wrap._GroupPlan.groups``)."""


@dataclass(frozen=True)
class NodePlan:
    """This rank's node slice of its group of one kind: ``group`` (None for a slice of one rank), ``index`` (this
    rank's place in the slice), ``size`` (``L``: ranks of the group on each node)."""

    group: Optional[dist.ProcessGroup]
    index: int
    size: int


def node_slices(groups: list[list[int]], ranks_per_node: int) -> list[list[int]]:
    """Each group's ranks split by node (``r // ranks_per_node``), in group order then node order."""
    out = []
    for ranks in groups:
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(r // ranks_per_node, []).append(r)
        out.extend(sorted(by_node.values()))
    return out


def _slices_of(topology, kind: str) -> tuple[list[list[int]], int, int]:
    """The node slices of every group of ``kind`` (only this rank's group on a fake group: a dry run), ``L`` and the
    groups' size ``G``.

    Raises:
        ValueError: slices of different sizes (``secondary_shard`` named with the sizes and the node layout).
    """
    if comm.is_fake():
        groups = [dist.get_process_group_ranks(topology.get_group(kind))]
    else:
        groups = topology.group_ranks(kind)
    slices = node_slices(groups, topology.ranks_per_node)
    sizes = sorted({len(s) for s in slices})
    if len(sizes) > 1:
        raise ValueError(f"secondary_shard=True: the {kind} groups (of {len(groups[0])} ranks) have {sizes} ranks on "
                         f"a node with ranks_per_node={topology.ranks_per_node} ({topology.describe()}); the copy "
                         f"within the node needs the same number of a group's ranks on every node")
    return slices, sizes[0], len(groups[0])


def check(topology, kinds: tuple[str, ...] = SHARD_KINDS) -> None:
    """Raise the :func:`_slices_of` error of any of ``kinds`` now, with no collective (``fully_shard``'s checks)."""
    for kind in kinds:
        _slices_of(topology, kind)


def node_plans(topology, kinds: tuple[str, ...] = SHARD_KINDS) -> dict[str, Optional[NodePlan]]:
    """Per kind, this rank's :class:`NodePlan`, or None where no group of the kind spans nodes (the option changes
    nothing there). Collective over the world the first time for a layout (the groups are created on every rank in
    one order, ``dist.new_subgroups_by_enumeration``); cached on ``topology``.

    Raises:
        ValueError: as :func:`_slices_of`, on every rank (before any group is created).
    """
    cache = topology.__dict__.setdefault("_secondary_shard_groups", {})
    found = {kind: _slices_of(topology, kind) for kind in kinds}
    plans: dict[str, Optional[NodePlan]] = {}
    for kind in kinds:
        slices, size, group_size = found[kind]
        if size == group_size:
            plans[kind] = None  # no group spans nodes
            continue
        key = tuple(map(tuple, slices))
        if key not in cache:
            cache[key] = _make_groups(slices, size, topology) if size > 1 else None
            if cache[key] is not None:
                comm.label_group(cache[key], f"{kind}_node")
        mine = next(s for s in slices if topology.rank in s)
        plans[kind] = NodePlan(cache[key], mine.index(topology.rank), size)
    return plans


def _make_groups(slices: list[list[int]], size: int, topology) -> dist.ProcessGroup:
    if comm.is_fake():  # this rank's slice only, as Topology makes a dry run's groups
        return dist.new_group(next(s for s in slices if topology.rank in s), timeout=topology.timeout)
    with shared_gloo_device():  # its loop threads as the topology's: [Note: gloo loop threads as batch work]
        group, _ = dist.new_subgroups_by_enumeration(slices, timeout=topology.timeout)
    return group


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def copy_bytes(padded_numel: int, group_size: int, node_size: int, wire: gather_wire.AllGatherDtype,
               element_size: int) -> int:
    """Bytes of one rank's copy: ``1/L`` of the wire copy, ``P * element_size`` (``param_dtype``'s) for ``wire``
    None, ``G * gather_wire.row_bytes(P / G)`` for a wire format."""
    if wire is None:
        return padded_numel * element_size // node_size
    return group_size * gather_wire.row_bytes(padded_numel // group_size, wire, element_size) // node_size


class SecondaryShard:
    """The secondary copy of one flat buffer (see [Note: secondary shard] at the top of this file).

    Args:
        plan: this rank's node slice of the buffer's sharding group.
        group_size: ``G``, the sharding group's size.
        shard_numel: ``S``, elements of each rank's shard.
        wire: the buffer's ``all_gather_dtype`` (None: ``param_dtype``).
        unit_name: for error messages.
    """

    def __init__(self, plan: NodePlan, group_size: int, shard_numel: int, wire: gather_wire.AllGatherDtype,
                 unit_name: str = "") -> None:
        self.plan, self.group_size, self.shard_numel, self.wire = plan, group_size, shard_numel, wire
        self.unit_name = unit_name
        self.copy: Optional[torch.Tensor] = None  # (W / L,) in the wire format
        self.armed = False  # the gather in flight, or last completed, may leave a copy at the reshard
        self._from_copy = False  # the gather in flight is the node slice's all-gather of the copies

    def _part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part (a view) of a wire copy ``whole``."""
        n = whole.numel() // self.plan.size
        return whole[self.plan.index * n:(self.plan.index + 1) * n]

    def begin_gather(self, keep: bool) -> bool:
        """An all-gather of the buffer starts: True when it is to come from the copy (the copy exists and this is a
        backward); else the copy is freed, and the gather is armed to leave one when ``keep`` (the unit reshards
        after forward), grad is enabled and this is no backward."""
        backward = in_backward()
        if self.copy is not None and backward:
            self._from_copy, self.armed = True, False
            return True
        self.copy, self._from_copy = None, False
        self.armed = bool(keep) and torch.is_grad_enabled() and not backward
        return False

    def all_gather(self, full: torch.Tensor) -> tuple[object, Optional[torch.Tensor]]:
        """Issue the node slice's all-gather of the copies (asynchronous): into ``full`` for a ``param_dtype`` wire,
        else into a new receive buffer (returned, to be dequantized as the forward's). ``(work, buffer)``; work
        None for a slice of one (a local copy, done)."""
        out = full if self.wire is None else gather_wire.gather_buffer(self.shard_numel, self.group_size, self.wire,
                                                                       full.device)
        work = comm.all_gather(out, self.copy, self.plan.group, async_op=True, category="inner_all_gather")
        return work, (None if self.wire is None else out)

    def gathered(self, wire_copy: Optional[torch.Tensor]) -> None:
        """An all-gather completed (``wire_copy``: what arrived in a wire format, None for ``param_dtype``): the copy
        it came from is freed; an armed forward gather in a wire format keeps its part."""
        if self._from_copy:
            self.copy, self._from_copy = None, False
        elif self.armed and wire_copy is not None:
            self.copy = self._part(wire_copy).clone()  # (W / L,)

    def resharded(self, full: Optional[torch.Tensor], keep: bool) -> None:
        """The buffer reshards (``full``: its full buffer while still alive, else None): with ``keep`` after an
        armed gather the copy stays (taken from ``full`` now for a ``param_dtype`` wire); otherwise it is freed."""
        if keep and self.armed:
            if self.copy is None and self.wire is None and full is not None:
                self.copy = self._part(full).clone()  # (P / L,) param_dtype
        else:
            self.copy = None
        self.armed = False

    @property
    def nbytes(self) -> int:
        """Bytes of the copy held now (0 when none)."""
        return 0 if self.copy is None else self.copy.numel() * self.copy.element_size()
