"""Byte-level text data for `shardfusion.train`: a corpus, a fixed train/val split and a seeded batch sampler.

The corpus is raw bytes (one token per byte, vocabulary 256). By default it is the Python standard library's own
source: every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages and dist-packages excluded), in
sorted path order, concatenated, capped at `max_bytes`. The last `VAL_FRACTION` of the corpus is the validation split.

Batches are windows of `seq_len + 1` bytes at random offsets. A training batch is a pure function of
(seed, step, micro_step, data-parallel rank), so each data-parallel rank sees different windows, and a run is
reproducible and can resume at any step without replaying the sampler. Validation batch i is a pure function of
(seed, i): the same on every rank.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VAL_FRACTION = 0.05
"""Fraction of the corpus, taken from its end, held out for validation."""

DEFAULT_MAX_BYTES = 16_000_000
"""Default cap on the corpus size, so start-up stays fast."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TRAIN, _VAL = 0, 1  # split ids mixed into the sampler seed


def stdlib_files() -> list[Path]:
    """The standard library's `*.py` files, sorted by path relative to the stdlib root."""
    return list(_stdlib_files())


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    # Cached: a worker checks the corpus size (`corpus_size`) before it loads it, and the walk is the slow part.
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if p.is_file() and not _SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def _corpus_files(path: str | Path | None) -> tuple[list[Path], str]:
    """The files of the corpus at `path` (see `load_corpus`), in order, and a description for messages."""
    if path is None:
        return stdlib_files(), f"the standard library at {sysconfig.get_paths()['stdlib']}"
    root = Path(path)
    if root.is_file():
        return [root], str(path)
    if root.is_dir():
        files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
        return files, str(path)
    raise FileNotFoundError(f"--data {str(path)!r} is neither a file nor a folder")


def _read_files(files: list[Path], max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)[:max_bytes]


def load_corpus(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Read the corpus as a 1-D uint8 tensor of at most max_bytes bytes.

    path: None for the standard library's source; a file; or a folder, whose files (recursively, sorted by relative
    path) are concatenated as raw bytes.

    Raises:
        FileNotFoundError: `path` is neither a file nor a folder.
        ValueError: max_bytes < 1, or no bytes were read.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    files, where = _corpus_files(path)
    data = _read_files(files, max_bytes)
    if not data:
        raise ValueError(f"no bytes read from {where}; pass --data with a non-empty text file or folder")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,)


def corpus_size(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """How many bytes `load_corpus(path, max_bytes)` would return, from the file sizes; each file it would read is
    opened (and its first byte read), so a file that cannot be read fails here, before any worker starts.

    Raises:
        FileNotFoundError: `path` is neither a file nor a folder.
        OSError: a file of the corpus cannot be read; the message starts with ``--data`` and names the file.
    """
    total = 0
    for file in _corpus_files(path)[0]:
        if total >= max_bytes:
            break
        try:
            with file.open("rb") as handle:
                handle.read(1)
        except OSError as error:
            raise OSError(f"--data: cannot read {file}: {error.strerror or error}") from None
        total += file.stat().st_size
    return min(total, max_bytes)


def split_sizes(num_bytes: int) -> tuple[int, int]:
    """(train, val) lengths of `split_corpus` on a corpus of num_bytes bytes."""
    n_val = max(1, int(num_bytes * VAL_FRACTION))
    return num_bytes - n_val, n_val


def min_corpus_bytes(seq_len: int) -> int:
    """The smallest corpus whose splits both hold one window of seq_len + 1 bytes."""
    n = max(2 * (seq_len + 1), math.ceil((seq_len + 1) / VAL_FRACTION))
    while min(split_sizes(n)) < seq_len + 1:  # guard against rounding in int(n * VAL_FRACTION)
        n += 1
    return n


def split_corpus(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D byte tensor into (train, val): val is the last VAL_FRACTION, at least one byte."""
    _, n_val = split_sizes(len(data))
    return data[:-n_val], data[-n_val:]


@dataclass(frozen=True, kw_only=True, eq=False)
class BatchSampler:
    """Seeded random windows over the train and val splits for one data-parallel rank."""

    train: torch.Tensor
    """Training bytes, 1-D uint8."""
    val: torch.Tensor
    """Validation bytes, 1-D uint8."""
    batch_size: int
    """Windows per batch (per data-parallel rank, per micro-batch)."""
    seq_len: int
    """Tokens per window; each window reads seq_len + 1 bytes (inputs and shifted targets)."""
    seed: int
    """Base seed; together with step, micro-step and rank it determines every batch."""
    dp_rank: int = 0
    """This rank's index in the data-parallel world (`topo.data_parallel_rank`)."""
    dp_world: int = 1
    """Size of the data-parallel world (`topo.dp * topo.sharding`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_world:
            raise ValueError(f"dp_rank({self.dp_rank}) must be in [0, dp_world({self.dp_world}))")
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) < self.seq_len + 1:
                raise ValueError(f"the {name} split has {len(split)} bytes, fewer than seq_len + 1 = "
                                 f"{self.seq_len + 1}; use more data (--data, --data-bytes) or a smaller --seq-len")

    def _windows(self, split: torch.Tensor, seed_words: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(seed_words)
        starts = rng.integers(0, len(split) - self.seq_len, size=self.batch_size)  # (B,)
        index = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)  # (B, T + 1)
        window = split[index].long()  # (B, T + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # 2 x (B, T)

    def get_batch(self, split: str, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) int64.

        split "train": this rank's batch for (step, micro_step). split "val": validation batch number `step`
        (micro_step unused), identical on every rank.
        """
        if split == "train":
            return self._windows(self.train, [self.seed, _TRAIN, step, micro_step, self.dp_rank])
        if split == "val":
            return self._windows(self.val, [self.seed, _VAL, step])
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def val_indices(self, num_batches: int) -> range:
        """This rank's share of the fixed validation set of `num_batches` batches, rounded up to a multiple of
        dp_world so that every rank runs the same number of forwards: indices dp_rank, dp_rank + dp_world, ..."""
        per_rank = -(-num_batches // self.dp_world)
        return range(self.dp_rank, per_rank * self.dp_world, self.dp_world)
