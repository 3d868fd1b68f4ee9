"""The training entry point: its config and CLI in-process, whole runs as subprocesses (gloo workers: the GPT-MoE
at ep 2 under HSDP, the dense GPT under torchrun), and bad flags rejected before any worker starts. The
communication accounting of the job: per step in metrics.jsonl and per step on average in summary.json, with
cross-node bytes for a pretended 2 nodes of 2 ranks (--ranks-per-node 2) and for one node (torchrun)."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardfusion.train.data import min_corpus_bytes
from shardfusion.accounting import CATEGORIES
from shardfusion.train.metrics import (COMM_FIELDS, MOE_KEYS, TRAIN_KEYS, VAL_KEYS, comm_per_step, comm_step_record,
                                 expert_balance, format_comm, read_metrics)
from shardfusion.train.job import no_decay
from shardfusion.train.config import TrainConfig, build_parser, check_run, lr_at, parse_args, resolve

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 150
TINY_RUN = ["--preset", "tiny", "--batch-size", "4", "--eval-every", "2", "--eval-batches", "4",
            "--data-bytes", "300000", "--sample-tokens", "16", "--no-progress"]


def run(args: list[str], *, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = clean_env()
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
    check_comm(train, summary)
    return summary


def check_comm(train: list[dict], summary: dict) -> None:
    """Every step's `comm` has every category and field; the summary's figures are their means per step."""
    for record in train:
        assert list(record["comm"]) == list(CATEGORIES)
        for row in record["comm"].values():
            assert list(row) == list(COMM_FIELDS) and all(v >= 0 for v in row.values())
            assert (row["wait_s"] > 0) == (row["count"] > 0) and row["cross_node_bytes"] <= row["wire_bytes"]
        assert record["comm"]["inner_all_gather"]["count"] > 0 and record["comm"]["other"]["count"] >= 1  # clipping
    comm = summary["comm"]
    for cat in CATEGORIES:
        for field in COMM_FIELDS:
            mean = sum(r["comm"][cat][field] for r in train) / len(train)
            assert comm["per_step"][cat][field] == pytest.approx(mean, rel=1e-12)
    assert comm["cross_node_bytes_per_step"] == pytest.approx(
        sum(row["cross_node_bytes"] for row in comm["per_step"].values()), rel=1e-12)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_end_to_end_moe_hsdp_4_workers(tmp_path: Path) -> None:
    # The default job's shape, small: a GPT-MoE with 4 experts over ep 2, HSDP outer 2 x inner 2.
    out = tmp_path / "run"
    # --ranks-per-node 2: the accounting pretends ranks {0,1} and {2,3} are two nodes.
    result = run([*TINY_RUN, "--nproc", "4", "--fsdp-outer-degree", "2", "--experts", "4", "--top-k", "2", "--ep", "2",
                  "--steps", "4", "--grad-accum", "2", "--clip", "0", "--ranks-per-node", "2", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = check_outputs(out, steps=4, eval_steps=[0, 2, 4])
    assert "outer2 x inner2" in summary["layout"] and "ep2" in summary["layout"]
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert isinstance(summary["sample"], str)
    assert "val loss" in result.stdout and "sample (" in result.stdout
    assert "aux loss" in result.stdout and "tokens/expert" in result.stdout

    train, _ = read_metrics(out / "metrics.jsonl")
    # Tokens per step: 4 ranks x 2 micro-batches x 4 sequences x 64 bytes, each to top_k = 2 experts in 2 layers.
    assignments = 4 * 2 * 4 * 64 * 2 * 2
    for record in train:
        assert set(MOE_KEYS) <= set(record)
        assert len(record["tokens_per_expert"]) == 4 and sum(record["tokens_per_expert"]) == assignments
        assert 1.0 <= record["load_balance"] <= record["worst_layer_balance"] <= 4 / 2
        assert 0.0 < record["aux_loss"] < 4.0
    experts = summary["experts"]
    assert (experts["n_experts"], experts["top_k"], experts["ep"]) == (4, 2, 2)
    assert experts["tokens_per_expert"] == train[-1]["tokens_per_expert"]
    assert experts["load_balance"] == train[-1]["load_balance"] and experts["final_aux_loss"] == train[-1]["aux_loss"]
    assert 0 < experts["num_active_params"] < summary["num_params"]

    # Communication per step. Units: the root, and per block (2 layers) a dense buffer sharded over the inner group
    # [0,1] / [2,3] and an expert buffer kept whole on each rank (expert_inner = moe_sharding / outer = 1); every
    # buffer is all-reduced once per step over the replicate group [0,2] / [1,3], which crosses the two nodes.
    # Each MoE layer issues 3 all-to-alls per forward and 2 per backward over the ep group [0,1] / [2,3].
    assert summary["comm"]["ranks_per_node"] == 2 and summary["comm"]["nodes"] == 2
    assert "comm per step    rank 0, mean of 4 steps; 2 nodes of 2 ranks (--ranks-per-node)" in result.stdout
    for record in train:
        comm = record["comm"]
        assert comm["replicate_all_reduce"]["count"] == 1 + 2 * 2
        assert comm["inner_reduce_scatter"]["count"] == 2 * (1 + 2)  # 2 micro-batches x (root + 2 dense buffers)
        assert comm["ep_all_to_all"]["count"] == 2 * 2 * (3 + 2)
        for cat in ("inner_all_gather", "inner_reduce_scatter", "ep_all_to_all"):
            assert comm[cat]["cross_node_bytes"] == 0, (cat, comm[cat])
        assert comm["replicate_all_reduce"]["cross_node_bytes"] == comm["replicate_all_reduce"]["wire_bytes"] > 0
        assert comm["other"]["wire_bytes"] == 2 * 3 / 4 * 4 and comm["other"]["cross_node_bytes"] == 3.0  # the norm
    assert summary["comm"]["cross_node_bytes_per_step"] == pytest.approx(
        summary["comm"]["per_step"]["replicate_all_reduce"]["wire_bytes"] + 3.0, rel=1e-12)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this interpreter")
def test_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
    # also the mixed-precision path of the job: bf16 compute, fp32 reduction, no prefetch
    result = run([*TINY_RUN, "--experts", "0", "--steps", "2", "--param-dtype", "bf16", "--grad-comm-dtype", "fp32",
                  "--prefetch", "0", "--out", str(out)], launcher=torchrun)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = check_outputs(out, steps=2, eval_steps=[0, 2])
    assert summary["layout"].startswith("world 2") and summary["layout"].endswith("ep1")
    # --experts 0: the dense GPT, with no MoE figures
    assert summary["experts"] is None and "aux loss" not in result.stdout
    train, _ = read_metrics(out / "metrics.jsonl")
    assert not set(MOE_KEYS) & set(train[0])
    # One node (torchrun's LOCAL_WORLD_SIZE = 2): nothing crosses nodes; plain FSDP: no replicate all-reduce.
    assert summary["comm"]["ranks_per_node"] == 2 and summary["comm"]["ranks_per_node_from"] == "LOCAL_WORLD_SIZE"
    assert summary["comm"]["cross_node_bytes_per_step"] == 0
    assert all(r["comm"]["replicate_all_reduce"]["count"] == 0 and r["comm"]["ep_all_to_all"]["count"] == 0
               for r in train)
    assert "1 node of 2 ranks (LOCAL_WORLD_SIZE)" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["param_dtype"], config["grad_comm_dtype"], config["prefetch"]) == ("bf16", "fp32", 0)


# Flags that only a check against the world size or the file system can reject: {case: (args, flag, message)}.
# Each must fail in the launching process, before any worker starts: exit status 2, one argparse-style error line
# that names the flag, no traceback.
BAD_FLAGS = {
    "outer-3": (["--nproc", "4", "--fsdp-outer-degree", "3"], "--fsdp-outer-degree",
                "--fsdp-outer-degree 3 does not fit 4 ranks (--nproc 4)"),
    "outer-8": (["--nproc", "4", "--fsdp-outer-degree", "8"], "--fsdp-outer-degree",
                "--fsdp-outer-degree 8 does not fit 4 ranks (--nproc 4)"),
    "data-missing": (["--nproc", "2", "--data", "/nonexistent/corpus"], "--data",
                     "'/nonexistent/corpus' is neither a file nor a folder"),
    "data-bytes": (["--nproc", "2", "--data-bytes", "10"], "--data-bytes",
                   "10 is too small: it splits into 9 train / 1 val bytes"),
    "data-short": (["--nproc", "2", "--data", str(REPO / "pyproject.toml"), "--seq-len", "4096"], "--data",
                   "holds only"),
    "ep-sharding": (["--nproc", "2", "--experts", "4", "--ep", "4"], "--ep",
                    "--ep 4 with --fsdp-outer-degree 1 does not fit 2 ranks (--nproc 2): sharding(2) % ep(4)"),
    "experts-ep": (["--nproc", "4", "--experts", "3", "--ep", "2"], "--ep", "--ep 2 must divide --experts 3"),
    "param-dtype": (["--nproc", "2", "--param-dtype", "fp8"], "--param-dtype",
                    "--param-dtype must be one of fp32, bf16, fp16, got 'fp8'"),
}
if not torch.cuda.is_available():
    BAD_FLAGS["device-cuda"] = (["--nproc", "2", "--device", "cuda"], "--device", "torch.cuda.is_available() is False")
BAD_FLAG_LIMIT_S = 30  # generous for a loaded machine: it takes the parent's imports only (about 2 s when idle)


def clean_env() -> dict[str, str]:
    """This environment without torchrun's variables, and one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Every BAD_FLAGS case, all at once, each as `python -m shardfusion.train`: {case: (result, seconds)}."""
    out = tmp_path_factory.mktemp("bad") / "run"
    started = {}
    for case, (args, _, _) in BAD_FLAGS.items():
        command = [sys.executable, "-m", "shardfusion.train", *TINY_RUN, "--steps", "1", "--out", str(out), *args]
        started[case] = (command, time.perf_counter(), subprocess.Popen(
            command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    runs = {}
    for case, (command, t0, process) in started.items():
        try:
            stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        runs[case] = (subprocess.CompletedProcess(command, process.returncode, stdout, stderr),
                      time.perf_counter() - t0)
    assert not out.exists(), "a rejected run must not start writing its output"
    return runs


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_fails_before_launch(case: str, bad_flag_runs: dict) -> None:
    result, seconds = bad_flag_runs[case]
    _, flag, message = BAD_FLAGS[case]
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "elastic" not in result.stderr  # no worker was launched
    errors = [line for line in result.stderr.splitlines() if line.startswith("shardfusion-train: error: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"shardfusion-train: error: {flag} ") and message in errors[0], errors[0]
    assert seconds < BAD_FLAG_LIMIT_S


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this interpreter")
def test_bad_flag_under_torchrun(tmp_path: Path) -> None:
    # The same checks run in every worker before it joins the process group; only rank 0 prints the message.
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
    result = run([*TINY_RUN, "--steps", "1", "--fsdp-outer-degree", "4", "--out", str(tmp_path / "run")],
                 launcher=torchrun)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert text.count("shardfusion-train: error: --fsdp-outer-degree 4 does not fit 2 ranks") == 1, text[-3000:]
    assert "exitcode  : 2" in text  # the workers exited with the usage error's status ...
    assert 'shardfusion/train/' not in text  # ... not with a traceback of ours
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_worker_failure_gives_nonzero_exit(tmp_path: Path) -> None:
    # A worker that fails after the launch must still fail the job. Skip the parent's checks (in the parent only;
    # spawned workers import the module afresh) so that a layout error reaches the workers: 2 ranks, 3 replicas.
    code = ("import dataclasses, sys; import shardfusion.train.job as t\n"
            "t.preflight = lambda config, torchrun: t.resolve(dataclasses.replace(config, nproc=2), device='cpu', "
            "world_size=2)\n"
            f"sys.exit(t.main({[*TINY_RUN, '--fsdp-outer-degree', '3', '--steps', '1', '--out', str(tmp_path)]!r}))")
    result = run([], launcher=[sys.executable, "-c", code])  # the module name that run() appends is unused
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a worker failed" in result.stdout and "fsdp_outer_degree(3)" in result.stdout + result.stderr


def test_check_run_messages(tmp_path: Path) -> None:
    need = min_corpus_bytes(64)  # tiny: seq_len 64
    (tmp_path / "corpus.txt").write_bytes(b"x" * need)
    (tmp_path / "short.txt").write_bytes(b"x" * (need - 1))

    def check(world_size: int = 4, **fields) -> None:
        fields = {"data": str(tmp_path / "corpus.txt"), "out": str(tmp_path / "run"), **fields}
        config = resolve(TrainConfig(preset="tiny", **fields), device="cpu", world_size=world_size)
        check_run(config, world_size=world_size, world=f"--nproc {world_size}")

    check()
    check(world_size=8, fsdp_outer_degree=4)
    with pytest.raises(ValueError, match=r"--fsdp-outer-degree 3 does not fit 4 ranks \(--nproc 4\).*"
                                         r"fsdp_outer_degree\(3\)"):
        check(fsdp_outer_degree=3)
    with pytest.raises(ValueError, match=r"fsdp_outer_degree\(0\) must be >= 1"):
        check(fsdp_outer_degree=0)
    with pytest.raises(ValueError, match=rf"--data-bytes {need - 1} is too small.*--data-bytes >= {need}"):
        check(data_bytes=need - 1)
    with pytest.raises(ValueError, match="--data-bytes 1000 is too small: it splits into 950 train / 50 val"):
        check(data_bytes=1000)
    with pytest.raises(ValueError, match=rf"--data .*short.txt holds only {need - 1} bytes.*"
                                         rf"split into {need - 1 - 64} train / 64 val"):
        check(data=str(tmp_path / "short.txt"))
    with pytest.raises(ValueError, match="^--data .* is neither a file nor a folder$"):
        check(data=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^--data .*empty holds no bytes; pass --data with a non-empty"):
        check(data=str(tmp_path / "empty"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="^--data .*empty.txt holds no bytes"):
        check(data=str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="--out .* is not a folder"):
        check(out=str(tmp_path / "corpus.txt" / "run"))

    # Expert parallelism: ep must divide the sharding degree, and ep * fsdp_outer_degree must divide it too.
    check(world_size=8, experts=8, ep=4)
    check(world_size=8, experts=4, ep=2, fsdp_outer_degree=4)
    with pytest.raises(ValueError, match=r"^--ep 8 with --fsdp-outer-degree 2 does not fit 4 ranks \(--nproc 4\): "
                                         r"sharding\(4\) % ep\(8\)"):
        check(experts=8, ep=8, fsdp_outer_degree=2)
    with pytest.raises(ValueError, match=r"^--ep 4 with --fsdp-outer-degree 2 does not fit 4 ranks \(--nproc 4\): "
                                         r"moe_sharding\(1\) .* % fsdp_outer_degree\(2\)"):
        check(experts=4, ep=4, fsdp_outer_degree=2)


def test_resolve_ep_and_outer_defaults() -> None:
    def resolved(world_size: int, **fields) -> tuple[int, int]:
        config = resolve(TrainConfig(**fields), device="cpu", world_size=world_size)
        return config.ep, config.fsdp_outer_degree

    assert resolved(4) == (2, 2)  # the default job: ep 2, HSDP outer 2
    assert resolved(2) == (2, 1)
    assert resolved(1) == (1, 1)
    assert resolved(8) == (2, 2)
    assert resolved(4, experts=0) == (1, 2)
    assert resolved(4, experts=3) == (1, 2)
    assert resolved(4, ep=4) == (4, 1)  # moe_sharding 1: no room for 2 replicas
    assert resolved(6) == (2, 1)  # moe_sharding 3 is odd
    assert resolved(4, ep=3, experts=3) == (3, 2)  # ep does not fit; check_run says so, not resolve


def moe_flag_error(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    """The one error line that parse_args prints for args, after checking that it exits with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardfusion-train: error: ")]
    assert len(errors) == 1
    return errors[0].removeprefix("shardfusion-train: error: ")


def test_moe_flags_rejected(capsys: pytest.CaptureFixture) -> None:
    assert moe_flag_error(capsys, ["--experts", "2", "--top-k", "3"]) == "--top-k 3 must be between 1 and --experts 2"
    assert moe_flag_error(capsys, ["--experts", "4", "--top-k", "0"]) == "--top-k 0 must be between 1 and --experts 4"
    assert moe_flag_error(capsys, ["--experts", "6", "--ep", "4"]).startswith("--ep 4 must divide --experts 6")
    assert moe_flag_error(capsys, ["--experts", "0", "--ep", "2"]).startswith("--ep 2 needs experts")
    assert moe_flag_error(capsys, ["--experts", "-1"]) == "--experts must be >= 0, got -1"
    assert moe_flag_error(capsys, ["--ep", "0"]) == "--ep must be >= 1, got 0"
    assert moe_flag_error(capsys, ["--expert-policy", "all"]).startswith("--expert-policy must be replicate or shard")
    assert moe_flag_error(capsys, ["--aux-loss-coef", "-0.1"]) == "--aux-loss-coef must be >= 0, got -0.1"


@pytest.mark.parametrize("flag", ["--weight-decay", "--aux-loss-coef", "--clip", "--lr", "--min-lr", "--dropout"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_float_flags_rejected(flag: str, value: str, capsys: pytest.CaptureFixture) -> None:
    # nan would train a NaN run with exit status 0 (or, for --clip, silently turn clipping off)
    assert moe_flag_error(capsys, [flag, value]) == f"argument {flag}: expected a finite number, got {value!r}"


def test_config_refuses_non_finite_floats() -> None:
    with pytest.raises(ValueError, match="^--clip must be a finite number, got nan$"):
        TrainConfig(clip=float("nan")).validate()


def test_abbreviated_flags_and_zero_steps_rejected(capsys: pytest.CaptureFixture) -> None:
    assert moe_flag_error(capsys, ["--step", "2"]) == "unrecognized arguments: --step 2"
    assert moe_flag_error(capsys, ["--steps", "0"]) == "--steps must be >= 1, got 0"


def test_expert_balance() -> None:
    figures = expert_balance([[1, 3], [2, 2]])  # (L, E) = 2 layers, 2 experts
    assert figures == {"tokens_per_expert": [3, 5], "load_balance": 1.25, "worst_layer_balance": 1.5}
    assert expert_balance([[4, 4, 4, 4]])["load_balance"] == 1.0


def test_comm_summary_figures() -> None:
    def summary(count: int, wire: float, cross: float, wait: float) -> dict:
        row = {"count": count, "bytes": 2 * wire, "wire_bytes": wire, "cross_node_bytes": cross, "wait_s": wait}
        return {cat: dict(row) if cat == "replicate_all_reduce" else {k: 0 for k in row} for cat in CATEGORIES}

    steps = [{"comm": comm_step_record(summary(3, 1000.0, 500.0, 0.01))},
             {"comm": comm_step_record(summary(3, 3000.0, 1500.0, 0.03))}, {"val_loss": 1.0}]
    assert list(steps[0]["comm"]["other"]) == list(COMM_FIELDS)  # the logical bytes are left out
    per_step = comm_per_step(steps)
    assert per_step["replicate_all_reduce"] == {"count": 3, "wire_bytes": 2000.0, "cross_node_bytes": 1000.0,
                                                "wait_s": pytest.approx(0.02)}
    assert per_step["other"] == {"count": 0, "wire_bytes": 0, "cross_node_bytes": 0, "wait_s": 0}
    lines = format_comm({"ranks_per_node": 2, "nodes": 2, "ranks_per_node_from": "--ranks-per-node",
                         "per_step": per_step, "wire_bytes_per_step": 2000.0, "cross_node_bytes_per_step": 1000.0,
                         "wait_s_per_step": 0.02}, steps=2)
    assert lines[0] == "comm per step    rank 0, mean of 2 steps; 2 nodes of 2 ranks (--ranks-per-node)"
    replicate = next(line for line in lines if "replicate all-reduce" in line)
    assert replicate.split() == ["replicate", "all-reduce", "3", "2.00", "kB", "1.00", "kB", "20.0", "ms"]


def test_ranks_per_node_flag(capsys: pytest.CaptureFixture) -> None:
    assert parse_args(["--ranks-per-node", "8"]).ranks_per_node == 8
    assert parse_args([]).ranks_per_node is None  # LOCAL_WORLD_SIZE at run time
    assert moe_flag_error(capsys, ["--ranks-per-node", "0"]) == "--ranks-per-node must be >= 1, got 0"


def test_cli_is_generated_from_the_dataclass() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for flag in ("--preset", "--n-layer", "--d-model", "--n-head", "--seq-len", "--batch-size", "--grad-accum",
                 "--steps", "--lr", "--min-lr", "--warmup", "--weight-decay", "--clip", "--seed",
                 "--fsdp-outer-degree", "--reshard-policy", "--eval-every", "--eval-batches", "--nproc", "--data",
                 "--out", "--sample-tokens", "--device", "--experts", "--top-k", "--ep", "--expert-hidden",
                 "--aux-loss-coef", "--expert-policy", "--ranks-per-node"):
        assert flag in help_text
    assert "Max global gradient norm" in help_text  # field docstrings become the help
    config = parse_args(["--steps", "7", "--lr", "0.01", "--min-lr", "0.001", "--no-progress"])
    assert (config.steps, config.lr, config.progress) == (7, 0.01, False)
    assert parse_args([]) == TrainConfig()
    assert config.model_config().n_layer == 4
    default = TrainConfig().model_config()  # the default job is a GPT-MoE
    assert (default.n_experts, default.top_k, default.expert_hidden_size) == (4, 2, 256)
    dense = parse_args(["--experts", "0"]).model_config()
    assert dense.n_experts == 0
    moe = parse_args(["--preset", "tiny", "--experts", "8", "--top-k", "1", "--expert-hidden", "32"]).model_config()
    assert (moe.n_experts, moe.top_k, moe.expert_hidden_size, moe.d_model) == (8, 1, 32, 64)
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
    ("encoder.layernorm.weight", True), ("lm_head.weight", False), ("blocks.0.mlp.router.weight", False),
    ("blocks.1.mlp.experts.3.fc.weight", False), ("blocks.1.mlp.experts.3.proj.bias", True),
])
def test_weight_decay_groups_by_name(name: str, exempt: bool) -> None:
    assert no_decay(name) is exempt
