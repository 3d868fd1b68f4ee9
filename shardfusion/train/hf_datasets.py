"""Hugging Face `datasets` folders as a corpus (`--data`): a folder written by `Dataset.save_to_disk`, or by
`DatasetDict.save_to_disk` with `--split` naming the split to read, loaded with `datasets.load_from_disk`.

What a folder is, is told by the files ``save_to_disk`` writes, without importing `datasets`: a DatasetDict's
folder holds ``dataset_dict.json`` (its ``"splits"``) and one Dataset folder per split; a Dataset's folder holds
``state.json`` (its Arrow files and its fingerprint) and ``dataset_info.json`` (its features). So the training job
can refuse a DatasetDict without `--split`, an unknown split, or a missing `datasets` package (an optional extra:
``pip install 'shardfusion[data]'``) in one line before any worker starts.

A Dataset's documents are the values of its `--text-field` column (default "text", as for JSON Lines and
Parquet), one per row, in row order, null rows skipped, read a batch of `BATCH_ROWS` rows at a time from the
memory-mapped Arrow files. The token cache (`shardfusion.train.token_cache`) keys the folder by `identity`: the
fingerprint ``save_to_disk`` recorded in ``state.json`` (the ``Dataset._fingerprint`` that `datasets` derives from
the data and every transform applied to it) and the path, size and modification time of each file the folder's
state names, so saving another dataset to the same folder gives another key.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Iterator

DICT_FILE = "dataset_dict.json"
"""Written by `DatasetDict.save_to_disk`: ``{"splits": [...]}``, one sub-folder per split."""

STATE_FILE = "state.json"
"""Written by `Dataset.save_to_disk`: the Arrow files (``"_data_files"``) and the fingerprint (``"_fingerprint"``)."""

INFO_FILE = "dataset_info.json"
"""Written by `Dataset.save_to_disk`: the features, among others."""

DATASETS_INSTALL_HINT = "pip install 'shardfusion[data]'"

BATCH_ROWS = 1024
"""Rows read per batch from a Dataset's Arrow files."""


def is_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` (it holds `STATE_FILE` and `INFO_FILE`)."""
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / INFO_FILE).is_file()


def is_dataset_dict(path: Path) -> bool:
    """Whether `path` is a folder written by `DatasetDict.save_to_disk` (it holds `DICT_FILE`)."""
    return path.is_dir() and (path / DICT_FILE).is_file()


def is_saved(path: Path) -> bool:
    """Whether `path` is a folder written by `save_to_disk` (a Dataset or a DatasetDict)."""
    return is_dataset(path) or is_dataset_dict(path)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
        raise ValueError(f"--data {path.parent}: cannot read its {what} {path.name}: {reason}") from None


def splits(root: Path) -> list[str]:
    """The splits of the DatasetDict folder `root`, as its `DICT_FILE` lists them.

    Raises:
        ValueError: one line naming --data: the file cannot be read or lists no splits.
    """
    names = _read_json(root / DICT_FILE, "split list")
    names = names.get("splits") if isinstance(names, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"--data {root}: its {DICT_FILE} lists no splits; save the DatasetDict again with "
                         f"save_to_disk")
    return names


def check_installed(root: Path) -> None:
    """Refuse a saved dataset when the `datasets` package is missing (found without importing it).

    Raises:
        ValueError: one line naming --data and the extra that installs it.
    """
    try:
        found = importlib.util.find_spec("datasets") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        found = False
    if not found:
        raise ValueError(f"--data {root}: a folder written by Hugging Face datasets' save_to_disk; reading it needs "
                         f"the datasets package ({DATASETS_INSTALL_HINT})")


def dataset_folder(root: Path, split: str | None) -> Path | None:
    """The Dataset folder that `--data root` and `--split split` name: root itself for a Dataset, root/split for a
    DatasetDict; None when root is no folder written by `save_to_disk` (other data).

    Raises:
        ValueError: one line naming the flag: a DatasetDict without --split (naming its splits), a split it does not
            have, --split with a Dataset, a split folder that is not a Dataset, or `datasets` not installed
            (`check_installed`).
    """
    if is_dataset_dict(root):
        names = splits(root)
        if split is None:
            raise ValueError(f"--data {root} is a DatasetDict with the splits {', '.join(names) or 'none'}: choose "
                             f"one with --split")
        if split not in names:
            raise ValueError(f"--split {split}: --data {root} has no such split (it has: {', '.join(names) or 'none'})")
        folder = root / split
        if not is_dataset(folder):
            raise ValueError(f"--data {root}: its split {split!r} has no saved Dataset in {folder} (no {STATE_FILE} "
                             f"or {INFO_FILE}); save the DatasetDict again with save_to_disk")
    elif is_dataset(root):
        if split is not None:
            raise ValueError(f"--split {split}: --data {root} is a Dataset, not a DatasetDict, so it has no splits; "
                             f"drop --split")
        folder = root
    else:
        return None
    check_installed(root)
    return folder


def _data_files(folder: Path, state: Any = None) -> list[Path]:
    """The files of the Dataset folder that decide its rows: `STATE_FILE`, `INFO_FILE` and the Arrow files the
    state (read if not given) names."""
    state = _read_json(folder / STATE_FILE, "state") if state is None else state
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise ValueError(f"--data {folder}: its {STATE_FILE} names no data files; save the dataset again with "
                         f"save_to_disk")
    return [folder / STATE_FILE, folder / INFO_FILE, *(folder / e["filename"] for e in entries)]


def identity(folder: Path) -> dict[str, Any]:
    """What the token cache keys a Dataset folder by: ``{"fingerprint": state.json's _fingerprint, "files": [[resolved
    path, size, mtime_ns], ...]}`` of `_data_files`.

    Raises:
        ValueError: one line naming --data: the state cannot be read, or a file it names cannot be.
    """
    state = _read_json(folder / STATE_FILE, "state")
    stats = []
    for path in _data_files(folder, state):
        try:
            st = path.stat()
        except OSError as error:
            raise ValueError(f"--data {folder}: cannot read {path.name}, which its {STATE_FILE} names: "
                             f"{error.strerror or error}; save the dataset again with save_to_disk") from None
        stats.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return {"fingerprint": state.get("_fingerprint"), "files": stats}


def data_bytes(folder: Path) -> int:
    """The bytes of the folder's Arrow files (all columns): the size of what the reader goes through."""
    return sum(p.stat().st_size for p in _data_files(folder)[2:])


def _load(folder: Path) -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ValueError(f"--data {folder}: reading a folder written by save_to_disk needs the datasets package "
                         f"({DATASETS_INSTALL_HINT}): {error}") from None
    try:
        data = datasets.load_from_disk(str(folder))
    except Exception as error:  # datasets raises FileNotFoundError, pyarrow errors, json errors, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--data {folder}: datasets.load_from_disk cannot read it: {reason}") from None
    if not isinstance(data, datasets.Dataset):
        raise ValueError(f"--data {folder}: load_from_disk gave a {type(data).__name__}, not a Dataset")
    return data


def dataset_documents(folder: Path, text_field: str) -> Iterator[str]:
    """The documents of the Dataset folder: its text_field column's values in row order, nulls skipped.

    Raises:
        ValueError: one line naming --data and the folder: `datasets` missing, the folder cannot be loaded, it has
            no such column (naming the columns and --text-field), or the column does not hold strings.
    """
    data = _load(folder)
    names = data.column_names
    if text_field not in names:
        raise ValueError(f"--data {folder}: no {text_field!r} column (it has: {', '.join(names) or 'none'}); name the "
                         f"text column with --text-field")
    feature = data.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"--data {folder}: the {text_field!r} column holds {feature}, not strings; name the text "
                         f"column with --text-field")
    rows = data.select_columns([text_field]).with_format("arrow")
    for batch in rows.iter(batch_size=BATCH_ROWS):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value
