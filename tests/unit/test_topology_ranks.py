"""shardfusion.topology without processes: the rank lists of every group kind against a brute-force enumeration of
the rank formula (docs/design.md, "Topology"), the worked example, degree validation. The real gloo groups are in
tests/distributed/test_topology.py."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from shardfusion.topology import KINDS, Degrees, Topology, _inner_kinds_spanning_nodes, group_ranks


# --- brute force: walk the dense rank formula and group ranks by the coordinates a kind keeps fixed ----------------

def _brute_force(world_size: int, kind: str, **degrees) -> list[list[int]]:
    d = {**dict(dp=1, pp=1, sharding=-1, sep=1, cp=1, mp=1, ep=1, fsdp_outer_degree=1), **degrees}
    if d["sharding"] == -1:
        d["sharding"] = world_size // (d["dp"] * d["pp"] * d["sep"] * d["cp"] * d["mp"])
    ep, outer = d["ep"], d["fsdp_outer_degree"]
    expert_inner = d["sharding"] // ep // outer
    groups: dict[tuple, list[int]] = {}
    for dp_i, pp_i, sh_i, sep_i, cp_i, mp_i in itertools.product(
            *(range(d[n]) for n in ("dp", "pp", "sharding", "sep", "cp", "mp"))):
        rank = (((((dp_i * d["pp"] + pp_i) * d["sharding"] + sh_i) * d["sep"] + sep_i) * d["cp"] + cp_i) * d["mp"]
                + mp_i)
        moe_i, ep_i = divmod(sh_i, ep)
        outer_i, ei_i = divmod(moe_i, expert_inner)
        inner_i = ei_i * ep + ep_i
        rest = (sep_i, cp_i, mp_i)
        fixed = {
            "dp": (pp_i, sh_i, *rest), "pp": (dp_i, sh_i, *rest), "sharding": (dp_i, pp_i, *rest),
            "sep": (dp_i, pp_i, sh_i, cp_i, mp_i), "cp": (dp_i, pp_i, sh_i, sep_i, mp_i),
            "mp": (dp_i, pp_i, sh_i, sep_i, cp_i),
            "ep": (dp_i, pp_i, moe_i, *rest), "moe_sharding": (dp_i, pp_i, ep_i, *rest),
            "fsdp_inner": (dp_i, pp_i, outer_i, *rest), "fsdp_outer": (dp_i, pp_i, inner_i, *rest),
            "expert_inner": (dp_i, pp_i, outer_i, ep_i, *rest), "expert_outer": (dp_i, pp_i, inner_i, *rest),
            "replicate": (pp_i, inner_i, mp_i), "data_parallel": (pp_i, *rest), "world": (),
            "expert_data_parallel": (pp_i, ep_i, *rest),
            "context": (dp_i, pp_i, sh_i, mp_i), "dense_replicas": (pp_i, mp_i), "expert_replicas": (pp_i, ep_i, mp_i),
            "expert_shard_replicate": (pp_i, sh_i, mp_i), "stage": (pp_i,),
        }[kind]
        groups.setdefault(fixed, []).append(rank)
    return sorted(sorted(g) for g in groups.values())


LAYOUTS = [  # (world_size, degrees)
    (16, dict(sharding=16, fsdp_outer_degree=2)),
    (16, dict(sharding=16, fsdp_outer_degree=2, ep=2)),
    (16, dict(sharding=16, fsdp_outer_degree=2, ep=8)),
    (16, dict(dp=2, mp=2, ep=2)),
    (16, dict(pp=2, mp=2, sharding=4, fsdp_outer_degree=2)),
    (32, dict(dp=2, pp=2, sharding=4, mp=2, ep=2, fsdp_outer_degree=2)),
    (48, dict(dp=2, sharding=6, sep=2, mp=2, ep=3)),
    (24, dict(dp=3, pp=2, cp=2, sharding=2, ep=2)),
    (64, dict(dp=2, pp=2, sharding=8, cp=2, ep=2, fsdp_outer_degree=4)),
    (1, {}),
]



def test_worked_example_dense():
    kw = dict(sharding=16, fsdp_outer_degree=2)
    assert group_ranks(16, "fsdp_inner", **kw) == [list(range(8)), list(range(8, 16))]
    assert group_ranks(16, "fsdp_outer", **kw) == [[r, r + 8] for r in range(8)]
    assert group_ranks(16, "sharding", **kw) == [list(range(16))]
    assert group_ranks(16, "replicate", **kw) == [[r, r + 8] for r in range(8)]


def test_worked_example_expert_ep2():
    kw = dict(sharding=16, fsdp_outer_degree=2, ep=2)
    assert group_ranks(16, "expert_inner", **kw) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert group_ranks(16, "expert_outer", **kw) == [[r, r + 8] for r in range(8)]
    assert group_ranks(16, "fsdp_inner", **kw) == [list(range(8)), list(range(8, 16))]  # dense is unchanged by ep
    assert group_ranks(16, "fsdp_outer", **kw) == [[r, r + 8] for r in range(8)]
    assert group_ranks(16, "ep", **kw) == [[r, r + 1] for r in range(0, 16, 2)]


def test_worked_example_expert_ep8():
    kw = dict(sharding=16, fsdp_outer_degree=2, ep=8)
    assert group_ranks(16, "expert_inner", **kw) == [[r] for r in range(16)]
    assert group_ranks(16, "expert_outer", **kw) == [[r, r + 8] for r in range(8)]
    assert group_ranks(16, "moe_sharding", **kw) == [[r, r + 8] for r in range(8)]
    assert group_ranks(16, "fsdp_inner", **kw) == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("world_size,degrees", LAYOUTS)
def test_matches_brute_force(world_size, degrees):
    for kind in KINDS:
        assert group_ranks(world_size, kind, **degrees) == _brute_force(world_size, kind, **degrees), kind


@pytest.mark.parametrize("world_size,degrees", LAYOUTS)
def test_groups_partition_the_world(world_size, degrees):
    d = Degrees(world_size=world_size, **degrees)
    for kind, axes in KINDS.items():
        groups = group_ranks(world_size, kind, **degrees)
        size = 1
        for axis in axes:
            size *= d.axis_sizes[axis]
        assert all(len(g) == size and g == sorted(g) for g in groups), kind
        assert sorted(r for g in groups for r in g) == list(range(world_size)), kind
        assert [g[0] for g in groups] == sorted(g[0] for g in groups), kind


@pytest.mark.parametrize("world_size,degrees", LAYOUTS)
def test_group_relations(world_size, degrees):
    def by_rank(kind):
        return {r: set(g) for g in group_ranks(world_size, kind, **degrees) for r in g}

    inner, outer, rep, dpar, shard = (by_rank(k) for k in ("fsdp_inner", "fsdp_outer", "replicate", "dense_replicas",
                                                          "sharding"))
    e_inner, e_outer, moe, ep = (by_rank(k) for k in ("expert_inner", "expert_outer", "moe_sharding", "ep"))
    for r in range(world_size):
        assert rep[r] & inner[r] == {r}  # one shard holder per replica
        assert set().union(*(inner[q] for q in rep[r])) == dpar[r]  # replicate x inner = data parallel x sep x cp
        assert set().union(*(inner[q] for q in outer[r])) == shard[r]  # outer x inner = sharding
        assert set().union(*(e_inner[q] for q in e_outer[r])) == moe[r]
        assert set().union(*(moe[q] for q in ep[r])) == shard[r]  # moe_sharding x ep = sharding
        assert outer[r] == e_outer[r] and e_inner[r] <= inner[r]


def test_sharding_rest_and_coordinates():
    d = Degrees(world_size=32, dp=2, pp=2, mp=2, ep=2, fsdp_outer_degree=2)
    assert (d.sharding, d.moe_sharding, d.inner, d.expert_inner) == (4, 2, 2, 1)
    for rank in range(32):
        c = d.coordinates(rank)
        sh = (c["outer"] * d.expert_inner + c["expert_inner"]) * d.ep + c["ep"]
        assert rank == (((((c["dp"] * d.pp + c["pp"]) * d.sharding + sh) * d.sep + c["sep"]) * d.cp + c["cp"])
                        * d.mp + c["mp"])


@pytest.mark.parametrize("world_size,degrees,pattern", [
    (8, dict(dp=2, sharding=4, mp=2), r"dp\(2\) \* pp\(1\) \* sharding\(4\) \* sep\(1\) \* cp\(1\) \* mp\(2\) = 16 "
                                      r"!= world_size\(8\)"),
    (8, dict(dp=3), r"world_size\(8\) is not divisible by dp\(3\) \* pp\(1\) \* sep\(1\) \* cp\(1\) \* mp\(1\) = 3"),
    (24, dict(sharding=6, dp=4, ep=4), r"sharding\(6\) % ep\(4\) = 2 != 0.*dp\(4\).*fsdp_outer_degree\(1\)"),
    (16, dict(ep=2, fsdp_outer_degree=3),
     r"moe_sharding\(8\) = sharding\(16\) // ep\(2\).*% fsdp_outer_degree\(3\) = 2 != 0.*world_size\(16\)"),
    (16, dict(ep=4, fsdp_outer_degree=8), r"moe_sharding\(4\) % fsdp_outer_degree\(8\) = 4"),
    (8, dict(dp=0), r"dp\(0\) must be >= 1.*world_size\(8\).*mp\(1\) ep\(1\)"),
    (8, dict(sharding=-2), r"sharding\(-2\) must be >= 1 \(or -1"),
    (8, dict(mp=2.0), r"mp must be an int, got 2.0 \(float\).*sharding\(-1\)"),
    (8, dict(ep=True), r"ep must be an int, got True \(bool\)"),
    (8, dict(fsdp_outer_degree="2"), r"fsdp_outer_degree must be an int"),
    (0, {}, r"world_size\(0\) must be >= 1"),
])
def test_invalid_degrees_raise(world_size, degrees, pattern):
    with pytest.raises(ValueError, match=pattern):
        group_ranks(world_size, "fsdp_inner", **degrees)
    with pytest.raises(ValueError, match=pattern):
        Degrees(world_size=world_size, **degrees)


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match=r"unknown group kind 'intra'.*'data_parallel'.*'fsdp_inner'.*'world'"):
        group_ranks(8, "intra")


def test_topology_needs_initialized_distributed():
    assert not dist.is_initialized(), "the pytest process itself never joins a process group"
    with pytest.raises(ValueError, match="init_process_group"):
        Topology()


def test_inner_groups_spanning_nodes():
    d = Degrees(world_size=16, sharding=16, fsdp_outer_degree=2, ep=2)
    assert _inner_kinds_spanning_nodes(d, 8) == []
    assert _inner_kinds_spanning_nodes(d, 4) == ["fsdp_inner", "expert_inner"]
    assert _inner_kinds_spanning_nodes(Degrees(world_size=16, sharding=8, mp=2), 16) == []
