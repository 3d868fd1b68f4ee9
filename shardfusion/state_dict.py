"""Full (unsharded) state dicts of a sharded model, for tests, export and inspection.

State dicts of a sharded model, in short (details: [Note: local state dicts] in ``local_state_dict.py``):

- ``model.state_dict()``: this rank's fragments (its rows of each parameter) under the original names, plus the
  buffers; cheap, local. Its ``_metadata`` (kept by ``torch.save``) records the rank, the world size and a digest
  of this rank's layout.
- :func:`full_state_dict`: every parameter in its full shape, on every rank (collective); loads into a plain model
  and into a sharded model of any layout.
- ``model.load_state_dict(sd)``: collective (every rank calls it). Takes full-shape tensors (each rank copies its
  fragment) and fragments only from this same rank and layout; refuses anything else with a ``ValueError`` on
  every rank, before anything is copied into it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.state import flat_buffers, sharded_state


def full_state_dict(model: nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Gather every parameter of a sharded model: ``{name: full tensor}`` with original shapes, on every rank.

    Collective: every rank of the model must call it, in the same order. Tensors are fresh copies (not views of any
    runtime buffer) in the parameters' dtype and device; a tied parameter appears once, under its first name.
    Tensor-parallel (DTensor) parameters come whole, in their global shape, as plain tensors (gathered over the mp
    mesh). Expert parameters of every ep rank are included (each ep rank holds its own experts, under their global names,
    see :class:`shardfusion.moe.MoE`): they are exchanged over the ep group with ``all_gather_object``.
    With ``buffers`` the persistent module buffers (e.g. BatchNorm statistics; not those registered with
    ``persistent=False``, which ``state_dict()`` leaves out too) are included, as held by the first data-parallel
    rank (for buffers of experts: the first rank holding those experts).

    The result loads into a plain (unsharded) model with ``load_state_dict`` (tied parameters: ``strict=False``, or
    give the other names too), and into a sharded model of any layout and world size with the sharded model's own
    ``model.load_state_dict(full)`` (collective; each rank copies its fragment out of the full tensors). To move
    weights between ranks or layouts use this (or :mod:`shardfusion.checkpoint`), never ``model.state_dict()``: that
    holds this rank's fragments, and ``load_state_dict`` refuses them on another rank or layout (``ValueError``
    on every rank, naming the key and the rank and layout it came from).

    Raises:
        ValueError: two ep ranks hold an expert parameter or buffer of the same name.
    """
    state = sharded_state(model)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}  # this ep rank's experts, exchanged over the ep group below
    for buffer in flat_buffers(model):
        full = buffer.gather_copy()  # (P,)
        for slot, spec in zip(buffer.layout.slots, buffer.tp_specs):
            piece = full[slot.offset:slot.end].view(slot.shape)  # a tensor-parallel parameter: this rank's piece
            (experts if buffer.is_expert else out)[slot.name] = tp.full_tensor(piece, spec).clone()
    dense_buffers, expert_buffers = state.split_buffers(persistent_only=True) if buffers else ([], [])
    copies = {name: buf.detach().clone() for name, buf in dense_buffers}
    comm.broadcast_coalesced(list(copies.values()), state.topology.get_data_parallel_group())
    out.update(copies)
    expert_copies = {name: buf.detach().clone() for name, buf in expert_buffers}
    comm.broadcast_coalesced(list(expert_copies.values()), state.topology.get_expert_data_parallel_group())
    experts.update(expert_copies)
    out.update(_gather_over_ep(experts, state.topology.get_group("ep")))
    return out


def _gather_over_ep(mine: dict[str, torch.Tensor], ep_group) -> dict[str, torch.Tensor]:
    """The union of every ep rank's expert tensors (one ``all_gather_object``, on the CPU, then back on the device).

    Raises:
        ValueError: two ep ranks hold a tensor of the same name (expert names must be global, unique over ep).
    """
    size = comm.group_size(ep_group)
    if size == 1:
        return mine
    every: list = [None] * size
    dist.all_gather_object(every, {n: t.cpu() for n, t in mine.items()}, group=ep_group)
    out: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for j, part in enumerate(every):
        for name, tensor in part.items():
            if name in owner:
                raise ValueError(f"expert tensor {name!r} is held by ep ranks {owner[name]} and {j}: expert parameter "
                                 f"and buffer names must be global (unique across the ep group), e.g. experts.<global "
                                 f"index>; see shardfusion.moe.MoE")
            owner[name] = j
            out[name] = tensor
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    return {n: t.to(device) for n, t in out.items()}
