"""Read back what the experiment trackers of `shardfusion.train.trackers` wrote, each with its own package's reader:
TensorBoard's `EventAccumulator`, W&B's protobuf records (`wandb.proto.wandb_internal_pb2.Record`) of an offline
run's .wandb file, trackio's `SQLiteStorage`. Shared by the unit tests (tests/unit/test_train_trackers.py) and the
job's test (tests/integration/test_train_trackers_job.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

WANDB_BLOCK = 32768
"""A .wandb file is a LevelDB-style log: 32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length,
type), after a 7-byte file header (":W&B", a magic number, the version)."""
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the event files of ``folder`` (purged steps left out, as
    TensorBoard shows them); each step once (`EventAccumulator` keeps the last value written at a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), (tag, steps)  # no step shown twice
        out[tag] = {e.step: e.value for e in events}
    return out


def tensorboard_accumulator(folder: Path) -> Any:
    """A loaded `EventAccumulator` of ``folder`` (images, text and hparams too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def _wandb_chunks(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", data[:7]
    i, pending = CHUNK_HEADER, b""
    while i + CHUNK_HEADER <= len(data):
        left = WANDB_BLOCK - i % WANDB_BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a header is padding
            i += left
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + CHUNK_HEADER])
        chunk = data[i + CHUNK_HEADER:i + CHUNK_HEADER + length]
        i += CHUNK_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def wandb_records(path: Path) -> list[tuple[str, Any]]:
    """(record type, record) of each record of the .wandb file ``path``, in order."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in _wandb_chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        out.append((kind, getattr(record, kind)))
    return out


def wandb_runs(out: Path) -> list[dict[str, Any]]:
    """Each offline run folder in OUT/wandb, oldest first: {"id", "config" (the run record's, decoded),
    "history" (each row's items, ``_step`` as "step", W&B's own ``_*`` keys left out; a media item's fields as
    ``key/field``)}."""
    runs = []
    for folder in sorted((out / "wandb").glob("offline-run-*")):
        (file,) = folder.glob("run-*.wandb")
        records = wandb_records(file)
        run = next(r for kind, r in records if kind == "run")
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        history = []
        for kind, r in records:
            if kind == "history":
                row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.item}
                history.append({"step": row["_step"], **{k: v for k, v in row.items() if not k.startswith("_")}})
        runs.append({"id": run.run_id, "config": config, "history": history, "folder": folder})
    return runs


def trackio_logs(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(OUT/trackers.json's trackio entry, the run's logged rows in order, its config) from trackio's own store, in
    the folder the entry names (trackio fixes its folder at import: pointed there for the reading)."""
    from trackio import sqlite_storage

    entry = json.loads((out / "trackers.json").read_text())["trackio"]
    folder = sqlite_storage.TRACKIO_DIR
    sqlite_storage.TRACKIO_DIR = Path(entry["dir"])
    try:
        storage = sqlite_storage.SQLiteStorage
        rows = storage.get_logs(entry["project"], entry["name"])
        return entry, rows, storage.get_run_config(entry["project"], entry["name"])
    finally:
        sqlite_storage.TRACKIO_DIR = folder
