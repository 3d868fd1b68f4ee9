"""The numbered checkpoints under a root folder: ``root/step-<n>`` published atomically, a ``latest`` pointer, the
last K kept (see :func:`shardfusion.checkpoint.save_checkpoint`, which writes them). The publish-by-rename pattern is
the usual one for crash-safe checkpoints (write to a temporary name, rename once complete; torchtitan and Megatron do
the same); the rename happens on rank 0 only after every rank's DCP write has finished."""

from __future__ import annotations

import os
import shutil
from typing import Optional


def prepare(root: str, step: int) -> None:
    """On rank 0, before every rank saves into ``root/tmp-step-<step>``: create ``root`` and remove what a crashed
    earlier save of this step left there."""
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(os.path.join(root, f"tmp-step-{step}"), ignore_errors=True)


def publish(root: str, step: int, keep: int) -> None:
    """On rank 0, after every rank has saved into ``root/tmp-step-<step>``: rename it to ``root/step-<step>``, point
    ``root/latest`` at it (a temporary file, fsync, ``os.replace``), fsync ``root`` so that both renames are durable,
    then prune (see :func:`shardfusion.checkpoint.save_checkpoint`): keep the ``keep - 1`` highest published checkpoints of a lower step,
    leave those of a higher step, delete every ``tmp-step-<n>`` folder."""
    final = os.path.join(root, f"step-{step}")
    shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a resumed run)
    os.replace(os.path.join(root, f"tmp-step-{step}"), final)
    pointer = os.path.join(root, "latest")
    with open(pointer + ".tmp", "w") as f:
        f.write(f"step-{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    lower = [d for d in published(root) if int(d[5:]) < step]  # oldest first; the new one is not among them
    for old in lower[:max(len(lower) - (keep - 1), 0)]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for name in os.listdir(root):  # folders of crashed saves (the one in flight is step-<step> by now)
        if name.startswith("tmp-step-") and name[9:].isdigit():
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def published(root: str) -> list[str]:
    """The published checkpoint folders under ``root`` (``step-<n>`` with DCP's ``.metadata``), oldest first."""
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root) if d.startswith("step-") and d[5:].isdigit()
             and os.path.isfile(os.path.join(root, d, ".metadata"))]
    return sorted(found, key=lambda d: int(d[5:]))


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest published checkpoint folder under ``root`` (from the ``latest`` pointer, i.e. the last one
    :func:`shardfusion.checkpoint.save_checkpoint` published, else the highest complete ``step-<n>``, which may belong to an abandoned
    timeline), or ``None``. ``tmp-`` folders of interrupted saves are never returned."""
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if os.path.isfile(os.path.join(root, name, ".metadata")):
            return os.path.join(root, name)
    done = published(root)
    return os.path.join(root, done[-1]) if done else None


def find_checkpoint(path: str) -> str:
    """The checkpoint folder that ``path`` names: ``path`` itself if it is one (it holds DCP's ``.metadata``), else the
    latest checkpoint under it (a root of ``step-<n>`` folders), else the latest under its one subfolder that is such
    a root (e.g. a training run's output folder, which keeps its checkpoints in a subfolder). Otherwise ``path``
    unchanged, so that reading it reports what is wrong there."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    below = [found for found in (latest_checkpoint(os.path.join(path, d)) for d in sorted(os.listdir(path))
                                 if os.path.isdir(os.path.join(path, d))) if found] if os.path.isdir(path) else []
    return below[0] if len(below) == 1 else path


def checkpoint_bytes(path: str) -> int:
    """Total size in bytes of the files of the checkpoint directory ``path`` (its data files and ``.metadata``).

    Raises:
        FileNotFoundError: ``path`` does not exist (NotADirectoryError: it is a file).
    """
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
