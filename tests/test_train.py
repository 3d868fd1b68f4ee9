"""The training entry point: its config and CLI in-process, and whole runs as subprocesses (4 gloo workers)."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardfusion.metrics import TRAIN_KEYS, VAL_KEYS, read_metrics
from shardfusion.train import no_decay
from shardfusion.train_config import TrainConfig, build_parser, lr_at, parse_args

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 150
TINY_RUN = ["--preset", "tiny", "--batch-size", "4", "--eval-every", "2", "--eval-batches", "4",
            "--data-bytes", "300000", "--sample-tokens", "16", "--no-progress"]


def run(args: list[str], *, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = (launcher or [sys.executable, "-m"]) + ["shardfusion.train", *args]
    # A session of its own, so that a hung run's workers are killed with their launcher.
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{command} ran over {RUN_TIMEOUT_S} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def check_outputs(out: Path, steps: int, eval_steps: list[int]) -> dict:
    train, val = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for record in train:
        assert set(TRAIN_KEYS) <= set(record)
        assert all(math.isfinite(record[k]) for k in TRAIN_KEYS)
    assert [r["step"] for r in val] == eval_steps
    assert all(set(VAL_KEYS) <= set(r) for r in val)
    assert (out / "loss.png").stat().st_size > 0
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_val_loss"] == val[0]["val_loss"] and summary["final_val_loss"] == val[-1]["val_loss"]
    assert summary["num_params"] == config["num_params"] > 0
    return summary


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_end_to_end_hsdp_4_workers(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run([*TINY_RUN, "--nproc", "4", "--fsdp-outer-degree", "2", "--steps", "4", "--grad-accum", "2",
                  "--clip", "0", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = check_outputs(out, steps=4, eval_steps=[0, 2, 4])
    assert "outer2 x inner2" in summary["layout"]
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert isinstance(summary["sample"], str)
    assert "val loss" in result.stdout and "sample (" in result.stdout


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this interpreter")
def test_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
    result = run([*TINY_RUN, "--steps", "2", "--out", str(out)], launcher=torchrun)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = check_outputs(out, steps=2, eval_steps=[0, 2])
    assert summary["layout"].startswith("world 2")


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_worker_failure_gives_nonzero_exit(tmp_path: Path) -> None:
    # 4 ranks cannot be split into 3 HSDP replicas: every worker raises, the launcher must report failure.
    result = run([*TINY_RUN, "--nproc", "4", "--fsdp-outer-degree", "3", "--steps", "1",
                  "--out", str(tmp_path / "run")])
    assert result.returncode != 0
    assert "fsdp_outer_degree" in result.stdout + result.stderr


def test_cli_is_generated_from_the_dataclass() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for flag in ("--preset", "--n-layer", "--d-model", "--n-head", "--seq-len", "--batch-size", "--grad-accum",
                 "--steps", "--lr", "--min-lr", "--warmup", "--weight-decay", "--clip", "--seed",
                 "--fsdp-outer-degree", "--reshard-policy", "--eval-every", "--eval-batches", "--nproc", "--data",
                 "--out", "--sample-tokens", "--device"):
        assert flag in help_text
    assert "Max global gradient norm" in help_text  # field docstrings become the help
    config = parse_args(["--steps", "7", "--lr", "0.01", "--min-lr", "0.001", "--no-progress"])
    assert (config.steps, config.lr, config.progress) == (7, 0.01, False)
    assert parse_args([]) == TrainConfig()
    assert config.model_config().n_layer == 4
    assert parse_args(["--preset", "tiny", "--n-layer", "3"]).model_config().n_layer == 3
    with pytest.raises(SystemExit):
        parse_args(["--preset", "nonexistent"])
    with pytest.raises(SystemExit):
        parse_args(["--lr", "0.001", "--min-lr", "0.01"])


def test_lr_schedule() -> None:
    config = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(config, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("name, exempt", [
    ("wte.weight", True), ("wpe.weight", True), ("ln_f.weight", True), ("blocks.0.ln_1.bias", True),
    ("blocks.0.attn.qkv.bias", True), ("blocks.3.mlp.fc.weight", False), ("blocks.0.attn.proj.weight", False),
    ("encoder.layernorm.weight", True), ("lm_head.weight", False),
])
def test_weight_decay_groups_by_name(name: str, exempt: bool) -> None:
    assert no_decay(name) is exempt
