"""What a stored benchmark result records and how its ratios are paired: the commit and the machine's load
(benchmarks/provenance.py), a DiLoCo run against the one-node reference paired only when the link rates ran repeat by
repeat (benchmarks/link.py --interleave-rates), and the cost of fault tolerance paired seed by seed (benchmarks/ft.py).
The reference figures are worked out by hand from made-up step times."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest

from benchmarks import ft, link
from benchmarks.provenance import RunRecord, git_commit

REPO = Path(__file__).resolve().parents[2]


def test_run_record_keeps_the_commit_and_the_load() -> None:
    with RunRecord(every=0.01) as record:
        pass
    env = record.as_dict()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert env["commit"] == head and isinstance(env["dirty"], list)
    assert len(env["load_before"]) == 3 and len(env["load_after"]) == 3 and env["wall_s"] >= 0
    during = env["load_during"]
    assert during["min"] <= during["median"] <= during["max"] and during["samples"] >= 2
    with pytest.raises(ValueError, match="every must be > 0 seconds, got 0"):
        RunRecord(every=0)


def test_git_commit_outside_a_repository(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == {"commit": None, "dirty": []}


def _variant(step_s: list[list[float]], every: int = 0) -> dict:
    out = {"step_s": step_s, "link_bytes": [[1000.0, 1000.0]] * len(step_s), "accounting": [],
           "losses": [[5.0, 4.0]] * len(step_s), "timed_steps": len(step_s[0])}
    if every:  # one outer step per window, at its end
        out["outer_step"] = [[i == len(rep) - 1 for i in range(len(rep))] for rep in step_s]
    return out


def _raw(interleaved: bool) -> dict:
    # per repeat: sf-hsdp without a limit has means 1.0, 2.0, 1.0 (the load doubled in repeat 1); DiLoCo at
    # 200 Mbit/s 1.1, 2.2, 1.4: paired ratios 1.1, 1.1, 1.4 -> 1.1; ratio of means 1.5667 / 1.3333 = 1.175
    one_node = _variant([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]])
    diloco = _variant([[1.0, 1.2], [2.0, 2.4], [1.3, 1.5]], every=2)
    rates = {"unlimited": {"link": {"rate_bps": None}, "variants": {"sf-hsdp": one_node}},
             "200mbit": {"link": {"rate_bps": 2e8}, "variants": {"sf-hsdp": copy.deepcopy(one_node),
                                                                  "sf-diloco-8": diloco}}}
    return {"config": {"steps": 2, "interleave_rates": interleaved}, "rates": rates}


def test_diloco_against_one_node_is_paired_only_when_the_rates_interleave() -> None:
    paired = link.summarize(_raw(True))["200mbit"]
    row = paired["diloco"]["sf-diloco-8"]
    assert row["vs_one_node"] == pytest.approx(1.175)
    assert row["vs_one_node_paired"] == pytest.approx(1.1)
    target = [t for t in paired["targets"] if t["target"].startswith("sf-diloco-8 ")][0]
    assert target["value"] == pytest.approx(1.1) and target["met"] and "paired" in target["target"]

    unpaired = link.summarize(_raw(False))["200mbit"]
    assert unpaired["diloco"]["sf-diloco-8"]["vs_one_node_paired"] is None
    target = [t for t in unpaired["targets"] if t["target"].startswith("sf-diloco-8 ")][0]
    assert target["value"] == pytest.approx(1.175) and not target["met"] and "paired" not in target["target"]


def test_jobs_of_one_rate_are_merged_repeat_by_repeat() -> None:
    raw = _raw(True)
    first, second = copy.deepcopy(raw["rates"]["200mbit"]), copy.deepcopy(raw["rates"]["200mbit"])
    first["qdisc"], second["qdisc"] = [{"drops": 1, "bytes": 10}], [{"drops": 2, "bytes": 5}]
    merged = link._merge(first, second)
    assert merged["variants"]["sf-diloco-8"]["step_s"] == raw["rates"]["200mbit"]["variants"]["sf-diloco-8"][
        "step_s"] * 2
    assert merged["qdisc"] == [{"drops": 3, "bytes": 15}] and merged["jobs"] == 2


def test_the_cost_of_fault_tolerance_is_paired_seed_by_seed() -> None:
    # seed 42 ran while the machine was quiet, seed 43 at twice the load: each against HSDP right after it
    clean = [{"median_step_s": 0.06}, {"median_step_s": 0.13}]
    hsdp = [{"median_step_s": 0.05}, {"median_step_s": 0.10}]
    cost = ft.paired_cost(clean, hsdp)
    assert cost["ratios"] == pytest.approx([1.2, 1.3]) and cost["median"] == pytest.approx(1.25)
