"""Checkpoints of the Lightning strategies: a sharded folder that loads into any layout, or one full file.

Sharded (the default, ``save_distributed_checkpoint=True``): a folder holding

- the model and optimizer states as :func:`shardfusion.checkpoint.save` writes them (``torch.distributed.checkpoint``,
  each fragment written once by its canonical holder; loaded by :func:`shardfusion.checkpoint.load` into any world
  size and any degrees: docs/checkpoints.md);
- :data:`META_FILE`, written by rank 0 with Lightning's ``CheckpointIO``: everything else of the checkpoint (for the
  Trainer: ``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``, hyperparameters, ...; for Fabric:
  the state's other entries).

It is written into ``<path>.partial`` and renamed to ``<path>`` by rank 0 once every rank has written its part (an
older checkpoint at ``<path>`` is moved aside first and deleted after the rename), so a crash mid-save never leaves a
half-written folder under the name.

Full (``save_distributed_checkpoint=False``): one ``torch.save`` file written by rank 0, in the format of Lightning's
single-device and DDP checkpoints: full tensors under the module's own parameter names, and each optimizer's
``state_dict()`` with full-shape tensors keyed by parameter index, so a plain ``LightningModule`` /
``Trainer(strategy="ddp")`` loads or resumes it, and a sharded one loads it back at any layout.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import shardfusion as sf
from shardfusion import comm
from shardfusion._runtime import optimizer_state_dict

META_FILE = "lightning.pt"
"""The file of a sharded checkpoint folder that holds everything but the model and optimizer states."""


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_sharded`."""
    return path.is_dir() and (path / META_FILE).is_file()


def save_sharded(path: Path, model: nn.Module, optimizers: Optional[list], meta: dict, io) -> None:
    """Write ``model`` (a sharded model) and ``optimizers`` with :func:`shardfusion.checkpoint.save`, and ``meta``
    with the ``CheckpointIO`` ``io``, as the folder ``path`` (see the module docstring). Collective.

    Raises:
        ValueError: on every rank: anything :func:`shardfusion.checkpoint.save` raises; rank 0 cannot prepare or
            publish the folder (the message names the path and rank 0's error).
    """
    tmp, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
    comm.call_on_rank0(lambda: _remove(tmp), f"cannot prepare {str(tmp)!r}")
    sf.checkpoint.save(model, optimizers or None, str(tmp))
    comm.call_on_rank0(lambda: _publish(tmp, path, old, meta, io), f"cannot publish {str(tmp)!r} as {str(path)!r}")


def _publish(tmp: Path, path: Path, old: Path, meta: dict, io) -> None:
    io.save_checkpoint(meta, tmp / META_FILE)
    _remove(old)
    if path.exists():
        os.replace(path, old)  # a file or a folder: kept until the new one has its name
    os.replace(tmp, path)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def load_sharded(path: Path, model: nn.Module, optimizers: Optional[list], io,
                 weights_only: Optional[bool] = None) -> dict:
    """Load the folder ``path`` (:func:`save_sharded`, any layout) into ``model`` and ``optimizers`` in place and
    return its :data:`META_FILE` contents. Collective. A checkpoint saved without optimizers leaves them as they
    are.

    Raises:
        ValueError: on every rank: anything :func:`shardfusion.checkpoint.load` raises (missing or extra parameters,
            other shapes or optimizer classes, damaged files; each named).
    """
    sf.checkpoint.load(model, optimizers or None, str(path))
    return io.load_checkpoint(path / META_FILE, weights_only=weights_only)


def full_model_state(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The full state dict of the sharded ``model`` (:func:`shardfusion.full_state_dict`) with ``prefix`` taken off
    the names, on the CPU, on rank 0 (``{}`` on the others). Collective."""
    full = sf.full_state_dict(model)
    if torch.distributed.get_rank() != 0:
        return {}
    return {name[len(prefix):]: t.cpu() for name, t in full.items() if name.startswith(prefix)}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` of an optimizer over fragments with every per-element state as a full-shape CPU
    tensor (what the same optimizer over the unsharded module holds), on rank 0 (``{}`` on the others).
    Collective: the states are gathered one at a time, in the order of their keys, on every rank."""
    optimizer_state_dict.install(optimizer)  # state_dict() gives DTensors even before the first step
    sd = optimizer.state_dict()
    state = {}
    for key in sorted(sd["state"]):
        entry = sd["state"][key]
        state[key] = {name: _full(entry[name]) for name in sorted(entry)}
    if torch.distributed.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": sd["param_groups"]}


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value.cpu() if isinstance(value, torch.Tensor) else value


def load_full_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full optimizer state (:func:`full_optimizer_state`, or a plain module's ``optimizer.state_dict()``)
    into an optimizer over fragments: each rank keeps its fragment of every full-shape tensor. Collective.

    Raises:
        ValueError: a state tensor of neither the parameter's full shape nor this rank's fragment's.
    """
    optimizer_state_dict.install(optimizer)
    optimizer.load_state_dict(state)
