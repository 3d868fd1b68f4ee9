"""The dry run (shardfusion.dry_run) in this process, on torch's fake process group: its figures against theory (the
flat buffers' sizes, the step's collectives, the cost model's bytes, which sf.plan computes from formulas, not from
the runtime), the kinds of rank it plays, the even MoE router it assumes, and its argument errors. The comparison
with measured runs of real processes: tests/distributed/test_dry_run.py and benchmarks/dry_run_check.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

import shardfusion as sf
from shardfusion.dry_run import kinds_of, link_terms
from shardfusion.models.gpt import GPT, Block, GPTConfig
from shardfusion.moe import _even_routing
from shardfusion.plan import Bandwidth, _size
from shardfusion.topology import Degrees

CONFIG = GPTConfig(n_layer=3, n_head=2, d_model=64, seq_len=32)
BATCH = 2


def _build(topo):
    return GPT(CONFIG, ep_group=topo.get_group("ep") if CONFIG.n_experts else None)


def _step(model, topo):
    x = torch.randint(0, 256, (BATCH, CONFIG.seq_len))  # fake tensors inside the dry run
    return model(x, x)[1]


@pytest.fixture(scope="module")
def w1024():
    """A 1,024-rank HSDP job: nodes of 8, inner 8 (one node), 128 replicas."""
    return sf.dry_run(_build, _step, world_size=1024, ranks_per_node=8, topology={"fsdp_outer_degree": 128},
                      fully_shard={"units": (Block,)})


def test_memory_is_the_shards_and_adamw_state(w1024) -> None:
    (rank,) = w1024.ranks
    assert rank.kind == "all ranks" and rank.rank == 0
    elements = sum(p.numel() for p in _build_meta().parameters())  # a tied weight once
    # fp32 shards over inner 8; shards cut on row boundaries pad a small model by a few % (2.4 % here; the table in
    # docs/shape-true-parameters.md)
    shard_bytes = rank.memory["params"]
    assert elements / 8 * 4 <= shard_bytes <= 1.05 * elements / 8 * 4
    assert rank.memory["grads"] == shard_bytes
    # AdamW: two fp32 moments per element, and a 0-dim fp32 step per parameter
    assert rank.memory["optimizer"] == 2 * shard_bytes + 4 * len(list(_build_meta().parameters()))
    # one unit at a time gathered, plus the prefetched one and the root: never the whole model
    assert rank.memory["largest_full_unit"] > 0
    assert rank.memory["full_params"] < 8 * shard_bytes
    assert rank.memory["activations"] > 0 and rank.memory["peak"] >= rank.memory["params"] + rank.memory["grads"]


def _build_meta():
    with torch.device("meta"):
        return GPT(CONFIG)


def test_collectives_follow_the_step(w1024) -> None:
    rows = {(c["op"], c["label"]): c for c in w1024.ranks[0].collectives}
    n = CONFIG.n_layer
    gather = rows[("all_gather", "fsdp_inner+expert_inner")]
    assert gather["count"] == 2 * n + 1 and gather["group_size"] == 8  # blocks twice (after_forward), root once
    assert gather["across_bytes"] == 0  # the inner group is one node
    scatter = rows[("reduce_scatter", "fsdp_inner_reduce+expert_inner_reduce")]
    assert scatter["count"] == n + 1 and scatter["across_bytes"] == 0
    replicate = rows[("all_reduce", "replicate")]
    assert replicate["count"] == n + 1 and replicate["group_size"] == 128
    # a ring over 128 ranks on 128 nodes: every hop crosses a node
    assert replicate["within_bytes"] == 0 and replicate["across_bytes"] == pytest.approx(replicate["wire_bytes"])


def test_bytes_equal_the_cost_model(w1024) -> None:
    """The runtime's recorded bytes (dry run) against sf.plan's formulas for the same layout."""
    rank, plan = w1024.ranks[0], w1024.plan
    bulk = [c for c in rank.collectives if c["label"] != "world"]  # the clipping scalar is not in the model
    assert sum(c["within_bytes"] for c in bulk) == pytest.approx(plan.within_bytes, rel=1e-9)
    assert sum(c["across_bytes"] for c in bulk) == pytest.approx(plan.across_bytes, rel=1e-9)
    assert plan.outer == 128 and plan.inner == 8 and plan.step_s > 0
    text = w1024.table()
    assert "world 1024 = 128 nodes x 8 ranks" in text and "predicted step" in text


def test_quantized_reduce_scatter_bytes_equal_the_cost_model() -> None:
    """grad_comm_dtype="int8" on a sharding group over 2 nodes: the reduce-scatters recorded in int8 (a byte and a
    scale per block of each rank's shard, the all-to-all's split: across nodes the bytes to the other node's ranks),
    against sf.plan's formulas (1 + 4/256 bytes per element; the plan ignores a shard's partial last block)."""
    mp = sf.MixedPrecisionPolicy(grad_comm_dtype="int8")
    runs = [sf.dry_run(_build, _step, world_size=16, ranks_per_node=8, topology={"fsdp_outer_degree": 1},
                       fully_shard={"units": (Block,), **kw}) for kw in ({}, {"mp_policy": mp})]
    fp32, int8 = ({c["op"]: c for c in r.ranks[0].collectives} for r in runs)
    assert int8["reduce_scatter"]["count"] == fp32["reduce_scatter"]["count"] == CONFIG.n_layer + 1
    ratio = int8["reduce_scatter"]["wire_bytes"] / fp32["reduce_scatter"]["wire_bytes"]
    assert 0.25 < ratio < 0.26
    assert int8["reduce_scatter"]["across_bytes"] == pytest.approx(8 / 15 * int8["reduce_scatter"]["wire_bytes"])
    bulk = [c for c in runs[1].ranks[0].collectives if c["label"] != "world"]
    for part in ("within_bytes", "across_bytes"):
        assert sum(c[part] for c in bulk) == pytest.approx(getattr(runs[1].plan, part), rel=1e-4)


def test_memory_budget_verdict(w1024) -> None:
    """--max-memory-per-rank / max_memory_per_rank: each kind of rank's peak against the budget, by how much, and the
    largest parts of the peak (the parts the live-memory sample at the peak adds up from)."""
    (rank,) = w1024.ranks
    m, parts = rank.memory, {k: v for k, v in rank.peak_parts.items() if k != "slow"}
    assert sum(parts.values()) == m["peak"] and sum(rank.peak_parts["slow"].values()) == m["peak_slow"]
    short = rank.budget(m["peak"] - 2**20)
    assert (short["fits"], short["headroom"]) == (False, -2**20)
    assert short["largest"][0] == max(parts.items(), key=lambda kv: kv[1])
    roomy = rank.budget(m["peak_slow"] + 2**30)
    assert roomy["fits"] and roomy["fits_slow"] and roomy["headroom_slow"] == 2**30
    text = dataclasses.replace(w1024, max_memory_per_rank=m["peak"] - 2**20).table()
    assert "does not fit by 1.00 MiB at the peak" in text and "largest parts of the peak: " in text
    assert "budget" not in w1024.table()  # no budget given: no verdict


def test_transient_peak_by_part_and_unit(w1024) -> None:
    """The transient memory (live bytes beyond parameters, gradients and optimizer state at its peak): what its
    parts add up to, the units whose full buffers are alive then (the root and the last two blocks at the start of
    backward: 3 blocks, prefetch 1), one figure whatever the collectives' timing, and its line in the report."""
    (rank,) = w1024.ranks
    m, at = rank.memory, rank.transient_peak
    kept = ("params", "grads", "optimizer")
    assert m["transient"] == sum(v for k, v in at["parts"].items() if k not in kept) > 0
    assert m["transient_slow"] == m["transient"] and m["full_grads_slow"] == m["full_grads"]
    assert set(at["units"]["full_params"]) == {"", "blocks.1", "blocks.2"}, at["units"]
    assert sum(at["units"]["full_params"].values()) == at["parts"]["full_params"]
    assert at["parts"]["activations"] > 0
    assert f"transient {_size(m['transient'])} (a later step peaks at" in w1024.table()


def test_live_memory_parts_by_origin() -> None:
    """LiveMemory counts a storage outside the watched parts where it came from: the phase it was made in, or a
    collective it was passed to; a watched storage counts in its watched part; a freed one leaves its part."""
    from shardfusion.live_memory import LiveMemory

    kept = torch.zeros(256)  # 1 KiB
    tracker = LiveMemory(lambda: {"params": {kept.untyped_storage()._cdata: kept.untyped_storage()}})
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with tracker:
            tracker.phase = "activations"
            act = torch.ones(512)  # 2 KiB
            tracker.phase = "optimizer_step"
            tmp = torch.ones(1024)  # 4 KiB
            tracker.phase = "other"
            sent = torch.ones(2048)  # 8 KiB, then passed to a collective
            dist.all_reduce(sent)
            parts = tracker.sample().parts
            assert (parts["params"], parts["activations"], parts["optimizer_step"], parts["comm_buffers"]) == (
                1024, 2048, 4096, 8192), parts
            del tmp
            assert tracker.sample().parts["optimizer_step"] == 0
            assert tracker.transient_peak.transient == 2048 + 4096 + 8192 + parts["other"]
        with pytest.raises(ValueError, match="phase must be one of"):
            tracker.phase = "forward"
    finally:
        dist.destroy_process_group()
    del act, sent


def test_cross_node_time_in_latency_and_bandwidth_terms(w1024) -> None:
    """The cost model's time within and across nodes = bytes / bandwidth + ring steps x latency, each term shown;
    the steps counted here from the collectives: G - 1 per all-gather and reduce-scatter on the inner groups of 8
    (one node), 2 (G - 1) per all-reduce over the 128 replicas (on 128 nodes)."""
    p, bw = w1024.plan, w1024.bandwidth
    within, across = link_terms(p, bw)
    steps_within = (p.traffic["all_gather"].count + p.traffic["reduce_scatter"].count) * 7
    steps_across = p.traffic["all_reduce"].count * 2 * 127
    assert p.across_s == pytest.approx(p.across_bytes / bw.across + steps_across * bw.latency_across)
    assert across == (f"across nodes {p.across_s * 1e3:.3f} ms = bytes {p.across_bytes / 1e6:.3f} MB / 25.00 GB/s = "
                      f"{p.across_bytes / bw.across * 1e3:.3f} ms + latency {steps_across:,} ring steps x 15 us = "
                      f"{steps_across * 15e-3:.3f} ms (all_reduce {steps_across:,}): latency-bound")
    assert within.startswith(f"within nodes {p.within_s * 1e3:.3f} ms = bytes {p.within_bytes / 1e6:.3f} MB / "
                             f"150.00 GB/s")
    assert f"latency {steps_within:,} ring steps x 5 us" in within
    assert across in w1024.table()


def test_the_job_passes_its_memory_budget(monkeypatch, capsys) -> None:
    """--max-memory-per-rank reaches the dry run in bytes, with the units of parse_bytes."""
    from shardfusion.train import job_dry_run
    from shardfusion.train.config import parse_args

    seen = {}

    def fake_dry_run(build, step, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(sf, "dry_run", fake_dry_run)
    with pytest.raises(ValueError, match="stop here"):
        job_dry_run.run(parse_args(["--dry-run", "--world", "64", "--preset", "tiny", "--max-memory-per-rank", "80GB"]))
    assert seen["max_memory_per_rank"] == 80 * 10**9
    assert parse_args(["--max-memory-per-rank", "74.5GiB"]).parallelism.max_memory_per_rank == int(74.5 * 2**30)


def test_async_save_staging_copy(monkeypatch) -> None:
    """async_save=True (the job's --async-save): each kind of rank reports the staging copy of an asynchronous
    checkpoint save, host memory beside the peak: on FSDP (every rank writes its fragments) its shards and their
    AdamW state, step scalars included; without it, no such figure. The job passes its flag."""
    from shardfusion.train import job_dry_run
    from shardfusion.train.config import parse_args

    kwargs = dict(world_size=16, ranks_per_node=8, fully_shard={"units": (Block,)}, bounds=False, plan_model=False)
    report = sf.dry_run(_build, _step, async_save=True, **kwargs)
    m = report.ranks[0].memory
    assert m["staging"] == m["params"] + m["optimizer"] > 0  # no persistent buffers in the GPT
    assert "async save: staging copy " in report.table() and "for a node of 8 such ranks" in report.table()
    plain = sf.dry_run(_build, _step, **kwargs)
    assert "staging" not in plain.ranks[0].memory and "async save" not in plain.table()
    seen = {}

    def fake_dry_run(build, step, **given):
        seen.update(given)
        raise ValueError("stop here")

    monkeypatch.setattr(sf, "dry_run", fake_dry_run)
    for flags, expected in ((["--async-save"], True), ([], False)):
        with pytest.raises(ValueError, match="stop here"):
            job_dry_run.run(parse_args(["--dry-run", "--world", "16", "--preset", "tiny", *flags]))
        assert seen["async_save"] is expected


def test_pipeline_stages_are_the_kinds() -> None:
    assert kinds_of(Degrees(world_size=16)) == [(0, "all ranks")]
    assert kinds_of(Degrees(world_size=16, pp=2)) == [(0, "pp stage 0"), (8, "pp stage 1")]
    assert [r for r, _ in kinds_of(Degrees(world_size=32, pp=4, fsdp_outer_degree=2))] == [0, 8, 16, 24]


def test_even_router() -> None:
    # 10 assignments over 4 experts on 2 ep ranks: 3, 3, 2, 2
    assert _even_routing(10, 4, 2, 0) == {"send": [6, 4], "recv": [6, 6], "expert_sizes": [6, 6]}
    assert _even_routing(10, 4, 2, 1) == {"send": [6, 4], "recv": [4, 4], "expert_sizes": [4, 4]}
    for rank in range(4):
        plan = _even_routing(1000, 8, 4, rank)
        assert sum(plan["send"]) == 1000 and sum(plan["recv"]) == sum(plan["expert_sizes"])


def test_moe_expert_ranks() -> None:
    global CONFIG
    saved, CONFIG = CONFIG, GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32, n_experts=4, top_k=2)
    try:
        report = sf.dry_run(_build, _step, world_size=64, ranks_per_node=8, topology={"fsdp_outer_degree": 8, "ep": 2},
                            fully_shard={"units": (Block,)})
    finally:
        CONFIG = saved
    rows = {c["op"]: c for c in report.ranks[0].collectives if c["op"] == "all_to_all"}
    # dispatch and combine per layer, forward and backward, plus the counts exchange: 5 per layer
    assert rows["all_to_all"]["count"] == 2 * 5 and rows["all_to_all"]["across_bytes"] == 0
    assert any("even router" in n for n in report.notes)


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
    ({"ranks_per_node": 3}, "ranks_per_node(3) must divide world_size(16)"),
    ({"backend": "mpi"}, "backend must be 'nccl' or 'gloo', got 'mpi'"),
    ({"fully_shard": {"device": "cpu"}}, "fully_shard: a dry run picks the device itself"),
    ({"ranks": [16]}, "ranks: 16 is not a rank of world_size(16)"),
    ({"topology": {"fsdp_outer_degree": 3}}, "fsdp_outer_degree"),
    ({"micro_batches": 0}, "micro_batches must be an int >= 1, got 0"),
    ({"topology": {"outer": 2}}, "topology: unknown keyword(s) ['outer']"),
    ({"fully_shard": {"unit": (Block,)}}, "fully_shard: unknown keyword(s) ['unit']"),
    ({"bandwidth": Bandwidth(within=0, across=1e9)}, "bandwidth.within must be a number > 0, got 0"),
    ({"max_memory_per_rank": 0}, "max_memory_per_rank must be an int >= 1, got 0"),
])
def test_argument_errors(kwargs: dict, words: str) -> None:
    args = {"world_size": 16, "ranks_per_node": 8, **kwargs}
    with pytest.raises(ValueError) as error:
        sf.dry_run(_build, _step, **args)
    assert words in str(error.value), str(error.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("step, kwargs, words", [
    (lambda model, topo: None, {}, "step(model, topo) must return the micro-batch's loss, a 0-dim tensor, got None"),
    (lambda model, topo: model(torch.randint(0, 256, (2, 8)))[0], {}, "got a tensor of shape (2, 8, 256)"),
    (_step, {"step_runs_backward": True}, "step_runs_backward=True: step must run the backward itself"),
    (_step, {"optimizer": lambda params: None}, "optimizer(params) must return a torch.optim.Optimizer"),
])
def test_step_contract(step, kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as error:
        sf.dry_run(_build, step, world_size=16, ranks_per_node=8, fully_shard={"units": (Block,)},
                   plan_model=False, bounds=False, **kwargs)
    assert words in str(error.value), str(error.value)
    assert not dist.is_initialized()  # the fake group is gone: the next dry run starts clean


def test_refused_beside_a_process_group() -> None:
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="dry_run needs a process without a process group"):
            sf.dry_run(_build, _step, world_size=16, ranks_per_node=8)
    finally:
        dist.destroy_process_group()


def test_context_and_expert_parallel_step(tmp_path, capsys) -> None:
    """--cp 2 with the GPT-MoE at --ep 2, as the job plays one step of it at 4 ranks (sharding 2 = ep 2): each
    MoE layer's all-to-alls run over the ep group of 2, and the attention's key/value all-gathers over the cp group
    of 2 (named with the expert buffers' group of the same ranks). The pair's proof in the compatibility table (shardfusion/train/compat.py)."""
    from shardfusion.train import job_dry_run
    from shardfusion.train.config import parse_args

    out = tmp_path / "plan"
    job_dry_run.run(parse_args(["--dry-run", "--world", "4", "--preset", "tiny", "--experts", "4", "--ep", "2",
                                "--cp", "2", "--batch-size", "2", "--out", str(out)]))
    assert "world 4 = dp1 x pp1 x sharding2 (outer1 x inner2) x sep1 x cp2 x mp1; ep2" in capsys.readouterr().out
    (rank,) = json.loads((out / "dry-run.json").read_text())["report"]["ranks"]
    calls = {(c["op"], c["label"]): (c["group_size"], c["count"]) for c in rank["collectives"]}
    # 2 MoE layers x (3 all-to-alls in forward + 2 in backward)
    assert calls[("all_to_all", "ep")] == (2, 2 * (3 + 2))
    context = [k for k in calls if k[0] == "all_gather" and "cp" in k[1].split("+")]
    assert len(context) == 1 and calls[context[0]][0] == 2 and calls[context[0]][1] >= 2  # k/v of 2 layers
