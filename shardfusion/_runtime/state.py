"""The one accessor for a sharded model's runtime state.

``fully_shard`` attaches a model's :class:`~shardfusion._runtime.scheduler.Scheduler` here (:func:`attach`) and a
later call that absorbs the model takes it off (:func:`detach`); the public API, clipping, state dicts and checkpoints
reach the flat buffers and fragments through :func:`sharded_state`, :func:`flat_buffers`, :func:`named_fragments`,
:func:`fragment_holders` and :func:`fragments_by_buffer`, never through the model's attributes, its units or their buffers' lists.
The Scheduler is typed here as :class:`RuntimeState`, what this module reads of it, not imported: ``scheduler``
imports modules that import this one."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Protocol, Sequence

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:  # annotations only; neither module imports this one, directly or through others
    from shardfusion._runtime.flat_buffer import FlatBuffer
    from shardfusion._runtime.unit import Unit


class RuntimeState(Protocol):
    """A sharded model's runtime state, the :class:`~shardfusion._runtime.scheduler.Scheduler` that ``fully_shard``
    attaches; this module reads only its units (the root unit first)."""

    units: Sequence["Unit"]

STATE_ATTR = "_sf_state"
"""The attribute of a sharded model that holds its :class:`~shardfusion._runtime.scheduler.Scheduler`."""

# fragment parameter -> the Scheduler of its model (for the optimizer step pre-hook and torch's clip functions).
_FRAGMENT_OWNER = WeakIdKeyDictionary()
# submodule of a sharded model -> (class name of that model, the submodule's qualified name), to refuse wrapping a
# module inside an already sharded one.
_INSIDE: "weakref.WeakKeyDictionary[nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class NamedFragment:
    """This rank's fragment of one parameter of a sharded model.

    Attributes:
        name: the parameter's first qualified name, relative to the sharded model.
        param: the fragment, an ``nn.Parameter`` view of ``buffer.shard`` of shape ``(numel // row,
            *shape[1:])`` (``layout.fragment_shape``: whole rows; a 0-d parameter ``(1,)`` or ``(0,)``); in an owner
            layout (``buffer.owner_layout``, ``whole_params``) the parameter's shape on its owner, ``(0,
            *shape[1:])`` elsewhere.
        shape: the parameter's full shape.
        offset: start of the fragment in the flattened parameter, in elements (a multiple of the row,
            ``prod(shape[1:])``).
        numel: the fragment's length in elements (0 allowed).
        shard_index: the shard this rank holds (0 for a buffer kept whole or without elements).
        buffer: the :class:`~shardfusion._runtime.flat_buffer.FlatBuffer` holding it (``is_expert``, ``is_primary``).
        tp_spec: for a tensor-parallel (DTensor) parameter, its
            :class:`~shardfusion._runtime.tensor_parallel.TensorParallelSpec`: then ``shape`` and ``offset`` are
            those of this mp rank's local piece, and ``tp_spec.shape`` is the global shape; ``None`` otherwise.
    """

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    offset: int
    numel: int
    shard_index: int
    buffer: "FlatBuffer"
    tp_spec: object = None


def attach(model: nn.Module, state: "RuntimeState") -> None:
    """Make ``state`` the runtime state of ``model`` (the end of ``fully_shard``): its fragments know their owner, its
    submodules know they are inside a sharded model."""
    setattr(model, STATE_ATTR, state)
    for buffer in _buffers(state):
        for frag in buffer.fragments:
            _FRAGMENT_OWNER[frag] = state
    for name, m in model.named_modules():
        if m is not model:
            _INSIDE[m] = (type(model).__name__, name)


def detach(model: nn.Module) -> "RuntimeState":
    """Take the runtime state off ``model`` (a later ``fully_shard`` call absorbs it) and return it.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    state = sharded_state(model)
    delattr(model, STATE_ATTR)
    return state


def sharded_state(model: nn.Module) -> "RuntimeState":
    """The runtime state of a model passed to ``fully_shard``.

    Raises:
        ValueError: ``model`` was not passed to :func:`shardfusion.fully_shard`.
    """
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not sharded: pass it to shardfusion.fully_shard first")
    return state


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` itself was passed to ``fully_shard`` (and not absorbed by a later call)."""
    return getattr(model, STATE_ATTR, None) is not None


def sharded_ancestor(module: nn.Module) -> Optional[tuple[str, str]]:
    """``(class name of the sharded model, qualified name of module in it)`` if ``module`` is a submodule of a model
    passed to ``fully_shard``, else ``None``."""
    return _INSIDE.get(module)


def flat_buffers(model: nn.Module, trainable_only: bool = False) -> Iterator["FlatBuffer"]:
    """Every flat buffer of a sharded model, in unit order (the root unit first), each unit's in layout order.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    return _buffers(sharded_state(model), trainable_only)


def named_fragments(model: nn.Module) -> Iterator[NamedFragment]:
    """This rank's fragment of every parameter of a sharded model (empty ones included), in the order of
    :func:`flat_buffers`, each buffer's in layout order; a tied parameter once.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    for buffer in flat_buffers(model):
        for param, frag, spec in zip(buffer.fragments, buffer.layout.fragments(buffer.shard_index), buffer.tp_specs):
            yield NamedFragment(frag.slot.name, param, tuple(frag.slot.shape), frag.param_offset, frag.numel,
                                buffer.shard_index, buffer, spec)


def fragment_holders(model: nn.Module) -> list[nn.Module]:
    """The modules in which a sharded model's fragments are registered, each once, in unit and layout order.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    holders: dict[int, nn.Module] = {}
    for unit in sharded_state(model).units:
        for regs in unit.registrations:
            for places in regs:
                for module, _attr in places:
                    holders.setdefault(id(module), module)
    return list(holders.values())


def fragment_registrations(model: nn.Module) -> list[tuple[dict, str, nn.Parameter]]:
    """Every place a sharded model's fragments are registered: ``(module._parameters, attribute, fragment)``, in
    unit and layout order (a tied parameter once per place).

    Raises:
        ValueError: ``model`` is not sharded.
    """
    return [(params, attr, frag) for unit in sharded_state(model).units
            for params, attr, frag, *_ in unit._registered]


def fragments_by_buffer(
        params: Iterable[torch.Tensor]) -> tuple[list["RuntimeState"], list[tuple["FlatBuffer", list]]]:
    """The fragments among ``params``: the sharded models' states they belong to (in order of first appearance) and
    ``(FlatBuffer, [its fragments among params])`` pairs; both lists are empty when none is a fragment."""
    params = list(params)
    states: dict[int, "RuntimeState"] = {}
    for p in params:
        s = _FRAGMENT_OWNER.get(p)
        if s is not None:
            states.setdefault(id(s), s)
    buffer_of = {id(f): b for s in states.values() for b in _buffers(s) for f in b.fragments}
    pairs: dict[int, tuple] = {}
    for p in params:
        b = buffer_of.get(id(p))
        if b is not None:
            pairs.setdefault(id(b), (b, []))[1].append(p)
    return list(states.values()), list(pairs.values())


def fragment_owner(param: torch.Tensor) -> Optional["RuntimeState"]:
    """The runtime state of the sharded model whose fragment ``param`` is, else ``None``."""
    return _FRAGMENT_OWNER.get(param)


def _buffers(state: "RuntimeState", trainable_only: bool = False) -> Iterator["FlatBuffer"]:
    for unit in state.units:
        yield from (unit.trainable_groups if trainable_only else unit.groups)
