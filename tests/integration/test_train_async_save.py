"""Checkpoints written in the background (`--async-save`), as whole runs of `python -m shardfusion.train` (2 gloo
workers).

Killed during a write: the tiny GPT-MoE (ep 2, dropout on) saves every 2 of 6 steps with --async-save and a test
delay before each background write (`SHARDFUSION_TEST_SAVE_DELAY_S`); once step 2 is published and the write of step
4 has begun (its tmp-step-4 folder exists), the test SIGKILLs the launcher's whole process group. The checkpoint
being written is never published: the latest stays step 2. The same command again (no delay) resumes at step 2 and
must end bitwise equal to the synchronous run of the same flags that was never interrupted: its step-6 checkpoint
key by key, and the metrics of steps 3 to 6 (an exact resume from step 2 equals that run:
tests/integration/test_train_resume.py).

Other modes: a Llama from a pretrained folder (--hf-model, --init-from) under DiLoCo on HSDP 2 x 1 with
--async-save writes checkpoints bitwise equal to the same run without it, DiLoCo's per-rank state included, and
logs the same metrics.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import REPO, TRAIN_TIMEOUT_S, clean_env, run_train, run_trains, start_train
from shardfusion.checkpoint import latest_checkpoint, read_all
from shardfusion.train.metrics import read_metrics

STEPS, SAVE_EVERY, DELAY_S = 6, 2, "3"
FLAGS = ["--preset", "tiny", "--nproc", "2", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--warmup", "2", "--eval-every", str(STEPS), "--eval-batches", "2", "--batch-size", "4", "--seq-len", "32",
         "--dropout", "0.1", "--data-bytes", "300000", "--sample-tokens", "0", "--no-progress"]
KILL_TIMEOUT_S = 120


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _same_checkpoint(ours: Path, theirs: Path) -> None:
    mine, ref = read_all(str(ours)), read_all(str(theirs))
    assert mine.keys() == ref.keys()
    for key in mine:
        assert torch.equal(mine[key], ref[key]), (ours, key)


def _same_metrics(ours: Path, theirs: Path, after: int = 0) -> None:
    (train, val), (ref_train, ref_val) = read_metrics(ours / "metrics.jsonl"), read_metrics(theirs / "metrics.jsonl")
    assert [r["step"] for r in train] == [r["step"] for r in ref_train] == list(range(1, len(ref_train) + 1))
    for mine, ref in zip(train[after:], ref_train[after:]):
        assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"]), mine
    assert [(r["step"], r["val_loss"]) for r in val] == [(r["step"], r["val_loss"]) for r in ref_val]


def _run_until(command: list[str], env: dict, log: Path, ready) -> tuple[bool, int]:
    """Start ``command`` in a session of its own; once ``ready()`` holds, SIGKILL its whole process group. Returns
    (whether it was killed, its return code)."""
    with log.open("w") as sink, subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                                 start_new_session=True) as process:
        deadline, killed = time.monotonic() + KILL_TIMEOUT_S, False
        try:
            while process.poll() is None and time.monotonic() < deadline:
                if ready():
                    os.killpg(process.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.02)
        finally:
            if process.poll() is None and not killed:
                os.killpg(process.pid, signal.SIGKILL)
        return killed, process.wait()


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S + 60)
def test_killed_during_a_background_write_resumes_from_the_complete_checkpoint(tmp_path: Path) -> None:
    reference, out = tmp_path / "reference", tmp_path / "run"
    # the uninterrupted run goes on beside the killed one (the kill waits on a write held for DELAY_S, not on speed)
    with start_train([*FLAGS, "--out", str(reference)]) as uninterrupted:
        root = out / "checkpoints"

        def writing_step_4() -> bool:  # step 2 published, the write of step 4 begun (its folder made by DCP's plan)
            return (latest_checkpoint(str(root)) or "").endswith("step-2") and (root / "tmp-step-4").is_dir()

        command = [sys.executable, "-m", "shardfusion.train", *FLAGS, "--async-save", "--out", str(out)]
        killed, code = _run_until(command, {**clean_env(), "SHARDFUSION_TEST_SAVE_DELAY_S": DELAY_S},
                                  tmp_path / "killed.log", writing_step_4)
        text = (tmp_path / "killed.log").read_text()
        assert killed, f"the run ended (status {code}) before the write of step 4 began:\n{text[-3000:]}"
        assert "step     2  saving" in text and "in the background" in text, text[-3000:]
        assert not (root / "tmp-step-4" / ".metadata").exists() and not (root / "step-4").exists()
        assert latest_checkpoint(str(root)) == str(root / "step-2")  # never the checkpoint being written
        resumed = _ok(run_train([*FLAGS, "--async-save", "--out", str(out)]))
        assert f"resuming at step 2 from {root / 'step-2'}" in resumed and "not an exact resume" not in resumed, \
            resumed[-3000:]
        assert "step     6  published" in resumed, resumed[-3000:]
        _ok(uninterrupted.finish())
    _same_checkpoint(root / f"step-{STEPS}", reference / "checkpoints" / f"step-{STEPS}")
    _same_metrics(out, reference, after=2)
    published = sorted(p.name for p in root.iterdir())
    assert published == ["latest", "step-2", "step-4", "step-6"], published  # tmp-step-4 of the killed run: gone


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 60)
def test_async_save_equals_sync_save_under_diloco_from_a_pretrained_folder(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from pretrained import save_tiny_llama

    folder = tmp_path / "pretrained"
    save_tiny_llama(folder)
    flags = ["--hf-model", "llama", "--init-from", str(folder), "--nproc", "2", "--fsdp-outer-degree", "2",
             "--outer-sync", "diloco", "--outer-every", "3", "--steps", "4", "--save-every", "2", "--eval-every", "4",
             "--eval-batches", "2", "--batch-size", "2", "--seq-len", "32", "--warmup", "1", "--data-bytes", "300000",
             "--sample-tokens", "0", "--no-progress"]
    sync, background = tmp_path / "sync", tmp_path / "async"
    results = run_trains([*flags, "--out", str(sync)], [*flags, "--async-save", "--out", str(background)])
    _ok(results[0])
    stdout = _ok(results[1])
    assert "LlamaForCausalLM" in stdout and "outer2 x inner1" in stdout, stdout[-3000:]
    assert "step     2  saving" in stdout and "step     4  published" in stdout, stdout[-3000:]
    for step in (2, 4):
        path = background / "checkpoints" / f"step-{step}"
        assert any(k.startswith("rank/1/diloco/") for k in read_all(str(path))), "no DiLoCo state saved"
        _same_checkpoint(path, sync / "checkpoints" / f"step-{step}")
    _same_metrics(background, sync)
