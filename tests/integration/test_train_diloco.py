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
- DiLoCo over tensor-parallel replicas (--mp 2) equals DiLoCo at --mp 1 to fp32 rounding.
- DiLoCo of a Hugging Face model from --init-from: the first loss is transformers', the outer snapshot holds the
  folder's weights, the replicas are equal after the last outer step.
- The flag refusals: tests/unit/test_outer_config.py (each is a usage error before launch, as every section's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness import TRAIN_TIMEOUT_S, run_train, run_trains
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
    whole, parts, other = tmp_path / "whole", tmp_path / "parts", tmp_path / "other-world-size"
    for result in run_trains([*FLAGS, "--out", str(whole)], [*FLAGS, "--stop-after", "6", "--out", str(parts)]):
        assert result.returncode == 0, result.stderr[-3000:]
    # the uninterrupted run's last checkpoint (as the resumed run's, below), resumed at another world size
    shutil.copytree(whole / "checkpoints" / "step-10", other / "checkpoints" / "step-10")
    nproc2 = [*FLAGS, "--out", str(other), "--steps", "12"]
    nproc2[nproc2.index("--nproc") + 1] = "2"
    result, refused = run_trains([*FLAGS, "--out", str(parts)], nproc2)
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
    assert refused.returncode != 0
    assert "resume a DiLoCo run with the layout and world size it was saved with" in refused.stdout + refused.stderr
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
    for result in run_trains([*PIPELINE, "--nproc", "2", "--out", str(pp1)],
                             [*PIPELINE, "--nproc", "4", "--pp", "2", "--stop-after", "3", "--out", str(pp2)]):
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
    result, reference = run_trains(
        [*PAIR_FLAGS, "--nproc", "4", "--fsdp-outer-degree", "2", "--mp", "2", "--out", str(mp)],
        [*PAIR_FLAGS, "--nproc", "2", "--fsdp-outer-degree", "2", "--out", str(plain)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x mp2;" in result.stdout, result.stdout[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
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
