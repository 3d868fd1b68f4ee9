"""The one accessor for a sharded model's runtime state, used by the public API, clipping, state dicts and
checkpoints: they reach the flat buffers through it, never through the model's attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch.nn as nn

if TYPE_CHECKING:
    from shardfusion._runtime.flat_buffer import FlatBuffer
    from shardfusion._runtime.scheduler import Scheduler

STATE_ATTR = "_sf_state"
"""The attribute of a sharded model that holds its :class:`~shardfusion._runtime.scheduler.Scheduler`."""


def sharded_state(model: nn.Module) -> "Scheduler":
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


def flat_buffers(model: nn.Module, trainable_only: bool = False) -> Iterator["FlatBuffer"]:
    """Every flat buffer of a sharded model, in unit order (the root unit first), each unit's in layout order.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    for unit in sharded_state(model).units:
        yield from (unit.trainable_groups if trainable_only else unit.groups)
