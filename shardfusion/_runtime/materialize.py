"""Where a sharded model's tensors live, and meta-device initialization.

[Note: meta-device initialization]
A model built under ``with torch.device("meta")`` has shapes and no storage, so a model larger than one rank can be
described on every rank. ``fully_shard`` lays its flat buffers out from the shapes alone (shards of zeros on
``device``), then materializes the model module by module, in *module order*: the order of
``model.named_modules()`` (the root first, then depth first in registration order, a module registered twice
once). Each module with parameters or buffers of its own on the meta device, and the root whenever ``init_fn`` is
given (even with no tensors of its own), is initialized in turn:

1. its own meta parameters are allocated full on ``device`` (``torch.empty``) and put in the module for the moment,
   except a shared parameter already allocated by an earlier module, which it gets as that one tensor (values from
   the earlier modules' inits); its meta buffers are allocated for good (done first, for the whole model, so buffer
   identities are fixed before the wrap reads them);
2. ``init_fn(module)`` runs if given, else ``module.reset_parameters()``, under ``torch.no_grad()``. Parameters and
   buffers of the module that were not on meta keep their values (saved and put back);
3. each parameter whose last registering module (in module order) this is gets broadcast from the first rank of
   the ranks that hold it (the data-parallel group; for experts the ranks with the same experts), as the eager wrap
   broadcasts its parameters, so replicas start equal even from differently seeded generators
   (docs/field-cases.md, F7); this rank copies its fragment into the shard and the full tensor is freed. A shared
   parameter (a tied embedding and head) stays full from its first registering module to its last: every
   registering module's init runs on the one tensor, in module order, so the last writer wins (eager construction
   when its inits run after the tie; each init draws from the generator what it draws there);
4. the module gets its meta parameters back; ``fully_shard`` then registers the fragments in their place.

Peak memory is the shards plus one module's parameters (plus one broadcast buffer per module, and the shared
parameters between their first and last registering modules), never one unit's full buffer. Why this equals eager
construction, for which models, and what to do otherwise is in docs/design.md ("Models larger than one rank").
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm

InitFn = Callable[[nn.Module], None]


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when the default process group runs NCCL, else ``cpu``."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_device_args(device, init_fn) -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (``None`` stays ``None``).

    Raises:
        ValueError: ``device`` is not a device (or a string naming one) or is ``meta``; ``init_fn`` is not callable.
    """
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn must be a callable init_fn(module) or None, got {init_fn!r}")
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a string such as 'cpu' or 'cuda:0', got {device!r}") from e
    if dev.type == "meta":
        raise ValueError("device='meta': the shards need storage; pass the device to materialize the model on")
    return dev


def target_device(t: torch.Tensor, device: Optional[torch.device]) -> torch.device:
    """Where ``t``'s values go: ``device`` if given, else ``t``'s own device, or :func:`default_device` for meta."""
    if device is not None:
        return device
    return default_device() if t.is_meta else t.device


def _own_meta(m: nn.Module) -> tuple[list[str], list[str]]:
    params = [a for a, p in m._parameters.items() if p is not None and p.is_meta]
    buffers = [a for a, b in m._buffers.items() if b is not None and b.is_meta]
    return params, buffers


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_initializable(model: nn.Module, init_fn: Optional[InitFn], group) -> None:
    """Every module with meta tensors of its own can be initialized, and every rank has the same meta tensors.

    Collective over ``group``: the ranks that wrap this model together, those of its pipeline stage (the world when
    pp is 1; ``Topology.get_group("stage")``; the stages of an interleaved pipeline are wrapped at different times);
    one all-reduce of two integers, before any other collective of the wrap.

    Raises:
        ValueError: a module with parameters or buffers of its own on the meta device, no ``init_fn`` and no
            ``reset_parameters()`` (the message names the modules and tensors); ranks that disagree on how many
            tensors are on meta (e.g. rank 0 built eagerly, the others on meta). On every rank.
    """
    problems = []
    count = 0
    for name, m in model.named_modules():
        params, buffers = _own_meta(m)
        count += len(params) + len(buffers)
        if (params or buffers) and init_fn is None and not callable(getattr(m, "reset_parameters", None)):
            what = [f"parameter {a!r}" for a in params] + [f"buffer {b!r}" for b in buffers]
            problems.append(f"{name or '<root>'!r} ({type(m).__name__}: {', '.join(what)})")
    counts = torch.tensor([count, -count], dtype=torch.int64, device=default_device())
    comm.all_reduce(counts, group, op=dist.ReduceOp.MAX)
    if not comm.is_fake(group) and counts[0].item() != -counts[1].item():
        raise ValueError(f"ranks disagree on the model's meta-device tensors: between {-counts[1].item()} and "
                         f"{counts[0].item()} tensors are on meta (this rank: {count}); build the model the same way on "
                         "every rank (all on meta, or all with values), then load weights with "
                         "shardfusion.load_safetensors or load_state_dict")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ValueError(f"cannot initialize the meta-device tensors of {len(problems)} module(s): {shown}. Each has "
                         "no reset_parameters(); pass fully_shard(..., init_fn=fn), called as fn(module) for every "
                         "module with meta tensors of its own, or build the model with values and stream-load weights "
                         "(docs/design.md, 'Models larger than one rank')")


def place_buffers(model: nn.Module, device: Optional[torch.device]) -> dict[int, set[str]]:
    """Allocate meta buffers on their target device (uninitialized until their module's init) and move the others to
    ``device`` if given. Returns ``{id(module): names of its buffers that were on meta}`` for the modules that had
    some (they need their init; their other buffers keep their values through it)."""
    needs_init: dict[int, set[str]] = {}
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            dev = target_device(b, device)
            if b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=dev)
                needs_init.setdefault(id(m), set()).add(name)
            elif b.device != dev:
                m._buffers[name] = b.to(dev)
    return needs_init


def initialize(model: nn.Module, slot_of: dict, needs_init: dict[int, set[str]], device: Optional[torch.device],
               init_fn: Optional[InitFn]) -> None:
    """Materialize the meta parameters module by module, in module order, and fill their fragments (see the note
    above).

    Args:
        slot_of: ``id(original parameter) -> (FlatBuffer, slot index)`` for every parameter of the model.
        needs_init: the modules whose buffers were on meta, and those buffers' names (from :func:`place_buffers`).

    Raises:
        ValueError: ``init_fn`` or ``reset_parameters`` left a tensor on meta or changed a parameter's shape.
    """
    modules = list(model.named_modules())
    last_at = {id(p): i for i, (_, m) in enumerate(modules) for p in m._parameters.values()
               if p is not None and p.is_meta}  # a meta parameter -> its last registering module
    shared: dict[int, torch.Tensor] = {}  # a meta parameter -> its full tensor, from its first to its last module
    for i, (name, m) in enumerate(modules):
        metas = [a for a, p in m._parameters.items() if p is not None and p.is_meta]
        if not metas and id(m) not in needs_init and not (m is model and init_fn is not None):
            continue
        originals = dict(m._parameters)
        kept = {a: p.detach().clone() for a, p in originals.items() if p is not None and not p.is_meta}
        were_meta = needs_init.get(id(m), set())
        kept_buffers = {b: t.clone() for b, t in m._buffers.items() if t is not None and b not in were_meta}
        for a in metas:
            p = originals[a]
            if id(p) not in shared:  # else allocated, and initialized, by an earlier module registering it
                shared[id(p)] = nn.Parameter(torch.empty_like(p, device=target_device(p, device)),
                                             requires_grad=p.requires_grad)
            m._parameters[a] = shared[id(p)]
        with torch.no_grad():
            (init_fn or type(m).reset_parameters)(m)
            for a, value in kept.items():
                m._parameters[a].copy_(value)
            for b, value in kept_buffers.items():
                m._buffers[b].copy_(value)
        for a in metas:
            p, value = originals[a], m._parameters[a]
            if value is None or value.is_meta or value.shape != p.shape:
                got = "None" if value is None else f"{tuple(value.shape)} on {value.device}"
                raise ValueError(f"initializing module {name or '<root>'!r} ({type(m).__name__}) left parameter "
                                 f"{a!r} as {got}; it must be {tuple(p.shape)} with values")
            shared[id(p)] = value  # the init may have put another tensor in its place: that one is the value
            m._parameters[a] = p
        # Parameters whose last registering module this is have their final values; the others wait, full, for the
        # later modules' inits to run on them.
        done = {id(originals[a]): originals[a] for a in metas if last_at[id(originals[a])] == i}
        fresh = [(p, shared.pop(key)) for key, p in done.items()]
        for b_name, b in m._buffers.items():
            if b is not None and b.is_meta:
                raise ValueError(f"initializing module {name or '<root>'!r} ({type(m).__name__}) left buffer "
                                 f"{b_name!r} on the meta device")
        _fill(fresh, slot_of)


def _fill(fresh: list[tuple[nn.Parameter, torch.Tensor]], slot_of: dict) -> None:
    """Broadcast each freshly initialized parameter over the ranks holding it and copy this rank's fragment."""
    by_group: dict[int, tuple] = {}
    for p, value in fresh:
        buffer, index = slot_of[id(p)]
        by_group.setdefault(id(buffer.data_parallel_group), (buffer.data_parallel_group, []))[1].append(
            (buffer, index, value))
    for group, members in by_group.values():
        for buffer, index, value in members:
            comm.broadcast(value.data, group)  # in place: no second copy of the module's parameters
            buffer.fill_slot(index, value)
