"""Wrapping: which unit each parameter lands in (by class, by comm_unit_size, tied and shared parameters at their
lowest common ancestor), the fragments that `named_parameters()` yields afterwards (names kept, tiling each
parameter over the inner group), and fully_shard's argument errors (raised on every rank).

comm_unit_size packs the children of an nn.ModuleList (never the list itself) and trains as one process does;
container classes as unit classes are refused.

Everything runs in one W=4 job on (I, O) = (2, 2) (sep/cp errors use their own topology); each check is a test.
Zero-size and frozen parameters, unit states around forward and backward, and what `parameters()` is after a
forward are in tests/distributed/test_fragments.py.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed, raised
from models import MLP, Block, TinyTransformer
from reference import assert_close_dicts, global_randn, rank_randn, seeded, sgd_step, state_snapshot

JOB_TIMEOUT_S = 180
WORLD, INNER, OUTER = 4, 2, 2
LR = 0.1


class Pair(nn.Module):
    """Two Linear layers sharing one weight: the tied weight's lowest common ancestor is the Pair."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.pair(x))


def _numels(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters()}


def _describe(model, sf) -> dict:
    return {
        "units": [(u.name, list(u.param_names)) for u in sf.get_units(model)],
        "names": [n for n, _ in model.named_parameters()],
        "fragments": {n: (p.numel(), p.dim(), p.requires_grad) for n, p in model.named_parameters()},
    }


class ListNet(nn.Module):
    """inp (72 elements) -> 3 Linears held by an nn.ModuleList (216) -> out (36). The list itself is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.out = nn.Linear(8, 4)

    def forward(self, x):  # (B, 8) -> (B, 4)
        h = self.inp(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


MODULELIST_TAG = 1
MODULELIST_SIZES = (50, 72, 100, 144, 216, 288, 10_000)  # 72 per Linear(8, 8): one per unit, two, three, the list...
MODULELIST_STEPS = 2


def _scenario(fn, *args):
    """fn(*args), or {"error": traceback} if it raised (on every rank alike: the job goes on with the next check)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def modulelist_by_size(topo) -> dict:
    """Worker: ListNet wrapped with each comm_unit_size, 2 SGD steps on per-rank data; units and full state."""
    import shardfusion as sf

    dp_rank, out = topo.data_parallel_rank, {}
    for size in MODULELIST_SIZES:
        try:  # an error here is the same on every rank (a bad unit fails in its forward): go on with the next size
            model = sf.fully_shard(seeded(ListNet), topo, comm_unit_size=size)
            units = [(u.name, [type(m).__name__ for m in u.modules]) for u in sf.get_units(model)]
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for step in range(MODULELIST_STEPS):
                x = rank_randn(MODULELIST_TAG, step, dp_rank, 4, 8)
                y = rank_randn(MODULELIST_TAG, 50 + step, dp_rank, 4, 4)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            out[size] = {"units": units, "full": sf.full_state_dict(model)}
        except Exception:  # noqa: BLE001 - reported by the test
            out[size] = {"error": traceback.format_exc()}
    return out


def modulelist_reference(world: int) -> dict:
    """ListNet trained in one process on the global batch (the mean loss over every rank's batch)."""
    model = seeded(ListNet)
    for step in range(MODULELIST_STEPS):
        x = global_randn(MODULELIST_TAG, step, world, 4, 8)
        y = global_randn(MODULELIST_TAG, 50 + step, world, 4, 4)
        F.mse_loss(model(x), y).backward()
        sgd_step(model, LR)
    return state_snapshot(model)


def units_job() -> dict:
    """Worker: wrap several models and report their units, fragments and argument errors."""
    import torch.distributed as dist
    import shardfusion as sf

    topo = sf.Topology(sharding=INNER * OUTER, fsdp_outer_degree=OUTER)
    out: dict = {"rank": dist.get_rank(), "inner_rank": topo.inner_rank}

    def wrap(model, **kw):
        names = [n for n, _ in model.named_parameters()]
        sf.fully_shard(model, topo, **kw)
        return names, _describe(model, sf)

    torch.manual_seed(0)
    out["by_class"] = wrap(TinyTransformer(), units=(Block,))
    torch.manual_seed(0)
    out["tied_lca_root"] = wrap(TinyTransformer(), units=(nn.Embedding, nn.Linear))
    torch.manual_seed(0)
    out["tied_lca_pair"] = wrap(PairModel(), units=(Pair, nn.Linear))
    torch.manual_seed(0)
    out["mlp_size150"] = wrap(MLP(), comm_unit_size=150)
    torch.manual_seed(0)
    out["mlp_size1000"] = wrap(MLP(), comm_unit_size=1000)
    torch.manual_seed(0)
    out["transformer_size200"] = wrap(TinyTransformer(), comm_unit_size=200)
    torch.manual_seed(0)
    out["no_units"] = wrap(MLP())

    out["modulelist_by_size"] = _scenario(modulelist_by_size, topo)
    out["container_units"] = raised(lambda: sf.fully_shard(seeded(ListNet), topo, units=(nn.ModuleList,)))

    # argument errors (raised before any collective, so every rank raises alike)
    def bad(**kw):
        return raised(lambda: sf.fully_shard(MLP(), topo, **kw))

    out["errors"] = {
        "reshard_policy": bad(reshard_policy="after_step"),
        "comm_unit_size=0": bad(comm_unit_size=0),
        "comm_unit_size=-5": bad(comm_unit_size=-5),
        "units=class": bad(units=nn.Linear),
        "units=instance": bad(units=(nn.Linear(2, 2),)),
        "units=str": bad(units=("Linear",)),
        "replicate_filter": bad(replicate_filter="yes"),
        "topology": raised(lambda: sf.fully_shard(MLP(), 4)),
        "units+comm_unit_size": bad(units=(nn.Linear,), comm_unit_size=10),
    }
    return out


@pytest.fixture(scope="module")
def job():
    return run_distributed(units_job, WORLD, timeout=JOB_TIMEOUT_S)


def _units(job, key) -> dict[str, list[str]]:
    return dict(job[0][key][1]["units"])


def _check_partition(units: dict[str, list[str]], names: list[str]) -> None:
    owned = [n for ns in units.values() for n in ns]
    assert sorted(owned) == sorted(names), f"every parameter in exactly one unit: units {units}, names {names}"


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


def test_units_by_class(job):
    units = _units(job, "by_class")
    assert list(units) == ["", "blocks.0", "blocks.1"], units
    assert sorted(units[""]) == sorted(["tok.weight", "pos", "norm.weight", "norm.bias"]), units[""]
    for i in (0, 1):
        assert sorted(units[f"blocks.{i}"]) == sorted(
            f"blocks.{i}.{p}" for p in ("ln.weight", "ln.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    _check_partition(units, job[0]["by_class"][0])


def test_tied_parameter_goes_to_lowest_common_ancestor(job):
    units = _units(job, "tied_lca_root")  # tok (Embedding) and head (Linear) are units; the tied weight is not theirs
    assert "tok.weight" in units[""], units
    assert all("tok.weight" not in ns and "head.weight" not in ns for name, ns in units.items() if name), units
    assert "blocks.0.fc1" in units and units["blocks.0.fc1"] == ["blocks.0.fc1.weight", "blocks.0.fc1.bias"], units
    _check_partition(units, job[0]["tied_lca_root"][0])
    units = _units(job, "tied_lca_pair")  # a and b are Linear units inside the Pair unit that ties them
    assert "pair.a.weight" in units["pair"], units
    assert units.get("pair.a", []) == ["pair.a.bias"] and units.get("pair.b", []) == ["pair.b.bias"], units
    _check_partition(units, job[0]["tied_lca_pair"][0])


def test_units_by_comm_unit_size(job):
    numel = _numels(MLP())
    units = _units(job, "mlp_size150")  # fc1 (144) and fc2 (68) do not fit together in 150
    nonroot = {n: ns for n, ns in units.items() if n}
    assert sorted(map(sorted, nonroot.values())) == [["fc1.bias", "fc1.weight"], ["fc2.bias", "fc2.weight"]], units
    units = _units(job, "mlp_size1000")  # both fit in one unit
    nonroot = [ns for n, ns in units.items() if n]
    assert len(nonroot) == 1 and sorted(nonroot[0]) == sorted(numel), units
    tnumel = _numels(TinyTransformer())
    units = _units(job, "transformer_size200")
    for name, ns in units.items():
        if name:
            assert sum(tnumel[n] for n in ns) <= 200, f"unit {name} has {sum(tnumel[n] for n in ns)} > 200: {ns}"
    assert "tok.weight" in units[""] and "pos" in units[""], units  # tied and direct parameters stay in the root
    _check_partition(units, job[0]["transformer_size200"][0])
    units = _units(job, "no_units")
    assert list(units) == [""] and sorted(units[""]) == sorted(numel), units


@pytest.mark.parametrize("key,model", [("by_class", TinyTransformer), ("tied_lca_root", TinyTransformer),
                                       ("mlp_size150", MLP), ("transformer_size200", TinyTransformer)])
def test_fragments_keep_names_and_tile_parameters(job, key, model):
    torch.manual_seed(0)
    plain = model()
    numel = _numels(plain)
    want_dims = {n: p.dim() for n, p in plain.named_parameters()}
    for r in job:
        names_before, desc = r[key]
        assert desc["names"] == names_before, f"rank {r['rank']}: names changed: {desc['names']} vs {names_before}"
        dims = {n: d for n, (_, d, _) in desc["fragments"].items()}
        assert dims == want_dims, f"rank {r['rank']}: fragments' dims {dims}, the parameters' {want_dims}"
    for outer in range(OUTER):  # ranks outer*I .. outer*I + I-1 form an inner group
        group = job[outer * INNER:(outer + 1) * INNER]
        for n, want in numel.items():
            sizes = [r[key][1]["fragments"][n][0] for r in group]
            assert sum(sizes) == want, f"{key}: {n}: fragments {sizes} over the inner group, numel {want}"


@pytest.mark.parametrize("key,exc,word", [
    ("reshard_policy", "ValueError", "reshard_policy"),
    ("comm_unit_size=0", "ValueError", "comm_unit_size"),
    ("comm_unit_size=-5", "ValueError", "comm_unit_size"),
    ("units=class", "ValueError", "units"),
    ("units=instance", "ValueError", "units"),
    ("units=str", "ValueError", "units"),
    ("replicate_filter", "ValueError", "replicate_filter"),
    ("topology", "ValueError", "topology"),
    ("units+comm_unit_size", "ValueError", "units+comm_unit_size"),
])
def test_bad_arguments(job, key, exc, word):
    """`word`: what the message must name ("a+b": both)."""
    for r in job:
        got_type, msg = r["errors"][key]
        assert got_type == exc, f"rank {r['rank']}: {key}: expected {exc}, got {got_type}: {msg}"
        for w in word.split("+"):
            assert w in msg, f"rank {r['rank']}: {key}: the message should name {w!r}: {msg}"


def test_comm_unit_size_with_modulelist_matches_reference(job):
    rs = [r["modulelist_by_size"] for r in job]
    for rank, r in enumerate(rs):
        assert "error" not in r, f"rank {rank} raised:\n{r['error']}"
    ref = modulelist_reference(WORLD)
    for size in MODULELIST_SIZES:
        for rank, r in enumerate(rs):
            got = r[size]
            assert "error" not in got, f"comm_unit_size={size}, rank {rank} raised:\n{got['error']}"
            for unit_name, module_types in got["units"]:
                assert not any(t in ("ModuleList", "ModuleDict") for t in module_types), (
                    f"comm_unit_size={size}: unit {unit_name!r} is a container: {got['units']}")
            assert_close_dicts(got["full"], ref, f"comm_unit_size={size}, rank {rank}")
    # The sizes really pack the list's Linears in different ways (one, several or all three in a unit).
    packings = {tuple(tuple(m) for _, m in rs[0][s]["units"]) for s in MODULELIST_SIZES}
    assert len(packings) >= 3, f"the sizes give too few distinct packings: {packings}"


def test_container_as_unit_class_raises(job):
    for r in job:
        kind, msg = r["container_units"]
        assert kind is not None, f"rank {r['rank']}: units=(nn.ModuleList,) did not raise"
        assert kind == "ValueError", f"rank {r['rank']}: {kind}: {msg}"
        assert "ModuleList" in msg and "container" in msg, f"rank {r['rank']}: message does not name containers: {msg}"
