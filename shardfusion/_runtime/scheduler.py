"""Hooks and scheduling: when units all-gather, reshard, reduce-scatter and all-reduce.

Forward: a unit's forward pre-hook unshards it (waiting for its prefetch) and prefetches the unit that ran after it
in the previous forward (unit order in the first); its post-hook reshards it when its policy says so and registers a
pre-backward hook on its outputs.

Backward: all-gathers follow one order on every rank, the reverse of the order in which units registered their
pre-backward hooks in forward. When a unit's pre-backward hook fires, every unit up to it in that order that is
sharded is all-gathered (so a unit whose outputs got no gradient on this rank is still gathered, as on the ranks
where they did), and the next one is prefetched; the end of backward gathers what is left. Each full-shape view has a
post-accumulate hook that puts its gradient into the unit's gradient buffer (allocating it at the unit's first
gradient; [Note: first gradient by copy] in flat_buffer.py) and counts arrivals; a unit whose trainable views all got
their gradient is READY. Reduce-scatters are issued in one
fixed order (reverse unit order), as soon as the unit at the head of that order is READY, on a process group of their
own, so every rank issues the same sequence whatever gradients it got (docs/design.md, invariant 1). A callback
queued on the autograd engine flushes the rest at the end of backward: units that got no gradient reduce-scatter
zeros (in their turn when the backward's graph says so at its start, see the note below).

[Note: gradient reductions in flight]
A unit's full gradient buffer (``FlatBuffer.grad_full``, ``(P,)``) is allocated at its first gradient, and it is the
input of its reduce-scatter, so it lives until that reduce-scatter completes (on gloo with a ``(P,)`` receive buffer
beside it, ``comm.reduce_scatter``). Left to complete whenever the collective finishes, a communication-bound
backward piles them up (measured: three blocks' buffers and two receive buffers at once). So a backward completes the
reduce-scatters it has issued, blocking, at two points fixed by the program: in a unit's pre-backward hook (after
the all-gathers up to that unit are issued, before its prefetches) and before a unit's gradient buffer is allocated;
all of them but the last ``prefetch`` issued, which stay in flight while the next unit computes its backward (the
overlap of gradient reduction with compute: with ``prefetch=0`` a unit's backward starts only once the previous
unit's reduction has completed, on CUDA the compute stream waits for it). In a backward that meets its units in
reverse unit order (a stack of blocks), at any moment at most the root's buffer and ``1 + prefetch`` units' buffers
(one accumulating, the others' reductions in flight) are alive: the same ``1 + prefetch`` as the gathered parameter
buffers; in any backward the buffers alive at each point are the same in every run (so a dry run predicts the peak).
Blocking is safe when every rank can issue
the awaited reduce-scatter with the all-gathers this rank has issued: it waits only for units whose reduce order
prefix lies within them (``_finish_issued_reduces``). And a unit whose trainable views get no gradient on a rank
would be ready there only at the end of backward, so the views that will get none (read from the backward's graph,
``_count_absent_grads``) count as arrived when it starts, and the unit reduces in its turn on every rank. With
replicate all-reduces handed off (below), the wait is for the reduce-scatter part of each hand-off. The idea of a
bounded number of gradient reductions in flight is DeepSpeed ZeRO-3's (its reduce bucket) and FSDP2's (one
reduce-scatter state kept per group); the fixed points and the safety rule are ours.

Prefetch: ``prefetch`` units are all-gathered ahead of the running one, in forward (the order of the previous
forward) and in backward (the backward order); 0 gathers each unit only when it runs. ``peak_unsharded_units``
records the most non-root units holding a full buffer at once (sampled when a unit is gathered).

Step boundary: the replicate-group all-reduce runs once per optimizer step, overlapped with the step's last
backward: each unit's all-reduce is handed off right after its reduce-scatter is issued, in reduce order, and runs
as soon as that reduce-scatter completes, off the backward's thread for CPU tensors (see [Note: overlapped replicate
all-reduce] in ``replicate_sync.py``: why the hand-off point must not depend on timing); ``finish_grad_sync``
(called by ``clip_grad_norm_``, by a global optimizer step pre-hook, or by the user) only waits. Which backward is the last is predicted: the one that brings
this step's count of reducing backwards to the previous step's (a constant number of micro-batches, the normal
case); before the first step boundary nothing is predicted and the all-reduces run at the boundary.
``set_is_last_backward`` overrides the prediction (True: this one is the last; False: run them at the boundary).
A misprediction stays correct: a gradient that reaches a buffer whose all-reduce was already issued goes to that
buffer's late gradient (``FlatBuffer.late_grad``), all-reduced by itself at the step boundary: one more all-reduce
for each such buffer in that step, and the sum of two all-reduces instead of one (rounding may differ in the last
bits from the synchronous path; with a correct prediction the additions are the same, and so is every bit).

``torch.compile``: every hook is excluded from tracing (``torch.compiler.disable``, applied by ``compile_disable``,
which imports ``torch._dynamo`` at the first hook call instead of at import). They resize storages, issue
collectives and keep Python state, which Inductor cannot lower (its ``resize_storage_bytes_`` lowering needs static
sizes). Dynamo breaks the graph at each hook, so the compute of each unit between two hooks is one compiled graph
and the hooks run eagerly, as without compile (``tests/distributed/test_compile.py``).

The step boundary's optimizer step pre-hook, and the optimizers it refuses, are in ``optimizer_hook.py``.

Direct gradients: a loss term computed from ``model.parameters()`` (the fragments) makes autograd accumulate into a
fragment. Each fragment's hooks take that gradient out into its group's ``direct_grad`` and leave ``.grad`` as it was
(see flat_buffer.py); it joins the step's gradient before the replicate all-reduce, averaged over the replicas. A
backward whose graph reaches a fragment issues no replicate all-reduce before its end, so none can be in flight when
a direct gradient arrives (decided from the graph: timing plays no part).

Double backward: a backward with ``create_graph=True`` keeps every unit unsharded (its graph holds views of the full
buffers) until the end of the next backward without it, or an optimizer step; see ``_post_backward``.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from shardfusion import comm
from shardfusion._runtime.compile_disable import compile_disable
from shardfusion._runtime.local_state_dict import persistent_buffers
from shardfusion._runtime.optimizer_hook import install_optimizer_hook
from shardfusion._runtime.replicate_sync import ReplicateSyncQueue
from shardfusion._runtime.secondary_shard import in_backward as _in_backward
from shardfusion._runtime.unit import ReduceState, Unit



class Scheduler:
    """Scheduling state of one sharded model: its units in order and the per-backward bookkeeping.

    Args:
        root: the model passed to ``fully_shard``.
        units: units in unit order (the root unit first, then by module registration order).
        wrap_options: the options of the ``fully_shard`` call (a later call that absorbs this one compares them).
    """

    def __init__(self, root: nn.Module, units: list[Unit], topology, broadcast_buffers: bool = True,
                 expert_buffers: frozenset = frozenset(), param_dtype: torch.dtype | None = None,
                 prefetch: int = 1, *, wrap_options: Any = None) -> None:
        self.root = root
        self.wrap_options = wrap_options
        self.prefetch = prefetch  # units all-gathered ahead of the one running, in forward and in backward
        self.is_last_backward: bool | None = None  # set_is_last_backward's override; None: predicted
        self._backwards_this_step = 0  # reducing backwards since the last step boundary
        self._backwards_last_step: int | None = None  # how many the previous step had (None before the first)
        self._overlap = False  # this backward hands off its replicate all-reduces (decided when it starts)
        self._sync_queue = ReplicateSyncQueue()
        self.handed_off_syncs = 0  # replicate all-reduces handed off during a backward (overlapped), ever
        self.peak_unsharded_units = 0  # most non-root units holding a full buffer at once (see _note_unsharded)
        self.param_dtype = param_dtype
        self.units = units
        self.topology = topology
        self.broadcast_buffers = broadcast_buffers
        self._buffers_trained = False  # a training forward ran since the last buffer broadcast (see _root_pre_forward)
        self._forward_mode: tuple[bool, bool] | None = None  # (training, grad enabled) of the last root forward
        self.expert_buffers = expert_buffers  # ids of the buffers that belong to experts (distinct across ep)
        self.requires_gradient_sync = True
        # Set by a pipeline stage (shardfusion.pipeline) between the micro-batches of a step: units gathered by one
        # micro-batch stay gathered for the next (no reshard at a forward's start or a backward's end); the step's
        # last backward clears it and reshards as usual. The parameters do not change within a step.
        self.keep_gathered = False
        self.step_waits: list = []  # callables finish_grad_sync runs after the replicate all-reduces, in order
        self._reduce_order = [u for u in reversed(units) if u.trainable_groups]
        self._next_reduce = 0
        self._next_all_reduce = 0  # units of _reduce_order whose reduce-scatter has been completed
        self._callback_queued = False
        self._next_sync = 0  # units of _reduce_order whose replicate all-reduce was issued in this backward
        self._handed_off: list = []  # (index in _reduce_order, OverlappedSync) handed off in this backward
        self._reduce_reach: list[int] = []  # see _start_backward_order
        self._creates_graph = False  # the running backward has create_graph=True (grad mode on in its hooks)
        self._views_accumulated = False  # autograd accumulated a gradient into a full view in the running backward
        self._graph_kept = False  # a create_graph backward ran: keep every unit unsharded until a plain one ends
        self._direct_check = (-1, False)  # (graph task id, whether it accumulates into a fragment)
        self._grad_accumulators: dict[int, Any] = {}  # id(fragment) -> its AccumulateGrad node, kept alive
        # Forward prefetch: unit -> the unit that ran after it in the last forward (unit order before the first).
        self._next_in_forward = {id(a): b for a, b in zip(units[1:], units[2:])}
        self._first_in_forward: Unit | None = units[1] if len(units) > 1 else None
        self._ran: list[Unit] = []  # units in the order they ran in this forward
        self._grad_order: list[Unit] = []  # units in the order they registered a pre-backward hook
        self._backward_order: list[Unit] | None = None  # reverse of _grad_order, fixed at the start of backward
        self._gathers_issued = 0  # units of _backward_order whose backward all-gather has been issued
        install_optimizer_hook()

    def split_buffers(self, persistent_only: bool = False
                      ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """The model's named buffers as (dense, expert) lists; with ``persistent_only`` without the non-persistent
        ones (those ``state_dict()`` leaves out: full state dicts and checkpoints leave them out too)."""
        named = persistent_buffers(self.root) if persistent_only else list(self.root.named_buffers())
        return ([(n, b) for n, b in named if id(b) not in self.expert_buffers],
                [(n, b) for n, b in named if id(b) in self.expert_buffers])

    def sync_buffers(self) -> None:
        """Broadcast buffers (non-persistent ones too) from the first rank holding the same ones: dense buffers over
        the data-parallel group, expert buffers over the ranks holding the same experts."""
        dense, expert = self.split_buffers()
        comm.broadcast_coalesced([b for _, b in dense], self.topology.get_param_replica_group())
        comm.broadcast_coalesced([b for _, b in expert], self.topology.get_param_replica_group(is_expert=True))

    # ---- hooks -------------------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Install the forward hooks on every unit's modules and the gradient hooks on every full view and on every
        trainable fragment (for gradients that reach a fragment directly)."""
        root_unit = self.units[0]
        handles = self.hook_handles = []  # the module hooks, removed when a later fully_shard call absorbs this one
        handles.append(self.root.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True))
        handles.append(self.root.register_forward_hook(self._root_post_forward))
        for unit in self.units:
            if unit is not root_unit:
                for m in unit.modules:
                    handles.append(m.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True))
                last = unit.modules[-1]
                handles.append(last.register_forward_hook(self._make_post_forward(unit)))
                for m in unit.modules[:-1]:
                    handles.append(m.register_forward_hook(self._make_backward_hook_only(unit)))
            attach_first = comm.is_fake()  # a dry run: [Note: first gradient by copy] in flat_buffer.py
            for g in unit.trainable_groups:
                for i, view in enumerate(g.full_views):
                    if attach_first or g.tp_specs[i] is not None:  # the slice zeroed and attached before autograd adds
                        view.register_hook(self._make_pre_accumulate(g, i))
                    view.register_post_accumulate_grad_hook(self._make_post_accumulate(unit, g, i))
                for i, frag in enumerate(g.fragments):
                    frag.register_hook(self._make_fragment_pre_accumulate(g, i))
                    frag.register_post_accumulate_grad_hook(self._make_fragment_post_accumulate(g, i))

    def remove_hooks(self) -> None:
        """Remove the module hooks (when a later ``fully_shard`` call absorbs this model's units)."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []

    @compile_disable
    def _root_pre_forward(self, module, args, kwargs):
        saving = self.__dict__.get("local_state_dict")
        if saving is not None:
            saving.restore()  # a state_dict() that raised in a hook left DTensors in the place of the fragments
        for u in self.units:  # a model cast or moved after fully_shard raises here, before anything runs
            u.check_fragments()
        if not _in_backward():
            mode = (bool(module.training), torch.is_grad_enabled())
            if mode != self._forward_mode:  # e.g. an evaluation: every rank must start it (Topology.check_forward_mode)
                self.topology.check_forward_mode(*mode)
                self._forward_mode = mode
            # A forward without a following backward (evaluation) may have left units gathered: start clean.
            for u in self.units[1:]:
                self._reshard(u)
            self._ran, self._grad_order = [], []
            # As DDP: before every training forward, and before the first forward after training ones (evaluation),
            # so eval outputs are the same on every rank (BatchNorm running statistics move in training forwards).
            if self.broadcast_buffers and (module.training or self._buffers_trained):
                self.sync_buffers()
            self._buffers_trained = module.training
        self._pre_forward(self.units[0])
        if self.param_dtype is not None:  # mixed precision: floating-point inputs in the compute dtype
            return tree_map(self._cast_input, args), tree_map(self._cast_input, kwargs)
        return None

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
            return x.to(self.param_dtype)
        return x

    @compile_disable
    def _root_post_forward(self, module, args, output):
        if not _in_backward():
            ran = list(dict.fromkeys(u for u in self._ran if u is not self.units[0]))
            if ran:
                self._next_in_forward = {id(a): b for a, b in zip(ran, ran[1:])}
                self._first_in_forward = ran[0]
        if not torch.is_grad_enabled():
            for u in self.units:  # no backward follows: free everything
                self._reshard(u)
            return
        self._register_pre_backward(self.units[0], output)
        if not _in_backward():
            for u in self.units[1:]:  # e.g. a prefetched unit that did not run in this forward
                if u.reshard_after_forward and u.is_unsharded:
                    self._reshard(u)

    def _make_pre_forward(self, unit: Unit):
        @compile_disable
        def hook(module, args, kwargs):
            self._pre_forward(unit)
            if unit.holds_frozen and torch.is_grad_enabled() and not _in_backward():
                return self._register_inputs_grad(unit, args, kwargs)
            return None

        return hook

    def _register_inputs_grad(self, unit: Unit, args, kwargs):
        """Pass the module's floating-point inputs that require grad through :class:`_InputsGradDone`, whose backward
        runs once their gradients are computed: from then on this graph no longer reads the unit's frozen
        parameters (FSDP2 frees a module's parameters at the same point). Returns the new ``(args, kwargs)``."""
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        outs = _InputsGradDone.apply(self, unit, *[leaves[i] for i in idx])
        for i, t in zip(idx, outs):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _inputs_grad_done(self, unit: Unit, node) -> None:
        unit.inputs_node_fired(node)
        self._reshard_if_done(unit)

    def _reshard_if_done(self, unit: Unit) -> None:
        """Free ``unit`` in the middle of backward once nothing in this backward reads or gathers it again."""
        if unit is not self.units[0] and unit.backward_done() and self._gather_done(unit):
            self._reshard(unit)

    def _pre_forward(self, unit: Unit) -> None:
        unit.unshard()
        unit.ran_forward = True
        if _in_backward():  # recomputation (activation checkpointing): the unit is gathered for backward already
            _refuse_reentrant_recompute(unit)
            return
        self._ran.append(unit)
        nxt = self._first_in_forward if unit is self.units[0] else self._next_in_forward.get(id(unit))
        for _ in range(self.prefetch):
            if nxt is None:
                break
            nxt.prefetch()
            nxt = self._next_in_forward.get(id(nxt))
        self._note_unsharded()

    def _make_post_forward(self, unit: Unit):
        @compile_disable
        def hook(module, args, output):
            if unit.reshard_after_forward and not _in_backward():
                self._reshard(unit, keep_secondary=True)  # hpZ: [Note: secondary shard] in secondary_shard.py
            if torch.is_grad_enabled():
                self._register_pre_backward(unit, output)

        return hook

    def _make_backward_hook_only(self, unit: Unit):
        @compile_disable
        def hook(module, args, output):
            if torch.is_grad_enabled():
                self._register_pre_backward(unit, output)

        return hook

    def _register_pre_backward(self, unit: Unit, output: Any) -> None:
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
        if not _in_backward():
            self._grad_order.append(unit)

    @compile_disable
    def _pre_backward(self, unit: Unit) -> None:
        self._queue_callback()
        order = self._start_backward_order()
        pos = order.index(unit) if unit in order else None
        if pos is not None:
            self._issue_gathers(pos + 1)
        self._finish_issued_reduces()  # [Note: gradient reductions in flight], before the prefetches
        if pos is not None:
            self._issue_gathers(pos + 1 + self.prefetch)  # prefetch the next units of the backward order
        unit.unshard()
        self._note_unsharded()

    def _start_backward_order(self) -> list[Unit]:
        if self._backward_order is None:
            self._backward_order = list(dict.fromkeys(reversed(self._grad_order)))
            self._gathers_issued = 0
            # per prefix of the reduce order, the furthest backward-order position of its units (-1: not gathered
            # in backward): a rank can issue those reduce-scatters once the gathers up to it are issued
            position = {id(u): i for i, u in enumerate(self._backward_order)}
            self._reduce_reach = list(itertools.accumulate((position.get(id(u), -1) for u in self._reduce_order),
                                                           max, initial=-1))[1:]
        return self._backward_order

    def _issue_gathers(self, upto: int) -> None:
        """Issue, in backward order, the all-gathers of units ``[issued, upto)`` that are sharded."""
        order = self._backward_order
        while self._gathers_issued < min(upto, len(order)):
            order[self._gathers_issued].prefetch()
            self._gathers_issued += 1

    def _note_unsharded(self) -> None:
        live = sum(1 for u in self.units[1:] if u.is_unsharded)
        self.peak_unsharded_units = max(self.peak_unsharded_units, live)

    def _reshard(self, unit: Unit, keep_secondary: bool = False) -> None:
        """Reshard ``unit`` unless a create_graph backward's graph may still be differentiated (it holds views of the
        full buffers: see ``_post_backward``) or a pipeline keeps it gathered between micro-batches
        (``keep_gathered``)."""
        if not (self._graph_kept or self._creates_graph or self.keep_gathered):
            unit.reshard(keep_secondary=keep_secondary)

    def _make_pre_accumulate(self, group, view_index: int):
        """A DTensor full view (its gradient may come with other placements than the view's: Partial, under sequence
        parallel) and any view in a dry run: its slice of the gradient buffer is zeroed and attached before autograd
        adds into it ([Note: first gradient by copy] in flat_buffer.py)."""
        @compile_disable
        def hook(grad):
            self._before_buffer_write(group, view_index)
            group.ensure_grad_full(view_index)
            return grad

        return hook

    def _before_buffer_write(self, group, view_index: int) -> None:
        """A gradient is about to be written into ``group``'s gradient buffer: queue the end-of-backward callback (a
        backward may reach no unit output's hook), handle a replicate all-reduce in flight, and complete the
        reductions in flight before the unit's first gradient buffer is allocated ([Note: gradient reductions in
        flight])."""
        self._queue_callback()
        _check_not_in_flight(group, view_index)
        if group.grad_full is None:
            self._finish_issued_reduces()

    def _make_post_accumulate(self, unit: Unit, group, view_index: int):
        """Autograd accumulated a gradient into a full view: a first gradient (handed over by autograd) is copied into
        the view's slice of the gradient buffer, later ones were added in place ([Note: first gradient by copy] in
        flat_buffer.py); the arrival is counted, and the unit reduce-scattered or freed when that is its turn."""
        @compile_disable
        def hook(param):
            self._views_accumulated = True
            if group.grad_in_place(view_index):  # added into a slice an earlier gradient wrote (no replicate
                self._queue_callback()  # all-reduce can be in flight)
            else:
                self._before_buffer_write(group, view_index)
                group.ensure_grad_full()
                group.keep_grad_in_buffer(view_index)
            ready = unit.grad_arrived()
            if ready or unit.holds_frozen:
                self._reshard_if_done(unit)
            if ready:
                self._issue_ready_reduces()

        return hook

    def _make_fragment_pre_accumulate(self, group, index: int):
        """Autograd is about to accumulate a gradient into a fragment itself (a loss term computed from
        ``model.parameters()``): set the fragment's ``.grad`` aside so that the new gradient can be taken out."""
        @compile_disable
        def hook(grad):
            self._queue_callback()  # this backward may reach only fragments: every rank still runs its collectives
            group.stash_fragment_grad(index)

        return hook

    def _make_fragment_post_accumulate(self, group, index: int):
        """Autograd accumulated a direct gradient into a fragment (not in ``autograd.grad``, which accumulates
        nothing): take it out into the group's direct gradient and give the fragment its ``.grad`` back."""
        @compile_disable
        def hook(param):
            grad = group.unstash_fragment_grad(index)
            _check_not_in_flight(group, index)
            group.discard_if_reset()  # the user reset gradients since the last backward: drop that pending step
            group.add_direct_grad(index, grad)

        return hook

    def _direct_grads_expected(self) -> bool:
        """Whether the running backward will accumulate a gradient into any fragment (decided from its graph, the
        same at any moment of the backward)."""
        task = torch._C._current_graph_task_id()
        if self._direct_check[0] != task:
            frags = [f for u in self._reduce_order for g in u.trainable_groups for f in g.fragments if f.requires_grad]
            self._direct_check = (task, any(self._will_accumulate(f) for f in frags))
        return self._direct_check[1]

    def _will_accumulate(self, frag: nn.Parameter, strict: bool = False) -> bool:
        """Whether the running backward accumulates a gradient into the leaf ``frag`` (a fragment or a full view).
        Inside ``autograd.grad()``, which accumulates into no leaf: False, or with ``strict`` the RuntimeError."""
        node = self._grad_accumulators.get(id(frag))
        if node is None:
            node = self._grad_accumulators[id(frag)] = get_gradient_edge(frag).node
        try:
            return torch._C._will_engine_execute_node(node)
        except RuntimeError:  # inside autograd.grad(): it accumulates into no leaf
            if strict:
                raise
            return False

    def _gather_done(self, unit: Unit) -> bool:
        """Whether no all-gather of ``unit`` can follow in this backward (so it may be freed now)."""
        order = self._backward_order or []
        return unit not in order or order.index(unit) < self._gathers_issued

    # ---- reduce scheduling -------------------------------------------------------------------------------------
    def _issue_ready_reduces(self) -> None:
        if not self.requires_gradient_sync or self._creates_graph:
            return
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].reduce_state is ReduceState.READY:
            order[self._next_reduce].reduce_scatter()
            self._next_reduce += 1
            if self._overlapping(block=False):
                self._hand_off_syncs(self._next_reduce)
            # else: completed at the next fixed point ([Note: gradient reductions in flight]), not when it ends

    def _overlapping(self, block: bool) -> bool:
        """Whether this backward hands off its replicate all-reduces now: it was taken for the step's last, and no
        gradient may still reach a fragment directly in it (the direct gradients are part of what the all-reduce
        sums; while they may come, the hand-offs wait for the end of the backward, ``block``)."""
        return self._overlap and self.requires_gradient_sync and not self._creates_graph and (
            block or not self._direct_grads_expected())

    def _complete_reduces(self, upto: int) -> None:
        """For units ``[completed, upto)`` of the reduce order, in order: wait for the reduce-scatter, add it into the
        sharded gradient, free the full gradient buffer. Called at fixed points only (the end of backward,
        :meth:`_finish_issued_reduces`), so the buffers alive at any point of a backward do not depend on timing."""
        order = self._reduce_order
        while self._next_all_reduce < upto:
            groups = order[self._next_all_reduce].trainable_groups
            for g in groups:
                g.finish_reduce_scatter()
            self._next_all_reduce += 1

    def _finish_issued_reduces(self) -> None:
        """Complete the reduce-scatters issued in this backward, blocking (see [Note: one gradient reduction at a
        time]): finish them (add into the sharded gradient, free the full gradient buffers), or for those handed
        off, wait for their reduce-scatter part. Only those of units that every rank can reduce with the
        all-gathers this rank has issued (all their units at most that far in the backward order): a rank that
        reduced a unit early, because it got no gradient there, does not wait for the ranks that still need its
        all-gathers to compute it."""
        self._start_backward_order()
        safe = bisect.bisect_left(self._reduce_reach, self._gathers_issued)  # reach is non-decreasing
        upto = min(self._next_reduce - self.prefetch, safe)  # the last `prefetch` issued stay in flight
        if self._next_all_reduce < upto:
            self._complete_reduces(upto)
        for index, job in self._handed_off:
            if index < upto:
                job.wait_reduced()

    def _hand_off_syncs(self, upto: int) -> None:
        """Hand the replicate all-reduces of units ``[handed off, upto)`` of the reduce order to the sync queue, in
        that order, each right after its reduce-scatter was issued: a point fixed by the program on every rank (see
        [Note: overlapped replicate all-reduce] in ``replicate_sync.py``). Buffers whose replicate group carries other
        collectives stay for the step boundary."""
        while self._next_sync < upto:
            for g in self._reduce_order[self._next_sync].trainable_groups:
                job = g.hand_off_sync() if g.overlap_replicate else None
                if job is not None:
                    self._handed_off.append((self._next_sync, job))
                    self._sync_queue.submit(job)
                    self.handed_off_syncs += 1
            self._next_sync += 1
        self._next_all_reduce = max(self._next_all_reduce, upto)

    def _queue_callback(self) -> None:
        if not self._callback_queued and _in_backward():
            self._callback_queued = True
            self._creates_graph = torch.is_grad_enabled()  # create_graph=True: grad mode is on in its hooks
            self._overlap = self._is_last_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
            if self.requires_gradient_sync and not self._creates_graph:
                self._count_absent_grads()

    def _count_absent_grads(self) -> None:
        """Count as arrived the trainable full views that get no gradient in the starting backward (decided from
        its graph, so at the same point on every rank whatever gradients each gets), and issue the reduce-scatters
        this makes ready: a unit whose outputs got no gradient on this rank reduces in its turn, as on the ranks
        where they did, not at the end of backward ([Note: gradient reductions in flight]). Inside
        ``autograd.grad``, which accumulates into no leaf, nothing is counted (its reductions run at the end)."""
        ready = False
        for u in self._reduce_order:
            views = [v for g in u.trainable_groups for f, v in zip(g.fragments, g.full_views) if f.requires_grad]
            try:
                absent = sum(1 for v in views if not (v.requires_grad and self._will_accumulate(v, strict=True)))
            except RuntimeError:  # autograd.grad: no accumulation at all
                return
            if absent:
                ready |= u.grads_absent(absent, len(views))
        if ready:
            self._issue_ready_reduces()

    def _is_last_backward(self) -> bool:
        """Whether the starting backward is the last of its step: the user's ``set_is_last_backward`` if given,
        else predicted: the previous step had as many reducing backwards as this one will have counted with it
        (a constant number of micro-batches). No prediction before the first step boundary."""
        if self.is_last_backward is not None:
            return self.is_last_backward
        return self._backwards_last_step is not None and self._backwards_this_step + 1 == self._backwards_last_step

    @compile_disable
    def _post_backward(self) -> None:
        """End of backward: reduce-scatter what is left, in order, wait for all, free full buffers.

        A backward with ``create_graph=True`` frees nothing: every unit stays unsharded, because the graph it built
        holds views of the full buffers; the next backward without ``create_graph`` frees them at its end. This costs
        the memory of every gathered unit from the first backward to the end of the second. If it accumulated no
        gradient into the parameters (a gradient penalty's ``autograd.grad``), it reduces nothing either: its zero
        gradients are held as with gradient sync off. It never issues the replicate all-reduce early
        (``set_is_last_backward``): that is left to the next backward or the step boundary."""
        self._callback_queued = False
        creates_graph = self._creates_graph
        for u in self._reduce_order:  # before anything reads the fragments' .grad
            for g in u.trainable_groups:
                g.restore_fragment_grads()
        self._start_backward_order()
        self._issue_gathers(len(self._backward_order))  # as issued on ranks where those units got gradients
        self._backward_order = None  # rebuilt from _grad_order by a second backward over a retained graph
        reduced = self.requires_gradient_sync and (self._views_accumulated or not creates_graph)
        if reduced:
            order = self._reduce_order
            overlap = self._overlapping(block=True)
            if overlap:
                self._hand_off_syncs(self._next_reduce)  # issued while direct gradients could still come
            while self._next_reduce < len(order):
                order[self._next_reduce].reduce_scatter()
                self._next_reduce += 1
                if overlap:
                    self._hand_off_syncs(self._next_reduce)
            self._complete_reduces(len(order))
        self._next_reduce = self._next_all_reduce = self._next_sync = 0
        self._handed_off = []
        self._backwards_this_step += reduced
        for u in self.units:
            u.finish_backward(reduced=reduced)
        if reduced and not creates_graph and self._finalizes():
            self.wait_replicas()  # the gradients are final when this backward returns (as DDP and FSDP2 give them)
        self._graph_kept, self._creates_graph, self._views_accumulated = creates_graph, False, False
        for u in self.units:
            self._reshard(u)

    # ---- step boundary -----------------------------------------------------------------------------------------
    def release_kept_units(self) -> None:
        """Reshard the units kept unsharded after a create_graph backward (see ``_post_backward``): called before an
        optimizer step, which makes their full buffers stale (a graph built before the step is stale as well)."""
        if self._graph_kept or self.keep_gathered:  # keep_gathered: a pipeline step that did not end its backward
            self._graph_kept = self.keep_gathered = False
            for u in self.units:
                u.reshard()

    def reshard_all(self) -> None:
        """Reshard every unit (e.g. after a load, which makes gathered full buffers stale)."""
        for u in self.units:
            u.reshard()

    def _finalizes(self) -> bool:
        """Whether the backward ending now leaves the step's gradients final: the one taken for the step's last
        (``_overlap``: predicted, or ``set_is_last_backward(model, True)``), or, before the first step boundary
        (nothing to predict from) and without an override, every reducing backward."""
        if self._overlap:
            return True
        return self.is_last_backward is None and self._backwards_last_step is None

    def wait_replicas(self) -> None:
        """All-reduce this step's pending sharded gradients over their replicate groups, waiting for those already in
        flight, and publish them in the fragments' ``.grad`` (idempotent: nothing pending, nothing issued)."""
        self._sync_queue.join()  # before anything else is issued on a replicate group from this thread
        for u in self._reduce_order:
            for g in u.trainable_groups:
                g.sync_replicas()

    def finish_grad_sync(self) -> None:
        """The step boundary: :meth:`wait_replicas` (a no-op when the step's last backward already finished them), and
        remember how many reducing backwards the step had (the prediction of the next step's last one)."""
        self.wait_replicas()
        while self.step_waits:  # e.g. the all-reduce of a weight tied across pipeline stages (shardfusion.pipeline)
            self.step_waits.pop(0)()
        if self._backwards_this_step:
            self._backwards_last_step, self._backwards_this_step = self._backwards_this_step, 0


class _InputsGradDone(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward tells the scheduler that their gradients are computed, so
    the unit's frozen parameters are no longer needed by this graph. The node is recorded in the unit by a weak
    reference: a graph freed without a backward drops it."""

    @staticmethod
    def forward(ctx, scheduler, unit, *tensors):
        ctx.scheduler, ctx.unit = scheduler, unit
        unit.add_inputs_node(ctx)
        return tensors

    @staticmethod
    @compile_disable
    def backward(ctx, *grads):
        ctx.scheduler._inputs_grad_done(ctx.unit, ctx)
        return (None, None, *grads)


def _refuse_reentrant_recompute(unit: Unit) -> None:
    """Raise if ``unit`` runs again inside the backward of a reentrant activation checkpoint
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``): its backward runs a nested backward over the
    recomputed segment, whose end-of-backward callback would reduce-scatter every unit while the outer backward
    still has gradients to bring (found wrong by 25-100 %, differently from run to run). The non-reentrant checkpoint
    recomputes inside the one backward and is supported (docs/pytorch-habits.md, "Activation checkpointing").

    Raises:
        RuntimeError: on every rank that runs the checkpointed unit, naming it and the fix.
    """
    node = torch._C._current_autograd_node()
    if node is not None and type(node).__name__ == "CheckpointFunctionBackward":
        raise RuntimeError(
            f"unit {unit.name!r} is recomputed by a reentrant activation checkpoint "
            "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)), whose nested backward would reduce the "
            "gradients before the outer backward has brought them all; pass use_reentrant=False (torch's "
            "recommended form), which shardfusion supports")


def _check_not_in_flight(group, index: int) -> None:
    """A gradient arrives for ``group`` while its replicate all-reduce is in flight (a backward after the one taken
    for the step's last): if the user reset the gradients since, that pending step is dropped; else the new gradient
    goes to the buffer's late gradient, all-reduced at the step boundary (``FlatBuffer.sync_replicas``)."""
    if group.sync_in_flight:
        group.discard_if_reset()
