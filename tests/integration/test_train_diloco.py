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
- Pipeline stages (--pp 2, one outer step per stage's replicas): the same per-step losses, gradient norms,
  validation losses and outer-step schedule as the --pp 1 run with the same replicas and global batch, also across
  a mid-period resume; streaming fragments per stage.
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


PIPELINE = ["--preset", "tiny", "--experts", "0", "--batch-size", "4", "--grad-accum", "2", "--seq-len", "64",
            "--data-bytes", "300000", "--eval-batches", "2", "--eval-every", "3", "--warmup", "2", "--sample-tokens",
            "0", "--no-progress", "--fsdp-outer-degree", "2", "--outer-sync", "diloco", "--outer-every", "2",
            "--steps", "6"]
"""DiLoCo over pipeline stages: --pp 2 on 4 ranks (each stage: outer 2 x inner 1, the tied embedding's copy kept
whole on the last stage) against the same run at --pp 1 on 2 ranks (outer 2 x inner 1): the same 2 replicas and
global batch."""


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_pipeline_stages_match_the_unpipelined_run_and_resume_mid_period(tmp_path: Path) -> None:
    """Each stage's replicas take their outer steps at the same steps as the --pp 1 run's (2, 4 and the last, 6);
    rank 0 logs its replica's loss and clip norm, equal to the --pp 1 run's at the pp parity tests' tolerance
    (tests/integration/test_train_pp.py). The --pp 2 run is stopped at step 3 (mid-period) and resumed: steps 5 and
    6 and the last validation loss (one model after the last outer step) come out right only if every rank's own
    stage state (shards, AdamW moments, snapshot, momentum) came back; replica 1's differs from the saved copy."""
    pp1, pp2 = tmp_path / "pp1", tmp_path / "pp2"
    result = run_train([*PIPELINE, "--nproc", "2", "--out", str(pp1)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = run_train([*PIPELINE, "--nproc", "4", "--pp", "2", "--stop-after", "3", "--out", str(pp2)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = run_train([*PIPELINE, "--nproc", "4", "--pp", "2", "--out", str(pp2)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming at step 3" in result.stdout and "pp2 x sharding2 (outer2 x inner1)" in result.stdout
    ours, theirs = _train(pp2), _train(pp1)
    assert [r[0] for r in ours] == list(range(1, 7)) == [r[0] for r in theirs]
    assert [(r[0], r[3]) for r in ours] == [(r[0], r[3]) for r in theirs]  # the outer-step schedule
    assert [r[0] for r in ours if r[3]] == [2, 4, 6]
    for mine, ref in zip(ours, theirs):
        assert mine[1] == pytest.approx(ref[1], rel=1e-5, abs=1e-6), mine
        assert mine[2] == pytest.approx(ref[2], rel=1e-5, abs=1e-6), mine
    val = [[r["val_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r] for out in (pp2, pp1)]
    assert len(val[0]) == len(val[1]) == 3 and val[0] == pytest.approx(val[1], rel=1e-5)
    summary = json.loads((pp2 / "summary.json").read_text())
    assert summary["outer_sync"]["outer_steps"] == [3] and summary["pipeline"]["stages"] == 2


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_pipeline_stages_stream_their_fragments(tmp_path: Path) -> None:
    """--outer-fragments 2 at --pp 2, H = 4: each stage's buffers are cut into 2 fragments, fragment 1 of every stage
    synchronised at step 2 and 6, fragment 0 at step 4 and (`finish`) at the last step 6, as the rule of
    `shardfusion.diloco` gives at --pp 1. The per-rank shards in the checkpoints (rank r: pp index r // 2, replica
    r % 2; inner 1, so a shard is the whole stage) differ between the replicas of a stage at step 3 and are bitwise
    equal at the end; the tied embedding's two copies (the first stage's, the last stage's kept whole) stay equal
    within a replica throughout, and at the end equal the saved embedding."""
    flags = [*PIPELINE, "--nproc", "4", "--pp", "2", "--outer-every", "4", "--outer-fragments", "2",
             "--save-every", "3", "--out", str(tmp_path)]
    result = run_train(flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r[3] for r in _train(tmp_path)] == [[], [1], [], [0], [], [0, 1]]
    wte = 256 * 64  # the tied embedding, kept whole: shard 0 of the first stage, shard 1 of the last
    for step, one_model in ((3, False), (6, True)):
        saved = read_all(str(tmp_path / "checkpoints" / f"step-{step}"))
        shard = {(r, i): saved[f"rank/{r}/diloco/shard/{i}"] for r in range(4) for i in range(3)}
        for stage_ranks in ((0, 1), (2, 3)):
            same = [torch.equal(shard[stage_ranks[0], i], shard[stage_ranks[1], i]) for i in range(3)]
            assert same == [one_model] * 3, (step, stage_ranks, same)
        assert shard[0, 0].numel() == shard[2, 1].numel() == wte
        assert torch.equal(shard[0, 0], shard[2, 1]) and torch.equal(shard[1, 0], shard[3, 1]), step
    assert torch.equal(shard[0, 0], saved["model/wte.weight"].flatten())
