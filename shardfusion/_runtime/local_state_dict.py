"""``model.state_dict()`` and ``model.load_state_dict()`` of a sharded model, with torch's own module hooks.

[Note: local state dicts]
After :func:`shardfusion.fully_shard`, ``model.state_dict()`` holds, under the original names, every parameter as a
DTensor of its full shape (``Shard(0)`` over its shard group, ``Replicate()`` over its replicas, the tensor-parallel
placement on an ``mp`` dimension: [Note: DTensor state dicts] in ``dtensor_state_dict.py``), a tied parameter under
each of its names, and the module buffers as plain tensors. A state-dict pre-hook on the sharded model gathers the
flat buffers one at a time (so ``state_dict()`` is collective: every rank calls it) and puts the DTensors in the
modules' ``_parameters`` in the place of the fragments; ``_save_to_state_dict`` and every state-dict hook of the
modules (e.g. one that splits a fused QKV weight with ``torch.chunk``) then see full shapes, and a post-hook puts the
fragments back. A state dict of a submodule of the sharded model (not through the model passed to ``fully_shard``)
holds that submodule's fragments: this rank's rows of each parameter (``(rows_on_this_rank, *shape[1:])``, see
``layout.fragment_shape``; in an owner layout of ``whole_params`` the shape on the owner and ``(0, *shape[1:])``
elsewhere). The post-hook also records in the state dict's ``_metadata`` (which
``torch.save`` keeps), under ``_metadata[prefix]["shardfusion"]``::

    {"rank": global rank, "world_size": W, "layout": hex digest of this rank's fragments}

The layout digest covers, for every parameter of the model: its name, full shape, shard count and index, and the
fragment's offset and length in the flattened parameter. Two ranks never share a digest unless they hold the same
fragments (replicas of the outer group do; they are still told apart by ``rank``).

A load-state-dict pre-hook on the sharded model decides, for every parameter key of the given state dict:

- a tensor of the parameter's full shape (a plain model's ``state_dict()``, :func:`shardfusion.full_state_dict`):
  each rank copies its own fragment out of it;
- a DTensor of the full shape (``model.state_dict()`` of a sharded model of this job, what ``dcp.load`` filled in):
  gathered (``full_tensor()``, collective over its mesh), then sliced as above; refused when the metadata says
  another rank or world size saved it (its local tensor is that rank's chunk: a ``torch.save``'d state dict);
- this rank's fragment shape: accepted only when the metadata says it comes from this rank, world size and layout
  (a fragment that holds all of its parameter has the full shape, and is taken as full, rightly);
- anything else (another rank's or layout's fragment, a fragment without metadata, another shape) is refused.

A full-shape tensor that an ancestor's own load pre-hook makes later (fusing q, k, v back into qkv) is sliced by the
load pre-hook of the module holding that fragment.

Refusals are collective: every rank validates its own keys, then one ``all_gather_object`` over the default group
exchanges the problems (and the names of the expert parameters and buffers each ep rank holds), before anything is
copied into the sharded model; if any rank found a problem every rank raises the same ``ValueError``. (When the
sharded model is a submodule, torch has loaded the modules it visits before it, e.g. earlier siblings, by then.) So
``load_state_dict`` of a sharded model (or of a module that contains it) must be called on every rank. Keys of
experts held by other ep ranks (a full state dict holds every expert) are dropped before torch matches keys, so
``strict=True`` works with full state dicts at any ep degree. A tied parameter may be given under any of its names.
``strict`` and the returned missing / unexpected keys otherwise behave as in torch. ``assign=True`` is refused (the
fragments must stay views of the shard). ``load_state_dict`` called on a submodule of a sharded model (not through
the model passed to ``fully_shard``) is refused on every rank that calls it.

Non-persistent buffers (``register_buffer(..., persistent=False)``) are left out of ``state_dict()`` by torch; the
full state dict and checkpoints leave them out too (:func:`persistent_buffers`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import arrival, comm
from shardfusion._runtime import dtensor_state_dict as dsd
from shardfusion._runtime.tensor_parallel import is_dtensor
from shardfusion._runtime.state import flat_buffers, fragment_holders, fragment_registrations, named_fragments

META_KEY = "shardfusion"  # key of our entry in a state dict's ``_metadata[prefix]``


@dataclass(frozen=True)
class _Param:
    """One parameter of the sharded model as this rank holds it."""

    name: str  # its first name (relative to the sharded model)
    aliases: tuple[str, ...]  # every name it is registered under (tied parameters: several)
    shape: tuple[int, ...]  # full shape
    offset: int  # start of this rank's fragment in the flattened parameter (elements)
    numel: int  # fragment length (elements; 0 allowed)
    is_expert: bool
    tp_spec: object = None  # a tensor-parallel parameter: shape/offset are its local piece's; tp_spec.shape global
    frag_shape: tuple[int, ...] = ()  # the fragment's shape: layout.fragment_shape

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape a full tensor of this parameter has (global for a tensor-parallel one)."""
        return self.shape if self.tp_spec is None else tuple(self.tp_spec.shape)


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module.named_buffers()`` without the non-persistent ones: the buffers ``module.state_dict()`` holds."""
    persistent = set()
    for mname, m in module.named_modules(remove_duplicate=False):
        for bname, buf in m._buffers.items():
            if buf is not None and bname not in m._non_persistent_buffers_set:
                persistent.add(f"{mname}.{bname}" if mname else bname)
    return [(n, b) for n, b in module.named_buffers() if n in persistent]


class LocalStateDict:
    """The state-dict hooks of one sharded model (see [Note: local state dicts]). Built by ``fully_shard``.

    Args:
        state: the model's ``Scheduler``, attached to it (its fragments and expert buffer ids are read once, here).
    """

    def __init__(self, state) -> None:
        self.state = state
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.params = _params(state.root)
        self.by_alias = {a: p for p in self.params for a in p.aliases}
        expert_ids = state.expert_buffers
        self.expert_names = sorted({a for p in self.params if p.is_expert for a in p.aliases} |
                                   {n for n, b in state.root.named_buffers() if id(b) in expert_ids})
        self.layout = _digest(state.root)
        self.by_fragment = {id(f.param): p for f, p in zip(named_fragments(state.root), self.params)}
        self.meshes: dict = {}  # the DTensors' device meshes, per set of groups (dtensor_state_dict.buffer_mesh)
        self._loading = False  # between the model's load pre-hook and post-hook: its submodules may load
        self._swapped: list[tuple[dict, str, nn.Parameter]] = []  # fragments replaced by DTensors while saving
        state.local_state_dict = self  # for the optimizer's state-dict hooks (optimizer_state_dict.py)

    def install(self) -> None:
        """Register the hooks on the sharded model and on each submodule that holds fragments; their handles join
        ``state.hook_handles`` (the module hooks removed when a later ``fully_shard`` call absorbs this model)."""
        root = self.state.root
        handles = [root.register_state_dict_pre_hook(self._before_save),
                   root.register_state_dict_post_hook(lambda *args: self._after_save(*args)),  # torch marks it
                   root.register_load_state_dict_pre_hook(self._before_load),
                   root.register_load_state_dict_post_hook(self._after_load)]
        holders = {id(m): m for m in fragment_holders(root) if m is not root}
        names = {id(m): n for n, m in root.named_modules()}
        own: dict[int, dict[str, _Param]] = {}  # id(module._parameters) -> the fragments registered there
        for params, attr, frag in fragment_registrations(root):
            own.setdefault(id(params), {})[attr] = self.by_fragment[id(frag)]
        for module in holders.values():
            handles.append(module.register_load_state_dict_pre_hook(
                self._guard_submodule(names.get(id(module), "?"), own.get(id(module._parameters), {}))))
        self.state.__dict__.setdefault("hook_handles", []).extend(handles)

    def metadata(self) -> dict:
        """This rank's entry: ``{"rank", "world_size", "layout"}``."""
        return {"rank": self.rank, "world_size": self.world_size, "layout": self.layout}

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _before_save(self, module, prefix, keep_vars) -> None:
        """Put a full-shape DTensor in the place of every fragment in the modules' ``_parameters`` (collective: one
        buffer gathered at a time, see [Note: DTensor state dicts]), so that ``_save_to_state_dict`` and every
        state-dict hook of the modules see them; :meth:`_after_save` puts the fragments back."""
        self.restore()  # a state_dict() that raised half-way left them in
        arrival.enter("model.state_dict()", self.state.topology)
        dtensors = {}
        for buffer in flat_buffers(self.state.root):
            flat = buffer.gather_copy()  # (P,)
            for frag, t in zip(buffer.fragments, dsd.buffer_dtensors(buffer, flat, self.meshes)):
                dtensors[id(frag)] = t
            del flat
        for params, attr, frag in fragment_registrations(self.state.root):
            if params.get(attr) is frag:
                params[attr] = dtensors[id(frag)]
                self._swapped.append((params, attr, frag))

    def _after_save(self, module, state_dict, prefix, local_metadata) -> None:
        self.restore()
        local_metadata[META_KEY] = self.metadata()

    def restore(self) -> None:
        """Put back the fragments that :meth:`_before_save` replaced (a no-op when none are out)."""
        swapped, self._swapped = self._swapped, []
        for params, attr, frag in swapped:
            params[attr] = frag

    def _before_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
        self.restore()
        arrival.enter("model.load_state_dict()", self.state.topology, range(self.world_size))  # gathers over all
        problems = self._problems(state_dict, prefix, local_metadata)
        every = comm.all_gather_object((self.rank, problems, self.expert_names), None, "the load_state_dict checks")
        refused = [(r, p) for r, p, _ in every if p]
        if refused:
            raise ValueError(_refusal(type(module).__name__, refused))
        held = set(self.by_alias) | {n for n, _ in module.named_buffers()}
        elsewhere = {n for _, _, names in every for n in names} - held  # other ep ranks' experts
        for name in elsewhere:
            state_dict.pop(prefix + name, None)
        self._to_fragments(state_dict, prefix)
        self._loading = True

    def _after_load(self, module, incompatible_keys) -> None:
        self._loading = False
        self.state.reshard_all()  # a gathered full buffer would hold the values from before the load

    def _guard_submodule(self, name: str, own: dict[str, _Param]):
        def hook(module, state_dict, prefix, *rest) -> None:
            if self._loading:
                # A full-shape tensor that appeared after the model's pre-hook (an ancestor's own load pre-hook fused
                # split keys back): this rank's fragment of it, as _to_fragments does.
                for attr, p in own.items():
                    t = state_dict.get(prefix + attr)
                    if isinstance(t, torch.Tensor) and tuple(t.shape) == p.full_shape and (
                            is_dtensor(t) or p.full_shape != p.frag_shape):
                        state_dict[prefix + attr] = dsd.fragment_of(t, p.offset, p.numel, p.frag_shape, p.tp_spec)
            else:
                raise ValueError(
                    f"load_state_dict on {name!r} ({type(module).__name__}), a submodule of a model sharded by "
                    f"shardfusion.fully_shard, would copy into this rank's fragments unchecked: call "
                    f"load_state_dict on the sharded model (or a module containing it), on every rank")
        return hook

    # ---- validation and slicing ----------------------------------------------------------------------------------
    def _problems(self, state_dict, prefix: str, local_metadata: dict) -> list[str]:
        """What this rank refuses in ``state_dict`` (one string per key), before anything is copied."""
        if local_metadata.get("assign_to_params_buffers", False):
            return ["assign=True would replace this rank's fragments (views of its shard): use assign=False"]
        saved = local_metadata.get(META_KEY)
        saved = saved if isinstance(saved, dict) else None
        same = saved == self.metadata()
        out = []
        for alias, p in self.by_alias.items():
            t = state_dict.get(prefix + alias)
            if is_dtensor(t) and saved is not None and (saved.get("rank"), saved.get("world_size")) != (
                    self.rank, self.world_size):
                out.append(f"{prefix + alias!r} is a DTensor saved by rank {saved.get('rank')} of "
                           f"{saved.get('world_size')}, loaded on rank {self.rank} of {self.world_size}: its local "
                           f"tensor is that rank's chunk (a torch.save'd model.state_dict() of another rank)")
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) == p.full_shape:
                continue  # not a tensor: torch reports it; full shape (a DTensor too): sliced
            if same and tuple(t.shape) == p.frag_shape:
                continue  # this rank's own fragment, same layout
            key = prefix + alias
            if saved is None:
                out.append(f"{key!r} has shape {tuple(t.shape)}, not the full shape {p.full_shape}, and the state dict "
                           f"has no shardfusion metadata (it lost its _metadata, or it is a fragment from elsewhere)")
            elif not same:
                out.append(f"{key!r} is a fragment {tuple(t.shape)} saved by rank {saved.get('rank')} of "
                           f"{saved.get('world_size')} (layout {saved.get('layout')}); rank {self.rank} of "
                           f"{self.world_size} holds layout {self.layout}")
            else:
                out.append(f"{key!r} has shape {tuple(t.shape)}: neither the full shape {p.full_shape} nor this rank's "
                           f"fragment {p.frag_shape}")
        return out

    def _to_fragments(self, state_dict, prefix: str) -> None:
        """Replace each full-shape tensor by this rank's fragment of it (in the fragment's shape,
        ``(rows_on_this_rank, *shape[1:])``); give a tied parameter that appears under one of its names the same
        value under the others."""
        for p in self.params:
            given = [prefix + a for a in p.aliases if prefix + a in state_dict]
            for key in given:
                t = state_dict[key]
                if isinstance(t, torch.Tensor) and tuple(t.shape) == p.full_shape:  # a DTensor: gathered first
                    state_dict[key] = dsd.fragment_of(t, p.offset, p.numel, p.frag_shape, p.tp_spec)
            for alias in p.aliases:
                if given and prefix + alias not in state_dict:
                    state_dict[prefix + alias] = state_dict[given[0]]


def _params(model: nn.Module) -> list[_Param]:
    aliases: dict[int, list[str]] = {}
    for name, frag in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(frag), []).append(name)
    return [_Param(f.name, tuple(aliases.get(id(f.param), [f.name])), f.shape, f.offset, f.numel, f.buffer.is_expert,
                   f.tp_spec, tuple(f.param.shape)) for f in named_fragments(model)]


def _digest(model: nn.Module) -> str:
    """Hex digest (16 digits) of this rank's layout: per parameter name, full shape, shard count and index, fragment
    offset and length."""
    rows = [(f.name, f.shape, f.buffer.layout.shard_count, f.shard_index, f.offset, f.numel)
            for f in named_fragments(model)]
    return hashlib.sha1(repr(sorted(rows)).encode()).hexdigest()[:16]


def _refusal(model_name: str, refused: list[tuple[int, list[str]]]) -> str:
    """One message for every rank: the first refusing rank's first problem, and which ranks refused how many keys."""
    first_rank, problems = refused[0]
    more = f" (and {len(problems) - 1} more key{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    counts = ", ".join(f"{r}: {len(p)}" for r, p in refused)
    return (f"load_state_dict into the sharded {model_name} refused on every rank, nothing copied into it: rank "
            f"{first_rank}: {problems[0]}{more}; keys refused per rank {{{counts}}}. model.state_dict() of a sharded "
            f"model holds DTensors of the full shapes whose local tensors are this rank's chunks (and a rank's own "
            f"fragments load back only on that rank and layout): to move weights between ranks or layouts use "
            f"torch.distributed.checkpoint with get_model_state_dict / set_model_state_dict, or save "
            f"shardfusion.full_state_dict(model) (full shapes; every rank calls it) and load that, or use "
            f"shardfusion.checkpoint.save / load")
