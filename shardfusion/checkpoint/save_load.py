"""Save and load a sharded model, its optimizer state and per-rank state with ``torch.distributed.checkpoint`` (DCP),
in any layout.

Public: :func:`save` / :func:`load` (one checkpoint folder), :func:`save_checkpoint` / :func:`latest_checkpoint`
(numbered checkpoints under a root folder, published atomically, the last K kept), :func:`read_meta`,
:func:`load_full` / :func:`read_all` (one process, no process group), :func:`load_full_state` (a full state dict
into a sharded model). Export to safetensors: :mod:`shardfusion.export`. Each distributed call takes ``model`` as
one sharded model or as the list of this rank's sharded models (its pipeline stages: see "Pipeline stages" below).

Format (plain DCP, no format of our own): every parameter is stored as a flattened 1-D global tensor of ``numel``
elements. A rank's fragment of it (``layout.fragments(shard_index)``: a contiguous range ``[start, end)`` of the
flattened parameter) is one DCP chunk with ``offsets=(start,)`` and ``sizes=(end - start,)``. Keys::

    model/<name>                 (numel,)   parameter values
    optim/<name>/<key>           (numel,)   per-element optimizer state (a tensor of the fragment's shape: exp_avg,
                                            exp_avg_sq, max_exp_avg_sq, momentum_buffer, sum, square_avg, ...),
                                            same chunks as the parameter
    optim/<name>/<key>           ()         scalar optimizer state (a 0-d tensor such as step, or a Python number),
                                            a plain tensor written once (DCP dedups equal keys)
    model_buffer/<name>          shape      persistent module buffers (those state_dict() holds; non-persistent
                                            ones are left out), dense and expert ones (expert names are global
                                            across the ep ranks), plain tensors written once per name
    rank/<global rank>/<key>     shape      per-rank state (e.g. RNG states), written by that rank only
    meta                         bytes      {"version", "world_size", "shapes": {name: shape},
                                            "buffer_shapes": {name: shape},
                                            "optim_state": {name: {key: kind}} or None (saved without optimizer),
                                            "param_groups": [...], "extra",
                                            "optimizers": [class name of each optimizer, in order]}
                                            merged from every rank's part (one all_gather_object), written by rank 0

``meta`` is the same whichever rank holds what: ``shapes``, ``buffer_shapes`` and ``optim_state`` are the unions
over every rank (expert names differ across ep ranks, stage names across pp ranks). ``param_groups``: group ``i``
of this rank's optimizers (their groups in order) is saved group ``i``: its hyperparameters (every entry but
``params``), which must be equal on every rank, plus ``"param_names"``, the names of every rank's group ``i`` (rank
order, each once). :func:`save` refuses ranks whose optimizer classes, number of groups or hyperparameters at an
index differ. ``optimizers``: the classes, the same on every rank; :func:`load` refuses other optimizers than those
saved, or another order (a checkpoint without the entry is not checked).

Versions: ``FORMAT_VERSION`` 3 (since pipeline stages) merges ``param_groups`` over the ranks as above; version 2
recorded rank 0's names only. :func:`load` reads both (the keys and tensors are the same); for a version-2
checkpoint the groups are matched by index without comparing names. ``read_all`` / ``load_full`` / the export read
any version.

``optim_state`` kinds: ``"element"`` (per-element), ``"tensor"`` (0-d tensor), ``"int"`` / ``"float"`` / ``"bool"``
(a Python number, stored as a 0-d int64 / float64 / bool tensor). A parameter without optimizer state (e.g. it never
had a gradient) has no entry. Names are those of ``model.named_parameters()`` (a tied parameter: its first name).

Save: only the canonical holder of each shard writes its fragments (replica 0 of the replicate group, mp rank 0:
``FlatBuffer.is_primary``), with the global ``(numel,)`` size and the chunk offset; DCP's coordinator merges the
chunks of every rank into one ``TensorStorageMetadata`` per key (and validates that they tile the tensor). Bytes
written therefore do not depend on the outer (replicate) degree. Scalar state and buffers are emitted by every rank
holding them (also by ranks whose fragment is empty, so that a parameter smaller than a shard still gets its
``step``); DCP keeps the lowest rank's copy, so they must be equal on those ranks (as ``step`` and synced buffers are).

Pipeline stages (``shardfusion.pipeline``): a rank holding stages ``s, s + pp, ...`` passes the list of its sharded
stage modules (each passed to ``fully_shard`` with the job's one ``Topology``) and one optimizer, or a list, over
their parameters. Every key is a parameter name, so stages must name their parameters as the whole model does
(``split_gpt`` keeps the GPT's names): the checkpoint then does not depend on the pp degree or on the split, and a
pp 2 checkpoint loads into the whole model at pp 1, into pp 2 x outer 2, or an interleaved run's into any of them.
Refused on every rank (``ValueError`` naming the rank and the index): an entry that is not sharded, given twice,
sharded with another ``Topology`` object, two entries holding one parameter or name, an optimizer parameter in none
of them; and, from the gathered parts, a name held on two pp ranks (stages naming different parameters alike would
mix them under one key) or with two shapes.

Load: every rank (replicas included) asks for exactly its fragment's range; DCP's resharding
(``create_read_items_for_chunk_list``) reads the overlapping parts of the stored chunks, whatever layout wrote them.
The optimizer state of each parameter becomes exactly the checkpoint's: the keys come from ``meta["optim_state"]``
(a fresh optimizer gets zero tensors of the stored dtypes, which DCP then fills), keys the checkpoint lacks are
dropped. The hyperparameters are restored group by group, by index, when this rank's optimizers have as many groups
as saved; a group ``i`` holding a parameter that the checkpoint has in group ``j != i`` is refused (version 3), so a
group never takes another group's hyperparameters. ``load_full`` reads the same checkpoint in one process with no
process group, into tensors of the original shapes.

Tensor parallel (``mp``): a DTensor parameter (docs/tensor-parallel.md) is stored like any other, flattened in its
*global* shape, so a checkpoint does not depend on the mp degree (save at mp 2, load at mp 1 or 4). Each mp rank
writes and reads its piece's fragment as the runs it covers in that flattening (``tensor_parallel.global_runs``):
one chunk for a ``Shard(0)`` (column-wise) piece, one per row for a ``Shard(1)`` (row-wise) matrix. ``Replicate()``
and plain parameters are identical on every mp rank: only mp rank 0 writes them (``is_primary``) and every mp rank
reads the same values. A *plain* tensor marked ``tensor_model_parallel = True`` (Megatron's convention) says that
it differs across mp but not how it was split: :func:`save` and :func:`load` raise ``ValueError`` for it.

The DCP planners that write and read fragments, and the DCP pitfalls they avoid, are in
:mod:`shardfusion.checkpoint.planners`; what the model holds in these terms (fragments, optimizer state kinds,
gathered over the ranks) is in :mod:`shardfusion.checkpoint.inventory`.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from shardfusion.checkpoint import background
from shardfusion.checkpoint.background import AsyncSave
from shardfusion.checkpoint.folder import prepare, publish
from shardfusion.checkpoint.inventory import (NUMBER_DTYPES, by_ranks, global_rank, local_info, merged_info,
                                              merged_state, mismatch, model_info, model_list, named_buffers,
                                              named_fragments, named_parameters, names_text, optimizer_list,
                                              optimizer_problems, scalar_tensor, state_kind)
from shardfusion.checkpoint.planners import FragmentLoadPlanner, FragmentSavePlanner
from shardfusion.checkpoint.read import failure_text, open_checkpoint, read_error
from shardfusion._runtime.state import is_sharded, sharded_state
from shardfusion import arrival, comm
from shardfusion.comm import call_on_rank0

__all__ = ["FORMAT_VERSION", "save", "load", "save_checkpoint", "load_full_state", "staging_bytes"]

FORMAT_VERSION = 3
# versions load reads: 2 (before pipeline stages: meta["param_groups"] with rank 0's names) is read as before, its
# groups by index without the name check
READ_VERSIONS = (2, 3)

_Model = Union[nn.Module, Sequence[nn.Module]]
_Optimizer = Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


# ---- public API ----------------------------------------------------------------------------------------------------
def save(model: _Model, optimizer: _Optimizer, path: str, extra: Optional[dict] = None,
         rank_state: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Write ``model`` (parameters and buffers), ``optimizer``'s state and hyperparameters, the picklable ``extra``
    and this rank's ``rank_state`` to the directory ``path`` (keys: see the module docstring).

    ``model``: a model passed to :func:`shardfusion.fully_shard`, or the list of this rank's sharded models (its
    pipeline stages, each sharded with the job's one ``Topology``; ranks may hold different stages). ``optimizer``
    covers the parameters of all of them. Parameters are saved under their names, so stages must name them as the
    whole model does (``split_gpt`` does): the checkpoint then does not depend on the pp degree or the split.

    Collective over the default process group; it starts with an arrival check of every rank, bounded by the arrival
    deadline (``arrival.check``). Each fragment is written once (by its canonical holder). Optimizer
    state entries may be tensors of the fragment's shape (saved per element, any dtype), 0-d tensors or Python
    numbers (saved once); ``None`` entries are skipped. ``rank_state`` (``{key: tensor}``, any shape, dtype and
    device, e.g. ``{"cpu_rng": torch.get_rng_state()}``) is stored under ``rank/<global rank>/<key>``; ranks may pass
    different keys, or ``None``. ``optimizer`` may be a list of optimizers, each parameter in one of them (e.g.
    Muon on the matrices, AdamW on the rest): their states are saved under the parameters' names and their param
    groups in order, so a load takes the same list.

    Raises:
        RuntimeError: on the ranks that called it, within the arrival deadline: some rank did not call it (e.g. a
            save under ``if rank == 0:``); the message names the call and the absent ranks.
        ValueError: on every rank, before anything is written, naming the rank: a ``model`` that is not a sharded
            model or a list of them (an entry not sharded, given twice, sharded with another ``Topology`` object,
            two entries holding the same parameter or name; named by index), ``optimizer`` not an optimizer or a
            list of them (a parameter in two, a parameter in none of the models), an optimizer state entry of
            another kind, a parameter name held on two pp ranks (stages naming different parameters alike) or with
            two shapes, ranks whose optimizers or param groups differ (the classes, the number of groups, or a
            group's hyperparameters at the same index: named with both values), a plain tensor marked
            ``tensor_model_parallel`` with mp > 1, or a ``rank_state`` value that is not a tensor; after the write,
            on every rank: a rank could not write its files (disk full, not writable: ``checkpoint <path> cannot be
            written: rank r: ...``), and the folder is then incomplete.
    """
    models, optimizers, info = _meet(model, optimizer, "save", held=rank_state)
    _write(*_state_dict(models, optimizers, path, extra, rank_state, info), path)


_NOTHING_HELD = object()  # _meet's default: gather no local_info


def _meet(model: _Model, optimizer: _Optimizer, call: str, in_flight: Optional[AsyncSave] = None,
          held: Any = _NOTHING_HELD) -> tuple[list[nn.Module], list, Optional[dict]]:
    """The start of every checkpoint call: the arrival check of every rank of the default group (a call made on some
    ranks only fails here, within the arrival deadline, naming the call and the absent ranks, before anything is
    written or read: ``arrival.check``), then
    the arguments checked (:func:`model_list`, :func:`optimizer_list`, :func:`optimizer_problems`) on every rank
    and the problems of every rank gathered (one ``all_gather_object``), so that a bad argument on one rank raises
    on every rank. With ``in_flight`` (the asynchronous save in flight, every rank's) each rank first waits for its
    own part of that save and the same gather carries its outcome, on which the ranks agree (no collective more).
    With ``held`` (a save's ``rank_state``, None included) the same gather also carries this rank's
    :func:`local_info` (what a save's ``meta`` and checks need: no collective more). Returns ``(models,
    optimizers, info)``: the lists, and :func:`model_info` merged from every rank's part (None without ``held``).

    Raises:
        ValueError: on every rank: the save ``in_flight`` failed (as ``AsyncSave.wait``); ``sf.checkpoint.<call>:
            rank r: ...`` for each rank's problems (the ranks that found the same one named together: ``ranks 0-3:
            ...``).
    """
    models, problems = model_list(model)
    given = model if isinstance(model, (list, tuple)) else [model]
    topologies = [sharded_state(m).topology for m in given if isinstance(m, nn.Module) and is_sharded(m)]
    arrival.check(f"sf.checkpoint.{call}", None, arrival.deadline(topologies[0] if topologies else None))
    optimizers: list = []
    try:
        optimizers = optimizer_list(optimizer)
    except ValueError as error:
        problems.append(str(error))
    if models and not problems:
        problems += optimizer_problems(models, optimizers)
    part = local_info(models, optimizers, held) if held is not _NOTHING_HELD and not problems else None
    outcome = in_flight.local_outcome() if in_flight is not None else None
    every = [(problems, outcome, part)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        size = dist.get_world_size()  # one round when every rank's part fits: at most 4 MiB in all past 64 ranks
        every = comm.all_gather_object(every[0], None, f"the arguments of sf.checkpoint.{call}",
                                       capacity=max(4096, min(65536, 2 ** 22 // size)))
    if in_flight is not None:
        in_flight.settle([outcome for _, outcome, _ in every])
    found = by_ranks([mine for mine, _, _ in every])
    if found:
        raise ValueError(f"sf.checkpoint.{call}: " + "; ".join(found))
    return models, optimizers, None if held is _NOTHING_HELD else merged_info([part for _, _, part in every])


def _state_dict(models: list[nn.Module], optimizers: list, path: str, extra: Optional[dict],
                rank_state: Optional[dict[str, torch.Tensor]],
                info: dict) -> tuple[dict[str, Any], dict[str, tuple[list, int]]]:
    """What this rank writes to ``path`` (keys: see the module docstring) and the fragment keys' ``(runs, global
    numel)`` for :class:`FragmentSavePlanner`. The tensors are the model's and the optimizer's own (views, not
    copies). ``info``: :func:`model_info` of these arguments, gathered by :func:`_meet`. Local: no collective.

    Raises:
        ValueError: on every rank (``info`` is the same on every rank): the problems ``info`` holds.
    """
    if info["problems"]:
        raise ValueError(f"cannot save checkpoint {path!r}: " + "; ".join(info["problems"]))
    sd, fragments = _tensors(models, optimizers, rank_state)
    if global_rank() == 0:  # what every rank holds, gathered and merged by model_info: the same on every rank
        sd["meta"] = {"version": FORMAT_VERSION,
                      "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                      "shapes": info["shapes"], "buffer_shapes": info["buffer_shapes"],
                      "optim_state": info["optim_state"] if optimizers else None,
                      "param_groups": info["param_groups"], "extra": extra, "optimizers": info["optimizers"]}
    return sd, fragments


def _tensors(models: list[nn.Module], optimizers: list, rank_state: Optional[dict[str, torch.Tensor]]
             ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[list, int]]]:
    """The tensors this rank writes, by key (every key but ``meta``), and the fragment keys' ``(runs, global
    numel)``. Local: no collective (the arguments were checked on every rank before)."""
    sd: dict[str, Any] = {}
    fragments: dict[str, tuple[list, int]] = {}
    opt_state = merged_state(optimizers)
    for name, p, runs, total, writes, _shape in named_fragments(models):
        st = opt_state.get(p, {})
        kinds = {k: state_kind(p, v) for k, v in st.items()}
        if writes and p.numel() > 0:
            sd[f"model/{name}"] = p.detach().view(-1)  # stored flattened: a fragment has its rows' shape
            fragments[f"model/{name}"] = (runs, total)
            for k, kind in kinds.items():
                if kind == "element":
                    sd[f"optim/{name}/{k}"] = st[k].detach().reshape(-1)
                    fragments[f"optim/{name}/{k}"] = (runs, total)
        for k, kind in kinds.items():  # every rank holding the parameter (empty fragments too); DCP keeps one
            if kind not in (None, "element"):
                sd[f"optim/{name}/{k}"] = scalar_tensor(st[k])
    # dense and expert ones (global names), persistent ones only (as state_dict); DCP keeps one copy per name
    for name, buf in named_buffers(models):
        sd[f"model_buffer/{name}"] = buf.detach()
    for key, value in (rank_state or {}).items():
        sd[f"rank/{global_rank()}/{key}"] = value.detach()
    return sd, fragments


def _copied_behind(sd: dict[str, Any], models: list[nn.Module], optimizers: list) -> frozenset[str]:
    """The keys of ``sd`` whose staging copy an asynchronous save may make behind the step loop (see [Note:
    asynchronous saves]): those in host memory of the parameters that ``optimizers`` update, their fragments and
    their optimizer state (only an optimizer step changes them, and it waits for the copy)."""
    stepped = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    names = {name for name, p, *_ in named_fragments(models) if id(p) in stepped}
    keys = []
    for key, value in sd.items():  # model/<name> and optim/<name>/<state key>: a name holds dots, never a slash
        if key.startswith("model/"):
            name = key[len("model/"):]
        elif key.startswith("optim/"):
            name = key[len("optim/"):key.rindex("/")]
        else:
            continue
        if name in names and value.device.type == "cpu":
            keys.append(key)
    return frozenset(keys)


def _write(sd: dict[str, Any], fragments: dict[str, tuple[list, int]], path: str) -> None:
    """``dcp.save`` of ``sd`` to ``path`` with the fragment planner. Collective.

    Raises:
        ValueError: on every rank: a rank could not write its files (DCP gathers every rank's write errors).
    """
    try:
        with comm.torch_object_collectives_without_numpy():  # DCP's own object collectives
            dcp.save(sd, storage_writer=FileSystemWriter(path), planner=FragmentSavePlanner(fragments),
                     no_dist=not dist.is_initialized())
    except (CheckpointException, OSError) as error:  # DCP gathers every rank's write errors: raised on every rank
        raise ValueError(f"checkpoint {path!r} cannot be written: "
                         f"{failure_text(error, with_ranks=dist.is_initialized())}") from error


def _check_keys(info: dict, meta: dict, path: str) -> None:
    """Format version, missing or extra parameters and buffers, shape mismatches and unsupported parameters, from
    the files and the gathered ``info`` (:func:`model_info`) of every rank: the same decision on every rank.
    ``meta`` is None where this rank could not read the checkpoint (``info`` then holds why)."""
    if info["unreadable"]:
        raise ValueError("; ".join(info["unreadable"]))
    if meta.get("version") not in READ_VERSIONS:
        raise ValueError(f"checkpoint {path!r} has format version {meta.get('version')}; load reads versions "
                         f"{list(READ_VERSIONS)} (read_all / load_full read any version)")
    problems = [mismatch(info["shapes"], meta["shapes"], "checkpoint", "missing from the checkpoint",
                          "in the checkpoint but not in the model"),
                mismatch(info["buffer_shapes"], meta["buffer_shapes"], "checkpoint",
                          "buffers missing from the checkpoint", "buffers in the checkpoint but not in the model",
                          also_allowed=info["nonpersistent"])]  # written by older versions: not read
    problems = [p for p in problems if p] + info["problems"]
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match the model: {'; '.join(problems)}")


def _optimizers_differ(optimizers: list, meta: dict) -> bool:
    """Whether ``optimizers`` are other classes, or in another order, than those the checkpoint was saved with
    (recorded since the list of optimizers; older checkpoints are not checked)."""
    saved = meta.get("optimizers")
    if not optimizers or meta.get("optim_state") is None or saved is None:
        return False
    return [type(opt).__name__ for opt in optimizers] != saved


def _check_optimizers(optimizers: list, meta: dict, path: str) -> None:
    """The optimizers given to :func:`load` are those the checkpoint was saved with, in the same order (their class
    names): otherwise each group would take another optimizer's hyperparameters and each parameter another
    optimizer's state. The same decision on every rank (the names come from the checkpoint and the arguments)."""
    if _optimizers_differ(optimizers, meta):
        raise ValueError(f"checkpoint {path!r} was saved with optimizers {meta['optimizers']}, in this order; load "
                         f"was given {[type(opt).__name__ for opt in optimizers]}: pass the same optimizers in the "
                         "same order, or optimizer=None to load the parameters only")


def _group_problems(models: list[nn.Module], optimizers: list, meta: Optional[dict]) -> list[str]:
    """Why this rank's param groups cannot take the saved hyperparameters by index (version 3, as many groups as
    saved, the same optimizers): a parameter of given group ``i`` that the checkpoint has in another group ``j``
    (its ``param_names``, merged over every rank at save). Parameters in no saved group (saved without state, or
    frozen) are not compared. Local: gathered by ``model_info`` so that every rank raises."""
    if (not optimizers or meta is None or meta.get("version", 0) < 3 or meta.get("optim_state") is None
            or _optimizers_differ(optimizers, meta)):
        return []
    saved = meta["param_groups"]
    groups = [g for opt in optimizers for g in opt.param_groups]
    if len(groups) != len(saved):
        return []  # the hyperparameters are then left as they are (load's docstring)
    where = {n: j for j, g in enumerate(saved) for n in g["param_names"]}
    names = {id(p): n for n, p, *_ in named_fragments(models)}  # a tied copy under the weight's name
    problems = []
    for i, g in enumerate(groups):
        moved: dict[int, list[str]] = {}
        for p in g["params"]:
            j = where.get(names[id(p)], i)
            if j != i:
                moved.setdefault(j, []).append(names[id(p)])
        for j, which in moved.items():
            problems.append(f"param group {i} holds {names_text(which)}, which the checkpoint has in param group {j}: "
                            "groups are matched by index (meta['param_groups'][i]['param_names']); build the groups "
                            "in the saved order, or load with optimizer=None")
    return problems


def _plan_optimizer(models: list[nn.Module], optimizers: list[torch.optim.Optimizer], kinds_by_name: dict,
                    stored: dict, sd: dict, fragments: dict, optional: set) -> None:
    """Make each parameter's optimizer state hold exactly the checkpoint's keys (existing tensors of the right shape
    and dtype are reused, others are created as zeros of the stored dtype; keys not in the checkpoint are dropped,
    a parameter without saved state loses its state) and add them to ``sd`` for DCP to fill."""
    table = {id(p): (name, runs) for name, p, runs, *_ in named_fragments(models)}
    for optimizer, group in [(opt, g) for opt in optimizers for g in opt.param_groups]:
        # 0-d tensors on the CPU unless capturable / fused, where torch's optimizers create them (step, mu_product)
        scalar_device = "param" if group.get("capturable", False) or group.get("fused", False) else "cpu"
        for p in group["params"]:
            name, runs = table[id(p)]
            kinds = kinds_by_name.get(name)
            if not kinds:
                optimizer.state.pop(p, None)
                continue
            old, new = optimizer.state[p], {}
            for k, kind in kinds.items():
                key = f"optim/{name}/{k}"
                dtype = stored[key].properties.dtype if key in stored else p.dtype
                shape = p.shape if kind == "element" else torch.Size([])
                device = p.device if kind == "element" or (kind == "tensor" and scalar_device == "param") else \
                    torch.device("cpu")
                cur = old.get(k)
                if not (torch.is_tensor(cur) and cur.shape == shape and cur.dtype == dtype and cur.device == device):
                    cur = torch.zeros(shape, dtype=dtype, device=device)
                new[k] = cur
                sd[key] = cur.view(-1) if kind == "element" else cur  # a view: DCP loads into the state itself
                if kind == "element":
                    fragments[key] = runs
                    if p.numel() == 0:  # a parameter of 0 elements: its per-element state is never written
                        optional.add(key)
            old.clear()
            old.update(new)


def load(model: _Model, optimizer: _Optimizer, path: str,
         rank_state: Optional[dict[str, torch.Tensor]] = None) -> Optional[dict]:
    """Load ``path`` (written by :func:`save` in any layout and world size) into this rank's fragments and buffers,
    in place; returns the saved ``extra``.

    ``model``: a sharded model or the list of this rank's sharded stages (as :func:`save`); the pp degree and the
    stage split need not be those that saved (a pp 2 checkpoint loads into the whole model at pp 1 and back), as
    long as the ranks together hold every saved parameter under its name.

    With ``optimizer`` (and a checkpoint saved with one) its state becomes the saved one: per-element state is
    resharded like the parameters, scalars (``step``) are restored on every rank holding the parameter, Python
    numbers come back as Python numbers; keys missing from the checkpoint are dropped and parameters that had no
    state get none. The saved hyperparameters (every param-group entry but ``params``: lr, weight_decay, betas, ...)
    are restored group by group, by index (this rank's optimizers' groups in order), when ``optimizer`` has as many
    param groups as the saved one (as torch's ``Optimizer.load_state_dict`` does); with another number of groups the
    groups are left as they are. Each saved group's ``param_names`` are those of every rank (every pp stage, every
    ep rank): a parameter that this rank's group ``i`` holds but the checkpoint has in group ``j != i`` is refused
    (ValueError), so groups never take another group's hyperparameters. The caller may
    override hyperparameters after the load (the training job of :mod:`shardfusion.train` re-applies its flags). A
    checkpoint saved without an optimizer leaves ``optimizer`` as it is. ``optimizer`` may be a list of optimizers
    (see :func:`save`); the state of each parameter goes to the one holding it.

    ``rank_state`` (``{key: tensor}``): each value is filled from ``rank/<this rank>/<key>``, in place when shape and
    dtype match (else the entry is replaced by the stored tensor, on the CPU); keys the checkpoint lacks for this
    rank (e.g. it was saved by a smaller world size) are removed from the dict, so the caller knows what was not
    restored.

    Collective over the default process group; it starts with an arrival check of every rank, bounded by the arrival
    deadline, as :func:`save`.

    Raises:
        RuntimeError: on the ranks that called it, within the arrival deadline: some rank did not call it.
        ValueError: on every rank, before any read of tensors: a ``model`` or ``optimizer`` refused as by
            :func:`save`, an unreadable folder, a format version other than 2 or 3, parameters or buffers missing
            from the checkpoint or from the model (the union over the ranks), shapes that differ, a name held on two
            pp ranks, a param group holding a parameter saved in another group, optimizers of other classes or in
            another order than saved, a plain tensor marked ``tensor_model_parallel`` with mp > 1, a ``rank_state``
            value that is not a tensor (each named). On every
            rank, after the read: a data file truncated, corrupt or missing (also when only one rank reads it),
            ``checkpoint <path> cannot be read: ...`` on one line naming the damaged files, their keys and each failed
            rank's error; the model and optimizer are then partly loaded.
    """
    background.wait_staged()  # the loaded values must not reach the staging copy of an asynchronous save
    models, optimizers, _ = _meet(model, optimizer, "load")
    try:
        reader, meta = open_checkpoint(path)
        unreadable = None
    except ValueError as error:  # maybe on some ranks only (a file system not shared by every node)
        reader, meta, unreadable = None, None, str(error)
    groups = _group_problems(models, optimizers, meta)
    _check_keys(model_info(models, None, rank_state, unreadable, groups), meta, path)
    _check_optimizers(optimizers, meta, path)
    stored = reader.read_metadata().state_dict_metadata
    sd: dict[str, Any] = {"meta": None}
    fragments: dict[str, list] = {}
    optional: set[str] = set()
    for name, p, runs, _total, _writes, _shape in named_fragments(models):
        sd[f"model/{name}"] = p.detach().view(-1)
        fragments[f"model/{name}"] = runs
        if p.numel() == 0:  # a parameter of 0 elements is never written
            optional.add(f"model/{name}")
    if optimizers and meta["optim_state"] is not None:
        _plan_optimizer(models, optimizers, meta["optim_state"], stored, sd, fragments, optional)
    for name, buf in named_buffers(models):
        sd[f"model_buffer/{name}"] = buf.detach()
    replaced: dict[str, torch.Tensor] = {}  # rank_state keys whose stored shape or dtype differs: loaded anew
    for key in list(rank_state or {}):
        fqn, value = f"rank/{global_rank()}/{key}", rank_state[key]
        if fqn not in stored:
            del rank_state[key]
            continue
        md = stored[fqn]
        if value.shape != md.size or value.dtype != md.properties.dtype:
            value = replaced[key] = torch.empty(md.size, dtype=md.properties.dtype)
        sd[fqn] = value
    try:
        with torch.no_grad():
            # collective; a rank whose read fails makes DCP raise CheckpointException on every rank (it gathers the
            # results of every rank's read), so every rank raises the ValueError below: no rank is left waiting
            with comm.torch_object_collectives_without_numpy():  # DCP's own object collectives
                dcp.load(sd, storage_reader=reader, planner=FragmentLoadPlanner(fragments, frozenset(optional)),
                         no_dist=not dist.is_initialized())
    except (CheckpointException, OSError) as error:  # DCP's error is a BaseException
        raise read_error(path, reader, error, with_ranks=dist.is_initialized()) from error
    if rank_state is not None:
        rank_state.update(replaced)
    if optimizers and meta["optim_state"] is not None:
        _restore_numbers(models, optimizers, meta["optim_state"])
        # by index, as torch's Optimizer.load_state_dict: the same decision on every rank (every rank has as many
        # groups, checked at save; a group holding another group's parameters was refused above)
        groups = [g for opt in optimizers for g in opt.param_groups]
        if len(meta["param_groups"]) == len(groups):
            for g, src in zip(groups, meta["param_groups"]):
                g.update({k: v for k, v in src.items() if k not in ("params", "param_names")})
    return meta["extra"]


def _restore_numbers(models: list[nn.Module], optimizers: list, kinds_by_name: dict) -> None:
    """State entries saved from Python numbers: back from their 0-d tensors to ``int`` / ``float`` / ``bool``."""
    names = {id(p): n for n, p, *_ in named_fragments(models)}
    for p, st in merged_state(optimizers).items():
        for k, kind in kinds_by_name.get(names.get(id(p)), {}).items():
            if kind in NUMBER_DTYPES:
                st[k] = {"int": int, "float": float, "bool": bool}[kind](st[k].item())


def save_checkpoint(model: _Model, optimizer: _Optimizer, root: str, step: int,
                    keep: int = 3, extra: Optional[dict] = None,
                    rank_state: Optional[dict[str, torch.Tensor]] = None,
                    async_save: bool = False) -> Union[str, AsyncSave]:
    """:func:`save` to ``root/step-<step>`` atomically and keep the last ``keep`` checkpoints; returns the folder, or
    with ``async_save`` an :class:`~shardfusion.checkpoint.background.AsyncSave` handle whose ``wait()`` returns it.
    ``model`` and ``optimizer`` as in :func:`save` (a list of this rank's stages too).

    Every rank writes into ``root/tmp-step-<step>``; after all ranks have finished (DCP's save ends with a collective
    commit), rank 0 renames it to ``root/step-<step>`` and replaces the ``root/latest`` pointer file
    (written to a temporary file, then ``os.replace``), then prunes. A crash before the rename leaves only a ``tmp-``
    folder, which :func:`latest_checkpoint` ignores: the previous checkpoint stays the latest.

    ``async_save=True`` (see [Note: asynchronous saves] in :mod:`shardfusion.checkpoint.background`): the call
    returns once the copy of this rank's tensors to host memory has begun (the staging copy: pinned for CUDA
    tensors, kept and reused by the next save, so held from the first asynchronous save on: :func:`staging_bytes`).
    The parameters' fragments and optimizer state in host memory of the parameters ``optimizer`` updates are copied
    on a staging thread while the loop goes on: a forward and a backward may run beside it, each ``step()`` of
    ``optimizer`` waits for it (a step pre-hook), as do the next save, ``wait()``, :func:`load` and
    :func:`load_full_state`; any other in-place change of them must call the handle's ``wait_staged()`` first. The
    rest is copied before the call returns. Rank 0's preparation of the folder, the write, the commit and rank 0's publish run on a background thread, with
    their collectives on a process group of their own (created by the first asynchronous save). The checkpoint is
    published only after every rank's write has ended, as above. Every save first waits for the asynchronous save in
    flight, if any, and every rank learns its outcome (in the gather of the arguments' check): one save at a time.
    Call ``wait()`` on the last handle before the process group is destroyed or a checkpoint of ``root`` is loaded.
    The test-only ``SHARDFUSION_TEST_SAVE_DELAY_S`` delays each background write.

    Pruning (rank 0, after the publish): the checkpoint just published is never deleted; among the published
    checkpoints with a lower step, the ``keep - 1`` highest are kept and the others deleted. Checkpoints with a
    higher step (from an abandoned timeline: a run resumed from an older checkpoint) are left untouched, for the user
    to delete, except one of the same step, which the new one replaces; ``latest`` points at the one just saved. Leftover ``tmp-step-<n>`` folders of crashed saves (any
    step: the one in flight has been renamed by then) are deleted too.

    Raises:
        RuntimeError: on the ranks that called it, within the arrival deadline: some rank did not call it (e.g. under
            ``if rank == 0:``), before rank 0 touches ``root``.
        ValueError: ``keep`` < 1 or ``step`` < 0; on every rank: the asynchronous save in flight failed (a rank could
            not write its part, or rank 0 could not publish it: ``asynchronous save of <root>/step-<n> failed: rank
            r: ...``; nothing of this save is started then); rank 0 cannot create ``root`` or publish the checkpoint
            (e.g. not writable; the error names the path); anything :func:`save` raises (a bad ``model`` or
            ``optimizer`` before rank 0 touches ``root``); ``SHARDFUSION_TEST_SAVE_DELAY_S`` not a number >= 0.
            With ``async_save``, a failure of this save's folder, write or publish is raised later, on every rank,
            by the next save or ``wait()`` (``asynchronous save of ... failed: ...``).
    """
    if keep < 1 or step < 0:
        raise ValueError(f"save_checkpoint: keep must be >= 1 and step >= 0, got keep={keep}, step={step}")
    if async_save:
        background.write_delay()  # a bad value is refused before anything is written
    final, tmp = os.path.join(root, f"step-{step}"), os.path.join(root, f"tmp-step-{step}")
    models, optimizers, info = _meet(model, optimizer, "save_checkpoint", background.in_flight(), rank_state)
    sd, fragments = _state_dict(models, optimizers, tmp, extra, rank_state, info)
    if async_save:  # rank 0 prepares the folder in the write's plan, between every rank's plan and any file
        return background.start(sd, fragments, root, step, keep, sharded_state(models[0]).topology, optimizers,
                                _copied_behind(sd, models, optimizers))
    call_on_rank0(lambda: prepare(root, step), f"cannot prepare {tmp!r}")
    _write(sd, fragments, tmp)
    call_on_rank0(lambda: publish(root, step, keep), f"cannot publish {tmp!r} as {final!r}")
    return final


def staging_bytes(model: _Model, optimizer: _Optimizer = None,
                  rank_state: Optional[dict[str, torch.Tensor]] = None) -> int:
    """Bytes of host memory this rank's staging copy takes in an asynchronous :func:`save_checkpoint` of ``model``,
    ``optimizer`` and ``rank_state`` as they are now: the tensors this rank writes (its primary fragments of the
    parameters and their per-element optimizer state, the scalar state, the persistent buffers, ``rank_state``);
    ``meta`` (a few kB) left out. Local: no collective, no copy; fake tensors (a dry run) count too.

    Raises:
        ValueError: a ``model`` or ``optimizer`` that :func:`save` refuses (the first problem).
    """
    models, problems = model_list(model)
    if problems:
        raise ValueError(f"staging_bytes: {problems[0]}")
    sd, _ = _tensors(models, optimizer_list(optimizer), rank_state)
    return sum(t.numel() * t.element_size() for t in sd.values())


def load_full_state(model: _Model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict, e.g. from :func:`load_full` or an exported safetensors file, into a sharded
    model's fragments and buffers, in place. Collective (an ``all_gather_object`` of the arguments' problems and one
    of the parameter shapes). ``model`` may be the list of this rank's sharded stages: each takes its own names
    (the state dict of the whole model on every rank).

    Keys of experts held by other ep ranks are expected in a full state dict and skipped here; a tied parameter may
    appear under any of its names; non-persistent buffers are not loaded (a key for one is ignored). The model's own
    ``load_state_dict`` takes the same full state dict (see :func:`shardfusion.full_state_dict`).

    Raises:
        ValueError: on every rank: a ``model`` refused as by :func:`save`, a parameter of the model missing from
            ``state_dict``, a key that is no parameter or buffer of the model on any rank, or a shape that differs
            (each named).
    """
    background.wait_staged()  # as load
    models, _, _ = _meet(model, None, "load_full_state")
    shapes = model_info(models)["shapes"]
    buffers = dict(named_buffers(models))
    nonpersistent = {n for m in models for n, _ in m.named_buffers()} - set(buffers)  # ignored if given (older exports)
    first = {id(p): n for n, p in named_parameters(models)}  # tied parameters: their first name
    aliases = {name: first[id(p)] for m in models for name, p in m.named_parameters(remove_duplicate=False)}
    given = {aliases.get(k, k): v for k, v in state_dict.items()}
    problems = mismatch(shapes, {n: t.shape for n, t in given.items()}, "given", "missing", "unexpected",
                         also_allowed=set(buffers) | nonpersistent)
    if problems:
        raise ValueError(f"state dict does not match the model: {problems}")
    with torch.no_grad():
        for name, p, runs, _total, _writes, _shape in named_fragments(models):
            flat, dest = given[name].reshape(-1), p.view(-1)
            for offset, start, length in runs:
                dest[start:start + length].copy_(flat[offset:offset + length])
        for name, buf in buffers.items():
            if name in given:
                buf.copy_(given[name])
