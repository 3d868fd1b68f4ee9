"""``fully_shard``: split a model into units, lay each unit's parameters into flat buffers, shard them, add hooks.

Data flow of a step and the invariants are in DESIGN.md; the tensors a unit owns are in [Note: flat group tensors]
(``flat_group.py``); when collectives run is in ``schedule.py``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion.flat_buffer import build_layout
from shardfusion.flat_group import FlatGroup
from shardfusion.local_state_dict import LocalStateDict
from shardfusion.moe import MoE
from shardfusion.schedule import ShardState
from shardfusion.unit import Unit

ReshardFilter = Union[str, Callable[[str, nn.Module], bool]]
_RESHARD_POLICIES = ("after_forward", "after_backward")
_EXPERT_POLICIES = ("replicate", "shard")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
ALIGN_BYTES = 16  # each parameter starts at a multiple of 16 bytes in its flat buffer


def fully_shard(
    model: nn.Module,
    topology,
    units: Optional[Sequence[type]] = None,
    comm_unit_size: Optional[int] = None,
    reshard_policy: str = "after_forward",
    reshard_filter: ReshardFilter = "all",
    param_dtype: Optional[torch.dtype] = None,
    grad_comm_dtype: Optional[torch.dtype] = None,
    replicate_filter: Optional[Callable[[str, nn.Parameter], bool]] = None,
    broadcast_buffers: bool = True,
    expert_filter: Optional[Callable[[str, nn.Parameter], bool]] = None,
    expert_policy: str = "replicate",
    prefetch: int = 1,
) -> nn.Module:
    """Shard ``model`` in place with FSDP (``fsdp_outer_degree == 1``) or HSDP (``> 1``) and return it.

    Units: every module whose class is in ``units`` is a unit; otherwise, with ``comm_unit_size``, consecutive
    sibling modules are packed greedily into units of at most ``comm_unit_size`` elements (a larger module is split
    into its children; ``ModuleList``/``ModuleDict`` containers, which are never called, are always split).
    Parameters outside every unit form the root unit (the model itself), which is never
    resharded after forward. A parameter registered in several modules (tied) belongs to the unit of their lowest
    common ancestor.

    Each unit keeps one flat buffer per (dtype, device, trainable or frozen, sharded or kept whole, dense or expert);
    parameters start at 16-byte aligned offsets and the buffer is padded to a multiple of its shard count. Each rank keeps its
    ``1/inner`` shard in the parameters' own dtype. Afterwards ``model.named_parameters()`` yields, under the original
    names, 1-D fragments (views into the shard, possibly of 0 elements), so any ``torch.optim`` optimizer works
    unchanged. Gradients become the gradient of the mean loss over the global batch (summed over the data-parallel
    world and divided by ``dp * sharding``); they are all-reduced over the replicate group (``dp x outer``) once per
    optimizer step (see :func:`finish_grad_sync`). ``model.state_dict()`` holds those fragments (local);
    ``model.load_state_dict()`` is collective and takes full-shape tensors or this rank's own fragments (see
    :func:`shardfusion.full_state_dict`).

    Args:
        model: the module to shard (on its target device; parameters of any float dtype).
        topology: a :class:`shardfusion.Topology`.
        units: module classes that each form a unit (e.g. ``(Block,)``).
        comm_unit_size: with no ``units``: the largest unit, in elements (> 0).
        reshard_policy: ``"after_forward"`` (free full buffers after each unit's forward, gather again for backward;
            ZeRO-3) or ``"after_backward"`` (keep them from forward until the unit's backward is done).
        reshard_filter: which units follow ``reshard_policy`` after forward: ``"all"``, ``"none"`` (all keep their
            full buffers until backward), or a callable ``(qualified_name, module) -> bool``.
        param_dtype: mixed precision (``torch.bfloat16`` or ``torch.float16``; ``None``: off): the dtype of the
            all-gathered full buffers and so of the forward and backward compute. Shards, the gradients the optimizer
            reads and so the optimizer state stay in the parameters' own dtype (fp32); each all-gather sends the shard
            cast to ``param_dtype``. Floating-point tensors passed to the model's forward are cast to it (FSDP2's
            ``cast_forward_inputs``). Gradients accumulated over micro-batches with gradient sync off are summed in
            fp32. As in FSDP2's ``MixedPrecisionPolicy``.
        grad_comm_dtype: dtype of the reduce-scatter and of the replicate all-reduce (``torch.float32``,
            ``torch.bfloat16`` or ``torch.float16``; ``None``: ``param_dtype`` if given, else the parameters' dtype).
            Reduced gradients are added into the fp32 sharded gradient; below 32 bits they are divided by
            ``dp * sharding`` before the reduction.
        replicate_filter: optional ``(name, parameter) -> bool``; parameters for which it is true are kept whole on
            every rank (not sharded) and their gradients all-reduced over the data-parallel group.
        broadcast_buffers: broadcast module buffers (e.g. BatchNorm running statistics) from the first data-parallel
            rank at the start of every forward in training mode and of the first forward after training ones (an
            evaluation), as DDP does, so replicas keep identical buffers and evaluate alike. Buffers are always
            broadcast once when wrapping. BatchNorm batch statistics stay per rank (as in DDP).
        expert_filter: optional ``(name, parameter) -> bool`` choosing the expert parameters; default: those with
            ``param.is_expert = True`` (set by :class:`shardfusion.moe.MoE`; see :func:`shardfusion.moe.mark_expert`).
            Expert parameters differ across the ep ranks (each ep rank holds its own experts); they are broadcast at
            wrap time over the ranks holding the same experts (``dp x moe_sharding``) and go into flat buffers of
            their own. Their gradients are divided by ``dp * sharding`` like dense ones (the mean over the global
            batch), never by the size of an expert group.
        expert_policy: how expert buffers use the outer group: ``"replicate"`` (HSDP, the default: sharded over the
            expert inner group ``moe_sharding / outer``, all-reduced over ``dp x outer`` once per step, the same
            replicate group object as dense buffers) or ``"shard"`` (sharded over the whole moe_sharding group, so
            only the dp replicas all-reduce them: no outer all-reduce for experts; their all-gathers then cross the
            outer group, as in Megatron-FSDP's ``outer_dp_sharding_strategy``). With ``fsdp_outer_degree == 1`` both
            are the same.
        prefetch: how many units are all-gathered ahead of the one running (asynchronously), in forward and in
            backward (default 1; 0: a unit is gathered only when it runs). With ``reshard_policy="after_forward"``
            at most ``prefetch + 1`` non-root units hold a full buffer at once in forward, ``prefetch + 2`` in
            backward (the running unit, the prefetched ones, and the previous one until its last gradient lands);
            units that are not resharded after forward keep theirs until their backward.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: bad ``units``, ``comm_unit_size``, ``reshard_policy``, ``reshard_filter``, ``expert_filter`` or
            ``expert_policy``; a model that is already sharded.
        NotImplementedError: ``sep * cp > 1``.
    """
    _check_args(model, topology, units, comm_unit_size, reshard_policy, reshard_filter, param_dtype, grad_comm_dtype,
                replicate_filter)
    if expert_filter is not None and not callable(expert_filter):
        raise ValueError(f"expert_filter must be None or a callable (name, param) -> bool, got {expert_filter!r}")
    if expert_policy not in _EXPERT_POLICIES:
        raise ValueError(f"expert_policy must be one of {_EXPERT_POLICIES}, got {expert_policy!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")
    _check_moe_layers(model, topology)
    expert_buffers = _expert_buffers(model, expert_filter or _marked_expert)  # before parameters become fragments
    unit_specs = _unit_modules(model, tuple(units or ()), comm_unit_size)
    built: list[Unit] = []
    for name, modules in unit_specs:
        reshard = reshard_policy == "after_forward" and name != "" and _filter(reshard_filter, name, modules[0])
        built.append(Unit(name, modules, reshard))
    owner = _owning_unit(model, unit_specs)
    placed = _assign_params(model, owner)
    plan = _GroupPlan(topology, replicate_filter, expert_filter or _marked_expert, expert_policy, param_dtype,
                      grad_comm_dtype)
    for unit_index, params in enumerate(placed):
        _add_flat_groups(built[unit_index], params, plan)
    state = ShardState(model, built, topology, broadcast_buffers, expert_buffers, param_dtype, prefetch)
    state.sync_buffers()  # e.g. BatchNorm statistics start equal too
    state.register_hooks()
    LocalStateDict(state).install()  # model.state_dict() / load_state_dict(): see local_state_dict.py
    model._sf_state = state
    return model


def get_units(model: nn.Module) -> list[Unit]:
    """The units of a sharded model, root unit first.

    Raises:
        ValueError: if ``model`` was not passed to :func:`fully_shard`.
    """
    return _state(model).units


def finish_grad_sync(model: nn.Module) -> None:
    """Finish this step's gradient synchronization: all-reduce sharded gradients over the replicate group.

    Called automatically before any ``torch.optim`` optimizer steps on the model's parameters and by
    :func:`shardfusion.clip_grad_norm_`; call it yourself before reading ``.grad`` of the fragments. Idempotent.
    Every rank of the model must call it (it is collective).
    """
    _state(model).finish_grad_sync()


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for the following backwards (FSDP2's convention).

    While off, gradients accumulate in the full-size per-unit gradient buffers with no reduce-scatter or
    all-reduce; turn it on again before the last micro-batch of the step, whose backward reduces the total.
    """
    _state(model).requires_gradient_sync = bool(requires_gradient_sync)


def set_is_last_backward(model: nn.Module, is_last_backward: bool) -> None:
    """Say whether the following backwards are the last of their optimizer step (FSDP2's convention; its
    ``set_requires_all_reduce`` for HSDP maps to the same thing here).

    When true, each unit's replicate (outer) all-reduce is issued as soon as its reduce-scatter is done, overlapped
    with the rest of the backward, instead of at the step boundary. With K micro-batches per step, set it to
    ``micro == K - 1`` before each backward. A gradient that reaches a buffer whose all-reduce is already in flight
    (another backward before the optimizer step) raises ``RuntimeError``: never a silent race. Results are bitwise
    the same as with the default (all-reduce at the step boundary).
    """
    _state(model).is_last_backward = bool(is_last_backward)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Context manager form of ``set_requires_gradient_sync(model, False)``; restores the previous setting."""
    state = _state(model)
    prev, state.requires_gradient_sync = state.requires_gradient_sync, False
    try:
        yield
    finally:
        state.requires_gradient_sync = prev


def _state(model: nn.Module) -> ShardState:
    state = getattr(model, "_sf_state", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not sharded: pass it to shardfusion.fully_shard first")
    return state


# Containers are never called, so forward hooks on them never fire: never a unit, always descended into.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _check_args(model, topology, units, comm_unit_size, reshard_policy, reshard_filter, param_dtype,
                grad_comm_dtype, replicate_filter) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not hasattr(topology, "get_fsdp_inner_group"):
        raise ValueError(f"topology must be a shardfusion.Topology, got {type(topology).__name__}")
    if getattr(model, "_sf_state", None) is not None:
        raise ValueError(f"model ({type(model).__name__}) is already sharded by fully_shard")
    if topology.sep * topology.cp > 1:
        raise NotImplementedError(
            f"sep({topology.sep}) * cp({topology.cp}) = {topology.sep * topology.cp} > 1 is not supported yet: "
            "the gradient all-reduce over sep x cp is not implemented")
    for name, value in (("param_dtype", param_dtype), ("grad_comm_dtype", grad_comm_dtype)):
        if value is not None and value not in _LOW_PRECISION + (torch.float32,):
            raise ValueError(f"{name} must be None, torch.float32, torch.bfloat16 or torch.float16, got {value!r}")
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
    if reshard_policy not in _RESHARD_POLICIES:
        raise ValueError(f"reshard_policy must be one of {_RESHARD_POLICIES}, got {reshard_policy!r}")
    if replicate_filter is not None and not callable(replicate_filter):
        raise ValueError(f"replicate_filter must be None or a callable (name, param) -> bool, got {replicate_filter!r}")
    if not (reshard_filter in ("all", "none") or callable(reshard_filter)):
        raise ValueError(f"reshard_filter must be 'all', 'none' or a callable (name, module) -> bool, "
                         f"got {reshard_filter!r}")


def _check_moe_layers(model: nn.Module, topology) -> None:
    """Every :class:`~shardfusion.moe.MoE` must dispatch over the topology's ep group: experts are placed by it."""
    ep_ranks = dist.get_process_group_ranks(topology.get_group("ep"))
    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        ranks = [dist.get_rank()] if m.ep_group is None else dist.get_process_group_ranks(m.ep_group)
        if m.ep_size != topology.ep or ranks != ep_ranks:
            raise ValueError(f"MoE {name!r} dispatches over ranks {ranks} (ep {m.ep_size}) but the topology's ep group "
                             f"is {ep_ranks} (ep {topology.ep}); build it with ep_group=topology.get_group('ep')")


def _expert_buffers(model: nn.Module, expert_filter) -> frozenset:
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


def _filter(reshard_filter: ReshardFilter, name: str, module: nn.Module) -> bool:
    if reshard_filter == "all":
        return True
    if reshard_filter == "none":
        return False
    return bool(reshard_filter(name, module))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _unit_modules(model: nn.Module, classes: tuple, comm_unit_size: Optional[int]) -> list[tuple[str, list]]:
    """``[(name, modules)]`` for every unit, the root unit ``("", [model])`` first, then in registration order."""
    specs: list[tuple[str, list]] = [("", [model])]
    if classes:
        for name, m in model.named_modules():
            if m is not model and isinstance(m, classes):
                specs.append((name, [m]))
        return specs
    if comm_unit_size is None:
        return specs

    def pack(parent: nn.Module, prefix: str) -> None:
        run: list[tuple[str, nn.Module]] = []
        size = 0

        def close() -> None:
            nonlocal run, size
            if run:
                specs.append((run[0][0], [m for _, m in run]))
            run, size = [], 0

        for cname, child in parent.named_children():
            qual = f"{prefix}{cname}"
            n = _numel(child)
            if n == 0 or isinstance(child, (nn.ParameterList, nn.ParameterDict)):
                continue  # parameter containers: their parameters stay with the parent's unit
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                close()
                pack(child, qual + ".")
                continue
            if n > comm_unit_size and any(True for _ in child.children()):
                close()
                pack(child, qual + ".")
                continue
            if size + n > comm_unit_size:
                close()
            run.append((qual, child))
            size += n
        close()

    pack(model, "")
    return specs


def _owning_unit(model: nn.Module, specs: list[tuple[str, list]]) -> dict[str, int]:
    """Map every module's qualified name to the index of the innermost unit containing it."""
    names: dict[int, list[str]] = {}  # module id -> every qualified name it has (shared modules have several)
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    owner: dict[str, int] = {}
    for idx, (_, modules) in enumerate(specs):  # later (inner) units overwrite earlier (outer) ones
        for top in modules:
            for name in names[id(top)]:
                for sub, _ in top.named_modules(remove_duplicate=False):
                    owner[f"{name}.{sub}".strip(".") if name else sub] = idx
    return owner


def _assign_params(model: nn.Module, owner: dict[str, int]) -> list[list[tuple[str, nn.Parameter, list]]]:
    """For each unit: ``[(name, param, [(module, attr), ...])]`` in registration order (tied: common ancestor)."""
    places: dict[int, list] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            places.setdefault(id(p), [])
            if (m, attr) not in [(pm, pa) for pm, pa, _ in places[id(p)]]:
                places[id(p)].append((m, attr, mname))
            first.setdefault(id(p), (f"{mname}.{attr}" if mname else attr, p))
    out: list[list] = [[] for _ in range(max(owner.values(), default=0) + 1)]
    for pid, (pname, p) in first.items():
        mnames = [mn for _, _, mn in places[pid]]
        common = _common_prefix(mnames)
        while common not in owner:
            common = common.rpartition(".")[0]
        out[owner[common]].append((pname, p, [(pm, pa) for pm, pa, _ in places[pid]]))
    return out


def _common_prefix(module_names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in module_names]
    prefix = []
    for tokens in zip(*parts):
        if len(set(tokens)) != 1:
            break
        prefix.append(tokens[0])
    return ".".join(prefix)


def _marked_expert(name: str, param: nn.Parameter) -> bool:
    return bool(getattr(param, "is_expert", False))


class _GroupPlan:
    """Which groups a flat buffer of each kind uses (see ``fully_shard``'s ``replicate_filter``, ``expert_policy``)."""

    def __init__(self, topology, replicate_filter, expert_filter, expert_policy: str, param_dtype=None,
                 grad_comm_dtype=None) -> None:
        self.topology = topology
        self.param_dtype = param_dtype
        self.grad_comm_dtype = grad_comm_dtype
        self.replicate_filter = replicate_filter
        self.expert_filter = expert_filter
        self.expert_policy = expert_policy

    def kind(self, name: str, p: nn.Parameter) -> tuple:
        """The key of the flat buffer ``p`` goes into: (dtype, device, trainable, whole, tensor parallel, expert)."""
        whole = bool(self.replicate_filter(name, p)) if self.replicate_filter is not None else False
        tp = bool(getattr(p, "tensor_model_parallel", False))
        return (p.dtype, p.device, p.requires_grad, whole, tp, bool(self.expert_filter(name, p)))

    def groups(self, whole: bool, expert: bool) -> tuple:
        """``(shard_group, reduce_group, replicate_group, broadcast_group)`` for a buffer of this kind."""
        t = self.topology
        # Ranks that hold the same parameters before sharding: all data-parallel ranks for dense ones, the ranks
        # with this rank's ep index for experts.
        holders = t.get_expert_data_parallel_group() if expert else t.get_data_parallel_group()
        if whole:
            return None, None, holders, holders
        if expert and self.expert_policy == "shard":
            return t.get_fsdp_group(is_expert=True), t.get_reduce_group("moe_sharding"), t.get_group("dp"), holders
        return (t.get_fsdp_inner_group(is_expert=expert), t.get_fsdp_inner_reduce_group(is_expert=expert),
                t.get_replicate_group(), holders)


def _add_flat_groups(unit: Unit, params: list, plan: _GroupPlan) -> None:
    """Group a unit's parameters by kind and build one :class:`FlatGroup` per kind, in first-seen order."""
    kinds: dict[tuple, list] = {}
    for name, p, regs in params:
        kinds.setdefault(plan.kind(name, p), []).append((name, p, regs))
    topology = plan.topology
    divisor = topology.dp * topology.sharding
    for (dtype, _device, _rg, whole, tp, expert), members in kinds.items():
        shard_group, reduce_group, replicate_group, holders = plan.groups(whole, expert)
        shard_count = 1 if shard_group is None else dist.get_world_size(shard_group)
        shard_index = 0 if shard_group is None else dist.get_rank(shard_group)
        align = max(1, ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size())
        layout = build_layout([n for n, _, _ in members], [tuple(p.shape) for _, p, _ in members], shard_count,
                              align)
        cast = dtype.is_floating_point
        group = FlatGroup(layout, [p for _, p, _ in members], shard_index, shard_group, reduce_group,
                          replicate_group, divisor, holders, param_dtype=plan.param_dtype if cast else None,
                          grad_comm_dtype=plan.grad_comm_dtype if cast else None)
        group.is_expert = expert
        if expert:  # the fragments the optimizer sees keep the mark (e.g. for per-expert parameter groups)
            for frag in group.fragments:
                frag.is_expert = True
        group.counts_in_norm = dist.get_rank(replicate_group) == 0 and (tp or topology.mp_rank == 0)
        unit.add_group(group, [regs for _, _, regs in members])
