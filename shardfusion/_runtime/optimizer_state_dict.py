"""``optimizer.state_dict()`` / ``load_state_dict()`` of an optimizer over a sharded model's fragments.

Installed on an optimizer at its first step (the global step pre-hook in ``optimizer_hook.py``; torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` take such a step, with a zero learning rate, when the
optimizer has no state yet). A state-dict post-hook gives every per-element tensor of a fragment's state (a tensor
of the fragment's shape, e.g. Adam's ``exp_avg``; not the 0-dim ``step``) as a DTensor of the parameter's full shape
over its buffer's mesh ([Note: DTensor state dicts] in ``dtensor_state_dict.py``), so ``torch.distributed.checkpoint``
never mixes ranks' fragments; the optimizer's own state is not changed. A load-state-dict pre-hook takes such
DTensors, or plain tensors of the full shape, and cuts this rank's fragment out of them.

Both are collective: ``optimizer.state_dict()`` gathers one buffer per state name at a time (after one
``comm.all_gather_object`` over the buffer's shard group that agrees on which states exist), ``load_state_dict`` gathers
each DTensor (``full_tensor()``); every rank must call them, with the same optimizer over the same parameters.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from shardfusion import arrival, comm
from shardfusion._runtime import dtensor_state_dict as dsd
from shardfusion._runtime.state import fragment_owner, fragments_by_buffer
from shardfusion._runtime.tensor_parallel import is_dtensor

_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def install(optimizer: torch.optim.Optimizer) -> None:
    """Register the two hooks on ``optimizer``, once; the first time, also cut this rank's fragments out of any
    DTensor state it holds already (a ``load_state_dict`` before its first step, without the hooks; collective)."""
    if optimizer in _HOOKED:
        return
    optimizer.register_state_dict_post_hook(_to_dtensors)
    optimizer.register_load_state_dict_pre_hook(_from_dtensors)
    _HOOKED.add(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and fragment_owner(p) is not None and any(is_dtensor(t) for t in state.values()):
                optimizer.state[p] = _fragment_state(p, state)


def _keyed_params(optimizer, state_dict) -> list[tuple[object, torch.Tensor]]:
    """``(key in state_dict["state"], parameter)`` in the optimizer's order (torch matches them by position)."""
    keys = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    return list(zip(keys, params))


def _is_per_element(t, frag: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and not is_dtensor(t) and t.dim() > 0 and t.shape == frag.shape


def _to_dtensors(optimizer, state_dict: dict) -> dict:
    keyed = _keyed_params(optimizer, state_dict)
    key_of = {id(p): k for k, p in keyed}
    states, pairs = fragments_by_buffer([p for _, p in keyed])
    if not pairs:
        return state_dict
    arrival.enter("optimizer.state_dict()", states[0].topology)
    state = state_dict["state"]
    agreed = [_agreed_plan(optimizer, buffer, [sorted((n, str(t.dtype)) for n, t in
                                                      state.get(key_of.get(id(f)), {}).items()
                                                      if _is_per_element(t, f)) for f in buffer.fragments])
              for buffer, _ in pairs]
    out = dict(state_dict)
    out["state"] = new_state = {k: dict(v) for k, v in state.items()}  # the optimizer's own dicts stay untouched
    for (buffer, frags), names in zip(pairs, agreed):
        cache = buffer_cache(frags[0])
        held = {id(f) for f in frags}
        for name, dtype in sorted({e for per_frag in names for e in per_frag}):
            tensors = []
            for f in buffer.fragments:
                t = new_state.get(key_of.get(id(f)), {}).get(name)
                tensors.append(t if _is_per_element(t, f) else None)
            flat = dsd.gather_fragments(buffer, tensors, getattr(torch, dtype.split(".")[-1]))  # (P,)
            for f, per_frag, t in zip(buffer.fragments, names, dsd.buffer_dtensors(buffer, flat, cache)):
                if id(f) in held and (name, dtype) in per_frag:
                    new_state.setdefault(key_of[id(f)], {})[name] = t
            del flat
    return out


def _agreed_plan(optimizer, buffer, plan: list[list[tuple[str, str]]]) -> list[list[tuple[str, str]]]:
    """Per fragment of ``buffer``, the ``(name, dtype)`` of its per-element states, united over the buffer's shard
    group (one ``comm.all_gather_object``), so that its ranks gather the same states (a rank whose fragment is empty may
    lack a state the others have).

    Raises:
        ValueError: the ranks of the shard group hold another number of fragments of it (on every rank of the group).
    """
    size = comm.group_size(buffer.shard_group)
    if size == 1:
        return plan
    every = comm.all_gather_object(plan, buffer.shard_group, f"the optimizer states of unit {buffer.unit_name!r} "
                                   "(optimizer.state_dict())")
    if any(len(p) != len(plan) for p in every):
        raise ValueError(f"optimizer.state_dict() of {type(optimizer).__name__}: the ranks of unit "
                         f"{buffer.unit_name!r}'s shard group hold {[len(p) for p in every]} fragments of it; every "
                         f"rank must build the same optimizer over model.parameters()")
    return [sorted({tuple(e) for p in every for e in p[i]}) for i in range(len(plan))]


def buffer_cache(fragment) -> dict:
    """The mesh cache of the sharded model ``fragment`` belongs to."""
    return fragment_owner(fragment).local_state_dict.meshes


def _from_dtensors(optimizer, state_dict: dict) -> dict:
    keyed = _keyed_params(optimizer, state_dict)
    owners = [fragment_owner(p) for _, p in keyed if fragment_owner(p) is not None]
    if not owners:
        return state_dict
    arrival.enter("optimizer.load_state_dict()", owners[0].topology)
    out = dict(state_dict)
    out["state"] = new_state = dict(state_dict["state"])
    for key, p in keyed:
        if fragment_owner(p) is None or key not in new_state:
            continue
        new_state[key] = _fragment_state(p, new_state[key])
    return out


def _fragment_state(p: torch.Tensor, state: dict) -> dict:
    """``state`` of fragment ``p`` with each DTensor or full-shape tensor replaced by this rank's fragment of it."""
    info = fragment_owner(p).local_state_dict.by_fragment[id(p)]
    values = dict(state)
    for name, t in values.items():
        if not isinstance(t, torch.Tensor) or (not is_dtensor(t) and (t.dim() == 0 or t.shape == p.shape)):
            continue  # a plain scalar (``step``), or already this rank's fragment; a DTensor of shape () is the
            # state of a 0-dim parameter and is cut like any other
        if tuple(t.shape) != info.full_shape:
            raise ValueError(f"optimizer state {name!r} of {info.name!r} has shape {tuple(t.shape)}, neither the "
                             f"parameter's full shape {info.full_shape} nor this rank's fragment "
                             f"{tuple(p.shape)} (rank {dist.get_rank()})")
        values[name] = dsd.fragment_of(t, info.offset, info.numel, info.frag_shape, info.tp_spec).clone()
    return values
