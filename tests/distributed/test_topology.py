"""shardfusion.topology on real gloo groups: every group kind of several layouts on 8 ranks (ranks, rank attributes,
getters, reduce twins, a sum over each group), the user timeout, a node-spanning warning, one rank, and the worked
example of docs/design.md on 16 ranks. The rank lists alone are in tests/unit/test_topology_ranks.py."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from shardfusion.topology import KINDS, Topology, group_ranks

RANK_ATTRS = {"dp": "dp_rank", "pp": "pp_rank", "sharding": "sharding_rank", "sep": "sep_rank", "cp": "cp_rank",
              "mp": "mp_rank", "ep": "ep_rank", "moe_sharding": "moe_sharding_rank", "fsdp_outer": "outer_rank",
              "fsdp_inner": "inner_rank", "expert_inner": "expert_inner_rank", "replicate": "replicate_rank",
              "data_parallel": "data_parallel_rank", "world": "rank"}
# kinds without a rank attribute: expert_data_parallel

WORKER_LAYOUTS = [  # (degrees, LOCAL_WORLD_SIZE, expect a node-spanning warning)
    (dict(sharding=8, fsdp_outer_degree=2, ep=2), "2", True),
    (dict(sharding=4, mp=2, fsdp_outer_degree=2), "4", False),
    (dict(pp=2, dp=2, sharding=2, fsdp_outer_degree=2), "8", False),
    (dict(pp=2, dp=2, sharding=2, ep=2), "8", False),
    (dict(sharding=2, sep=2, cp=2, ep=2), "8", False),
    (dict(), "8", False),  # ep 1, world-sized groups: the default-group shortcut must not alias the reduce twin
]


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _check_layout(topo: Topology, degrees: dict, problems: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    where = f"rank {rank} {degrees}"
    for kind in KINDS:
        (mine,) = [g for g in group_ranks(world, kind, **degrees) if rank in g]
        group = topo.get_group(kind)
        if _ranks(group) != mine or topo.group_ranks(kind) != group_ranks(world, kind, **degrees):
            problems.append(f"{where}: {kind} group {_ranks(group)} != {mine}")
        if kind in RANK_ATTRS and not (getattr(topo, RANK_ATTRS[kind]) == mine.index(rank)
                                       == dist.get_group_rank(group, rank)):
            problems.append(f"{where}: {RANK_ATTRS[kind]} {getattr(topo, RANK_ATTRS[kind])} != {mine.index(rank)}")
    expect = {"get_fsdp_group": ("sharding", "moe_sharding"), "get_fsdp_inner_group": ("fsdp_inner", "expert_inner"),
              "get_fsdp_inner_reduce_group": ("fsdp_inner", "expert_inner"),
              "get_fsdp_outer_group": ("fsdp_outer", "expert_outer")}
    for method, (dense, expert) in expect.items():
        for is_expert, kind in ((False, dense), (True, expert)):
            if _ranks(getattr(topo, method)(is_expert=is_expert)) != _ranks(topo.get_group(kind)):
                problems.append(f"{where}: {method}(is_expert={is_expert}) ranks differ from {kind}")
    if _ranks(topo.get_replicate_group()) != _ranks(topo.get_group("replicate")) or \
            _ranks(topo.get_data_parallel_group()) != _ranks(topo.get_group("data_parallel")) or \
            _ranks(topo.get_expert_data_parallel_group()) != _ranks(topo.get_group("expert_data_parallel")):
        problems.append(f"{where}: replicate / data_parallel / expert_data_parallel getters disagree with get_group")
    if _ranks(topo.get_reduce_group("moe_sharding")) != _ranks(topo.get_group("moe_sharding")) or \
            topo.get_reduce_group("moe_sharding") is topo.get_group("moe_sharding"):
        problems.append(f"{where}: the moe_sharding reduce twin is wrong")
    if topo.ep > 1 and any(topo.get_group("ep") is topo.get_group(k) for k in KINDS if k not in ("ep", "world")):
        problems.append(f"{where}: the ep (all-to-all) group is shared with another kind")
    if topo.get_fsdp_outer_group() is not topo.get_fsdp_outer_group(is_expert=True):
        problems.append(f"{where}: dense and expert outer groups are different objects")
    for is_expert in (False, True):
        if topo.get_fsdp_inner_reduce_group(is_expert) is topo.get_fsdp_inner_group(is_expert):
            problems.append(f"{where}: reduce twin (is_expert={is_expert}) is the all-gather group itself")
    if topo.ep == 1 and topo.get_fsdp_group() is not topo.get_fsdp_group(is_expert=True):
        problems.append(f"{where}: with ep 1 the expert fsdp group should be the dense one")
    # Same order of all-reduces on every rank; a wrong or shared-by-mistake group gives a wrong sum.
    groups = [(kind, topo.get_group(kind)) for kind in KINDS]
    groups += [(f"reduce twin {e}", topo.get_fsdp_inner_reduce_group(e)) for e in (False, True)]
    groups += [("reduce twin moe_sharding", topo.get_reduce_group("moe_sharding"))]
    for kind, group in groups:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        if t.item() != sum(r + 1 for r in _ranks(group)):
            problems.append(f"{where}: all_reduce over {kind} gave {t.item()}")


def _topology_worker() -> dict:
    import os

    problems: list[str] = []
    warned: list[bool] = []
    for degrees, local_world_size, _ in WORKER_LAYOUTS:
        os.environ["LOCAL_WORLD_SIZE"] = local_world_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            topo = Topology(**degrees)
        warned.append(any("span nodes" in str(w.message) for w in caught))
        _check_layout(topo, degrees, problems)

    # A user timeout reaches every group, and a blocked collective fails instead of hanging.
    topo = Topology(sharding=8, fsdp_outer_degree=4, timeout=3.0)
    cpu = torch.device("cpu")
    every = [topo.get_group(k) for k in KINDS if k != "world"] + [topo.get_fsdp_inner_reduce_group(e)
                                                                  for e in (False, True)]
    timeouts = {g._get_backend(cpu).options._timeout.total_seconds() for g in every}
    assert _ranks(topo.get_fsdp_inner_group()) == [dist.get_rank() // 2 * 2, dist.get_rank() // 2 * 2 + 1]
    elapsed = None
    if dist.get_rank() == 0:  # rank 1 never joins this all_reduce
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=topo.get_fsdp_inner_group())
        except RuntimeError:
            elapsed = time.monotonic() - start
        else:
            elapsed = -1.0
    dist.barrier()
    return {"problems": problems, "warned": warned, "timeouts": sorted(timeouts), "elapsed": elapsed,
            "describe": Topology(sharding=4, fsdp_outer_degree=2, mp=2, ep=2).describe()}


@pytest.mark.timeout(150)
def test_topology_on_eight_gloo_ranks():
    results = run_distributed(_topology_worker, 8, timeout=120)
    assert [p for r in results for p in r["problems"]] == []
    assert all(r["warned"] == [w for _, _, w in WORKER_LAYOUTS] for r in results), [r["warned"] for r in results]
    assert all(r["timeouts"] == [3.0] for r in results), [r["timeouts"] for r in results]
    assert results[0]["elapsed"] is not None and 2.5 <= results[0]["elapsed"] < 10, results[0]["elapsed"]
    assert results[0]["describe"] == ("world 8 = dp1 x pp1 x sharding4 (outer2 x inner2) x sep1 x cp1 x mp2; ep2 "
                                      "(moe_sharding2 = outer2 x expert_inner1)")


def _single_rank_worker() -> dict:
    problems: list[str] = []
    topo = Topology(timeout=5)
    _check_layout(topo, {}, problems)
    return {"problems": problems, "describe": topo.describe(), "repr": repr(topo)}


@pytest.mark.timeout(90)
def test_topology_on_one_rank():
    (result,) = run_distributed(_single_rank_worker, 1, timeout=60)
    assert result["problems"] == []
    assert result["describe"] == "world 1 = dp1 x pp1 x sharding1 (outer1 x inner1) x sep1 x cp1 x mp1; ep1"
    assert result["repr"] == f"Topology(rank 0: {result['describe']})"


def _worked_example_worker() -> dict:
    """docs/design.md's worked example on 16 real ranks: the expert groups a Topology creates, at ep 2 and 8."""
    rank = dist.get_rank()
    found = {}
    for ep in (2, 8):
        topo = Topology(sharding=16, fsdp_outer_degree=2, ep=ep)
        found[ep] = {kind: _ranks(topo.get_group(kind)) for kind in ("expert_inner", "expert_outer", "fsdp_inner",
                                                                     "fsdp_outer", "moe_sharding", "ep")}
        found[ep]["same_outer_object"] = topo.get_fsdp_outer_group(True) is topo.get_fsdp_outer_group(False)
        found[ep]["rank"] = rank
    return found


@pytest.mark.timeout(200)
def test_worked_example_on_sixteen_gloo_ranks():
    results = run_distributed(_worked_example_worker, 16, timeout=170)
    table = {2: {"expert_inner": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]},
             8: {"expert_inner": [[r] for r in range(16)]}}
    for ep in (2, 8):
        for kind in ("expert_outer", "fsdp_inner", "fsdp_outer", "moe_sharding", "ep"):
            table[ep].setdefault(kind, group_ranks(16, kind, sharding=16, fsdp_outer_degree=2, ep=ep))
        assert table[ep]["expert_outer"] == [[r, r + 8] for r in range(8)]
        for r in results:
            mine = r[ep]
            assert mine["same_outer_object"], f"ep {ep} rank {mine['rank']}: dense and expert outer differ"
            for kind, groups in table[ep].items():
                (expected,) = [g for g in groups if mine["rank"] in g]
                assert mine[kind] == expected, f"ep {ep} rank {mine['rank']}: {kind} {mine[kind]} != {expected}"


def _ranks_per_node_worker() -> dict:
    import os

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    out = {}
    for name, kw in (("default", dict(sharding=4)), ("two-nodes", dict(sharding=4, ranks_per_node=2)),
                     ("hsdp", dict(sharding=4, fsdp_outer_degree=2, ranks_per_node=2))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            topo = Topology(**kw)
        out[name] = (topo.ranks_per_node, topo.spanning_groups, topo.describe_nodes(),
                     any("span nodes" in str(w.message) for w in caught))
    for bad in (3, 0, True):
        try:
            Topology(sharding=4, ranks_per_node=bad)
        except ValueError as error:
            out[f"bad-{bad}"] = str(error)
    return out


@pytest.mark.timeout(90)
def test_ranks_per_node_declares_nodes_on_one_machine():
    """Topology(ranks_per_node=2) on 4 ranks: two nodes, the sharding group of 4 named as spanning them (no warning:
    declared on purpose); HSDP with inner 2 keeps it in a node; without it and LOCAL_WORLD_SIZE, one node; bad values
    are one ValueError on every rank."""
    for r in run_distributed(_ranks_per_node_worker, 4, timeout=60):
        assert r["default"] == (4, [], "1 node x 4 ranks", False), r["default"]
        assert r["two-nodes"] == (2, ["fsdp_inner"], "2 nodes x 2 ranks; fsdp_inner groups span nodes (fsdp inner 4)",
                                  False), r["two-nodes"]
        assert r["hsdp"] == (2, [], "2 nodes x 2 ranks", False), r["hsdp"]
        for bad in (3, 0, True):
            assert r[f"bad-{bad}"] == (f"ranks_per_node must be an int >= 1 that divides world_size(4): nodes of "
                                       f"equal size, got {bad!r}"), r
