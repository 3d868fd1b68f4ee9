"""The bytes of one corpus file (`--data`): decompressed by its suffix, and refused when they are not text.

Compression is told by the last suffix: ``.gz`` (gzip), ``.bz2`` (bzip2) and ``.xz`` (xz/LZMA) are read with the
standard library (`gzip`, `bz2`, `lzma`); ``.zst`` (Zstandard) with the `zstandard` package, an optional extra
(``pip install 'shardfusion[data]'``; without it a one-line error names the extra). The suffix under it decides the
format (`format_suffix`: ``a.jsonl.gz`` is JSON Lines), so every reader of `shardfusion.train.documents` and the
byte corpus of `shardfusion.train.data` read the text inside.

A file is text when the first `HEAD_BYTES` of its (decompressed) bytes hold no NUL byte and decode as UTF-8 with at
most `MAX_REPLACEMENT_FRACTION` of the characters replaced by U+FFFD (`check_text`): an archive, an image, a
compressed file under a name that hides it, or text in another encoding is refused with one line naming the file,
instead of being trained on as replacement characters.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "Zstandard"}
"""Suffix -> the compression it stands for (the last suffix of a file's name)."""

HEAD_BYTES = 1 << 20
"""How much of a file's (decompressed) start `check_text` looks at: 1 MiB."""

MAX_REPLACEMENT_FRACTION = 0.01
"""The largest fraction of a file's first characters that may be U+FFFD (bytes that are not UTF-8) for it to be
taken as text: 1 %."""

ZSTD_INSTALL_HINT = "pip install 'shardfusion[data]'"

_CHUNK = 1 << 20


def compression(path: Path) -> str | None:
    """The compression of `path` by its last suffix (a value of `COMPRESSIONS`), or None."""
    return COMPRESSIONS.get(path.suffix.lower())


def format_suffix(path: Path) -> str:
    """The lower-case suffix that tells the file's format: the last one, or the one before a compression suffix
    (``a.jsonl.gz`` -> ``.jsonl``; ``a.gz`` -> ``""``)."""
    if compression(path) is None:
        return path.suffix.lower()
    return Path(path.stem).suffix.lower()


def _zstd_reader(raw: BinaryIO, path: Path) -> tuple[BinaryIO, tuple[type[BaseException], ...]]:
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"--data {path}: reading Zstandard (.zst) needs the zstandard package "
                         f"({ZSTD_INSTALL_HINT})") from None
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return io.BufferedReader(reader, _CHUNK), (zstandard.ZstdError,)


@contextmanager
def open_bytes(path: Path) -> Iterator[BinaryIO]:
    """The file's bytes as a binary stream, decompressed by its suffix (see the module docstring).

    Raises:
        OSError: the file cannot be opened (as `Path.open` raises it).
        ValueError: one line naming --data and the file: `.zst` without the zstandard package, or the data do not
            decompress (corrupt or truncated), raised where the reading fails.
    """
    kind = compression(path)
    with path.open("rb") as raw:
        if kind is None:
            yield raw
            return
        errors: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError)
        if kind == "gzip":
            stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb")
        elif kind == "bzip2":
            stream = bz2.BZ2File(raw, mode="rb")
        elif kind == "xz":
            stream = lzma.LZMAFile(raw, mode="rb")
        else:
            stream, extra = _zstd_reader(raw, path)
            errors += extra
        try:
            with stream:
                yield stream
        except errors as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"--data {path}: cannot decompress it as {kind}: {first}") from None


def read(stream: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes of `stream`, fewer only at its end (a decompressing reader may return short reads)."""
    parts, left = [], size
    while left > 0:
        part = stream.read(min(left, _CHUNK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def check_text(path: Path, head: bytes, whole: bool) -> None:
    """Refuse a file whose first bytes are not text: a NUL byte, or more than `MAX_REPLACEMENT_FRACTION` of the
    characters not UTF-8 (each invalid byte sequence counts one U+FFFD).

    head: the file's first `HEAD_BYTES` bytes, decompressed (all of it if shorter); whole: whether head is the
    whole file (else an incomplete UTF-8 sequence cut at its end is not counted).

    Raises:
        ValueError: one line naming --data, the file, the first NUL's offset or the fraction replaced.
    """
    after = " after decompression" if compression(path) else ""
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"--data {path}: not text (a NUL byte at offset {nul}{after}); train on UTF-8 text files, "
                         f"or leave this file out of --data")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=whole)
    replaced = text.count("\ufffd")
    if text and replaced > MAX_REPLACEMENT_FRACTION * len(text):
        raise ValueError(f"--data {path}: not UTF-8 text ({replaced} of the first {len(text)} characters{after} are "
                         f"not UTF-8, more than {MAX_REPLACEMENT_FRACTION:.0%}); convert it to UTF-8, or leave this "
                         f"file out of --data")


def check_file(path: Path) -> None:
    """`check_text` on the first `HEAD_BYTES` of the file, decompressed.

    Raises:
        OSError: the file cannot be opened.
        ValueError: see `open_bytes` and `check_text`.
    """
    with open_bytes(path) as stream:
        head = read(stream, HEAD_BYTES + 1)
    check_text(path, head[:HEAD_BYTES], whole=len(head) <= HEAD_BYTES)


def read_bytes(path: Path, max_bytes: int | None = None, check: bool = True) -> bytes:
    """The file's first max_bytes bytes (None: all), decompressed; with check, its first `HEAD_BYTES` must pass
    `check_text` (read even when max_bytes is smaller, so the verdict does not depend on the cap).

    Raises:
        OSError: the file cannot be opened or read.
        ValueError: see `open_bytes` and `check_text`.
    """
    with open_bytes(path) as stream:
        if max_bytes is None:
            data = stream.read()
        else:
            data = read(stream, max(max_bytes, HEAD_BYTES + 1) if check else max_bytes)
    if check:
        check_text(path, data[:HEAD_BYTES], whole=len(data) <= HEAD_BYTES)
    return data if max_bytes is None else data[:max_bytes]


def text_size(path: Path, max_bytes: int) -> int:
    """min(max_bytes, the file's size after decompression): the file size for an uncompressed file (nothing read),
    else counted by decompressing up to max_bytes.

    Raises:
        OSError: the file cannot be opened.
        ValueError: see `open_bytes`.
    """
    if compression(path) is None:
        return min(max_bytes, path.stat().st_size)
    total = 0
    with open_bytes(path) as stream:
        while total < max_bytes:
            part = stream.read(min(_CHUNK, max_bytes - total))
            if not part:
                break
            total += len(part)
    return total
