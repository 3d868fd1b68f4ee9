"""Pretrained weights from safetensors files, streamed into a sharded model: :func:`load_safetensors`.

[Note: streaming load]
A model passed to :func:`shardfusion.fully_shard` holds, on each rank, one fragment of every parameter: the element
range ``[offset, offset + numel)`` of the row-major flattened parameter, whole rows of it (shards are cut on row
boundaries: [Note: row-aligned shards] in ``_runtime/layout.py``), a ``(rows, *shape[1:])`` view of the rank's shard
(see :class:`shardfusion._runtime.state.NamedFragment`). Loading a whole state dict on every rank to cut those ranges
out of it (:func:`shardfusion.checkpoint.load_full_state`) needs the whole model in memory on every rank. Here every
rank opens the files lazily instead (``safe_open``: the header is parsed, the data are memory-mapped, nothing is
read) and, for each of its fragments, reads only the rows (first-dim range) that cover the fragment, one tensor at a
time::

    row    = prod(shape[1:])                          # elements per row of the parameter
    r0, r1 = offset // row, ceil((offset + numel) / row)
    slab   = get_slice(name)[r0:r1]                   # (r1 - r0, *shape[1:]), in the file's dtype
    part   = slab.reshape(-1)[offset - r0 * row:][:numel]   # (numel,): the fragment, copied into the shard

Since a fragment is whole rows, ``offset`` and ``numel`` are multiples of ``row``: the slab is exactly the
fragment, so a rank reads only its fragments' rows (the ceiling would cover partial rows of a layout that cut
them), and the memory the load adds is one such slab (plus its dtype conversion). An empty fragment reads nothing.
Kept-whole parameters are fragments that cover the whole parameter; expert parameters appear only on the ep ranks
that hold them, so each ep rank reads only its own experts. Persistent buffers are read whole.

Before anything is copied every rank checks what it holds against the file headers, and one ``all_gather_object``
over the default group exchanges the findings (and the names of the experts each rank holds, so that the experts
of other ep ranks are not "unexpected"; the other names are the same on every rank): every rank then takes the same
decision. A second ``all_gather_object`` after the copy exchanges read errors, so a failed read raises on every rank
too.

The layout of a folder is Hugging Face's: ``model.safetensors``, or ``model.safetensors.index.json``, whose
``weight_map`` names the file holding each tensor. Reading slices through ``get_slice`` instead of whole tensors is
the idea of torch's distributed checkpoint (DCP) loading into FSDP2's sharded tensors, where each rank asks storage
for the chunks overlapping its own shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import arrival, comm
from shardfusion._runtime.local_state_dict import persistent_buffers
from shardfusion._runtime.state import named_fragments, sharded_state

__all__ = ["LoadResult", "load_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHOWN = 5  # names shown in an error message before "... (N in all)"

# safetensors dtype codes -> torch dtype names (those this torch lacks are refused as unsupported)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
           "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64", "C128": "complex128"}


class LoadResult(NamedTuple):
    """What :func:`load_safetensors` did not load, the same on every rank (as torch's ``load_state_dict`` returns)."""

    missing_keys: list[str]
    """Parameters (first names) and persistent buffers of the model, on any rank, that the files lack."""
    unexpected_keys: list[str]
    """Tensor names of the files (as stored) that no rank's model holds."""


@dataclass(frozen=True)
class _Entry:
    """One tensor of the files, as its header describes it."""

    stored: str  # its name in the file
    file: str  # the file's path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code, e.g. "BF16"
    handle: Any  # the open safe_open object of the file


@dataclass(frozen=True)
class _Target:
    """One parameter fragment or persistent buffer of this rank, to be filled."""

    names: tuple[str, ...]  # every name it is registered under, the first first
    shape: tuple[int, ...]  # full shape
    offset: int  # start of this rank's part in the flattened tensor (elements); 0 for a buffer
    numel: int  # elements this rank holds (0 allowed); all of them for a buffer
    dest: torch.Tensor  # the fragment (numel,) or the buffer (shape)


def load_safetensors(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                     key_map: Optional[Callable[[str], Optional[str]]] = None) -> LoadResult:
    """Load pretrained weights from safetensors files into a model passed to :func:`shardfusion.fully_shard`, in
    place, each rank reading only the parts of the tensors that its fragments hold (see [Note: streaming load]).

    Collective over the default process group: every rank calls it, with the same arguments.

    Args:
        model: the sharded model (any layout: FSDP, HSDP, kept-whole parameters, experts at any ep degree).
        path: a ``.safetensors`` file; or a folder holding ``model.safetensors.index.json`` (Hugging Face's sharded
            layout, ``{"metadata": ..., "weight_map": {tensor name: file name in the folder}}``); or a folder holding
            one ``model.safetensors``.
        strict: when True (default), a parameter or persistent buffer missing from the files, or a tensor of the
            files that the model does not hold, raises; when False they are left alone and returned.
        key_map: maps each tensor name of the files to the model's name for it (e.g. to drop a ``"model."``
            prefix); ``None`` from it skips that tensor. Default: the names as stored.

    A tensor must have the full shape of the parameter or buffer it fills (in elements, any dtype). Floating-point
    tensors are converted to the model's floating dtype as they are copied (a bf16 file loads into an fp32 model
    exactly; fp32 into bf16 rounds to nearest even, as ``Tensor.to``); any other dtype must equal the model's. A
    parameter registered under several names (tied weights) may be stored under any of them, once (the first
    found in registration order is read). Persistent buffers are loaded whole, expert ones on the ranks holding
    those experts; non-persistent buffers are neither loaded nor missing (a tensor stored for one is ignored).
    Memory: the shards plus one tensor's row slab, never a whole file or state dict.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)``, sorted, the same on every rank (empty lists under strict).

    Raises:
        ImportError: the ``safetensors`` package is not installed (``pip install safetensors``, or the
            ``shardfusion[train]`` extra).
        ValueError: ``model`` is not sharded, or it has tensor-parallel (DTensor) parameters. On every rank, before
            anything is copied: ``path`` is neither a file
            nor a folder of either layout, the index is not valid JSON with a ``weight_map``, a file is missing,
            truncated or corrupt (safetensors refuses its header), ranks see different files; under ``strict``,
            missing or unexpected names; a shape that differs, a dtype that cannot be converted, a name stored
            twice. Each kind names the first few names with their count, the file, the shapes and dtypes. On every
            rank, after the copy: a read failed on some rank (the model is then partly loaded).
    """
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError("shardfusion.load_safetensors needs the safetensors package: pip install safetensors "
                          "(or pip install 'shardfusion[train]')") from error
    state = sharded_state(model)
    arrival.enter("sf.load_safetensors", state.topology, range(state.topology.world_size))  # gathers over all
    path = os.fspath(path)
    split = [f.name for f in named_fragments(model) if f.tp_spec is not None]
    if split:  # the same on every rank: the model's structure
        raise ValueError(f"load_safetensors into a tensor-parallel model is not supported yet ({len(split)} DTensor "
                         f"parameters, e.g. {split[0]!r}): load the weights into the model before parallelize_module, "
                         "or load a full state dict (model.load_state_dict(full) takes global shapes)")
    targets, names_held, expert_names = _targets(model, state.expert_buffers)
    with contextlib.ExitStack() as stack:
        try:
            entries, unreadable = _open(path, safe_open, stack, key_map), None
        except ValueError as error:  # maybe on some ranks only (a file system not shared by every node)
            entries, unreadable = {}, str(error)
        mine = {"unreadable": unreadable, "digest": _digest(entries), "experts": expert_names,
                **_check(targets, entries)}
        every = _gather(mine)
        held = names_held | {n for part in every for n in part["experts"]}  # other ep ranks' experts too
        missing, unexpected = _decide(every, entries, held, path, type(model).__name__, strict)
        read_error = None
        try:
            _copy(targets, entries)
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            read_error = f"{type(error).__name__}: {error}"
        failed = [(r, e) for r, e in enumerate(_gather(read_error)) if e]
    state.reshard_all()  # a unit left gathered would hold the values from before the load
    if failed:
        raise ValueError(f"load_safetensors({path!r}): a read failed, the model is partly loaded: "
                         + "; ".join(f"rank {r}: {e}" for r, e in failed))
    return LoadResult(missing, unexpected)


# ---- this rank's model ---------------------------------------------------------------------------------------------
def _targets(model: nn.Module, expert_buffers: frozenset) -> tuple[list[_Target], set[str], list[str]]:
    """This rank's fragments and persistent buffers to fill; every name this rank's model holds (parameters and
    buffers, non-persistent ones and aliases included: a stored tensor under one of them is not unexpected); and
    those of them that belong to experts (``expert_buffers``: ids of the expert buffers), which differ across ep
    ranks (the others are the same on every rank)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    targets, experts = [], set()
    for f in named_fragments(model):
        targets.append(_Target(tuple(aliases.get(id(f.param), [f.name])), f.shape, f.offset, f.numel, f.param))
        if f.buffer.is_expert:
            experts.update(targets[-1].names)
    buffer_names: dict[int, list[str]] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        buffer_names.setdefault(id(b), []).append(name)
    for name, b in persistent_buffers(model):
        names = [name] + [n for n in buffer_names[id(b)] if n != name]
        targets.append(_Target(tuple(names), tuple(b.shape), 0, b.numel(), b))
    experts.update(n for b_id, names in buffer_names.items() if b_id in expert_buffers for n in names)
    held = {n for names in (*aliases.values(), *buffer_names.values()) for n in names}
    return targets, held, sorted(experts)


# ---- the files -----------------------------------------------------------------------------------------------------
def _files(path: str) -> tuple[list[str], Optional[dict[str, str]]]:
    """The safetensors files of ``path`` and the index's ``{tensor name: file path}`` (None without an index).

    Raises:
        ValueError: ``path`` is neither a file nor a folder of either layout, or the index is not valid.
    """
    if os.path.isfile(path):
        return [path], None
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in weight_map.items()):
                raise TypeError("weight_map is not a {str: str} object")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"safetensors index {index!r} cannot be read: {type(error).__name__}: {error}") from error
        located = {name: os.path.join(path, file) for name, file in weight_map.items()}
        return sorted(set(located.values())), located
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [os.path.join(path, SINGLE_FILE)], None
    what = "does not exist" if not os.path.exists(path) else f"is a folder with neither {INDEX_FILE} nor {SINGLE_FILE}"
    raise ValueError(f"safetensors path {path!r} {what}")


def _open(path: str, safe_open, stack: contextlib.ExitStack,
          key_map: Optional[Callable[[str], Optional[str]]]) -> dict[str, _Entry]:
    """Open every file of ``path`` (headers only) and describe its tensors: ``{model name: _Entry}``.

    Raises:
        ValueError: a file that cannot be opened (missing, truncated, corrupt), an index naming a tensor its file
            does not hold, a tensor stored twice, two stored names that ``key_map`` maps to one.
    """
    files, located = _files(path)
    entries: dict[str, _Entry] = {}
    for file in files:
        try:
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            described = []
            for stored in handle.keys():
                view = handle.get_slice(stored)  # lazy: nothing read
                described.append((stored, tuple(view.get_shape()), view.get_dtype()))
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error type, or OSError
            raise ValueError(f"safetensors file {file!r} cannot be read: {type(error).__name__}: {error}") from error
        for stored, shape, dtype in described:
            name = key_map(stored) if key_map is not None else stored
            if name is None:
                continue
            if name in entries:
                other = entries[name]
                raise ValueError(f"safetensors path {path!r}: {name!r} is stored twice: as {other.stored!r} in "
                                 f"{other.file!r} and as {stored!r} in {file!r}")
            entries[name] = _Entry(stored, file, shape, dtype, handle)
    found = {(e.stored, e.file) for e in entries.values()}
    for stored, file in (located or {}).items():
        if (stored, file) not in found and (key_map is None or key_map(stored) is not None):
            raise ValueError(f"safetensors index of {path!r} places {stored!r} in {file!r}, which does not hold it")
    return entries


def _digest(entries: dict[str, _Entry]) -> str:
    """What the headers say (names, shapes, dtypes; not the paths), as a short hex digest."""
    rows = sorted((n, e.stored, e.shape, e.dtype) for n, e in entries.items())
    return hashlib.sha1(repr(rows).encode()).hexdigest()[:16]


# ---- validation ----------------------------------------------------------------------------------------------------
def _check(targets: list[_Target], entries: dict[str, _Entry]) -> dict[str, list[str]]:
    """This rank's findings: the names it lacks in the files, and its shape and dtype problems (one line each)."""
    missing, shapes, dtypes = [], [], []
    for t in targets:
        name = next((n for n in t.names if n in entries), None)
        if name is None:
            missing.append(t.names[0])
            continue
        e = entries[name]
        called = f"{name!r}" + (f" (stored as {e.stored!r})" if e.stored != name else "")
        if e.shape != t.shape:
            shapes.append(f"{called}: model {t.shape}, file {e.shape} in {e.file!r}")
        src = getattr(torch, _DTYPES.get(e.dtype, ""), None)
        dst = t.dest.dtype
        if not isinstance(src, torch.dtype):
            dtypes.append(f"{called}: dtype {e.dtype} in {e.file!r} is not supported")
        elif not (src == dst or (src.is_floating_point and dst.is_floating_point)):
            dtypes.append(f"{called}: file dtype {src} in {e.file!r} does not convert to the model's {dst} "
                          f"(floating point converts to floating point; other dtypes must be equal)")
    return {"missing": missing, "shapes": shapes, "dtypes": dtypes}


def _gather(obj: Any) -> list:
    """``obj`` of every rank of the default group (one ``all_gather_object``; none without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    return comm.all_gather_object(obj, None, "the safetensors load's checks")


def _few(names: list[str]) -> str:
    """``3 names: 'a', 'b', 'c'`` / ``12 names: 'a', ..., 'e', ...``."""
    shown = ", ".join(repr(n) for n in names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    return f"{len(names)} name{'s' if len(names) != 1 else ''}: {shown}"


def _union(lists) -> list[str]:
    """The entries of ``lists``, each once, in order of first appearance."""
    return list(dict.fromkeys(x for part in lists for x in part))


def _decide(every: list[dict], entries: dict[str, _Entry], held: set[str], path: str, model_name: str,
            strict: bool) -> tuple[list[str], list[str]]:
    """From every rank's findings and the names ``held`` by any rank, the same decision on every rank:
    ``(missing, unexpected)``, or a ValueError."""
    head = f"load_safetensors({path!r}) into the sharded {model_name}: nothing copied, on every rank: "
    unreadable: dict[str, list[int]] = {}  # error text -> the ranks that hit it
    for r, part in enumerate(every):
        if part["unreadable"]:
            unreadable.setdefault(part["unreadable"], []).append(r)
    if unreadable:
        raise ValueError(head + "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
                                          for text, ranks in unreadable.items()))
    digests = {part["digest"] for part in every}
    if len(digests) > 1:
        by = {d: [r for r, part in enumerate(every) if part["digest"] == d] for d in digests}
        raise ValueError(head + "ranks see different files (names, shapes or dtypes differ): ranks "
                         + " vs ".join(str(r) for r in sorted(by.values())))
    missing = sorted(_union(part["missing"] for part in every))
    extra = [e for n, e in entries.items() if n not in held]  # held by no rank (other ep ranks' experts are)
    unexpected = sorted(e.stored for e in extra)
    problems = []
    if strict and missing:
        problems.append(f"missing from the files: {_few(missing)}")
    if strict and unexpected:
        files = sorted({e.file for e in extra})
        problems.append(f"in the files but not in the model: {_few(unexpected)} (in {', '.join(map(repr, files))}); "
                        f"key_map= can rename them, strict=False skips them")
    for kind, label in (("shapes", "shape mismatch"), ("dtypes", "dtype mismatch")):
        found = _union(part[kind] for part in every)
        if found:
            more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
            problems.append(f"{label} for {len(found)} tensor{'s' if len(found) > 1 else ''}: "
                            + "; ".join(found[:SHOWN]) + more)
    if problems:
        raise ValueError(head + "; ".join(problems))
    return missing, unexpected


# ---- the copy ------------------------------------------------------------------------------------------------------
def _copy(targets: list[_Target], entries: dict[str, _Entry]) -> None:
    """Read each target's part of its tensor (the covering rows only) and copy it in, converting the dtype."""
    with torch.no_grad():
        for t in targets:
            name = next((n for n in t.names if n in entries), None)
            if name is None or t.numel == 0:  # missing (strict=False), or an empty fragment: nothing to read
                continue
            part = _read_range(entries[name], t.offset, t.numel)  # (numel,), file dtype
            t.dest.data.copy_(part.view(t.dest.shape))


def _read_range(e: _Entry, offset: int, numel: int) -> torch.Tensor:
    """Elements ``[offset, offset + numel)`` of the flattened tensor ``e``, ``(numel,)`` in the file's dtype, read
    as the rows (first-dim range) that cover them."""
    if len(e.shape) == 0:
        return e.handle.get_tensor(e.stored).reshape(1)
    from safetensors import safe_open

    row = math.prod(e.shape[1:])  # elements per row; > 0, since numel > 0
    r0, r1 = offset // row, -(-(offset + numel) // row)
    # A handle of its own per read: the file's pages this read touched are unmapped when it closes, so they do not
    # add up in the resident set over the whole load (a handle kept open keeps every page it touched mapped).
    with safe_open(e.file, framework="pt", device="cpu") as handle:
        slab = handle.get_slice(e.stored)[r0:r1]  # (r1 - r0, *shape[1:]), a copy out of the mapping
    start = offset - r0 * row
    return slab.reshape(-1)[start:start + numel]
