"""Gradient clipping by global norm over a sharded model.

Each element of the gradient is counted exactly once (docs/design.md, step 5 and invariant 2): a rank adds the
elements of a flat buffer's shard only where it holds the buffer's canonical copy (``FlatBuffer.is_primary``: replica
0 of the replicate group, which after the step's all-reduce holds the same shard as the other replicas, and, for
parameters replicated across model-parallel ranks, mp rank 0; parameters marked ``tensor_model_parallel = True``,
Megatron's convention, are distinct across mp and counted everywhere). Then one all-reduce of one scalar over the world
gives every rank the same norm; every rank takes part, even with no gradient.

``import shardfusion`` also makes torch's own ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (and the
same names in ``torch.nn.utils.clip_grad``) act on fragments correctly (:func:`install_torch_clip_wrappers`): given
fragments of sharded models they finish the step's gradient synchronization first and, for the norm, measure the
global norm as :func:`clip_grad_norm_` does. Given anything else they are torch's functions unchanged. A name bound
before ``import shardfusion`` (``from torch.nn.utils import clip_grad_norm_``) stays torch's original.
"""

from __future__ import annotations

import math
import types
import weakref
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.utils.clip_grad as _torch_clip_grad
from torch.utils._foreach_utils import _device_has_foreach_support

from shardfusion import comm
from shardfusion._runtime.state import flat_buffers, fragments_by_buffer, sharded_state

_Params = Union[torch.Tensor, Iterable[torch.Tensor]]

_COPIES: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # id -> fragment
"""Fragments whose gradient equals another fragment's elsewhere in the model (the last pipeline stage's copy of a
weight tied to the first stage's, ``shardfusion.pipeline``): clipped, not counted in the norm."""


def count_once(fragment: torch.Tensor) -> None:
    """Leave ``fragment``'s gradient out of the global norm (it is scaled still): another rank holds the same
    gradient under another parameter and counts it (a tied weight copied onto another pipeline stage)."""
    _COPIES[id(fragment)] = fragment


def clip_grad_norm_(
    model: Union[nn.Module, Sequence[nn.Module]], max_norm: float, norm_type: float = 2.0,
    error_if_nonfinite: bool = False, foreach: Optional[bool] = None,
) -> torch.Tensor:
    """Clip the gradients of a sharded model in place so that their global norm is at most ``max_norm``.

    ``model`` may be a list of sharded models: the pipeline stages this rank holds (every rank passes its own, one
    call on every rank); the norm is then over every stage of the pipeline, each element counted once.

    Finishes the step's gradient synchronization first (:func:`shardfusion.finish_grad_sync`). Scaling follows
    ``torch.nn.utils.clip_grad_norm_``: gradients are multiplied by ``min(1, max_norm / (norm + 1e-6))``.
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` gives the same result (see the module docstring).

    Args:
        model: a model passed to :func:`shardfusion.fully_shard`, or a list of them (e.g. the pipeline stages of
            this rank, ``shardfusion.pipeline``).
        max_norm: largest allowed norm (``float('inf')`` only measures).
        norm_type: the order p of the norm: a finite ``p > 0`` or ``float('inf')``.
        error_if_nonfinite: raise if the norm is nan or inf (on every rank, as the norm is the same everywhere).
        foreach: as in torch: ``None`` uses the foreach kernels where the device has them, ``True`` requires them,
            ``False`` works tensor by tensor.

    Returns:
        The total norm of the gradients before clipping: a 0-dim tensor (float64 if any gradient is float64, else
        float32), identical on every rank, on the device of the parameters. Only gradients the optimizer would see
        count: a fragment whose ``.grad`` is ``None`` counts as absent.

    Raises:
        ValueError: ``norm_type`` is not a finite positive number or inf, or ``max_norm`` is negative or nan.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite; ``foreach=True`` on a device without
            foreach kernels.
    """
    models = [model] if isinstance(model, nn.Module) else list(model)
    groups = [(b, b.fragments) for m in models for b in flat_buffers(m, trainable_only=True)]
    return _clip_fragment_grads([sharded_state(m) for m in models], groups, max_norm, norm_type, error_if_nonfinite,
                                foreach)


def _clip_fragment_grads(states: list, groups: list[tuple], max_norm: float, norm_type: float,
                         error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
    """Clip the ``.grad`` of the given fragments by their global norm. ``groups``: ``(FlatBuffer, fragments)`` pairs,
    the fragments being some of that group's; ``states``: the ``Scheduler`` of every model they belong to."""
    norm_type = float(norm_type)
    if not (norm_type == math.inf or 0.0 < norm_type < math.inf):
        raise ValueError(f"norm_type must be a finite number > 0 or inf, got {norm_type}")
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    for state in states:
        state.finish_grad_sync()
    # What the optimizer will read: the fragments' .grad (None after zero_grad(set_to_none=True) is skipped).
    # While replicate sync is off (DiLoCo's inner steps, shardfusion.diloco) each replica clips by its own norm:
    # counted once within the replica, summed over its ranks only (no traffic between replicas).
    alone = [g for g, _ in groups if not g.replicate_sync]
    if alone and len(alone) != len(groups):
        raise ValueError(f"clip_grad_norm_: {len(alone)} of {len(groups)} flat buffers have replicate sync off: "
                         f"clip models of one mode together (all DiLoCo inner steps, or all synchronous)")
    norm_group = alone[0].replica_group if alone else dist.group.WORLD
    counted, scaled = [], []
    for g, frags in groups:
        have = [f for f in frags if f.grad is not None and f.grad.numel()]
        scaled.extend(f.grad for f in have)
        if (g.is_replica_primary if alone else g.is_primary) or norm_type == math.inf:
            counted.extend(f.grad for f in have if _COPIES.get(id(f)) is not f)
    device = _norm_device([g for g, _ in groups])
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in scaled) else torch.float32
    local = torch.zeros((), dtype=dtype, device=device)
    if counted:
        norms = torch.stack([n.to(device, dtype) for n in _norms(counted, norm_type, foreach)])
        local = norms.max() if norm_type == math.inf else norms.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    comm.all_reduce(local, norm_group, op=op)  # every rank, even one without gradients: the same collectives
    total = local if norm_type == math.inf else local.sqrt() if norm_type == 2.0 else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (dev, dt), same in _by_device_dtype(scaled).items():
        if _use_foreach(dev, foreach):
            torch._foreach_mul_(same, coef.to(dev, dt))
        else:
            for t in same:
                t.mul_(coef.to(dev, dt))
    return total


def _norms(tensors: list[torch.Tensor], norm_type: float, foreach: Optional[bool]) -> list[torch.Tensor]:
    """The norm of each tensor (0-dim tensors), with torch's foreach kernels where ``foreach`` allows."""
    out = []
    for (dev, _), same in _by_device_dtype(tensors).items():
        if _use_foreach(dev, foreach):
            out.extend(torch._foreach_norm(same, norm_type))
        else:
            out.extend(torch.linalg.vector_norm(t, norm_type) for t in same)
    return out


def _use_foreach(device: torch.device, foreach: Optional[bool]) -> bool:
    if foreach is False:
        return False
    supported = _device_has_foreach_support(device)
    if foreach and not supported:
        raise RuntimeError(f"foreach=True was passed, but {device.type} tensors have no foreach kernels")
    return supported


def _norm_device(groups) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return groups[0].shard.device if groups else torch.device("cpu")


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    out: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


# ---- torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on fragments ---------------------------------------------
def _original(fn):
    return getattr(fn, "_sf_torch_original", fn)  # torch's function even if this module is imported again


_TORCH_CLIP_GRAD_NORM = _original(_torch_clip_grad.clip_grad_norm_)
_TORCH_CLIP_GRAD_VALUE = _original(_torch_clip_grad.clip_grad_value_)


def _as_list(parameters: _Params) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _clip_grad_norm_(parameters: _Params, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, made aware of shardfusion fragments (installed by ``import shardfusion``).

    When ``parameters`` are fragments of sharded models (e.g. ``model.parameters()`` after ``fully_shard``): the
    global norm over exactly those parameters, as :func:`shardfusion.clip_grad_norm_` measures it (the step's
    gradient synchronization finished first, each element counted once, one all-reduce of one scalar over the
    world: every rank must call it with the same parameters), identical on every rank; then the gradients are
    scaled by ``min(1, max_norm / (norm + 1e-6))``. Otherwise torch's own function.

    Raises:
        ValueError: ``parameters`` mixes fragments with parameters that are not sharded (clip them separately);
            ``norm_type`` or ``max_norm`` out of range (see :func:`shardfusion.clip_grad_norm_`).
    """
    is_generator = isinstance(parameters, types.GeneratorType)
    params = _as_list(parameters)
    states, groups = fragments_by_buffer(params)
    if not states:
        return _TORCH_CLIP_GRAD_NORM((p for p in params) if is_generator else params, max_norm, norm_type,
                                     error_if_nonfinite, foreach)  # a generator again: torch warns if empty
    fragments = sum(len(frags) for _, frags in groups)
    if fragments != len(params):
        raise ValueError(
            f"clip_grad_norm_: parameters holds {fragments} shardfusion fragments and {len(params) - fragments} "
            "tensors that are not sharded; their norm cannot be combined (which ranks hold copies of the others is "
            "unknown). Clip each model separately, e.g. shardfusion.clip_grad_norm_(sharded_model, max_norm)")
    return _clip_fragment_grads(states, groups, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_grad_value_(parameters: _Params, clip_value: float, foreach: Optional[bool] = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, made aware of shardfusion fragments (installed by ``import shardfusion``).

    Clamping is elementwise, so each rank clamps its own shard; for the fragments among ``parameters`` the step's
    gradient synchronization (the replicate all-reduce) is finished first, so that the clamped values are the
    step's full gradient (collective when fragments are given: every rank must call it). Then torch's function.
    """
    params = _as_list(parameters)
    for state in fragments_by_buffer(params)[0]:
        state.finish_grad_sync()
    return _TORCH_CLIP_GRAD_VALUE(params, clip_value, foreach)


def install_torch_clip_wrappers() -> None:
    """Bind ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (and the same names in
    ``torch.nn.utils.clip_grad``, which torch's deprecated ``clip_grad_norm`` calls) to the fragment-aware
    versions above. Idempotent; called by ``import shardfusion``."""
    for module in (torch.nn.utils, _torch_clip_grad):
        module.clip_grad_norm_ = _clip_grad_norm_
        module.clip_grad_value_ = _clip_grad_value_


_clip_grad_norm_._sf_torch_original = _TORCH_CLIP_GRAD_NORM
_clip_grad_value_._sf_torch_original = _TORCH_CLIP_GRAD_VALUE
