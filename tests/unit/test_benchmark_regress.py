"""The speed regression guard's comparison (benchmarks/regress.py) on two hand-made results: what it flags and what
it does not. No benchmark runs here and no time is asserted."""

from __future__ import annotations

import copy
import sys

from harness import REPO

sys.path.insert(0, str(REPO))
from benchmarks.regress import compare, config_differences, markdown  # noqa: E402

BASE = {
    "config": {"regimes": ["comm"], "repeats": 3, "warmup": 2, "steps": 5, "seed": 42},
    "env": {"torch": "2.13.0", "load_before": [1, 1, 1], "load_after": [2, 2, 2], "wall_s": 100.0},
    "summary": {"comm": {"variants": {
        "shardfusion": {"median_step_s": 0.24, "vs_fsdp2_paired": 0.63, "vs_ddp_paired": 1.42,
                        "collectives": {"all_gather/inner": {"count": 17, "wire_bytes": 1000.0}},
                        "persistent_bytes": {"total": 5000}, "transient": {"full_param_bytes": 600,
                                                                            "full_grad_bytes": 900},
                        "loss_first_last": [5.54, 5.68]},
        "fsdp2": {"median_step_s": 0.38, "vs_fsdp2_paired": 1.0, "loss_first_last": [5.54, 5.68]},
    }}},
}


def _flags(rows) -> dict:
    return {(r["variant"], r["figure"]): r["flag"] for r in rows if r["flag"]}


def test_an_identical_run_flags_nothing() -> None:
    assert _flags(compare(BASE, copy.deepcopy(BASE))) == {}


def test_what_is_flagged() -> None:
    fresh = copy.deepcopy(BASE)
    sf = fresh["summary"]["comm"]["variants"]["shardfusion"]
    sf["median_step_s"] = 0.5               # absolute time: shown, never flagged (the load moves it)
    sf["vs_fsdp2_paired"] = 0.63 * 1.2      # 20 % slower against the peer in the same rounds
    sf["vs_ddp_paired"] = 1.42 * 0.8        # 20 % faster
    sf["collectives"]["all_gather/inner"]["count"] = 18
    sf["transient"]["full_grad_bytes"] = 700  # timing-dependent: shown, never flagged
    sf["loss_first_last"] = [5.54 + 1e-7, 5.70]
    flags = _flags(compare(BASE, fresh))
    assert flags == {("shardfusion", "vs_fsdp2 (paired)"): "slower", ("shardfusion", "vs_ddp (paired)"): "faster",
                     ("shardfusion", "all_gather/inner count"): "changed", ("shardfusion", "loss last"): "changed"}


def test_settings_that_differ_are_named() -> None:
    fresh = copy.deepcopy(BASE)
    fresh["config"]["warmup"] = 1
    assert config_differences(BASE, fresh) == ["warmup: 2 -> 1"]
    text = markdown(compare(BASE, fresh), BASE, fresh, "a.json", "b.json")
    assert "**differ** (warmup: 2 -> 1)" in text


# ---- the paired mode (benchmarks/paired_commits.py, regress.py --against-commit) ----------------------------------
from benchmarks import paired_commits  # noqa: E402


def _rounds(candidate_factor: float, n: int = 8) -> list[dict]:
    """``n`` rounds whose baseline steps wobble by +-4 % from round to round (the load), the candidate's by the same
    amount times ``candidate_factor``."""
    rows = []
    for r in range(n):
        load = 1.0 + 0.04 * (-1) ** r * (r % 3) / 2
        base = [0.2 * load * (1 + 0.001 * i) for i in range(5)]
        cand = [t * candidate_factor for t in base]
        trees = {"baseline": {"step_s": base, "cpu_s": base}, "candidate": {"step_s": cand, "cpu_s": cand}}
        for t in trees.values():
            t["median_s"] = t["median_cpu_s"] = sorted(t["step_s"])[2]
        for t in trees.values():
            t["ratio"] = t["median_s"] / trees["baseline"]["median_s"]
            t["cpu_ratio"] = t["median_cpu_s"] / trees["baseline"]["median_cpu_s"]
        rows.append({"round": r, "trees": trees})
    return rows


def test_paired_flags_a_five_percent_slowdown_that_the_load_hides() -> None:
    s = paired_commits.summarize(_rounds(1.05))
    assert s["flag"] == "slower"
    assert abs(s["trees"]["candidate"]["median_round_ratio"] - 1.05) < 1e-9
    assert s["trees"]["candidate"]["rounds_slower"] == 8
    assert paired_commits.summarize(_rounds(1.0))["flag"] == ""
    assert paired_commits.summarize(_rounds(0.95))["flag"] == "faster"
    assert paired_commits.summarize(_rounds(1.05), tolerance=0.06)["flag"] == ""
    assert paired_commits.summarize(_rounds(1.05), judge="wall")["flag"] == "slower"


def test_paired_trees_are_commits_or_folders(tmp_path) -> None:
    (tmp_path / "shardfusion").mkdir()
    with paired_commits.checkout(str(tmp_path)) as folder:  # a folder holding shardfusion/: used as it is
        assert folder == tmp_path.resolve()
    try:
        with paired_commits.checkout("no-such-revision-xyz"):
            raise AssertionError("a bad revision was checked out")
    except ValueError as e:
        assert "'no-such-revision-xyz' is neither a commit" in str(e)


def test_paired_flag_errors_are_one_line() -> None:
    import argparse

    p = argparse.ArgumentParser()
    paired_commits.add_run_flags(p)
    for flags, message in ((["--rounds", "0"], "--rounds must be >= 1, got 0"),
                           (["--cpus", "0,x"], "--cpus takes CPU numbers separated by commas, got '0,x'"),
                           (["--candidate-spin", "-1"], "--candidate-spin must be >= 0, got -1.0"),
                           (["--candidate-env", "X"], "--candidate-env takes NAME=VALUE items, got 'X'")):
        try:
            paired_commits.opts_of(p.parse_args(flags))
            raise AssertionError(f"{flags} accepted")
        except ValueError as e:
            assert str(e) == message, e


def test_regress_against_commit_runs_the_paired_mode(monkeypatch) -> None:
    from benchmarks import regress

    seen = {}

    def fake_run(trees, opts, rounds, tolerance, name, out_dir, argv, command):
        seen.update(trees=trees, opts=opts, rounds=rounds, tolerance=tolerance, name=name, command=command)
        return {"summary": {"flag": "slower"}}

    monkeypatch.setattr(paired_commits, "run", fake_run)
    assert regress.main(["--against-commit", "d677f4a", "--rounds", "6", "--strict"]) == 1
    assert seen["trees"] == {"baseline": "d677f4a", "candidate": None}  # None: the working tree
    assert (seen["rounds"], seen["tolerance"], seen["name"]) == (6, 0.03, "regress-vs-d677f4a")
    assert seen["opts"]["judge"] == "cpu" and seen["opts"]["regime"] == "comm"
    assert seen["command"] == "python -m benchmarks.regress"
    assert regress.main(["--against-commit", "d677f4a"]) == 0  # flagged, but not --strict
