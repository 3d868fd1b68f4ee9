"""The job's --secondary-shard (ZeRO++'s hpZ, docs/secondary-shard.md): 4 gloo workers as 2 pretended nodes of 2
ranks (--ranks-per-node, which reaches `sf.Topology(ranks_per_node=)`), one sharding group of 4 over both nodes
(--fsdp-outer-degree 1), the dense tiny GPT, 2 steps of 2 micro-batches. Against the same run without the flag:
bitwise the same training losses (the backward computes with the forward's parameters), the same number of
parameter all-gathers, fewer bytes of them across nodes (the backward's stay in the node)."""

import subprocess
from pathlib import Path

import pytest

from harness import TRAIN_TIMEOUT_S, run_trains
from shardfusion.train.metrics import read_metrics

RUN = ["--preset", "tiny", "--batch-size", "4", "--eval-every", "2", "--eval-batches", "1", "--data-bytes", "300000", "--sample-tokens", "0",
       "--no-progress", "--nproc", "4", "--ranks-per-node", "2", "--fsdp-outer-degree", "1", "--experts", "0",
       "--steps", "2", "--grad-accum", "2", "--clip", "0"]


def _records(out: Path, result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")[0]


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 30)
def test_secondary_shard_is_bitwise_and_keeps_backward_gathers_in_the_node(tmp_path: Path) -> None:
    outs = {"plain": [], "hpz": ["--secondary-shard"]}  # started together (`harness.run_trains`)
    results = run_trains(*([*RUN, *flags, "--out", str(tmp_path / name)] for name, flags in outs.items()))
    plain, hpz = (_records(tmp_path / name, result) for name, result in zip(outs, results))
    assert [r["loss"] for r in hpz] == [r["loss"] for r in plain]
    for p, h in zip(plain, hpz):
        p_ag, h_ag = p["comm"]["inner_all_gather"], h["comm"]["inner_all_gather"]
        assert h_ag["count"] == p_ag["count"]  # each backward all-gather now on a node group
        assert 0 < h_ag["cross_node_bytes"] < p_ag["cross_node_bytes"]
