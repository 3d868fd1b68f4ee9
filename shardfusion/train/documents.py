"""The documents of a corpus (`--data`): text files, JSON Lines, Parquet and Hugging Face `datasets` folders, read
in a fixed order.

`--data` is a file, a folder written by `datasets`' ``save_to_disk`` (`shardfusion.train.hf_datasets`: a Dataset, or
a DatasetDict with `--split`), or a folder of files; a folder's files are taken recursively, sorted by relative
path, hidden files and folders (a name starting with ".", such as the token cache `.shardfusion-tokens`) left out.
A file compressed with gzip, bzip2, xz or Zstandard (``.gz``, ``.bz2``, ``.xz``, ``.zst``) is decompressed, and
the suffix before that one tells its format (`shardfusion.train.text_files`). Each file is read by its suffix:

- ``.jsonl`` / ``.ndjson``: JSON Lines, one object per line, its `--text-field` (default "text") a document; blank
  lines are skipped.
- ``.parquet``: a Parquet table (pyarrow, an optional extra: ``pip install 'shardfusion[data]'``), its
  `--text-field` column, one document per row, read a row group at a time.
- a ``save_to_disk`` folder: its `--text-field` column, one document per row (null rows skipped), read with
  `datasets.load_from_disk` (an optional extra, as above).
- anything else: text, the whole file one document (UTF-8; invalid bytes become U+FFFD; an empty file none).

JSON Lines and text files must be text (`shardfusion.train.text_files.check_text`: no NUL byte and at most 1 % of
the characters not UTF-8 in the first MiB), unless the caller vouches for them (``check_text=False``: the job's
default corpus, the standard library's source, a few of whose test files are in other encodings on purpose).

`documents` yields the non-empty documents in that order, stopping after the one that reaches `max_bytes` bytes of
text, and raises a one-line ValueError naming --data, the file and (for JSON Lines) the line for input it cannot
use. The training job tokenizes them once into a token cache (`shardfusion.train.token_cache`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Iterator

from shardfusion.train import hf_datasets
from shardfusion.train.text_files import check_file, format_suffix, open_bytes, read_bytes, text_size

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DATA_INSTALL_HINT = "pip install 'shardfusion[data]'"


def is_structured(path: Path) -> bool:
    """Whether the file holds documents of its own (JSON Lines or Parquet, compressed or not, or a `datasets`
    folder) rather than one text."""
    return format_suffix(path) in JSONL_SUFFIXES + PARQUET_SUFFIXES or hf_datasets.is_dataset(path)


def data_files(root: Path, split: str | None = None) -> list[Path]:
    """The sources of `--data root`: root itself if it is a file; the Dataset folder of a `save_to_disk` folder
    (with `--split split` for a DatasetDict: `shardfusion.train.hf_datasets.dataset_folder`); else root's
    non-hidden files, recursively, sorted by relative path.

    Raises:
        FileNotFoundError: root is neither a file nor a folder.
        ValueError: one line naming the flag: --split without a DatasetDict, or see `hf_datasets.dataset_folder`; a
            `save_to_disk` folder inside a folder of files (pass it as --data itself).
    """
    if not root.is_file() and not root.is_dir():
        raise FileNotFoundError(f"--data {str(root)!r} is neither a file nor a folder")
    folder = hf_datasets.dataset_folder(root, split)
    if folder is not None:
        return [folder]
    if split is not None:
        raise ValueError(f"--split {split}: --data {root} is not a folder written by DatasetDict.save_to_disk, "
                         f"whose splits --split chooses; drop --split")
    if root.is_file():
        return [root]
    files = [p for p in root.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    for path in files:
        if path.name in (hf_datasets.STATE_FILE, hf_datasets.DICT_FILE) and hf_datasets.is_saved(path.parent):
            raise ValueError(f"--data {root}: {path.parent} is a folder written by save_to_disk; pass it as --data "
                             f"itself (one dataset per run)")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_bytes(path: Path, text_field: str, max_bytes: int) -> int:
    """min(max_bytes, the text a source holds), about: the bytes of a file after decompression
    (`shardfusion.train.text_files.text_size`: JSON Lines and Parquet counted with their syntax), or for a
    `datasets` folder its documents' UTF-8 bytes, counted up to max_bytes.

    Raises:
        OSError: a file cannot be opened.
        ValueError: see `text_size` and `hf_datasets.dataset_documents`.
    """
    if not hf_datasets.is_dataset(path):
        return text_size(path, max_bytes)
    total = 0
    for text in hf_datasets.dataset_documents(path, text_field):
        if total >= max_bytes:
            break
        total += len(text.encode("utf-8"))
    return min(total, max_bytes)


def source_bytes(path: Path) -> int:
    """The bytes on disk of a source of `data_files`: a file's size, or a `datasets` folder's Arrow files'."""
    return hf_datasets.data_bytes(path) if hf_datasets.is_dataset(path) else path.stat().st_size


def _jsonl(path: Path, field: str, check_text: bool) -> Iterator[str]:
    if check_text:
        check_file(path)
    with open_bytes(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--data {path} line {number}: not JSON ({error.msg}); a JSON Lines file holds one "
                                 f"JSON object per line") from None
            if not isinstance(record, dict) or field not in record:
                fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"--data {path} line {number}: no {field!r} field (it has: {fields or 'none'}); "
                                 f"name the text field with --text-field")
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(f"--data {path} line {number}: the {field!r} field is a {type(text).__name__}, "
                                 f"not a string")
            yield text


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ValueError(f"--data {path}: reading Parquet needs pyarrow ({DATA_INSTALL_HINT}): {error}") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
        raise ValueError(f"--data {path}: cannot read it as Parquet: {str(error).splitlines()[0]}") from None
    names = table.schema_arrow.names
    if field not in names:
        raise ValueError(f"--data {path}: no {field!r} column (it has: {', '.join(names) or 'none'}); name the text "
                         f"column with --text-field")
    for group in range(table.num_row_groups):
        try:
            column = table.read_row_group(group, columns=[field]).column(0)
        except Exception as error:
            raise ValueError(f"--data {path}: cannot read row group {group}: {str(error).splitlines()[0]}") from None
        for value in column.to_pylist():
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"--data {path}: the {field!r} column holds {type(value).__name__} values, not "
                                 f"strings")
            yield value


def _text(path: Path, check_text: bool) -> Iterator[str]:
    text = read_bytes(path, check=check_text).decode("utf-8", errors="replace")
    if text:  # an empty file holds no document
        yield text


def file_documents(path: Path, text_field: str, check_text: bool = True) -> Iterator[str]:
    """The documents of one source of `data_files`: a `datasets` folder, or a file by its suffix (see the module
    docstring); with check_text, a JSON Lines or text
    file must be text (`shardfusion.train.text_files.check_text`).

    Raises:
        ValueError: one line naming --data and the file: it cannot be read or decompressed, it is not text, or
            its content does not fit its format (the line of a JSON Lines file).
    """
    if hf_datasets.is_dataset(path):
        yield from hf_datasets.dataset_documents(path, text_field)
        return
    suffix = format_suffix(path)
    try:
        if suffix in JSONL_SUFFIXES:
            yield from _jsonl(path, text_field, check_text)
        elif suffix in PARQUET_SUFFIXES:
            if path.suffix.lower() not in PARQUET_SUFFIXES:
                raise ValueError(f"--data {path}: a compressed Parquet file; Parquet compresses its own columns, "
                                 f"so decompress it to {path.stem}")
            yield from _parquet(path, text_field)
        else:
            yield from _text(path, check_text)
    except OSError as error:
        raise ValueError(f"--data: cannot read {path}: {error.strerror or error}") from None


def documents(files: list[Path], text_field: str, max_bytes: int,
              check_text: bool = True) -> Iterator[tuple[Path, str]]:
    """(file, document) of the files in order, until the text read reaches max_bytes UTF-8 bytes (the document
    that crosses it is the last, whole); check_text as in `file_documents`.

    Raises:
        ValueError: a file it cannot use (see `file_documents`).
    """
    total = 0
    for path in files:
        for text in file_documents(path, text_field, check_text):
            if not text:
                continue  # an empty document would be a lone end-of-text token
            yield path, text
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                return
