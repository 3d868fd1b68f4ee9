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
