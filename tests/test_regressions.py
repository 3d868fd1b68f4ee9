"""Regression tests for the defects of the review (repros r1-r7 and s15), each against a single-process reference.

Two spawned jobs run every scenario (the test process pays worker start-up twice, STYLE.md item 8):

* W=4, HSDP inner 2 x outer 2 (`sf.Topology(fsdp_outer_degree=2)`), default debug level: every scenario.
* W=2, plain FSDP (the repros' layout), under TORCH_DISTRIBUTED_DEBUG=DETAIL, so c10d also checks that every
  collective has the same op and shapes on every rank of its group: the rank-dependent loss (r4) with
  reshard_policy="after_backward" only, and the non-finite step (r7). r4 with "after_forward" is not run under DETAIL:
  it hangs there (see R4_DETAIL_POLICIES).

Each scenario returns a dict per rank (or {"error": traceback}); each test checks one scenario in the parent against
a reference computed here on one process: the model built under the same seed, the global batch = the concatenation
of every data-parallel rank's batch, loss = mean (all data-parallel ranks are distinct here: dp * sharding = W), so
its gradient is the library's (summed over the data-parallel ranks and divided by dp * sharding). Parameters are
compared through `sf.full_state_dict(model)` (full tensors, original shapes) at fp32 tolerances (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed

RTOL, ATOL = 1e-5, 1e-6
JOB_TIMEOUT_S = 120  # a hang (r4) shows up as a harness timeout of the job, well within the tests' timeouts
TEST_TIMEOUT_S = 2 * JOB_TIMEOUT_S + 60  # a test may wait for both jobs (the fixture runs them lazily)
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
POLICIES = ("after_forward", "after_backward")
LR = 0.1


# --- data -------------------------------------------------------------------------------------------------------------


def randn(tag: int, step: int, rank: int, *shape: int) -> torch.Tensor:
    """Data of data-parallel rank `rank` at `step` for scenario `tag` (the same on the worker and in the reference)."""
    g = torch.Generator().manual_seed(100_000 * tag + 100 * step + rank)
    return torch.randn(*shape, generator=g)


def global_batch(tag: int, step: int, world: int, *shape: int) -> torch.Tensor:
    """The reference's batch: every data-parallel rank's batch, concatenated in rank order."""
    return torch.cat([randn(tag, step, r, *shape) for r in range(world)])


def sgd_step(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    model.zero_grad(set_to_none=True)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_close_state(actual: dict, expected: dict, what: str, names=None) -> None:
    names = list(expected) if names is None else names
    for n in names:
        assert n in actual, f"{what}: {n} missing (has {sorted(actual)})"
        a, e = actual[n], expected[n]
        assert tuple(a.shape) == tuple(e.shape), f"{what}: {n}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.isfinite(a).all(), f"{what}: {n} is not finite: {a}"
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {n}: {m}")


# --- models -----------------------------------------------------------------------------------------------------------


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


def seq3() -> nn.Sequential:
    """Linear(8, 8), Tanh, Linear(8, 8), Tanh, Linear(8, 4): units 0, 2 and 4 with units=(nn.Linear,)."""
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def seq2() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


class AuxBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class AuxNet(nn.Module):
    """Body of two units, an auxiliary head of two units (AuxBlock), and an output Linear in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(AuxBlock(), AuxBlock())
        self.aux = nn.Sequential(AuxBlock(), AuxBlock())
        self.out = nn.Linear(8, 4)

    def forward(self, x):  # (B, 8) -> (B, 4), (B, 8)
        h = self.body(x)
        return self.out(h), self.aux(h)


def odd_mlp() -> nn.Sequential:
    """Odd sizes: the flat buffers of Linear(5, 3) and Linear(3, 1) have alignment gaps and padding."""
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def build(factory, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


# --- worker side: one function per scenario, called with the job's Topology ---------------------------------------

R1_TAG, R2_TAG, R3_TAG, R4_TAG, R7_TAG, R5_TAG = 1, 2, 3, 4, 7, 5
R1_SIZES = (50, 72, 100, 144, 216, 288, 10_000)  # 72 per Linear(8, 8): one per unit, two, three, the whole list, ...
R1_STEPS = 2
R2_FROZEN = ("0.weight", "0.bias", "2.bias")  # a whole unit (layer 0) and part of one (layer 2's bias)
R3_STEPS = 2
R4_STEPS = 3
R7_STEPS = 6
R7_BAD = {1: (0, math.inf), 3: (-1, math.nan)}  # step -> (rank whose loss is multiplied, factor); -1: the last rank
R7_MAX_NORM = 1.0
R5_STEPS = 3


def r4_aux_ranks(world: int) -> list[set]:
    """Ranks that add the auxiliary loss, per step (the last W=2 step: none)."""
    return [{0}, {1, 2}, {3}] if world == 4 else [{0}, {1}, set()]


def _rank_info(topo) -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "dp_rank": topo.data_parallel_rank}


def sc_r1_modulelist(topo) -> dict:
    """r1: comm_unit_size packing over an nn.ModuleList; 2 SGD steps. Also units=(nn.ModuleList,) must raise."""
    import shardfusion as sf

    info = _rank_info(topo)
    out = {"sizes": {}}
    for size in R1_SIZES:
        try:  # an error here is the same on every rank (a bad unit fails in its forward): go on with the next size
            model = sf.fully_shard(build(ListNet), topo, comm_unit_size=size)
            units = [(u.name, [type(m).__name__ for m in u.modules]) for u in sf.get_units(model)]
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for step in range(R1_STEPS):
                x, y = randn(R1_TAG, step, info["dp_rank"], 4, 8), randn(R1_TAG, 50 + step, info["dp_rank"], 4, 4)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            out["sizes"][size] = {"units": units, "full": sf.full_state_dict(model)}
        except Exception:  # noqa: BLE001 - reported by the test
            out["sizes"][size] = {"error": traceback.format_exc()}
    try:
        sf.fully_shard(build(ListNet), topo, units=(nn.ModuleList,))
        out["container_units"] = None
    except Exception as e:  # noqa: BLE001 - the type and message are the result
        out["container_units"] = (type(e).__name__, str(e))
    return out


def sc_r2_freeze(topo) -> dict:
    """r2: freeze after wrapping (layer 0, and layer 2's bias), 2 SGD steps; then unfreeze one frozen at wrap time."""
    import shardfusion as sf

    info = _rank_info(topo)
    out = {}
    for policy in POLICIES:
        model = sf.fully_shard(build(seq3), topo, units=(nn.Linear,), reshard_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=LR)  # built before freezing, as in a fine-tuning schedule
        frags = dict(model.named_parameters())
        for n in R2_FROZEN:
            frags[n].requires_grad_(False)
        before = sf.full_state_dict(model)
        grads = []
        for step in range(2):
            x, y = randn(R2_TAG, step, info["dp_rank"], 4, 8), randn(R2_TAG, 50 + step, info["dp_rank"], 4, 4)
            F.mse_loss(model(x), y).backward()
            sf.finish_grad_sync(model)
            grads.append({n: (None if p.grad is None else p.grad.clone(), p.numel())
                          for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        out[policy] = {"before": before, "after": sf.full_state_dict(model), "grads": grads}

    # Unfreezing a parameter that was frozen when fully_shard ran: an error on every rank, at the next forward.
    model = build(seq3)
    model[2].bias.requires_grad_(False)
    sf.fully_shard(model, topo, units=(nn.Linear,))
    dict(model.named_parameters())["2.bias"].requires_grad_(True)
    try:
        F.mse_loss(model(randn(R2_TAG, 9, info["dp_rank"], 4, 8)), torch.zeros(4, 4)).backward()
        out["unfreeze"] = None
    except Exception as e:  # noqa: BLE001 - the type and message are the result
        out["unfreeze"] = (type(e).__name__, str(e))
    return out


def _params_view(model) -> tuple[list, list]:
    named = list(model.named_parameters())
    return [(n, id(p)) for n, p in named], [(n, tuple(p.shape), isinstance(p, nn.Parameter)) for n, p in named]


def sc_r3_parameters_after_forward(topo) -> dict:
    """r3: model.parameters() after a forward without backward and between forward and backward; optimizer built
    after a warm-up forward."""
    import shardfusion as sf

    info = _rank_info(topo)
    out = {}
    for policy in POLICIES:
        for units_name, units in (("root-only", None), ("linear-units", (nn.Linear,))):
            model = sf.fully_shard(build(seq2), topo, units=units, reshard_policy=policy)
            at_wrap, _ = _params_view(model)
            warm = model(randn(R3_TAG, 99, info["dp_rank"], 2, 8))  # grad enabled, no backward
            ids_warm, shapes_warm = _params_view(model)
            opt = torch.optim.SGD(model.parameters(), lr=LR)  # built while `warm`'s graph is alive
            del warm
            between = []
            for step in range(R3_STEPS):
                x, y = randn(R3_TAG, step, info["dp_rank"], 4, 8), randn(R3_TAG, 50 + step, info["dp_rank"], 4, 4)
                loss = F.mse_loss(model(x), y)
                ids, shapes = _params_view(model)
                between.append((ids == at_wrap, shapes))
                loss.backward()
                opt.step()
                opt.zero_grad()
            out[f"{policy}/{units_name}"] = {"after_warm_same": ids_warm == at_wrap, "shapes_warm": shapes_warm,
                                             "between": between, "full": sf.full_state_dict(model)}
    return out


def sc_r4_rank_dependent_loss(topo, policies=POLICIES) -> dict:
    """r4: an auxiliary head's loss added on some ranks only; 3 SGD steps per reshard policy."""
    import shardfusion as sf

    info = _rank_info(topo)
    aux_ranks = r4_aux_ranks(info["world"])
    out = {}
    for policy in policies:
        model = sf.fully_shard(build(AuxNet), topo, units=(AuxBlock,), reshard_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        done = 0
        for step in range(R4_STEPS):
            x, y = randn(R4_TAG, step, info["dp_rank"], 4, 8), randn(R4_TAG, 50 + step, info["dp_rank"], 4, 4)
            o, a = model(x)
            loss = F.mse_loss(o, y)
            if info["dp_rank"] in aux_ranks[step]:
                loss = loss + a.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            done += 1
        out[policy] = {"steps_done": done, "full": sf.full_state_dict(model)}
    return out


def sc_r7_nonfinite_step(topo) -> dict:
    """r7: steps whose gradients are not finite (one rank's loss times inf or nan) are skipped by the user, then
    zero_grad(set_to_none=False). s15: zero_grad(set_to_none=True), no backward: the norm is 0."""
    import shardfusion as sf

    info = _rank_info(topo)
    bad = {s: (r % info["world"], f) for s, (r, f) in R7_BAD.items()}
    model = sf.fully_shard(build(odd_mlp), topo, units=(nn.Linear,))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms, stepped = [], []
    for step in range(R7_STEPS):
        x, y = randn(R7_TAG, step, info["dp_rank"], 4, 5), randn(R7_TAG, 50 + step, info["dp_rank"], 4, 1)
        loss = F.mse_loss(model(x), y)
        if step in bad and bad[step][0] == info["dp_rank"]:
            loss = loss * bad[step][1]
        loss.backward()
        norm = sf.clip_grad_norm_(model, R7_MAX_NORM)
        norms.append(norm.item())
        stepped.append(bool(torch.isfinite(norm)))
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=False)
    full = sf.full_state_dict(model)

    # s15 (a fresh model): a norm measured after zero_grad(set_to_none=True) and no backward is 0, not the last one.
    model = sf.fully_shard(build(odd_mlp), topo, units=(nn.Linear,))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = randn(R7_TAG, 90, info["dp_rank"], 4, 5), randn(R7_TAG, 91, info["dp_rank"], 4, 1)
    F.mse_loss(model(x), y).backward()
    norm_after_backward = sf.clip_grad_norm_(model, 1e9).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    norm_no_grads = sf.clip_grad_norm_(model, 1e9).item()
    grads_none = all(p.grad is None for p in model.parameters())
    return {"norms": norms, "stepped": stepped, "full": full, "s15_norm_after_backward": norm_after_backward,
            "s15_norm": norm_no_grads, "s15_grads_none": grads_none}


def sc_r5_batchnorm_buffers(topo) -> dict:
    """r5: BatchNorm1d in training mode, 3 SGD steps. Records the buffers the BN forward starts from (after the
    runtime's broadcast), the local buffers after each step, and full_state_dict after each step."""
    import shardfusion as sf

    info = _rank_info(topo)
    model = sf.fully_shard(build(bn_net), topo, units=(nn.Linear,))
    seen = []

    def record(module, args):
        seen.append({n: b.detach().clone() for n, b in module.named_buffers()})

    model[1].register_forward_pre_hook(record)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    local, full = [], []
    for step in range(R5_STEPS):
        model(randn(R5_TAG, step, info["dp_rank"], 16, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        local.append({f"1.{n}": b.detach().clone() for n, b in model[1].named_buffers()})
        full.append(sf.full_state_dict(model))
    return {"at_forward": seen, "local": local, "full": full}


def sc_r8_argument_errors(topo) -> dict:
    """fully_shard argument errors: (type name, message) of each, None if nothing was raised."""
    import shardfusion as sf

    calls = {
        "replicate_filter": lambda: sf.fully_shard(build(seq2), topo, replicate_filter="yes"),
        "topology": lambda: sf.fully_shard(build(seq2), 4),
        "units+comm_unit_size": lambda: sf.fully_shard(build(seq2), topo, units=(nn.Linear,), comm_unit_size=10),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the type and message are the result
            out[name] = (type(e).__name__, str(e))
    return out


# Under TORCH_DISTRIBUTED_DEBUG=DETAIL, r4 with "after_forward" hangs in the first backward: the rank that used the
# auxiliary head issues that unit's reduce-scatter (on the reduce group) before the body's backward all-gather (on the
# shard group), the other rank the all-gather first. Without DETAIL the two groups progress independently (by
# design); DETAIL's ProcessGroupWrapper checks each collective synchronously when it is issued, so each rank waits in
# a different group for the other. So only "after_backward" (no backward all-gathers) runs under DETAIL.
R4_DETAIL_POLICIES = ("after_backward",)

# name -> (scenario function, keyword arguments)
W4_SCENARIOS = {
    "r1": (sc_r1_modulelist, {}),
    "r2": (sc_r2_freeze, {}),
    "r3": (sc_r3_parameters_after_forward, {}),
    "r4": (sc_r4_rank_dependent_loss, {"policies": POLICIES}),
    "r7": (sc_r7_nonfinite_step, {}),
    "r5": (sc_r5_batchnorm_buffers, {}),
    "args": (sc_r8_argument_errors, {}),
}
W2_SCENARIOS = {
    "r4": (sc_r4_rank_dependent_loss, {"policies": R4_DETAIL_POLICIES}),
    "r7": (sc_r7_nonfinite_step, {}),
}


def scenarios_job(names: list[str], world: int, outer: int) -> dict:
    """Worker body: one Topology, then every named scenario in order; {name: result or {"error": traceback}}.

    A scenario that raises on every rank is recorded and the next one runs; one that raises on some ranks only
    leaves the others in a collective, which the harness reports as a timeout.
    """
    import shardfusion as sf

    topo = sf.Topology(fsdp_outer_degree=outer)
    table = W4_SCENARIOS if world == 4 else W2_SCENARIOS
    results = {}
    for name in names:
        try:
            fn, kwargs = table[name]
            results[name] = fn(topo, **kwargs)
        except Exception:  # noqa: BLE001 - reported per scenario to the parent
            results[name] = {"error": traceback.format_exc()}
    results["_info"] = _rank_info(topo)
    return results


# --- the jobs, run once per module ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobs():
    cache = {}

    def get(world: int):
        if world not in cache:
            try:
                if world == 4:
                    cache[4] = run_distributed(scenarios_job, 4, list(W4_SCENARIOS), 4, 2, timeout=JOB_TIMEOUT_S)
                else:
                    cache[2] = run_distributed(scenarios_job, 2, list(W2_SCENARIOS), 2, 1, timeout=JOB_TIMEOUT_S,
                                               env=DETAIL)
            except Exception as e:  # a failed job fails every test that needs it, without running it again
                cache[world] = e
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return get


def scenario(jobs, world: int, name: str) -> list[dict]:
    per_rank = jobs(world)
    rs = [r[name] for r in per_rank]
    for rank, r in enumerate(rs):
        if "error" in r:
            raise AssertionError(f"scenario {name!r} (W={world}) raised on rank {rank}:\n{r['error']}")
    return rs


# --- references (single process) ------------------------------------------------------------------------------------


def ref_r1(world: int) -> dict:
    model = build(ListNet)
    for step in range(R1_STEPS):
        x, y = global_batch(R1_TAG, step, world, 4, 8), global_batch(R1_TAG, 50 + step, world, 4, 4)
        F.mse_loss(model(x), y).backward()
        sgd_step(model)
    return snapshot(model)


def ref_r2(world: int) -> dict:
    model = build(seq3)
    before = snapshot(model)
    params = dict(model.named_parameters())
    for n in R2_FROZEN:
        params[n].requires_grad_(False)
    for step in range(2):
        x, y = global_batch(R2_TAG, step, world, 4, 8), global_batch(R2_TAG, 50 + step, world, 4, 4)
        F.mse_loss(model(x), y).backward()
        sgd_step(model)
    return {"before": before, "after": snapshot(model)}


def ref_r3(world: int) -> dict:
    model = build(seq2)
    for step in range(R3_STEPS):
        x, y = global_batch(R3_TAG, step, world, 4, 8), global_batch(R3_TAG, 50 + step, world, 4, 4)
        F.mse_loss(model(x), y).backward()
        sgd_step(model)
    return snapshot(model)


def ref_r4(world: int) -> dict:
    """Each rank's loss computed on its own batch; global loss = their mean over the ranks."""
    model = build(AuxNet)
    aux_ranks = r4_aux_ranks(world)
    for step in range(R4_STEPS):
        total = 0.0
        for r in range(world):
            o, a = model(randn(R4_TAG, step, r, 4, 8))
            loss = F.mse_loss(o, randn(R4_TAG, 50 + step, r, 4, 4))
            if r in aux_ranks[step]:
                loss = loss + a.pow(2).mean()
            total = total + loss
        (total / world).backward()
        sgd_step(model)
    return snapshot(model)


def ref_r7(world: int) -> dict:
    model = build(odd_mlp)
    bad = {s: (r % world, f) for s, (r, f) in R7_BAD.items()}
    norms = []
    for step in range(R7_STEPS):
        total = 0.0
        for r in range(world):
            loss = F.mse_loss(model(randn(R7_TAG, step, r, 4, 5)), randn(R7_TAG, 50 + step, r, 4, 1))
            if step in bad and bad[step][0] == r:
                loss = loss * bad[step][1]
            total = total + loss
        (total / world).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), R7_MAX_NORM)
        norms.append(norm.item())
        if torch.isfinite(norm):
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
        model.zero_grad(set_to_none=False)
    return {"norms": norms, "final": snapshot(model)}


def ref_r5(world: int) -> dict:
    """Training-mode BatchNorm normalizes each rank's batch with that batch's statistics, so the loss is the mean of
    per-rank losses; every rank starts its forward from the first data-parallel rank's buffers (broadcast), and the
    buffers after the step are those that rank 0's forward left."""
    model = build(bn_net)
    bn = model[1]
    at_forward, after, params = [], [], []
    for step in range(R5_STEPS):
        start = {n: b.detach().clone() for n, b in bn.named_buffers()}
        at_forward.append(start)
        total, rank0_after = 0.0, None
        for r in range(world):
            for n, t in start.items():  # fresh tensors: the forward of the rank before saved its own for backward
                setattr(bn, n, t.clone())
            total = total + model(randn(R5_TAG, step, r, 16, 8)).pow(2).mean()
            if r == 0:
                rank0_after = {n: b.detach().clone() for n, b in bn.named_buffers()}
        for n, t in rank0_after.items():
            setattr(bn, n, t.clone())
        (total / world).backward()
        sgd_step(model)
        after.append({f"1.{n}": t for n, t in rank0_after.items()})
        params.append(snapshot(model))
    return {"at_forward": at_forward, "after": after, "params": params}


# --- r1: comm_unit_size over an nn.ModuleList -----------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r1_comm_unit_size_with_modulelist_matches_reference(jobs):
    rs = scenario(jobs, 4, "r1")
    ref = ref_r1(4)
    for size in R1_SIZES:
        for rank, r in enumerate(rs):
            got = r["sizes"][size]
            assert "error" not in got, f"comm_unit_size={size}, rank {rank} raised:\n{got['error']}"
            for unit_name, module_types in got["units"]:
                assert not any(t in ("ModuleList", "ModuleDict") for t in module_types), (
                    f"comm_unit_size={size}: unit {unit_name!r} is a container: {got['units']}")
            assert_close_state(got["full"], ref, f"comm_unit_size={size}, rank {rank}")
    # The sizes really pack the list's Linears in different ways (one, several or all three in a unit).
    packings = {tuple(tuple(m) for _, m in rs[0]["sizes"][s]["units"]) for s in R1_SIZES}
    assert len(packings) >= 3, f"the sizes give too few distinct packings: {packings}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r1_container_as_unit_class_raises(jobs):
    for rank, r in enumerate(scenario(jobs, 4, "r1")):
        err = r["container_units"]
        assert err is not None, f"rank {rank}: units=(nn.ModuleList,) did not raise"
        kind, msg = err
        assert kind == "ValueError", f"rank {rank}: {kind}: {msg}"
        assert "ModuleList" in msg and "container" in msg, f"rank {rank}: message does not name containers: {msg}"


# --- r2: requires_grad changed after wrapping -----------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("policy", POLICIES)
def test_r2_freeze_after_wrap(jobs, policy):
    rs = scenario(jobs, 4, "r2")
    ref = ref_r2(4)
    trainable = [n for n in ref["after"] if n not in R2_FROZEN]
    for rank, r in enumerate(rs):
        got = r[policy]
        for step, grads in enumerate(got["grads"]):
            for n, (g, numel) in grads.items():
                if n in R2_FROZEN:
                    assert g is None, f"{policy}, rank {rank}, step {step}: frozen {n} has a gradient"
                elif numel:
                    assert g is not None, f"{policy}, rank {rank}, step {step}: trainable {n} has no gradient"
        for n in R2_FROZEN:
            assert torch.equal(got["after"][n], got["before"][n]), f"{policy}, rank {rank}: frozen {n} changed"
            assert torch.equal(got["after"][n], ref["before"][n]), f"{policy}, rank {rank}: {n} != initial value"
        assert_close_state(got["after"], ref["after"], f"{policy}, rank {rank}", names=trainable)
        for n in trainable:  # the others did train
            assert not torch.equal(got["after"][n], got["before"][n]), f"{policy}, rank {rank}: {n} did not train"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r2_unfreeze_after_wrap_raises_on_every_rank(jobs):
    rs = scenario(jobs, 4, "r2")
    for rank, r in enumerate(rs):
        err = r["unfreeze"]
        assert err is not None, f"rank {rank}: unfreezing a parameter frozen at wrap time did not raise"
        kind, msg = err
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {msg}"
        assert "2.bias" in msg and "before calling fully_shard" in msg, f"rank {rank}: {msg}"


# --- r3: model.parameters() after a forward without backward --------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r3_parameters_are_fragments_after_forward_and_train(jobs):
    rs = scenario(jobs, 4, "r3")
    ref = ref_r3(4)
    full_shapes = {n: tuple(t.shape) for n, t in ref.items()}
    for rank, r in enumerate(rs):
        assert set(r) == {f"{p}/{u}" for p in POLICIES for u in ("root-only", "linear-units")}
        for key, got in r.items():
            what = f"{key}, rank {rank}"
            assert got["after_warm_same"], f"{what}: parameters() after a forward without backward are not the " \
                                           f"fragments of wrap time: {got['shapes_warm']}"
            for n, shape, is_param in got["shapes_warm"]:
                assert len(shape) == 1 and is_param, f"{what}: {n} has shape {shape} after a forward"
            local = sum(shape[0] for _, shape, _ in got["shapes_warm"])
            assert local < sum(math.prod(s) for s in full_shapes.values()), (
                f"{what}: the parameters hold {local} elements, the whole model (not a shard): {got['shapes_warm']}")
            for step, (same, shapes) in enumerate(got["between"]):
                assert same, f"{what}, step {step}: parameters() between forward and backward changed: {shapes}"
                assert all(len(s) == 1 for _, s, _ in shapes), f"{what}, step {step}: {shapes}"
            assert_close_state(got["full"], ref, what)


# --- r4: a loss term on some ranks only -----------------------------------------------------------------------------


def _check_r4(rs: list[dict], world: int, policies: tuple, label: str) -> None:
    ref = ref_r4(world)
    init = snapshot(build(AuxNet))
    for rank, r in enumerate(rs):
        assert set(r) == set(policies), f"{label}, rank {rank}: ran {sorted(r)}"
        for policy in policies:
            got = r[policy]
            assert got["steps_done"] == R4_STEPS, f"{label} {policy}, rank {rank}: {got['steps_done']} steps"
            assert_close_state(got["full"], ref, f"{label} {policy}, rank {rank}")
            # The auxiliary head did train (its loss was used on some rank in some step).
            assert not torch.equal(got["full"]["aux.1.lin.weight"], init["aux.1.lin.weight"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r4_rank_dependent_loss_hsdp(jobs):
    """Both reshard policies, W=4 HSDP 2x2: no hang (the job's timeout), parameters equal the reference."""
    _check_r4(scenario(jobs, 4, "r4"), 4, POLICIES, "W=4 HSDP 2x2")


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r4_rank_dependent_loss_fsdp_detail(jobs):
    """W=2 FSDP under TORCH_DISTRIBUTED_DEBUG=DETAIL; "after_backward" only (R4_DETAIL_POLICIES)."""
    _check_r4(scenario(jobs, 2, "r4"), 2, R4_DETAIL_POLICIES, "W=2 FSDP (DETAIL)")


# --- r7 and s15: non-finite steps skipped, stale norms --------------------------------------------------------------


def _check_r7(rs: list[dict], world: int) -> None:
    ref = ref_r7(world)
    for step, ref_norm in enumerate(ref["norms"]):
        bad = step in R7_BAD
        assert math.isfinite(ref_norm) != bad, f"reference step {step}: norm {ref_norm} (bad step: {bad})"
    for rank, r in enumerate(rs):
        assert r["norms"] == rs[0]["norms"] or all(
            (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(r["norms"], rs[0]["norms"])), (
            f"norms differ across ranks: rank 0 {rs[0]['norms']} vs rank {rank} {r['norms']}")
        for step, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            if step in R7_BAD:
                assert not math.isfinite(got), f"W={world} rank {rank} step {step}: norm {got} should not be finite"
            else:
                assert math.isfinite(got), (f"W={world} rank {rank} step {step}: norm {got} after a skipped "
                                            f"non-finite step (all norms: {r['norms']})")
                assert math.isclose(got, want, rel_tol=RTOL), (
                    f"W={world} rank {rank} step {step}: norm {got} != reference {want}")
        assert r["stepped"] == [s not in R7_BAD for s in range(R7_STEPS)]
        assert_close_state(r["full"], ref["final"], f"W={world} rank {rank} after {R7_STEPS} steps")


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("world", (4, 2))
def test_r7_norm_recovers_after_skipped_nonfinite_step(jobs, world):
    _check_r7(scenario(jobs, world, "r7"), world)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("world", (4, 2))
def test_s15_norm_is_zero_after_zero_grad_set_to_none(jobs, world):
    for rank, r in enumerate(scenario(jobs, world, "r7")):
        assert r["s15_norm_after_backward"] > 0, f"rank {rank}: the step before had no gradient to forget"
        assert r["s15_grads_none"], f"rank {rank}: zero_grad(set_to_none=True) left gradients"
        assert r["s15_norm"] == 0.0, (f"W={world} rank {rank}: clip_grad_norm_ with no gradients returned "
                                      f"{r['s15_norm']} (the previous norm was {r['s15_norm_after_backward']})")


# --- r5: BatchNorm buffers ------------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_r5_batchnorm_buffers_identical_across_ranks(jobs):
    """DDP's semantics: each training forward starts from the first data-parallel rank's buffers on every rank, and
    full_state_dict returns those on every rank. (After a step each rank's *local* buffers hold its own batch's
    update, as under DDP, so they are not compared across ranks.)"""
    rs = scenario(jobs, 4, "r5")
    ref = ref_r5(4)
    for step in range(R5_STEPS):
        for rank, r in enumerate(rs):
            # Every training forward starts from the same buffers on every rank (the first data-parallel rank's).
            for n, t in r["at_forward"][step].items():
                assert torch.equal(t, rs[0]["at_forward"][step][n]), (
                    f"step {step}: BatchNorm {n} at the start of forward differs between rank 0 and rank {rank}")
            # full_state_dict gives the same buffers on every rank, those rank 0 holds.
            for n in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
                assert torch.equal(r["full"][step][n], rs[0]["full"][step][n]), (
                    f"step {step}: full_state_dict()[{n!r}] differs between rank 0 and rank {rank}")
                assert torch.equal(r["full"][step][n], rs[0]["local"][step][n]), (
                    f"step {step}: full_state_dict()[{n!r}] on rank {rank} is not the first data-parallel rank's")
            assert_close_state(r["full"][step], ref["params"][step], f"step {step}, rank {rank}")
        # The statistics are the reference's (rank 0's batch applied to the broadcast buffers).
        assert_close_state({f"1.{n}": t for n, t in rs[0]["at_forward"][step].items()},
                           {f"1.{n}": t for n, t in ref["at_forward"][step].items()}, f"step {step} at forward")
        assert_close_state(rs[0]["full"][step], ref["after"][step], f"step {step} buffers",
                           names=list(ref["after"][step]))
    assert rs[0]["full"][-1]["1.num_batches_tracked"].item() == R5_STEPS


# --- fully_shard argument errors ------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("arg", ("replicate_filter", "topology", "units+comm_unit_size"))
def test_fully_shard_argument_errors(jobs, arg):
    for rank, r in enumerate(scenario(jobs, 4, "args")):
        err = r[arg]
        assert err is not None, f"rank {rank}: bad {arg} did not raise"
        kind, msg = err
        assert kind == "ValueError", f"rank {rank}: {arg}: {kind}: {msg}"
        for word in arg.split("+"):
            assert word in msg, f"rank {rank}: the error does not name {word!r}: {msg}"
