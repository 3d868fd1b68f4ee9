"""The training entry point as whole runs (subprocesses; gloo workers): the GPT-MoE at ep 2 under HSDP, the dense GPT
under torchrun, bad flags rejected before any worker starts, a failing worker failing the job. The communication
accounting of the job: per step in metrics.jsonl and per step on average in summary.json, with cross-node bytes for
a pretended 2 nodes of 2 ranks (--ranks-per-node 2) and for one node (torchrun). The configuration alone is tested
in tests/unit/test_train_config.py."""

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from harness import REPO, TRAIN_TIMEOUT_S, run_train, train_usage_error
from shardfusion.accounting import CATEGORIES
from shardfusion.train.metrics import COMM_FIELDS, MOE_KEYS, TRAIN_KEYS, VAL_KEYS, read_metrics


TINY_RUN = ["--preset", "tiny", "--batch-size", "4", "--eval-every", "2", "--eval-batches", "4",
            "--data-bytes", "300000", "--sample-tokens", "16", "--no-progress"]


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


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_end_to_end_moe_hsdp_4_workers(tmp_path: Path) -> None:
    # The default job's shape, small: a GPT-MoE with 4 experts over ep 2, HSDP outer 2 x inner 2.
    out = tmp_path / "run"
    # --ranks-per-node 2: the accounting pretends ranks {0,1} and {2,3} are two nodes.
    result = run_train([*TINY_RUN, "--nproc", "4", "--fsdp-outer-degree", "2", "--experts", "4", "--top-k", "2",
                        "--ep", "2", "--steps", "4", "--grad-accum", "2", "--clip", "0", "--ranks-per-node", "2",
                        "--out", str(out)])
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


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this interpreter")
def test_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
    # also the mixed-precision path of the job: bf16 compute, fp32 reduction, no prefetch
    result = run_train([*TINY_RUN, "--experts", "0", "--steps", "2", "--param-dtype", "bf16", "--grad-comm-dtype",
                        "fp32", "--prefetch", "0", "--out", str(out)], launcher=torchrun)
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


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_sharding_group_across_pretended_nodes(tmp_path: Path) -> None:
    # --ranks-per-node 2 reaches the library's topology: with one sharding group of 4 (--fsdp-outer-degree 1) the
    # job names it as spanning the 2 pretended nodes (no LOCAL_WORLD_SIZE warning: declared on purpose) and prints
    # the ZeRO++ options; the accounting sees the gathers cross.
    out = tmp_path / "run"
    result = run_train([*TINY_RUN, "--nproc", "4", "--ranks-per-node", "2", "--fsdp-outer-degree", "1",
                        "--all-gather-dtype", "int8", "--experts", "0", "--steps", "1", "--eval-every", "100",
                        "--sample-tokens", "0", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("shardfusion: ZeRO++: ")]
    assert len(lines) == 1 and lines[0].startswith("shardfusion: ZeRO++: qwZ on (--all-gather-dtype int8), "), lines
    assert lines[0].endswith("; 2 nodes x 2 ranks; fsdp_inner groups span nodes (fsdp inner 4)"), lines
    assert "groups span nodes (LOCAL_WORLD_SIZE" not in result.stdout + result.stderr
    train, _ = read_metrics(out / "metrics.jsonl")
    assert train[0]["comm"]["inner_all_gather"]["cross_node_bytes"] > 0


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_outer_degree_auto(tmp_path: Path) -> None:
    # --fsdp-outer-degree auto on 4 gloo ranks as 2 pretended nodes of 2 (--ranks-per-node 2): the job probes the
    # links, prints the cost model's table on rank 0, trains with the chosen degree and writes it to config.json as
    # an int. Which degree wins depends on the measured (loopback) links; whichever it is, the cost model's bytes
    # and counts per step for it must be the accounting's (both use the ring formulas).
    out = tmp_path / "run"
    result = run_train([*TINY_RUN, "--nproc", "4", "--ranks-per-node", "2", "--experts", "0", "--steps", "1",
                        "--eval-every", "100", "--sample-tokens", "0", "--fsdp-outer-degree", "auto",
                        "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outer = json.loads((out / "config.json").read_text())["fsdp_outer_degree"]
    assert isinstance(outer, int) and outer in (1, 2, 4)
    text = result.stdout
    assert text.count("fsdp_outer_degree cost model: world 4 = 2 nodes x 2 ranks") == 1  # rank 0 only
    rows = [line.split("|")[0].split() for line in text.splitlines() if line.endswith("<- chosen")]
    assert rows == [["shardfusion:", str(outer), str(4 // outer)]], text[-3000:]
    assert f"chosen: outer {outer} (inner {4 // outer})" in text and "bandwidth probe" in text
    summary = json.loads((out / "summary.json").read_text())
    assert f"outer{outer} x inner{4 // outer}" in summary["layout"]

    from shardfusion.models.gpt import GPT, PRESETS, Block
    from shardfusion.plan import Bandwidth, plan, unit_sizes
    with torch.device("meta"):
        sizes = unit_sizes(GPT(dataclasses.replace(PRESETS["tiny"], n_experts=0)), units=(Block,))
    chosen = next(c for c in plan(sizes, world_size=4, local_world_size=2, bandwidth=Bandwidth(1e9, 1e8),
                                  max_memory_per_rank=2**40).candidates if c.outer == outer)
    train, _ = read_metrics(out / "metrics.jsonl")
    comm = train[0]["comm"]
    for op, category in (("all_gather", "inner_all_gather"), ("reduce_scatter", "inner_reduce_scatter"),
                         ("all_reduce", "replicate_all_reduce")):
        predicted, measured = chosen.traffic[op], comm[category]
        assert predicted.count == measured["count"], (op, predicted, measured)
        assert predicted.within_bytes + predicted.across_bytes == pytest.approx(measured["wire_bytes"], rel=1e-9)
        assert predicted.across_bytes == pytest.approx(measured["cross_node_bytes"], rel=1e-9)


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


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_fails_before_launch(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """In this process (`harness.train_usage_error`: no process start-up per case). As real commands:
    test_bad_flag_under_torchrun here, tests/integration/test_train_pp.py::test_usage_errors_as_commands."""
    args, flag, message = BAD_FLAGS[case]
    out = tmp_path / "run"
    line = train_usage_error([*TINY_RUN, "--steps", "1", "--out", str(out), *args], capsys)
    assert line.startswith(f"{flag} ") and message in line, line
    assert not out.exists(), "a rejected run must not start writing its output"


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this interpreter")
def test_bad_flag_under_torchrun(tmp_path: Path) -> None:
    # The same checks run in every worker before it joins the process group; only rank 0 prints the message.
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
    result = run_train([*TINY_RUN, "--steps", "1", "--fsdp-outer-degree", "4", "--out", str(tmp_path / "run")],
                       launcher=torchrun)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert text.count("shardfusion-train: error: --fsdp-outer-degree 4 does not fit 2 ranks") == 1, text[-3000:]
    assert "exitcode  : 2" in text  # the workers exited with the usage error's status ...
    assert 'shardfusion/train/' not in text  # ... not with a traceback of ours
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_worker_failure_gives_nonzero_exit(tmp_path: Path) -> None:
    # A worker that fails after the launch must still fail the job. Skip the parent's checks (in the parent only;
    # spawned workers import the module afresh) so that a layout error reaches the workers: 2 ranks, 3 replicas.
    code = ("import sys; import shardfusion.train.job as t\n"
            "t.preflight = lambda config, torchrun: t.resolve(config, device='cpu', world_size=2, nproc=2)\n"
            f"sys.exit(t.main({[*TINY_RUN, '--fsdp-outer-degree', '3', '--steps', '1', '--out', str(tmp_path)]!r}))")
    result = run_train([], launcher=[sys.executable, "-c", code])  # the module name that run_train() appends is unused
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a worker failed" in result.stdout and "fsdp_outer_degree(3)" in result.stdout + result.stderr
