"""Save and load a sharded model and its AdamW state with ``torch.distributed.checkpoint`` (DCP), in any layout.

Public: :func:`save` / :func:`load` (one checkpoint folder), :func:`save_checkpoint` / :func:`latest_checkpoint`
(numbered checkpoints under a root folder, published atomically, the last K kept), :func:`load_full` /
:func:`read_all` (one process, no process group). Still to come (issue 5): export to safetensors, resume in the
training job, restart after a killed worker.

Format (plain DCP, no format of our own): every parameter is stored as a flattened 1-D global tensor of ``numel``
elements. A rank's fragment of it (``layout.fragments(shard_index)``: a contiguous range ``[start, end)`` of the
flattened parameter) is one DCP chunk with ``offsets=(start,)`` and ``sizes=(end - start,)``. Keys::

    model/<name>                 (numel,)   parameter values
    optim/<name>/exp_avg         (numel,)   AdamW state, same chunks as the parameter
    optim/<name>/exp_avg_sq      (numel,)
    optim/<name>/step            ()         plain tensor, written once (DCP dedups equal keys)
    model_buffer/<name>          shape      module buffers (dense only), plain tensors written once
    meta                         bytes      {"version", "shapes": {name: shape}, "param_groups": [...], "extra"}

Save: only the canonical holder of each shard writes its fragments (replica 0 of the replicate group, mp rank 0:
``FlatGroup.counts_in_norm``), with the global ``(numel,)`` size and the chunk offset; DCP's coordinator merges the
chunks of every rank into one ``TensorStorageMetadata`` per key (and validates that they tile the tensor). Bytes
written therefore do not depend on the outer (replicate) degree.

Load: every rank (replicas included) asks for exactly its fragment's range; DCP's resharding
(``create_read_items_for_chunk_list``) reads the overlapping parts of the stored chunks, whatever layout wrote them.
``load_full`` reads the same checkpoint in one process with no process group, into tensors of the original shapes.

DCP pitfalls met in the spike (torch 2.13):
- ``find_state_dict_object`` refuses a plain tensor addressed with a non-zero offset: both planners override
  ``lookup_object`` / ``lookup_tensor`` for fragment keys.
- ``_validate_global_plan`` requires the chunks of a key to tile its global size exactly (no overlap, full volume,
  when more than one rank plans): empty fragments must not be planned, and every shard needs exactly one writer.
- ``dedup_save_plans`` deduplicates by ``MetadataIndex`` (fqn, offset): equal replicated items are written once
  anyway, by the smallest plan unless ``dedup_save_to_lowest_rank``; we still plan fragments only on their writer.
- ``DefaultLoadPlanner(flatten_sharded_tensors=True)`` (the default) copies the state dict, so ``load_bytes`` writes
  the loaded object into the copy and the caller sees ``None``: pass ``flatten_sharded_tensors=False``.
- ``dcp.load`` replaces non-Stateful values of the caller's dict with the loaded ones (bytes items arrive there).
- FileSystemWriter serializes each item with its own header (~1 KB): negligible for real models, dominant here.
- Not handled yet: tensor-parallel (``mp``-sharded) parameters (same name, different values per mp rank), expert
  buffers, optimizers other than AdamW (their state keys), 0-element parameters are not stored (only their shape).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardfusion.fully_shard import _state

FORMAT_VERSION = 1
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


# ---- planners ----------------------------------------------------------------------------------------------------
class _FragmentSavePlanner(DefaultSavePlanner):
    """Writes ``fragments`` keys as 1-D chunks ``[offset, offset + numel)`` of a ``(global_numel,)`` tensor; every
    other key as DCP's default planner would (plain tensors and bytes, deduplicated across ranks)."""

    def __init__(self, fragments: dict[str, tuple[int, int]]) -> None:
        # flatten_state_dict=False: our keys are already flat strings, and the default flattening would store its
        # key mapping in Metadata.planner_data for nothing.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self._fragments = fragments  # key -> (offset in the flattened parameter, global numel)

    def create_local_plan(self) -> SavePlan:
        """One SHARD write item per fragment key: chunk ``(offset,)`` + ``(numel,)`` of a ``(global numel,)``
        tensor; DCP's default items for the rest."""
        items: list[WriteItem] = []
        rest = {}
        for fqn, obj in self.state_dict.items():
            if fqn not in self._fragments:
                rest[fqn] = obj
                continue
            offset, total = self._fragments[fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=obj.size())
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size([offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(obj),
                                            size=torch.Size([total]))))
        items += create_default_local_save_plan(rest, self.is_coordinator).items
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The fragment tensor itself for a fragment key (the default refuses a plain tensor at a non-zero
        offset); else the default lookup."""
        if index.fqn in self._fragments:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class _FragmentLoadPlanner(DefaultLoadPlanner):
    """Reads ``fragments`` keys as the 1-D range ``[offset, offset + numel)`` of the stored global tensor (any stored
    chunking); other keys as DCP's default planner. Keys in ``optional`` that the checkpoint lacks are skipped."""

    def __init__(self, fragments: dict[str, int], optional: frozenset = frozenset()) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._fragments = fragments  # key -> offset in the flattened parameter
        self._optional = optional

    def create_local_plan(self) -> LoadPlan:
        """Read items for exactly this rank's range of each fragment key (whatever chunks stored it); DCP's default
        items for the rest. Raises DCP's error for a missing key that is not optional."""
        md = self.metadata.state_dict_metadata
        items = []
        rest = {}
        for fqn, obj in self.state_dict.items():
            if fqn not in md:
                if fqn in self._optional:
                    continue
                raise RuntimeError(f"checkpoint has no {fqn!r}")
            if fqn not in self._fragments:
                rest[fqn] = obj
                continue
            tmd = md[fqn]
            offset, numel = self._fragments[fqn], obj.numel()
            if not isinstance(tmd, TensorStorageMetadata) or len(tmd.size) != 1 or offset + numel > tmd.size[0]:
                raise RuntimeError(f"{fqn!r}: checkpoint holds {tmd}, cannot read range [{offset}, {offset + numel})")
            if numel == 0:
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([numel]))
            items += create_read_items_for_chunk_list(fqn, tmd, [chunk])
        items += create_default_local_load_plan(rest, self.metadata, True).items
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The destination 1-D fragment for a fragment key (the read item's ``dest_offsets`` are relative to it);
        else the default lookup."""
        if index.fqn in self._fragments:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


# ---- model / optimizer walk ----------------------------------------------------------------------------------------
def _fragment_table(model: nn.Module) -> dict[int, tuple[str, int, int, bool, tuple]]:
    """``id(fragment) -> (name, offset in the flattened parameter, global numel, writes, shape)`` for every
    fragment this rank holds (empty ones included)."""
    state = _state(model)
    out = {}
    for unit in state.units:
        for g in unit.groups:
            count = g.layout.shard_count
            index = 0 if count == 1 or g.shard_group is None else dist.get_rank(g.shard_group)
            for param, frag in zip(g.fragments, g.layout.fragments(index)):
                out[id(param)] = (frag.slot.name, frag.param_offset, frag.slot.numel, bool(g.counts_in_norm),
                                  tuple(frag.slot.shape))
    return out


def _named_fragments(model: nn.Module):
    table = _fragment_table(model)
    for name, p in model.named_parameters():
        slot_name, offset, total, writes, shape = table[id(p)]
        yield name, p, offset, total, writes, shape


def _gather_shapes(model: nn.Module) -> dict[str, tuple]:
    """Original shapes of every parameter of every rank (expert names differ across ep ranks)."""
    mine = {name: shape for name, _, _, _, _, shape in _named_fragments(model)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, tuple] = {}
    for part in every:
        out.update(part)
    return out


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


# ---- public API ----------------------------------------------------------------------------------------------------
def save(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: str,
         extra: Optional[dict] = None) -> None:
    """Write ``model`` (and ``optimizer``'s AdamW state, and the picklable ``extra``) to the directory ``path``.

    Collective over the default process group. Each fragment is written once (by its canonical holder).
    """
    state = _state(model)
    sd: dict[str, Any] = {}
    fragments: dict[str, tuple[int, int]] = {}
    opt_state = optimizer.state if optimizer is not None else {}
    for name, p, offset, total, writes, _shape in _named_fragments(model):
        if not writes or p.numel() == 0:
            continue
        sd[f"model/{name}"] = p.detach()
        fragments[f"model/{name}"] = (offset, total)
        st = opt_state.get(p, {})
        for k in _ADAM_KEYS:
            if k in st:
                sd[f"optim/{name}/{k}"] = st[k]
                fragments[f"optim/{name}/{k}"] = (offset, total)
    # step: a 0-d tensor equal on every rank holding the parameter; emitted by all of them (also by ranks whose
    # fragment is empty, so that a parameter smaller than a shard still gets it), DCP keeps one copy.
    for name, p, *_ in _named_fragments(model):
        st = opt_state.get(p, {})
        if "step" in st:
            step = st["step"]
            sd[f"optim/{name}/step"] = step.detach().clone() if torch.is_tensor(step) else torch.tensor(float(step))
    dense_buffers, _expert_buffers = state.split_buffers()  # spike: expert buffers are not saved
    for name, buf in dense_buffers:
        sd[f"model_buffer/{name}"] = buf.detach()
    shapes = _gather_shapes(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        groups = []
        if optimizer is not None:
            for g, names in zip(optimizer.param_groups, _param_names(model, optimizer)):
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "param_names": names})
        sd["meta"] = {"version": FORMAT_VERSION, "shapes": shapes, "param_groups": groups, "extra": extra}
    dcp.save(sd, storage_writer=FileSystemWriter(path), planner=_FragmentSavePlanner(fragments),
             no_dist=not dist.is_initialized())


def _read_plain(sd: dict[str, Any], reader: FileSystemReader) -> None:
    """Fill ``sd`` (keys as stored; ``None`` for pickled items) from ``reader`` in this process alone, no collective.
    ``flatten_sharded_tensors=False``: the default copies ``sd``, and pickled items would land in the copy."""
    dcp.load(sd, storage_reader=reader,
             planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)


def read_meta(path: str) -> dict:
    """The ``meta`` item of a checkpoint (format version, original shapes, optimizer groups, ``extra``), read by this
    process alone (no collective).

    Raises:
        ValueError: ``path`` is not a readable checkpoint folder (names the path and the cause).
    """
    try:
        reader = FileSystemReader(path)
        sd: dict[str, Any] = {"meta": None}
        _read_plain(sd, reader)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's error is a BaseException
        # any unreadable folder: one clear error, the same on every rank
        raise ValueError(f"checkpoint folder {path!r} is not readable: {type(error).__name__}: {error}") from error
    return sd["meta"]


def _check_keys(model: nn.Module, meta: dict, path: str) -> None:
    """Missing or extra parameters and shape mismatches, from the files and the gathered shapes of every rank: the
    same decision on every rank (collective: one ``all_gather_object``)."""
    problems = _mismatch(_gather_shapes(model), meta["shapes"], "checkpoint", "missing from the checkpoint",
                         "in the checkpoint but not in the model")
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match the model: {problems}")


def _mismatch(mine: dict, other: dict, other_name: str, missing_label: str, extra_label: str,
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


def load(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: str) -> Optional[dict]:
    """Load ``path`` (written by :func:`save` in any layout) into this rank's fragments, in place; with
    ``optimizer`` (AdamW) also its state and the saved hyperparameters. Returns the saved ``extra``.

    Collective over the default process group.

    Raises:
        ValueError: on every rank, before any read of tensors: an unreadable folder, parameters missing from the
            checkpoint or from the model, or shapes that differ (each named).
    """
    _check_keys(model, read_meta(path), path)
    state = _state(model)
    sd: dict[str, Any] = {"meta": None}
    fragments: dict[str, int] = {}
    optional = set()
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state[p]
                if "exp_avg" not in st:  # a fresh optimizer: create the state we are about to fill
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    for name, p, offset, _total, _writes, _shape in _named_fragments(model):
        sd[f"model/{name}"] = p.detach()
        fragments[f"model/{name}"] = offset
        if optimizer is not None:
            st = optimizer.state[p]
            for k in _ADAM_KEYS:
                sd[f"optim/{name}/{k}"] = st[k]
                fragments[f"optim/{name}/{k}"] = offset
                optional.add(f"optim/{name}/{k}")
            if not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]))
            sd[f"optim/{name}/step"] = st["step"]
            optional.add(f"optim/{name}/step")
    dense_buffers, _ = state.split_buffers()
    for name, buf in dense_buffers:
        sd[f"model_buffer/{name}"] = buf.detach()
    # A parameter with 0 elements is never written: load nothing for it.
    reader = FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    for key in [k for k in sd if k.startswith("model/") and k not in stored]:
        if sd[key].numel() == 0:
            optional.add(key)
    with torch.no_grad():
        dcp.load(sd, storage_reader=reader, planner=_FragmentLoadPlanner(fragments, frozenset(optional)),
                 no_dist=not dist.is_initialized())
    meta = sd["meta"]
    if optimizer is not None and meta["param_groups"]:
        saved = {tuple(g["param_names"]): g for g in meta["param_groups"]}
        for g, names in zip(optimizer.param_groups, _param_names(model, optimizer)):
            src = saved.get(tuple(names))
            if src is not None:
                g.update({k: v for k, v in src.items() if k not in ("params", "param_names")})
    return meta["extra"]


def read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in one process with no process group: ``{key: tensor}``, parameter-shaped
    tensors (``model/`` and ``optim/.../exp_avg*``) reshaped to the original shapes."""
    reader = FileSystemReader(path)
    md = reader.read_metadata().state_dict_metadata
    sd: dict[str, Any] = {}
    for key, m in md.items():
        if isinstance(m, TensorStorageMetadata):
            sd[key] = torch.empty(m.size, dtype=m.properties.dtype)
        else:
            sd[key] = None
    _read_plain(sd, reader)
    shapes = sd["meta"]["shapes"]
    out = {}
    for key, t in sd.items():
        if key == "meta":
            continue
        parts = key.split("/")
        if parts[0] == "model" or (parts[0] == "optim" and parts[-1] in _ADAM_KEYS):
            t = t.view(shapes[parts[1]])
        out[key] = t
    for name, shape in shapes.items():  # 0-element parameters are never written
        out.setdefault(f"model/{name}", torch.empty(shape))
    return out


def load_full(path: str) -> dict[str, torch.Tensor]:
    """The model of a checkpoint, unsharded, in one process: ``{name: tensor}`` with the original shapes (buffers
    included)."""
    out = {}
    for key, t in read_all(path).items():
        if key.startswith("model/"):
            out[key[len("model/"):]] = t
        elif key.startswith("model_buffer/"):
            out[key[len("model_buffer/"):]] = t
    return out


def save_checkpoint(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], root: str, step: int,
                    keep: int = 3, extra: Optional[dict] = None) -> str:
    """Save to ``root/step-<step>`` atomically and keep the last ``keep`` checkpoints; returns the folder.

    Every rank writes into ``root/tmp-step-<step>``; after all ranks have finished (DCP's save ends with a collective
    commit, then a barrier), rank 0 renames it to ``root/step-<step>`` and replaces the ``root/latest`` pointer file
    (written to a temporary file, then ``os.replace``), then deletes the oldest published checkpoints beyond
    ``keep``. A crash before the rename leaves only a ``tmp-`` folder, which :func:`latest_checkpoint` ignores: the
    previous checkpoint stays the latest.

    Raises:
        ValueError: ``keep`` < 1 or ``step`` < 0.
    """
    if keep < 1 or step < 0:
        raise ValueError(f"save_checkpoint: keep must be >= 1 and step >= 0, got keep={keep}, step={step}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    final, tmp = os.path.join(root, f"step-{step}"), os.path.join(root, f"tmp-step-{step}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
    if dist.is_initialized():
        dist.barrier()
    save(model, optimizer, tmp, extra=extra)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = os.path.join(root, "latest")
        with open(pointer + ".tmp", "w") as f:
            f.write(f"step-{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        for old in _published(root)[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def _published(root: str) -> list[str]:
    """The published checkpoint folders under ``root`` (``step-<n>`` with DCP's ``.metadata``), oldest first."""
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root) if d.startswith("step-") and d[5:].isdigit()
             and os.path.isfile(os.path.join(root, d, ".metadata"))]
    return sorted(found, key=lambda d: int(d[5:]))


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest published checkpoint folder under ``root`` (from the ``latest`` pointer, else the highest
    complete ``step-<n>``), or ``None``. ``tmp-`` folders of interrupted saves are never returned."""
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if os.path.isfile(os.path.join(root, name, ".metadata")):
            return os.path.join(root, name)
    published = _published(root)
    return os.path.join(root, published[-1]) if published else None


def checkpoint_bytes(path: str) -> int:
    """Total size of the files of a checkpoint directory."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def load_full_state(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict, e.g. from :func:`load_full` or an exported safetensors file, into a sharded
    model's fragments and buffers, in place. Collective (one ``all_gather_object`` of the parameter shapes).

    Keys of experts held by other ep ranks are expected in a full state dict and skipped here; a tied parameter may
    appear under any of its names.

    Raises:
        ValueError: on every rank: a parameter of the model missing from ``state_dict``, a key that is no parameter
            or buffer of the model on any rank, or a shape that differs (each named).
    """
    shapes = _gather_shapes(model)
    buffers = dict(model.named_buffers())
    first = {id(p): n for n, p in model.named_parameters()}  # tied parameters: their first name
    aliases = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    given = {aliases.get(k, k): v for k, v in state_dict.items()}
    problems = _mismatch(shapes, {n: t.shape for n, t in given.items()}, "given", "missing", "unexpected",
                         also_allowed=set(buffers))
    if problems:
        raise ValueError(f"state dict does not match the model: {problems}")
    with torch.no_grad():
        for name, p, offset, _total, _writes, _shape in _named_fragments(model):
            p.copy_(given[name].reshape(-1)[offset:offset + p.numel()])
        for name, buf in buffers.items():
            if name in given:
                buf.copy_(given[name])
