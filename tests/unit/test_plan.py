"""The outer-degree cost model (`shardfusion.plan`) in one process: hand-computed bytes, seconds and memory of every
candidate for known unit sizes and bandwidths, the choice (a slow link across nodes: HSDP; equal links and a tight
budget: plain FSDP; nothing fits: ValueError), `unit_sizes` against a hand-laid-out model, the job's
`--fsdp-outer-degree auto` / `--max-memory-per-rank` flags and `parse_bytes`. The job with auto on 4 gloo ranks is
in tests/integration/test_train.py.

The numbers below: world 4 = 2 nodes x 2 ranks, fp32, 1 micro-batch, prefetch 1, a root unit of 1000 elements (never
resharded) and 2 blocks of 4000 (resharded after forward). Padding: to a multiple of inner * 4 elements (16 bytes),
so the root is 1008 elements at inner 4, 1000 at inner 2 and 1. Groups (topology.group_ranks): inner [0..3] at
outer 1 (a ring with 2 of its 4 hops across nodes: half the bytes cross), [0,1] [2,3] at outer 2 (within nodes);
replicate [0,2] [1,3] at outer 2 (every byte crosses), [0..3] at outer 4 (half crosses)."""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import shardfusion as sf
from shardfusion.plan import Bandwidth, UnitSize, parse_bytes, plan, unit_sizes
from shardfusion.train.config import JobConfig, check_run, parse_args, resolve

UNITS = [UnitSize("", 1000, 0, False), UnitSize("blocks.0", 4000), UnitSize("blocks.1", 4000)]
SLOW = Bandwidth(within=1e9, across=1e7)  # a cross-node link 100x slower than within a node
EQUAL = Bandwidth(within=1e9, across=1e9)
LAYOUT = dict(world_size=4, local_world_size=2)

# Per candidate, per rank and step, by hand (module docstring):
# outer 1: all-gathers 3/4 * (1008*4 B root once + 16000 B per block twice) = 3024 + 48000; reduce-scatters
#   3024 + 2 * 12000; half of it across: 39024 B within, 39024 B across. Memory: shard 252 + 2 * 1000 elements ->
#   9008 B params, 9008 grads, 18016 AdamW; unsharded 4032 (root) + 2 * 16000 (prefetch + 2 >= 2 blocks)
#   + 2 * 16000 (the 2 largest gradient buffers) = 68032.
# outer 2: all-gathers 1/2 * (4000 + 4 * 16000) = 34000 and reduce-scatters 1/2 * (4000 + 2 * 16000) = 18000, all
#   within; all-reduces of the shards 2 * 1/2 * (2000 + 2 * 8000) = 18000, all across. Memory: 4500 elements ->
#   18000 + 18000 + 36000, unsharded 4000 + 32000 + 32000.
# outer 4: no inner collectives; all-reduces 2 * 3/4 * (4000 + 2 * 16000) = 54000, half across. Memory: 9000
#   elements -> 36000 + 36000 + 72000, unsharded: the full buffers are the shards; gradients 32000.
EXPECTED = {  # outer: (within B, across B, memory B)
    1: (39024, 39024, 104064),
    2: (52000, 18000, 140000),
    4: (27000, 27000, 176000),
}


def by_outer(p) -> dict:
    return {c.outer: c for c in p.candidates}


def test_bytes_and_memory_by_hand() -> None:
    p = plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9)
    got = by_outer(p)
    assert sorted(got) == [1, 2, 4]
    for outer, (within, across, memory) in EXPECTED.items():
        c = got[outer]
        assert (c.within_bytes, c.across_bytes, c.memory_bytes) == (within, across, memory), outer
        assert c.inner == 4 // outer and c.fits
    assert got[1].memory == {"params": 9008, "grads": 9008, "optimizer": 18016, "unsharded": 68032, "other": 0}
    # counts per step: outer 1: 1 + 2*2 all-gathers, 3 reduce-scatters, no all-reduce; outer 4: 3 all-reduces only
    assert [got[1].traffic[op].count for op in ("all_gather", "reduce_scatter", "all_reduce")] == [5, 3, 0]
    assert [got[4].traffic[op].count for op in ("all_gather", "reduce_scatter", "all_reduce")] == [0, 0, 3]
    assert got[2].traffic["all_reduce"].within_bytes == 0 and got[2].traffic["all_reduce"].across_bytes == 18000


def test_times_and_the_overlapped_all_reduce_by_hand() -> None:
    got = by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9))
    for outer, (within, across, _) in EXPECTED.items():
        assert got[outer].within_s == pytest.approx(within / 1e9)
        assert got[outer].across_s == pytest.approx(across / 1e7)
        assert got[outer].serial_s == pytest.approx(within / 1e9 + across / 1e7)
    # outer 1 and 4: nothing to overlap (no all-reduce beside inner collectives): the step is serial
    assert got[1].step_s == pytest.approx(got[1].serial_s) and got[4].step_s == pytest.approx(got[4].serial_s)
    # outer 2: the last backward's inner collectives (root RS 2000 + blocks' AG 2*8000 + RS 2*8000 = 34000 B within,
    # 3.4e-5 s) run beside the blocks' all-reduces (16000 B across, 1.6e-3 s); the root's (2000 B, 2e-4 s) comes last:
    # max(3.4e-5, 1.6e-3) + 2e-4 replaces 3.4e-5 + 1.8e-3.
    assert got[2].step_s == pytest.approx(got[2].serial_s - 3.4e-5 - 1.8e-3 + 1.6e-3 + 2e-4)
    no_overlap = by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, overlap=False))
    assert no_overlap[2].step_s == pytest.approx(got[2].serial_s)


def test_latency_per_ring_step() -> None:
    bw = Bandwidth(within=1e9, across=1e7, latency_within=1e-6, latency_across=1e-4)
    c = by_outer(plan(UNITS, **LAYOUT, bandwidth=bw, max_memory_per_rank=10**9))[2]
    # within: 5 all-gathers + 3 reduce-scatters on groups of 2 (1 ring step each); across: 3 all-reduces, 2 steps each
    assert c.within_s == pytest.approx(52000 / 1e9 + 8 * 1e-6)
    assert c.across_s == pytest.approx(18000 / 1e7 + 3 * 2 * 1e-4)


def test_gloo_reduce_scatter_is_an_all_to_all() -> None:
    # At outer 1 a rank of [0..3] sends 1/4 of the input to each of its 3 peers, 2 of them on the other node: 2/3 of
    # the 27024 B cross (a ring would send 1/2 across).
    rs = by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, backend="gloo"))[1]
    rs = rs.traffic["reduce_scatter"]
    assert (rs.within_bytes, rs.across_bytes) == pytest.approx((9008, 18016))


def test_slow_link_chooses_hsdp() -> None:
    p = plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9)
    assert p.fsdp_outer_degree == 2 and p.chosen.outer == 2
    assert "outer 2 (inner 2): the fastest predicted step" in p.reason
    table = p.table()
    assert "2 nodes x 2 ranks" in table and table.count("\n") == len(p.candidates) + 3
    row = next(line for line in table.splitlines() if line.endswith("<- chosen"))
    assert row.split()[:2] == ["2", "2"] and "0.052" in row and "0.018" in row  # MB within / across
    assert table.splitlines()[-1] == f"chosen: {p.reason}"


def test_equal_links_and_a_tight_budget_choose_fsdp() -> None:
    # only outer 1 fits 110000 B: plain FSDP, the others named as not fitting
    p = plan(UNITS, **LAYOUT, bandwidth=EQUAL, max_memory_per_rank=110_000)
    assert p.fsdp_outer_degree == 1
    assert [c.fits for c in p.candidates] == [True, False, False]
    assert "does not fit: outer 2" in p.reason
    # With room for all: on equal links outer 2 (overlapped) and outer 4 both take 5.4e-5 s: a tie, the smaller wins.
    roomy = plan(UNITS, **LAYOUT, bandwidth=EQUAL, max_memory_per_rank=10**9)
    got = by_outer(roomy)
    assert got[2].step_s == pytest.approx(5.4e-5) and got[4].step_s == pytest.approx(5.4e-5)
    assert roomy.fsdp_outer_degree == 2 and "the smaller outer degree shards more" in roomy.reason
    # outer 1 (7.8e-5 s) is within 50% of them: with that tolerance it ties too and wins
    assert plan(UNITS, **LAYOUT, bandwidth=EQUAL, max_memory_per_rank=10**9, tie_tolerance=0.5).fsdp_outer_degree == 1


def test_full_buffers_follow_prefetch() -> None:
    # 4 blocks at outer 1: prefetch + 2 resharded blocks hold a full buffer at once (16000 B each), on top of the
    # root's 4032 B and the 2 largest gradient buffers (32000 B)
    units = [UnitSize("", 1000, 0, False)] + [UnitSize(f"blocks.{i}", 4000) for i in range(4)]
    for prefetch, blocks in ((0, 2), (1, 3), (2, 4), (5, 4)):
        c = by_outer(plan(units, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, prefetch=prefetch))[1]
        assert c.memory["unsharded"] == 4032 + blocks * 16000 + 32000, prefetch
    # nothing resharded after forward: every full buffer at once
    kept = [dataclasses.replace(u, reshard_after_forward=False) for u in units]
    c = by_outer(plan(kept, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9))[1]
    assert c.memory["unsharded"] == 4032 + 4 * 16000 + 32000 and c.traffic["all_gather"].count == 5


def test_nothing_fits_names_the_budget_and_the_smallest_need() -> None:
    with pytest.raises(ValueError, match=r"max_memory_per_rank\(100000 bytes.*smallest need is 104064 bytes.*outer 1"):
        plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=100_000)


def test_prefer_keeps_a_fitting_degree() -> None:
    assert plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, prefer=4).fsdp_outer_degree == 4
    # a preferred degree that does not fit gives way to the cost model's choice
    assert plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=150_000, prefer=4).fsdp_outer_degree == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=4, local_world_size=3), r"local_world_size\(3\) must divide world_size\(4\)"),
    (dict(max_memory_per_rank=0), r"max_memory_per_rank must be an int >= 1, got 0"),
    (dict(bandwidth=Bandwidth(within=1e9, across=0.0)), r"bandwidth.across must be a number > 0, got 0.0"),
    (dict(outer_degrees=[3]), r"outer_degrees \[3\] must be divisors of moe_sharding\(4\)"),
    (dict(micro_batches=0), r"micro_batches must be an int >= 1, got 0"),
    (dict(ep=3), r"sharding\(4\) % ep\(3\)"),
    (dict(param_dtype=torch.int8), r"param_dtype must be a floating-point torch.dtype"),
])
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    args = dict(**LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan(UNITS, **args)


def test_expert_buffers_and_bf16() -> None:
    # ep 2 on 4 ranks: moe_sharding 2, so the candidates are outer 1 and 2; at outer 2 the expert buffer (800
    # elements per rank) is kept whole (expert_inner 1) and only all-reduced over [0,2] (1600 B in bf16 comm).
    units = [UnitSize("", 1000, 0, False), UnitSize("blocks.0", 4000, 800)]
    p = plan(units, **LAYOUT, ep=2, bandwidth=SLOW, max_memory_per_rank=10**9, param_dtype=torch.bfloat16)
    got = by_outer(p)
    assert sorted(got) == [1, 2] and got[2].expert_inner == 1 and got[1].expert_inner == 2
    # outer 2: all-reduce of dense shards 500 + 2000 and the whole expert buffer 800, in bf16: 2 * 1/2 * 3300 * 2 B
    assert got[2].traffic["all_reduce"].across_bytes == 6600
    # outer 1: dense all-gathers over [0..3] (half across): 3/4 * (1008 * 2 B once + 4000 * 2 B twice) / 2 = 6756;
    # the expert ones over expert_inner [0,2] / [1,3] (all across): 1/2 * 800 * 2 B, twice = 1600
    assert got[1].traffic["all_gather"].across_bytes == 6756 + 1600


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 5)  # weight 15 elements at 0, bias 5 at 16 (aligned to 4): 24 laid out
        self.expert = nn.Parameter(torch.zeros(6))
        sf.mark_expert(self.expert)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 3)  # root: weight 6 at 0, bias 3 at 8: 11 -> 12
        self.blocks = nn.ModuleList([Blk(), Blk()])


def test_unit_sizes_as_fully_shard_lays_them_out() -> None:
    with torch.device("meta"):
        model = Net()
    sizes = unit_sizes(model, units=(Blk,))
    blk = (((5, 3), (5,)), ((6,),))  # Blk's dense buffer (fc), its expert buffer
    assert sizes == [UnitSize("", 12, 0, False, buffer_shapes=(((3, 2), (3,)),)),
                     UnitSize("blocks.0", 24, 8, True, buffer_shapes=blk[:1], expert_buffer_shapes=blk[1:]),
                     UnitSize("blocks.1", 24, 8, True, buffer_shapes=blk[:1], expert_buffer_shapes=blk[1:])]
    assert unit_sizes(model, units=(Blk,), reshard_policy="after_backward")[1].reshard_after_forward is False
    direct = plan(model, units=(Blk,), **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9)
    assert direct.candidates == plan(sizes, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9).candidates
    with pytest.raises(ValueError, match="match no module"):
        unit_sizes(model, units=(nn.Conv1d,))


def test_parse_bytes() -> None:
    assert parse_bytes("8GB") == 8 * 10**9 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5gib") == 3 * 2**29 and parse_bytes("4096") == parse_bytes("4096B") == 4096
    for bad in ("", "8XB", "-1GB", "0", "nanGB", "GB"):
        with pytest.raises(ValueError, match="expected a size in bytes"):
            parse_bytes(bad)


def test_job_flags(capsys: pytest.CaptureFixture) -> None:
    config = parse_args(["--fsdp-outer-degree", "auto", "--max-memory-per-rank", "512MiB"])
    assert (config.parallelism.fsdp_outer_degree, config.parallelism.max_memory_per_rank) == ("auto", 512 * 2**20)
    assert parse_args(["--fsdp-outer-degree", "2"]).parallelism.fsdp_outer_degree == 2
    for args, flag in ((["--fsdp-outer-degree", "two"], "--fsdp-outer-degree"),
                       (["--max-memory-per-rank", "8XB"], "--max-memory-per-rank")):
        with pytest.raises(SystemExit):
            parse_args(args)
        assert f"argument {flag}: expected" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--fsdp-outer-degree must be an int >= 1 or auto, got 'x'"):
        JobConfig.from_flat(fsdp_outer_degree="x").validate()
    with pytest.raises(ValueError, match="--max-memory-per-rank must be a size in bytes > 0"):
        JobConfig.from_flat(max_memory_per_rank=0).validate()
    # auto passes the layout checks before launch (the ep ones still apply)
    def check(world_size: int, **fields) -> None:
        world = f"--nproc {world_size}"
        config = JobConfig.from_flat(preset="tiny", fsdp_outer_degree="auto", data_bytes=300_000, **fields)
        check_run(resolve(config, device="cpu", world_size=world_size, world=world), world=world)

    check(4, ep=1)
    with pytest.raises(ValueError, match="--ep 4 with --fsdp-outer-degree 1 does not fit 2 ranks"):
        check(2, ep=4)


def test_measure_bandwidth_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="measure_bandwidth needs torch.distributed"):
        sf.measure_bandwidth(2)
    assert math.isinf(Bandwidth(within=math.inf, across=1e9).within)


def test_compressed_outer_all_reduce_bytes():
    """outer_comm_dtype scales the replicate all-reduce's bytes (int8: 1 + 4/256 bytes per element) and nothing else."""
    units = [UnitSize("", numel=4096), UnitSize("b", numel=8192)]
    kw = dict(world_size=4, local_world_size=2, bandwidth=sf.Bandwidth(1e9, 1e8, 0.0, 0.0),
              max_memory_per_rank=1 << 40, outer_degrees=[2])
    sent = lambda t: t.within_bytes + t.across_bytes  # noqa: E731
    base = plan(units, **kw).chosen
    assert sent(base.traffic["all_reduce"]) > 0
    for dtype, size in ((torch.bfloat16, 2), ("int8", 1 + 4 / 256)):
        got = plan(units, outer_comm_dtype=dtype, **kw).chosen
        for op in ("all_gather", "reduce_scatter"):
            assert sent(got.traffic[op]) == sent(base.traffic[op])
        assert sent(got.traffic["all_reduce"]) == pytest.approx(sent(base.traffic["all_reduce"]) * size / 4)
    with pytest.raises(ValueError, match="outer_comm_dtype"):
        plan(units, outer_comm_dtype="int4", **kw)


def test_quantized_all_gather_bytes():
    """all_gather_dtype scales the all-gathers' bytes (int8 and fp8: 1 + 4/256 bytes per element, bf16 2 of fp32's
    4), across nodes too (one sharding group of 4 over 2 nodes), and nothing else."""
    units = [UnitSize("", numel=4096), UnitSize("b", numel=8192)]
    kw = dict(world_size=4, local_world_size=2, bandwidth=sf.Bandwidth(1e9, 1e8, 0.0, 0.0),
              max_memory_per_rank=1 << 40, outer_degrees=[1])
    base = plan(units, **kw).chosen
    assert base.traffic["all_gather"].across_bytes > 0
    for dtype, size in ((torch.bfloat16, 2), ("int8", 1 + 4 / 256), (torch.float8_e4m3fn, 1 + 4 / 256)):
        got = plan(units, all_gather_dtype=dtype, **kw).chosen
        assert got.traffic["reduce_scatter"] == base.traffic["reduce_scatter"]
        for part in ("within_bytes", "across_bytes"):
            assert getattr(got.traffic["all_gather"], part) == pytest.approx(
                getattr(base.traffic["all_gather"], part) * size / 4)
        assert got.memory_bytes == base.memory_bytes  # the gathered buffers stay in param_dtype
    with pytest.raises(ValueError, match="all_gather_dtype must be None"):
        plan(units, all_gather_dtype="int4", **kw)


def test_sharding_group_spanning_nodes_is_named():
    """4 ranks as 2 nodes of 2: outer 1 (one sharding group of 4) spans the nodes and the table says so; outer 2
    keeps each inner group in a node; expert groups are named only when the units hold experts."""
    kw = dict(world_size=4, local_world_size=2, bandwidth=sf.Bandwidth(1e9, 1e8, 0.0, 0.0),
              max_memory_per_rank=1 << 40)
    p = plan([UnitSize("", numel=4096)], **kw)
    assert [c.spanning for c in p.candidates] == [("inner",), (), ()]
    lines = p.table().splitlines()
    assert lines[3].endswith("(inner groups span nodes)") and "span" not in lines[4] + lines[5], lines
    moe = plan([UnitSize("", numel=4096, expert_numel=4096)], **kw)
    assert moe.candidates[0].spanning == ("inner", "expert_inner")


def test_zeropp_suggested_where_the_chosen_group_spans_nodes():
    """A chosen sharding group that spans nodes gets the suggestion of ZeRO++'s three options at its degree, with
    the across-node bytes and step time they give (each option's bytes are tested on its own above): equal to a
    plan made with the three options on; none when the group stays in a node or the options are already on."""
    units = [UnitSize("", numel=4096, reshard_after_forward=False),
             *(UnitSize(f"b{i}", numel=65536) for i in range(4))]
    kw = dict(world_size=4, local_world_size=2, bandwidth=sf.Bandwidth(1e9, 1e8, 0.0, 0.0),
              max_memory_per_rank=1 << 40)
    spanning = plan(units, outer_degrees=[1], **kw)
    on = plan(units, outer_degrees=[1], all_gather_dtype="int8", secondary_shard=True, grad_comm_dtype="int8", **kw)
    assert on.suggestion == "" and on.chosen.across_bytes < 0.3 * spanning.chosen.across_bytes
    c, z = spanning.chosen, on.chosen
    assert (f"across {c.across_bytes / 1e6:.3f} -> {z.across_bytes / 1e6:.3f} MB/step" in spanning.suggestion
            and f"step {c.step_s:.4f} -> {z.step_s:.4f} s" in spanning.suggestion), spanning.suggestion
    assert "--secondary-shard" in spanning.suggestion and "fits" in spanning.suggestion
    assert spanning.table().splitlines()[-1] == f"suggested: {spanning.suggestion}"
    assert plan(units, outer_degrees=[2], **kw).suggestion == ""  # inner groups of 2 within a node
    assert plan(units, **{**kw, "local_world_size": 4}).suggestion == ""  # one node


def test_quantized_reduce_scatter_bytes():
    """grad_comm_dtype="int8" sends the reduce-scatters in 1 + 4/256 bytes per element, as an all-to-all whatever
    the backend (its share across nodes is the peers' on other nodes: gloo's share already), and leaves the
    all-gathers and the replicate all-reduce (then in the shard's dtype, fp32) as they are."""
    units = [UnitSize("", numel=4096), UnitSize("b", numel=8192)]
    kw = dict(world_size=8, local_world_size=2, bandwidth=sf.Bandwidth(1e9, 1e8, 0.0, 0.0),
              max_memory_per_rank=1 << 40, outer_degrees=[2])
    for backend in ("gloo", "nccl"):
        base = plan(units, backend=backend, **kw).chosen
        a2a = plan(units, backend="gloo", **kw).chosen  # fp32, sent as an all-to-all
        got = plan(units, backend=backend, grad_comm_dtype="int8", **kw).chosen
        assert base.traffic["reduce_scatter"].across_bytes > 0 and got.traffic["all_reduce"].across_bytes > 0
        assert got.traffic["all_gather"] == base.traffic["all_gather"]
        assert got.traffic["all_reduce"] == base.traffic["all_reduce"]  # fp32, not int8
        for part in ("within_bytes", "across_bytes"):
            assert getattr(got.traffic["reduce_scatter"], part) == pytest.approx(
                getattr(a2a.traffic["reduce_scatter"], part) * (1 + 4 / 256) / 4)
        assert got.memory_bytes == base.memory_bytes
    bf16 = plan(units, param_dtype=torch.bfloat16, **kw).chosen  # the all-reduce in bf16 (grad_comm = param)
    int8 = plan(units, param_dtype=torch.bfloat16, grad_comm_dtype="int8", **kw).chosen
    assert int8.traffic["all_reduce"].across_bytes == pytest.approx(2 * bf16.traffic["all_reduce"].across_bytes)
    with pytest.raises(ValueError, match='grad_comm_dtype must be None, torch.float32, .* or "int8"'):
        plan(units, grad_comm_dtype="int4", **kw)


def test_whole_params_padding_by_hand() -> None:
    """One unit of three whole matrices (16 x 4, 16 x 4, 8 x 4; Newton-Schulz costs 256, 256, 128): owners by cost,
    equal shards. Inner 4: one matrix a shard, the fullest 64 elements; inner 2: 16x4 + 8x4 on one shard, 96;
    inner 1: all 160. The shard (params memory, 4 B each) follows the owner layout of each candidate's inner degree."""
    units = [UnitSize("", 0, 0, False, whole_shapes=((16, 4), (16, 4), (8, 4)))]
    got = by_outer(plan(units, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9))
    assert {o: c.memory["params"] for o, c in got.items()} == {1: 64 * 4, 2: 96 * 4, 4: 160 * 4}
    # outer 1: the all-gather moves 3/4 of the padded 256 elements once (the root unit is not resharded)
    assert got[1].traffic["all_gather"].within_bytes + got[1].traffic["all_gather"].across_bytes == 3 * 64 * 4

    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 16), nn.Linear(4, 8, bias=False)

    model = nn.Sequential(Blk(), Blk())
    sizes = unit_sizes(model, units=(Blk,), whole_params=lambda n, p: p.dim() == 2)
    assert [(u.numel, u.whole_shapes) for u in sizes] == [(0, ()), (16, ((16, 4), (8, 4))), (16, ((16, 4), (8, 4)))]
    with pytest.raises(ValueError, match="whole_params must be None or a callable"):
        unit_sizes(model, units=(Blk,), whole_params="matrices")
    with pytest.raises(ValueError, match="whole_params apply to a model"):
        plan(units, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, whole_params=lambda n, p: True)


def test_plan_pads_buffers_as_the_row_aligned_layout() -> None:
    """With the shapes of each buffer, the shard the plan counts is the one fully_shard lays out at each inner
    degree (rows kept whole), not numel rounded up: a (10, 6) matrix over 4 shards needs S = 24, not 16."""
    from shardfusion._runtime.layout import build_layout

    shapes = ((10, 6), (6,))
    units = [UnitSize("", 72, 0, False, buffer_shapes=(shapes,))]
    got = by_outer(plan(units, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9))
    for outer, c in got.items():
        layout = build_layout(["w", "b"], shapes, c.inner, 4)
        assert c.memory["params"] == layout.shard_numel * 4
    assert got[1].memory["params"] == 24 * 4
    plain = by_outer(plan([UnitSize("", 72, 0, False)], **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9))
    assert plain[1].memory["params"] == 20 * 4  # numel rounded up to inner * align: 80 / 4


def test_diloco_spreads_the_outer_all_reduce_over_h_steps() -> None:
    """outer 2, by hand (EXPECTED): the all-reduces send 18000 B across per step, at 1e7 B/s 1.8 ms (no latency).
    DiLoCo with H = 8 sends them once per 8 steps after the optimizer step: 2250 B and 0.225 ms per step on
    average, the inner collectives as before; the step that carries the outer step has all of it (half with 2
    fragments); the snapshot, the momentum and one fragment's pseudo-gradients add 3 x the shard (4500 elements
    x 4 B x 3; 2.5 x with 2 fragments). Under bf16 gradients the pseudo-gradients still travel in fp32 (the shard's
    dtype) unless outer_comm_dtype says otherwise."""
    sync = by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9))[2]
    d = by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, outer_every=8))[2]
    s2 = by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, outer_every=8,
                       outer_fragments=2))[2]
    assert sync.sync_step_s is None and sync.traffic["all_reduce"].across_bytes == 18000
    assert d.traffic["all_reduce"].across_bytes == pytest.approx(18000 / 8)
    assert d.traffic["all_reduce"].count == pytest.approx(3 / 8)  # one all-reduce per buffer, once per 8 steps
    inner_s = sum(d.traffic[op].within_s + d.traffic[op].across_s for op in ("all_gather", "reduce_scatter"))
    assert d.step_s == pytest.approx(inner_s + 18000 / 1e7 / 8)
    assert d.sync_step_s == pytest.approx(inner_s + 18000 / 1e7)
    assert s2.sync_step_s == pytest.approx(inner_s + 18000 / 1e7 / 2) and s2.step_s == pytest.approx(d.step_s)
    assert d.memory["outer"] == 3 * 4500 * 4 and d.memory_bytes == sync.memory_bytes + 54000
    assert s2.memory["outer"] == (2 * 4500 + 2250) * 4
    bf16 = dict(param_dtype=torch.bfloat16, max_memory_per_rank=10**9)
    assert by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, outer_every=8, **bf16))[2].traffic[
        "all_reduce"].across_bytes == pytest.approx(18000 / 8)  # fp32 deltas
    assert by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, **bf16))[2].traffic[
        "all_reduce"].across_bytes == pytest.approx(9000)  # the synchronous all-reduce in bf16
    with pytest.raises(ValueError, match="expert_policy='shard'"):
        plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, outer_every=8, expert_policy="shard")
    assert "outer" not in by_outer(plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9,
                                        outer_every=8))[1].memory  # outer 1: no replicas, nothing to sync
    with pytest.raises(ValueError, match=r"outer_fragments\(3\) must be <= outer_every\(2\)"):
        plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, outer_every=2, outer_fragments=3)
    with pytest.raises(ValueError, match="outer_every"):
        plan(UNITS, **LAYOUT, bandwidth=SLOW, max_memory_per_rank=10**9, outer_every=0)
