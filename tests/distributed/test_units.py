"""Wrapping: which unit each parameter lands in, what `named_parameters()` yields afterwards, zero-size and frozen
parameters, the unit state around forward and backward, and argument errors.

Everything runs in one W=4 job on (I, O) = (2, 2) (sep/cp errors use their own topology); each check is a test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_distributed
from models import MLP, Block, HalfFrozenLinear, TinyTransformer, build_model, loss_fn, make_batch

JOB_TIMEOUT_S = 180
WORLD, INNER, OUTER = 4, 2, 2


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


def _attribute(module, dotted: str):
    """``module.a.b.weight`` for ``"a.b.weight"``: attribute lookup, as forward code does it."""
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _error(fn) -> tuple:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
        return type(e).__name__, str(e)
    return None, None


def units_job() -> dict:
    """Worker: wrap several models and report their units, fragments and errors."""
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

    # zero-size parameters: wrap, forward, backward, step, full_state_dict
    model = build_model("zero_size")
    names, desc = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn("zero_size", model, make_batch("zero_size", torch.Generator().manual_seed(1))).backward()
    opt.step()
    out["zero_size"] = (names, desc, {n: tuple(t.shape) for n, t in sf.full_state_dict(model).items()})

    # frozen parameters: a frozen unit and a unit with a frozen weight next to a trainable bias
    model = build_model("skip_frozen_a")
    model.b = HalfFrozenLinear(8, 8)
    full_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names, desc = wrap(model, units=(nn.Linear, HalfFrozenLinear))
    frag_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        loss_fn("skip", model, make_batch("skip", torch.Generator().manual_seed(2))).backward()
        sf.finish_grad_sync(model)
        grads = {n: p.grad is not None for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["frozen"] = {
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "has_grad": grads,
        "unchanged": {n: torch.equal(p.detach(), frag_before[n]) for n, p in model.named_parameters()},
        "full": {n: torch.equal(t, full_before[n]) for n, t in sf.full_state_dict(model).items() if n in full_before},
    }

    # unit states around forward and backward
    states = {}
    for policy in ("after_forward", "after_backward"):
        torch.manual_seed(0)
        model = sf.fully_shard(TinyTransformer(), topo, units=(Block,), reshard_policy=policy)
        units = sf.get_units(model)
        seen = {}

        def during_block1(mod, args, units=units, seen=seen):  # runs after the runtime's own pre-forward hook
            # What forward code sees: the attributes (module.weight) are full-shape views of one gathered buffer,
            # while named_parameters() keeps yielding the 1-D fragments the optimizer holds.
            seen["in_block1"] = {u.name: u.is_unsharded for u in units}
            attrs = {n: _attribute(mod, n) for n, _ in mod.named_parameters()}
            seen["storages"] = len({t.untyped_storage().data_ptr() for t in attrs.values()})
            seen["shapes"] = {n: tuple(t.shape) for n, t in attrs.items()}
            seen["registered_dims"] = {p.dim() for p in mod.parameters()}

        model.blocks[1].register_forward_pre_hook(during_block1)
        st = {"after_wrap": {u.name: u.is_unsharded for u in units},
              "fragment_storages": len({p.untyped_storage().data_ptr() for p in model.blocks[1].parameters()})}
        loss = loss_fn("transformer", model, make_batch("transformer", torch.Generator().manual_seed(3)))
        st["in_block1"] = seen["in_block1"]
        st["full_storages"], st["full_shapes"] = seen["storages"], seen["shapes"]
        st["registered_dims"] = seen["registered_dims"]
        st["after_forward"] = {u.name: u.is_unsharded for u in units}
        loss.backward()
        st["after_backward"] = {u.name: u.is_unsharded for u in units}
        states[policy] = st
    out["states"] = states

    # argument errors (raised before any collective, so every rank raises alike)
    def bad(**kw):
        return _error(lambda: sf.fully_shard(MLP(), topo, **kw))

    out["errors"] = {
        "reshard_policy": bad(reshard_policy="after_step"),
        "comm_unit_size=0": bad(comm_unit_size=0),
        "comm_unit_size=-5": bad(comm_unit_size=-5),
        "units=class": bad(units=nn.Linear),
        "units=instance": bad(units=(nn.Linear(2, 2),)),
        "units=str": bad(units=("Linear",)),
    }
    for kind, degrees in (("sep", {"sep": 2}), ("cp", {"cp": 2})):
        sub = sf.Topology(sharding=WORLD // 2, **degrees)
        out["errors"][kind] = _error(lambda: sf.fully_shard(MLP(), sub))
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
    numel = _numels(model())
    for r in job:
        names_before, desc = r[key]
        assert desc["names"] == names_before, f"rank {r['rank']}: names changed: {desc['names']} vs {names_before}"
        assert all(d == 1 for _, d, _ in desc["fragments"].values()), f"rank {r['rank']}: fragments are not 1-D"
    for outer in range(OUTER):  # ranks outer*I .. outer*I + I-1 form an inner group
        group = job[outer * INNER:(outer + 1) * INNER]
        for n, want in numel.items():
            sizes = [r[key][1]["fragments"][n][0] for r in group]
            assert sum(sizes) == want, f"{key}: {n}: fragments {sizes} over the inner group, numel {want}"


def test_zero_size_parameters(job):
    for r in job:
        names, desc, full_shapes = r["zero_size"]
        assert desc["names"] == names
        for n in ("empty", "lin.weight", "lin.bias"):
            assert desc["fragments"][n][0] == 0, f"rank {r['rank']}: {n} fragment {desc['fragments'][n]}"
        assert full_shapes["empty"] == (0,) and full_shapes["lin.weight"] == (0, 4) and full_shapes["lin.bias"] == (0,)
        assert full_shapes["a"] == (8,) and full_shapes["b"] == (24,)


def test_frozen_parameters(job):
    frozen = {"a.weight", "a.bias", "b.weight"}
    for r in job:
        f = r["frozen"]
        for n, rg in f["requires_grad"].items():
            assert rg == (n not in frozen), f"rank {r['rank']}: {n}.requires_grad is {rg}"
        for n in frozen:
            assert not f["has_grad"][n], f"rank {r['rank']}: frozen {n} has a gradient"
            assert f["unchanged"][n], f"rank {r['rank']}: frozen {n} changed"
            assert f["full"][n], f"rank {r['rank']}: frozen {n} in full_state_dict differs from its initial value"
        for n in ("b.bias", "head.weight", "head.bias"):
            assert f["has_grad"][n], f"rank {r['rank']}: trainable {n} has no gradient"
        assert not all(f["unchanged"][n] for n in ("b.bias", "head.weight", "head.bias")), (
            f"rank {r['rank']}: trainable parameters did not move")


def test_unit_states_around_forward_and_backward(job):
    for r in job:
        for policy, st in r["states"].items():
            where = f"rank {r['rank']}, {policy}"
            assert not any(st["after_wrap"].values()), f"{where}: unsharded right after wrapping: {st['after_wrap']}"
            assert st["in_block1"]["blocks.1"], f"{where}: blocks.1 not unsharded during its forward"
            blocks_after_fwd = {n: v for n, v in st["after_forward"].items() if n}
            if policy == "after_forward":
                assert not any(blocks_after_fwd.values()), f"{where}: blocks still unsharded: {st['after_forward']}"
            else:
                assert all(blocks_after_fwd.values()), (
                    f"{where}: blocks resharded before backward: {st['after_forward']}")
            assert not any(st["after_backward"].values()), f"{where}: unsharded after backward: {st['after_backward']}"


@pytest.mark.parametrize("key,exc,word", [
    ("reshard_policy", "ValueError", "reshard_policy"),
    ("comm_unit_size=0", "ValueError", "comm_unit_size"),
    ("comm_unit_size=-5", "ValueError", "comm_unit_size"),
    ("units=class", "ValueError", "units"),
    ("units=instance", "ValueError", "units"),
    ("units=str", "ValueError", "units"),
    ("sep", "NotImplementedError", "sep"),
    ("cp", "NotImplementedError", "cp"),
])
def test_bad_arguments(job, key, exc, word):
    for r in job:
        got_type, msg = r["errors"][key]
        assert got_type == exc, f"rank {r['rank']}: {key}: expected {exc}, got {got_type}: {msg}"
        assert word in msg, f"rank {r['rank']}: {key}: the message should name {word!r}: {msg}"


def test_unit_parameters_are_views_of_one_buffer(job):
    """Invariant 5: a unit's fragments are views of one shard, and during forward its full-shape parameters are
    views of one gathered buffer (no per-parameter tensors)."""
    torch.manual_seed(0)
    shapes = {n: tuple(p.shape) for n, p in Block().named_parameters()}
    for r in job:
        for policy, st in r["states"].items():
            where = f"rank {r['rank']}, {policy}"
            assert st["fragment_storages"] == 1, (
                f"{where}: blocks.1's fragments span {st['fragment_storages']} storages")
            assert st["full_storages"] == 1, f"{where}: blocks.1's parameters span {st['full_storages']} storages"
            assert st["full_shapes"] == shapes, f"{where}: shapes during forward {st['full_shapes']}"
            assert st["registered_dims"] == {1}, f"{where}: parameters() must yield 1-D fragments during forward"
