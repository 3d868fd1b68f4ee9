"""The training job with `--optimizer muon`, as whole runs of `python -m shardfusion.train` (gloo workers, a tiny
GPT-MoE: 4 experts at ep 2, so Muon's matrices lie whole on their owners in dense and expert buffers alike).

Reference: one muon run of 6 steps on 2 workers saving at steps 3 and 6. Checked against it: the first loss equals
an AdamW run's (the same weights and batch: the owner layout changes where a matrix lives, not its values); the
loss goes down; Muon holds the blocks' matrices (momentum_buffer in the checkpoint) and AdamW the rest (exp_avg);
--stop-after 3 and a second run resume exactly (the step-6 checkpoint equal bitwise); a resume of the step-3
checkpoint on 4 workers with inner degree 4 (other owners for every matrix) continues the run: its first step's
loss is the reference's to fp32 rounding and its last within the bf16 Newton-Schulz tolerance; a resume with
another --optimizer is refused before any worker starts, both ways. Muon at --cp 2 (the dense GPT) equals Muon at
--cp 1 loss for loss.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from harness import TRAIN_TIMEOUT_S, run_train, run_trains, train_usage_error
from shardfusion.checkpoint import read_all
from shardfusion.train.metrics import read_metrics

STEPS, HALF = 6, 3
FLAGS = ["--preset", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--steps", str(STEPS), "--warmup", "2",
         "--eval-every", str(HALF), "--eval-batches", "2", "--data-bytes", "300000", "--sample-tokens", "0",
         "--no-progress", "--experts", "4", "--ep", "2"]
MUON = [*FLAGS, "--optimizer", "muon", "--muon-lr", "0.02", "--save-every", str(HALF)]  # the tolerances' lr
# Resumed on 4 workers (inner 4, no outer): the first resumed step is a forward of the loaded weights on the same
# batch (sums in another order: fp32 rounding); the last differs by what the bf16 Newton-Schulz makes of gradients
# that differ in rounding (the lead's parity test: ~5e-4 on the weights after 3 steps). Measured on the two steps
# after the resumed one: 3.4e-5 and 2.3e-5 relative; with Muon's momentum dropped at the resume (its state started
# afresh, AdamW's loaded) 8.1e-4 and 7.2e-4.
FIRST_RTOL, LAST_RTOL = 1e-5, 2e-4


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The reference (Muon) and one AdamW step with its other flags, saved (--stop-after), started together
    (`harness.run_trains`): {"muon" | "adamw": (--out, result)}."""
    outs = {name: tmp_path_factory.mktemp(name) for name in ("muon", "adamw")}
    results = run_trains([*MUON, "--nproc", "2", "--out", str(outs["muon"])],
                         [*FLAGS, "--nproc", "2", "--stop-after", "1", "--out", str(outs["adamw"])])
    return {name: (outs[name], result) for name, result in zip(outs, results)}


@pytest.fixture(scope="module")
def reference(runs: dict) -> tuple[Path, str]:
    out, result = runs["muon"]
    return out, _ok(result)


@pytest.fixture(scope="module")
def adamw_run(runs: dict) -> Path:
    """One AdamW step with the reference's other flags, saved (--stop-after)."""
    out, result = runs["adamw"]
    _ok(result)
    return out


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 30)
def test_muon_learns_from_the_adamw_start(reference: tuple[Path, str], adamw_run: Path) -> None:
    out, stdout = reference
    adamw = adamw_run
    train, val = read_metrics(out / "metrics.jsonl")
    adamw_train, adamw_val = read_metrics(adamw / "metrics.jsonl")
    assert train[0]["loss"] == adamw_train[0]["loss"] and val[0]["val_loss"] == adamw_val[0]["val_loss"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.05 and val[-1]["val_loss"] < val[0]["val_loss"]
    for record in train:  # Muon's lr follows the same schedule as AdamW's, scaled to --muon-lr
        assert record["muon_lr"] == pytest.approx(0.02 * record["lr"] / 3e-3, rel=1e-12)
    assert "muon_lr" not in adamw_train[0]
    # Muon holds the blocks' matrices (dense and expert), AdamW the rest
    state = read_all(str(out / "checkpoints" / f"step-{STEPS}"))
    for name in ("blocks.0.attn.q.weight", "blocks.1.mlp.router.weight", "blocks.0.mlp.experts.3.fc.weight"):
        assert f"optim/{name}/momentum_buffer" in state and f"optim/{name}/exp_avg" not in state, name
    for name in ("wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "blocks.0.attn.q.bias", "ln_f.bias"):
        assert f"optim/{name}/exp_avg" in state and f"optim/{name}/momentum_buffer" not in state, name
    # the owners' balance: printed once at start, recorded in config.json and summary.json
    assert stdout.count("--optimizer muon: Muon (lr 0.02) on 18 matrices") == 1, stdout[-3000:]
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert config["optimizer"] == summary["optimizer"] == "muon"
    assert summary["owner_balance"] == config["owner_balance"] and set(config["owner_balance"]) == {"dense", "expert"}
    # per shard of the inner group: 2 dense shards; the experts' group is ep 2 of 2 ranks: one shard (no padding)
    assert [len(config["owner_balance"][kind]["cost"]) for kind in ("dense", "expert")] == [2, 1]
    for report in config["owner_balance"].values():
        assert 1.0 <= report["cost_imbalance"] <= 1.25
        assert 0.0 <= report["padding_fraction"] < 0.05


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S + 30)
def test_muon_resume_exact_and_at_another_world_size(reference: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = reference
    split, wider = tmp_path / "split", tmp_path / "wider"
    _ok(run_train([*MUON, "--nproc", "2", "--stop-after", str(HALF), "--out", str(split)]))
    shutil.copytree(split, wider)
    # the exact resume and, from the same step-3 checkpoint, the resume at another world size, started together
    second, third = (_ok(result) for result in run_trains(
        [*MUON, "--nproc", "2", "--out", str(split)],
        [*MUON, "--nproc", "4", "--fsdp-outer-degree", "1", "--out", str(wider)]))
    assert f"resuming at step {HALF} from" in second and "not an exact resume" not in second
    ours = read_all(str(split / "checkpoints" / f"step-{STEPS}"))
    theirs = read_all(str(out / "checkpoints" / f"step-{STEPS}"))
    assert ours.keys() == theirs.keys() and any(k.endswith("/momentum_buffer") for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    ref_train, _ = read_metrics(out / "metrics.jsonl")
    assert [r["loss"] for r in read_metrics(split / "metrics.jsonl")[0]] == [r["loss"] for r in ref_train]

    # 4 workers, inner 4: every owner layout differs from the saved run's (inner 2); the checkpoint reshards
    assert f"resuming at step {HALF} from" in third and "world size was 2, now 4" in third, third[-3000:]
    train, _ = read_metrics(wider / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[HALF]["loss"] == pytest.approx(ref_train[HALF]["loss"], rel=FIRST_RTOL)
    for mine, ref in zip(train[HALF + 1:], ref_train[HALF + 1:]):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=LAST_RTOL), mine["step"]
    assert train[-1]["loss"] != ref_train[-1]["loss"]  # it did run in another layout
    assert len(json.loads((wider / "config.json").read_text())["owner_balance"]["dense"]["cost"]) == 4


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 30)
def test_resume_with_another_optimizer_is_refused(reference: tuple[Path, str], adamw_run: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """Usage errors before any worker starts, in this process (`harness.train_usage_error`)."""
    out, _ = reference
    error = train_usage_error([*FLAGS, "--nproc", "2", "--optimizer", "adamw", "--out", str(out)], capsys)
    assert error.startswith("--optimizer adamw: the checkpoint in --out") and \
        "was written with --optimizer muon" in error and "resume with --optimizer muon" in error, error
    error = train_usage_error([*MUON, "--nproc", "2", "--out", str(adamw_run)], capsys)
    assert "--optimizer muon: the checkpoint" in error and "was written with --optimizer adamw" in error, error


def test_outer_degree_auto_counts_the_owner_layouts(tmp_path: Path) -> None:
    """--fsdp-outer-degree auto with muon (4 ranks as 2 nodes of 2, the dense tiny GPT): the cost model lays the
    Muon matrices out in owner layouts for each candidate (their padding, their own buffer per unit), so for the
    chosen degree its collectives per step and their bytes are the accounting's."""
    import dataclasses

    from shardfusion.models.gpt import GPT, PRESETS, Block
    from shardfusion.plan import Bandwidth, plan, unit_sizes
    from shardfusion.train.optim import muon_matrices

    out = tmp_path / "run"
    _ok(run_train(["--preset", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--steps", "1",
                   "--eval-every", "100", "--data-bytes", "300000", "--sample-tokens", "0", "--no-progress",
                   "--experts", "0", "--optimizer", "muon", "--nproc", "4", "--ranks-per-node", "2",
                   "--fsdp-outer-degree", "auto", "--out", str(out)]))
    outer = json.loads((out / "config.json").read_text())["fsdp_outer_degree"]
    with torch.device("meta"):
        model = GPT(dataclasses.replace(PRESETS["tiny"], n_experts=0, seq_len=32, fused_qkv=False))
    sizes = unit_sizes(model, units=(Block,), whole_params=muon_matrices(model, (Block,)))
    chosen = next(c for c in plan(sizes, world_size=4, local_world_size=2, bandwidth=Bandwidth(1e9, 1e8),
                                  max_memory_per_rank=2**40).candidates if c.outer == outer)
    comm = read_metrics(out / "metrics.jsonl")[0][0]["comm"]
    for op, category in (("all_gather", "inner_all_gather"), ("reduce_scatter", "inner_reduce_scatter"),
                         ("all_reduce", "replicate_all_reduce")):
        predicted, measured = chosen.traffic[op], comm[category]
        assert predicted.count == measured["count"], (outer, op, predicted, measured)
        assert predicted.within_bytes + predicted.across_bytes == pytest.approx(measured["wire_bytes"], rel=1e-9)


CP_RTOL = 5e-5
"""The losses of Muon at --cp 2 against --cp 1 after the first step: measured 5e-6 relative at most (4 steps)."""


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 30)
def test_context_parallel_equals_cp1(tmp_path: Path) -> None:
    """Muon at --cp 2 (4 ranks as inner 2 x cp 2: each rank a half of every sequence, Muon's matrices whole on
    their owners over the inner group) against Muon at --cp 1 (2 ranks, inner 2), the dense tiny GPT, the same
    batches: the gradients are the whole sequences' (summed over cp before Muon orthogonalizes them), so the first
    loss is the --cp 1 run's to fp32 rounding, the later ones and the last validation loss within what the bf16
    Newton-Schulz makes of gradients that differ in rounding (`CP_RTOL`). Not the parameters: the Newton-Schulz
    iteration lifts the gradients' smallest singular directions, rounding noise, so its matrices differ by ~3% of
    their norm after 4 steps between any two layouts (--nproc 2 against --nproc 1 alike), while the loss does not
    see it. The --cp 2 run keeps its blocks gathered from forward to backward by --reshard-policy auto (a budget
    that fits both; the --cp 1 run frees them after forward): the policy moves no value, so the comparison holds."""
    flags = [*FLAGS[:FLAGS.index("--experts")], "--experts", "0", "--optimizer", "muon", "--muon-lr", "0.02",
             "--steps", "4", "--eval-every", "4", "--save-every", "4", "--fsdp-outer-degree", "1"]
    cp, plain = tmp_path / "cp2", tmp_path / "cp1"
    results = run_trains([*flags, "--nproc", "4", "--cp", "2", "--reshard-policy", "auto", "--max-memory-per-rank",
                          "64GB", "--out", str(cp)], [*flags, "--nproc", "2", "--out", str(plain)])
    out = _ok(results[0])
    assert "x cp2 x" in out and "reshard policy auto: 2 of 2 units kept gathered" in out
    _ok(results[1])
    (train, val), (ref_train, ref_val) = read_metrics(cp / "metrics.jsonl"), read_metrics(plain / "metrics.jsonl")
    assert [r["step"] for r in train] == [r["step"] for r in ref_train] == [1, 2, 3, 4]
    assert train[0]["loss"] == pytest.approx(ref_train[0]["loss"], rel=FIRST_RTOL)
    for mine, ref in zip(train[1:], ref_train[1:]):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=CP_RTOL), mine["step"]
    assert val[-1]["val_loss"] == pytest.approx(ref_val[-1]["val_loss"], rel=CP_RTOL)
    state = read_all(str(cp / "checkpoints" / "step-4"))
    assert "optim/blocks.0.attn.q.weight/momentum_buffer" in state and "optim/wte.weight/exp_avg" in state
