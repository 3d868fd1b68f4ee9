"""The training job's --dry-run (shardfusion.train.job_dry_run): one step of a large job played in one process with
the job's own model and layout flags; its report, its dry-run.json, and the flags it refuses. The figures themselves
are checked against theory and measured runs in tests/unit/test_dry_run.py and
tests/distributed/test_dry_run_measured.py."""

from __future__ import annotations

import json

from harness import run_train, usage_error_line

TIMEOUT_S = 240


def test_dry_run_of_a_512_rank_moe_job(tmp_path) -> None:
    out = tmp_path / "plan"
    # the default outer degree over 64 nodes: inner = one node (64 x 8), and the report says why
    result = run_train(["--dry-run", "--world", "512", "--ranks-per-node", "8", "--max-memory-per-rank", "80GB",
                        "--ep", "2", "--experts", "4", "--preset", "tiny", "--batch-size", "2", "--out", str(out)],
                       timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    assert "dry run: world 512 = 64 nodes x 8 ranks" in text
    assert ("shardfusion: --fsdp-outer-degree 64 by default: 512 ranks = 64 nodes x 8: outer 64 x inner 8, each "
            "inner group one node") in text
    assert "  budget 74.51 GiB per rank: fits, " in text and "across nodes " in text and " ring steps x 15 us" in text
    assert "outer64 x inner8" in text and "ep2" in text
    assert "predicted step" in text and "even router" in text
    record = json.loads((out / "dry-run.json").read_text())
    (rank,) = record["report"]["ranks"]
    ops = {(c["op"], c["label"]) for c in rank["collectives"]}
    assert ("all_reduce", "replicate") in ops and ("all_to_all", "ep") in ops
    replicate = next(c for c in rank["collectives"] if c["label"] == "replicate")
    assert replicate["group_size"] == 64 and replicate["within_bytes"] == 0  # one replica per node
    assert rank["memory"]["params"] > 0 and rank["memory"]["peak"] > rank["memory"]["params"]
    assert record["config"]["world"] == 512 and not (out / "checkpoints").exists()  # nothing trained


def test_dry_run_of_pipeline_stages() -> None:
    result = run_train(["--dry-run", "--world", "32", "--ranks-per-node", "4", "--pp", "2", "--experts", "0",
                        "--preset", "tiny", "--batch-size", "4", "--microbatches", "2"], timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rank 0 (pp stage 0;" in result.stdout and "rank 16 (pp stage 1;" in result.stdout
    assert "p2p_send" in result.stdout
    assert "cost model: not run (the cost model covers pp, mp, sep and cp 1 only)" in result.stdout


def test_a_layout_error_is_one_line() -> None:
    """The job's own checks against --world: one line, exit status 2, before anything is built (every refusal of
    the section, and the layout checks, in one process: tests/unit/test_dry_run_config.py)."""
    flags = ["--dry-run", "--world", "64", "--pp", "2", "--microbatches", "3", "--experts", "0", "--preset", "tiny"]
    line = usage_error_line(run_train(flags, timeout=TIMEOUT_S))
    assert "--microbatches 3 must divide the 16 sequences" in line, line
