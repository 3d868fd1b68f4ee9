"""Gradient clipping by global norm over a sharded model.

Each element of the gradient is counted exactly once (DESIGN.md step 5, invariant 2): a rank adds the elements of its
shards only if it is replica index 0 of the group's replicate group (after the step's all-reduce all replicas hold the
same shard), and, for parameters replicated across model-parallel ranks, only on mp rank 0 (parameters marked
``tensor_model_parallel = True``, Megatron's convention, are distinct across mp and counted everywhere). Then one
all-reduce of one scalar over the world gives every rank the same norm; every rank takes part, even with no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion.fully_shard import _state


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of a sharded model in place so that their global norm is at most ``max_norm``.

    Finishes the step's gradient synchronization first (:func:`shardfusion.finish_grad_sync`). Scaling follows
    ``torch.nn.utils.clip_grad_norm_``: gradients are multiplied by ``min(1, max_norm / (norm + 1e-6))``.

    Args:
        model: a model passed to :func:`shardfusion.fully_shard`.
        max_norm: largest allowed norm (``float('inf')`` only measures).
        norm_type: ``2.0`` or ``float('inf')``.
        error_if_nonfinite: raise if the norm is nan or inf (on every rank, as the norm is the same everywhere).

    Returns:
        The total norm of the gradients before clipping: a 0-dim tensor (float64 if any gradient is float64, else
        float32), identical on every rank, on the device of the parameters. Only gradients the optimizer would see
        count: a fragment whose ``.grad`` is ``None`` counts as absent.

    Raises:
        ValueError: ``norm_type`` is not 2 or inf, or ``max_norm`` is negative or nan.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    state = _state(model)
    state.finish_grad_sync()
    groups = [g for u in state.units for g in u.trainable_groups]
    # What the optimizer will read: the fragments' .grad (None after zero_grad(set_to_none=True) is skipped).
    counted, scaled = [], []
    for g in groups:
        grads = [f.grad for f in g.fragments if f.grad is not None and f.grad.numel()]
        scaled.extend(grads)
        if g.counts_in_norm or norm_type == math.inf:
            counted.extend(grads)
    device = _norm_device(groups)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in scaled) else torch.float32
    local = torch.zeros((), dtype=dtype, device=device)
    if counted:
        norms = torch.stack([n.to(device, dtype) for n in torch._foreach_norm(counted, norm_type)])
        local = norms.pow(2).sum() if norm_type == 2.0 else norms.max()
    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    comm.all_reduce(local, dist.group.WORLD, op=op)  # every rank, even one without gradients (invariant 1)
    total = local.sqrt() if norm_type == 2.0 else local
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dev_dtype, same in _by_device_dtype(scaled).items():
        torch._foreach_mul_(same, coef.to(*dev_dtype))
    return total


def _norm_device(groups) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return groups[0].shard.device if groups else torch.device("cpu")


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    out: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out
