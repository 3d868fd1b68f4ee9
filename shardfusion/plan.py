"""Choose the HSDP outer degree (``fsdp_outer_degree``) from a cost model: bytes, time and memory per candidate.

[Note: the outer-degree cost model]
A run with ``sharding`` ranks per fsdp group can split it as ``outer x inner`` for every ``outer`` that divides
``moe_sharding = sharding // ep``. :func:`plan` predicts, for each such candidate, what one optimizer step sends per
rank, how long that takes on the measured links, and how much memory each rank holds, then picks the fastest one
that fits the memory budget. Per unit and flat buffer (dense, expert) of ``P`` elements, padded as ``fully_shard``
pads them (``layout.build_layout`` at the candidate's inner degree: shards cut on row boundaries, a multiple of
``inner * align``, ``align = 16 bytes / shard element``; from the parameters' shapes when :class:`UnitSize` has them,
else ``numel`` rounded up to ``inner * align``), with ``m`` micro-batches per
step and the ring volumes of [Note: communication accounting] (``accounting.py``; ``G`` = group size, ``N`` =
logical bytes):

- all-gather over the inner group, ``N = P * gather bytes``, ``(G-1)/G * N`` per rank; ``m`` times per step, ``2m``
  for a unit resharded after forward (gathered again in backward); gather bytes: the param dtype's, or those of
  ``all_gather_dtype`` (bf16/fp16 2; int8 and fp8 ``1 + 4/256``: a byte and a scale per block of 256);
- with ``secondary_shard`` (hpZ) and an inner group that spans nodes, the backward's all-gather of a unit resharded
  after forward runs over the group's ``L`` ranks on the node instead: ``(L-1)/L * N``, all within the node (none
  for ``L = 1``), and the unit holds a copy of ``N / L`` bytes from its forward to its backward (memory part
  ``secondary``, every resharded unit's copy at once);
- reduce-scatter over the inner group, ``N = P * grad_comm bytes``, ``(G-1)/G * N``; ``m`` times per step;
  ``grad_comm_dtype="int8"``: ``1 + 4/256`` bytes (a byte and a scale per block of 256), sent as an all-to-all
  whatever the backend ([Note: quantized gradient reduce-scatter] in ``_runtime/grad_wire.py``), and the
  all-reduce below then in ``shard_dtype`` unless ``outer_comm_dtype``;
- all-reduce over the replicate group (``dp x outer``), ``N = P / inner * grad_comm bytes``, ``2(G-1)/G * N``; once
  per step.

A collective's bytes cross nodes in the share the accounting gives them: a ring over the group's ranks (in order,
wrapping around) has ``k`` of its ``G`` hops between nodes and ``k/G`` of the bytes cross (an inner group that spans
nodes sends that share across); gloo's reduce-scatter, an all-to-all (``comm.reduce_scatter``), sends each peer
``N/G`` directly, so the share is that of the peers on other nodes. Time of one collective with ``b`` bytes within
and ``c`` bytes across nodes: ``b / bandwidth.within + c / bandwidth.across`` plus ``steps * latency`` (``steps`` =
``G-1``, ``2(G-1)`` for the all-reduce; the across latency when the group spans nodes). The bandwidths are per rank
while every rank of a node sends at once (what :func:`measure_bandwidth` measures), so a node's shared link is
accounted for.

Time per step: everything serial, except the last backward of the step, whose replicate all-reduces run beside its
all-gathers and reduce-scatters (the overlapped all-reduce: each unit's all-reduce is issued once its
reduce-scatter is done). That backward takes ``max(I, A, I_w + A_w, I_x + A_x) + A_last``: ``I`` the inner
collectives' time (``I_w`` within and ``I_x`` across nodes), ``A`` the all-reduces but the last one (``A_w``,
``A_x``), ``A_last`` the all-reduce of the unit reduced last (the first of the list: the root unit); two streams
that use different links overlap fully, on a shared link they add up. With ``overlap=False`` it is ``I + A +
A_last``. Compute is not modelled: the time is the communication on the critical path of a step with no compute to
hide it (a communication-bound step).

With DiLoCo (``outer_every = H``, :class:`shardfusion.DiLoCo`) inner steps send no all-reduce; the outer step's
all-reduce of each buffer's pseudo-gradient (the same ``P / inner`` elements, in ``outer_comm_dtype``) runs after
the optimizer step, serially, once per H steps: its bytes and seconds count ``1/H`` in the per-step figures,
``step_s`` is the mean step, and ``sync_step_s`` the step that carries it (``1/outer_fragments`` of it when
streamed).

Memory per rank: sharded parameters (``P / inner`` elements each, in the shard dtype), sharded gradients (the
same), optimizer state (``optim_states`` values per element in ``optim_dtype``), and the full buffers of the units
being run: every unit not resharded after forward, the ``prefetch + 2`` largest resharded ones (the running one,
the prefetched ones, the previous one until its gradient lands) and the gradient buffers of the 2 largest units
(in the param dtype); a full buffer costs nothing when ``inner == 1`` and the dtypes agree (it is the shard).
Activations are not counted: pass them as ``other_bytes``. The sum is ``reshard_budget.memory_parts``, which
``fully_shard(..., reshard_policy="auto")`` uses to keep units gathered within a budget (under ``"auto"`` the plan
makes that choice at each candidate: [Note: reshard policy by budget] in ``shardfusion/reshard_budget.py``).

The idea of choosing the HSDP replication from a bandwidth model comes from the HSDP / ZeRO++ (hpZ) papers and
Megatron-FSDP's ``outer_dp_sharding_strategy`` discussion; the formulas and the code are ours.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from shardfusion._runtime import compress, grad_wire
from shardfusion.probe import (Bandwidth, _check_int, _check_seconds, check_bandwidth,  # noqa: F401 (re-exported)
                               measure_bandwidth)
from shardfusion.policies import EXPERT_POLICIES, RESHARD_FILTERS, RESHARD_POLICIES, MixedPrecisionPolicy
from shardfusion.reshard_budget import ReshardChoice, UnitBytes, _size, choose, memory_parts  # noqa: F401 (_size)
from shardfusion.topology import Degrees, _rank_grid

__all__ = ["Bandwidth", "Candidate", "Plan", "Traffic", "UnitSize", "default_memory_budget", "measure_bandwidth",
           "parse_bytes", "plan", "unit_sizes"]

ALIGN_BYTES = 16
"""Each parameter starts at a multiple of 16 bytes in its flat buffer (as ``fully_shard`` lays them out)."""

OPS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives of a step that the model counts, in table order."""


@dataclass(frozen=True)
class UnitSize:
    """The sizes of one unit, as :func:`plan` needs them.

    Attributes:
        name: the unit's name (``""`` for the root unit).
        numel: dense trainable elements, as laid out in its flat buffer (the alignment gaps between parameters
            included; :func:`unit_sizes` counts them so; plain element counts are fine too).
        expert_numel: expert elements held by one rank (this ep rank's experts; for a model that holds every
            expert, divide by ep).
        reshard_after_forward: whether its full buffers are freed after forward and gathered again in backward
            (the root unit never is).
        whole_shapes, expert_whole_shapes: the shapes of its dense / expert parameters that ``whole_params`` keeps
            whole on an owner rank (not in ``numel`` / ``expert_numel``): their owner-layout buffer is padded to
            equal shards, which :func:`plan` lays out for each candidate's inner degree (docs/whole-params.md).
        buffer_shapes, expert_buffer_shapes: per kind of element-sharded flat buffer of its dense / expert
            parameters (one per dtype), their shapes in flat order (:func:`unit_sizes` fills them). When given,
            :func:`plan` lays them out for each candidate's inner degree exactly as ``fully_shard`` does (rows kept
            whole, a kind split into row classes where one buffer would pad too much: ``layout.row_groups``;
            docs/shape-true-parameters.md) instead of rounding ``numel`` / ``expert_numel`` up.
    """

    name: str
    numel: int
    expert_numel: int = 0
    reshard_after_forward: bool = True
    whole_shapes: tuple = ()
    expert_whole_shapes: tuple = ()
    buffer_shapes: tuple = ()
    expert_buffer_shapes: tuple = ()


@dataclass(frozen=True)
class Traffic:
    """One kind of collective of one candidate, per rank and per optimizer step.

    Attributes:
        op: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        count: collectives issued per step (a mean: with DiLoCo the all-reduces of an outer step / H).
        within_bytes: bytes sent to ranks of the same node.
        across_bytes: bytes sent to other nodes.
        within_s: seconds on the links within a node (bytes / bandwidth, plus the latency of groups in one node).
        across_s: seconds on the links across nodes (bytes / bandwidth, plus the latency of groups that span nodes).
    """

    op: str
    count: float
    within_bytes: float
    across_bytes: float
    within_s: float
    across_s: float


@dataclass(frozen=True)
class Candidate:
    """The prediction for one outer degree.

    Attributes:
        outer: ``fsdp_outer_degree``.
        inner: dense inner degree, ``sharding // outer``.
        expert_inner: the degree expert buffers are sharded over (``moe_sharding // outer``, or ``moe_sharding``
            under ``expert_policy="shard"``).
        traffic: per op (``OPS``), what it sends per rank per step.
        within_bytes, across_bytes: per rank per step, all ops together.
        within_s, across_s: seconds per step on the links within / across nodes, all ops together.
        serial_s: ``within_s + across_s``: the step's communication with nothing overlapped.
        step_s: the predicted communication time per step (the last backward's all-reduces overlapped, see [Note:
            the outer-degree cost model]); the candidates are ranked by it.
        memory: bytes per rank by part: ``params``, ``grads``, ``optimizer``, ``unsharded``, ``other``, with
            ``secondary_shard`` where it acts ``secondary`` (hpZ's copies), and with
            DiLoCo ``outer`` (the snapshot and the momentum on the shards).
        memory_bytes: their sum.
        fits: ``memory_bytes <= max_memory_per_rank``.
        sync_step_s: with DiLoCo, the communication time of the step that carries an outer step (or a fragment's):
            the slowest step; ``step_s`` is the mean over H steps. None without DiLoCo.
        reshard: with ``reshard_policy="auto"``, the units kept gathered at this degree within the budget
            (:class:`shardfusion.reshard_budget.ReshardChoice`); None otherwise.
        spanning: the sharding groups whose ranks sit on more than one node (``"inner"``, ``"expert_inner"``):
            their all-gathers and reduce-scatters cross nodes (the table names them).
    """

    outer: int
    inner: int
    expert_inner: int
    traffic: dict
    within_bytes: float
    across_bytes: float
    within_s: float
    across_s: float
    serial_s: float
    step_s: float
    memory: dict
    memory_bytes: int
    fits: bool
    sync_step_s: Optional[float] = None
    reshard: Optional[ReshardChoice] = None
    spanning: tuple = ()
    secondary: str = ""
    """With ``secondary_shard``: what hpZ does at this degree (the backward's all-gathers within the node and the
    copies' bytes, or why it changes nothing); empty without it."""


@dataclass(frozen=True)
class Plan:
    """The result of :func:`plan`: every candidate, the one chosen and why.

    Attributes:
        candidates: one :class:`Candidate` per outer degree, ascending.
        chosen: the chosen candidate.
        reason: one sentence: why it was chosen.
        bandwidth: the links the times were computed with.
        max_memory_per_rank: the budget, bytes.
        world_size, local_world_size: the layout (``local_world_size`` ranks per node).
        micro_batches: micro-batches per optimizer step.
        suggestion: where the chosen candidate's sharding groups span nodes and ZeRO++'s three options are not all
            on: the same degree with all three (``all_gather_dtype="int8"``, ``secondary_shard=True``,
            ``grad_comm_dtype="int8"``; docs/secondary-shard.md and the quantized pages): its bytes across nodes and its step's communication time
            against the chosen one's (whether it fits the budget too). Empty otherwise.
    """

    candidates: tuple
    chosen: Candidate
    reason: str
    bandwidth: Bandwidth
    max_memory_per_rank: int
    world_size: int
    local_world_size: int
    micro_batches: int
    suggestion: str = ""

    @property
    def fsdp_outer_degree(self) -> int:
        """The chosen outer degree."""
        return self.chosen.outer

    def table(self) -> str:
        """The printed table: per candidate the predicted bytes and seconds per step within and across nodes (per
        rank), the step's communication time, the memory per rank and whether it fits; then the choice and why."""
        nodes = self.world_size // self.local_world_size
        lines = [f"fsdp_outer_degree cost model: world {self.world_size} = {nodes} node{'s' * (nodes != 1)} x "
                 f"{self.local_world_size} ranks; {self.micro_batches} micro-batch"
                 f"{'es' * (self.micro_batches != 1)} per step; memory budget {_size(self.max_memory_per_rank)} "
                 f"per rank",
                 f"measured per rank: {self.bandwidth.describe()}",
                 "outer inner | within MB/step  across MB/step | within s  across s    step s | memory/rank  fits",
                 ]
        for c in self.candidates:
            mark = "  <- chosen" if c is self.chosen else ""
            if c.reshard is not None:
                mark = f"  kept {len(c.reshard.kept)}/{sum(c.reshard.decided)}{mark}"
            lines.append(f"{c.outer:5d} {c.inner:5d} | {c.within_bytes / 1e6:14.3f} {c.across_bytes / 1e6:15.3f} | "
                         f"{c.within_s:8.4f} {c.across_s:9.4f} {c.step_s:9.4f} | {_size(c.memory_bytes):>11}  "
                         f"{'yes' if c.fits else 'no':>4}{mark}"
                         + (f"  ({' and '.join(c.spanning)} groups span nodes)" if c.spanning else "")
                         + (f"  [{c.secondary}]" if c.secondary else ""))
        lines.append(f"chosen: {self.reason}")
        if self.suggestion:
            lines.append(f"suggested: {self.suggestion}")
        return "\n".join(lines)


# ---- unit sizes from a model -----------------------------------------------------------------------------------------
def unit_sizes(model: nn.Module, *, units: Optional[Sequence[type]] = None, comm_unit_size: Optional[int] = None,
               reshard_policy: str = "after_forward", reshard_filter="all",
               expert_filter: Optional[Callable[[str, nn.Parameter], bool]] = None,
               whole_params: Optional[Callable[[str, nn.Parameter], bool]] = None) -> list[UnitSize]:
    """The :class:`UnitSize` of every unit ``fully_shard(model, ..., units=units, comm_unit_size=comm_unit_size,
    reshard_policy=..., reshard_filter=..., expert_filter=...)`` would make, the root unit first, without sharding
    anything (the model may be on the meta device; no process group is needed).

    Each parameter goes to the unit ``fully_shard`` gives it (a tied one to the lowest common ancestor's); a unit's
    ``numel`` / ``expert_numel`` are its dense / expert parameters laid out as in its flat buffers (each aligned to
    16 bytes of its dtype; the tail padding, which depends on the inner degree, is added by :func:`plan`). Frozen
    parameters and those a ``replicate_filter`` would keep whole are counted as trainable dense ones (the model
    overestimates them). The experts are the ones the model holds: a model built without an ep group holds all of
    them (divide ``expert_numel`` by ep). Parameters ``whole_params`` chooses are listed by shape in
    ``whole_shapes`` / ``expert_whole_shapes`` instead. ``buffer_shapes`` / ``expert_buffer_shapes`` hold the
    shapes of each flat buffer, so that :func:`plan` pads them at each inner degree as ``fully_shard`` does.

    Raises:
        ValueError: ``model`` is not a module or is already sharded; bad ``units``, ``comm_unit_size``,
            ``whole_params``, ``reshard_policy`` or ``reshard_filter`` (as ``fully_shard`` raises them).
    """
    from shardfusion._runtime import wrap  # the unit rules of fully_shard itself
    from shardfusion._runtime.layout import build_layout
    from shardfusion._runtime.state import is_sharded

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        raise ValueError(f"model ({type(model).__name__}) is already sharded: plan before fully_shard")
    if whole_params is not None and not callable(whole_params):
        raise ValueError(f"whole_params must be None or a callable (name, param) -> bool, got {whole_params!r}")
    options = wrap.WrapOptions(None, MixedPrecisionPolicy(), None, True, expert_filter, "replicate", 1,
                               reshard_policy, reshard_filter)
    wrap._check_units(units, comm_unit_size)
    if reshard_policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard_policy must be one of {RESHARD_POLICIES}, got {reshard_policy!r}")
    if not (reshard_filter in RESHARD_FILTERS or callable(reshard_filter)):
        raise ValueError(f"reshard_filter must be 'all', 'none' or a callable (name, module) -> bool, "
                         f"got {reshard_filter!r}")
    if units is None and comm_unit_size is None:
        units = wrap.default_units(model)
    wrap._check_unit_classes(model, units)
    specs = wrap.unit_specs(model, options, units, comm_unit_size)
    per_unit = wrap._assign_params(model, wrap._owning_unit(model, specs), len(specs))
    is_expert = expert_filter or wrap.marked_expert
    out = []
    for (name, _modules, reshard), params in zip(specs, per_unit):
        sizes = {False: 0, True: 0}
        whole: dict[bool, list] = {False: [], True: []}
        buffers: dict[bool, list] = {False: [], True: []}
        for expert in (False, True):
            by_dtype: dict[torch.dtype, list] = {}
            for pname, p, _ in params:
                if bool(is_expert(pname, p)) != expert:
                    continue
                if whole_params is not None and whole_params(pname, p):
                    whole[expert].append(tuple(p.shape))
                else:
                    by_dtype.setdefault(p.dtype, []).append((pname, tuple(p.shape)))
            for dtype, members in by_dtype.items():
                align = max(1, ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size())
                layout = build_layout([n for n, _ in members], [s for _, s in members], 1, align)
                sizes[expert] += layout.padded_numel
                buffers[expert].append(tuple(s for _, s in members))
        out.append(UnitSize(name, sizes[False], sizes[True], bool(reshard), tuple(whole[False]), tuple(whole[True]),
                            tuple(buffers[False]), tuple(buffers[True])))
    return out


def _padded(shapes: tuple, count: int, align: int) -> list[int]:
    """The padded elements of each flat buffer that element-sharded parameters of ``shapes`` (one kind) make over
    ``count`` shards, as ``fully_shard`` lays them out (``layout.row_groups``, then ``layout.build_layout`` each)."""
    from shardfusion._runtime.layout import build_layout, row_groups

    return [build_layout([str(i) for i in g], [shapes[i] for i in g], count, align).padded_numel
            for g in row_groups(shapes, count, align)]


def _owner_padded(shapes: tuple, count: int, align: int, load: list[int]) -> int:
    """The padded elements of the owner layout of ``shapes`` over ``count`` shards (``load``: the cost each shard
    owns from earlier units, updated), as ``fully_shard(..., whole_params=...)`` lays it out."""
    from shardfusion._runtime.layout import build_carried_owner_layout

    return build_carried_owner_layout([str(i) for i in range(len(shapes))], shapes, count, align, load).padded_numel


# ---- the cost model ----------------------------------------------------------------------------------------------------
class _Group:
    """One kind of group of one candidate: its size, the share of a ring's / an all-to-all's bytes that crosses
    nodes (averaged over every rank of every group of the kind), and whether it spans nodes."""

    def __init__(self, grid: torch.Tensor, local_world_size: int) -> None:
        # grid: (groups, size) int64, each row a group's ranks ascending (topology._rank_grid); vectorized, as a dry
        # run plans worlds of a million ranks
        groups, self.size = grid.shape
        ranks = groups * self.size
        nodes = grid // local_world_size  # (groups, size)
        self.ring_across = int((nodes != nodes.roll(-1, dims=1)).sum()) / ranks  # accounting.ring_crossings' hops
        # (rank, peer) pairs of a group on different nodes: G^2 - sum over its nodes of (the node's ranks)^2
        _, per_node = torch.unique(torch.arange(groups)[:, None] * (int(nodes.max()) + 1) + nodes, return_counts=True)
        off = ranks * self.size - int((per_node * per_node).sum())
        self.spans = bool((nodes[:, 0] != nodes[:, -1]).any())  # ascending rows: first and last on other nodes
        self.node_size = int(per_node.min())  # L: a group's ranks on one node (hpZ's node slice)
        self.a2a_across = off / (ranks * (self.size - 1)) if self.size > 1 else 0.0


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _check_dtype(name: str, value) -> torch.dtype:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{name} must be a floating-point torch.dtype, got {value!r}")
    return value


def _outer_element_size(outer_comm_dtype, grad_comm_dtype: torch.dtype) -> float:
    """Bytes per element of the replicate all-reduce: ``"int8"`` sends one byte and a 4-byte scale per block of
    ``compress.DEFAULT_BLOCK_SIZE`` (block padding ignored); None: ``grad_comm_dtype``'s size."""
    value = compress.validate_outer_comm_dtype(outer_comm_dtype)
    if value == "int8":
        return 1 + 4 / compress.DEFAULT_BLOCK_SIZE
    return _element_size(grad_comm_dtype if value is None else value)


def _gather_element_size(all_gather_dtype, param_dtype: torch.dtype) -> float:
    """Bytes per element of the parameter all-gather on the wire (``MixedPrecisionPolicy.all_gather_dtype``):
    ``"int8"`` and fp8 one byte and a 4-byte scale per block of ``compress.DEFAULT_BLOCK_SIZE`` (block padding
    ignored), bf16/fp16 2, None ``param_dtype``'s size.

    Raises:
        ValueError: a value ``MixedPrecisionPolicy`` refuses (naming ``all_gather_dtype``).
    """
    MixedPrecisionPolicy(all_gather_dtype=all_gather_dtype)  # validates
    if all_gather_dtype is None:
        return _element_size(param_dtype)
    if all_gather_dtype == "int8" or all_gather_dtype is torch.float8_e4m3fn:
        return 1 + 4 / compress.DEFAULT_BLOCK_SIZE
    return _element_size(all_gather_dtype)


def plan(model_or_units: Union[nn.Module, Sequence[UnitSize]], *, world_size: int, local_world_size: int,
         bandwidth: Bandwidth, max_memory_per_rank: int, micro_batches: int = 1, dp: int = 1, ep: int = 1,
         units: Optional[Sequence[type]] = None, comm_unit_size: Optional[int] = None,
         reshard_policy: str = "after_forward", prefetch: int = 1, expert_policy: str = "replicate",
         shard_dtype: torch.dtype = torch.float32, param_dtype: Optional[torch.dtype] = None,
         grad_comm_dtype: Union[None, torch.dtype, str] = None,
         outer_comm_dtype: Union[None, torch.dtype, str] = None,
         all_gather_dtype: Union[None, torch.dtype, str] = None, optim_dtype: torch.dtype = torch.float32,
         optim_states: int = 2, other_bytes: int = 0, overlap: bool = True, backend: str = "nccl",
         outer_degrees: Optional[Sequence[int]] = None, prefer: Optional[int] = None,
         tie_tolerance: float = 0.01,
         whole_params: Optional[Callable[[str, nn.Parameter], bool]] = None,
         outer_every: Optional[int] = None, outer_fragments: int = 1, secondary_shard: bool = False) -> Plan:
    """Predict bytes, time and memory per step for every outer degree and choose one (see [Note: the outer-degree
    cost model] above for every formula).

    Choice: the candidate with the smallest predicted ``step_s`` among those that fit ``max_memory_per_rank``;
    candidates within ``tie_tolerance`` (relative) of it tie, and the smallest outer degree among them wins (more
    sharding, less memory). ``prefer`` (e.g. the degree of a run being resumed, for an exact resume) is chosen
    instead whenever it fits. Deterministic: ranks that pass equal arguments choose the same degree.

    Args:
        model_or_units: a model (not yet sharded; meta is fine), split into units by ``units`` /
            ``comm_unit_size`` / ``reshard_policy`` as ``fully_shard`` would (:func:`unit_sizes`), or the units'
            :class:`UnitSize` list (the first one is reduced last: the root unit).
        world_size: ranks in the job.
        local_world_size: ranks per node (consecutive global ranks share a node); it must divide ``world_size``.
        bandwidth: the measured links (:func:`measure_bandwidth`).
        max_memory_per_rank: the memory budget of one rank, bytes (> 0).
        micro_batches: forward/backward passes per optimizer step (each reduce-scatters its gradients).
        dp, ep: the data-parallel replicas (``sharding = world_size // dp``) and the expert-parallel degree, as in
            :class:`shardfusion.Topology`.
        units, comm_unit_size, reshard_policy: as in ``fully_shard`` (units and comm_unit_size only for a model; a
            ``UnitSize`` carries its own ``reshard_after_forward``). ``reshard_policy="auto"``: at each candidate
            the units marked ``reshard_after_forward`` (for a model: those ``fully_shard`` would let the policy
            decide) are kept gathered where they fit ``max_memory_per_rank`` (``other_bytes`` and DiLoCo's state
            counted), as ``fully_shard(..., reshard_policy="auto", memory_budget=max_memory_per_rank)`` keeps them
            ([Note: reshard policy by budget] in ``shardfusion.reshard_budget``); ``Candidate.reshard`` says which.
        prefetch: units gathered ahead of the running one (``fully_shard``'s ``prefetch``).
        expert_policy: ``fully_shard``'s: ``"replicate"`` or ``"shard"``.
        shard_dtype: the parameters' own dtype (the shards, the sharded gradients).
        param_dtype, grad_comm_dtype: as in :class:`shardfusion.MixedPrecisionPolicy` (all-gathers in
            ``param_dtype``; reduce-scatters and the all-reduce in ``grad_comm_dtype``); default ``shard_dtype`` and
            ``param_dtype``. ``grad_comm_dtype="int8"``: the reduce-scatters in 1 + 4/256 bytes per element, as an
            all-to-all; the all-reduce in ``shard_dtype``.
        outer_comm_dtype: ``fully_shard``'s: the wire format of the replicate all-reduce (None: ``grad_comm_dtype``;
            a float dtype; ``"int8"``: 1 + 4/256 bytes per element, the int8 values and a scale per block).
        all_gather_dtype: :class:`shardfusion.MixedPrecisionPolicy`'s: the wire format of the parameter
            all-gathers (None: ``param_dtype``; bf16/fp16: 2 bytes per element; ``"int8"`` and
            ``torch.float8_e4m3fn``: 1 + 4/256). The gathered buffers in memory stay in ``param_dtype``.
        optim_dtype, optim_states: the optimizer's state per element: AdamW's 2 values in fp32 by default.
        other_bytes: memory per rank the model does not see (activations, workspace), added to every candidate.
        overlap: whether the last backward's all-reduces overlap its other collectives (the default runtime).
        backend: ``"nccl"`` (ring reduce-scatter) or ``"gloo"`` (reduce-scatter as an all-to-all).
        outer_degrees: the candidates to consider (default: every divisor of ``sharding // ep``).
        prefer: a degree to keep whenever it fits (it must be a candidate).
        tie_tolerance: relative difference of ``step_s`` under which candidates tie (>= 0).
        whole_params: ``fully_shard``'s (only for a model): the parameters it chooses are laid out in owner layouts
            for each candidate's inner degree, so their padding counts in the bytes and the memory.
        outer_every: None (every step: HSDP's all-reduce each step, overlapped with the last backward) or H >= 1:
            DiLoCo (:class:`shardfusion.DiLoCo`): the replicate all-reduce of the pseudo-gradients once every H
            steps, after the optimizer step (not overlapped), in ``outer_comm_dtype``; ``step_s`` is then the mean
            over H steps, ``sync_step_s`` the step that carries it, and the memory holds the snapshot and the
            momentum (2 x the shard, in ``shard_dtype``), plus one fragment's pseudo-gradients at the outer step.
            The pseudo-gradients travel in ``outer_comm_dtype``, or the shard's dtype when it is None.
        outer_fragments: with ``outer_every``: streaming DiLoCo's fragments (1 .. H): each outer step's bytes are
            spread over that many steps (``sync_step_s`` carries 1/fragments of them).
        secondary_shard: ``fully_shard``'s (hpZ, docs/secondary-shard.md): where a candidate's sharding group spans
            nodes, the backward all-gather of a unit resharded after forward runs over its ``L`` ranks on the node
            (``(L-1)/L`` of the same bytes, none across nodes), and each such unit's copy (``P * gather bytes /
            L``) counts in the memory part ``secondary``; ``Candidate.secondary`` says what it does at that degree.

    Returns:
        A :class:`Plan`.

    Raises:
        ValueError: a bad argument (named, with its value): ``world_size`` not divisible by ``local_world_size`` or
            the degrees (as :class:`shardfusion.topology.Degrees` says), no units or a negative size, a
            non-positive bandwidth or budget, an outer degree that does not divide ``sharding // ep``; and when no
            candidate fits, one naming ``max_memory_per_rank`` and the smallest need.
    """
    world_size = _check_int("world_size", world_size, 1)
    local = _check_int("local_world_size", local_world_size, 1)
    if world_size % local:
        raise ValueError(f"local_world_size({local}) must divide world_size({world_size}): nodes of equal size")
    budget = _check_int("max_memory_per_rank", max_memory_per_rank, 1)
    m = _check_int("micro_batches", micro_batches, 1)
    prefetch = _check_int("prefetch", prefetch, 0)
    optim_states = _check_int("optim_states", optim_states, 0)
    other_bytes = _check_int("other_bytes", other_bytes, 0)
    tie_tolerance = _check_seconds("tie_tolerance", tie_tolerance, positive=False)
    if outer_every is not None:
        outer_every = _check_int("outer_every", outer_every, 1)
        fragments = _check_int("outer_fragments", outer_fragments, 1)
        if fragments > outer_every:
            raise ValueError(f"outer_fragments({fragments}) must be <= outer_every({outer_every})")
    elif outer_fragments != 1:
        raise ValueError(f"outer_fragments({outer_fragments!r}) needs outer_every (DiLoCo)")
    if outer_every is not None and expert_policy == "shard":
        raise ValueError("outer_every (DiLoCo) with expert_policy='shard': DiLoCo needs every buffer replicated over "
                         "the replicate group; use expert_policy='replicate'")
    check_bandwidth(bandwidth)
    if expert_policy not in EXPERT_POLICIES:
        raise ValueError(f"expert_policy must be one of {EXPERT_POLICIES}, got {expert_policy!r}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if reshard_policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard_policy must be one of {RESHARD_POLICIES}, got {reshard_policy!r}")
    shard_dtype = _check_dtype("shard_dtype", shard_dtype)
    param_dtype = _check_dtype("param_dtype", param_dtype if param_dtype is not None else shard_dtype)
    if isinstance(grad_comm_dtype, str):
        MixedPrecisionPolicy(grad_comm_dtype=grad_comm_dtype)  # validates: the message names the accepted values
    reduce_int8 = grad_wire.is_quantized(grad_comm_dtype)  # the reduce-scatter block-quantized, the rest in shard_dtype
    grad_comm_dtype = _check_dtype("grad_comm_dtype", shard_dtype if reduce_int8 else (
        grad_comm_dtype if grad_comm_dtype is not None else param_dtype))
    optim_dtype = _check_dtype("optim_dtype", optim_dtype)
    base = Degrees(world_size=world_size, dp=dp, ep=ep)  # the degree errors, named
    moe_sharding = base.moe_sharding

    if isinstance(model_or_units, nn.Module):
        sizes = unit_sizes(model_or_units, units=units, comm_unit_size=comm_unit_size, reshard_policy=reshard_policy,
                           whole_params=whole_params)
    else:
        sizes = list(model_or_units)
        if units is not None or comm_unit_size is not None or whole_params is not None:
            raise ValueError("units, comm_unit_size and whole_params apply to a model, not to a list of UnitSize")
    if not sizes or not all(isinstance(u, UnitSize) for u in sizes):
        raise ValueError(f"model_or_units must be a model or a non-empty list of UnitSize, got {model_or_units!r}")
    for u in sizes:
        if min(u.numel, u.expert_numel) < 0:
            raise ValueError(f"unit {u.name!r}: numel({u.numel}) and expert_numel({u.expert_numel}) must be >= 0")
    if not any(u.numel or u.expert_numel or u.whole_shapes or u.expert_whole_shapes for u in sizes):
        raise ValueError("the units hold no elements: nothing to plan")

    valid = [o for o in range(1, moe_sharding + 1) if moe_sharding % o == 0]
    if outer_degrees is None:
        degrees = valid
    else:
        degrees = sorted({_check_int("outer_degrees", o, 1) for o in outer_degrees})
        bad = [o for o in degrees if o not in valid]
        if bad or not degrees:
            raise ValueError(f"outer_degrees {list(outer_degrees)} must be divisors of moe_sharding({moe_sharding}) = "
                             f"sharding({base.sharding}) // ep({ep}): choose from {valid}")
    if prefer is not None and prefer not in degrees:
        raise ValueError(f"prefer({prefer!r}) is not a candidate outer degree; candidates: {degrees}")

    sizes_b = {"shard": _element_size(shard_dtype), "param": _element_size(param_dtype),
               "comm": 1 + 4 / compress.DEFAULT_BLOCK_SIZE if reduce_int8 else _element_size(grad_comm_dtype),
               "optim": _element_size(optim_dtype),
               "gather": _gather_element_size(all_gather_dtype, param_dtype),
               # DiLoCo all-reduces the pseudo-gradients in the shard's dtype unless a wire format is given
               "outer": _outer_element_size(outer_comm_dtype,
                                            shard_dtype if outer_every is not None else grad_comm_dtype)}
    align = max(1, ALIGN_BYTES // sizes_b["shard"])
    model = _Model(sizes, world_size, local, dp, ep, m, prefetch, expert_policy, sizes_b, align, optim_states,
                   shard_dtype != param_dtype, other_bytes, bandwidth, overlap, backend,
                   (outer_every, outer_fragments) if outer_every is not None else None,
                   auto=reshard_policy == "auto", secondary=bool(secondary_shard),
                   reduce_all_to_all=reduce_int8)
    candidates = tuple(model.candidate(o, budget) for o in degrees)
    chosen = _choose(candidates, budget, prefer, tie_tolerance, bandwidth, world_size, local, m)
    on = (sizes_b["gather"] == sizes_b["comm"] == 1 + 4 / compress.DEFAULT_BLOCK_SIZE and model.secondary)
    if not chosen.chosen.spanning or on:
        return chosen
    return replace(chosen, suggestion=_zeropp_suggestion(model, chosen.chosen, budget, outer_comm_dtype is None
                                                         and outer_every is None))


def _zeropp_suggestion(model: "_Model", chosen: Candidate, budget: int, outer_follows_grads: bool) -> str:
    """``Plan.suggestion``: ``chosen``'s degree re-evaluated with ZeRO++'s three options on (the int8 all-gather,
    hpZ, the int8 reduce-scatter; the replicate all-reduce then in the shard's dtype unless ``outer_comm_dtype``)."""
    q = 1 + 4 / compress.DEFAULT_BLOCK_SIZE
    alt = copy.copy(model)
    alt.nbytes = {**model.nbytes, "gather": q, "comm": q}
    if outer_follows_grads:
        alt.nbytes["outer"] = model.nbytes["shard"]
    alt.secondary, alt.reduce_all_to_all = True, True
    c = alt.candidate(chosen.outer, budget)
    return (f"{' and '.join(chosen.spanning)} groups span nodes: with all_gather_dtype='int8', secondary_shard=True, "
            f"grad_comm_dtype='int8' (ZeRO++; --all-gather-dtype int8 --secondary-shard --grad-comm-dtype int8) "
            f"outer {c.outer}: across {chosen.across_bytes / 1e6:.3f} -> {c.across_bytes / 1e6:.3f} MB/step, step "
            f"{chosen.step_s:.4f} -> {c.step_s:.4f} s, memory {_size(c.memory_bytes)} per rank "
            f"({'fits' if c.fits else 'does not fit'}); gathers and gradients then carry int8 rounding "
            f"(docs/quantized-all-gather.md, docs/quantized-reduce-scatter.md)")


class _Model:
    """The cost model of one :func:`plan` call; ``candidate(outer, budget)`` evaluates one outer degree."""

    def __init__(self, sizes, world_size, local, dp, ep, m, prefetch, expert_policy, nbytes, align, optim_states,
                 cast, other_bytes, bandwidth, overlap, backend, diloco=None, auto: bool = False,
                 secondary: bool = False, reduce_all_to_all: bool = False) -> None:
        self.sizes, self.world_size, self.local, self.dp, self.ep, self.m = sizes, world_size, local, dp, ep, m
        self.prefetch, self.expert_policy, self.nbytes, self.align = prefetch, expert_policy, nbytes, align
        self.optim_states, self.cast, self.other_bytes = optim_states, cast, other_bytes
        self.bw, self.overlap, self.backend = bandwidth, overlap, backend
        self.diloco = diloco  # (H, fragments), or None: the all-reduce every step
        self.auto = auto  # reshard_policy="auto": the units kept gathered are chosen per candidate within the budget
        self.secondary = secondary  # secondary_shard (hpZ): backward all-gathers within the node where groups span
        self.reduce_all_to_all = reduce_all_to_all or backend == "gloo"  # reduce-scatters sent as all-to-alls

    def _groups(self, outer: int) -> dict[str, _Group]:
        kinds = {"inner": "fsdp_inner", "replicate": "replicate"}
        if self.expert_policy == "shard":
            kinds.update(expert_inner="moe_sharding", expert_replicate="dp")
        else:
            kinds.update(expert_inner="expert_inner", expert_replicate="replicate")
        degrees = Degrees(world_size=self.world_size, dp=self.dp, ep=self.ep, fsdp_outer_degree=outer)
        return {key: _Group(_rank_grid(degrees, kind), self.local) for key, kind in kinds.items()}

    def _cost(self, op: str, nbytes: float, group: _Group) -> tuple[float, float, float, float]:
        """(within bytes, across bytes, within s, across s) of one collective of ``nbytes`` logical bytes."""
        g = group.size
        wire = (2 if op == "all_reduce" else 1) * (g - 1) / g * nbytes
        share = group.a2a_across if (op == "reduce_scatter" and self.reduce_all_to_all) else group.ring_across
        across, within = wire * share, wire * (1 - share)
        steps = (2 if op == "all_reduce" else 1) * (g - 1)
        within_s = (within / self.bw.within if within else 0.0) + (0.0 if group.spans else steps * self.bw.latency_within)
        across_s = (across / self.bw.across if across else 0.0) + (steps * self.bw.latency_across if group.spans else 0.0)
        return within, across, within_s, across_s

    def _unit_buffers(self, groups: dict[str, _Group]) -> list[list[tuple[int, _Group, _Group]]]:
        """Per unit, its flat buffers as ``(padded elements, shard group, replicate group)``, laid out as
        ``fully_shard`` lays them out at these groups' degrees (empty buffers left out)."""
        owner_load = {"inner": [0] * groups["inner"].size,  # carried over units, as wrap does
                      "expert_inner": [0] * groups["expert_inner"].size}
        out = []
        for u in self.sizes:
            buffers = []
            for numel, shapes, whole, shard_kind, rep_kind in (
                    (u.numel, u.buffer_shapes, u.whole_shapes, "inner", "replicate"),
                    (u.expert_numel, u.expert_buffer_shapes, u.expert_whole_shapes, "expert_inner",
                     "expert_replicate")):
                g_shard = groups[shard_kind]
                if shapes:
                    buffers.extend((padded, g_shard, groups[rep_kind]) for b in shapes
                                   for padded in _padded(b, g_shard.size, self.align))
                elif numel:
                    buffers.append((_round_up(numel, g_shard.size * self.align), g_shard, groups[rep_kind]))
                if whole:
                    padded = _owner_padded(whole, g_shard.size, self.align, owner_load[shard_kind])
                    buffers.append((padded, g_shard, groups[rep_kind]))
            out.append([b for b in buffers if b[0]])
        return out

    def _unit_bytes(self, name: str, buffers: list[tuple[int, _Group, _Group]]) -> UnitBytes:
        """The memory facts of one unit's buffers (every element trainable, in the shard dtype; full buffers and
        full gradients in the param dtype; a full buffer costs nothing when it is the shard: one shard, no cast)."""
        nb = self.nbytes
        shard = sum(padded // g.size for padded, g, _ in buffers)
        full = sum(padded * nb["param"] for padded, g, _ in buffers if g.size > 1 or self.cast)
        gather = sum((Fraction((g.size - 1) * padded * nb["param"], g.size) for padded, g, _ in buffers
                      if g.size > 1), Fraction(0))
        secondary = sum(math.ceil(padded * nb["gather"] / g.node_size) for padded, g, _ in buffers
                        if self._hpz(g)) if self.secondary else 0
        return UnitBytes(name, shard * nb["shard"], shard * nb["shard"], shard, full,
                         sum(padded * nb["param"] for padded, _, _ in buffers), gather, secondary)

    def _hpz(self, group: _Group) -> bool:
        """Whether hpZ moves the backward all-gathers of a buffer sharded over ``group`` into the node."""
        return self.secondary and group.size > 1 and group.spans

    def _node_cost(self, nbytes: float, group: _Group) -> tuple[float, float, float, float]:
        """(within bytes, across bytes, within s, across s) of hpZ's all-gather of ``nbytes`` over the ``L`` ranks of
        ``group`` on one node (nothing for ``L = 1``: a local copy)."""
        n = group.node_size
        within = (n - 1) / n * nbytes
        return within, 0.0, (within / self.bw.within + (n - 1) * self.bw.latency_within) if n > 1 else 0.0, 0.0

    def _reshard(self, facts: list[UnitBytes], budget: int, outer_bytes: int) -> Optional[ReshardChoice]:
        """With ``reshard_policy="auto"``: the units kept gathered within ``budget`` (the choice of
        ``shardfusion.reshard_budget``, activations and DiLoCo's state counted as given); else None."""
        if not self.auto:
            return None
        flags = [u.reshard_after_forward for u in self.sizes]
        return choose(facts, flags, flags, budget, prefetch=self.prefetch, optim_states=self.optim_states,
                      optim_bytes=self.nbytes["optim"], other_bytes=self.other_bytes + outer_bytes)

    def candidate(self, outer: int, budget: int) -> Candidate:
        """The :class:`Candidate` of ``outer`` (a divisor of moe_sharding): bytes and seconds per step per op
        within and across nodes, the overlapped step time, memory per rank in bytes, and whether it fits ``budget``
        (bytes); the formulas are those of [Note: the outer-degree cost model]."""
        groups = self._groups(outer)
        per_unit = self._unit_buffers(groups)
        facts = [self._unit_bytes(u.name, b) for u, b in zip(self.sizes, per_unit)]
        shard_elems = sum(f.optim_elems for f in facts)
        outer_bytes = 0
        if self.diloco is not None and any(g.size > 1 for b in per_unit for _, _, g in b):
            # replicas to synchronise: DiLoCo's snapshot and momentum on the shards, and at an outer step the
            # pseudo-gradients of one fragment
            outer_bytes = (2 * shard_elems + math.ceil(shard_elems / self.diloco[1])) * self.nbytes["shard"]
        choice = self._reshard(facts, budget, outer_bytes)
        reshard = list(choice.reshard_after_forward) if choice else [u.reshard_after_forward for u in self.sizes]
        total, last_bwd_inner, reduces = self._traffic(per_unit, reshard)
        sync_step = None
        if self.diloco is not None and total["all_reduce"][0]:  # DiLoCo: the all-reduces once per H steps, serial
            every, fragments = self.diloco
            outer_s = total["all_reduce"][3] + total["all_reduce"][4]
            inner_s = sum(total[op][3] + total[op][4] for op in OPS if op != "all_reduce")
            sync_step = inner_s + outer_s / fragments
            total["all_reduce"] = [v / every for v in total["all_reduce"]]
        within_s = sum(total[op][3] for op in OPS)
        across_s = sum(total[op][4] for op in OPS)
        serial = within_s + across_s
        with_reduce = [i for i, r in enumerate(reduces) if r[0] or r[1]]
        if sync_step is not None:
            step = serial  # inner steps, plus the outer step's all-reduces spread over the H steps
        elif self.overlap and with_reduce:
            last = with_reduce[0]  # reduce order is the reverse unit order: the first unit with an all-reduce
            ar_w = sum(r[0] for i, r in enumerate(reduces) if i != last)
            ar_x = sum(r[1] for i, r in enumerate(reduces) if i != last)
            iw, ix = last_bwd_inner
            phase = max(iw + ix, ar_w + ar_x, iw + ar_w, ix + ar_x) + sum(reduces[last])
            step = serial - (iw + ix) - sum(total["all_reduce"][3:5]) + phase
        else:
            step = serial
        traffic = {op: Traffic(op, total[op][0] if sync_step is not None else int(total[op][0]), *total[op][1:])
                   for op in OPS}
        memory = memory_parts(facts, reshard, prefetch=self.prefetch, optim_states=self.optim_states,
                              optim_bytes=self.nbytes["optim"], other_bytes=self.other_bytes)
        if sync_step is not None:
            memory["outer"] = outer_bytes
        need = sum(memory.values())
        return Candidate(outer=outer, inner=groups["inner"].size, expert_inner=groups["expert_inner"].size,
                         traffic=traffic, within_bytes=sum(t.within_bytes for t in traffic.values()),
                         across_bytes=sum(t.across_bytes for t in traffic.values()), within_s=within_s,
                         across_s=across_s, serial_s=serial, step_s=step, memory=memory, memory_bytes=need,
                         fits=need <= budget, sync_step_s=sync_step, reshard=choice,
                         secondary=self._secondary_note(groups, reshard, memory),
                         spanning=tuple(k for k in ("inner", "expert_inner")
                                        if groups[k].spans and groups[k].size > 1
                                        and (k == "inner" or any(u.expert_numel or u.expert_whole_shapes
                                                                 for u in self.sizes))))

    def _secondary_note(self, groups: dict, reshard: list[bool], memory: dict) -> str:
        """``Candidate.secondary``: what hpZ does at this degree, or why it changes nothing."""
        if not self.secondary:
            return ""
        if not any(self._hpz(groups[k]) for k in ("inner", "expert_inner")):
            return "secondary_shard changes nothing: no sharding group spans nodes"
        if not memory.get("secondary"):
            return "secondary_shard changes nothing: no unit is resharded after forward"
        return f"hpZ: backward all-gathers within the node, copies {_size(memory['secondary'])}"

    def _traffic(self, per_unit: list, reshard: list[bool]) -> tuple[dict, list[float], list[list[float]]]:
        """Per op ``[count, within B, across B, within s, across s]`` per step; the last backward's inner
        collectives' (within s, across s); and each unit's all-reduce (within s, across s), in unit order."""
        nb = self.nbytes
        total = {op: [0, 0.0, 0.0, 0.0, 0.0] for op in OPS}
        last_bwd_inner = [0.0, 0.0]
        reduces = []

        def add(op: str, cost: tuple, times: int) -> None:
            row = total[op]
            row[0] += times
            for i in range(4):
                row[i + 1] += cost[i] * times

        for buffers, resharded in zip(per_unit, reshard):
            unit_reduce = [0.0, 0.0]
            for padded, g_shard, g_rep in buffers:
                if g_shard.size > 1 and resharded and self._hpz(g_shard):  # the backward's within the node
                    ag = self._cost("all_gather", padded * nb["gather"], g_shard)
                    node = self._node_cost(padded * nb["gather"], g_shard)
                    rs = self._cost("reduce_scatter", padded * nb["comm"], g_shard)
                    add("all_gather", ag, self.m)
                    add("all_gather", node, self.m if g_shard.node_size > 1 else 0)
                    add("reduce_scatter", rs, self.m)
                    last_bwd_inner[0] += node[2] + rs[2]
                    last_bwd_inner[1] += node[3] + rs[3]
                elif g_shard.size > 1:
                    gathers = 2 if resharded else 1
                    ag = self._cost("all_gather", padded * nb["gather"], g_shard)
                    rs = self._cost("reduce_scatter", padded * nb["comm"], g_shard)
                    add("all_gather", ag, gathers * self.m)
                    add("reduce_scatter", rs, self.m)
                    last_bwd_inner[0] += (gathers - 1) * ag[2] + rs[2]
                    last_bwd_inner[1] += (gathers - 1) * ag[3] + rs[3]
                if g_rep.size > 1:
                    ar = self._cost("all_reduce", padded // g_shard.size * nb["outer"], g_rep)
                    add("all_reduce", ar, 1)
                    unit_reduce[0] += ar[2]
                    unit_reduce[1] += ar[3]
            reduces.append(unit_reduce)
        return total, last_bwd_inner, reduces


def _choose(candidates: tuple, budget: int, prefer: Optional[int], tie: float, bandwidth: Bandwidth,
            world_size: int, local: int, m: int) -> Plan:
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise ValueError(f"max_memory_per_rank({budget} bytes = {_size(budget)}) is less than every outer degree "
                         f"needs: the smallest need is {least.memory_bytes} bytes = {_size(least.memory_bytes)} "
                         f"(outer {least.outer}, inner {least.inner}); raise the budget, shard over more ranks, or "
                         f"use a lower-precision dtype")
    others = f"; does not fit: {', '.join(f'outer {c.outer} ({_size(c.memory_bytes)})' for c in candidates if not c.fits)}"
    others = others if len(fitting) < len(candidates) else ""
    best = min(fitting, key=lambda c: (c.step_s, c.outer))
    if prefer is not None and any(c.outer == prefer for c in fitting):
        chosen = next(c for c in fitting if c.outer == prefer)
        reason = (f"outer {chosen.outer} (inner {chosen.inner}), kept as asked (prefer={prefer}, e.g. the run being "
                  f"resumed) since it fits {_size(budget)}: {chosen.step_s:.4f} s predicted per step; the fastest is "
                  f"outer {best.outer} at {best.step_s:.4f} s{others}")
    else:
        tied = [c for c in fitting if c.step_s <= best.step_s * (1 + tie)]
        chosen = min(tied, key=lambda c: c.outer)
        rest = sorted((c for c in fitting if c is not chosen), key=lambda c: c.step_s)
        reason = (f"outer {chosen.outer} (inner {chosen.inner}): the fastest predicted step among the "
                  f"{len(fitting)} degree{'s' * (len(fitting) != 1)} that fit {_size(budget)} per rank "
                  f"({chosen.step_s:.4f} s")
        if rest:
            reason += f"; next: outer {rest[0].outer}, {rest[0].step_s:.4f} s"
        reason += ")"
        if len(tied) > 1:
            reason += (f"; outer {', '.join(str(c.outer) for c in tied if c is not chosen)} within "
                       f"{tie:.0%} of it: the smaller outer degree shards more, so needs less memory")
        reason += others
    return Plan(candidates=candidates, chosen=chosen, reason=reason, bandwidth=bandwidth,
                max_memory_per_rank=budget, world_size=world_size, local_world_size=local, micro_batches=m)


# ---- budgets and byte counts -------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """Bytes from a size such as ``8GB`` (10^9), ``512MiB`` (2^20), ``1.5GiB``, ``4096`` or ``4096B`` (case does
    not matter).

    Raises:
        ValueError: not a number with one of the suffixes B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, or not > 0.
    """
    s = str(text).strip().replace(" ", "")
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    number, unit = s[:i], s[i:].lower()
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a size in bytes > 0 such as 8GB, 512MiB or 4096, got {text!r}")
    return int(value * _UNITS[unit])


def default_memory_budget(device: Union[torch.device, str], local_world_size: int) -> int:
    """The default memory budget of one rank: the CUDA device's total memory, or on the CPU the host's physical
    memory divided by ``local_world_size`` (the ranks that share it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(1, int(local_world_size))
