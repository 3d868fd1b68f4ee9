"""Tokenize a corpus once into a memory-mapped token file, reused by every later run with the same inputs.

The cache entry of a corpus is keyed by everything that decides its tokens: the tokenizer's fingerprint, each
file's resolved path, size and modification time (for a Hugging Face `datasets` folder: its fingerprint and its
files', `shardfusion.train.hf_datasets.identity`), the text field, the byte cap and `CACHE_VERSION`. Change any of
them (another tokenizer, an edited file) and the key changes, so the corpus is tokenized again; an entry that exists
is only opened. An entry is two files in the cache folder, written to temporary names and renamed when complete (a
run killed while tokenizing leaves no half entry):

- ``<key>.tokens``: the packed stream, every document's ids (`Tokenizer.document_ids`: bos if any, the text, eot)
  one after the other, as little-endian `Tokenizer.id_dtype` (uint8, uint16 or uint32), opened with `numpy.memmap`;
- ``<key>.json``: what it holds (tokens, documents, text bytes, tokenizer, files), for people and for the job's
  messages.

Where the cache lives: `--data-cache DIR` if given; else ``.shardfusion-tokens`` in the folder that holds `--data`
(beside the data, so it moves with it), when that is writable; else the user cache
(``$XDG_CACHE_HOME/shardfusion/tokens``, by default ``~/.cache/shardfusion/tokens``). Processes that need the same
entry at once (torchrun's workers of one node) take a file lock: one tokenizes, the others wait and open it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from shardfusion.train import hf_datasets
from shardfusion.train.documents import documents, source_bytes
from shardfusion.train.tokenizer import Tokenizer

CACHE_VERSION = 2
"""Bumped when the layout of an entry, the packing or the reading of the files changes (2: compressed files are
decompressed, where version 1 tokenized their compressed bytes as text)."""

CACHE_FOLDER = ".shardfusion-tokens"
"""Name of the cache folder beside the data (hidden: a folder of data never reads it as data)."""

BATCH_BYTES = 4 << 20
"""Text handed to the tokenizer per call, in bytes (its batch encoder runs the documents in parallel)."""


def user_cache() -> Path:
    """``$XDG_CACHE_HOME/shardfusion/tokens`` (default ``~/.cache/shardfusion/tokens``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardfusion" / "tokens"


def cache_folder(data: Optional[str], data_cache: Optional[str]) -> Path:
    """Where the entries of `--data data` live (see the module docstring)."""
    if data_cache is not None:
        return Path(data_cache)
    if data is not None:
        parent = Path(data).resolve().parent
        beside = parent / CACHE_FOLDER
        if os.access(beside if beside.is_dir() else parent, os.W_OK | os.X_OK):
            return beside
    return user_cache()


def cache_key(files: list[Path], tokenizer: Tokenizer, text_field: str, max_bytes: int) -> str:
    """The entry's name: a digest of everything that decides the tokens."""
    stats: list = []
    for path in files:
        if hf_datasets.is_dataset(path):  # a folder: its fingerprint and files (the keys of files are unchanged)
            stats.append(hf_datasets.identity(path))
            continue
        st = path.stat()
        stats.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    text = json.dumps({"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint, "files": stats,
                       "text_field": text_field, "max_bytes": max_bytes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _batches(files: list[Path], text_field: str, max_bytes: int, check_text: bool) -> Iterator[list[str]]:
    batch, size = [], 0
    for _, text in documents(files, text_field, max_bytes, check_text):
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _build(files: list[Path], tokenizer: Tokenizer, text_field: str, max_bytes: int, stem: Path,
           progress: bool, where: str, check_text: bool = True) -> dict:
    from tqdm import tqdm  # the job's extra; the library never gets here

    total = min(max_bytes, sum(source_bytes(p) for p in files))
    tmp = stem.with_name(stem.name + f".tokens.tmp{os.getpid()}")
    counts = {"tokens": 0, "documents": 0, "text_bytes": 0}
    print(f"shardfusion: tokenizing {where} ({len(files)} files, {total:,} bytes) with {tokenizer.describe()} "
          f"into {stem.parent}", file=sys.stderr, flush=True)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress, file=sys.stderr)
    try:
        with open(tmp, "wb") as out:
            for batch in _batches(files, text_field, max_bytes, check_text):
                dtype = tokenizer.id_dtype.newbyteorder("<")
                ids = np.concatenate([np.asarray(doc, dtype=dtype) for doc in tokenizer.document_ids(batch)])
                out.write(ids.tobytes())
                size = sum(len(t.encode("utf-8")) for t in batch)
                counts["tokens"] += len(ids)
                counts["documents"] += len(batch)
                counts["text_bytes"] += size
                bar.update(size)
        bar.close()
        meta = {"version": CACHE_VERSION, **counts, "dtype": tokenizer.id_dtype.name, "tokenizer": tokenizer.name,
                "tokenizer_fingerprint": tokenizer.fingerprint, "text_field": text_field, "max_bytes": max_bytes,
                "files": [str(p.resolve()) for p in files]}
        os.replace(tmp, stem.with_suffix(".tokens"))
        meta_tmp = stem.with_name(stem.name + f".json.tmp{os.getpid()}")
        meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(meta_tmp, stem.with_suffix(".json"))  # last: its presence marks a complete entry
    finally:
        tmp.unlink(missing_ok=True)
    return meta


def cached_tokens(files: list[Path], tokenizer: Tokenizer, *, text_field: str, max_bytes: int, folder: Path,
                  progress: bool = True, where: str = "the corpus", check_text: bool = True
                  ) -> tuple[np.ndarray, dict]:
    """The packed token stream of the files, (N,) `tokenizer.id_dtype`, read-only memory map, and its entry's
    metadata; tokenizes the files first when the cache has no entry for them (check_text: see
    `shardfusion.train.documents.file_documents`).

    Raises:
        ValueError: a file it cannot use (`shardfusion.train.documents`), or the cache folder cannot be written
            (naming --data-cache).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--data-cache: cannot create the token cache folder {folder}: {error.strerror or error}"
                         ) from None
    stem = folder / cache_key(files, tokenizer, text_field, max_bytes)
    meta_path = stem.with_suffix(".json")
    if not meta_path.is_file():
        if not os.access(folder, os.W_OK | os.X_OK):  # else the lock file's open raises a bare PermissionError
            raise ValueError(f"--data-cache: cannot write the token cache folder {folder} (permission denied); "
                             f"pass --data-cache with a writable folder")
        with _locked(stem.with_suffix(".lock")):
            if not meta_path.is_file():  # another process may have built it while this one waited
                _build(files, tokenizer, text_field, max_bytes, stem, progress, where, check_text)
    meta = json.loads(meta_path.read_text())
    meta["path"] = str(stem.with_suffix(".tokens"))
    if meta["tokens"] == 0:
        return np.zeros(0, dtype=tokenizer.id_dtype), meta
    tokens = np.memmap(stem.with_suffix(".tokens"), dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")
    return tokens, meta
