"""Gradients are final when the step's last ``backward()`` returns, as DDP and FSDP2 give them: the fragments'
``.grad`` then hold the gradient of the mean loss over the global batch, outer (replicate) all-reduce included.

One W=4 job, FSDP 4 and HSDP 2 x 2, a three-Linear model, against one process on the global batch:

- a hand-written update ``p -= lr * p.grad`` with no optimizer at all (so no step boundary ever runs);
- a hand-written gradient norm read right after ``backward()`` (every step: the first, before anything is predicted,
  and the later ones, whose last backward is predicted from the step before), then torch's AdamW;
- the same with two micro-batches per step and gradient sync on: after the second (last) backward the norm is the
  global one. The first micro-batch's gradients are not final from the second step on (they wait for the last
  backward's all-reduce, one per step), as documented.

Before the fix the outer all-reduce ran at ``optimizer.step()``: under HSDP the hand-written norm was that of one
replica's half of the batch, and the hand-written update diverged from the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from reference import global_randn, rank_randn

WORLD = 4
TAG = 71
STEPS, LR = 3, 0.05
LAYOUTS = (1, 2)  # fsdp_outer_degree
JOB_TIMEOUT_S = 180


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_randn(TAG, 10 * step + micro, rank, 2, 8), rank_randn(TAG + 1, 10 * step + micro, rank, 2, 4)


def global_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return global_randn(TAG, 10 * step + micro, WORLD, 2, 8), global_randn(TAG + 1, 10 * step + micro, WORLD, 2, 4)


def update(model: nn.Module, opt) -> None:
    """``opt.step()``, or with no optimizer the hand-written ``p -= lr * p.grad``; then the gradients are reset."""
    if opt is None:
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.zero_grad()
    else:
        opt.step()
        opt.zero_grad()


def reference(micro_batches: int, optimizer: bool) -> dict:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if optimizer else None
    norms = []
    for step in range(STEPS):
        for m in range(micro_batches):
            x, y = global_batch(step, m)
            (F.mse_loss(model(x), y) / micro_batches).backward()
        norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())))
        update(model, opt)
    return {"norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def final_gradients_job() -> dict:
    import torch.distributed as dist
    import shardfusion as sf

    out = {}
    for outer in LAYOUTS:
        topo = sf.Topology(sharding=WORLD, fsdp_outer_degree=outer)
        rank = topo.data_parallel_rank
        inner_group = topo.get_fsdp_inner_group()
        for micro_batches, optimizer in ((1, False), (1, True), (2, True)):
            model = sf.fully_shard(build(), topo, units=(nn.Linear,))
            opt = torch.optim.AdamW(model.parameters(), lr=LR) if optimizer else None
            norms = []
            for step in range(STEPS):
                for m in range(micro_batches):
                    x, y = batch(step, rank, m)
                    (F.mse_loss(model(x), y) / micro_batches).backward()
                # A hand-written norm: every element once over one replica's shards (the replicas are identical).
                sq = torch.zeros(())
                for p in model.parameters():
                    if p.grad is not None:
                        sq += p.grad.pow(2).sum()
                dist.all_reduce(sq, group=inner_group)
                norms.append(math.sqrt(float(sq)))
                update(model, opt)
            out[(outer, micro_batches, optimizer)] = {"norms": norms, "params": sf.full_state_dict(model)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(final_gradients_job, WORLD, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("micro_batches,optimizer", [(1, False), (1, True), (2, True)])
def test_gradients_final_when_last_backward_returns(results, micro_batches, optimizer):
    ref = reference(micro_batches, optimizer)
    for outer in LAYOUTS:
        what = f"outer {outer}, {micro_batches} micro-batch(es), {'AdamW' if optimizer else 'hand-written update'}"
        for rank, r in enumerate(results):
            got = r[(outer, micro_batches, optimizer)]
            for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
                assert abs(a - b) <= 1e-5 * max(1.0, b), (
                    f"{what}, rank {rank}, step {step}: norm read after backward {a} != reference {b}")
            for n, want in ref["params"].items():
                torch.testing.assert_close(got["params"][n], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what}, rank {rank}: {n}: {m}")


def _assigned_grad_job(stale: bool) -> dict:
    """SGD steps where, after ``zero_grad()``, the user assigns ``p.grad`` (a tensor of their own) to the first
    parameter before the backward; with ``stale``, a step ran before (its gradient left in the sharded buffer)."""
    import torch.distributed as dist
    import torch.nn as nn
    import shardfusion as sf

    torch.manual_seed(0)
    model = sf.fully_shard(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), sf.Topology(sharding=2),
                           units=(nn.Linear,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(3))[dist.get_rank()]
    for step in range(2 if stale else 1):
        opt.zero_grad()
        if step == (1 if stale else 0):
            p = next(model.parameters())
            p.grad = torch.full_like(p, 0.5)
        model(x).square().mean().backward()
        opt.step()
    return sf.full_state_dict(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stale", [False, True], ids=["first-step", "after-a-step"])
def test_a_grad_the_user_assigns_is_added_to(stale: bool):
    """Plain PyTorch adds the backward's gradient to a ``.grad`` the user assigned; so does a sharded model (the
    assigned value was dropped before)."""
    import torch.nn as nn

    got = run_distributed(_assigned_grad_job, 2, stale)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(3))
    for step in range(2 if stale else 1):
        opt.zero_grad()
        if step == (1 if stale else 0):
            p = next(ref.parameters())
            p.grad = torch.full_like(p, 0.5)
        (ref(xs[0]).square().mean() / 2 + ref(xs[1]).square().mean() / 2).backward()
        opt.step()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[0][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
