"""One data order for every layout, as whole runs of `python -m shardfusion.train` (gloo workers, the tiny dense
GPT, fp32, global batch 8, 4 steps, a corpus file of the repository's sources, so that no worker walks the stdlib).

Reference: run A in one worker (all 8 sequences, --global-batch-size 8). Run B: 4 ranks (HSDP outer 2 x inner 2,
given as --batch-size 2) with --stop-after 2, then the same command at 2 ranks (plain FSDP) without a batch flag,
which resumes from step 2 and keeps the saved global batch size (4 sequences per rank). Step 1's loss (the step-0
forward, before any update) of A and B agree to fp32 rounding: the same 8 sequences and the same initial weights,
only the mean is taken over 4 x 2 instead of 1 x 8 (tolerance 2e-6 relative; measured: at most 1 ulp, 9e-8).
Steps 2-4 agree within 1e-4 relative: B's first updates sum the gradients in another order, so its parameters differ
from A's by rounding, which AdamW carries on (measured: at most 1 ulp). With the per-rank data order of older runs
(`DATA_ORDER_PER_RANK`) the sequences differ with the world size, and so do the losses, by 2e-3 to 2e-2 relative
(measured; this test then fails). The sampler itself: tests/unit/test_data.py; the batch flags:
tests/unit/test_train_config.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness import REPO, TRAIN_TIMEOUT_S, run_train, run_trains
from shardfusion.train.metrics import read_metrics

STEPS, STOP = 4, 2
CORPUS_BYTES = 200_000
COMMON = ["--preset", "tiny", "--experts", "0", "--seq-len", "32", "--steps", str(STEPS), "--warmup", "1",
          "--eval-every", str(STEPS), "--eval-batches", "4", "--sample-tokens", "0", "--no-progress"]
FIRST_STEP_RTOL = 2e-6
"""Step 1's loss across layouts: fp32 rounding of the mean over ranks (the forward is the same per sequence)."""
LATER_RTOL = 1e-4
"""Steps 2-4: parameters updated from gradients summed in another order (measured differences below 1e-6)."""


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _losses(out: Path) -> list[float]:
    train, _ = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    return [r["loss"] for r in train]


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S + 60)
def test_layouts_and_a_resume_at_another_world_size_see_one_data_order(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    sources = sorted((REPO / "shardfusion").rglob("*.py"))
    corpus.write_bytes(b"".join(p.read_bytes() for p in sources)[:CORPUS_BYTES])
    assert corpus.stat().st_size == CORPUS_BYTES
    common = [*COMMON, "--data", str(corpus)]
    a, b = tmp_path / "a", tmp_path / "b"
    results = run_trains([*common, "--nproc", "1", "--global-batch-size", "8", "--out", str(a)],
                         [*common, "--nproc", "4", "--batch-size", "2", "--stop-after", str(STOP), "--out", str(b)])
    _ok(results[0])
    first = _ok(results[1])
    resumed = _ok(run_train([*common, "--nproc", "2", "--out", str(b)]))

    config_a = json.loads((a / "config.json").read_text())
    config_b = json.loads((b / "config.json").read_text())
    config_b1 = json.loads((b / f"config.step-{STOP}.json").read_text())  # B's first run, kept by the resume
    assert "outer2 x inner2" in config_b1["layout"] and config_b1["world_size"] == 4
    assert config_a["world_size"] == 1 and (config_a["global_batch_size"], config_a["batch_size"]) == (8, 8)
    assert config_b["world_size"] == 2 and "outer1 x inner2" in config_b["layout"], config_b["layout"]
    # B's resumed run kept the saved G, with 4 per rank at 2 ranks
    assert (config_b["global_batch_size"], config_b["batch_size"], config_b["data_order"]) == (8, 4, 2)
    assert config_a["data_order"] == 2
    assert (config_b1["global_batch_size"], config_b1["batch_size"], config_b1["data_order"]) == (8, 2, 2)
    assert "resuming" not in first
    assert f"resuming at step {STOP}" in resumed and "world size was 4, now 2: sums in another order" in resumed
    assert "batch-size was" not in resumed

    ours, reference = _losses(b), _losses(a)
    assert ours[0] == pytest.approx(reference[0], rel=FIRST_STEP_RTOL, abs=0)
    assert ours[1:] == pytest.approx(reference[1:], rel=LATER_RTOL, abs=0)


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 60)
def test_tensor_and_context_parallel_runs_see_the_same_first_step(tmp_path: Path) -> None:
    """`--mp 2` and `--cp 2` at 4 ranks (data-parallel world 2: 4 sequences per rank, cp ranks half of each; HSDP
    outer 2 by default, so each is also its mode's pair with HSDP in the compatibility table) train the same global
    batch from the same weights as the default layout: step 1's loss and gradient norm agree to fp32 rounding (the
    row-wise all-reduces and the context ranks' sums add in another order)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in sorted((REPO / "shardfusion").rglob("*.py")))[:CORPUS_BYTES])
    common = [*COMMON, "--data", str(corpus), "--nproc", "4", "--global-batch-size", "8", "--steps", "1"]
    firsts = {}
    runs = {"default": [], "mp2": ["--mp", "2"], "cp2": ["--cp", "2"]}
    results = run_trains(*([*common, *flags, "--out", str(tmp_path / name)] for name, flags in runs.items()))
    for name, result in zip(runs, results):
        out = tmp_path / name
        _ok(result)
        train, _ = read_metrics(out / "metrics.jsonl")
        firsts[name] = (train[0]["loss"], train[0]["grad_norm"])
        layout = json.loads((out / "config.json").read_text())["layout"]
        assert (name == "default") or f"{name[:2]}2" in layout, layout
        assert "outer2 x inner" in layout, layout  # HSDP at 4 ranks by default, under --mp 2 and --cp 2 too
    for name in ("mp2", "cp2"):
        assert firsts[name][0] == pytest.approx(firsts["default"][0], rel=FIRST_STEP_RTOL, abs=0), firsts
        assert firsts[name][1] == pytest.approx(firsts["default"][1], rel=1e-5, abs=0), firsts
