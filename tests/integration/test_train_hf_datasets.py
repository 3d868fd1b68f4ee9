"""Hugging Face `datasets` as the training job's data, as whole runs of `python -m shardfusion.train` (gloo workers,
the tiny dense GPT on bytes, fp32, 2 ranks, 3 steps). The dataset is built here with `datasets` and saved with
`DatasetDict.save_to_disk`, never downloaded.

Reference: the same texts written as JSON Lines. Both go through the token cache with the byte tokenizer (each
document's bytes, then NUL), so the runs read the same token stream and draw the same batches: every training and
validation loss is the same, bitwise (one command, one layout, the same arithmetic). A DatasetDict without --split,
and a save_to_disk folder without the datasets package, are one-line usage errors before any worker starts. The
reader, the cache key and the flag checks one by one: tests/unit/test_documents.py, test_token_cache.py,
test_data_config.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

hf = pytest.importorskip("datasets")

from harness import TRAIN_TIMEOUT_S, run_trains, train_usage_error  # noqa: E402
from shardfusion.train.metrics import read_metrics  # noqa: E402

STEPS = 3
COMMON = ["--preset", "tiny", "--experts", "0", "--seq-len", "32", "--steps", str(STEPS), "--warmup", "1",
          "--global-batch-size", "4", "--eval-every", str(STEPS), "--eval-batches", "2", "--sample-tokens", "0",
          "--data-bytes", "300000", "--nproc", "2", "--no-progress"]


def _documents(n: int) -> list[str]:
    """n short, varied, deterministic documents (about 60 bytes each)."""
    words = ("cats", "hats", "boats", "trees", "rivers", "clocks", "lamps", "roads")
    return [f"Note {i}: {words[i % 8]} by the {words[(i * 5 + 3) % 8]}, {i * 7 % 101} of them.\n" for i in range(n)]


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _losses(out: Path) -> tuple[list[float], list[float]]:
    train, val = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    return [r["loss"] for r in train], [r["val_loss"] for r in val]


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 60)
def test_a_saved_dataset_trains_as_its_json_lines(tmp_path: Path) -> None:
    docs = _documents(600)
    root = tmp_path / "corpus"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"id": list(range(len(docs))), "text": docs}),
                    "test": hf.Dataset.from_dict({"text": docs[:5]})}).save_to_disk(str(root))
    lines = tmp_path / "corpus.jsonl"
    lines.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    ours, reference = tmp_path / "ours", tmp_path / "reference"
    for result in run_trains([*COMMON, "--data", str(root), "--split", "train", "--out", str(ours)],
                             [*COMMON, "--data", str(lines), "--out", str(reference)]):
        _ok(result)

    assert _losses(ours) == _losses(reference)
    config = json.loads((ours / "config.json").read_text())
    assert (config["data"], config["split"], config["world_size"]) == (str(root), "train", 2)
    entries = [json.loads(p.read_text()) for p in (tmp_path / ".shardfusion-tokens").glob("*.json")]
    assert sorted(e["files"][0] for e in entries) == sorted([str(lines.resolve()), str((root / "train").resolve())])
    assert {(e["documents"], e["tokens"]) for e in entries} == {(len(docs), sum(len(d) + 1 for d in docs))}


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_saved_datasets_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "corpus"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": _documents(10)}),
                    "test": hf.Dataset.from_dict({"text": _documents(3)})}).save_to_disk(str(root))
    out = tmp_path / "out"
    line = train_usage_error([*COMMON, "--data", str(root), "--out", str(out)], capsys)
    assert line == f"--data {root} is a DatasetDict with the splits train, test: choose one with --split", line
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the package were not installed
    line = train_usage_error([*COMMON, "--data", str(root), "--split", "train", "--out", str(out)], capsys)
    assert line.startswith(f"--data {root}: a folder written by Hugging Face datasets' save_to_disk") and \
        line.endswith("needs the datasets package (pip install 'shardfusion[data]')"), line
    assert not out.exists()
