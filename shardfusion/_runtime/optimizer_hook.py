"""The step boundary on the optimizer's side: a global ``torch.optim`` step pre-hook.

Before any optimizer steps, it refuses, on every rank and before anything else, an optimizer that holds parameters
``fully_shard`` replaced (built before wrapping), one that is not element-wise (``_NOT_ELEMENTWISE``), or a matrix
optimizer (``_MATRIX``: Muon) holding fragments that are not whole (only ``whole_params`` keeps a parameter whole on
its owner rank); then it finishes the gradient synchronization of every sharded model the optimizer holds fragments
of.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from shardfusion._runtime import optimizer_state_dict
from shardfusion._runtime.state import fragment_owner, fragments_by_buffer

# parameter that fully_shard replaced by fragments (the originals, and the fragments of an absorbed nested call) ->
# its qualified name, so that an optimizer still holding one is refused instead of silently updating nothing.
REPLACED_PARAMS = WeakIdKeyDictionary()
# Optimizers that read a parameter's shape or all parameters together: wrong on fragments (some rows of each tensor).
_NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "SparseAdam")
                         if hasattr(torch.optim, name))
# Optimizers that update each matrix as a whole (torch >= 2.9 has Muon): right on fragments of whole_params only,
# which are whole on their owner and empty elsewhere.
_MATRIX = tuple(getattr(torch.optim, name) for name in ("Muon",) if hasattr(torch.optim, name))
_ELEMENTWISE_NAMES = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD", "NAdam",
                      "RAdam")
_OPTIMIZER_HOOK = None


def _optimizer_pre_step(optimizer, args, kwargs) -> None:
    """Before any ``torch.optim`` step: refuse what cannot work on fragments, then finish the gradient sync of every
    sharded model the optimizer holds fragments of.

    The refusals come before anything collective or local in the step, and depend only on the optimizer (the same on
    every rank), so every rank raises alike.

    Raises:
        ValueError: the optimizer holds a parameter that ``fully_shard`` replaced (built before wrapping); or it holds
            fragments and is not element-wise (``LBFGS``, ``Adafactor``, ``SparseAdam`` or a subclass); or it is
            ``Muon`` (or a subclass) and holds a fragment of a parameter that ``whole_params`` did not choose.
    """
    states = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in REPLACED_PARAMS:  # first: an absorbed nested call's fragments are replaced too
                raise ValueError(
                    f"{type(optimizer).__name__} holds parameter {REPLACED_PARAMS[p]!r} (shape {tuple(p.shape)}) from "
                    "before fully_shard, which replaced every parameter by a fragment of its shard: this optimizer "
                    "would update tensors the model no longer uses. Build the optimizer after fully_shard, from "
                    "model.parameters()")
            s = fragment_owner(p)
            if s is not None:
                states[id(s)] = s
    if states and isinstance(optimizer, _NOT_ELEMENTWISE):
        raise ValueError(
            f"{type(optimizer).__name__} is not supported on a sharded model: it reads each parameter's shape or all "
            "parameters together, but after fully_shard each rank's parameters are fragments of a flat shard "
            "(some rows of the original tensors, possibly none). Use an element-wise optimizer: "
            f"{', '.join(_ELEMENTWISE_NAMES)}, or Muon on parameters kept whole by fully_shard(whole_params=...)")
    if states and isinstance(optimizer, _MATRIX):
        _check_whole(optimizer)
    if states:
        optimizer_state_dict.install(optimizer)  # its state_dict() in full-shape DTensors: optimizer_state_dict.py
    for s in states.values():
        s.finish_grad_sync()
        s.release_kept_units()


def _check_whole(optimizer) -> None:
    """Every fragment a matrix optimizer holds is of a parameter kept whole on its owner (``whole_params``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _, pairs = fragments_by_buffer(params)
    for buffer, frags in pairs:
        if not buffer.owner_layout:
            names = [s.name for s, f in zip(buffer.layout.slots, buffer.fragments) if any(f is q for q in frags)]
            raise ValueError(
                f"{type(optimizer).__name__} holds {names[:3]}{' ...' if len(names) > 3 else ''} of unit "
                f"{buffer.unit_name!r}, which fully_shard split by rows across ranks: a matrix optimizer "
                "needs each matrix whole. Pass whole_params=f to fully_shard, with f(name, param) true for the "
                "matrices this optimizer updates (docs/whole-params.md)")


def install_optimizer_hook() -> None:
    """Register :func:`_optimizer_pre_step` as a global optimizer step pre-hook, once per process."""
    global _OPTIMIZER_HOOK
    if _OPTIMIZER_HOOK is None:
        _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_optimizer_pre_step)
