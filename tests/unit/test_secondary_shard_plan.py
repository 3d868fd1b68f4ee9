"""hpZ's figures in one process: the node slices and their refusal (``shardfusion/_runtime/secondary_shard.py``),
the cost model's bytes and memory with ``sf.plan(..., secondary_shard=True)`` against the formulas of
docs/secondary-shard.md, and the dry run's copy (on torch's fake process group) against the flat buffers' sizes.
The runs themselves: tests/distributed/test_secondary_shard.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import shardfusion as sf
from shardfusion._runtime import secondary_shard
from shardfusion.models.gpt import GPT, Block, GPTConfig
from shardfusion.plan import Bandwidth, UnitSize

SLOW = Bandwidth(within=1e9, across=1e7, latency_within=0.0, latency_across=0.0)
UNITS = [UnitSize("", 4096, reshard_after_forward=False), UnitSize("b0", 65536), UnitSize("b1", 65536)]


def test_node_slices_and_unequal_slices_refused() -> None:
    assert secondary_shard.node_slices([[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    topo = SimpleNamespace(group_ranks=lambda kind: [[0, 1, 2], [3, 4, 5]], ranks_per_node=2,
                           describe=lambda: "world 6 = sharding3")
    with pytest.raises(ValueError, match=r"secondary_shard=True: the fsdp_inner groups \(of 3 ranks\) have \[1, 2\] "
                                         r"ranks on a node with ranks_per_node=2"):
        secondary_shard.check(topo, ("fsdp_inner",))


def _plan(outer: int, on: bool, **kw):
    p = sf.plan(UNITS, world_size=4, local_world_size=2, bandwidth=SLOW, max_memory_per_rank=2**40,
                micro_batches=2, outer_degrees=[outer], secondary_shard=on, **kw)
    return p.chosen, p.table()


@pytest.mark.parametrize("wire, gather_bytes", [(None, 4), ("int8", 1 + 4 / 256)])
def test_plan_moves_the_backward_all_gather_into_the_node(wire, gather_bytes) -> None:
    off, _ = _plan(1, False, all_gather_dtype=wire)
    on, table = _plan(1, True, all_gather_dtype=wire)
    n = 65536 * gather_bytes  # the wire copy of a block (P = 65536: a multiple of 4 x 4)
    ag_off, ag_on = off.traffic["all_gather"], on.traffic["all_gather"]
    # per block and micro-batch: the forward's all-gather over 4 ranks on 2 nodes unchanged; the backward's, of
    # (4-1)/4 n with 2 of 4 ring hops across, becomes one over the 2 ranks of the node: (2-1)/2 n, none across
    assert ag_on.count == ag_off.count
    assert ag_on.across_bytes == pytest.approx(ag_off.across_bytes - 2 * 2 * 0.75 * n * 0.5)
    assert ag_on.within_bytes == pytest.approx(ag_off.within_bytes - 2 * 2 * 0.75 * n * 0.5 + 2 * 2 * 0.5 * n)
    assert on.step_s < off.step_s
    assert on.memory["secondary"] == pytest.approx(2 * n / 2, abs=2) and "secondary" not in off.memory
    assert on.memory_bytes == off.memory_bytes + on.memory["secondary"]
    assert "hpZ: backward all-gathers within the node" in table


def test_plan_says_when_it_changes_nothing() -> None:
    inner_in_node, table = _plan(2, True)  # inner 2 = one node
    assert "secondary_shard changes nothing: no sharding group spans nodes" in table
    assert dataclasses.replace(inner_in_node, secondary="") == _plan(2, False)[0]  # the same figures
    kept = [UnitSize(u.name, u.numel, reshard_after_forward=False) for u in UNITS]
    p = sf.plan(kept, world_size=4, local_world_size=2, bandwidth=SLOW, max_memory_per_rank=2**40,
                outer_degrees=[1], secondary_shard=True)
    assert "changes nothing: no unit is resharded after forward" in p.table()


CONFIG = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32)


def _step(model, topo):
    x = torch.randint(0, 256, (2, CONFIG.seq_len))
    return model(x, x)[1]


def test_dry_run_counts_the_copies_and_says_so() -> None:
    kwargs = dict(world_size=8, ranks_per_node=4, bounds=False, plan_model=False)
    shard = {"units": (Block,), "secondary_shard": True}
    report = sf.dry_run(lambda topo: GPT(CONFIG), _step, fully_shard=shard, **kwargs)
    m = report.ranks[0].memory
    with torch.device("meta"):
        block = sum(p.numel() for p in Block(CONFIG).parameters())
    # every block's copy alive at the end of the forward: 1/L of its (padded) fp32 buffer each, L = 4 ranks of the
    # sharding group of 8 on each node of 4
    assert CONFIG.n_layer * block * 4 / 4 <= m["secondary_params"] <= 1.05 * CONFIG.n_layer * block * 4 / 4
    rows = [c for c in report.ranks[0].collectives if c["label"] == "fsdp_inner_node"]
    assert rows and rows[0]["group_size"] == 4 and rows[0]["across_bytes"] == 0
    assert any("secondary_shard: the backward's all-gathers" in n for n in report.notes)
    assert "secondary_params" in report.table()
    one_node = sf.dry_run(lambda topo: GPT(CONFIG), _step, fully_shard=shard,
                          **{**kwargs, "ranks_per_node": 8})
    assert one_node.ranks[0].memory["secondary_params"] == 0
    assert any("secondary_shard changes nothing" in n for n in one_node.notes)


@pytest.mark.parametrize("mode", ["hsdp", "fsdp-tp", "diloco", "streaming-diloco", "pp", "ft", "dry-run"])
def test_job_flag_reaches_the_library_in_every_mode(mode: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--secondary-shard in every mode of the job (the modes of tests/unit/test_train_dtype_flags.py), through the
    job's own path: the command line, the checks against the world, and the `fully_shard` keywords every mode builds
    its model with (`parallelize.shard_options`; the dry run's, handed to `sf.dry_run`, which is stubbed)."""
    from test_train_dtype_flags import MODES, dry_run_fully_shard

    from shardfusion.train import parallelize
    from shardfusion.train.config import check_run, parse_args, resolve

    extra, world = MODES[mode]
    argv = ["--preset", "tiny", "--out", str(tmp_path / "run"), *extra, "--secondary-shard"]
    if mode == "dry-run":
        assert dry_run_fully_shard(argv, monkeypatch)["secondary_shard"] is True
        return
    config = resolve(parse_args(argv), device="cpu", world_size=world)
    check_run(config, world=f"--nproc {world}")
    assert parallelize.shard_options(config.parallelism, config.precision)["secondary_shard"] is True
    off = resolve(parse_args(argv[:-1]), device="cpu", world_size=world)
    assert "secondary_shard" not in parallelize.shard_options(off.parallelism, off.precision)  # off: as before
