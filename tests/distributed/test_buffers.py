"""Module buffers of a sharded model: broadcast from the first data-parallel rank (schedule.Scheduler.sync_buffers).

One W=4 job at (I, O) = (2, 2). BatchNorm: three SGD steps on per-rank data move each rank's running statistics
apart; the eval forward that follows broadcasts them (as DDP does), so the eval output for one probe is the same on
every rank and equals the output of a plain model loaded (strictly) with sf.full_state_dict, computed in the test
process. A second model has a non-persistent buffer set to a different value on each rank: a training forward
broadcasts it (non-persistent buffers are synced, only state dicts leave them out).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

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
