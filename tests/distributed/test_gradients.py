"""Gradient semantics of ordinary PyTorch code on a sharded model, against the single-process reference.

Direct gradients: a loss term computed from ``model.parameters()`` (which yields the fragments after fully_shard),
e.g. an explicit L2 or L1 penalty, or a penalty on one parameter, counts once per element as in the unsharded model:
with inner-only sharding (O=1) and HSDP (O=2), with SGD and AdamW, with 2 micro-batches under no_sync, when the user
keeps gradients across steps (no zero_grad) or drops a backward's with zero_grad, when the penalty's gradient
arrives after the model's (term computed before the forward) under set_is_last_backward, and when the penalty has a
backward of its own. Replicas stay bitwise identical.

Double backward: a WGAN-GP-style gradient penalty (``autograd.grad(..., create_graph=True)`` then ``backward()``)
under after_forward, after_backward and root-only wrapping, and with set_is_last_backward; every unit is resharded
after the second backward. ``loss.backward(create_graph=True)`` still gives the first-order gradients.

A loss term used on some ranks only (an auxiliary head whose loss only some ranks add, different ranks in different
steps): no rank hangs and the parameters equal the reference, whose loss is the mean of the ranks' losses; at W=4
HSDP (2, 2) under both reshard policies, and at W=2 plain FSDP under TORCH_DISTRIBUTED_DEBUG=DETAIL with
"after_backward" (see AUX_DETAIL_POLICIES).

W=4; the configurations of each kind are sub-cases of one spawned job; each is its own test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from models import build_model
from reference import assert_close_dicts, rank_randn, seeded, sgd_step, state_snapshot

JOB_TIMEOUT_S = 240
WORLD, STEPS, BATCH, WD = 4, 3, 16, 0.05
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class GradCase:
    name: str
    outer: int = 2
    penalty: str = "l2"  # l2 | l1 | fc2_weight | wgan_gp | create_graph (no penalty: backward(create_graph=True))
    optim: str = "sgd"  # sgd | adamw
    micro: int = 1  # micro-batches per step (no_sync on all but the last)
    keep_grads: bool = False  # never zero_grad: every step adds to the kept gradients (plain PyTorch semantics)
    penalty_first: bool = False  # the penalty is computed before the forward: its gradient arrives last
    last_backward: bool = False  # set_is_last_backward on the last micro-batch
    own_backward: bool = False  # the penalty gets a backward of its own
    discarded_backward: bool = False  # each step starts with a backward whose gradients zero_grad() then drops
    units: bool = True  # units=(nn.Linear,), else the root unit only
    reshard_policy: str = "after_forward"


def _penalty(kind: str, named: dict[str, torch.Tensor]) -> torch.Tensor:
    """The parameter term of the loss; ``named``: model.named_parameters() (fragments after fully_shard)."""
    if kind == "l2":
        return 0.5 * WD * sum(p.pow(2).sum() for p in named.values())
    if kind == "l1":
        return WD * sum(p.abs().sum() for p in named.values())
    return WD * named["fc2.weight"].pow(2).sum()  # fc2_weight: one parameter only


def _wgan_gp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    out = model(x)
    grad_x, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() + (grad_x.norm(dim=1) - 1).pow(2).mean()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _optimizer(case: GradCase, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1) if case.optim == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def train(case: GradCase, model: nn.Module, chunk, sharded=None) -> None:
    """``STEPS`` optimizer steps of ``case`` on ``model``; ``chunk(t)`` is this process's part of a global batch
    tensor; ``sharded``: the shardfusion module (None for the single-process reference)."""
    opt = _optimizer(case, model.parameters())
    for step in range(STEPS):
        x, y = (chunk(t) for t in _batch(step))
        if case.discarded_backward:
            (F.mse_loss(model(x), y) + _penalty(case.penalty, dict(model.named_parameters()))).backward()
            opt.zero_grad()
        for m, (xm, ym) in enumerate(zip(x.chunk(case.micro), y.chunk(case.micro))):
            last = m == case.micro - 1
            if sharded is not None:
                sharded.set_requires_gradient_sync(model, last)
                sharded.set_is_last_backward(model, case.last_backward and last)
            if case.penalty == "wgan_gp":
                (_wgan_gp_loss(model, xm) / case.micro).backward()
                continue
            if case.penalty == "create_graph":
                (F.mse_loss(model(xm), ym) / case.micro).backward(create_graph=True)
                continue
            pen = _penalty(case.penalty, dict(model.named_parameters())) if case.penalty_first else None
            data = F.mse_loss(model(xm), ym)
            if pen is None:
                pen = _penalty(case.penalty, dict(model.named_parameters()))
            if case.own_backward:
                (data / case.micro).backward()
                (pen / case.micro).backward()
            else:
                ((data + pen) / case.micro).backward()
        opt.step()
        if not case.keep_grads:
            opt.zero_grad()


def _wrap_kwargs(case: GradCase) -> dict:
    kw = {"reshard_policy": case.reshard_policy}
    if case.units:
        kw["units"] = (nn.Linear,)
    return kw


def sharded_job(cases: list[GradCase], autograd_grad: bool = False, aux_policies: tuple = ()) -> dict:
    """Worker: train every case with shardfusion on this rank; the full parameters and fragments after training.
    With ``autograd_grad``, also what ``torch.autograd.grad`` of an L2 term over the fragments gives; with
    ``aux_policies``, the rank-dependent auxiliary loss under each of those reshard policies (outer degree 2)."""
    import torch.distributed as dist
    import shardfusion as sf

    rank, topologies, out = dist.get_rank(), {}, {}
    for case in cases:
        if case.outer not in topologies:
            topologies[case.outer] = sf.Topology(sharding=-1, fsdp_outer_degree=case.outer)
        topo = topologies[case.outer]
        model = sf.fully_shard(build_model("mlp"), topo, **_wrap_kwargs(case))
        dp_rank, dp = topo.data_parallel_rank, WORLD
        train(case, model, lambda t: t.chunk(dp)[dp_rank], sharded=sf)
        out[case.name] = {
            "full": {k: v.clone() for k, v in sf.full_state_dict(model).items()},
            "fragments": {n: p.detach().clone() for n, p in model.named_parameters()},
            "inner_rank": topo.inner_rank,
            "unsharded": [u.name for u in sf.get_units(model)[1:] if u.is_unsharded],
            "rank": rank,
        }
    if autograd_grad:
        out["autograd_grad"] = _autograd_grad_on_fragments(sf, topologies[2])
    if aux_policies:
        out["aux_loss_some_ranks"] = aux_loss_on_some_ranks(topologies[2], aux_policies)
    return out


def _autograd_grad_on_fragments(sf, topo) -> dict:
    """After a backward: autograd.grad of sum(p^2) over the fragments; whether it is 2p and leaves .grad as it was."""
    model = sf.fully_shard(build_model("mlp"), topo, units=(nn.Linear,))
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    sf.finish_grad_sync(model)
    params = list(model.parameters())
    before = [p.grad.clone() for p in params]
    grads = torch.autograd.grad(sum(p.pow(2).sum() for p in params), params)
    return {"is_2p": all(torch.equal(g, 2 * p.detach()) for g, p in zip(grads, params)),
            "grad_kept": all(torch.equal(b, p.grad) for b, p in zip(before, params))}


def reference(case: GradCase) -> dict[str, torch.Tensor]:
    model = build_model("mlp")
    train(case, model, lambda t: t)
    return {k: v.detach() for k, v in model.state_dict().items()}


_P = GradCase(name="")
DIRECT_CASES = [
    replace(_P, name="l2-sgd-O1", outer=1),
    replace(_P, name="l2-sgd-O2"),
    replace(_P, name="l2-adamw-O2", optim="adamw"),
    replace(_P, name="l1-adamw-O1", penalty="l1", optim="adamw", outer=1),
    replace(_P, name="fc2_weight-sgd-O2-after_backward", penalty="fc2_weight", reshard_policy="after_backward"),
    replace(_P, name="l2-sgd-O2-micro2-no_sync", micro=2),
    replace(_P, name="l2-adamw-O2-micro2-no_sync-last_backward-penalty_first", optim="adamw", micro=2,
            last_backward=True, penalty_first=True),
    replace(_P, name="l2-sgd-O2-keep_grads", keep_grads=True),
    replace(_P, name="l2-sgd-O2-own_backward", own_backward=True),
    replace(_P, name="l2-sgd-O2-discarded_backward", discarded_backward=True),
    replace(_P, name="l2-sgd-O2-last_backward-penalty_first", last_backward=True, penalty_first=True),
]
_G = GradCase(name="", penalty="wgan_gp")
DOUBLE_BACKWARD_CASES = [
    replace(_G, name="wgan_gp-O2-after_forward"),
    replace(_G, name="wgan_gp-O2-after_backward", reshard_policy="after_backward"),
    replace(_G, name="wgan_gp-O2-root_only", units=False),
    replace(_G, name="wgan_gp-O2-micro2-no_sync-last_backward", micro=2, last_backward=True),
    replace(_G, name="backward_create_graph-O2", penalty="create_graph"),
]


@pytest.fixture(scope="module")
def direct_results():
    return run_distributed(sharded_job, WORLD, DIRECT_CASES, autograd_grad=True, aux_policies=AUX_POLICIES,
                           timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def double_backward_results():
    return run_distributed(sharded_job, WORLD, DOUBLE_BACKWARD_CASES, timeout=JOB_TIMEOUT_S)


def _check_parity(results: list[dict], case: GradCase) -> None:
    ref = reference(case)
    for r in results:
        got = r[case.name]
        for name, expected in ref.items():
            torch.testing.assert_close(got["full"][name], expected, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{case.name}, rank {got['rank']}, {name}: {m}")
        assert got["unsharded"] == [], f"{case.name}, rank {got['rank']}: units left unsharded {got['unsharded']}"
    by_inner: dict[int, dict] = {}
    for r in results:  # replicas (same inner rank) hold bitwise identical fragments
        got = r[case.name]
        first = by_inner.setdefault(got["inner_rank"], got["fragments"])
        for name, frag in got["fragments"].items():
            assert torch.equal(frag, first[name]), f"{case.name}: replicas differ in {name} (rank {got['rank']})"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: c.name)
def test_parameter_term_counts_once(direct_results, case):
    _check_parity(direct_results, case)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")  # the reference's
@pytest.mark.parametrize("case", DOUBLE_BACKWARD_CASES, ids=lambda c: c.name)
def test_double_backward_gradient_penalty(double_backward_results, case):
    _check_parity(double_backward_results, case)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_autograd_grad_of_parameter_term_leaves_grad_alone(direct_results):
    for rank, r in enumerate(direct_results):
        assert r["autograd_grad"] == {"is_2p": True, "grad_kept": True}, f"rank {rank}: {r['autograd_grad']}"


# --- a loss term on some ranks only ---------------------------------------------------------------------------------

AUX_TAG, AUX_STEPS, AUX_LR = 4, 3, 0.1
AUX_POLICIES = ("after_forward", "after_backward")
# Under TORCH_DISTRIBUTED_DEBUG=DETAIL, "after_forward" hangs in the first backward: the rank that used the auxiliary
# head issues that unit's reduce-scatter (on the reduce group) before the body's backward all-gather (on the shard
# group), the other rank the all-gather first. Without DETAIL the two groups progress independently (by design);
# DETAIL's ProcessGroupWrapper checks each collective synchronously when it is issued, so each rank waits in a
# different group for the other (docs/design.md, invariant 1). So only "after_backward" (no backward all-gathers)
# runs under DETAIL.
AUX_DETAIL_POLICIES = ("after_backward",)


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


def aux_ranks(world: int) -> list[set]:
    """Ranks that add the auxiliary loss, per step (the last W=2 step: none)."""
    return [{0}, {1, 2}, {3}] if world == 4 else [{0}, {1}, set()]


def aux_loss_on_some_ranks(topo, policies: tuple) -> dict:
    """Worker: AuxNet, the auxiliary head's loss added on some ranks only; 3 SGD steps per reshard policy."""
    import torch.distributed as dist
    import shardfusion as sf

    dp_rank, adding = topo.data_parallel_rank, aux_ranks(dist.get_world_size())
    out = {}
    for policy in policies:
        model = sf.fully_shard(seeded(AuxNet), topo, units=(AuxBlock,), reshard_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=AUX_LR)
        done = 0
        for step in range(AUX_STEPS):
            x, y = rank_randn(AUX_TAG, step, dp_rank, 4, 8), rank_randn(AUX_TAG, 50 + step, dp_rank, 4, 4)
            o, a = model(x)
            loss = F.mse_loss(o, y)
            if dp_rank in adding[step]:
                loss = loss + a.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            done += 1
        out[policy] = {"steps_done": done, "full": sf.full_state_dict(model)}
    return out


def aux_loss_detail_job() -> dict:
    """Worker of the W=2 plain-FSDP job (under DETAIL)."""
    import shardfusion as sf

    return aux_loss_on_some_ranks(sf.Topology(sharding=-1, fsdp_outer_degree=1), AUX_DETAIL_POLICIES)


@pytest.fixture(scope="module")
def aux_detail_results():
    return run_distributed(aux_loss_detail_job, 2, timeout=JOB_TIMEOUT_S, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def aux_loss_reference(world: int) -> dict:
    """Each rank's loss computed on its own batch; global loss = their mean over the ranks."""
    model = seeded(AuxNet)
    adding = aux_ranks(world)
    for step in range(AUX_STEPS):
        total = 0.0
        for r in range(world):
            o, a = model(rank_randn(AUX_TAG, step, r, 4, 8))
            loss = F.mse_loss(o, rank_randn(AUX_TAG, 50 + step, r, 4, 4))
            if r in adding[step]:
                loss = loss + a.pow(2).mean()
            total = total + loss
        (total / world).backward()
        sgd_step(model, AUX_LR)
    return state_snapshot(model)


def _check_aux_loss(rs: list[dict], world: int, policies: tuple, label: str) -> None:
    ref = aux_loss_reference(world)
    init = state_snapshot(seeded(AuxNet))
    for rank, r in enumerate(rs):
        assert set(r) == set(policies), f"{label}, rank {rank}: ran {sorted(r)}"
        for policy in policies:
            got = r[policy]
            assert got["steps_done"] == AUX_STEPS, f"{label} {policy}, rank {rank}: {got['steps_done']} steps"
            assert_close_dicts(got["full"], ref, f"{label} {policy}, rank {rank}")
            # The auxiliary head did train (its loss was used on some rank in some step).
            assert not torch.equal(got["full"]["aux.1.lin.weight"], init["aux.1.lin.weight"])


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_loss_term_on_some_ranks_only_hsdp(direct_results):
    """Both reshard policies, W=4 HSDP 2x2: no hang (the job's timeout), parameters equal the reference."""
    _check_aux_loss([r["aux_loss_some_ranks"] for r in direct_results], WORLD, AUX_POLICIES, "W=4 HSDP 2x2")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_loss_term_on_some_ranks_only_fsdp_detail(aux_detail_results):
    """W=2 FSDP under TORCH_DISTRIBUTED_DEBUG=DETAIL; "after_backward" only (AUX_DETAIL_POLICIES)."""
    _check_aux_loss(aux_detail_results, 2, AUX_DETAIL_POLICIES, "W=2 FSDP (DETAIL)")
