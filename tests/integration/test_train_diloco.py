"""--outer-sync diloco in the training job: W=4 as HSDP 2 x 2, an outer step every 4 steps, the pseudo-gradients
sent in bf16 (--outer-comm-dtype bf16; every value of every dtype flag in every mode:
tests/unit/test_train_dtype_flags.py).

- A run stopped at step 6 (mid-period: outer steps at 4 and 8, and at the last step 10, so the run ends as one
  model) and resumed equals the uninterrupted run: every
  logged loss and gradient norm, and the final checkpoint bitwise. Replica 1 differs from replica 0 between outer
  steps, so this holds only if each rank's own parameters, AdamW moments, snapshot and momentum came back.
- Resumed at another world size (W=2), the per-rank state does not fit: every rank refuses.
- The inner steps send nothing across the replicas: the summary's per-step replicate all-reduce is the outer steps'
  bytes / steps.
- The flag refusals: tests/unit/test_outer_config.py (each is a usage error before launch, as every section's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import TRAIN_TIMEOUT_S, run_train
from shardfusion.checkpoint import read_all

FLAGS = ["--preset", "tiny", "--experts", "0", "--batch-size", "4", "--seq-len", "64", "--data-bytes", "300000",
         "--eval-batches", "4", "--warmup", "2", "--sample-tokens", "0", "--no-progress", "--nproc", "4",
         "--fsdp-outer-degree", "2", "--outer-sync", "diloco", "--outer-every", "4", "--steps", "10",
         "--eval-every", "5", "--save-every", "3", "--outer-comm-dtype", "bf16"]


def _train(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["outer_synced"])
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_resume_mid_period_is_exact(tmp_path: Path) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    result = run_train([*FLAGS, "--out", str(whole)])
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train([*FLAGS, "--stop-after", "6", "--out", str(parts)])
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train([*FLAGS, "--out", str(parts)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming at step 6" in result.stdout
    ours, theirs = _train(parts), _train(whole)
    assert [r[0] for r in ours] == list(range(1, 11)) and ours == theirs
    assert [r[0] for r in theirs if r[3]] == [4, 8, 10]  # the outer steps, and the last step's: one model at the end
    a, b = read_all(str(whole / "checkpoints" / "step-10")), read_all(str(parts / "checkpoints" / "step-10"))
    assert a.keys() == b.keys() and any("/diloco/snapshot/" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # at another world size the per-rank state cannot be put back: every rank refuses (no silent divergence)
    nproc2 = [*FLAGS, "--out", str(parts), "--steps", "12"]
    nproc2[nproc2.index("--nproc") + 1] = "2"
    result = run_train(nproc2)
    assert result.returncode != 0
    assert "resume a DiLoCo run with the layout and world size it was saved with" in result.stdout + result.stderr
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["outer_sync"]["outer_steps"] == [3] and summary["outer_sync"]["every"] == 4
    assert summary["outer_sync"]["comm_dtype"] == "bf16"
    # the outer steps' all-reduces only: 2 outer steps x one per trainable flat buffer, over 10 steps
    assert 0 < summary["comm"]["per_step"]["replicate_all_reduce"]["count"] < 1
