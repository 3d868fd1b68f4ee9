"""A unit: the parameters gathered and reduced together, and its state machine.

A unit owns one :class:`~shardfusion._runtime.flat_buffer.FlatBuffer` per kind of parameter (see [Note: flat buffer
tensors] in ``flat_buffer.py``) and the places in the modules where its parameters are registered. Its sharded state
says which tensors the modules see:

- ``SHARDED``: the modules' attributes resolve to the fragments (this rank's rows of each parameter, what the
  optimizer updates).
- ``UNSHARDED``: the modules' attributes resolve to full-shape views of the all-gathered buffers (forward and
  backward run on them).

The fragments stay registered in ``module._parameters`` at all times, so ``model.parameters()`` and
``model.state_dict()`` always yield them, even between a forward and its backward. While unsharded, each full view
is put in the module's instance ``__dict__`` under the parameter's name, which Python's attribute lookup finds before
``nn.Module.__getattr__`` reads ``_parameters``: ``module.weight`` is then the full view.

Per backward, a unit with trainable parameters goes IDLE -> (gradients arrive) -> READY (every trainable view got
its gradient) -> REDUCING (reduce-scatter issued) -> IDLE (flushed at the end of backward).
"""

from __future__ import annotations

import enum
import weakref

import torch.nn as nn

from shardfusion._runtime.flat_buffer import FlatBuffer


class ShardedState(enum.Enum):
    """Which tensors the modules of a unit hold."""

    SHARDED = enum.auto()  # fragments registered; full buffers freed
    UNSHARDED = enum.auto()  # full-shape views registered; full buffers alive


class ReduceState(enum.Enum):
    """Progress of a unit's gradients within one backward."""

    IDLE = enum.auto()  # no gradient handled yet in this backward
    READY = enum.auto()  # every trainable view has its gradient; waiting its turn to reduce-scatter
    REDUCING = enum.auto()  # reduce-scatter issued, not yet finished


class Unit:
    """One unit of a sharded model.

    Attributes:
        name: qualified name of the unit's first module (``""`` for the root unit).
        modules: the modules whose forward hooks drive this unit (one for a class unit; several consecutive
            siblings for a unit built from ``comm_unit_size``; the model itself for the root unit).
        param_names: names of the unit's parameters (first registered name of each), in flat order.
        groups: the unit's flat buffers.
        reshard_after_forward: whether the full buffers are freed after forward (else kept until backward ends).
    """

    def __init__(self, name: str, modules: list[nn.Module], reshard_after_forward: bool) -> None:
        self.name = name
        self.modules = modules
        self.reshard_after_forward = reshard_after_forward
        self.param_names: list[str] = []
        self.groups: list[FlatBuffer] = []
        # For each group, for each slot: the (module, attribute) places the parameter is registered under.
        self.registrations: list[list[list[tuple[nn.Module, str]]]] = []
        # (module._parameters, attribute, fragment, its data_ptr, shard, name) of every registration (check_fragments)
        self._registered: list[tuple] = []
        self.state = ShardedState.SHARDED
        self.reduce_state = ReduceState.IDLE
        self.ran_forward = False
        self._grads_arrived = 0
        self._grads_expected = 0
        # Frozen parameters (a frozen buffer, or views frozen after wrapping) may be read by backward after every
        # trainable gradient has arrived (the gradient of the unit's inputs needs the weight): such a unit is freed
        # in backward only once the gradients of its inputs exist. ``holds_frozen`` is set at each unshard; the
        # pending input registrations are weak references to the autograd nodes that fire then (see
        # ``Scheduler._register_inputs_grad``), dead once their graph is freed (a forward never backpropagated).
        self.holds_frozen = False
        self._inputs_pending: dict[int, weakref.ref] = {}
        self._inputs_registered = False

    def add_group(self, group: FlatBuffer, registrations: list[list[tuple[nn.Module, str]]]) -> None:
        """Attach a flat buffer and register its fragments in the modules."""
        self.groups.append(group)
        self.registrations.append(registrations)
        self.param_names.extend(s.name for s in group.layout.slots)
        for slot, frag, places in zip(group.layout.slots, group.fragments, registrations):
            for module, attr in places:
                module._parameters[attr] = frag
                self._registered.append((module._parameters, attr, frag, frag.data_ptr(), group.shard, slot.name))

    def check_fragments(self) -> None:
        """Raise if the model was cast or moved since its fragments were registered: each must still be the module's
        parameter and a view of its shard (same storage, dtype and device).

        Raises:
            ValueError: a parameter was replaced (``.to(dtype)``, ``.double()``, ``.half()``, ``.to(device)``).
        """
        for params, attr, frag, ptr, shard, name in self._registered:
            now = params.get(attr)
            if now is not frag or frag.dtype != shard.dtype or frag.data_ptr() != ptr:
                now = frag if now is None else now
                raise ValueError(
                    f"parameter {name!r} is no longer a view of its shard: it is {now.dtype} on {now.device}, its "
                    f"shard {shard.dtype} on {shard.device}. The model was cast or moved after fully_shard (e.g. "
                    "model.to(torch.float64), .double(), .half(), .to(device)), which replaces the fragments. Cast "
                    "or move the model before calling fully_shard (for low-precision compute pass "
                    "mp_policy=MixedPrecisionPolicy(param_dtype=...))")

    @property
    def trainable_groups(self) -> list[FlatBuffer]:
        """The flat buffers that hold trainable parameters."""
        return [g for g in self.groups if g.requires_grad]

    @property
    def is_unsharded(self) -> bool:
        """Whether the modules hold full views or a gathered (or in-flight) full buffer of this unit is alive."""
        return self.state is ShardedState.UNSHARDED or any(
            g.gather_in_flight or (g.is_unsharded and g.full is not g.shard) for g in self.groups)

    # ---- transitions -------------------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Issue the asynchronous all-gathers of every flat buffer (no-op when already gathered or in flight)."""
        for g in self.groups:
            g.unshard(async_op=True, keep_secondary=self.reshard_after_forward)

    def unshard(self) -> None:
        """SHARDED -> UNSHARDED: complete the all-gathers and register the full-shape views."""
        for g in self.groups:
            g.unshard(async_op=False, keep_secondary=self.reshard_after_forward)
        if self.state is ShardedState.SHARDED:
            self._sync_requires_grad()
            self._put(use_full=True)
            self.state = ShardedState.UNSHARDED

    def reshard(self, keep_secondary: bool = False) -> None:
        """UNSHARDED -> SHARDED: register the fragments again and free the full buffers; ``keep_secondary`` (after
        forward) keeps their secondary copies ([Note: secondary shard] in ``secondary_shard.py``)."""
        if self.state is ShardedState.UNSHARDED:
            self._put(use_full=False)
            self.state = ShardedState.SHARDED
        for g in self.groups:
            g.reshard(keep_secondary=keep_secondary)

    def grad_arrived(self, count: int = 1) -> bool:
        """Count ``count`` accumulated gradients; returns True when the unit just became READY."""
        self._grads_arrived += count
        if self._grads_arrived == self._grads_expected and self.reduce_state is ReduceState.IDLE:
            self.reduce_state = ReduceState.READY
            return True
        return False

    def grads_absent(self, absent: int, expected: int) -> bool:
        """At the start of a backward: of the unit's ``expected`` trainable views, ``absent`` get no gradient in it
        (decided from its graph); they count as arrived. Returns True when the unit just became READY."""
        self._grads_expected = expected
        return self.grad_arrived(absent)

    def reduce_scatter(self) -> None:
        """Issue the reduce-scatter of every trainable flat buffer (asynchronous)."""
        for g in self.trainable_groups:
            g.reduce_scatter()
        self.reduce_state = ReduceState.REDUCING

    def finish_backward(self, reduced: bool) -> None:
        """End of a backward: with ``reduced``, complete the reduce-scatters and free the gradient buffers (else
        they stay alive and keep accumulating, gradient sync being off); reset the per-backward state."""
        for g in self.trainable_groups:
            if reduced:
                g.finish_reduce_scatter()
                g.fold_direct_grad()
            else:
                g.hold_grads()
        self.reduce_state = ReduceState.IDLE
        self._grads_arrived = 0
        self.ran_forward = False
        self._inputs_registered = bool(self._live_inputs())

    # ---- frozen parameters in backward ---------------------------------------------------------------------------
    def add_inputs_node(self, node) -> None:
        """Record an autograd node over this unit's forward inputs that fires once their gradients are computed."""
        self._inputs_pending[id(node)] = weakref.ref(node)
        self._inputs_registered = True

    def inputs_node_fired(self, node) -> None:
        """The gradients of the inputs recorded by ``node`` have been computed."""
        self._inputs_pending.pop(id(node), None)

    def _live_inputs(self) -> list:
        self._inputs_pending = {k: r for k, r in self._inputs_pending.items() if r() is not None}
        return list(self._inputs_pending)

    def backward_done(self) -> bool:
        """Whether this backward can no longer read this unit's full buffers: every trainable view got its gradient
        and, if the unit holds frozen parameters, the gradients of its inputs have been computed (a unit whose inputs
        need no gradient keeps them until the end of backward)."""
        if self._grads_arrived < self._grads_expected:
            return False
        if not self.holds_frozen:
            return self._grads_expected > 0
        return self._inputs_registered and not self._live_inputs()

    def _sync_requires_grad(self) -> None:
        """Give each full view the ``requires_grad`` of its fragment (the user may freeze after wrapping).

        Raises:
            RuntimeError: a parameter that was frozen when ``fully_shard`` ran has been unfrozen (it has no gradient
                buffer); freeze or unfreeze before wrapping instead.
        """
        expected = 0
        frozen = False
        for g in self.groups:
            for slot, frag, view in zip(g.layout.slots, g.fragments, g.full_views):
                frozen |= not frag.requires_grad and slot.numel > 0 and g.full is not g.shard
                if not g.requires_grad:
                    if frag.requires_grad:
                        raise RuntimeError(
                            f"parameter {slot.name!r} was frozen when fully_shard ran and has been unfrozen since; "
                            "set requires_grad before calling fully_shard")
                    continue
                if view.requires_grad != frag.requires_grad:
                    view.requires_grad_(frag.requires_grad)
                expected += frag.requires_grad
        self._grads_expected = expected
        self.holds_frozen = frozen

    def _put(self, use_full: bool) -> None:
        for g, regs in zip(self.groups, self.registrations):
            for view, places in zip(g.full_views, regs):
                for module, attr in places:
                    if use_full:
                        module.__dict__[attr] = view
                    else:
                        module.__dict__.pop(attr, None)
