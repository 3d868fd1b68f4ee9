"""Loss scaling on a sharded model: ``torch.amp.GradScaler`` steps or skips alike on every rank.

A scaler skips the optimizer step when a gradient holds an inf or a NaN (``found_inf``). Each rank checks only the
gradients it holds, its fragments, so on a sharded model one rank can find an inf that the others do not see: its
step is skipped and its scale backed off while the others step, and the replicas drift apart or the next collective
hangs. FSDP's ``ShardedGradScaler`` agrees on ``found_inf`` with one all-reduce over its process group.
``import shardfusion`` gives ``torch.amp.GradScaler`` (and ``torch.cuda.amp.GradScaler``, a subclass) the same
agreement when the optimizer holds fragments of a sharded model (:func:`install_grad_scaler_sync`):

- first, the step's gradient synchronization is finished (:func:`shardfusion.finish_grad_sync`, a no-op when the
  step's last backward already did it), so every rank checks final gradients;
- the per-device ``found_inf`` flags are summed into one scalar (fp32, 0 or more), all-reduced with ``MAX`` over the
  default process group (every rank of the job: each holds fragments of the model), and written back: every rank
  then skips or steps alike, and ``update()`` sets the same scale everywhere.

The all-reduce is collective: ``scaler.unscale_(optimizer)`` (or ``scaler.step(optimizer)``, which calls it) must run
on every rank, as the optimizer step does. Optimizers holding no fragment are left to torch's own code. Torch's
``ShardedGradScaler`` overrides the method this wraps and keeps its own agreement, which is right on fragments too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfusion import comm
from shardfusion._runtime.state import fragment_owner

try:
    from torch.amp.grad_scaler import GradScaler as _GradScaler
except ImportError:  # torch < 2.3: the scaler lives in torch.cuda.amp only
    _GradScaler = None


def _original(fn):
    return getattr(fn, "_sf_torch_original", fn)  # torch's method even if this module is imported again


_TORCH_UNSCALE_GRADS = _original(_GradScaler._unscale_grads_) if _GradScaler is not None else None


def _sharded_states(optimizer: torch.optim.Optimizer) -> list:
    states = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            s = fragment_owner(p)
            if s is not None:
                states[id(s)] = s
    return list(states.values())


def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
    """``GradScaler._unscale_grads_`` with ``found_inf`` agreed over the ranks (see the module docstring)."""
    states = _sharded_states(optimizer)
    for s in states:
        s.finish_grad_sync()
    per_device = _TORCH_UNSCALE_GRADS(self, optimizer, inv_scale, found_inf, allow_fp16)
    if not states or not dist.is_initialized():
        return per_device
    device = found_inf.device
    with torch.no_grad():
        flag = torch.zeros((), dtype=torch.float32, device=device)  # () 0 or the number of devices with an inf
        for v in per_device.values():
            flag += v.to(device=device, dtype=torch.float32)
        work = comm.all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MAX, async_op=True)
        if work is not None:
            comm.wait(work, "all_reduce of GradScaler's found_inf (scaler.unscale_ / scaler.step must run on every "
                            "rank)")
        if not per_device:  # no gradient on this rank: still record the agreed flag, as update() needs one
            per_device[device] = found_inf
        for v in per_device.values():
            v.copy_(flag.to(v.dtype).clamp_(max=1.0))
    return per_device


def install_grad_scaler_sync() -> None:
    """Bind ``torch.amp.GradScaler._unscale_grads_`` to the fragment-aware :func:`_unscale_grads_` (idempotent)."""
    if _GradScaler is not None:
        _GradScaler._unscale_grads_ = _unscale_grads_


_unscale_grads_._sf_torch_original = _TORCH_UNSCALE_GRADS
