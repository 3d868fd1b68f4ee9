"""What ``fully_shard`` does between its arguments and the :class:`~shardfusion._runtime.scheduler.Scheduler`.

Its checks (all before any collective, so a bad argument raises the same error on every rank), the units (by class
or packed up to ``comm_unit_size``), the unit owning each parameter (a tied parameter: the unit of the lowest common
ancestor of the modules registering it), the process groups each kind of flat buffer uses, and the
:class:`~shardfusion._runtime.flat_buffer.FlatBuffer` of each kind in each unit. Absorbing the units of earlier
``fully_shard`` calls is in ``nested.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion._runtime import materialize, secondary_shard
from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.flat_buffer import FlatBuffer
from shardfusion._runtime.layout import build_carried_owner_layout, build_layout, row_groups
from shardfusion._runtime.optimizer_hook import REPLACED_PARAMS
from shardfusion._runtime.state import is_sharded, sharded_ancestor
from shardfusion._runtime.unit import Unit
from shardfusion.policies import EXPERT_POLICIES, RESHARD_FILTERS, RESHARD_POLICIES, MixedPrecisionPolicy

ReshardFilter = Union[str, Callable[[str, nn.Module], bool]]
ALIGN_BYTES = 16  # each parameter starts at a multiple of 16 bytes in its flat buffer
EP_GROUP_ATTR = "ep_group"
"""A module with this attribute (a process group, or ``None``: it holds every expert) is an expert-parallel layer,
such as :class:`shardfusion.moe.MoE`: it must dispatch over the topology's ep group, which places the experts."""
# Containers are never called, so forward hooks on them never fire: never a unit, always descended into.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class WrapOptions:
    """The options of one ``fully_shard`` call, kept on its state (a later call on an ancestor compares them)."""

    topology: object
    mp_policy: MixedPrecisionPolicy
    replicate_filter: Optional[Callable]
    broadcast_buffers: bool
    expert_filter: Optional[Callable]
    expert_policy: str
    prefetch: int
    reshard_policy: str  # per unit: may differ between nested calls
    reshard_filter: ReshardFilter  # per unit: may differ between nested calls
    outer_comm_dtype: object = None  # validated: None, a float dtype or "int8" (compress.validate_outer_comm_dtype)
    whole_params: Optional[Callable] = None  # (name, param) -> bool: whole in one owner rank's shard
    secondary_shard: bool = False  # hpZ: [Note: secondary shard] in secondary_shard.py


# Options a nested call must share with the call that absorbs it (the reshard policy is per unit and may differ).
MUST_AGREE = ("topology", "mp_policy", "replicate_filter", "broadcast_buffers", "expert_filter", "expert_policy",
              "prefetch", "outer_comm_dtype", "whole_params", "secondary_shard")


# ---- checks ----------------------------------------------------------------------------------------------------------
def check_args(model, options: WrapOptions, units, comm_unit_size) -> None:
    """The arguments of ``fully_shard`` (see its Raises)."""
    topology = options.topology
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not hasattr(topology, "get_fsdp_inner_group"):
        raise ValueError(f"topology must be a shardfusion.Topology, got {type(topology).__name__}")
    if is_sharded(model):
        raise ValueError(f"model ({type(model).__name__}) is already sharded by fully_shard")
    if sharded_ancestor(model) is not None:
        root, name = sharded_ancestor(model)
        raise ValueError(f"model ({type(model).__name__}) is submodule {name!r} of a {root} that is already sharded "
                         "by fully_shard: shard the submodules first, then their ancestor (a call on a module "
                         "absorbs the already sharded modules inside it)")
    if not isinstance(options.mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a shardfusion.MixedPrecisionPolicy, got {options.mp_policy!r}")
    _check_units(units, comm_unit_size)
    if options.reshard_policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard_policy must be one of {RESHARD_POLICIES}, got {options.reshard_policy!r}")
    for name in ("replicate_filter", "expert_filter", "whole_params"):
        value = getattr(options, name)
        if value is not None and not callable(value):
            raise ValueError(f"{name} must be None or a callable (name, param) -> bool, got {value!r}")
    if not (options.reshard_filter in RESHARD_FILTERS or callable(options.reshard_filter)):
        raise ValueError(f"reshard_filter must be 'all', 'none' or a callable (name, module) -> bool, "
                         f"got {options.reshard_filter!r}")
    if options.expert_policy not in EXPERT_POLICIES:
        raise ValueError(f"expert_policy must be one of {EXPERT_POLICIES}, got {options.expert_policy!r}")
    if not isinstance(options.secondary_shard, bool):
        raise ValueError(f"secondary_shard must be True or False, got {options.secondary_shard!r}")
    if options.secondary_shard:
        secondary_shard.check(topology)
    prefetch = options.prefetch
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")


def _check_units(units, comm_unit_size) -> None:
    if units is not None:
        if isinstance(units, type) or not all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
            raise ValueError(f"units must be a tuple of nn.Module classes, got {units!r}")
        containers = [u.__name__ for u in units if issubclass(u, _CONTAINERS)]
        if containers:
            raise ValueError(f"units {containers} are containers, whose forward never runs; name the classes of "
                             "the modules they hold instead")
        if units and comm_unit_size is not None:
            raise ValueError(f"give units ({units!r}) or comm_unit_size ({comm_unit_size}), not both")
    if comm_unit_size is not None and (isinstance(comm_unit_size, bool) or not isinstance(comm_unit_size, int)
                                       or comm_unit_size <= 0):
        raise ValueError(f"comm_unit_size must be a positive int (elements), got {comm_unit_size!r}")


def check_model(model: nn.Module, options: WrapOptions, units: Optional[Sequence[type]]) -> None:
    """The model itself: its expert-parallel layers, unit classes that match a module, the parameters
    ``whole_params`` chooses (meta tensors: see ``materialize.check_initializable``)."""
    topology = options.topology
    _check_expert_parallel_layers(model, topology)
    _check_unit_classes(model, units)
    for name, p in model.named_parameters():
        tp.check_param(name, p, topology)
    if options.whole_params is not None:
        _check_whole_params(model, options)


def _check_whole_params(model: nn.Module, options: WrapOptions) -> None:
    """A parameter ``whole_params`` chooses is neither kept whole on every rank by ``replicate_filter`` nor a
    tensor-parallel piece (a matrix optimizer would see a piece of the matrix as if it were the matrix)."""
    for name, p in model.named_parameters():
        if not options.whole_params(name, p):
            continue
        if options.replicate_filter is not None and options.replicate_filter(name, p):
            raise ValueError(f"parameter {name!r} {tuple(p.shape)} is chosen by both replicate_filter (whole on every "
                             "rank) and whole_params (whole on one owner rank): choose one")
        if tp.is_tensor_parallel(p):
            raise ValueError(f"whole_params chooses {name!r}, a tensor-parallel DTensor (global shape "
                             f"{tuple(p.shape)}, local piece {tuple(tp.local(p).shape)}): its owner would hold a piece, "
                             "not the matrix; leave tensor-parallel parameters out of whole_params")


def _check_expert_parallel_layers(model: nn.Module, topology) -> None:
    """Every expert-parallel layer (a module with an :data:`EP_GROUP_ATTR` attribute) dispatches over the topology's
    ep group: experts are placed by it."""
    ep_ranks = dist.get_process_group_ranks(topology.get_group("ep"))
    for name, m in model.named_modules():
        if not hasattr(m, EP_GROUP_ATTR):
            continue
        group = getattr(m, EP_GROUP_ATTR)
        ranks = [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)
        if comm.group_size(group) != topology.ep or ranks != ep_ranks:
            raise ValueError(f"{type(m).__name__} {name!r} dispatches over ranks {ranks} (ep {comm.group_size(group)}) "
                             f"but the topology's ep group is {ep_ranks} (ep {topology.ep}); build it with "
                             "ep_group=topology.get_group('ep')")


def _check_unit_classes(model: nn.Module, units: Optional[Sequence[type]]) -> None:
    """Some class in ``units`` matches a module of ``model``: with none (a class of the same name from another
    module, a wrong import), the whole model would silently be one unit, gathered whole. A tuple shared by several
    models may hold classes that one of them lacks."""
    if not units:
        return
    present = {type(m) for m in model.modules()}
    if not any(issubclass(t, u) for u in units for t in present):
        raise ValueError(f"units {[u.__name__ for u in units]} match no module of {type(model).__name__} (its "
                         f"module classes: {sorted({t.__name__ for t in present})}); pass the classes of its "
                         "layers, e.g. the block class the model itself uses")


# ---- units -----------------------------------------------------------------------------------------------------------
def default_units(model: nn.Module) -> Optional[tuple[type, ...]]:
    """The unit classes of a model that names its own: a Hugging Face ``PreTrainedModel`` lists in
    ``_no_split_modules`` the class names of the layers that must not be split across devices (its decoder layers),
    as accelerate's FSDP integration reads them; those classes become units. ``None`` for other models."""
    names = getattr(model, "_no_split_modules", None)
    if not names or isinstance(names, str):
        return None
    names = set(names)
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    return tuple(sorted(classes, key=lambda c: c.__name__)) or None


def reshards_after_forward(options: WrapOptions, name: str, module: nn.Module) -> bool:
    """Whether the unit ``name`` (first module ``module``) frees its full buffers after forward under ``options``
    (under ``"auto"``: whether the policy decides it; it starts resharded, ``shardfusion.reshard_budget``)."""
    if options.reshard_policy == "after_backward":
        return False
    if options.reshard_filter in RESHARD_FILTERS:
        return options.reshard_filter == "all"
    return bool(options.reshard_filter(name, module))


def unit_specs(model: nn.Module, options: WrapOptions, units: Optional[Sequence[type]],
               comm_unit_size: Optional[int], absorbed: Sequence[tuple[str, list, bool]] = (),
               inside: Sequence[nn.Module] = ()) -> list[tuple[str, list, bool]]:
    """``(name, modules, reshard_after_forward)`` of every unit, the root unit ``("", [model], False)`` first, each
    after the units containing it. ``absorbed``: the units of earlier calls on the modules ``inside``, in which this
    call makes no units."""
    specs = [(name, modules, name != "" and reshards_after_forward(options, name, modules[0]))
             for name, modules in _unit_modules(model, tuple(units or ()), comm_unit_size, inside)]
    if not absorbed:
        return specs
    position = {id(m): i for i, m in enumerate(model.modules())}  # by each unit's first module
    return sorted(specs + list(absorbed), key=lambda spec: position[id(spec[1][0])])


def _unit_modules(model: nn.Module, classes: tuple, comm_unit_size: Optional[int],
                  absorbed: Sequence[nn.Module] = ()) -> list[tuple[str, list]]:
    """``[(name, modules)]`` for every unit, the root unit ``("", [model])`` first, then in registration order.

    Modules inside ``absorbed`` (submodules sharded by an earlier call, whose units are kept) are never made units
    here."""
    specs: list[tuple[str, list]] = [("", [model])]
    inside = {id(m) for sub in absorbed for m in sub.modules()}
    if classes:
        for name, m in model.named_modules():
            if m is not model and isinstance(m, classes) and id(m) not in inside:
                specs.append((name, [m]))
        return specs
    if comm_unit_size is not None:
        _pack(model, "", comm_unit_size, inside, specs)
    return specs


def _pack(parent: nn.Module, prefix: str, comm_unit_size: int, inside: set, specs: list) -> None:
    """Append to ``specs`` the runs of consecutive children of ``parent`` of at most ``comm_unit_size`` elements; a
    larger child with children, and a ``ModuleList`` / ``ModuleDict``, is split into its own children."""
    run: list[tuple[str, nn.Module]] = []
    size = 0

    def close() -> None:
        nonlocal run, size
        if run:
            specs.append((run[0][0], [m for _, m in run]))
        run, size = [], 0

    for cname, child in parent.named_children():
        qual = f"{prefix}{cname}"
        if id(child) in inside:  # its own units, from the earlier call
            close()
            continue
        n = sum(p.numel() for p in child.parameters())
        if n == 0 or isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            continue  # parameter containers: their parameters stay with the parent's unit
        split = isinstance(child, (nn.ModuleList, nn.ModuleDict)) or (
            n > comm_unit_size and next(child.children(), None) is not None)
        if split:
            close()
            _pack(child, qual + ".", comm_unit_size, inside, specs)
            continue
        if size + n > comm_unit_size:
            close()
        run.append((qual, child))
        size += n
    close()


def build_units(model: nn.Module, specs: list[tuple[str, list, bool]], options: WrapOptions,
                device: Optional[torch.device] = None, init_fn: Optional[materialize.InitFn] = None,
                needs_init: Optional[dict] = None) -> list[Unit]:
    """One :class:`Unit` per spec, each holding the flat buffers of the parameters it owns (fragments registered in
    the modules in place of the parameters). Collective: initial values are broadcast from the first rank holding
    them.

    Every buffer is laid out first (shards of zeros); meta parameters are then materialized module by module
    (``materialize.initialize``; ``needs_init``: modules whose buffers were on meta); last, unit by unit, the
    parameters with values are copied in and the fragments registered, so each unit's original parameters are freed
    before the next unit's are copied (peak: the model plus one unit's flat buffer)."""
    built = [Unit(name, modules, reshard) for name, modules, reshard in specs]
    plan = _GroupPlan(options, device)
    # Per unit: [(kind, members, FlatBuffer or None)]; buffers holding a meta parameter are made now (initialize fills
    # them), the others just before they are filled, so their shards do not coexist with every original parameter.
    pending = [[(kind, members, _flat_buffer(unit, kind, members, plan) if any(p.is_meta for _, p, _ in members)
                 else None) for kind, members in _kinds(params, plan)]
               for unit, params in zip(built, _assign_params(model, _owning_unit(model, specs), len(specs)))]
    if any(b is not None for groups in pending for _, _, b in groups) or needs_init:
        slot_of = {id(p): (buffer, i) for groups in pending for _, members, buffer in groups if buffer is not None
                   for i, (_, p, _) in enumerate(members)}
        materialize.initialize(model, slot_of, needs_init or {}, device, init_fn)
        del slot_of
    for i, unit in enumerate(built):
        groups, pending[i] = pending[i], None  # the last references to this unit's original parameters
        _fill_and_register(unit, groups, plan)
        del groups  # freed here, before the next unit's are copied
    return built


def _fill_and_register(unit: Unit, groups: list, plan: "_GroupPlan") -> None:
    for kind, members, buffer in groups:
        if buffer is None:
            buffer = _flat_buffer(unit, kind, members, plan)
        buffer.fill_from_params([None if p.is_meta else tp.local(p) for _, p, _ in members])
        unit.add_group(buffer, [regs for _, _, regs in members])


def _owning_unit(model: nn.Module, specs: list[tuple[str, list, bool]]) -> dict[str, int]:
    """Map every module's qualified name to the index of the innermost unit containing it (``specs``: ``(name,
    modules, reshard_after_forward)`` of every unit, each after the units that contain it)."""
    names: dict[int, list[str]] = {}  # module id -> every qualified name it has (shared modules have several)
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    owner: dict[str, int] = {}
    for idx, (_, modules, _) in enumerate(specs):  # later (inner) units overwrite earlier (outer) ones
        for top in modules:
            for name in names[id(top)]:
                for sub, _ in top.named_modules(remove_duplicate=False):
                    owner[f"{name}.{sub}".strip(".") if name else sub] = idx
    return owner


def _assign_params(model: nn.Module, owner: dict[str, int], count: int) -> list[list[tuple[str, nn.Parameter, list]]]:
    """For each of the ``count`` units: ``[(name, param, [(module, attr), ...])]`` in registration order (a tied
    parameter: the unit of the lowest common ancestor of its modules)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}  # distinct (module, attr) registrations
    module_names: dict[int, list[str]] = {}  # every qualified name of a module holding it (a shared module: several)
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            regs = places.setdefault(id(p), [])
            if not any(pm is m and pa == attr for pm, pa in regs):
                regs.append((m, attr))
            module_names.setdefault(id(p), []).append(mname)
            first.setdefault(id(p), (f"{mname}.{attr}" if mname else attr, p))
    out: list[list] = [[] for _ in range(count)]
    for pid, (pname, p) in first.items():
        common = _common_prefix(module_names[pid])
        while common not in owner:
            common = common.rpartition(".")[0]
        out[owner[common]].append((pname, p, places[pid]))
    return out


def _common_prefix(module_names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in module_names]
    prefix = []
    for tokens in zip(*parts):
        if len(set(tokens)) != 1:
            break
        prefix.append(tokens[0])
    return ".".join(prefix)


def marked_expert(name: str, param: nn.Parameter) -> bool:
    """The default ``expert_filter``: parameters marked ``param.is_expert = True``."""
    return bool(getattr(param, "is_expert", False))


def expert_buffers(model: nn.Module, expert_filter) -> frozenset:
    """Ids of the buffers that belong to experts: those of a module whose nearest parameter-holding ancestor (itself
    included) holds only expert parameters. They differ across ep ranks, like the experts' parameters."""
    experts = {id(p) for n, p in model.named_parameters() if expert_filter(n, p)}
    found: set[int] = set()

    def walk(module: nn.Module, inherited: bool) -> None:
        params = list(module.parameters())
        is_expert = all(id(p) in experts for p in params) if params else inherited
        if is_expert:
            found.update(id(b) for b in module.buffers(recurse=False))
        for child in module.children():
            walk(child, is_expert)

    walk(model, False)
    return frozenset(found)


# ---- flat buffers ----------------------------------------------------------------------------------------------------
class _GroupPlan:
    """Which groups a flat buffer of each kind uses (see ``fully_shard``'s ``replicate_filter``, ``expert_policy``)."""

    def __init__(self, options: WrapOptions, device: Optional[torch.device] = None) -> None:
        self.topology = options.topology
        self.device = device
        self.mp_policy = options.mp_policy
        self.outer_comm_dtype = options.outer_comm_dtype
        self.replicate_filter = options.replicate_filter
        self.expert_filter = options.expert_filter or marked_expert
        self.expert_policy = options.expert_policy
        self.whole_params = options.whole_params
        # The cost each rank of a shard group owns so far in owner layouts (by group: dense and expert groups differ),
        # carried from unit to unit so that owners balance over the whole model.
        self.owner_load: dict[int, list[int]] = {}
        # hpZ: per kind of shard group, this rank's node slice (None: no group spans nodes); made on every rank
        self.node_plans = secondary_shard.node_plans(self.topology) if options.secondary_shard else {}

    def layout(self, members: list, shard_group, placement: str, align: int):
        """The :class:`FlatLayout` of a buffer of these members (an owner layout for ``placement == "owner"``)."""
        names = [n for n, _, _ in members]
        shapes = [tuple(tp.local(p).shape) for _, p, _ in members]
        count = comm.group_size(shard_group)
        if placement != "owner":
            return build_layout(names, shapes, count, align)
        return build_carried_owner_layout(names, shapes, count, align,
                                          self.owner_load.setdefault(id(shard_group), [0] * count))

    def kind(self, name: str, p: nn.Parameter) -> tuple:
        """The key of the flat buffer ``p`` goes into: (dtype, device, trainable, placement, tensor parallel,
        expert); placement is ``"replicate"`` (``replicate_filter``: kept whole on every rank), ``"owner"``
        (``whole_params``: whole on one rank of the shard group) or ``"shard"`` (element-sharded)."""
        replicate = bool(self.replicate_filter(name, p)) if self.replicate_filter is not None else False
        owner = bool(self.whole_params(name, p)) if self.whole_params is not None else False
        placement = "replicate" if replicate else "owner" if owner else "shard"
        return (p.dtype, materialize.target_device(p, self.device), p.requires_grad, placement,
                tp.is_tensor_parallel(p), bool(self.expert_filter(name, p)))

    def node_plan(self, placement: str, expert: bool) -> Optional[secondary_shard.NodePlan]:
        """The node slice of the shard group of a buffer of this kind with ``secondary_shard`` (None: off, kept
        whole, or no group of its kind spans nodes)."""
        if placement == "replicate":
            return None
        kind = ("moe_sharding" if self.expert_policy == "shard" else "expert_inner") if expert else "fsdp_inner"
        return self.node_plans.get(kind)

    def groups(self, placement: str, expert: bool) -> tuple:
        """``(shard_group, reduce_group, replicate_group, broadcast_group)`` for a buffer of this kind."""
        t = self.topology
        # Ranks that hold the same parameters before sharding: the data-parallel ranks and the sep x cp ranks for
        # dense ones; for experts, those with this rank's ep index.
        holders = t.get_param_replica_group(is_expert=expert)
        if placement == "replicate":
            return None, None, holders, holders
        if expert and self.expert_policy == "shard":
            return (t.get_fsdp_group(is_expert=True), t.get_reduce_group("moe_sharding"),
                    t.get_group("expert_shard_replicate"), holders)
        return (t.get_fsdp_inner_group(is_expert=expert), t.get_fsdp_inner_reduce_group(is_expert=expert),
                t.get_replicate_group(), holders)


def _kinds(params: list, plan: _GroupPlan) -> list[tuple[tuple, list]]:
    """A unit's ``[(name, param, registrations)]`` grouped by the kind of flat buffer, in first-seen order; an
    element-sharded kind split further into its row classes where one buffer would pad too much
    (``layout.row_groups``)."""
    kinds: dict[tuple, list] = {}
    for name, p, regs in params:
        kinds.setdefault(plan.kind(name, p), []).append((name, p, regs))
    out = []
    for kind, members in kinds.items():
        dtype, placement, expert = kind[0], kind[3], kind[5]
        if placement != "shard":
            out.append((kind, members))
            continue
        count = comm.group_size(plan.groups(placement, expert)[0])
        align = max(1, ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size())
        shapes = [tuple(tp.local(p).shape) for _, p, _ in members]
        out.extend((kind, [members[i] for i in group]) for group in row_groups(shapes, count, align))
    return out


def _flat_buffer(unit: Unit, kind: tuple, members: list, plan: _GroupPlan) -> FlatBuffer:
    """The :class:`FlatBuffer` of one kind of a unit's parameters, laid out (a shard of zeros), not yet filled."""
    dtype, device, _rg, placement, tensor_parallel, expert = kind
    topology = plan.topology
    shard_group, reduce_group, replicate_group, holders = plan.groups(placement, expert)
    align = max(1, ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size())
    layout = plan.layout(members, shard_group, placement, align)
    cast = dtype.is_floating_point
    buffer = FlatBuffer(
        layout, [p for _, p, _ in members], device=device,
        shard_index=0 if shard_group is None else dist.get_rank(shard_group),
        shard_group=shard_group, reduce_group=reduce_group, replicate_group=replicate_group,
        grad_divisor=topology.gradient_divisor, data_parallel_group=holders, is_expert=expert,
        is_primary=dist.get_rank(replicate_group) == 0 and (tensor_parallel or topology.mp_rank == 0),
        unit_name=unit.name,
        param_dtype=plan.mp_policy.param_dtype if cast else None,
        grad_comm_dtype=plan.mp_policy.grad_comm_dtype if cast else None,
        all_gather_dtype=plan.mp_policy.all_gather_dtype if cast else None,
        overlap_replicate=replicate_group is topology.get_replicate_group(),
        outer_comm_dtype=None if placement == "replicate" or not cast else plan.outer_comm_dtype,
        tp_specs=[tp.spec_of(p) for _, p, _ in members], owner_layout=placement == "owner",
        # within a replica a buffer kept whole is held by each of its inner ranks: the first of them counts it
        is_replica_primary=(tensor_parallel or topology.mp_rank == 0) and (
            placement != "replicate" or comm.group_rank(topology.get_fsdp_inner_group(is_expert=expert)) == 0))
    node = plan.node_plan(placement, expert)
    if node is not None and layout.padded_numel:
        buffer.secondary = secondary_shard.SecondaryShard(node, layout.shard_count, layout.shard_numel,
                                                          buffer.all_gather_dtype, unit.name)
    for name, p, _ in members:
        REPLACED_PARAMS[p] = name
    return buffer
