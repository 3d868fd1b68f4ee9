"""Reading a checkpoint folder in one process, with no process group (no collective): ``read_meta``, ``read_all``
and ``load_full``, and the plain DCP read under the distributed ``load`` too; errors are one line that names the
path and the damaged files. The keys are those of :mod:`shardfusion.checkpoint.save_load`'s format table."""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException


def read_plain_raw(sd: dict[str, Any], reader: FileSystemReader) -> None:
    """Fill ``sd`` (keys as stored; ``None`` for pickled items) from ``reader`` in this process alone, no collective;
    DCP's errors as they are (``CheckpointException``, a ``BaseException``). ``flatten_sharded_tensors=False``: the
    default copies ``sd``, and pickled items would land in the copy."""
    with warnings.catch_warnings():
        # DCP warns that it "assumes the intent is to load in a single process" when a process group exists: it is.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(sd, storage_reader=reader,
                 planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)


def read_plain(sd: dict[str, Any], reader: FileSystemReader, path: str) -> None:
    """:func:`read_plain_raw`, a failed read (a data file truncated, corrupt or missing) as one ``ValueError``.

    Raises:
        ValueError: ``checkpoint <path> cannot be read: ...`` (:func:`read_error`).
    """
    try:
        read_plain_raw(sd, reader)
    except (CheckpointException, OSError) as error:  # DCP's error is a BaseException
        raise read_error(path, reader, error) from error


def failure_text(error: BaseException, with_ranks: bool = False) -> str:
    """``error`` on one line: for DCP's ``CheckpointException`` (one traceback per failed rank in its ``str``) the
    exception of each failed rank, with ``with_ranks`` prefixed by the ranks that raised it (``rank 1: EOFError``)."""
    if isinstance(error, CheckpointException) and error.failures:
        by_text: dict[str, list[int]] = {}
        for rank, (exc, _trace) in sorted(error.failures.items()):
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            by_text.setdefault(text, []).append(rank)
        parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}" if with_ranks else text
                 for text, ranks in by_text.items()]
        text = "; ".join(parts)
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def _damaged_files(path: str, reader: FileSystemReader) -> list[str]:
    """The data files of ``path`` that are missing or shorter than its metadata says, each with the keys it holds
    (the first few), e.g. ``"__1_0.distcp has 100 bytes, the metadata needs 7442 (15 keys: model/a.weight, ...)"``;
    ``[]`` when the metadata cannot be read or every file is long enough."""
    try:
        storage = reader.read_metadata().storage_data
    except Exception:  # noqa: BLE001 - a diagnosis only: the caller reports the read error itself
        return []
    need: dict[str, int] = {}
    keys: dict[str, list[str]] = {}
    for index, info in storage.items():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        if index.fqn not in keys.setdefault(info.relative_path, []):
            keys[info.relative_path].append(index.fqn)
    out = []
    for name in sorted(need):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is not None and size >= need[name]:
            continue
        held = ", ".join(keys[name][:3]) + (", ..." if len(keys[name]) > 3 else "")
        what = "is missing" if size is None else f"has {size} bytes, the metadata needs {need[name]}"
        out.append(f"{name} {what} ({len(keys[name])} key{'s' if len(keys[name]) > 1 else ''}: {held})")
    return out


def read_error(path: str, reader: Optional[FileSystemReader], error: BaseException,
                with_ranks: bool = False) -> ValueError:
    """The error for a failed read of checkpoint ``path``: one line naming the path, the damaged data files (missing
    or truncated, with their keys) and the exception (of each failed rank, named with ``with_ranks``)."""
    damaged = _damaged_files(path, reader) if reader is not None else []
    return ValueError(f"checkpoint {path!r} cannot be read: "
                      + "; ".join(damaged + [failure_text(error, with_ranks)]))


def open_checkpoint(path: str) -> tuple[FileSystemReader, dict]:
    """A reader of ``path`` (its DCP metadata read) and the ``meta`` item, in this process alone.

    Raises:
        ValueError: ``path`` is not a readable checkpoint folder (names the path and the cause).
    """
    if not os.path.isfile(os.path.join(path, ".metadata")):  # checked first: DCP would log tracebacks for it
        what = "does not exist" if not os.path.exists(path) else "has no .metadata (not a complete DCP checkpoint)"
        raise ValueError(f"checkpoint folder {path!r} is not readable: it {what}")
    reader = None
    try:
        reader = FileSystemReader(path)
        sd: dict[str, Any] = {"meta": None}
        read_plain_raw(sd, reader)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's error is a BaseException
        # any unreadable folder: one clear error on one line, the same on every rank
        damaged = _damaged_files(path, reader) if reader is not None else []
        raise ValueError(f"checkpoint folder {path!r} is not readable: "
                         + "; ".join(damaged + [failure_text(error)])) from error
    return reader, sd["meta"]


def read_meta(path: str) -> dict:
    """The ``meta`` item of a checkpoint (format version, saving world size, original shapes, optimizer state keys
    and groups, ``extra``: see :mod:`shardfusion.checkpoint.save_load`; merged over every saving rank, so a pipeline
    checkpoint's shapes are those of every stage), read by this process alone (no collective).

    Raises:
        ValueError: ``path`` is not a readable checkpoint folder (names the path and the cause).
    """
    return open_checkpoint(path)[1]


def read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in one process with no process group: ``{key: tensor}`` (keys as in the module
    docstring), parameters and per-element optimizer state reshaped to the original shapes (also those of 0
    elements, which are not stored: as empty float tensors), scalars 0-d, buffers and ``rank/`` state as saved.

    Raises:
        ValueError: ``path`` is not a readable checkpoint folder, or a data file is truncated, corrupt or missing
            (one line naming ``path`` and the damaged files).
    """
    reader, meta = open_checkpoint(path)
    sd: dict[str, Any] = {}
    for key, m in reader.read_metadata().state_dict_metadata.items():
        if key != "meta":
            sd[key] = torch.empty(m.size, dtype=m.properties.dtype)
    read_plain(sd, reader, path)
    shapes = meta["shapes"]
    for key, t in sd.items():
        parts = key.split("/")
        if parts[0] == "model" or (parts[0] == "optim" and t.dim() == 1):  # per-element state is stored 1-D
            sd[key] = t.view(shapes[parts[1]])
    for name, shape in shapes.items():  # 0-element parameters (and their per-element state) are never written
        sd.setdefault(f"model/{name}", torch.empty(shape))
        for k, kind in ((meta.get("optim_state") or {}).get(name) or {}).items():
            if kind == "element":
                sd.setdefault(f"optim/{name}/{k}", torch.empty(shape))
    return sd


def load_full(path: str) -> dict[str, torch.Tensor]:
    """The model of a checkpoint, unsharded, in one process: ``{name: tensor}`` with the original shapes (persistent
    buffers, expert ones included: the keys of the model's own ``state_dict()``, a tied parameter once).

    Raises:
        ValueError: ``path`` is not a readable checkpoint folder, or a data file is truncated, corrupt or missing
            (as :func:`read_all`).
    """
    out = {}
    for key, t in read_all(path).items():
        if key.startswith("model/"):
            out[key[len("model/"):]] = t
        elif key.startswith("model_buffer/"):
            out[key[len("model_buffer/"):]] = t
    return out
