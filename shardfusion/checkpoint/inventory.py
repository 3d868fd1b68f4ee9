"""What a sharded model holds, as the checkpoint format sees it (see :mod:`shardfusion.checkpoint.save_load`): each
parameter's fragment on this rank, the kind of each optimizer state entry, the union of every rank's parameters,
buffers and state kinds, the param groups merged over the ranks, and how a set of parameter shapes differs from
another. A "model" here is one sharded model or this rank's list of them (pipeline stages, ``shardfusion.pipeline``):
:func:`model_list` checks the argument, the other functions take the list.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.local_state_dict import persistent_buffers
from shardfusion._runtime.state import is_sharded, sharded_state
from shardfusion._runtime.state import named_fragments as model_fragments

_SHOWN = 3  # names shown in one problem; the count says how many more


def model_list(model) -> tuple[list[nn.Module], list[str]]:
    """``model`` as a list of sharded models (one model -> ``[model]``; a list or tuple, e.g. this rank's pipeline
    stages, as given) and what is wrong with it, ``[]`` when nothing is: an empty list, an entry that is no module or
    was not passed to ``fully_shard`` (or was absorbed by a later call), a model given twice, models sharded with
    different ``Topology`` objects (a rank's stages share the job's one), a parameter name or a parameter in two of
    them. Local (no collective): the caller gathers the problems so that every rank raises (``_meet``)."""
    listed = isinstance(model, (list, tuple))
    given = list(model) if listed else [model]
    if not given:
        return [], ["model is an empty list: pass a sharded model or the list of this rank's sharded stages"]
    problems: list[str] = []
    first: dict[int, int] = {}  # id(model) -> its first index
    topo_of: Optional[tuple[int, Any]] = None
    valid = []
    for i, m in enumerate(given):
        where = f"model[{i}]" if listed else "model"
        if not isinstance(m, nn.Module):
            problems.append(f"{where} must be a model passed to shardfusion.fully_shard, got {type(m).__name__}")
            continue
        if not is_sharded(m):
            problems.append(f"{where} ({type(m).__name__}) is not sharded: pass it to shardfusion.fully_shard first "
                            "(a module inside a sharded model is not one)")
            continue
        if first.setdefault(id(m), i) != i:
            problems.append(f"model[{i}] is model[{first[id(m)]}]: pass each stage once")
            continue
        topo = sharded_state(m).topology
        if topo_of is None:
            topo_of = (i, topo)
        elif topo is not topo_of[1]:
            problems.append(f"model[{i}] is sharded with another Topology object than model[{topo_of[0]}] "
                            f"({topo.describe()} vs {topo_of[1].describe()}): shard every stage of a rank with the "
                            "job's one Topology")
            continue
        valid.append((i, m))
    names: dict[str, int] = {}  # name -> index of the first model holding it
    params: dict[int, int] = {}  # id(parameter) -> the same
    clashes: dict[tuple[int, int], list[str]] = {}
    for i, m in valid:
        for name, p in m.named_parameters():
            j = names.setdefault(name, i)
            if j == i:  # a new name: maybe a parameter of an earlier model under another name
                j = params.setdefault(id(p), i)
            if j != i:
                clashes.setdefault((j, i), []).append(name)
    for (j, i), clash in clashes.items():
        problems.append(f"model[{j}] and model[{i}] both hold {names_text(clash)}: each parameter (and each "
                        "name) may be in one stage only")
    return [m for _, m in valid] if not problems else [], problems


def names_text(names: list[str]) -> str:
    """The first few of ``names``, and how many there are: ``'a', 'b', 'c' and 4 more (7 parameters)``."""
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{shown}{more} ({len(names)} parameter{'s' if len(names) != 1 else ''})"


def ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-3, 6`` (runs of consecutive ranks as ranges)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def by_ranks(every: list[list[str]]) -> list[str]:
    """Each rank's problems (``every[r]``, texts without a rank) as ``"rank r: text"``, the ranks that found the
    same text named together (``"ranks 0-3: text"``), in the order first found."""
    ranks: dict[str, list[int]] = {}
    for rank, texts in enumerate(every):
        for text in texts:
            ranks.setdefault(text, []).append(rank)
    return [f"{ranks_text(rs)}: {text}" for text, rs in ranks.items()]


def named_fragments(model):
    """``(name, fragment, runs, global numel, writes, full shape)`` for every parameter of
    ``model.named_parameters()`` (empty fragments included), over each model of a list in order. ``runs``: where
    the fragment lies in the parameter flattened in its full (global) shape, ``[(offset, start in the fragment,
    length)]`` (one run, or for a tensor-parallel parameter one per block of its piece:
    ``tensor_parallel.global_runs``); ``writes``: this rank writes it (``is_primary``).

    A copy of a weight tied across pipeline stages (a model's ``checkpoint_aliases``, ``{its name: the weight's
    name}``, e.g. the last GPT stage's ``{"lm_head.weight": "wte.weight"}``) is named as the weight and never
    written: the stage that holds the weight itself writes it, and the copy loads from it."""
    for m in (model if isinstance(model, (list, tuple)) else [model]):
        table = {id(f.param): f for f in model_fragments(m)}
        aliases = getattr(m, "checkpoint_aliases", {})
        for name, p in m.named_parameters():
            f = table[id(p)]
            shape = f.shape if f.tp_spec is None else tuple(f.tp_spec.shape)
            runs = tp.global_runs(f.tp_spec, f.shape, f.offset, f.numel)
            yield aliases.get(name, name), p, runs, math.prod(shape), f.buffer.is_primary and name not in aliases, \
                shape


def aliased_names(models: list[nn.Module]) -> set[str]:
    """The names this rank's models hold only as copies (``checkpoint_aliases``' values, see
    :func:`named_fragments`)."""
    return {canonical for m in models for canonical in getattr(m, "checkpoint_aliases", {}).values()}


def named_parameters(models: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every model of ``models``, in order (a tied parameter: its first name)."""
    return [(n, p) for m in models for n, p in m.named_parameters()]


def named_buffers(models: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The persistent buffers (``persistent_buffers``) of every model of ``models``, in order."""
    return [(n, b) for m in models for n, b in persistent_buffers(m)]


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


def model_info(model, optimizer=None, rank_state: Optional[dict] = None, unreadable: Optional[str] = None,
               problems: Sequence[str] = ()) -> dict:
    """What every rank holds, gathered (collective: one ``all_gather_object``): the union over ranks of parameter
    shapes, buffer shapes and optimizer state kinds (expert names differ across ep ranks, stage names across pp
    ranks), the param groups merged over the ranks (:func:`merge_groups`: ``"param_groups"``, ``"optimizers"``),
    and the problems found on any rank (unsupported optimizer state, tensor-parallel parameters, non-tensor
    ``rank_state`` values, a name held on two pp ranks or with two shapes, groups that differ between ranks, and
    the caller's ``problems``) as ``"rank <r>: ..."`` strings, so that every rank can raise the same error;
    ``unreadable``: why this rank could not read the checkpoint (gathered under ``"unreadable"``). ``model``: a
    sharded model or a checked list of them (:func:`model_list`). The caller's ``problems`` that several ranks
    found alike are named once with their ranks (:func:`by_ranks`)."""
    every = [local_info(model, optimizer, rank_state, unreadable, problems)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = comm.all_gather_object(every[0], None, "what every rank holds (checkpoint)")
    return merged_info(every)


def local_info(model, optimizer=None, rank_state: Optional[dict] = None, unreadable: Optional[str] = None,
               problems: Sequence[str] = ()) -> dict:
    """This rank's part of :func:`model_info` (the same arguments), picklable, for a caller that gathers it with
    other things (``save_checkpoint`` gathers it with the arguments' check). Local: no collective."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    topo = sharded_state(models[0]).topology
    rank, mp_rank = global_rank(), topo.mp_rank
    optimizers = optimizer_list(optimizer)
    mine: dict[str, Any] = {"shapes": {}, "buffer_shapes": {}, "optim_state": {},
                            "problems": [], "own": list(problems),
                            "unreadable": [f"rank {rank}: {unreadable}"] if unreadable else [],
                            "pp_rank": topo.pp_rank, "optimizers": [type(opt).__name__ for opt in optimizers],
                            "copies": sorted(aliased_names(models)),
                            "groups": group_records(models, optimizers)}
    opt_state = merged_state(optimizers)
    plain_tp = {id(f.param) for m in models for f in model_fragments(m) if f.tp_spec is None}
    tensor_parallel = []
    for name, p, _runs, _total, writes, shape in named_fragments(models):
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
    for name, buf in named_buffers(models):
        mine["buffer_shapes"][name] = tuple(buf.shape)
    mine["nonpersistent"] = sorted({n for m in models for n, _ in m.named_buffers()} - set(mine["buffer_shapes"]))
    for key, value in (rank_state or {}).items():
        if not isinstance(key, str) or not torch.is_tensor(value):
            mine["problems"].append(f"rank {rank}: rank_state[{key!r}] must be a tensor under a str key, got "
                                    f"{type(value).__name__}")
    return mine


def merged_info(every: list[dict]) -> dict:
    """:func:`model_info` from every rank's :func:`local_info` (in rank order): the same on every rank."""
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
    out["problems"] += by_ranks([part["own"] for part in every]) + _held_twice(every)
    out["param_groups"], out["optimizers"], group_problems = merge_groups(every)
    out["problems"] += group_problems
    return out


def _held_twice(every: list[dict]) -> list[str]:
    """Names that two pp ranks hold (two stages naming different parameters alike: the checkpoint would mix them)
    or that ranks hold with different shapes, from every rank's part of :func:`model_info`."""
    pp_of: dict[str, dict[int, int]] = {}  # name -> {pp rank: first global rank holding it there}
    shape_of: dict[str, dict[tuple, int]] = {}
    for rank, part in enumerate(every):
        for name, shape in part["shapes"].items():
            if name not in part.get("copies", ()):  # a tied weight's copy on another stage is the same weight
                pp_of.setdefault(name, {}).setdefault(part["pp_rank"], rank)
            shape_of.setdefault(name, {}).setdefault(tuple(shape), rank)
    problems = []
    twice = [n for n, held in pp_of.items() if len(held) > 1]
    if twice:
        where = pp_of[twice[0]]
        problems.append(f"{names_text(twice)} are held on more than one pp rank (the first on pp ranks "
                        f"{sorted(where)}: global ranks {sorted(where.values())}): stages must name their parameters "
                        "as the whole model does, each name on one stage (split_gpt keeps the GPT's names)")
    for name, shapes in shape_of.items():
        if len(shapes) > 1:
            problems.append(f"parameter {name!r} has shape " + " and ".join(
                f"{list(s)} on rank {r}" for s, r in shapes.items()))
    return problems


def group_records(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[dict]:
    """This rank's param groups, over ``optimizers`` in order: ``{"hyper": every entry but params, "names": the
    names of its parameters in the group's order}`` (a parameter of none of ``models``: ``"?"``, refused earlier by
    :func:`optimizer_problems`)."""
    names = {id(p): n for n, p, *_ in named_fragments(models)}  # a tied copy under the weight's name
    return [{"hyper": {k: v for k, v in g.items() if k != "params"},
             "names": [names.get(id(p), "?") for p in g["params"]]} for opt in optimizers for g in opt.param_groups]


def optimizer_problems(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """The optimizers' parameters that are in none of ``models`` (each optimizer named with the shapes of the first
    few): their state could be saved under no name."""
    mine = {id(p) for _, p in named_parameters(models)}
    problems = []
    for i, opt in enumerate(optimizers):
        foreign = [tuple(p.shape) for g in opt.param_groups for p in g["params"] if id(p) not in mine]
        if foreign:
            problems.append(f"optimizer[{i}] holds {len(foreign)} parameter{'s' if len(foreign) > 1 else ''} "
                            f"(shapes {foreign[:_SHOWN]}{' ...' if len(foreign) > _SHOWN else ''}) "
                            f"that {'are' if len(foreign) > 1 else 'is'} in none "
                            f"of the {len(models)} model{'s' if len(models) > 1 else ''} given: pass every stage "
                            "this rank's optimizers cover")
    return problems


def same_value(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values are equal: tensors by value (and dtype, shape), tuples and lists element by
    element, nan equal to nan, anything else by ``==``."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared differ
        return False


def hyper_difference(a: dict, b: dict) -> dict[str, tuple]:
    """``{key: (a's value, b's value)}`` for the hyperparameters that differ (a key missing on one side: ``None``
    there)."""
    return {k: (a.get(k), b.get(k)) for k in list(a) + [k for k in b if k not in a]
            if k not in a or k not in b or not same_value(a[k], b[k])}


def merge_groups(every: list[dict]) -> tuple[list[dict], list[str], list[str]]:
    """The param groups of a checkpoint, from every rank's part of :func:`model_info`: ``(param_groups, optimizers,
    problems)``. Groups are matched by their index in the rank's optimizers (their groups in order), as a load
    matches them: every rank must have the same optimizer classes in the same order, as many groups, and at each
    index the same hyperparameters; saved group ``i`` holds those hyperparameters plus ``"param_names"``, the names
    of every rank's group ``i`` (rank order, each name once: the union over the pp stages and the ep ranks). A rank
    that differs is a problem naming it, the index and the values (rank 0 is the reference), and the groups are
    then those of rank 0."""
    base = every[0]
    groups = [{**g["hyper"], "param_names": []} for g in base["groups"]]
    seen: list[set] = [set() for _ in groups]
    structure: dict[str, list[int]] = {}  # "optimizers ... with n param groups" -> the ranks that differ so
    values: dict[str, list[int]] = {}  # "param group i: key=value" -> the ranks that have it (rank 0: another)
    for rank, part in enumerate(every):
        if part["optimizers"] != base["optimizers"] or len(part["groups"]) != len(base["groups"]):
            structure.setdefault(f"optimizers {part['optimizers']} with {len(part['groups'])} param groups",
                                 []).append(rank)
            continue
        for i, (g, ref) in enumerate(zip(part["groups"], base["groups"])):
            for k, (mine, theirs) in hyper_difference(g["hyper"], ref["hyper"]).items():
                values.setdefault(f"param group {i} has {k}={mine!r} on {{}} but {k}={theirs!r} on rank 0",
                                  []).append(rank)
            for name in g["names"]:
                if name not in seen[i]:
                    seen[i].add(name)
                    groups[i]["param_names"].append(name)
    problems = []
    if structure:
        problems.append("; ".join(f"{ranks_text(rs)} {'have' if len(rs) > 1 else 'has'} {what}"
                                  for what, rs in structure.items())
                        + f", rank 0 {base['optimizers']} with {len(base['groups'])}: a checkpoint matches param "
                        "groups by index, so every rank (every pp stage) needs the same optimizers and as many groups "
                        "(an empty group is allowed)")
    if values:
        problems.append("; ".join(what.format(ranks_text(rs)) for what, rs in values.items())
                        + ": a checkpoint matches param groups by index, so group i needs the same hyperparameters "
                        "on every rank (every pp stage)")
    return groups, list(base["optimizers"]), problems


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
