"""``fully_shard``: split a model into units, lay each unit's parameters into flat buffers, shard them, add hooks.

Data flow of a step and the invariants are in DESIGN.md; the tensors a unit owns are in [Note: flat group tensors]
(``flat_group.py``); when collectives run is in ``schedule.py``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion._runtime.layout import build_layout
from shardfusion._runtime.flat_buffer import FlatBuffer
from shardfusion._runtime.local_state_dict import LocalStateDict
from shardfusion.moe import MoE
from shardfusion._runtime.scheduler import REPLACED_PARAMS, Scheduler
from shardfusion._runtime.state import sharded_state
from shardfusion._runtime.unit import Unit

ReshardFilter = Union[str, Callable[[str, nn.Module], bool]]
_RESHARD_POLICIES = ("after_forward", "after_backward")
_EXPERT_POLICIES = ("replicate", "shard")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
ALIGN_BYTES = 16  # each parameter starts at a multiple of 16 bytes in its flat buffer
# submodule of a sharded model -> (class name of that model, the submodule's qualified name), to refuse wrapping a
# module inside an already sharded one.
_SHARDED_MODULES: "weakref.WeakKeyDictionary[nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _WrapOptions:
    """The options of one ``fully_shard`` call, kept on its state (a later call on an ancestor compares them)."""

    topology: object
    param_dtype: Optional[torch.dtype]
    grad_comm_dtype: Optional[torch.dtype]
    replicate_filter: Optional[Callable]
    broadcast_buffers: bool
    expert_filter: Optional[Callable]
    expert_policy: str
    prefetch: int
    reshard_policy: str  # per unit: may differ between nested calls
    reshard_filter: ReshardFilter  # per unit: may differ between nested calls


# Options a nested call must share with the call that absorbs it (the reshard policy is per unit and may differ).
_MUST_AGREE = ("topology", "param_dtype", "grad_comm_dtype", "replicate_filter", "broadcast_buffers",
               "expert_filter", "expert_policy", "prefetch")


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
    resharded after forward. A parameter registered in several modules (tied weights, or a module shared by several
    units) belongs to the unit of their lowest common ancestor.

    Nested calls (shard the children, then the root): a call on a module that contains modules sharded by earlier
    calls absorbs them: their parameters get their full values back, their hooks are removed, and each of their
    units (its modules, its reshard-after-forward setting) becomes a unit of this call; the earlier call's root
    becomes a unit that reshards after forward under that call's ``reshard_policy`` / ``reshard_filter``. ``units``
    and ``comm_unit_size`` of this call make no units inside them. The earlier calls must have used the same options
    as this one (``topology`` with the same degrees, the same ``param_dtype``, ``grad_comm_dtype``, filter objects,
    ``broadcast_buffers``, ``expert_policy``, ``prefetch``); only ``reshard_policy`` and ``reshard_filter`` may
    differ. Build the optimizer after the outermost call (one built in between holds the inner calls' fragments and
    is refused at its first step).

    Every rank must run the same units in the same order, in forward and in backward: a unit skipped on some ranks
    only (LayerDrop, an early exit, a branch on per-rank data) leaves the collectives mismatched, and the ranks wait
    until the process-group timeout (``Topology(timeout=...)``), which then raises ``RuntimeError`` naming the
    collective, the unit and this cause. To drop a layer, run it on every rank and zero its contribution (e.g.
    ``x = x + keep * block(x)``).

    Each unit keeps one flat buffer per (dtype, device, trainable or frozen, sharded or kept whole, dense or expert);
    parameters start at 16-byte aligned offsets and the buffer is padded to a multiple of its shard count. Each rank keeps its
    ``1/inner`` shard in the parameters' own dtype. Afterwards ``model.named_parameters()`` yields, under the original
    names, 1-D fragments (views into the shard, possibly of 0 elements), so element-wise ``torch.optim`` optimizers
    (SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, Rprop, ASGD, NAdam, RAdam) work unchanged and give the
    single-process result; build the optimizer after ``fully_shard``, from ``model.parameters()``. Optimizers that
    read a parameter's shape or all parameters together (``LBFGS``, ``Adafactor``, ``Muon``, ``SparseAdam`` and
    their subclasses) are refused at their first step with ``ValueError`` on every rank, as is an optimizer holding
    parameters from before ``fully_shard`` (matrix optimizers such as Muon are planned work). Cast or move the model
    (``.to(dtype)``, ``.double()``, ``.half()``, ``.to(device)``) before wrapping: afterwards the next forward raises
    ``ValueError``. Gradients become the gradient of the mean loss over the global batch (summed over the data-parallel
    world and divided by ``dp * sharding``); they are all-reduced over the replicate group (``dp x outer``) once per
    optimizer step (see :func:`finish_grad_sync`). ``model.state_dict()`` holds those fragments (local);
    ``model.load_state_dict()`` is collective and takes full-shape tensors or this rank's own fragments (see
    :func:`shardfusion.full_state_dict`).

    Args:
        model: the module to shard (on its target device, materialized: not on the meta device; parameters of any
            float dtype). It may contain modules sharded by earlier calls (see nested calls above).
        topology: a :class:`shardfusion.Topology`.
        units: module classes that each form a unit (e.g. ``(Block,)``); at least one must match a module.
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
        ValueError: bad ``units`` (also: none of its classes matches a module), ``comm_unit_size``,
            ``reshard_policy``, ``reshard_filter``, ``expert_filter`` or ``expert_policy``; a model that is already
            sharded, or that is inside a sharded module; a parameter or buffer on the meta device; a sharded submodule
            whose call used other options (the message names the option). All before any collective, so on every
            rank.
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
    _check_materialized(model)
    _check_unit_classes(model, units)
    options = _WrapOptions(topology, param_dtype, grad_comm_dtype, replicate_filter, broadcast_buffers, expert_filter,
                           expert_policy, prefetch, reshard_policy, reshard_filter)
    inner = _sharded_submodules(model)
    _check_nested_options(model, inner, options)
    absorbed = [spec for name, sub in inner for spec in _absorb(name, sub)]  # collective: restores the parameters
    expert_buffers = _expert_buffers(model, expert_filter or _marked_expert)  # before parameters become fragments
    unit_specs = [(name, modules, reshard_policy == "after_forward" and name != "" and
                   _filter(reshard_filter, name, modules[0]))
                  for name, modules in _unit_modules(model, tuple(units or ()), comm_unit_size,
                                                     [sub for _, sub in inner])]
    if absorbed:
        unit_specs = _in_module_order(model, unit_specs + absorbed)
    built = [Unit(name, modules, reshard) for name, modules, reshard in unit_specs]
    owner = _owning_unit(model, unit_specs)
    placed = _assign_params(model, owner)
    plan = _GroupPlan(topology, replicate_filter, expert_filter or _marked_expert, expert_policy, param_dtype,
                      grad_comm_dtype)
    for unit_index, params in enumerate(placed):
        _add_flat_groups(built[unit_index], params, plan)
    state = Scheduler(model, built, topology, broadcast_buffers, expert_buffers, param_dtype, prefetch)
    state.wrap_options = options
    state.sync_buffers()  # e.g. BatchNorm statistics start equal too
    state.register_hooks()
    state.hook_handles.append(model.register_forward_pre_hook(_fragment_check(built), prepend=True))
    LocalStateDict(state).install()  # model.state_dict() / load_state_dict(): see local_state_dict.py
    model._sf_state = state
    for name, m in model.named_modules():
        if m is not model:
            _SHARDED_MODULES[m] = (type(model).__name__, name)
    return model


def get_units(model: nn.Module) -> list[Unit]:
    """The units of a sharded model, root unit first.

    Raises:
        ValueError: if ``model`` was not passed to :func:`fully_shard`.
    """
    return sharded_state(model).units


def finish_grad_sync(model: nn.Module) -> None:
    """Finish this step's gradient synchronization: all-reduce sharded gradients over the replicate group.

    Called automatically before any ``torch.optim`` optimizer steps on the model's parameters and by
    :func:`shardfusion.clip_grad_norm_`; call it yourself before reading ``.grad`` of the fragments. Idempotent.
    Every rank of the model must call it (it is collective).
    """
    sharded_state(model).finish_grad_sync()


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for the following backwards (FSDP2's convention).

    While off, gradients accumulate in the full-size per-unit gradient buffers with no reduce-scatter or
    all-reduce; turn it on again before the last micro-batch of the step, whose backward reduces the total.
    """
    sharded_state(model).requires_gradient_sync = bool(requires_gradient_sync)


def set_is_last_backward(model: nn.Module, is_last_backward: bool) -> None:
    """Say whether the following backwards are the last of their optimizer step (FSDP2's convention; its
    ``set_requires_all_reduce`` for HSDP maps to the same thing here).

    When true, each unit's replicate (outer) all-reduce is issued as soon as its reduce-scatter is done, overlapped
    with the rest of the backward, instead of at the step boundary. With K micro-batches per step, set it to
    ``micro == K - 1`` before each backward. A gradient that reaches a buffer whose all-reduce is already in flight
    (another backward before the optimizer step) raises ``RuntimeError``: never a silent race. Results are bitwise
    the same as with the default (all-reduce at the step boundary).
    """
    sharded_state(model).is_last_backward = bool(is_last_backward)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Context manager form of ``set_requires_gradient_sync(model, False)``; restores the previous setting."""
    state = sharded_state(model)
    prev, state.requires_gradient_sync = state.requires_gradient_sync, False
    try:
        yield
    finally:
        state.requires_gradient_sync = prev


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
    if model in _SHARDED_MODULES:
        root, name = _SHARDED_MODULES[model]
        raise ValueError(f"model ({type(model).__name__}) is submodule {name!r} of a {root} that is already sharded "
                         "by fully_shard: shard the submodules first, then their ancestor (a call on a module "
                         "absorbs the already sharded modules inside it)")
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


def _check_materialized(model: nn.Module) -> None:
    """No parameter or buffer on the meta device: its values are what every rank starts from."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"{kind} {name!r} of {type(model).__name__} is on the meta device: materialize the model first "
                    "(model.to_empty(device=...), then reset_parameters() on its modules); meta-device "
                    "initialization is not supported yet")


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


def _sharded_submodules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, module)]`` of the submodules an earlier ``fully_shard`` call sharded."""
    return [(name, m) for name, m in model.named_modules()
            if m is not model and getattr(m, "_sf_state", None) is not None]


def _check_nested_options(model: nn.Module, inner: list[tuple[str, nn.Module]], options: _WrapOptions) -> None:
    """Each already sharded submodule was wrapped with the same options as this call (but the reshard policy)."""
    for name, sub in inner:
        theirs = sub._sf_state.wrap_options
        for field in _MUST_AGREE:
            mine, earlier = getattr(options, field), getattr(theirs, field)
            same = _same_topology(mine, earlier) if field == "topology" else (
                mine is earlier if callable(mine) or callable(earlier) else mine == earlier)
            if not same:
                raise ValueError(
                    f"submodule {name!r} was sharded with {field}={earlier!r} but this fully_shard call on "
                    f"{type(model).__name__} has {field}={mine!r}: a call absorbs the already sharded submodules, "
                    f"which must have been sharded with the same {field} (only reshard_policy and reshard_filter may "
                    "differ)")


def _same_topology(a, b) -> bool:
    return a is b or (a.degrees == b.degrees and getattr(a, "timeout", None) == getattr(b, "timeout", None))


def _absorb(prefix: str, sub: nn.Module) -> list[tuple[str, list, bool]]:
    """Undo the earlier ``fully_shard`` call on ``sub`` (at ``prefix`` in the model being sharded) and return its
    units as ``(name, modules, reshard_after_forward)`` for this call.

    Collective over each flat buffer's shard group (all-gathers, in unit order, the same on every rank): every
    parameter gets its full values back (the original ``nn.Parameter`` if it is still alive, else a new one with its
    attributes), its hooks are removed and ``sub`` is no longer sharded. The earlier root unit becomes a unit whose
    reshard-after-forward follows the earlier call's ``reshard_policy`` and ``reshard_filter`` (called with
    ``prefix``); the other units keep their setting.
    """
    state = sub._sf_state
    state.remove_hooks()
    specs = []
    for unit in state.units:
        unit.reshard()
        _restore_parameters(unit, prefix)
        if unit is state.units[0]:
            opts = state.wrap_options
            reshard = opts.reshard_policy == "after_forward" and _filter(opts.reshard_filter, prefix, sub)
            specs.append((prefix, [sub], reshard))
        else:
            specs.append((f"{prefix}.{unit.name}", unit.modules, unit.reshard_after_forward))
    del sub._sf_state
    return specs


def _restore_parameters(unit: Unit, prefix: str) -> None:
    """Register full-shape parameters with the unit's current values in place of its fragments (collective)."""
    for g, regs in zip(unit.groups, unit.registrations):
        full = torch.empty(g.layout.padded_numel, dtype=g.shard.dtype, device=g.shard.device)  # (P,)
        comm.all_gather(full, g.shard, g.shard_group)
        for slot, frag, places, original, attrs in zip(g.layout.slots, g.fragments, regs, g.originals,
                                                       g.param_attrs):
            value = full[slot.offset:slot.end].view(slot.shape)
            param = original()
            if param is None:
                param = nn.Parameter(value.clone(), requires_grad=frag.requires_grad)
                param.__dict__.update(attrs)
            else:  # still alive: e.g. tied to a module outside ``sub``, which must keep sharing it
                with torch.no_grad():
                    param.copy_(value)
                param.requires_grad_(frag.requires_grad)
            for module, attr in places:
                module._parameters[attr] = param
            REPLACED_PARAMS[frag] = f"{prefix}.{slot.name}"
        del full


def _in_module_order(model: nn.Module, specs: list[tuple[str, list, bool]]) -> list[tuple[str, list, bool]]:
    """``specs`` sorted by the position of each unit's first module in ``model.modules()`` (root first, a unit after
    the units containing it)."""
    position = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(specs, key=lambda spec: position[id(spec[1][0])])


def _fragment_check(units: list[Unit]):
    """A root forward pre-hook that raises if the model was cast or moved after wrapping: every registered fragment
    must still be the module's parameter and a view of its shard (same storage, dtype and device)."""
    checks = []
    for u in units:
        for g, regs in zip(u.groups, u.registrations):
            for slot, frag, places in zip(g.layout.slots, g.fragments, regs):
                for module, attr in places:
                    checks.append((module._parameters, attr, frag, frag.data_ptr(), g.shard, slot.name))

    @torch.compiler.disable  # a Python loop over every fragment: not for tracing (see schedule.py on compile)
    def hook(module, args):
        for params, attr, frag, ptr, shard, name in checks:
            now = params.get(attr)
            if now is not frag or frag.dtype != shard.dtype or frag.data_ptr() != ptr:
                now = frag if now is None else now
                raise ValueError(
                    f"parameter {name!r} is no longer a view of its shard: it is {now.dtype} on {now.device}, its "
                    f"shard {shard.dtype} on {shard.device}. The model was cast or moved after fully_shard (e.g. "
                    "model.to(torch.float64), .double(), .half(), .to(device)), which replaces the fragments. Cast "
                    "or move the model before calling fully_shard (for low-precision compute pass param_dtype=)")

    return hook


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
            if id(child) in inside:  # its own units, from the earlier call
                close()
                continue
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


def _assign_params(model: nn.Module, owner: dict[str, int]) -> list[list[tuple[str, nn.Parameter, list]]]:
    """For each unit: ``[(name, param, [(module, attr), ...])]`` in registration order (tied: common ancestor)."""
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
    out: list[list] = [[] for _ in range(max(owner.values(), default=0) + 1)]
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
    """Group a unit's parameters by kind and build one :class:`FlatBuffer` per kind, in first-seen order."""
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
        group = FlatBuffer(layout, [p for _, p, _ in members], shard_index, shard_group, reduce_group,
                          replicate_group, divisor, holders, param_dtype=plan.param_dtype if cast else None,
                          grad_comm_dtype=plan.grad_comm_dtype if cast else None)
        group.is_expert = expert
        # What a later fully_shard call on an ancestor needs to give the modules their parameters back (_absorb).
        group.originals = [weakref.ref(p) for _, p, _ in members]
        group.param_attrs = [dict(vars(p)) for _, p, _ in members]
        for name, p, _ in members:
            REPLACED_PARAMS[p] = name
        if expert:  # the fragments the optimizer sees keep the mark (e.g. for per-expert parameter groups)
            for frag in group.fragments:
                frag.is_expert = True
        group.counts_in_norm = dist.get_rank(replicate_group) == 0 and (tp or topology.mp_rank == 0)
        unit.add_group(group, [regs for _, _, regs in members])
