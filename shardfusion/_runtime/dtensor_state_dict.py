"""DTensors of the full logical shape for a sharded model's state dicts (model and optimizer), and back.

[Note: DTensor state dicts]
``model.state_dict()`` of a sharded model, and ``optimizer.state_dict()`` of an optimizer over its fragments, give
each parameter (and each per-parameter optimizer tensor, e.g. Adam's ``exp_avg``) as a ``DTensor`` of the
parameter's full shape, as FSDP2's sharded state dicts do, so that model code (a state-dict hook that splits a fused
QKV weight by ``torch.chunk``) and torch's tools (``torch.distributed.checkpoint`` and its ``state_dict`` API) see
the shapes they were written for. Each flat buffer gets one ``DeviceMesh`` (:func:`buffer_mesh`), built with
``DeviceMesh.from_group`` from the buffer's own process groups, slowest first::

    replicate  (the buffer's replicate group: dp x outer x sep x cp; ranks holding the same shard)   Replicate()
    shard      (the buffer's shard group: the inner group, or the expert groups)                    Shard(0)
    mp         (only for a buffer of tensor-parallel pieces: the parameter's mp mesh)               its placement

A dimension is left out when the buffer has no such group (a kept-whole buffer has no shard group; a buffer of
zero-element parameters has none at all and gives plain tensors). A 0-dim parameter is ``Replicate()`` on every
dimension. The local tensor of each DTensor is DTensor's own chunk (``torch.chunk`` semantics along dim 0, then along
the tensor-parallel dim), not this rank's fragment (cut at flat offsets): it is taken from the gathered buffer
(:func:`buffer_dtensors`), one buffer at a time, so building a state dict holds one buffer's full ``(P,)`` tensor at a
time besides the chunks, and is collective over every group of the buffers (every rank must call it, in the same
order). The chunks are fresh copies: writing into them (``dcp.load``) changes nothing until the state dict is
loaded. Loading goes the other way: :func:`fragment_of` takes ``full_tensor()`` of a DTensor (collective over its
mesh) and cuts this rank's fragment out of it by flat offsets.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardfusion import comm
from shardfusion._runtime import tensor_parallel as tp


def _mesh_groups(buffer) -> list[tuple[str, dist.ProcessGroup]]:
    """``(dim name, group)`` of the buffer's mesh, slowest first (see the note)."""
    dims = []
    if buffer.replicate_group is not None:
        dims.append(("replicate", buffer.replicate_group))
    if buffer.shard_group is not None:
        dims.append(("shard", buffer.shard_group))
    specs = [s for s in buffer.tp_specs if s is not None and s.shard_dim is not None]
    if specs:
        dims.append(("mp", specs[0].mesh.get_group()))
    return dims


def _grid(groups: list[dist.ProcessGroup]) -> list:
    """The global ranks of the mesh spanned by ``groups`` (slowest first) around this rank, as nested lists: the
    last group's ranks, then each earlier group's members' grids (one ``comm.all_gather_object`` per earlier group)."""
    grid = dist.get_process_group_ranks(groups[-1])
    for group in reversed(groups[:-1]):
        grid = comm.all_gather_object(grid, group, "the ranks of a state dict's device mesh")
    return grid


def buffer_mesh(buffer, cache: dict) -> Optional[DeviceMesh]:
    """The ``DeviceMesh`` of the buffer's DTensors (see the note), ``None`` for a buffer without groups; built once
    per set of groups and kept in ``cache``. Collective over the buffer's groups the first time."""
    dims = _mesh_groups(buffer)
    if not dims:
        return None
    key = tuple(id(g) for _, g in dims)
    if key not in cache:
        groups = [g for _, g in dims]
        device = "cuda" if buffer.shard.is_cuda else "cpu"
        if len(groups) == 1:
            mesh = DeviceMesh.from_group(groups[0], device, mesh_dim_names=(dims[0][0],))
        else:
            mesh = DeviceMesh.from_group(groups, device, mesh=torch.tensor(_grid(groups), dtype=torch.int),
                                         mesh_dim_names=tuple(n for n, _ in dims))
        cache[key] = (mesh, groups)  # the groups kept alive with the mesh
    return cache[key][0]


def _placements(mesh: DeviceMesh, ndim: int, spec) -> list:
    from torch.distributed.tensor import Replicate, Shard  # imported here: tensor_parallel.is_dtensor

    out = []
    for name in mesh.mesh_dim_names:
        if name == "shard" and ndim > 0:
            out.append(Shard(0))
        elif name == "mp" and spec is not None:
            out.append(spec.placements[0])
        else:
            out.append(Replicate())
    return out


def as_full_dtensor(full: torch.Tensor, mesh: Optional[DeviceMesh], spec=None) -> torch.Tensor:
    """``full`` (a parameter's global shape, the same on every rank of ``mesh``) as a DTensor over ``mesh`` whose
    local tensor is a fresh copy of DTensor's own chunk (no communication); ``full.clone()`` when ``mesh`` is None."""
    full = full.detach()
    if mesh is None:
        return full.clone()
    from torch.distributed.tensor import DTensor, distribute_tensor

    placements = _placements(mesh, full.dim(), spec)
    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
    return DTensor.from_local(dt.to_local().clone(), mesh, placements, run_check=False, shape=dt.shape,
                              stride=dt.stride())


def buffer_dtensors(buffer, flat: torch.Tensor, cache: dict) -> list[torch.Tensor]:
    """One full-shape DTensor per slot of ``buffer`` from ``flat`` (the whole ``(P,)`` buffer of some per-element
    tensor, e.g. ``buffer.gather_copy()``; collective over the mp mesh for tensor-parallel pieces)."""
    mesh = buffer_mesh(buffer, cache)
    out = []
    for slot, spec in zip(buffer.layout.slots, buffer.tp_specs):
        piece = flat[slot.offset:slot.end].view(slot.shape)  # this mp rank's piece for a tensor-parallel parameter
        full = tp.full_tensor(piece, spec)  # global shape
        out.append(as_full_dtensor(full, mesh, spec if spec is not None and spec.shard_dim is not None else None))
    return out


def gather_fragments(buffer, tensors: list[Optional[torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The ``(P,)`` buffer of a per-element tensor given per fragment (``tensors[i]`` has fragment ``i``'s numel, or
    is ``None``: zeros), all-gathered over the buffer's shard group in ``dtype`` (collective)."""
    shard = torch.zeros(buffer.layout.shard_numel, dtype=dtype, device=buffer.shard.device)  # (S,)
    for (off, n), t in zip(buffer._frag_ranges, tensors):
        if t is not None and n:
            shard[off:off + n].copy_(t.detach().reshape(-1))
    out = torch.empty(buffer.layout.padded_numel, dtype=dtype, device=buffer.shard.device)  # (P,)
    comm.all_gather(out, shard, buffer.shard_group)
    return out


def fragment_of(t: torch.Tensor, offset: int, numel: int, frag_shape: tuple[int, ...], spec=None) -> torch.Tensor:
    """This rank's fragment of ``t`` (a parameter's global shape; a DTensor is gathered first with
    ``full_tensor()``, collective over its mesh): this mp rank's piece, flattened, ``[offset, offset + numel)``, in
    ``frag_shape``. A view of ``t`` when ``t`` is a plain tensor."""
    if tp.is_dtensor(t):
        t = t.full_tensor()
    piece = t if spec is None else tp.local_piece(t, spec)
    return piece.reshape(-1)[offset:offset + numel].view(frag_shape)
