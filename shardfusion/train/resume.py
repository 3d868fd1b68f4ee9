"""Checkpoints of the training job (`shardfusion.train`): what a resume needs beyond the model and the optimizer.

A checkpoint of the job is a `shardfusion.checkpoint` folder `OUT/checkpoints/step-N` (published atomically, the
last `--keep` kept) holding the model, the optimizer state (AdamW's; with `--optimizer muon` Muon's momentum of
the blocks' matrices and AdamW's state of the rest, under the parameters' names: `shardfusion.checkpoint` takes the
list `[muon, adamw]`) and:

- `extra` (written once, by rank 0): `step` (optimizer steps done), `elapsed_s` (training seconds so far), the
  world size, `layout` (`Topology.describe()`), the model's record (`JobModel.extra`: `model`, the `GPTConfig`
  fields, what a plain `GPT` needs to load an export of the checkpoint; or for a Hugging Face model `hf_config`,
  its config dict, which `shardfusion.export` writes as the export's config.json) and `config`: the
  `RESUME_FIELDS` of the run's `ResolvedJob`, the settings that decide the learning rate schedule and the data
  order;
- `tokenizer`: what `python -m shardfusion.export` writes beside the weights (`run_folder.tokenizer_extra`: the
  run's OUT/tokenizer relative to the checkpoint, or bytes);
- `data_order`: the sampler's data order (`shardfusion.train.data.DATA_ORDER`); a checkpoint without it was written
  before the order was recorded, by a run that drew each data-parallel rank's batches itself
  (`DATA_ORDER_PER_RANK`), and resumes with that order (`saved_data_order`);
- per-rank state (`rank/<rank>/...`): this rank's torch RNG states (CPU, and CUDA on a GPU run), which dropout
  draws from.

The data position needs nothing more: the global batch of a step is a pure function of (seed, step, micro-step,
global batch size) and each data-parallel rank takes its slice (`shardfusion.train.data.BatchSampler`); the
learning rate is a pure function of the step (`train_config.lr_at`). Restoring step, parameters, optimizer state and
RNG states therefore continues the run exactly: in fp32 with the same layout, N steps + save + restart + N steps
equals 2N steps in one run, bitwise.

Resuming in another layout (world size, ep or outer degree) works too (the checkpoint reshards) and keeps the data
order: a run that gives neither --batch-size nor --global-batch-size keeps the saved global batch size
(`saved_settings`, read before any worker starts). The sums then run in another order, and with another world size
the RNG states of new ranks are fresh (dropout); the run continues correctly but not bitwise like the uninterrupted
one. `restore` says so, as it does for changed settings (`RESUME_FIELDS`) and model fields that keep every shape
(e.g. `n_head`, `top_k`), which no shape check can catch. A checkpoint of the per-rank order keeps it, and its data
order still changes with the world size.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import checkpoint as ckpt
from shardfusion.comm import call_on_rank0
from shardfusion.train import run_folder
from shardfusion.train.config import OWNER, RESUME_FIELDS, SAVED_TOKENIZER_FIELDS
from shardfusion.train.data import DATA_ORDER_PER_RANK, DATA_ORDERS

CHECKPOINT_DIR = run_folder.CHECKPOINTS
"""Folder under --out holding the job's checkpoints (`step-N`, `latest`)."""

# RESUME_FIELDS: the fields that decide the learning rate schedule, the data order, the loss or the arithmetic
# (dtypes, device, where expert gradients are summed): a resume with other values continues, but not as the saved run
# would have. The per-rank batch_size is not one of them (it follows from the global one and the world size), except
# for a checkpoint of the per-rank data order, whose saved batch_size is compared too. `optimizer` is not merely
# compared: a resume with another one is refused (`check_optimizer`). SAVED_TOKENIZER_FIELDS: saved beside them but
# not compared by `restore`: the tokenizer a resume must use. Its path may change (a resumed run reads its own
# OUT/tokenizer), so `shardfusion.train.data_config.check_saved` compares the fingerprint instead, before any worker
# starts. Both come from the sections' field metadata (`shardfusion.train.sections`).

OUTER_SETTINGS = tuple(name for name in RESUME_FIELDS if OWNER[name] == "outer" and name != "outer_sync")
"""`RESUME_FIELDS` that only DiLoCo uses (the outer section's, but --outer-sync): compared only when the saved run
or this one has --outer-sync diloco (their defaults changed since runs were saved, and an every-step run never read
them)."""

SAVED_OPTIMIZER_DEFAULT = "adamw"
"""The optimizer of a checkpoint whose settings name none (written before --optimizer existed: AdamW)."""


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as uint8 tensors: ``cpu`` (torch's default generator) and, on CUDA, ``cuda``
    (the current device's)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore the states of `rng_state` that `state` holds (absent ones are left as they are)."""
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def latest(out: str) -> Optional[str]:
    """The latest published checkpoint under ``out/checkpoints`` as rank 0 sees it (broadcast, so every rank resumes
    from the same one), or None. Collective.

    Raises:
        ValueError: on every rank: rank 0 could not look (e.g. the folder is not readable).
    """
    return call_on_rank0(lambda: ckpt.latest_checkpoint(os.path.join(out, CHECKPOINT_DIR)),
                         f"cannot look for a checkpoint in {out}/{CHECKPOINT_DIR}")


SHOWN_FIELDS = ("n_layer", "d_model", "seq_len", "n_experts", "expert_hidden",  # GPTConfig
                 "model_type", "num_hidden_layers", "hidden_size", "max_position_embeddings", "num_experts",
                 "num_local_experts")  # a Hugging Face config
"""The saved model's fields that a refused resume names."""


def saved_data_order(extra: dict[str, Any]) -> int:
    """The data order a checkpoint's `extra` records: its `data_order`, or `DATA_ORDER_PER_RANK` when it has none
    (written before the order was recorded).

    Raises:
        ValueError: an order this version does not know (a checkpoint of a newer version).
    """
    order = extra.get("data_order", DATA_ORDER_PER_RANK)
    if order not in DATA_ORDERS:
        raise ValueError(f"the checkpoint records data order {order!r}, but this version knows only {DATA_ORDERS}; "
                         f"resume it with the version that wrote it, or use another --out")
    return order


def saved_settings(out: Optional[str]) -> Optional[dict[str, Any]]:
    """The `RESUME_FIELDS` of the latest checkpoint in ``out`` and its `data_order` (`saved_data_order`), read by
    this process alone, before any worker starts (`shardfusion.train.config.resolve` keeps the saved global batch
    size); None when ``out`` is None (a new run folder) or holds no checkpoint, or one without the job's settings.

    Raises:
        ValueError: the checkpoint records an unknown data order.
    """
    if out is None:
        return None
    path = ckpt.latest_checkpoint(os.path.join(out, CHECKPOINT_DIR))
    if path is None:
        return None
    extra = ckpt.read_meta(path).get("extra")
    if not isinstance(extra, dict) or not isinstance(extra.get("config"), dict):
        return None
    return {**extra["config"], "data_order": saved_data_order(extra)}


def check_optimizer(out: Optional[str], optimizer: str, saved: Optional[dict[str, Any]]) -> None:
    """Refuse a resume with another --optimizer than the saved run's: the checkpoint holds that optimizer's state
    (AdamW's exp_avg / exp_avg_sq, or Muon's momentum_buffer on the matrices), which the other cannot continue
    from. ``saved``: the checkpoint's settings (`saved_settings`; None: no checkpoint, nothing to check); a
    checkpoint that names no optimizer was written by AdamW (`SAVED_OPTIMIZER_DEFAULT`).

    Raises:
        ValueError: naming both values, the checkpoint folder and how to go on.
    """
    if saved is None:
        return
    was = saved.get("optimizer", SAVED_OPTIMIZER_DEFAULT)
    if was != optimizer:
        raise ValueError(f"--optimizer {optimizer}: the checkpoint in --out {out} was written with --optimizer "
                         f"{was}, whose state {optimizer} cannot continue from; resume with --optimizer {was}, use "
                         f"another --out, or move the checkpoint away")


def check_resume(out: str, meta_model: Callable[[], nn.Module]) -> None:
    """Refuse, before any worker starts, a resume whose model has other parameters than the checkpoint in ``out``:
    ``meta_model()`` builds the model on the meta device (no memory, no process group; see
    `shardfusion.train.job_model.meta_model`) and its parameter names and shapes are compared with the latest
    checkpoint's (read by this process alone). No checkpoint: nothing to check, nothing built.

    Raises:
        ValueError: one line naming the checkpoint, the differing parameters (at most 3) and how to go on.
    """
    path = ckpt.latest_checkpoint(os.path.join(out, CHECKPOINT_DIR))
    if path is None:
        return
    meta = ckpt.read_meta(path)
    model = meta_model()
    mine = {name: tuple(p.shape) for name, p in model.named_parameters()}
    saved = {name: tuple(shape) for name, shape in meta["shapes"].items()}
    differ = [f"{n} {saved[n]} -> {mine[n]}" for n in mine if n in saved and saved[n] != mine[n]]
    differ += [f"{n} is new" for n in mine if n not in saved] + [f"{n} is gone" for n in saved if n not in mine]
    if differ:
        extra = meta.get("extra") or {}
        fields = extra.get("model") or extra.get("hf_config") or {}
        was = ", ".join(f"{k}={fields[k]}" for k in SHOWN_FIELDS if k in fields)
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise ValueError(f"--out {out} holds a checkpoint of another model ({path}: {was}): "
                         f"{'; '.join(differ[:3])}{more}; resume with the model flags of the saved run, use another "
                         f"--out, or move the checkpoint away")


def save(model: nn.Module | Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], out: str, *,
         step: int, keep: int, settings: Mapping[str, Any], model_extra: dict[str, dict[str, Any]], layout: str,
         elapsed_s: float, device: torch.device, data_order: int,
         rank_extra: Optional[dict[str, torch.Tensor]] = None, async_save: bool = False) -> str | ckpt.AsyncSave:
    """Publish ``out/checkpoints/step-<step>`` (see `shardfusion.checkpoint.save_checkpoint`); returns its path, or
    with ``async_save`` (--async-save) the handle of the save, whose ``wait()`` returns the path once every rank
    has written it and it is published. Collective. ``model``: the sharded model, or with --pp the list of this
    rank's stage models (each named as in
    the whole model, so the checkpoint is the whole model's). ``optimizers``: the run's optimizers
    (`shardfusion.train.optim.build_optimizers`: ``[adamw]`` or
    ``[muon, adamw]``), each parameter in one of them; the checkpoint keeps their states under the parameters'
    names, so it loads into any layout. ``settings``: the run's flags by name, resolved (`ResolvedJob.flat`), of
    which the checkpoint keeps those a resume compares and the tokenizer's. ``model_extra``: the model's record
    (`JobModel.extra`), merged into the checkpoint's ``extra``;
    ``data_order``: the sampler's (`shardfusion.train.data.DATA_ORDERS`); ``rank_extra``: more per-rank tensors
    (``{key: tensor}``, saved under ``rank/<rank>/<key>`` beside the RNG states; DiLoCo's, `job_outer`).

    Raises:
        ValueError: on every rank: what `shardfusion.checkpoint.save_checkpoint` raises (a folder that cannot be
            written, a disk full; the asynchronous save in flight failed).
    """
    extra = {"step": step, "elapsed_s": elapsed_s, "world_size": dist.get_world_size(), "layout": layout,
             **model_extra,
             "config": {name: settings[name] for name in RESUME_FIELDS + SAVED_TOKENIZER_FIELDS},
             "data_order": data_order, **run_folder.tokenizer_extra(settings["tokenizer"])}
    return ckpt.save_checkpoint(model, list(optimizers), os.path.join(out, CHECKPOINT_DIR), step, keep=keep,
                                extra=extra, rank_state={**rng_state(device), **(rank_extra or {})},
                                async_save=async_save)


def restore(model: nn.Module | Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], path: str, *,
            settings: Mapping[str, Any], model_extra: dict[str, dict[str, Any]], layout: str,
            device: torch.device, rank_extra: Optional[dict[str, torch.Tensor]] = None
            ) -> tuple[int, float, list[str], int]:
    """Load the checkpoint at `path` into `model` and `optimizers` (the list `save` took; any layout: with Muon's
    whole matrices on other owner ranks too) and this rank's RNG states. Collective. The optimizers'
    hyperparameters are the saved ones afterwards: the caller re-applies its own. ``settings``: this run's flags by
    name, resolved (`ResolvedJob.flat`), compared with the saved ones (`RESUME_FIELDS`).
    ``model_extra``: this run's model record (`JobModel.extra`), compared field by field with the saved one.
    ``rank_extra``: the per-rank tensors `save` took, as placeholders: afterwards it holds the ones the checkpoint
    had (in their saved shapes), the others removed.

    Returns (steps done, training seconds so far, notes, data order): the notes name every way in which the
    continuation will differ from the saved run (changed `RESUME_FIELDS` or model fields, another world size or
    layout), empty for an exact resume; the data order is the saved one (`saved_data_order`), which the run keeps.

    Raises:
        ValueError: on every rank: the checkpoint does not match the model or cannot be read (see
            `shardfusion.checkpoint.load`), it was not written by the training job, it records an unknown data
            order or another --optimizer (`check_optimizer`; the model and optimizers are then loaded but unusable);
            the message says how to go on.
    """
    rng = rng_state(device)
    rank = {**rng, **(rank_extra or {})}
    try:
        extra = ckpt.load(model, list(optimizers), path, rank_state=rank)
    except ValueError as error:
        raise ValueError(f"cannot resume from {path}: {error}. Resume with the model flags of the saved run, use "
                         f"another --out, or move the checkpoint away") from error
    if not isinstance(extra, dict) or "step" not in extra:
        raise ValueError(f"cannot resume from {path}: it holds no training state (no step in its extra), so it was "
                         f"not written by shardfusion.train; use another --out")
    if isinstance(extra.get("config"), dict):  # preflight refused this already; a worker started otherwise too
        check_optimizer(os.path.dirname(os.path.dirname(path)), settings["optimizer"], extra["config"])
    set_rng_state({key: rank[key] for key in rng if key in rank}, device)
    if rank_extra is not None:
        rank_extra.clear()
        rank_extra.update({key: value for key, value in rank.items() if key not in rng})
    try:
        order = saved_data_order(extra)
    except ValueError as error:
        raise ValueError(f"cannot resume from {path}: {error}") from None
    compared = RESUME_FIELDS + (("batch_size",) if order == DATA_ORDER_PER_RANK else ())
    if settings["optimizer"] != "muon":
        compared = tuple(name for name in compared if name != "muon_lr")  # unused by AdamW alone
    if "diloco" not in (settings["outer_sync"], extra.get("config", {}).get("outer_sync")):
        compared = tuple(name for name in compared if name not in OUTER_SETTINGS)  # unused by every-step
    notes = [f"--{name.replace('_', '-')} was {old!r}, now {settings[name]!r}"
             for name, old in extra.get("config", {}).items()
             if name in compared and settings[name] != old]
    for key, model_now in model_extra.items():
        notes += [f"model field {name} was {old!r}, now {model_now.get(name)!r}"
                  for name, old in (extra.get(key) or {}).items() if model_now.get(name) != old]
    note = layout_note(extra, dist.get_world_size(), layout, order)
    return int(extra["step"]), float(extra.get("elapsed_s", 0.0)), notes + ([note] if note else []), order


DEGREE_FLAGS = {"pp": "--pp", "mp": "--mp", "cp": "--cp", "ep": "--ep", "outer": "--fsdp-outer-degree"}
"""The degrees a layout line (`shardfusion.Topology.describe`: ``... x pp2 x sharding2 (outer1 x inner2) ...; ep1``)
names, and the flags that set them."""


def degree_changes(was: Optional[str], now: str) -> list[str]:
    """The `DEGREE_FLAGS` whose degree differs between two layout lines (`shardfusion.Topology.describe`), each as
    ``--pp 2 -> 1``; none that a line does not name (a layout recorded before that degree existed)."""
    def degrees(line: Optional[str]) -> dict[str, int]:
        found: dict[str, int] = {}
        for name, value in re.findall(r"\b(" + "|".join(DEGREE_FLAGS) + r")(\d+)\b", line or ""):
            found.setdefault(name, int(value))  # the first: "outer" comes again in the expert part
        return found

    before, after = degrees(was), degrees(now)
    return [f"{flag} {before[name]} -> {after[name]}" for name, flag in DEGREE_FLAGS.items()
            if name in before and name in after and before[name] != after[name]]


def layout_note(extra: dict[str, Any], world_size: int, layout: str, order: int) -> Optional[str]:
    """The note of `restore` on a resume at another world size or layout than the checkpoint's (``extra``: its
    ``world_size`` and ``layout``), naming the degrees that changed (`degree_changes`, e.g. ``--pp 2 -> 1``) and what
    differs from the saved run: the sums' order, and at another world size fresh RNG states on new ranks (and another
    data order for a checkpoint of the per-rank order). None when both are the saved ones."""
    changed = ", ".join(degree_changes(extra.get("layout"), layout))
    changed = f" ({changed})" if changed else ""
    if extra.get("world_size") != world_size:
        data = ("other data order (a checkpoint of the per-rank data order)" if order == DATA_ORDER_PER_RANK
                else "sums in another order")
        return (f"world size was {extra.get('world_size')}, now {world_size}: {data}, fresh RNG states on new "
                f"ranks{changed}")
    if extra.get("layout") != layout:
        return f"layout was {extra.get('layout')}, now {layout}: sums in another order{changed}"
    return None
