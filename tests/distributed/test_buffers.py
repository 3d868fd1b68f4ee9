"""Module buffers of a sharded model: broadcast from the first data-parallel rank (Scheduler.sync_buffers).

One W=4 job at (I, O) = (2, 2). BatchNorm: three SGD steps on per-rank data move each rank's running statistics
apart; the eval forward that follows broadcasts them (as DDP does), so the eval output for one probe is the same on
every rank and equals the output of a plain model loaded (strictly) with sf.full_state_dict, computed in the test
process. A second model has a non-persistent buffer set to a different value on each rank: a training forward
broadcasts it (non-persistent buffers are synced, only state dicts leave them out).

DDP's semantics in training too: BatchNorm1d in training mode, 3 SGD steps; every training forward starts from the
first data-parallel rank's buffers on every rank, full_state_dict returns those on every rank, and statistics and
parameters equal the reference (rank 0's batch applied to the broadcast buffers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_distributed
from reference import assert_close_dicts, rank_randn, seeded, sgd_step, state_snapshot

JOB_TIMEOUT_S = 240


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


class Scaled(nn.Module):
    """A Linear times a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


def _buffers_job() -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    rank = dist.get_rank()
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=2)
    torch.manual_seed(0)
    m = sf.fully_shard(_bn_net(), topo, units=(nn.Linear,))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank)) + rank  # per-rank data
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    m.eval()
    with torch.no_grad():
        out = {"eval": m(torch.ones(1, 8)), "running_mean": m[1].running_mean.clone()}
    out["full"] = sf.full_state_dict(m)
    s = sf.fully_shard(Scaled(), topo, units=(nn.Linear,))
    s.scale.fill_(float(rank + 1))
    s(torch.ones(1, 4)).sum().backward()
    out["scale"] = s.scale.clone()
    out["training"] = batchnorm_buffers_in_training(topo)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_buffers_job, 4, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_batchnorm_eval_after_training_same_on_every_rank(runs):
    plain = _bn_net()
    plain.load_state_dict(runs[0]["full"])  # strict
    plain.eval()
    with torch.no_grad():
        expected = plain(torch.ones(1, 8))
    for rank, r in enumerate(runs):
        assert torch.equal(r["running_mean"], runs[0]["full"]["1.running_mean"]), rank
        torch.testing.assert_close(r["eval"], expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nonpersistent_buffer_broadcast_in_training_forward(runs):
    for rank, r in enumerate(runs):
        assert torch.equal(r["scale"], torch.ones(4)), (rank, r["scale"])  # rank 0's value


# --- BatchNorm buffers during training --------------------------------------------------------------------------------

BN_TAG, BN_STEPS, BN_LR = 5, 3, 0.1


def bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def batchnorm_buffers_in_training(topo) -> dict:
    """Worker: BatchNorm1d in training mode, 3 SGD steps. Records the buffers the BN forward starts from (after the
    runtime's broadcast), the local buffers after each step, and full_state_dict after each step."""
    import shardfusion as sf

    dp_rank = topo.data_parallel_rank
    model = sf.fully_shard(seeded(bn_net), topo, units=(nn.Linear,))
    seen = []

    def record(module, args):
        seen.append({n: b.detach().clone() for n, b in module.named_buffers()})

    model[1].register_forward_pre_hook(record)
    opt = torch.optim.SGD(model.parameters(), lr=BN_LR)
    local, full = [], []
    for step in range(BN_STEPS):
        model(rank_randn(BN_TAG, step, dp_rank, 16, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        local.append({f"1.{n}": b.detach().clone() for n, b in model[1].named_buffers()})
        full.append(sf.full_state_dict(model))
    return {"at_forward": seen, "local": local, "full": full}


def batchnorm_reference(world: int) -> dict:
    """Training-mode BatchNorm normalizes each rank's batch with that batch's statistics, so the loss is the mean of
    per-rank losses; every rank starts its forward from the first data-parallel rank's buffers (broadcast), and the
    buffers after the step are those that rank 0's forward left."""
    model = seeded(bn_net)
    bn = model[1]
    at_forward, after, params = [], [], []
    for step in range(BN_STEPS):
        start = {n: b.detach().clone() for n, b in bn.named_buffers()}
        at_forward.append(start)
        total, rank0_after = 0.0, None
        for r in range(world):
            for n, t in start.items():  # fresh tensors: the forward of the rank before saved its own for backward
                setattr(bn, n, t.clone())
            total = total + model(rank_randn(BN_TAG, step, r, 16, 8)).pow(2).mean()
            if r == 0:
                rank0_after = {n: b.detach().clone() for n, b in bn.named_buffers()}
        for n, t in rank0_after.items():
            setattr(bn, n, t.clone())
        (total / world).backward()
        sgd_step(model, BN_LR)
        after.append({f"1.{n}": t for n, t in rank0_after.items()})
        params.append(state_snapshot(model))
    return {"at_forward": at_forward, "after": after, "params": params}


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_batchnorm_buffers_identical_across_ranks(runs):
    """Each training forward starts from the first data-parallel rank's buffers on every rank, and full_state_dict
    returns those on every rank. (After a step each rank's *local* buffers hold its own batch's update, as under
    DDP, so they are not compared across ranks.)"""
    rs = [r["training"] for r in runs]
    ref = batchnorm_reference(4)
    for step in range(BN_STEPS):
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
            assert_close_dicts(r["full"][step], ref["params"][step], f"step {step}, rank {rank}")
        # The statistics are the reference's (rank 0's batch applied to the broadcast buffers).
        assert_close_dicts({f"1.{n}": t for n, t in rs[0]["at_forward"][step].items()},
                           {f"1.{n}": t for n, t in ref["at_forward"][step].items()}, f"step {step} at forward")
        assert_close_dicts(rs[0]["full"][step], ref["after"][step], f"step {step} buffers",
                           names=list(ref["after"][step]))
    assert rs[0]["full"][-1]["1.num_batches_tracked"].item() == BN_STEPS
