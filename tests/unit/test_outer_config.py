"""The job's --outer-* section (shardfusion.train.outer_config): its checks and refusals, in one process. The runs
themselves: tests/integration/test_train_diloco.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfusion.train import outer_config as oc
from shardfusion.train.config import JobConfig

ON = dict(outer_sync="diloco", fsdp_outer_degree=2)
LOSS_RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "diloco-loss.json"


@pytest.mark.parametrize("fields, words", [
    ({"outer_sync": "sometimes"}, "--outer-sync must be every-step or diloco, got 'sometimes'"),
    ({"outer_every": 8}, "--outer-every needs --outer-sync diloco"),
    ({"outer_fragments": 2}, "--outer-fragments needs --outer-sync diloco"),
    ({**ON, "outer_every": 0}, "--outer-every 0 must be >= 1"),
    ({**ON, "outer_lr": 0.0}, "--outer-lr 0.0 must be > 0"),
    ({**ON, "outer_momentum": 1.0}, "--outer-momentum 1.0 must be in [0, 1)"),
    ({**ON, "outer_every": 4, "outer_fragments": 5}, "--outer-fragments 5 must be in 1 .. --outer-every 4"),
    ({**ON, "cp": 2}, "--cp 2 with --outer-sync diloco"),
    ({**ON, "optimizer": "muon"}, "--optimizer muon with --outer-sync diloco"),
    ({**ON, "experts": 4, "expert_policy": "shard"}, "--expert-policy shard with --outer-sync diloco"),
])
def test_check_flags_refusals(fields: dict, words: str) -> None:
    with pytest.raises(ValueError) as error:
        (JobConfig.from_flat(**fields)).check_section("outer")
    assert str(error.value).startswith(words), str(error.value)


def test_defaults_pass_and_layout_needs_replicas() -> None:
    (JobConfig()).check_section("outer")
    (JobConfig.from_flat(**ON, outer_every=32, outer_fragments=4)).check_section("outer")
    (JobConfig.from_flat(**ON, pp=2, outer_fragments=2)).check_section("outer")  # one outer step per stage
    assert not oc.enabled(JobConfig().outer) and oc.enabled(JobConfig.from_flat(**ON).outer)
    def check_layout(**fields) -> None:
        config = JobConfig.from_flat(**fields)
        oc.check_layout(config.outer, config.parallelism.fsdp_outer_degree, "--nproc 4")

    check_layout(**ON)
    check_layout(fsdp_outer_degree=1)  # every-step: nothing to check
    for outer in (1, "auto"):
        with pytest.raises(ValueError, match=rf"^--outer-sync diloco needs replicas: --fsdp-outer-degree {outer} "
                                             r"\(--nproc 4\)"):
            check_layout(outer_sync="diloco", fsdp_outer_degree=outer)


FT = dict(ft_lighthouse="http://127.0.0.1:1", ft_replica_id=0, out="runs/x")


def test_diloco_runs_across_fault_tolerant_replica_groups() -> None:
    """--ft-lighthouse with --outer-sync diloco: the replicas are the replica groups (each of outer degree 1, as
    resolve makes it), so the layout needs --ft-replicas >= 2 instead of an outer degree; the runs themselves:
    tests/integration/test_train_ft.py (parity with HSDP and a group killed between outer steps)."""
    config = JobConfig.from_flat(outer_sync="diloco", ft_replicas=2, **FT)
    config.check_section("outer")
    oc.check_layout(config.outer, 1, "--nproc 2", config.ft)
    one = JobConfig.from_flat(outer_sync="diloco", ft_replicas=1, **FT)
    with pytest.raises(ValueError, match=r"^--outer-sync diloco needs replicas: --ft-replicas 1 \(under fault "):
        oc.check_layout(one.outer, 1, "--nproc 2", one.ft)


def test_the_default_outer_optimizer_is_the_measured_one() -> None:
    """The job's default outer optimizer and H are those of the stored measurement (`python -m
    benchmarks.diloco_loss`: the default run, seeds 42, 43, 44, synchronous and DiLoCo interleaved), and its final
    validation loss averaged over the seeds is closer to the synchronous runs' than the paper's outer optimizer,
    measured beside it and still reachable by its flags. The result records its verdict on the 3 % goal."""
    result = json.loads(LOSS_RESULT.read_text())
    assert result["seeds"] == [42, 43, 44] and result["extra"] == [], result["command"]
    table = result["table"]
    default, paper = table["diloco"]["outer"], table["diloco-paper"]["outer"]
    config = JobConfig.from_flat(**ON)
    assert (default["lr"], default["momentum"], default["every"]) == (
        config.outer.outer_lr, config.outer.outer_momentum, config.outer.outer_every)
    assert (paper["lr"], paper["momentum"], paper["every"]) == (0.7, 0.9, config.outer.outer_every)
    (JobConfig.from_flat(**ON, outer_lr=0.7, outer_momentum=0.9)).check_section("outer")
    ratio = table["diloco"]["ratio_of_means"]
    assert ratio < table["diloco-paper"]["ratio_of_means"] - 0.05, table
    assert result["goal"] == {"ratio_of_means": ratio, "limit": 1.03, "met": ratio <= 1.03}
