"""Tensor-parallel (DTensor) parameters inside flat buffers.

torch's tensor-parallel engine (``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel``,
``RowwiseParallel``, ...) turns a module's parameters into DTensors over a one-dimensional mesh: each mp rank holds
a *local piece* (``Shard(d)``: a slice along dim ``d``; ``Replicate()``: the whole tensor). ``fully_shard`` then
lays out and shards the local pieces exactly as it does plain parameters, and gives the modules, while a unit is
unsharded, DTensors whose local tensors are views of the full flat buffer: the module code and torch's parallel
styles see the placements they were written for, and no parameter is copied (docs/tensor-parallel.md).

A buffer holds only tensor-parallel sharded pieces (distinct on each mp rank: counted on every mp rank by the
gradient norm, written by every mp rank) or only replicated parameters (identical across mp: counted and written on
mp rank 0): ``wrap._GroupPlan.kind`` keeps the two apart.

The same idea in the field: FSDP2 shards a DTensor's local tensor over its own mesh dimension (``fully_shard`` on
a 2-D mesh); Megatron marks tensor-parallel parameters with ``tensor_model_parallel = True``, which this library
also reads.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)``, without importing ``torch.distributed.tensor`` (about 0.5 s of CPU after torch,
    which ``import shardfusion`` paid in every process): a DTensor exists only once that module is imported, by
    whoever made it. The placement classes (``Shard``, ``Replicate``) are imported where a DTensor is at hand."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, getattr(module, "DTensor", ()))


@dataclass(frozen=True)
class TensorParallelSpec:
    """How one parameter is split over the mp mesh: its DTensor's mesh, placements, global shape and stride."""

    mesh: object  # a 1-D DeviceMesh
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def shard_dim(self) -> Optional[int]:
        """The tensor dim split over the mesh (``Shard(d)``), or ``None`` for a replicated parameter."""
        from torch.distributed.tensor import Shard  # a spec is made from a DTensor: imported (see is_dtensor)

        placement = self.placements[0]
        return placement.dim if isinstance(placement, Shard) else None


def spec_of(p: torch.Tensor) -> Optional[TensorParallelSpec]:
    """The :class:`TensorParallelSpec` of a DTensor parameter, ``None`` for a plain tensor."""
    if not is_dtensor(p):
        return None
    return TensorParallelSpec(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()))


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``p`` (``p`` itself for a plain tensor), without autograd history."""
    return p.to_local().detach() if is_dtensor(p) else p


def is_tensor_parallel(p: torch.Tensor) -> bool:
    """Whether ``p`` differs across mp ranks: a DTensor sharded over its mesh, or a plain tensor marked
    ``tensor_model_parallel = True`` (Megatron's convention)."""
    if is_dtensor(p):
        from torch.distributed.tensor import Shard

        return any(isinstance(pl, Shard) for pl in p.placements)
    return bool(getattr(p, "tensor_model_parallel", False))


def check_param(name: str, p: torch.Tensor, topology) -> None:
    """A DTensor parameter is one ``fully_shard`` can hold: over the topology's mp mesh, ``Shard`` or
    ``Replicate``, not on the meta device.

    Raises:
        ValueError: another mesh (its ranks and the mp group's are named), a ``Partial`` or other placement, a meta
            DTensor.
    """
    if not is_dtensor(p):
        return
    from torch.distributed.tensor import Replicate, Shard

    mesh = p.device_mesh
    mp_ranks = dist.get_process_group_ranks(topology.get_group("mp"))
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim != 1 or ranks != mp_ranks:
        raise ValueError(f"parameter {name!r} is a DTensor over a mesh of shape {tuple(mesh.shape)} with ranks "
                         f"{ranks}; fully_shard holds DTensors over the topology's mp mesh only (ranks {mp_ranks}): "
                         "parallelize with topology.get_mesh('mp')")
    placement = p.placements[0]
    if not isinstance(placement, (Shard, Replicate)):
        raise ValueError(f"parameter {name!r} has placement {placement}; a parameter must be Shard(d) or Replicate() "
                         "over the mp mesh")
    if p.is_meta:
        raise ValueError(f"parameter {name!r} is a DTensor on the meta device: fully_shard cannot initialize split "
                         "parameters yet; build the model with values before parallelize_module")


def as_param(alias: torch.Tensor, spec: Optional[TensorParallelSpec], requires_grad: bool) -> nn.Parameter:
    """The parameter the modules see for one slot: ``alias`` itself, or a DTensor with ``spec`` whose local tensor
    shares ``alias``'s storage (no copy)."""
    if spec is None:
        return nn.Parameter(alias, requires_grad=requires_grad)
    return nn.Parameter(as_dtensor(alias, spec), requires_grad=requires_grad)


def as_dtensor(tensor: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
    """``tensor`` (this rank's piece, e.g. a view of ``grad_full``) as a DTensor with ``spec``, sharing storage."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return DTensor.from_local(tensor, spec.mesh, spec.placements, run_check=False, shape=torch.Size(spec.shape),
                                  stride=spec.stride)


def same_storage(grad: Optional[torch.Tensor], alias: torch.Tensor) -> bool:
    """Whether ``grad`` (a view's ``.grad``, plain or DTensor) still lies on ``alias``."""
    if grad is None:
        return False
    piece = grad._local_tensor if is_dtensor(grad) else grad
    return piece is alias or (piece.data_ptr() == alias.data_ptr() and piece.shape == alias.shape)


def piece_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``parts`` when a dim of ``size`` is split as DTensor's ``Shard``
    splits it (``torch.chunk``: pieces of ``ceil(size / parts)``, the last ones shorter or empty)."""
    chunk = math.ceil(size / parts) if size else 0
    start = min(index * chunk, size)
    return start, min(size, start + chunk) - start


def local_piece(full: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
    """This rank's piece of ``full`` (the parameter's global shape ``spec.shape``), a view."""
    dim = spec.shard_dim
    if dim is None:
        return full
    mesh = spec.mesh
    start, length = piece_range(spec.shape[dim], mesh.size(), mesh.get_local_rank())
    return full.narrow(dim, start, length)


def full_tensor(piece: torch.Tensor, spec: Optional[TensorParallelSpec]) -> torch.Tensor:
    """The parameter in its global shape from each mp rank's ``piece`` (collective over the mp mesh for a sharded
    parameter; ``piece`` itself otherwise)."""
    if spec is None or spec.shard_dim is None:
        return piece
    return as_dtensor(piece, spec).full_tensor()


def global_runs(spec: Optional[TensorParallelSpec], local_shape: tuple[int, ...], offset: int,
                numel: int) -> list[tuple[int, int, int]]:
    """Where a fragment lies in the parameter flattened in its *global* shape: ``[(global_offset, start, length)]``,
    each a contiguous run of ``length`` elements that starts at ``start`` in the fragment, which covers
    ``[offset, offset + numel)`` of this rank's local piece (shape ``local_shape``) flattened.

    A plain or replicated parameter is one run. For ``Shard(d)`` view the piece as ``(A, l, R)`` and the global
    tensor as ``(A, g, R)`` (``A`` the product of the dims before ``d``, ``R`` of those after): each of the ``A``
    blocks of ``l * R`` local elements is contiguous in the global flattening too, at ``(a * g + s) * R`` with ``s``
    the piece's start along ``d``. So a ``Shard(0)`` fragment is one run and a row-wise (``Shard(1)``) matrix's one
    run per row it touches. Empty fragments give ``[]``.
    """
    if numel == 0:
        return []
    if spec is None or spec.shard_dim is None:
        return [(offset, 0, numel)]
    d = spec.shard_dim
    g, local_len = spec.shape[d], local_shape[d]
    start, _ = piece_range(g, spec.mesh.size(), spec.mesh.get_local_rank())
    inner = math.prod(spec.shape[d + 1:])
    block = local_len * inner
    runs, i, end = [], offset, offset + numel
    while i < end:
        a, rem = divmod(i, block)
        n = min(end - i, block - rem)
        runs.append(((a * g + start) * inner + rem, i - offset, n))
        i += n
    return runs
