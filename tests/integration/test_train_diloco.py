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
- DiLoCo over tensor-parallel replicas (--mp 2) equals DiLoCo at --mp 1 to fp32 rounding.
- DiLoCo of a Hugging Face model from --init-from: the first loss is transformers', the outer snapshot holds the
  folder's weights, the replicas are equal after the last outer step.
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


PAIR_FLAGS = [*FLAGS[:FLAGS.index("--nproc")], "--outer-sync", "diloco", "--outer-every", "2", "--steps", "4",
              "--eval-every", "4", "--save-every", "4"]
"""The pairs' runs: FLAGS' model and data (no --outer-comm-dtype), outer steps at 2 and 4, no layout yet."""


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_tensor_parallel_replicas_equal_mp1(tmp_path: Path) -> None:
    """DiLoCo over replicas that are tensor parallel inside (--mp 2: 4 ranks as outer 2 x mp 2) against DiLoCo at
    --mp 1 (2 ranks as outer 2 x inner 1), the same data-parallel ranks and batches: each mp rank's outer step runs
    on its pieces with the same mp rank of the other replica, so every step's loss and norm (before and after the
    outer steps), the final validation loss and the final parameters are the --mp 1 run's to fp32 rounding (the
    tensor-parallel sums run in another order)."""
    mp, plain = tmp_path / "mp2", tmp_path / "mp1"
    result = run_train([*PAIR_FLAGS, "--nproc", "4", "--fsdp-outer-degree", "2", "--mp", "2", "--out", str(mp)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x mp2;" in result.stdout, result.stdout[-3000:]
    result = run_train([*PAIR_FLAGS, "--nproc", "2", "--fsdp-outer-degree", "2", "--out", str(plain)])
    assert result.returncode == 0, result.stderr[-3000:]
    (train, val), (ref_train, ref_val) = _records(mp), _records(plain)
    assert [(r["step"], r["outer_synced"]) for r in train] == [(r["step"], r["outer_synced"]) for r in ref_train]
    assert [r["step"] for r in train if r["outer_synced"]] == [2, 4]
    for mine, ref in zip(train, ref_train):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5), mine["step"]
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), mine["step"]
    assert val[-1]["step"] == 4 and val[-1]["val_loss"] == pytest.approx(ref_val[-1]["val_loss"], rel=1e-5)
    ours, theirs = (read_all(str(out / "checkpoints" / "step-4")) for out in (mp, plain))
    names = [k for k in theirs if k.startswith("model/")]
    assert names and {k for k in ours if k.startswith("model/")} == set(names)
    for key in names:  # replica 0's full parameters after the last outer step
        assert torch.allclose(ours[key], theirs[key], rtol=0, atol=1e-5), key


def _rank_state(path: Path, what: str) -> list[list[torch.Tensor]]:
    """Each rank's DiLoCo tensors ``what`` (shard or snapshot) of a checkpoint: per rank, per flat buffer, (S,)."""
    state = read_all(str(path))
    ranks = sorted({int(k.split("/")[1]) for k in state if k.startswith("rank/")})
    return [[state[f"rank/{r}/diloco/{what}/{i}"] for i in range(len([k for k in state
             if k.startswith(f"rank/{r}/diloco/{what}/")]))] for r in ranks]


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S)
def test_from_a_pretrained_folder(tmp_path: Path) -> None:
    """DiLoCo (HSDP 2 x 2, outer steps at 3 and at the last step 4) of a Hugging Face model, started with
    --init-from a folder written by save_pretrained (a tiny Llama far from the job's initialization): the first loss
    is a single-process transformers forward of the folder's model on the batches of replica 0's 2 ranks (a DiLoCo
    run logs its first replica's loss); the outer snapshot is
    taken from the folder's weights, not from the initialization they replace (mid-period, at step 2, every rank's
    snapshot shards hold them: their squared sum is the replicas' count times the folder's, whatever the layout),
    while the replicas' own shards differ; after the last outer step each rank's shards equal those of its peer in
    the other replica, bitwise; the loss falls."""
    pytest.importorskip("transformers")
    from pretrained import first_loss, save_tiny_llama

    folder, out = tmp_path / "pretrained", tmp_path / "run"
    pretrained = save_tiny_llama(folder)
    flags = [*FLAGS[:FLAGS.index("--experts")], *FLAGS[FLAGS.index("--experts") + 2:FLAGS.index("--outer-every")],
             "--outer-every", "3", "--steps", "4", "--eval-every", "4", "--save-every", "2", "--init-from",
             str(folder), "--out", str(out)]
    result = run_train(flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"LlamaForCausalLM (from {folder})" in result.stdout and "outer2 x inner2" in result.stdout
    train, val = _records(out)
    assert [r["step"] for r in train if r["outer_synced"]] == [3, 4]
    batch, seq_len, data_bytes = (int(flags[flags.index(f) + 1]) for f in ("--batch-size", "--seq-len",
                                                                            "--data-bytes"))
    reference = first_loss(folder, world=4, batch_size=batch, seq_len=seq_len, data_bytes=data_bytes, ranks=2)
    assert train[0]["loss"] == pytest.approx(reference, rel=1e-5)  # replica 0's: data-parallel ranks 0 and 1
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.2, val
    weights = sum(float(p.detach().double().square().sum()) for p in pretrained.parameters())
    snapshot = _rank_state(out / "checkpoints" / "step-2", "snapshot")
    assert sum(float(s.double().square().sum()) for shards in snapshot for s in shards) == pytest.approx(
        2 * weights, rel=1e-6)
    mid, end = (_rank_state(out / "checkpoints" / f"step-{s}", "shard") for s in (2, 4))

    def peers(state: list[list[torch.Tensor]]) -> int:  # pairs of ranks whose shards are bitwise equal
        return sum(all(torch.equal(a, b) for a, b in zip(state[i], state[j]))
                   for i in range(len(state)) for j in range(i + 1, len(state)))

    assert len(end) == 4 and peers(mid) == 0 and peers(end) == 2
