"""What a sharded model holds, as the checkpoint format sees it (see :mod:`shardfusion.checkpoint.save_load`): each
parameter's fragment on this rank, the kind of each optimizer state entry, the union of every rank's parameters,
buffers and state kinds, and how a set of parameter shapes differs from another.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.local_state_dict import persistent_buffers
from shardfusion._runtime.state import named_fragments as model_fragments
from shardfusion._runtime.state import sharded_state


def named_fragments(model: nn.Module):
    """``(name, fragment, runs, global numel, writes, full shape)`` for every parameter of
    ``model.named_parameters()`` (empty fragments included). ``runs``: where the fragment lies in the parameter
    flattened in its full (global) shape, ``[(offset, start in the fragment, length)]`` (one run, or for a
    tensor-parallel parameter one per block of its piece: ``tensor_parallel.global_runs``); ``writes``: this rank
    writes it (``is_primary``)."""
    table = {id(f.param): f for f in model_fragments(model)}
    for name, p in model.named_parameters():
        f = table[id(p)]
        shape = f.shape if f.tp_spec is None else tuple(f.tp_spec.shape)
        runs = tp.global_runs(f.tp_spec, f.shape, f.offset, f.numel)
        yield name, p, runs, math.prod(shape), f.buffer.is_primary, shape


def optimizer_list(optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list: ``None`` -> ``[]``, one optimizer -> ``[it]``, a list or tuple of them as given (e.g.
    Muon on the matrices, AdamW on the rest: their states are saved under the parameters' names, so together they
    are one optimizer to the checkpoint).

    Raises:
        ValueError: an entry is not a ``torch.optim.Optimizer``, or a parameter is in two of them.
    """
    if optimizer is None:
        return []
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    seen: dict[int, int] = {}
    for i, opt in enumerate(given):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizer[{i}] must be a torch.optim.Optimizer, got {type(opt).__name__}")
        for group in opt.param_groups:
            for p in group["params"]:
                if seen.setdefault(id(p), i) != i:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in optimizer[{seen[id(p)]}] and "
                                     f"optimizer[{i}]: each parameter may be in one optimizer only")
    return given


def merged_state(optimizers: list[torch.optim.Optimizer]) -> dict:
    """``{parameter: its state}`` over ``optimizers`` (each parameter in one of them), for reading."""
    out: dict = {}
    for opt in optimizers:
        out.update(opt.state)
    return out


def global_rank() -> int:
    """This process's rank in the default group (0 without one: the single-process readers)."""
    return dist.get_rank() if dist.is_initialized() else 0


def state_kind(p: torch.Tensor, value: Any) -> Optional[str]:
    """The kind of the optimizer state entry ``value`` of fragment ``p`` (see ``optim_state`` kinds in
    :mod:`~shardfusion.checkpoint.save_load`), ``None`` for a ``None`` entry (not saved).

    Raises:
        ValueError: any other entry (a tensor of another shape, a list, ...).
    """
    if value is None:
        return None
    if torch.is_tensor(value):
        if value.dim() == 0:
            return "tensor"
        if value.shape == p.shape:
            return "element"
    elif isinstance(value, (bool, int, float)):
        return type(value).__name__
    what = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else f"a {type(value).__name__}"
    raise ValueError(f"is {what}; only tensors of the fragment's shape {tuple(p.shape)} (per-element state), 0-d "
                     f"tensors and Python numbers can be saved")


NUMBER_DTYPES = {"int": torch.int64, "float": torch.float64, "bool": torch.bool}


def scalar_tensor(value: Any) -> torch.Tensor:
    """A scalar state entry as the 0-d tensor it is stored as."""
    if torch.is_tensor(value):
        return value.detach()
    return torch.tensor(value, dtype=NUMBER_DTYPES[type(value).__name__])


def model_info(model: nn.Module, optimizer=None,
                rank_state: Optional[dict] = None, unreadable: Optional[str] = None) -> dict:
    """What every rank holds, gathered (collective: one ``all_gather_object``): the union over ranks of parameter
    shapes, buffer shapes and optimizer state kinds (expert names differ across ep ranks), and the problems found on
    any rank (unsupported optimizer state, tensor-parallel parameters, non-tensor ``rank_state`` values) as
    ``"rank <r>: ..."`` strings, so that every rank can raise the same error; ``unreadable``: why this rank could
    not read the checkpoint (gathered under ``"unreadable"``)."""
    rank, mp_rank = global_rank(), sharded_state(model).topology.mp_rank
    mine: dict[str, Any] = {"shapes": {}, "buffer_shapes": {}, "optim_state": {}, "problems": [],
                            "unreadable": [f"rank {rank}: {unreadable}"] if unreadable else []}
    opt_state = merged_state(optimizer_list(optimizer))
    plain_tp = {id(f.param) for f in model_fragments(model) if f.tp_spec is None}
    tensor_parallel = []
    for name, p, _runs, _total, writes, shape in named_fragments(model):
        mine["shapes"][name] = shape
        if writes and mp_rank != 0 and id(p) in plain_tp:  # tensor_model_parallel=True on a plain tensor
            tensor_parallel.append(name)
        kinds = {}
        for key, value in opt_state.get(p, {}).items():
            try:
                kind = state_kind(p, value)
            except ValueError as error:
                mine["problems"].append(f"rank {rank}: optimizer state {key!r} of {name!r} {error}")
                continue
            if kind is not None:
                kinds[key] = kind
        if kinds:
            mine["optim_state"][name] = kinds
    if tensor_parallel:
        mine["problems"].append(f"rank {rank}: parameters {tensor_parallel} are marked tensor_model_parallel=True "
                                "but are plain tensors: a checkpoint cannot tell where each mp rank's piece lies; "
                                "make them DTensors over topology.get_mesh('mp') (docs/tensor-parallel.md)")
    for name, buf in persistent_buffers(model):
        mine["buffer_shapes"][name] = tuple(buf.shape)
    mine["nonpersistent"] = sorted({n for n, _ in model.named_buffers()} - set(mine["buffer_shapes"]))
    for key, value in (rank_state or {}).items():
        if not isinstance(key, str) or not torch.is_tensor(value):
            mine["problems"].append(f"rank {rank}: rank_state[{key!r}] must be a tensor under a str key, got "
                                    f"{type(value).__name__}")
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = comm.all_gather_object(mine, None, "what every rank holds (checkpoint)")
    out: dict[str, Any] = {"shapes": {}, "buffer_shapes": {}, "optim_state": {}, "problems": [], "unreadable": [],
                           "nonpersistent": set()}
    for part in every:
        for field in ("shapes", "buffer_shapes"):
            out[field].update(part[field])
        out["nonpersistent"].update(part["nonpersistent"])
        for name, kinds in part["optim_state"].items():
            out["optim_state"].setdefault(name, {}).update(kinds)
        out["problems"] += part["problems"]
        out["unreadable"] += part["unreadable"]
    return out


def param_names(model: nn.Module, optimizer) -> list[list[str]]:
    """For each parameter group of ``optimizer`` (one, or a list: their groups in order), the names (``model.named_parameters()``; a tied parameter: its
    first name) of its parameters, in the group's order. Recorded in a checkpoint for information only.

    Raises:
        KeyError: the optimizer holds a parameter that is not one of ``model``'s.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for opt in optimizer_list(optimizer) for group in opt.param_groups]


def mismatch(mine: dict, other: dict, other_name: str, missing_label: str, extra_label: str,
              also_allowed: frozenset | set = frozenset()) -> str:
    """What differs between the model's parameter shapes ``mine`` (every rank's) and ``other``'s: the parameters
    missing from ``other``, the names of ``other`` that are no parameter (nor in ``also_allowed``), the shapes that
    differ; ``""`` when nothing does."""
    mine = {n: tuple(shape) for n, shape in mine.items()}
    other = {n: tuple(shape) for n, shape in other.items()}
    missing = sorted(set(mine) - set(other))
    extra = sorted(set(other) - set(mine) - set(also_allowed))
    wrong = sorted(n for n in set(mine) & set(other) if mine[n] != other[n])
    parts = [f"{missing_label}: {missing}"] if missing else []
    parts += [f"{extra_label}: {extra}"] if extra else []
    if wrong:
        parts.append("shape mismatch: " + ", ".join(f"{n} model {mine[n]} vs {other_name} {other[n]}" for n in wrong))
    return "; ".join(parts)
