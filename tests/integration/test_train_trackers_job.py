"""The training job's experiment trackers as a whole run of `python -m shardfusion.train --log ...` (tiny preset, 2
ranks): each tracker holds the job's losses and evaluations equal to metrics.jsonl's, once per step across a stop
and a resume, and the job's outputs stay as they were (the trackers only add)."""

import os
from pathlib import Path

import pytest

from harness import TRAIN_TIMEOUT_S, run_train
from shardfusion.train.metrics import read_metrics
from trackers_readback import tensorboard_scalars, trackio_logs, wandb_runs

STEPS, STOP = 6, 3
FLAGS = ["--preset", "tiny", "--nproc", "2", "--steps", str(STEPS), "--eval-every", "3", "--eval-batches", "2",
         "--batch-size", "2", "--seq-len", "32", "--warmup", "1", "--data-bytes", "300000", "--sample-tokens", "0",
         "--no-progress", "--log", "tensorboard,wandb,trackio"]


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 30)
def test_trackers_hold_the_jobs_losses_across_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_PROJECT", "TRACKIO_DIR"):
        monkeypatch.delenv(name, raising=False)  # the job's defaults: offline W&B, trackio under OUT
    _ok(run_train([*FLAGS, "--stop-after", str(STOP), "--out", str(tmp_path)]))
    stdout = _ok(run_train([*FLAGS, "--out", str(tmp_path)]))
    assert f"resuming at step {STOP}" in stdout and "trackio run" in stdout
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and [r["step"] for r in val] == [0, 3, 6]
    assert train[STOP]["resumed_from_step"] == STOP

    scalars = tensorboard_scalars(tmp_path / "tensorboard")  # float32
    assert scalars["loss"] == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in train}
    assert scalars["val_loss"] == {r["step"]: pytest.approx(r["val_loss"], rel=1e-6) for r in val}
    assert set(scalars["comm/inner_all_gather/wire_bytes"]) == set(range(1, STEPS + 1))

    runs = wandb_runs(tmp_path)  # the first run's folder, then the resumed one's: the same run id
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"] and runs[0]["config"]["steps"] == STEPS
    logged = {row["step"]: row for run in runs for row in run["history"]}
    assert sorted(logged) == list(range(0, STEPS + 1))
    assert {r["step"]: logged[r["step"]]["loss"] for r in train} == {r["step"]: r["loss"] for r in train}
    assert {r["step"]: logged[r["step"]]["val_loss"] for r in val} == {r["step"]: r["val_loss"] for r in val}

    entry, rows, config = trackio_logs(tmp_path)
    assert entry["dir"] == os.path.realpath(tmp_path / "trackio") and config["steps"] == STEPS
    assert {r["step"]: r["loss"] for r in rows if "loss" in r} == {r["step"]: r["loss"] for r in train}
    assert [r["step"] for r in rows if "loss_plot" in r] == [STOP, STEPS]  # each run's plot
