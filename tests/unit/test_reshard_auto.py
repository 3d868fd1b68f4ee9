"""The reshard policy chosen by a memory budget (shardfusion.reshard_budget; ``fully_shard(...,
reshard_policy="auto", memory_budget=)``) in this process: the choice on hand-made unit facts (the order by
all-gather bytes per byte, ties last unit first, a unit that does not fit passed over, the extremes, units the
filter leaves out), the budget's argument errors, the cost model's choice per candidate (``sf.plan(...,
reshard_policy="auto")``), and the dry run on torch's fake process group: the choice a wrap makes, the budget it
respects in the measured step, its verdict in the report, and the same choice as the cost model's. The job's flag
--reshard-policy auto: its check, its dry run. Real processes: tests/distributed/test_reshard_auto_ranks.py; the job:
tests/integration/test_train_reshard_auto.py."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import shardfusion as sf
from shardfusion.models.gpt import GPT, Block, GPTConfig
from shardfusion.reshard_budget import UnitBytes, check_budget, choose, memory_parts

F = 1000  # bytes of one unit's full buffers in the hand-made cases


def _unit(name: str, full: int, group: int = 2) -> UnitBytes:
    """A unit of ``full`` bytes sharded over ``group`` ranks; no shards or gradients (the full buffers alone)."""
    return UnitBytes(name, 0, 0, 0, full, 0, Fraction((group - 1) * full, group))


def _choose(units: list[UnitBytes], budget: int, decided=None, prefetch: int = 0):
    decided = [True] * len(units) if decided is None else decided
    return choose(units, [True] * len(units), decided, budget, prefetch=prefetch)


def test_the_most_gather_bytes_per_byte_first() -> None:
    # prefetch 0: the 2 largest resharded units count; keeping one more unit costs F
    units = [_unit("a", F), _unit("b", F, group=4), _unit("c", F), _unit("d", F)]
    choice = _choose(units, 3 * F)
    assert choice.needs == (2 * F, 3 * F, 4 * F, 4 * F, 4 * F)
    assert choice.kept == ("b",) and choice.order[0] == 1  # 3/4 of its bytes gathered again, against 1/2


def test_equal_units_last_first() -> None:
    units = [_unit(n, F) for n in "abcd"]
    assert _choose(units, 3 * F).kept == ("d",)
    assert _choose(units, 4 * F - 1).kept == ("d",)
    assert _choose(units, 4 * F).kept == ("a", "b", "c", "d")  # 4F keeps two, and then every one fits


def test_a_unit_that_does_not_fit_is_passed_over() -> None:
    units = [_unit("a", F), _unit("b", 10 * F), _unit("c", 10 * F), _unit("d", 10 * F)]
    choice = _choose(units, 21 * F)
    assert choice.order == (3, 2, 1, 0)  # equal ratios: last first
    assert choice.kept == ("a",) and choice.memory_bytes == 21 * F and choice.fits


def test_extremes() -> None:
    units = [_unit("", 5 * F), *(_unit(f"b{i}", F) for i in range(6))]
    decided = [False] + [True] * 6
    nothing = choose(units, [False] + [True] * 6, decided, 1, prefetch=1)
    assert nothing.kept == () and not nothing.fits and nothing.reshard_after_forward == (False,) + (True,) * 6
    assert nothing.memory_bytes == nothing.needs[0] == 5 * F + 3 * F  # the root, prefetch + 2 resharded
    everything = choose(units, [False] + [True] * 6, decided, nothing.needs[-1], prefetch=1)
    assert everything.reshard_after_forward == (False,) * 7 and everything.needs[-1] == 11 * F
    assert everything.memory == memory_parts(units, [False] * 7, prefetch=1)


def test_units_the_policy_does_not_decide_keep_their_setting() -> None:
    units = [_unit("", F), *(_unit(f"b{i}", F) for i in range(4))]
    # b0 left out by the filter: kept gathered by the user's choice, counted first
    choice = choose(units, [False, False, True, True, True], [False, False, True, True, True], 10 * F, prefetch=0)
    assert choice.decided == (False, False, True, True, True) and 1 not in choice.order
    assert choice.needs[0] == 2 * F + 2 * F and choice.reshard_after_forward[:2] == (False, False)
    assert choice.kept == ("b1", "b2", "b3")


def test_the_choice_counts_what_the_plan_counts() -> None:
    unit = UnitBytes("b", shard_bytes=400, grad_shard_bytes=400, optim_elems=100, full_bytes=800, grad_bytes=800,
                     gather_bytes=Fraction(400))
    parts = memory_parts([unit, unit], [True, False], prefetch=1)
    assert parts == {"params": 800, "grads": 800, "optimizer": 2 * 100 * 2 * 4, "unsharded": 800 + 800 + 1600,
                     "other": 0}


@pytest.mark.parametrize("policy, budget, words", [
    ("auto", None, "needs memory_budget"), ("auto", 0, "got 0"), ("auto", -5, "got -5"), ("auto", True, "True"),
    ("auto", 1.5, "1.5"), ("after_forward", 10**9, "memory_budget(1000000000) is read only by reshard_policy='auto'"),
    ("after_backward", 10, "got reshard_policy='after_backward'")])
def test_bad_budgets(policy, budget, words) -> None:
    with pytest.raises(ValueError, match=r"memory_budget") as error:
        check_budget(policy, budget)
    assert words in str(error.value)


# ---- the cost model ------------------------------------------------------------------------------------------------
CONFIG = GPTConfig(n_layer=6, n_head=2, d_model=64, seq_len=32)


def _meta() -> GPT:
    with torch.device("meta"):
        return GPT(CONFIG)


def _plan(policy: str, budget: int, outer: int = 2, param_dtype=None):
    return sf.plan(_meta(), units=(Block,), world_size=8, local_world_size=8, bandwidth=sf.Bandwidth(1e9, 1e9),
                   max_memory_per_rank=budget, reshard_policy=policy, outer_degrees=[outer], param_dtype=param_dtype)


def test_plan_chooses_per_candidate_within_the_budget() -> None:
    needs = _plan("auto", 2**62).chosen.reshard.needs
    assert len(needs) == CONFIG.n_layer + 1 and needs[0] < needs[2] < needs[-1]
    two = _plan("auto", needs[2]).chosen
    assert two.reshard.kept == ("blocks.4", "blocks.5") and two.memory_bytes <= needs[2] and two.fits
    assert two.traffic["all_gather"].count == 1 + 2 * CONFIG.n_layer - 2  # the root once, 4 blocks twice
    # the extremes are the fixed policies, bytes, seconds and memory alike
    for budget, policy in ((needs[-1], "after_backward"), (needs[0], "after_forward")):
        got, fixed = _plan("auto", budget).chosen, _plan(policy, 2**62).chosen
        assert (got.memory, got.traffic, got.step_s) == (fixed.memory, fixed.traffic, fixed.step_s), policy
    with pytest.raises(ValueError, match=r"max_memory_per_rank\(\d+ bytes"):
        _plan("auto", needs[0] - 1)  # not even every block resharded fits: no candidate
    assert "kept 2/6" in _plan("auto", needs[2]).table()


# ---- the dry run -------------------------------------------------------------------------------------------------
def _build(topo):
    return GPT(CONFIG)


def _step(model, topo):
    x = torch.randint(0, 256, (2, CONFIG.seq_len))
    return model(x, x)[1]


def _dry(budget: int, **fully_shard):
    return sf.dry_run(_build, _step, world_size=8, ranks_per_node=8, topology={"fsdp_outer_degree": 2},
                      fully_shard={"units": (Block,), "reshard_policy": "auto", "memory_budget": budget,
                                   **fully_shard}, bounds=False, plan_model=not fully_shard)


def test_dry_run_respects_the_budget_and_states_the_verdict() -> None:
    needs = _plan("auto", 2**62).chosen.reshard.needs
    report = _dry(needs[2])
    (rank,) = report.ranks
    (choice,) = rank.reshard
    assert choice["kept"] == ["blocks.4", "blocks.5"] and tuple(choice["needs"]) == needs  # the plan's estimate
    m = rank.memory
    measured = m["params"] + m["grads"] + m["optimizer"] + m["full_params"] + m["full_grads"]
    assert measured <= choice["memory_bytes"] <= choice["budget"] == needs[2]
    assert report.plan.reshard is None and report.plan.traffic["all_gather"].count == 1 + 2 * CONFIG.n_layer - 2
    gathers = {c["op"]: c["count"] for c in rank.collectives}["all_gather"]
    assert gathers == 1 + 2 * CONFIG.n_layer - 2  # the wrap's choice runs: 2 blocks are not gathered again
    table = report.table()
    assert "reshard policy auto: 2 of 6 units kept gathered (blocks.4, blocks.5)" in table and ": fits, " in table
    short = _dry(needs[0] - 1)
    assert short.ranks[0].reshard[0]["kept"] == [] and "(does not fit by 1 B), measured" in short.table()


def test_dry_run_under_mixed_precision_counts_the_bf16_buffers() -> None:
    needs = _plan("auto", 2**62, param_dtype=torch.bfloat16).chosen.reshard.needs
    assert needs != _plan("auto", 2**62).chosen.reshard.needs  # the full buffers are bf16: half the bytes
    (rank,) = _dry(needs[1], mp_policy=sf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)).ranks
    (choice,) = rank.reshard
    assert choice["kept"] == ["blocks.5"] and tuple(choice["needs"]) == needs
    m = rank.memory
    assert m["params"] + m["grads"] + m["optimizer"] + m["full_params"] + m["full_grads"] <= choice["memory_bytes"]


def test_job_flag_needs_a_budget_and_the_dry_run_reports_the_choice(capsys) -> None:
    from shardfusion.train import job_dry_run
    from shardfusion.train.config import JobConfig, build_parser

    def config(*flags: str) -> JobConfig:
        return JobConfig.from_flat(**vars(build_parser().parse_args(
            ["--preset", "tiny", "--experts", "0", "--n-layer", "6", "--data-bytes", "300000", *flags])))

    with pytest.raises(ValueError, match=r"^--reshard-policy auto needs --max-memory-per-rank \(bytes per rank"):
        config("--reshard-policy", "auto").validate()
    job_dry_run.run(config("--dry-run", "--world", "4", "--reshard-policy", "auto", "--max-memory-per-rank", "64GB"))
    out = capsys.readouterr().out
    assert "reshard policy auto: 6 of 6 units kept gathered" in out and "measured" in out
