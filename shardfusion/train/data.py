"""Text data for `shardfusion.train`: the byte corpus, a fixed train/val split and a seeded batch sampler.

With the byte tokenizer (the default) the corpus is raw bytes (one token per byte, vocabulary 256); other
tokenizers and JSON Lines / Parquet data give a token stream from the token cache (`shardfusion.train.data_config`),
which the split and the sampler treat the same way, counting tokens instead of bytes. By default it is the Python standard library's own
source: every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages and dist-packages excluded), in
sorted path order, concatenated, capped at `max_bytes`. The last `VAL_FRACTION` of the corpus is the validation split.

Batches are windows of `seq_len + 1` bytes at random offsets. The global batch of (step, micro-step), G windows, is a
pure function of (seed, step, micro_step, G) (`BatchSampler.global_batch`): data-parallel rank r takes its rows
[r * B, (r + 1) * B), B = G / dp_world, so every world size and layout trains on the same global batch, and a run is
reproducible and can resume at any step, in any layout, without replaying the sampler (data order `DATA_ORDER`).
Runs written before that drew B windows per rank from a seed that mixed in the rank (`DATA_ORDER_PER_RANK`); a
checkpoint of such a run resumes with that order. Validation batch i is a pure function of (seed, i, B): the same on
every rank. `context_parallel_slice` cuts a context-parallel rank's part of each sequence out of a batch.
See docs/data-order.md.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardfusion.context_parallel import sequence_chunk
from shardfusion.train.text_files import check_file, read_bytes, text_size

VAL_FRACTION = 0.05
"""Fraction of the corpus, taken from its end, held out for validation."""

DEFAULT_MAX_BYTES = 16_000_000
"""Default cap on the corpus size, so start-up stays fast."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TRAIN, _VAL, _TRAIN_GLOBAL = 0, 1, 2  # stream ids mixed into the sampler seed (_TRAIN: the per-rank order)

DATA_ORDER_PER_RANK = 1
"""Data order of runs before the order was recorded: each data-parallel rank draws its own `batch_size` windows from
a seed of (seed, step, micro-step, dp_rank), so the data depend on the world size."""

DATA_ORDER = 2
"""Data order of new runs: the global batch of `global_batch_size` windows is drawn from a seed of (seed, step,
micro-step) alone and each data-parallel rank takes a contiguous slice of it, so the data do not depend on the world
size or the layout. Recorded in OUT/config.json and in each checkpoint (`shardfusion.train.resume`)."""

DATA_ORDERS = (DATA_ORDER_PER_RANK, DATA_ORDER)


def stdlib_files() -> list[Path]:
    """The standard library's `*.py` files, sorted by path relative to the stdlib root."""
    return list(_stdlib_files())


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    # Cached: a worker checks the corpus size (`corpus_size`) before it loads it, and the walk is the slow part.
    return python_files(sysconfig.get_paths()["stdlib"])


def python_files(root: str | Path) -> tuple[Path, ...]:
    """The `*.py` files under ``root`` outside site-packages, dist-packages and __pycache__ folders, sorted by path
    relative to ``root``: ``root.rglob("*.py")`` filtered by ``is_file()`` (a folder reached through a symbolic link
    is not entered, a link to a file counts). Walked with os.walk: the launcher and every worker of a run walk the
    standard library, and pathlib's glob, which entered the skipped folders before filtering, took about 20 times
    as long."""
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]
        relative = os.path.relpath(folder, root)
        for name in names:
            if name.endswith(".py") and os.path.isfile(os.path.join(folder, name)):
                files.append(name if relative == os.curdir else f"{relative}/{name}")
    return tuple(Path(root, relative) for relative in sorted(files))


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


def _read_files(files: list[Path], max_bytes: int, check: bool) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        chunk = read_bytes(path, max_bytes - total, check)
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def load_corpus(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Read the corpus as a 1-D uint8 tensor of at most max_bytes bytes.

    path: None for the standard library's source; a file; or a folder, whose files (recursively, sorted by relative
    path) are concatenated as raw bytes. A compressed file (.gz, .bz2, .xz, .zst) gives its decompressed bytes, and
    each file read must be text (`shardfusion.train.text_files`; the standard library is not checked).

    Raises:
        FileNotFoundError: `path` is neither a file nor a folder.
        ValueError: max_bytes < 1, no bytes were read, or a file is not text or does not decompress (one line
            naming --data and the file).
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    files, where = _corpus_files(path)
    data = _read_files(files, max_bytes, check=path is not None)
    if not data:
        raise ValueError(f"no bytes read from {where}; pass --data with a non-empty text file or folder")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,)


def corpus_size(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """How many bytes `load_corpus(path, max_bytes)` would return: the file sizes, or for compressed files the
    bytes they decompress to (counted up to the cap). Each file it would read is opened and, for `--data` (not the
    standard library), its first MiB checked to be text, so a file that cannot be read, does not decompress or is
    not text fails here, before any worker starts.

    Raises:
        FileNotFoundError: `path` is neither a file nor a folder.
        OSError: a file of the corpus cannot be read; the message starts with ``--data`` and names the file.
        ValueError: a file is not text or does not decompress (`shardfusion.train.text_files`).
    """
    total = 0
    for file in _corpus_files(path)[0]:
        if total >= max_bytes:
            break
        try:
            if path is None:
                with file.open("rb") as handle:
                    handle.read(1)
            else:
                check_file(file)
            total += text_size(file, max_bytes - total)
        except OSError as error:
            raise OSError(f"--data: cannot read {file}: {error.strerror or error}") from None
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


def split_corpus(data):
    """Split a 1-D token tensor or array into (train, val) views: val is the last VAL_FRACTION, at least one
    token."""
    _, n_val = split_sizes(len(data))
    return data[:-n_val], data[-n_val:]


@dataclass(frozen=True, kw_only=True, eq=False)
class BatchSampler:
    """Seeded random windows over the train and val splits, as one data-parallel rank sees them.

    Training (data order `DATA_ORDER`): the global batch of (step, micro_step) holds G = batch_size * dp_world
    windows drawn from a seed without the rank; rank dp_rank takes rows [dp_rank * B, (dp_rank + 1) * B), B =
    batch_size. The union of the ranks' slices, in rank order, is `global_batch`, whatever dp_world is (for the same
    G). With `data_order=DATA_ORDER_PER_RANK`, each rank draws B windows of its own (the order of runs before).

    Raises:
        ValueError: dp_rank outside [0, dp_world), batch_size < 1, an unknown data_order, or a split shorter than
            seq_len + 1 bytes.
    """

    train: torch.Tensor | np.ndarray
    """Training tokens, 1-D: uint8 bytes (a torch tensor), or a token stream (a numpy array, e.g. the memory map
    of `shardfusion.train.token_cache`)."""
    val: torch.Tensor | np.ndarray
    """Validation tokens, as `train`."""
    batch_size: int
    """Windows per batch per data-parallel rank per micro-batch (B); the global batch holds B * dp_world."""
    seq_len: int
    """Tokens per window; each window reads seq_len + 1 tokens (inputs and shifted targets)."""
    seed: int
    """Base seed; together with step and micro-step (and G) it determines every batch."""
    dp_rank: int = 0
    """This rank's index in the data-parallel world (`topo.data_parallel_rank`)."""
    dp_world: int = 1
    """Size of the data-parallel world (`topo.dp * topo.sharding`)."""
    data_order: int = DATA_ORDER
    """`DATA_ORDER` (one global batch, sliced by rank) or `DATA_ORDER_PER_RANK` (the order of older runs)."""

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_world:
            raise ValueError(f"dp_rank({self.dp_rank}) must be in [0, dp_world({self.dp_world}))")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.data_order not in DATA_ORDERS:
            raise ValueError(f"data_order must be one of {DATA_ORDERS}, got {self.data_order!r}")
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) < self.seq_len + 1:
                raise ValueError(f"the {name} split has {len(split)} tokens, fewer than seq_len + 1 = "
                                 f"{self.seq_len + 1}; use more data (--data, --data-bytes) or a smaller --seq-len")

    @property
    def global_batch_size(self) -> int:
        """G: windows per micro-batch summed over the data-parallel ranks."""
        return self.batch_size * self.dp_world

    def _starts(self, split: torch.Tensor, seed_words: list[int], count: int) -> np.ndarray:
        rng = np.random.default_rng(seed_words)
        return rng.integers(0, len(split) - self.seq_len, size=count)  # (count,) int64

    def _windows(self, split: torch.Tensor | np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(split, np.ndarray):  # a memory-mapped token stream (shardfusion.train.token_cache)
            window = torch.from_numpy(split[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64))
        else:
            index = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)  # (n, T + 1)
            window = split[index].long()  # (n, T + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # 2 x (n, T)

    def _global_starts(self, step: int, micro_step: int) -> np.ndarray:
        return self._starts(self.train, [self.seed, _TRAIN_GLOBAL, step, micro_step], self.global_batch_size)

    def global_batch(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (G, T) int64 of the whole global batch of (step, micro_step) in data order
        `DATA_ORDER`: the same for every dp_rank and every dp_world with the same G. For references and tests; a
        rank trains on its slice (`get_batch`)."""
        return self._windows(self.train, self._global_starts(step, micro_step))

    def get_batch(self, split: str, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) int64.

        split "train": this rank's slice of the global batch of (step, micro_step) (with `DATA_ORDER_PER_RANK`:
        this rank's own draw). split "val": validation batch number `step` (micro_step unused), identical on every
        rank.
        """
        if split == "train":
            if self.data_order == DATA_ORDER_PER_RANK:
                starts = self._starts(self.train, [self.seed, _TRAIN, step, micro_step, self.dp_rank],
                                      self.batch_size)
            else:  # draw all G starts (cheap), read only this rank's B windows
                first = self.dp_rank * self.batch_size
                starts = self._global_starts(step, micro_step)[first: first + self.batch_size]
            return self._windows(self.train, starts)
        if split == "val":
            return self._windows(self.val, self._starts(self.val, [self.seed, _VAL, step], self.batch_size))
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def val_bytes_per_token(self, token_bytes: np.ndarray, num_batches: int) -> float:
        """Mean UTF-8 bytes per target token over the whole validation set of `num_batches` batches (every rank's
        indices, so the same on every rank; no communication): mean loss in nats / (ln 2 x this) is bits per byte.
        token_bytes: (V,) bytes per id (`shardfusion.train.tokenizer.Tokenizer.token_bytes`)."""
        per_rank = -(-num_batches // self.dp_world)
        total = count = 0
        for i in range(per_rank * self.dp_world):
            _, targets = self.get_batch("val", i)
            total += int(token_bytes[targets.numpy()].sum())
            count += targets.numel()
        return total / count

    def val_indices(self, num_batches: int) -> range:
        """This rank's share of the fixed validation set of `num_batches` batches, rounded up to a multiple of
        dp_world so that every rank runs the same number of forwards: indices dp_rank, dp_rank + dp_world, ..."""
        per_rank = -(-num_batches // self.dp_world)
        return range(self.dp_rank, per_rank * self.dp_world, self.dp_world)


def context_parallel_span(seq_len: int, cp_rank: int, cp: int) -> tuple[int, int]:
    """[start, end) of the positions that context-parallel rank cp_rank of cp holds in a sequence of seq_len
    tokens: the contiguous chunk number cp_rank of length seq_len / cp. A model with absolute position embeddings
    gives its tokens the positions start .. end - 1.

    Raises:
        ValueError: cp < 1, cp_rank outside [0, cp), or seq_len not divisible by cp (naming both numbers).
    """
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank({cp_rank}) must be in [0, cp({cp}))")
    if seq_len % cp:
        raise ValueError(f"the sequence length {seq_len} must be divisible by cp {cp} (each context-parallel rank "
                         f"holds seq_len / cp tokens); {seq_len} % {cp} = {seq_len % cp}")
    chunk = seq_len // cp
    return cp_rank * chunk, (cp_rank + 1) * chunk


def context_parallel_slice(inputs: torch.Tensor, targets: torch.Tensor, cp_rank: int,
                           cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This context-parallel rank's part of a batch: inputs[:, start:end] and targets[:, start:end], each
    (B, T / cp), same dtype, contiguous copies, with [start, end) = `context_parallel_span(T, cp_rank, cp)`.

    inputs, targets: (B, T), e.g. a data-parallel rank's `BatchSampler.get_batch("train", ...)`; every cp rank of a
    data-parallel rank holds the same batch and takes its own chunk, so the chunks of ranks 0 .. cp-1 side by side
    are the whole sequences. Targets are already shifted (target t is input t + 1), so a chunk's last target is the
    next chunk's first input and no token is lost at a boundary. The mean loss over a global batch is then the mean
    over all data-parallel and cp ranks of each rank's mean loss over its (B, T / cp) tokens (every rank holds as
    many). Contiguous chunks, as in ring attention (Liu et al., 2023); under causal attention the last chunk does
    the most work: a load-balanced split (2 * cp chunks, rank r taking chunks r and 2cp - 1 - r, as Megatron-LM's
    context parallel does) would be a drop-in replacement here.

    Raises:
        ValueError: inputs and targets are not 2-D of one shape, or what `context_parallel_span` raises.
    """
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(f"inputs and targets must both be (B, T), got {tuple(inputs.shape)} and "
                         f"{tuple(targets.shape)}")
    context_parallel_span(inputs.shape[1], cp_rank, cp)  # the checks and their messages
    return sequence_chunk(inputs, cp_rank, cp).contiguous(), sequence_chunk(targets, cp_rank, cp).contiguous()
