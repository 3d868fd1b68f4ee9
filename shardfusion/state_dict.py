"""Full (unsharded) state dicts of a sharded model, for tests, export and inspection.

State dicts of a sharded model, in short (details: [Note: local state dicts] in ``local_state_dict.py`` and
[Note: DTensor state dicts] in ``dtensor_state_dict.py``):

- ``model.state_dict()``: every parameter as a DTensor of its full shape (``Shard(0)`` over the shard group,
  ``Replicate()`` over the replicas; local tensors are DTensor's own chunks), a tied parameter under each name, plus
  the buffers as plain tensors; collective (one flat buffer gathered at a time). The model's own state-dict hooks see
  the DTensors. It is what ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` returns, so
  ``dcp.save`` / ``dcp.load`` reshard it into any layout; ``optimizer.state_dict()`` of an optimizer over the
  fragments gives its per-element states as DTensors too (``get_optimizer_state_dict``).
- :func:`full_state_dict`: every parameter in its full shape as a plain tensor, on every rank (collective); loads
  strictly into a plain model and into a sharded model of any layout.
- ``model.load_state_dict(sd)``: collective (every rank calls it). Takes DTensors and plain tensors of the full shape
  (each rank copies its fragment) and fragments only from this same rank and layout; refuses anything else with a
  ``ValueError`` on every rank, before anything is copied into it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardfusion import arrival, comm
from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.state import flat_buffers, sharded_state


def full_state_dict(model: nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Gather every parameter of a sharded model: ``{name: full tensor}`` with original shapes, on every rank.

    Collective: every rank of the model must call it, in the same order. Tensors are fresh copies (not views of any
    runtime buffer) in the parameters' dtype and device, of shape ``param.shape`` as the unsharded model has it; a
    tied parameter appears under each of its names, as one tensor (as in a plain model's ``state_dict()``: a file
    format that refuses shared tensors, e.g. safetensors' ``save_file``, needs one name dropped).
    Tensor-parallel (DTensor) parameters come whole, in their global shape, as plain tensors (gathered over the mp
    mesh). Expert parameters of every ep rank are included (each ep rank holds its own experts, under their global names,
    see :class:`shardfusion.moe.MoE`): they are exchanged over the ep group with ``all_gather_object``.
    With ``buffers`` the persistent module buffers (e.g. BatchNorm statistics; not those registered with
    ``persistent=False``, which ``state_dict()`` leaves out too) are included, as held by the first data-parallel
    rank (for buffers of experts: the first rank holding those experts).

    The result loads into a plain (unsharded) model with ``load_state_dict`` (``strict=True``), and into a sharded
    model of any layout and world size with the sharded model's own ``model.load_state_dict(full)`` (collective; each
    rank copies its fragment out of the full tensors). ``model.state_dict()`` holds DTensors instead, which a plain
    model does not take (torch refuses to copy a DTensor into a plain tensor): use this,
    ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``, or DCP for that.

    Raises:
        ValueError: two ep ranks hold an expert parameter or buffer of the same name.
    """
    state = sharded_state(model)
    arrival.enter("sf.full_state_dict()", state.topology)
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
    return _with_aliases(model, out)


def _with_aliases(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``full`` with each tied parameter also under its other names (the same tensor), in the order of
    ``model.state_dict()``'s parameter names, then the rest (buffers, other ep ranks' experts)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for group in names.values():
        for name in group:
            if name in full:
                out.update((alias, full[name]) for alias in group)
                break
    out.update((k, v) for k, v in full.items() if k not in out)
    return out


def _gather_over_ep(mine: dict[str, torch.Tensor], ep_group) -> dict[str, torch.Tensor]:
    """The union of every ep rank's expert tensors (one ``all_gather_object``, on the CPU, then back on the device).

    Raises:
        ValueError: two ep ranks hold a tensor of the same name (expert names must be global, unique over ep).
    """
    size = comm.group_size(ep_group)
    if size == 1:
        return mine
    every = comm.all_gather_object({n: t.cpu() for n, t in mine.items()}, ep_group, "the experts of every ep rank")
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
