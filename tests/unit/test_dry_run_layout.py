"""The dry run's layout over nodes and its world size: the default outer degree over several nodes (inner = one
node: `shardfusion.topology.outer_degree_within_nodes`, the job's `default_outer_degree`, in the dry run and in a job
started by torchrun on several nodes), the warning when inner groups span nodes, the refusal of worlds whose
bookkeeping would not fit, and the fake group's topology that makes only the played rank's groups (so that a
million-rank world costs what a thousand-rank one does: benchmarks/results/dry-run-scale-tiny.md). Each is checked
against a brute-force walk over every group of the world (tests/unit/test_topology_ranks.py's kind of reference)."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch.distributed as dist

import shardfusion as sf
dr = importlib.import_module("shardfusion.dry_run")  # the module (shardfusion.dry_run is also the function's name)
from shardfusion.topology import (KINDS, Degrees, Topology, _group_of, _inner_kinds_spanning_nodes, group_ranks,
                                  outer_degree_within_nodes)
from shardfusion.train.config import JobConfig, default_outer_degree, parse_args, resolve
from shardfusion.train.job_dry_run import prepare

LAYOUTS = [dict(world_size=w, pp=pp, cp=cp, mp=mp, ep=ep)
           for w, pp, cp, mp, ep in itertools.product((16, 24, 48), (1, 2, 3), (1, 2), (1, 2), (1, 2, 4))
           if w % (pp * cp * mp) == 0 and (w // (pp * cp * mp)) % ep == 0]


def _spanning_brute_force(d: Degrees, ranks_per_node: int) -> list[str]:
    """The inner kinds with a group on more than one node, by walking every group of the world."""
    return [kind for kind in ("fsdp_inner", "expert_inner")
            if any(len({r // ranks_per_node for r in g}) > 1
                   for g in group_ranks(d.world_size, kind, pp=d.pp, cp=d.cp, mp=d.mp, ep=d.ep,
                                        fsdp_outer_degree=d.fsdp_outer_degree))]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def test_spanning_and_the_degree_within_nodes_against_brute_force() -> None:
    for layout, rpn in itertools.product(LAYOUTS, (2, 4, 6, 8)):
        if layout["world_size"] % rpn:
            continue
        base = Degrees(**layout)
        spans = {}
        for outer in _divisors(base.moe_sharding):
            d = Degrees(**layout, fsdp_outer_degree=outer)
            spans[outer] = _spanning_brute_force(d, rpn)
            assert _inner_kinds_spanning_nodes(d, rpn) == spans[outer], (layout, rpn, outer)
        # the smallest degree whose inner groups sit within a node, as a walk over the candidates finds it; None
        # when ep x cp x mp do not divide a node (then only inner 1, every rank holding whole parameters, would)
        expected = None if rpn % (base.ep * base.cp * base.mp) else min(o for o in spans if not spans[o])
        assert outer_degree_within_nodes(base, rpn) == expected, (layout, rpn)


@pytest.mark.parametrize("flags, world, rpn, outer", [
    ({}, 1024, 8, 128),                               # the case: inner 8 = one node, not 512 over 64 nodes
    ({"experts": 0}, 1024, 8, 128),
    ({"pp": 2, "experts": 0}, 1024, 8, 64),           # per stage: 512 ranks = 64 nodes
    ({"cp": 2}, 1024, 8, 128),                        # inner 4 x cp 2 = one node
    ({"ep": 16, "experts": 16}, 1024, 8, 2),          # ep 16 spans nodes whatever the degree: the one-node rule
    ({}, 4, None, 2),                                 # one node: make train's HSDP 2 x 2
    ({}, 4, 4, 2),
    ({}, 8, 8, 2),
    ({"fsdp_outer_degree": 2}, 1024, 8, 2),           # given: kept
])
def test_default_outer_degree(flags: dict, world: int, rpn, outer: int) -> None:
    config = resolve(JobConfig.from_flat(preset="tiny", **flags), device="cpu", world_size=world, ranks_per_node=rpn)
    assert config.fsdp_outer_degree == outer
    d = Degrees(world_size=world, pp=config.pipeline.pp, cp=config.parallelism.cp, ep=config.ep,
                fsdp_outer_degree=outer)
    if not {"ep", "fsdp_outer_degree"} & set(flags) and rpn is not None:
        assert _spanning_brute_force(d, rpn) == []
    default, why = default_outer_degree(config, world, rpn)
    if "fsdp_outer_degree" in flags:
        assert default == 128  # what it would have been
    elif rpn is None or rpn >= world:
        assert why.startswith("one node")
    elif "ep" in flags:
        assert "no outer degree keeps the inner groups within a node, as --ep 16 = 16 ranks do not divide 8" in why
    else:
        assert f"{world} ranks = {world // rpn} nodes x {rpn}: outer {outer} x inner" in why, why


def test_a_resumed_run_keeps_its_saved_degree_over_several_nodes() -> None:
    """A checkpoint written with outer 2 (the default before inner = one node) resumes with outer 2 on 128 nodes."""
    config = JobConfig.from_flat(preset="tiny")
    saved = {"fsdp_outer_degree": 2}
    assert resolve(config, device="cpu", world_size=1024, ranks_per_node=8, saved=saved).fsdp_outer_degree == 2
    assert default_outer_degree(resolve(config, device="cpu", world_size=1024, ranks_per_node=8), 1024, 8, saved)[1] \
        == ("1024 ranks = 128 nodes x 8: outer 2, kept from the checkpoint this run resumes (the default over several "
            "nodes, inner = one node, would be 128)")
    # a saved degree that does not fit the world (moe_sharding 512 % 3): the default
    assert resolve(config, device="cpu", world_size=1024, ranks_per_node=8,
                   saved={"fsdp_outer_degree": 3}).fsdp_outer_degree == 128


def test_the_dry_run_takes_the_default_over_nodes_and_says_why() -> None:
    given = JobConfig.from_flat(dry_run=True, world=1024, ranks_per_node=8, preset="tiny")
    config, world, rpn = prepare(given)
    assert (world, rpn, config.fsdp_outer_degree, config.ep) == (1024, 8, 128, 2)
    from shardfusion.train.job_dry_run import outer_degree_line

    assert outer_degree_line(given, config, world, rpn) == (
        "--fsdp-outer-degree 128 by default: 1024 ranks = 128 nodes x 8: outer 128 x inner 8, each inner group one "
        "node, the default over several nodes")
    kept, _, _ = prepare(JobConfig.from_flat(dry_run=True, world=1024, ranks_per_node=8, preset="tiny", fsdp_outer_degree=2))
    assert kept.fsdp_outer_degree == 2
    one_node, _, _ = prepare(JobConfig.from_flat(dry_run=True, world=4, preset="tiny"))
    assert one_node.fsdp_outer_degree == 2


@pytest.mark.parametrize("local, outer, line", [("4", 8, True), ("32", 2, False)])
def test_a_job_started_on_several_nodes(tmp_path, capsys, monkeypatch, local: str, outer: int, line: bool) -> None:
    """torchrun on 8 nodes of 4 (LOCAL_WORLD_SIZE 4 < WORLD_SIZE 32): inner = one node; on one node, as before."""
    from shardfusion.train import job

    for key, value in (("WORLD_SIZE", "32"), ("LOCAL_WORLD_SIZE", local), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(key, value)
    config = job.preflight(parse_args(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "run")]),
                           torchrun=True)
    assert config.fsdp_outer_degree == outer
    printed = [x for x in capsys.readouterr().out.splitlines() if "--fsdp-outer-degree" in x]
    assert printed == ([f"shardfusion: --fsdp-outer-degree 8 by default: 32 ranks = 8 nodes x 4: outer 8 x inner 4, "
                        "each inner group one node, the default over several nodes"] if line else [])


def test_a_job_resumed_on_several_nodes_keeps_its_degree(tmp_path, capsys, monkeypatch) -> None:
    """The degree of the run being resumed (OUT/config.json) is kept on 8 nodes of 4, and the line says so."""
    from shardfusion.train import job

    for key, value in (("WORLD_SIZE", "32"), ("LOCAL_WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"fsdp_outer_degree": 2}')
    monkeypatch.setattr(job.train_state, "saved_settings", lambda folder: {})  # as if OUT held a checkpoint
    config = job.preflight(parse_args(["--preset", "tiny", "--device", "cpu", "--out", str(out)]), torchrun=True)
    assert config.fsdp_outer_degree == 2
    assert "shardfusion: --fsdp-outer-degree 2 by default: 32 ranks = 8 nodes x 4: outer 2, kept from the checkpoint " \
           "this run resumes (the default over several nodes, inner = one node, would be 8)" in capsys.readouterr().out


def test_a_given_degree_whose_inner_groups_span_nodes_is_named() -> None:
    notes = dr._layout_notes(Degrees(world_size=1024, fsdp_outer_degree=2), 8)
    assert notes == ["the inner groups span nodes (inner 512: blocks of 512 ranks over 64 nodes of 8): their "
                     "all-gathers and reduce-scatters cross the network; fsdp_outer_degree 128 keeps each within a "
                     "node"]
    assert dr._layout_notes(Degrees(world_size=1024, fsdp_outer_degree=128), 8) == []


# --- the world size: refused before any allocation, and the played rank's groups only -----------------------------

def test_a_world_too_large_is_refused_before_anything_is_allocated(monkeypatch) -> None:
    monkeypatch.setattr(dr, "_available_memory", lambda: 2**30)  # 1 GiB available
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a process group was made"))
    with pytest.raises(ValueError, match=r"world_size\(1,000,000,000\) is more than this machine can play: .* "
                                         r"1\.00 GiB is available; at most about 524,288 ranks fit"):
        sf.dry_run(lambda topo: None, lambda m, t: None, world_size=10**9, ranks_per_node=8)
    with pytest.raises(ValueError, match=r"^--world 1048576: world_size\(1,048,576\) is more than"):
        prepare(JobConfig.from_flat(dry_run=True, world=2**20, preset="tiny"))
    dr.check_world_fits(2**19)  # fits 1 GiB at 2 KiB per rank


def _groups_made(world: int, **degrees) -> tuple[int, dict]:
    """Process groups a fake-group Topology makes for rank world / 2 + 1 (pp index 1, an end of the pipeline), and
    its group of each kind (ranks, accounting label)."""
    from shardfusion import comm

    dist.init_process_group("fake", rank=world // 2 + 1, world_size=world)
    try:
        before = dist.distributed_c10d._world.group_count
        topo = Topology(**degrees)
        made = dist.distributed_c10d._world.group_count - before
        groups = {kind: (dist.get_process_group_ranks(topo.get_group(kind)), comm.group_kinds(topo.get_group(kind)))
                  for kind in KINDS}
        groups["pipeline_ends"] = (dist.get_process_group_ranks(topo.get_pipeline_ends_group()),
                                   comm.group_kinds(topo.get_pipeline_ends_group()))
        assert topo.rank in groups["world"][0] and _group_of(topo.degrees, "sharding", topo.rank) == groups["sharding"][0]
        return made, groups
    finally:
        dist.destroy_process_group()


def test_a_fake_topology_makes_the_played_ranks_groups_only() -> None:
    """The played rank's groups, as a walk over every group of the world gives them, labelled for the accounting;
    as many process groups at 4,096 ranks as at 64 (a mesh makes one per group of every axis: thousands)."""
    layout = dict(pp=2, cp=2, ep=2, fsdp_outer_degree=2)
    small, _ = _groups_made(64, **layout)
    large, groups = _groups_made(4096, **layout)
    assert small == large < 40
    rank = 4096 // 2 + 1
    for kind in KINDS:
        ranks, labels = groups[kind]
        assert ranks in group_ranks(4096, kind, **layout) and rank in ranks, kind
        assert kind in labels, (kind, labels)
    pp_group = next(g for g in group_ranks(4096, "pp", **layout) if rank in g)
    assert groups["pipeline_ends"] == ([pp_group[0], pp_group[-1]], ("pipeline_ends",))


def test_kinds_of_pipeline_stages_against_brute_force() -> None:
    for d in (Degrees(world_size=48, pp=3), Degrees(world_size=48, dp=2, pp=4, cp=2)):
        firsts: dict[int, int] = {}
        for r in range(d.world_size):
            firsts.setdefault(d.coordinates(r)["pp"], r)
        assert dr.kinds_of(d) == [(r, f"pp stage {s}") for s, r in sorted(firsts.items())]
