"""Pipeline parallel in the training job (`--pp`; shardfusion/train/pipeline_config.py, job_pipeline.py), as whole
runs of `python -m shardfusion.train` (gloo workers), started together to share the start-up time:

- `pp2`: the default GPT-MoE (4 experts, ep 2 inside each stage, the head tied to the embedding: a copy on the last
  stage), tiny, on 4 workers = pp 2 x sharding 2,
  1F1B with the default 2 micro-batches (= --grad-accum 2: the pipeline micro-batches are the accumulation
  micro-batches), 4 steps; `pp1`: the same flags at --pp 1 on 2 workers (the same global batch of 2 x 2 sequences per
  micro-batch); `interleaved`: the dense GPT of 4 blocks, 2 stages per pp rank, 4 micro-batches, 3 steps.
- Checked: the --pp 2 run learns and equals the --pp 1 run (losses, aux loss, tokens per expert, gradient norm,
  validation loss through the forward-only pipeline); the summary's pipeline record (schedule, stages, micro-batches,
  the bubble in theory, per stage and per pp rank: parameters, memory, collectives per category, point-to-point
  bytes); every refused combination is a one-line usage error (exit status 2) before any worker starts.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO, clean_env
from shardfusion.accounting import CATEGORIES
from shardfusion.train.metrics import read_metrics
from shardfusion.train.pipeline_config import bubble_fraction

RUNS_TIMEOUT_S = 240  # the three runs together take about 30 s on 2 idle cores; generous for a loaded machine
BASE = ["--preset", "tiny", "--eval-every", "2", "--eval-batches", "4", "--data-bytes",
        "300000", "--sample-tokens", "16", "--no-progress"]
MOE = [*BASE, "--batch-size", "2", "--grad-accum", "2", "--steps", "4"]  # experts 4, ep 2: the defaults
RUNS = {
    "pp2": [*MOE, "--nproc", "4", "--pp", "2"],
    "pp1": [*MOE, "--nproc", "2"],
    "interleaved": [*BASE, "--experts", "0", "--n-layer", "4", "--batch-size", "4", "--steps", "3", "--nproc", "4",
                    "--pp", "2", "--pp-schedule", "interleaved"],
}


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardfusion.train", *args], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every run of `RUNS`, all at once: {name: (result, its --out)}."""
    root = tmp_path_factory.mktemp("pp")
    started = {name: (_start([*args, "--out", str(root / name)]), root / name) for name, args in RUNS.items()}
    t0 = time.perf_counter()
    done = {}
    for name, (process, out) in started.items():
        done[name] = (_finish(process, max(1.0, RUNS_TIMEOUT_S - (time.perf_counter() - t0))), out)
    return done


def _ok(runs: dict, name: str) -> tuple[list[dict], list[dict], dict, str]:
    """(train records, val records, summary, stdout) of a run that succeeded."""
    result, out = runs[name]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train, val = read_metrics(out / "metrics.jsonl")
    return train, val, json.loads((out / "summary.json").read_text()), result.stdout


@pytest.mark.timeout(RUNS_TIMEOUT_S + 30)
def test_pp2_learns_and_equals_pp1(runs: dict) -> None:
    train, val, summary, _ = _ok(runs, "pp2")
    train1, val1, summary1, _ = _ok(runs, "pp1")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in val] == [0, 2, 4]
    assert train[-1]["loss"] < train[0]["loss"] and val[-1]["val_loss"] < val[0]["val_loss"]  # it learns
    assert "pp2 x sharding2" in summary["layout"] and "ep2" in summary["layout"]
    assert summary["num_params"] == summary1["num_params"]
    # The same model, data and loss: the first step's loss equals the --pp 1 run's, and so does every later figure
    # (the sums run in another order); the validation loss runs through the forward-only pipeline.
    for mine, theirs in zip(train, train1, strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (mine["step"], key)
        assert mine["tokens_per_expert"] == theirs["tokens_per_expert"], mine["step"]
    for mine, theirs in zip(val, val1, strict=True):
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5), mine["step"]
    assert isinstance(summary["sample"], str)


@pytest.mark.timeout(RUNS_TIMEOUT_S + 30)
def test_pp2_summary_reports_the_pipeline(runs: dict) -> None:
    _, _, summary, stdout = _ok(runs, "pp2")
    config = json.loads((runs["pp2"][1] / "config.json").read_text())
    # the measured default between micro-batches with --pp > 1 (docs/pipeline-benchmark.md); --pp 1 keeps its own
    assert config["reshard_policy"] == "after_backward"
    assert json.loads((runs["pp1"][1] / "config.json").read_text())["reshard_policy"] == "after_forward"
    assert (config["pp"], config["pp_schedule"], config["stages_per_rank"], config["microbatches"]) == (2, "1f1b", 1,
                                                                                                       2)
    p = summary["pipeline"]
    assert (p["pp"], p["schedule"], p["stages"], p["stages_per_rank"], p["microbatches"]) == (2, "1f1b", 2, 1, 2)
    assert p["microbatch_sequences"] == 2  # grad-accum 2 x batch-size 2 rows per data-parallel rank, in 2
    assert p["bubble_fraction_theory"] == (2 - 1) / (2 + 2 - 1) == bubble_fraction("1f1b", 2, 1, 2)
    assert 0.0 <= p["bubble_fraction_measured"] < 1.0
    assert [(s["stage"], s["pp_rank"], s["blocks"]) for s in p["stage_table"]] == [(0, 0, [0]), (1, 1, [1])]
    # every expert counted; the last stage also holds its copy of the tied embedding (256 x d_model 64)
    assert sum(s["num_params"] for s in p["stage_table"]) == summary["num_params"] + 256 * 64
    # 2 sequences x 64 bytes x d_model 64 in fp32 per micro-batch: activations forward from stage 0, gradients back
    # from stage 1, one send per micro-batch each
    activation = 2 * 64 * 64 * 4
    for r, ranks in zip(p["per_pp_rank"], ([0, 1], [2, 3]), strict=True):
        assert r["ranks"] == ranks and r["stages"] == [r["pp_rank"]] and r["comm_rank"] == ranks[0]
        assert r["num_params"] == p["stage_table"][r["pp_rank"]]["num_params"]
        assert 0 < r["param_shard_bytes"] < r["optimizer_state_bytes"] and r["peak_memory_bytes"] > 0
        assert 0.0 <= r["bubble_fraction_measured"] < 1.0
        assert list(r["comm_per_step"]) == list(CATEGORIES)
        comm = r["comm_per_step"]
        # each stage's one block: gathered in forward and backward, reduce-scattered once per step, not per
        # micro-batch; its MoE all-to-alls over the stage's ep group (3 forward + 2 backward per micro-batch)
        assert comm["inner_reduce_scatter"]["count"] == 2 and comm["ep_all_to_all"]["count"] == 2 * (3 + 2)
        # the tied embedding's copy, kept whole on each end: one all-reduce over the stage's data-parallel ranks,
        # then one over the pipeline ends ("other"), besides the norm's ("other")
        assert comm["replicate_all_reduce"]["count"] == 1 and comm["other"]["count"] == 2
        assert r["p2p_per_step"] == {"count": 2, "wire_bytes": 2 * activation, "cross_node_bytes": 0}
    assert "pipeline         pp 2, 1f1b, 2 stages (1 per rank), 2 micro-batches" in stdout
    assert "pp rank 1 (stages 1)" in stdout


@pytest.mark.timeout(RUNS_TIMEOUT_S + 30)
def test_interleaved_two_stages_per_rank(runs: dict) -> None:
    train, val, summary, _ = _ok(runs, "interleaved")
    assert val[-1]["val_loss"] < val[0]["val_loss"] and train[-1]["loss"] < train[0]["loss"]
    p = summary["pipeline"]
    assert (p["schedule"], p["stages"], p["stages_per_rank"], p["microbatches"]) == ("interleaved", 4, 2, 4)
    assert p["bubble_fraction_theory"] == (2 - 1) / (2 * 4 + 2 - 1)  # (p - 1) / (v m + p - 1)
    assert [r["stages"] for r in p["per_pp_rank"]] == [[0, 2], [1, 3]]
    assert [s["blocks"] for s in p["stage_table"]] == [[0], [1], [2], [3]]
    # pp rank 0 sends stage 0's and stage 2's activations and stage 2's gradients: 3 sends per micro-batch;
    # pp rank 1 stage 1's activations and gradients and stage 3's gradients
    assert [r["p2p_per_step"]["count"] for r in p["per_pp_rank"]] == [3 * 4, 3 * 4]
    for r in p["per_pp_rank"]:  # units with parameters: 2 blocks and the first or last stage's root (embeddings
        # or head; a middle stage's root holds none): one reduce-scatter each per step; under the --pp default
        # --reshard-policy after_backward the stages keep their units gathered for the step: one all-gather each
        assert r["comm_per_step"]["inner_reduce_scatter"]["count"] == 3
        assert r["comm_per_step"]["inner_all_gather"]["count"] == 3


# (flags, the start of the one error line): each refused before any worker starts, with exit status 2
USAGE_ERRORS = {
    "microbatches-below-stages": (["--pp", "2", "--no-tie-embeddings", "--microbatches", "1"],
                                  "--microbatches 1 is fewer than the 2 pipeline stages (--pp 2 x 1 per rank)"),
    "layers": (["--pp", "2", "--no-tie-embeddings", "--n-layer", "3"],
               "--pp 2 x 1 stage(s) per rank = 2 stages must divide n_layer 3"),
    "interleaved-layers": (["--pp", "2", "--no-tie-embeddings", "--pp-schedule", "interleaved"],
                           "--pp 2 x 2 stage(s) per rank = 4 stages must divide n_layer 2"),
    "world": (["--pp", "2", "--no-tie-embeddings", "--nproc", "3"], "--pp 2 must divide the 3 ranks (--nproc 3)"),
    "rows": (["--pp", "2", "--no-tie-embeddings", "--nproc", "4", "--batch-size", "3", "--grad-accum", "2",
              "--microbatches", "4"], "--microbatches 4 must divide the 6 sequences each data-parallel rank takes"),
    "interleaved-rounds": (["--pp", "2", "--no-tie-embeddings", "--n-layer", "4", "--pp-schedule", "interleaved",
                            "--microbatches", "5"], "--microbatches 5 with --pp-schedule interleaved and --pp 2: "
                                                    "torch's Interleaved1F1B runs max(1, M // pp) = 2 rounds"),
    "mp": (["--pp", "2", "--no-tie-embeddings", "--mp", "2"], "--pp 2 with --mp 2: the job's pipeline stages are sharded by fully_shard"),
    "cp": (["--pp", "2", "--no-tie-embeddings", "--cp", "2"], "--pp 2 with --cp 2: the job's pipeline stages are sharded by fully_shard"),
    "hf": (["--pp", "2", "--hf-model", "llama"], "--pp 2 with --hf-model llama: the pipeline stages are the GPT's"),
    "muon": (["--pp", "2", "--no-tie-embeddings", "--optimizer", "muon"],
             "--pp 2 with --optimizer muon: Muon's whole matrices per stage"),
    "outer-auto": (["--pp", "2", "--no-tie-embeddings", "--fsdp-outer-degree", "auto"],
                   "--fsdp-outer-degree auto with --pp 2: the cost model does not plan pipeline stages"),
    "ep": (["--pp", "2", "--no-tie-embeddings", "--nproc", "4", "--ep", "4"],
           "--ep 4 with --fsdp-outer-degree 1 and --pp 2 does not fit 4 ranks (--nproc 4): sharding(2) % ep(4)"),
    "stages-per-rank": (["--pp", "2", "--no-tie-embeddings", "--stages-per-rank", "2"],
                        "--stages-per-rank 2 needs --pp-schedule interleaved"),
    "schedule": (["--pp", "2", "--no-tie-embeddings", "--pp-schedule", "zb"],
                 "--pp-schedule must be one of gpipe, 1f1b, interleaved, got 'zb'"),
    "microbatches-without-pp": (["--microbatches", "4"], "--microbatches 4 applies only to a pipeline"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_error(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """In this process: `main` exits with status 2 and one error line before it would launch a worker."""
    from shardfusion.train.job import main
    args, message = USAGE_ERRORS[case]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--steps", "1", "--data-bytes", "300000", "--out", str(out), *args])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardfusion-train: error: ")]
    assert len(errors) == 1 and errors[0].removeprefix("shardfusion-train: error: ").startswith(message), errors
    assert not out.exists()


@pytest.mark.timeout(90)
def test_usage_errors_as_commands(tmp_path: Path) -> None:
    """Two of them as real commands: exit status 2, one line, no worker launched, nothing written."""
    out = tmp_path / "run"
    started = {case: _start(["--preset", "tiny", "--steps", "1", "--data-bytes", "300000", "--out", str(out),
                             *USAGE_ERRORS[case][0]]) for case in ("layers", "world")}
    for case, process in started.items():
        result = _finish(process, 60)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        assert "Traceback" not in result.stderr and "elastic" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("shardfusion-train: error: ")]
        assert len(errors) == 1 and USAGE_ERRORS[case][1] in errors[0], errors
    assert not out.exists()


@pytest.mark.timeout(2 * RUNS_TIMEOUT_S + 60)
def test_pp_resume_is_exact(runs: dict, tmp_path: Path) -> None:
    """2 steps, a checkpoint, 2 more steps in a second run equal `pp2`'s 4 (checkpoints of the stage list)."""
    out = tmp_path / "run"
    first = _finish(_start([*RUNS["pp2"], "--stop-after", "2", "--out", str(out)]), RUNS_TIMEOUT_S)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = _finish(_start([*RUNS["pp2"], "--out", str(out)]), RUNS_TIMEOUT_S)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming at step 2" in second.stdout
    train, _ = read_metrics(out / "metrics.jsonl")
    whole, _, _, _ = _ok(runs, "pp2")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for mine, theirs in zip(train, whole, strict=True):
        assert math.isclose(mine["loss"], theirs["loss"], rel_tol=1e-6), mine["step"]
