"""Activation checkpointing inside a sharded model (``torch.utils.checkpoint.checkpoint`` around each unit's call):
the non-reentrant form (``use_reentrant=False``) trains as one process does, under both reshard policies, FSDP over
2 ranks; the reentrant form is refused during the first backward, on every rank, with an error naming the unit and
the fix (its nested backward would reduce the gradients before the outer backward brought them all)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from harness import run_distributed

STEPS, LR = 3, 0.1
X = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))  # (ranks, B, 8): each rank's batch


class CheckpointedNet(nn.Module):
    """Three Linear units, each called through an activation checkpoint, then a tanh."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):  # x: (B, 8)
        for layer in self.layers:
            x = torch.tanh(checkpoint(layer, x, use_reentrant=self.reentrant))
        return x


def _build(reentrant: bool) -> CheckpointedNet:
    torch.manual_seed(0)
    return CheckpointedNet(reentrant)


def _train(model: nn.Module, batches: list[torch.Tensor], scale: float) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        for x in batches:
            (model(x).square().mean() * scale).backward()
        opt.step()
        opt.zero_grad()


def job(reentrant: bool, policy: str):
    import torch.distributed as dist
    import shardfusion as sf

    model = sf.fully_shard(_build(reentrant), sf.Topology(sharding=2), units=(nn.Linear,), reshard_policy=policy)
    try:
        # a reentrant checkpoint passes gradients only through inputs that require them
        _train(model, [X[dist.get_rank()].clone().requires_grad_(reentrant)], 1.0)
    except RuntimeError as e:
        return str(e)
    return sf.full_state_dict(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["after_forward", "after_backward"])
def test_non_reentrant_checkpoint_trains_as_one_process(policy: str):
    got = run_distributed(job, 2, False, policy)
    ref = _build(False)
    _train(ref, [X[0], X[1]], 0.5)  # the mean over the ranks' losses
    for rank, state in enumerate(got):
        assert isinstance(state, dict), f"rank {rank}: {state}"
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.timeout(120)
def test_reentrant_checkpoint_is_refused_on_every_rank():
    for rank, err in enumerate(run_distributed(job, 2, True, "after_forward")):
        assert isinstance(err, str), f"rank {rank} trained: a reentrant checkpoint must be refused"
        for words in ("reentrant activation checkpoint", "use_reentrant=False", "layers."):
            assert words in err, f"rank {rank}: {err}"
