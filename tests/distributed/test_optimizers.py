"""Optimizers on a sharded model: element-wise ones train as in a single process; an optimizer built before
fully_shard and optimizers that read a parameter's shape or all parameters together are refused at their first step,
on every rank, before the step does anything (no collective, no update, no state); so is Muon holding a parameter
that ``whole_params`` did not keep whole (Muon on whole parameters: tests/distributed/test_whole_params.py).

One W=4 job on (I, O) = (2, 2); each check is a test. Training cases run 3 steps on a global batch of 16 rows (4 per
rank) and are compared with single-process training of the same model on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed, raised

JOB_TIMEOUT_S = 240
WORLD = 4
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6

ELEMENTWISE = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
}


class MyLBFGS(torch.optim.LBFGS):
    """A subclass is refused like its base."""


REFUSED = {
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=1e-2),
    "MyLBFGS": lambda p: MyLBFGS(p, lr=0.5, max_iter=4),
}


def build() -> nn.Module:
    """16 -> 32 -> 4 with biases: at I=2 some ranks hold empty fragments of the 4-element bias."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: x (16, 16), y (16, 4)."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(4 * WORLD, 16, generator=g), torch.randn(4 * WORLD, 4, generator=g)


def reference(name: str) -> dict[str, torch.Tensor]:
    """Single-process training on the whole batch; the parameters after the last step."""
    model = build()
    opt = ELEMENTWISE[name](model.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _local_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step)
    return F.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])


def _refused_step(model: nn.Module, opt, rank: int, sf) -> dict:
    """One forward/backward, then a step that must raise: its error, and what the step did before raising."""
    opt.zero_grad()
    _local_loss(model, 0, rank).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    closure = lambda: _local_loss(model, 0, rank)  # noqa: E731 - LBFGS needs one
    with sf.comm.CommCounter() as counter:
        error = raised(lambda: opt.step(closure))
    return {"error": error, "collectives": len(counter.records), "state": len(opt.state),
            "unchanged": all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())}


def optimizers_job() -> dict:
    import torch.distributed as dist
    import shardfusion as sf

    rank = dist.get_rank()
    topo = sf.Topology(sharding=WORLD, fsdp_outer_degree=2)
    out: dict = {"rank": rank, "train": {}, "refused": {}}
    for name, make in ELEMENTWISE.items():
        model = sf.fully_shard(build(), topo, units=(nn.Linear,))
        opt = make(model.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            _local_loss(model, step, rank).backward()
            opt.step()
        out["train"][name] = sf.full_state_dict(model)

    for name, make in REFUSED.items():
        model = sf.fully_shard(build(), topo, units=(nn.Linear,))
        out["refused"][name] = _refused_step(model, make(model.parameters()), rank, sf)

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before wrapping
    sf.fully_shard(model, topo, units=(nn.Linear,))
    out["refused"]["before-wrap"] = _refused_step(model, opt, rank, sf)

    model = build()  # between the calls of nested wrapping: holds the inner call's fragments
    sf.fully_shard(model[0], topo)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sf.fully_shard(model, topo)
    out["refused"]["between-nested"] = _refused_step(model, opt, rank, sf)

    model = sf.fully_shard(build(), topo, units=(nn.Linear,))
    out["muon"] = raised(lambda: torch.optim.Muon(model.parameters(), lr=1e-2))

    model = sf.fully_shard(build(), topo, units=(nn.Linear,), whole_params=lambda n, p: n == "0.weight")
    params = dict(model.named_parameters())
    opt = torch.optim.Muon([params["0.weight"]], lr=1e-2)  # whole: 2-D on every rank
    opt.add_param_group({"params": [params["2.weight"]]})  # element-sharded (rows): torch checks only in __init__
    out["refused"]["muon-fragment"] = _refused_step(model, opt, rank, sf)
    return out


@pytest.fixture(scope="module")
def job():
    return run_distributed(optimizers_job, WORLD, timeout=JOB_TIMEOUT_S)


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_optimizer_matches_single_process(job, name):
    want = reference(name)
    for r in job:
        got = r["train"][name]
        assert sorted(got) == sorted(want), f"rank {r['rank']}: names {sorted(got)}"
        for n, w in want.items():
            torch.testing.assert_close(got[n], w, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}, rank {r['rank']}, parameter {n}: {m}")


def _assert_refused_before_anything(job, key: str, *words: str) -> None:
    for r in job:
        got = r["refused"][key]
        kind, msg = got["error"]
        assert kind == "ValueError", f"rank {r['rank']}: {key}: expected ValueError, got {kind}: {msg}"
        for w in words:
            assert w in msg, f"rank {r['rank']}: {key}: the message should say {w!r}: {msg}"
        assert got["collectives"] == 0, f"rank {r['rank']}: {key}: the step issued {got['collectives']} collectives"
        assert got["unchanged"] and got["state"] == 0, f"rank {r['rank']}: {key}: the step changed something: {got}"


@pytest.mark.parametrize("name", list(REFUSED))
def test_non_elementwise_optimizer_is_refused_at_step(job, name):
    _assert_refused_before_anything(job, name, name, "fragments of a flat shard", "element-wise", "AdamW", "Muon")


def test_optimizer_built_before_fully_shard_is_refused(job):
    _assert_refused_before_anything(job, "before-wrap", "before fully_shard", "'0.weight'",
                                    "after fully_shard, from model.parameters()")


def test_optimizer_built_between_nested_calls_is_refused(job):
    _assert_refused_before_anything(job, "between-nested", "before fully_shard", "'0.weight'")


def test_muon_holding_a_split_parameter_is_refused_at_step(job):
    _assert_refused_before_anything(job, "muon-fragment", "Muon", "'2.weight'", "whole_params")


def test_muon_refuses_fragments_when_built(job):
    """torch.optim.Muon checks for 2-D parameters itself, on every rank, when it is built."""
    for r in job:
        kind, msg = r["muon"]
        assert kind == "ValueError" and "2D" in msg, f"rank {r['rank']}: {kind}: {msg}"
