"""``fully_shard`` and the calls on a sharded model: split a model into units, lay each unit's parameters into flat
buffers, shard them, add hooks.

The data flow of a step and the invariants the tests hold are in docs/design.md. The pieces, all private, under
``shardfusion/_runtime/``: ``wrap.py`` (the checks, the units, the flat buffers of each unit), ``nested.py`` (a call
that absorbs earlier ones), ``flat_buffer.py`` (the tensors a buffer owns: [Note: flat buffer tensors]),
``scheduler.py`` (when collectives run), ``state.py`` (the one accessor for a sharded model's state).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from shardfusion import reshard_budget
from shardfusion._runtime import compress, materialize, nested, wrap
from shardfusion._runtime.local_state_dict import LocalStateDict
from shardfusion._runtime.scheduler import Scheduler
from shardfusion._runtime.state import attach, sharded_state
from shardfusion._runtime.unit import Unit
from shardfusion.policies import EXPERT_POLICIES, RESHARD_POLICIES, MixedPrecisionPolicy

__all__ = ["EXPERT_POLICIES", "RESHARD_POLICIES", "MixedPrecisionPolicy", "finish_grad_sync", "fully_shard",
           "get_units", "no_sync", "reshard_choice", "set_is_last_backward", "set_requires_gradient_sync"]


def fully_shard(
    model: nn.Module,
    topology,
    *,
    units: Optional[Sequence[type]] = None,
    comm_unit_size: Optional[int] = None,
    reshard_policy: str = "after_forward",
    reshard_filter: wrap.ReshardFilter = "all",
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    replicate_filter: Optional[Callable[[str, nn.Parameter], bool]] = None,
    broadcast_buffers: bool = True,
    expert_filter: Optional[Callable[[str, nn.Parameter], bool]] = None,
    expert_policy: str = "replicate",
    prefetch: int = 1,
    device: Optional[Union[torch.device, str]] = None,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
    outer_comm_dtype: Union[None, torch.dtype, str] = None,
    whole_params: Optional[Callable[[str, nn.Parameter], bool]] = None,
    memory_budget: Optional[int] = None,
    secondary_shard: bool = False,
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
    as this one (``topology`` with the same degrees, an equal ``mp_policy``, the same filter objects,
    ``broadcast_buffers``, ``expert_policy``, ``prefetch``); only ``reshard_policy`` and ``reshard_filter`` may
    differ. Build the optimizer after the outermost call (one built in between holds the inner calls' fragments and
    is refused at its first step).

    Every rank must run the same units in the same order, in forward and in backward: a unit skipped on some ranks
    only (LayerDrop, an early exit, a branch on per-rank data) leaves the collectives mismatched, and the ranks wait
    until the process-group timeout (``Topology(timeout=...)``), which then raises ``RuntimeError`` naming the
    collective, the unit and this cause. To drop a layer, run it on every rank and zero its contribution (e.g.
    ``x = x + keep * block(x)``).

    Each unit keeps one flat buffer per (dtype, device, trainable or frozen, sharded or kept whole, tensor-parallel
    sharded or not, dense or expert; a sharded kind whose rows of unrelated lengths would pad more than about a row
    per shard is split into one buffer per row class); parameters start at 16-byte aligned offsets, shards are cut
    on the parameters' row boundaries and the buffer is padded to a multiple of its shard count
    (docs/shape-true-parameters.md). Each rank keeps its ``1/inner`` shard in
    the parameters' own dtype. Afterwards ``model.named_parameters()`` yields, under the original names, fragments:
    views into the shard of shape ``(rows_on_this_rank, *shape[1:])`` (0 rows allowed; a 0-d parameter is ``(1,)``
    on the rank holding it, ``(0,)`` elsewhere), so ``p.dim()`` and the trailing dimensions are the original ones
    and ``p.grad.shape == p.shape``; element-wise ``torch.optim`` optimizers
    (SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, Rprop, ASGD, NAdam, RAdam) work unchanged and give the
    single-process result; build the optimizer after ``fully_shard``, from ``model.parameters()``. Optimizers that
    read a parameter's shape or all parameters together (``LBFGS``, ``Adafactor``, ``SparseAdam`` and their
    subclasses) are refused at their first step with ``ValueError`` on every rank, as is an optimizer holding
    parameters from before ``fully_shard``; ``Muon`` runs on the parameters ``whole_params`` keeps whole (below) and
    is refused holding any other. Cast or move the model
    (``.to(dtype)``, ``.double()``, ``.half()``, ``.to(device)``) before wrapping: afterwards the next forward raises
    ``ValueError``. Gradients become the gradient of the mean loss over the global batch (summed over the data-parallel
    world and the context ranks, divided by ``Topology.gradient_divisor`` = ``dp * sharding * sep * cp``); they are
    all-reduced over the replicate group (``dp x outer x sep x cp``) once per optimizer step (see
    :func:`finish_grad_sync`).

    Tensor parallel (docs/tensor-parallel.md): parameters that torch's ``parallelize_module`` made DTensors over
    ``topology.get_mesh("mp")`` (``Shard(d)`` or ``Replicate()``) are laid out by their local pieces; while a unit is
    unsharded the modules see DTensors with the original placements over views of the full buffer, so torch's
    parallel styles run as without FSDP. Context parallel (docs/context-parallel.md): with ``sep * cp > 1`` the
    context ranks are replicas of the shards; the model splits its sequences itself (e.g.
    :func:`shardfusion.context_parallel.attention`). ``model.state_dict()`` is collective and holds full-shape DTensors
    (``Shard(0)`` over the shard group, ``Replicate()`` over the replicas), which the model's own state-dict hooks see
    and torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` and DCP take; ``model.load_state_dict()`` is
    collective and takes those, full-shape tensors or this rank's own fragments (see
    :func:`shardfusion.full_state_dict`).

    Meta-device models: a model built (all or partly) under ``with torch.device("meta")`` is materialized here,
    module by module in ``model.named_modules()`` order: a module's own meta parameters are allocated full on
    ``device``, initialized by ``init_fn(module)`` or else the module's ``reset_parameters()``, broadcast from the
    first rank holding them, copied into this rank's shard and freed (peak: the shards plus one module's
    parameters). A parameter registered by several modules (a tied embedding and head) is one tensor on which each
    of them runs its init in that order (the last writer wins); it is broadcast after the last. For layers
    that draw their values in ``reset_parameters`` (``torch.nn`` layers, :class:`shardfusion.models.gpt.GPT`,
    :class:`shardfusion.moe.MoE`) the result equals eager construction under the same seed, bitwise; docs/design.md
    ("Models larger than one rank") says when that holds and what to do otherwise. An eager model's original
    parameters are freed unit by unit during the wrap (peak: the model plus one unit's flat buffer).

    Args:
        model: the module to shard (parameters of any float dtype; on the meta device, all or partly, or with
            values). It may contain modules sharded by earlier calls (see nested calls above).
        topology: a :class:`shardfusion.Topology`.
        units: module classes that each form a unit (e.g. ``(Block,)``); at least one must match a module. ``None``
            with no ``comm_unit_size``: the classes named in the model's ``_no_split_modules`` (a Hugging Face
            ``PreTrainedModel``'s decoder layers, as accelerate's FSDP integration uses them), else only the root
            unit.
        comm_unit_size: with no ``units``: the largest unit, in elements (> 0).
        reshard_policy: ``"after_forward"`` (free full buffers after each unit's forward, gather again for backward;
            ZeRO-3), ``"after_backward"`` (keep them from forward until the unit's backward is done) or ``"auto"``:
            keep gathered the units that fit ``memory_budget`` (most all-gather bytes saved per byte held first,
            equal ones last unit first), reshard the rest after forward ([Note: reshard policy by budget] in
            ``shardfusion/reshard_budget.py``); the choice is the same on every rank (checked: one all-reduce) and
            :func:`reshard_choice` returns it. A budget under the need with every unit resharded keeps none (the
            choice is ``after_forward``; the record says it does not fit); one over the need with every unit kept
            keeps all (``after_backward``).
        reshard_filter: which units follow ``reshard_policy`` after forward: ``"all"``, ``"none"`` (all keep their
            full buffers until backward), or a callable ``(qualified_name, module) -> bool``. Under ``"auto"`` the
            units it leaves out keep their full buffers until backward, as the user chose, and count in the budget
            first; the policy decides the others. Of the units absorbed from earlier calls (nested calls), this
            call's ``"auto"`` decides again those that an earlier ``"auto"`` decided (its root too, when its filter
            selects it); units of earlier calls under a fixed policy keep their setting.
        mp_policy: mixed precision, a :class:`MixedPrecisionPolicy` (``param_dtype``: the dtype of the gathered
            parameters and so of the compute; ``grad_comm_dtype``: the dtype of the gradient reduce-scatter and
            all-reduce, or ``"int8"``: the reduce-scatter block-quantized, docs/quantized-reduce-scatter.md);
            ``None`` or ``MixedPrecisionPolicy()``: off.
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
            units that are not resharded after forward keep theirs until their backward. In backward, also how
            many units' gradient reduce-scatters stay in flight while the next unit computes (their full gradient
            buffers alive beside the accumulating one: ``prefetch + 1`` at most; 0: each reduction completes before
            the next unit's backward starts, no overlap).

        device: where the shards (and every runtime buffer) live. ``None``: each tensor's own device, and for meta
            tensors ``cuda:LOCAL_RANK`` under NCCL, ``cpu`` under gloo. Given: tensors elsewhere are copied to it
            (shard by shard, so an eager CPU model can be sharded onto GPUs).
        init_fn: ``init_fn(module)``, called under ``torch.no_grad()`` for each module with parameters or buffers of
            its own on the meta device, in ``model.named_modules()`` order, once their storage is allocated (values
            uninitialized, or those of the earlier modules' inits for a shared parameter), instead of its
            ``reset_parameters()``; also for ``model`` itself, first, when it has no tensors of its own (its
            submodules' are still on meta then); e.g. ``model._init_weights`` for a transformers model. Only
            called when the model has meta tensors.
        outer_comm_dtype: the wire format of the replicate (HSDP outer, cross-node) all-reduce only: ``None``
            (default: ``mp_policy.grad_comm_dtype``), ``torch.bfloat16`` / ``torch.float16`` (half the bytes), or
            ``"int8"``: block-wise int8 with one fp32 scale per 256 elements (about 0.254 x the bytes of fp32),
            reduced in fp32 by an all-to-all of quantized chunks and an all-gather of the requantized sums, so each
            element is quantized twice whatever the number of replicas (ZeRO++'s qgZ idea); its error bound is in
            ``docs/compressed-all-reduce.md``. No error feedback. The inner reduce-scatter keeps
            ``grad_comm_dtype``; kept-whole parameters (``replicate_filter``) are all-reduced uncompressed. Also the
            strings ``"fp32"``, ``"bf16"``, ``"fp16"``.
        whole_params: optional ``(name, parameter) -> bool`` choosing the parameters a matrix optimizer (e.g.
            ``torch.optim.Muon``) needs whole. Each lies whole inside the shard of one *owner* rank of its shard
            group (the flat buffer is laid out on parameter boundaries for them: ``layout.build_owner_layout``),
            instead of being split across ranks. On its owner the fragment has the parameter's shape (and so does
            its ``.grad``); on every other rank it is an empty tensor of shape ``(0, *shape[1:])``; so an optimizer
            built from ``model.parameters()`` updates each matrix once, where it lives, with no collective.
            Owners are chosen per shard group by the longest-processing-time rule on the Newton-Schulz cost
            ``max(m, n) * min(m, n) ** 2`` with the load carried from unit to unit (the balance holds over the
            model); shards stay equal for the all-gather, so what one rank owns beyond another is padding
            (:func:`shardfusion.owner_balance` reports both). Forward and backward are unchanged (the unit is
            all-gathered and reduce-scattered whole); gradients, clipping, ``full_state_dict`` and checkpoints keep
            their meaning (a checkpoint stores parameters flattened, so it loads into either layout). The idea of
            owner ranks comes from PaddlePaddle's sharding for Muon and Megatron's layer-wise optimizer; see
            ``docs/whole-params.md``.
        memory_budget: with ``reshard_policy="auto"`` only (required there): the memory of one rank, in bytes, that
            the units kept gathered must fit. It counts what :func:`shardfusion.plan` counts for
            ``max_memory_per_rank``: this rank's shards and sharded gradients, the optimizer state (AdamW's two fp32
            values per trainable shard element), the full buffers (every unit kept gathered, the ``prefetch + 2``
            largest resharded ones, the 2 largest full gradient buffers); not activations, not DiLoCo's state.
        secondary_shard: ZeRO++'s hpZ (Wang et al., 2023): where a buffer's sharding group spans nodes (node
            boundaries: ``topology.ranks_per_node``), a unit resharded after forward keeps, from its forward's
            all-gather to its backward's, a copy of the gathered buffer in the all-gather's wire format
            (``mp_policy.all_gather_dtype``, else ``param_dtype``) sharded over the group's ranks on this rank's
            node (``L`` of them: ``1/L`` of it per rank), and its backward all-gathers that copy within the node
            (one process group per node slice, made here on every rank). The backward computes with bitwise the
            forward's parameters; shards, gradients and checkpoints are unchanged. Dense and expert buffers, owner
            layouts (``whole_params``) and tensor-parallel buffers alike. It changes nothing for a group within one
            node, a buffer kept whole, or a unit kept gathered until backward (``reshard_policy="after_backward"``,
            units ``"auto"`` keeps). Default False. See ``docs/secondary-shard.md`` and [Note: secondary shard] in
            ``shardfusion/_runtime/secondary_shard.py``.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: bad ``units`` (also: none of its classes matches a module), ``comm_unit_size``,
            ``reshard_policy`` (not in :data:`RESHARD_POLICIES`), ``reshard_filter``, ``mp_policy``,
            ``replicate_filter``, ``expert_filter``, ``expert_policy`` (not in :data:`EXPERT_POLICIES`),
            ``memory_budget`` (missing under ``"auto"``, not an int > 0, or given with another policy),
            ``prefetch`` or ``outer_comm_dtype``, ``secondary_shard`` (not a bool, or a sharding group with unequal
            numbers of ranks on its nodes), ``device`` (not a device, or ``"meta"``), ``init_fn`` (not callable); a model that is
            already sharded, or that is inside a sharded module; a module with meta tensors of its own and no
            ``reset_parameters()`` when no ``init_fn`` is given, or ranks that disagree on which tensors are on
            meta (after one small all-reduce, so on every rank); an ``init_fn`` that leaves a tensor on meta or
            changes its shape; a module with an ``ep_group`` attribute (an expert-parallel layer such as
            :class:`shardfusion.moe.MoE`) whose group is not the topology's ep group; a sharded submodule whose call
            used other options (the message names the option); a DTensor parameter over another mesh than
            ``topology.get_mesh("mp")``, with a ``Partial`` placement or on the meta device
            (docs/tensor-parallel.md); ``whole_params`` not callable, or choosing a parameter that
            ``replicate_filter`` also chooses or a DTensor. All before any collective, so on every rank.
    """
    options = wrap.WrapOptions(topology, MixedPrecisionPolicy() if mp_policy is None else mp_policy,
                               replicate_filter, broadcast_buffers, expert_filter, expert_policy, prefetch,
                               reshard_policy, reshard_filter, compress.validate_outer_comm_dtype(outer_comm_dtype),
                               whole_params, secondary_shard=secondary_shard)
    wrap.check_args(model, options, units, comm_unit_size)
    reshard_budget.check_budget(reshard_policy, memory_budget)
    device = materialize.check_device_args(device, init_fn)
    if units is None and comm_unit_size is None:
        units = wrap.default_units(model)
    wrap.check_model(model, options, units)
    inner = nested.sharded_submodules(model)
    nested.check_nested_options(model, inner, options)
    # the first collective: the same error on every rank of the stage
    materialize.check_initializable(model, init_fn, topology.get_group("stage"))
    again = reshard_budget.decided_again(inner) if reshard_policy == "auto" else set()  # before they are absorbed
    absorbed = [spec for name, sub in inner for spec in nested.absorb(name, sub)]  # collective: full parameters back
    needs_init = materialize.place_buffers(model, device)  # before buffer identities are read
    expert_buffers = wrap.expert_buffers(model, expert_filter or wrap.marked_expert)  # before they become fragments
    specs = wrap.unit_specs(model, options, units, comm_unit_size, absorbed, [sub for _, sub in inner])
    built = wrap.build_units(model, specs, options, device, init_fn, needs_init)
    choice = None
    if reshard_policy == "auto":  # the units this call makes and its filter selects, and earlier "auto" ones
        earlier = {id(spec) for spec in absorbed}
        decided = [spec[0] != "" and (spec[0] in again if id(spec) in earlier else spec[2]) for spec in specs]
        choice = reshard_budget.apply(built, decided, memory_budget, prefetch=prefetch,
                                      group=topology.get_group("stage"), device=materialize.default_device())
    state = Scheduler(model, built, topology, broadcast_buffers, expert_buffers, options.mp_policy.param_dtype,
                      prefetch, wrap_options=options)
    state.sync_buffers()  # e.g. BatchNorm statistics start equal too
    state.register_hooks()
    state.reshard_choice = choice  # reshard_choice(model)
    attach(model, state)
    LocalStateDict(state).install()  # model.state_dict() / load_state_dict(): see local_state_dict.py
    return model


def get_units(model: nn.Module) -> list[Unit]:
    """The units of a sharded model, root unit first.

    Raises:
        ValueError: if ``model`` was not passed to :func:`fully_shard`.
    """
    return sharded_state(model).units


def reshard_choice(model: nn.Module) -> Optional[reshard_budget.ReshardChoice]:
    """The units ``reshard_policy="auto"`` kept gathered and why (budget, estimate, needs at the extremes), as a
    :class:`shardfusion.reshard_budget.ReshardChoice` (``describe()``: lines to print; ``as_dict()``: a record);
    None when the model was sharded under another policy.

    Raises:
        ValueError: if ``model`` was not passed to :func:`fully_shard`.
    """
    return getattr(sharded_state(model), "reshard_choice", None)


def finish_grad_sync(model: nn.Module) -> None:
    """Finish this step's gradient synchronization: all-reduce sharded gradients over the replicate group.

    The step's last backward already waits for it before it returns, so gradients are final then (see
    :func:`set_is_last_backward` for which backward that is). Called again before any ``torch.optim`` optimizer
    steps on the model's parameters, by :func:`shardfusion.clip_grad_norm_` and by ``torch.amp.GradScaler.unscale_``;
    call it yourself after a backward that was not taken for the last. Idempotent. Every rank of the model must call
    it (it is collective).
    """
    sharded_state(model).finish_grad_sync()


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for the following backwards (FSDP2's convention).

    While off, gradients accumulate in the full-size per-unit gradient buffers with no reduce-scatter or
    all-reduce; turn it on again before the last micro-batch of the step, whose backward reduces the total.
    """
    sharded_state(model).requires_gradient_sync = bool(requires_gradient_sync)


def set_is_last_backward(model: nn.Module, is_last_backward: Optional[bool]) -> None:
    """Say whether the following backwards are the last of their optimizer step (FSDP2's convention; its
    ``set_requires_all_reduce`` for HSDP maps to the same thing here); ``None`` (the default): predicted.

    The last backward of a step issues each unit's replicate (outer) all-reduce as soon as its reduce-scatter is
    done, overlapped with the rest of the backward, and waits for them at its end: the fragments' ``.grad`` are
    final when it returns, as with DDP and FSDP2. By default the last backward is predicted from the number of
    reducing backwards of the previous step (a constant number of micro-batches: exactly one all-reduce per buffer
    per step, overlapped); before the first optimizer step none is predicted and every reducing backward ends with
    the all-reduces (K micro-batches with gradient sync on cost K in that step). True marks the following backwards
    as last; False runs the all-reduces at the step boundary (``optimizer.step()``, clipping, ``finish_grad_sync``). A wrong prediction or setting (another backward after the one taken for the
    last) is correct: the later gradients of a buffer whose all-reduce was issued are all-reduced by themselves at
    the step boundary (one more all-reduce of that buffer). Results are bitwise those of the step-boundary path when
    the last backward is the one taken; after a wrong one, the sum of two all-reduces may round differently.
    """
    sharded_state(model).is_last_backward = None if is_last_backward is None else bool(is_last_backward)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Context manager form of ``set_requires_gradient_sync(model, False)``; restores the previous setting."""
    state = sharded_state(model)
    prev, state.requires_gradient_sync = state.requires_gradient_sync, False
    try:
        yield
    finally:
        state.requires_gradient_sync = prev
