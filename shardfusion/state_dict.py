"""Full (unsharded) state dicts of a sharded model, for tests, export and inspection."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion.fully_shard import _state


def full_state_dict(model: nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Gather every parameter of a sharded model: ``{name: full tensor}`` with original shapes, on every rank.

    Collective: every rank of the model must call it, in the same order. Tensors are fresh copies (not views of any
    runtime buffer) in the parameters' dtype and device; a tied parameter appears once, under its first name.
    Expert parameters of every ep rank are included (each ep rank holds its own experts, under their global names,
    see :class:`shardfusion.moe.MoE`): they are exchanged over the ep group with ``all_gather_object``.
    With ``buffers`` the module buffers (e.g. BatchNorm statistics) are included too, as held by the first
    data-parallel rank.
    """
    state = _state(model)
    ep_group = state.topology.get_group("ep")
    out: dict[str, torch.Tensor] = {}
    for unit in state.units:
        for g in unit.groups:
            full = torch.empty(g.layout.padded_numel, dtype=g.shard.dtype, device=g.shard.device)  # (P,)
            comm.all_gather(full, g.shard, g.shard_group)
            mine = {slot.name: full[slot.offset:slot.end].view(slot.shape).clone() for slot in g.layout.slots}
            if g.is_expert and comm.group_size(ep_group) > 1:
                every: list = [None] * comm.group_size(ep_group)
                dist.all_gather_object(every, {n: t.cpu() for n, t in mine.items()}, group=ep_group)
                mine = {n: t.to(g.shard.device) for part in every for n, t in part.items()}
            out.update(mine)
    if buffers:
        copies = {name: buf.detach().clone() for name, buf in model.named_buffers()}
        comm.broadcast_coalesced(list(copies.values()), state.topology.get_data_parallel_group())
        out.update(copies)
    return out
