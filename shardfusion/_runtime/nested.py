"""Nested ``fully_shard`` calls: a call on a module that contains modules sharded by earlier calls absorbs them.

Each absorbed module gets its parameters back in full (collective), loses its hooks and its runtime state, and hands
its units to the new call: the earlier root becomes a unit that reshards after forward under the earlier call's
``reshard_policy`` / ``reshard_filter``; its other units keep their setting. The earlier calls must have used the
same options as the new one but for the reshard policy (:data:`~shardfusion._runtime.wrap.MUST_AGREE`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.optimizer_hook import REPLACED_PARAMS
from shardfusion._runtime.state import detach, is_sharded, sharded_state
from shardfusion._runtime.unit import Unit
from shardfusion._runtime.wrap import MUST_AGREE, WrapOptions, reshards_after_forward


def sharded_submodules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, module)]`` of the submodules an earlier ``fully_shard`` call sharded."""
    return [(name, m) for name, m in model.named_modules() if m is not model and is_sharded(m)]


def check_nested_options(model: nn.Module, inner: list[tuple[str, nn.Module]], options: WrapOptions) -> None:
    """Each already sharded submodule was wrapped with the same options as this call (but the reshard policy).

    Raises:
        ValueError: naming the submodule and the option that differs, with both values.
    """
    for name, sub in inner:
        theirs = sharded_state(sub).wrap_options
        for field in MUST_AGREE:
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


def absorb(prefix: str, sub: nn.Module) -> list[tuple[str, list, bool]]:
    """Undo the earlier ``fully_shard`` call on ``sub`` (at ``prefix`` in the model being sharded) and return its
    units as ``(name, modules, reshard_after_forward)`` for this call.

    Collective over each flat buffer's shard group (all-gathers, in unit order, the same on every rank): every
    parameter gets its full values back (the original ``nn.Parameter`` if it is still alive, else a new one with its
    attributes), its hooks are removed and ``sub`` is no longer sharded. The earlier root unit becomes a unit whose
    reshard-after-forward follows the earlier call's ``reshard_policy`` and ``reshard_filter`` (called with
    ``prefix``); the other units keep their setting.
    """
    state = detach(sub)
    state.remove_hooks()
    specs = []
    for unit in state.units:
        unit.reshard()
        _restore_parameters(unit, prefix)
        if unit is state.units[0]:
            specs.append((prefix, [sub], reshards_after_forward(state.wrap_options, prefix, sub)))
        else:
            specs.append((f"{prefix}.{unit.name}", unit.modules, unit.reshard_after_forward))
    return specs


def _restore_parameters(unit: Unit, prefix: str) -> None:
    """Register full-shape parameters with the unit's current values in place of its fragments (collective)."""
    for buffer, regs in zip(unit.groups, unit.registrations):
        full = buffer.gather_copy()  # (P,)
        for slot, frag, places, original, attrs, spec in zip(buffer.layout.slots, buffer.fragments, regs,
                                                             buffer.originals, buffer.param_attrs, buffer.tp_specs):
            value = full[slot.offset:slot.end].view(slot.shape)  # a DTensor parameter: this rank's piece
            param = original()
            if param is None or param.is_meta:  # freed, or the meta placeholder of a meta-device build
                param = tp.as_param(value.clone(), spec, frag.requires_grad)
                param.__dict__.update(attrs)
            else:  # still alive: e.g. tied to a module outside ``sub``, which must keep sharing it
                with torch.no_grad():
                    tp.local(param).copy_(value)
                param.requires_grad_(frag.requires_grad)
            for module, attr in places:
                module._parameters[attr] = param
            REPLACED_PARAMS[frag] = f"{prefix}.{slot.name}"
        del full
