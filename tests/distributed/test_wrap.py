"""Wrapping habits: sharding the children and then the root (nested fully_shard), a module shared by two units, and
what fully_shard refuses (unit classes that match nothing, casting or moving after wrapping).

Training cases run 3 SGD steps at W=4 on a global batch of 16 rows (4 per rank) and are compared with single-process
training of the same model (same seed) on the whole batch: the global mean loss of every step and every parameter
(``full_state_dict``) after the last one. Everything runs in one W=4 job; each check is a test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed, raised

JOB_TIMEOUT_S = 240
WORLD = 4
D = 16  # model width
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6


class Block(nn.Module):
    """x + fc2(tanh(fc1(ln(x)))): a unit of three modules with unequal parameter sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):  # x: (B, D)
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Deep(nn.Module):
    """Two Blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, D)

    def forward(self, x):  # x: (B, D)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Tied(nn.Module):
    """``out.weight is inp.weight``: a weight tied across the boundary of a module sharded on its own (``out``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.out.weight = self.inp.weight

    def forward(self, x):  # x: (B, D)
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class SharedBlock(nn.Module):
    def __init__(self, fc: nn.Linear) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = fc

    def forward(self, x):  # x: (B, D)
        return x + self.fc(self.norm(x))


class Shared(nn.Module):
    """One Linear shared by two SharedBlock units: its parameters belong to their common ancestor (the root)."""

    def __init__(self) -> None:
        super().__init__()
        fc = nn.Linear(D, D)
        self.b1, self.b2 = SharedBlock(fc), SharedBlock(fc)

    def forward(self, x):  # x: (B, D)
        return self.b2(self.b1(x))


def _stack(bias: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(D, D, bias=bias), nn.Tanh(), nn.Linear(D, D, bias=bias))


MODELS = {
    "linears-nobias": lambda: _stack(False),  # equal shard sizes in every unit
    "linears-bias": lambda: _stack(True),  # 272 elements per unit: unequal fragments
    "three-levels": Deep,
    "mixed-units": Deep,
    "tied-across": Tied,
    "shared-after_forward": Shared,
    "shared-after_backward": Shared,
}


def build(key: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[key]()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: x (16, D), y (16, D)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * WORLD, D, generator=g), torch.randn(4 * WORLD, D, generator=g)


def _wrap_nested(key: str, model: nn.Module, topo, sf) -> None:
    """Shard the children first (FSDP2's idiom), then the root."""
    if key.startswith("linears"):
        for layer in model:
            if isinstance(layer, nn.Linear):
                sf.fully_shard(layer, topo)
        sf.fully_shard(model, topo)
    elif key == "three-levels":  # fc1 in each block, then each block (block 0 kept gathered), then the root
        for i, block in enumerate(model.blocks):
            sf.fully_shard(block.fc1, topo)
            sf.fully_shard(block, topo, reshard_policy="after_backward" if i == 0 else "after_forward")
        sf.fully_shard(model, topo)
    elif key == "mixed-units":  # the head on its own, the blocks by class in the root's call
        sf.fully_shard(model.head, topo)
        sf.fully_shard(model, topo, units=(Block,))
    elif key == "tied-across":
        sf.fully_shard(model.out, topo)
        sf.fully_shard(model, topo)
    elif key.startswith("shared"):
        sf.fully_shard(model, topo, units=(SharedBlock,), reshard_policy=key.split("-")[1])
    else:
        raise KeyError(key)


def _train(model: nn.Module, rank: int) -> list[float]:
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
        loss.backward()
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / WORLD)
    return losses


def reference(key: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of the same model on the whole batch."""
    model = build(key)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}  # tied: each name


def wrap_job(keys: tuple = tuple(MODELS), refusals: bool = True) -> dict:
    """Worker: train the cases ``keys`` on both layouts, then (with ``refusals``) try what fully_shard refuses."""
    import torch.distributed as dist
    import shardfusion as sf

    rank = dist.get_rank()
    topos = {"I4": sf.Topology(sharding=WORLD), "I2O2": sf.Topology(sharding=WORLD, fsdp_outer_degree=2)}
    out: dict = {"rank": rank, "train": {}, "errors": {}}
    for key in keys:
        for layout, topo in topos.items():
            model = build(key)
            _wrap_nested(key, model, topo, sf)
            units = [(u.name, u.reshard_after_forward, list(u.param_names)) for u in sf.get_units(model)]
            losses = _train(model, rank)
            out["train"][(key, layout)] = {"losses": losses, "full": sf.full_state_dict(model), "units": units}
    if refusals:
        out["errors"] = _refusals(topos["I2O2"], sf)
    return out


def _refusals(topo, sf) -> dict:
    """``{case: (error type, message)}`` for each thing fully_shard must refuse (on every rank)."""
    errors: dict = {}

    def mismatch(inner_topo, **inner_kw):
        model = build("linears-bias")
        sf.fully_shard(model[0], inner_topo, **inner_kw)
        sf.fully_shard(model[2], topo)
        return raised(lambda: sf.fully_shard(model, topo))

    errors["mismatch-param_dtype"] = mismatch(topo, mp_policy=sf.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    errors["mismatch-prefetch"] = mismatch(topo, prefetch=0)
    errors["mismatch-topology"] = mismatch(sf.Topology(sharding=WORLD // 2, dp=2))

    model = sf.fully_shard(build("linears-bias"), topo)
    errors["inside-sharded"] = raised(lambda: sf.fully_shard(model[0], topo))

    errors["unmatched-units"] = raised(lambda: sf.fully_shard(build("three-levels"), topo, units=(nn.Conv1d, nn.GRU)))

    casts = {"double": lambda m: m.double(), "half": lambda m: m.half(),
             "to_float64": lambda m: m.to(torch.float64), "to_meta": lambda m: m.to("meta")}
    for name, cast in casts.items():
        model = sf.fully_shard(build("three-levels"), topo, units=(Block,))
        cast(model)
        errors[f"cast-{name}"] = raised(lambda: model(torch.randn(2, D)))
    return errors


@pytest.fixture(scope="module")
def job():
    return run_distributed(wrap_job, WORLD, timeout=JOB_TIMEOUT_S)


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)

LAYOUTS = ("I4", "I2O2")


def _check_training(job, key: str, layout: str) -> None:
    ref_losses, ref_params = reference(key)
    for r in job:
        got = r["train"][(key, layout)]
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{key} {layout} rank {r['rank']}: losses: {m}")
    full = job[0]["train"][(key, layout)]["full"]
    assert sorted(full) == sorted(ref_params), f"{key} {layout}: names {sorted(full)} vs {sorted(ref_params)}"
    for name, want in ref_params.items():
        torch.testing.assert_close(full[name], want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{key} {layout}: parameter {name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("key", ["linears-nobias", "linears-bias", "three-levels", "mixed-units", "tied-across"])
def test_nested_fully_shard_matches_single_process(job, key, layout):
    _check_training(job, key, layout)


def test_nested_fully_shard_keeps_inner_units(job):
    units = {name: (reshard, params) for name, reshard, params in job[0]["train"][("three-levels", "I2O2")]["units"]}
    assert list(units) == ["", "blocks.0", "blocks.0.fc1", "blocks.1", "blocks.1.fc1"], units
    assert units["blocks.0.fc1"][1] == ["blocks.0.fc1.weight", "blocks.0.fc1.bias"], units
    assert sorted(units["blocks.0"][1]) == sorted(
        f"blocks.0.{p}" for p in ("ln.weight", "ln.bias", "fc2.weight", "fc2.bias")), units
    assert sorted(units[""][1]) == ["head.bias", "head.weight"], units
    # block 0 was sharded with reshard_policy="after_backward": it keeps it; the others reshard after forward
    assert {n: r for n, (r, _) in units.items()} == {
        "": False, "blocks.0": False, "blocks.0.fc1": True, "blocks.1": True, "blocks.1.fc1": True}, units
    mixed = [name for name, _, _ in job[0]["train"][("mixed-units", "I2O2")]["units"]]
    assert mixed == ["", "blocks.0", "blocks.1", "head"], mixed


def test_shared_module_goes_to_common_ancestor(job):
    for policy in ("after_forward", "after_backward"):
        units = {name: params for name, _, params in job[0]["train"][(f"shared-{policy}", "I2O2")]["units"]}
        assert units[""] == ["b1.fc.weight", "b1.fc.bias"], units
        assert units["b1"] == ["b1.norm.weight", "b1.norm.bias"] and units["b2"] == ["b2.norm.weight",
                                                                                      "b2.norm.bias"], units


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["after_forward", "after_backward"])
def test_shared_module_matches_single_process(job, policy, layout):
    _check_training(job, f"shared-{policy}", layout)


def _assert_error(job, key: str, *words: str) -> None:
    for r in job:
        kind, msg = r["errors"][key]
        assert kind == "ValueError", f"rank {r['rank']}: {key}: expected ValueError, got {kind}: {msg}"
        for w in words:
            assert w in msg, f"rank {r['rank']}: {key}: the message should say {w!r}: {msg}"


@pytest.mark.parametrize("option", ["param_dtype", "prefetch", "topology"])
def test_nested_call_with_other_options_is_refused(job, option):
    _assert_error(job, f"mismatch-{option}", option, "'0'")


def test_wrapping_inside_a_sharded_module_is_refused(job):
    _assert_error(job, "inside-sharded", "'0'", "already sharded", "submodules first")


def test_unit_classes_matching_no_module_are_refused(job):
    _assert_error(job, "unmatched-units", "Conv1d", "GRU", "match no module")


@pytest.mark.parametrize("cast", ["double", "half", "to_float64", "to_meta"])
def test_cast_or_move_after_wrapping_is_refused_at_forward(job, cast):
    _assert_error(job, f"cast-{cast}", "cast or moved after fully_shard", "before calling fully_shard")
