"""torch.compile of a sharded model: Inductor compiles the modules' compute, shardfusion's hooks run eagerly.

The hooks are excluded from tracing (``torch.compiler.disable``): Dynamo breaks the graph at each of them, so each
unit's compute between two hooks is one compiled graph, and the all-gathers, reshards and reduce-scatters run as
without compile. Checked against the single-process eager reference: W=4 HSDP (inner 2 x outer 2), SGD, 3 steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from models import MLP, MODEL_SEED, TinyTransformer

STEPS, BATCH, LR = 3, 8, 0.1
JOB_TIMEOUT_S = 420  # Inductor compiles each unit's forward and backward on every rank: slow on two cores


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    tokens = torch.randint(0, 16, (BATCH, 6), generator=g)
    return tokens, tokens


def _loss(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return F.mse_loss(out, target)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _build(kind: str) -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return MLP() if kind == "mlp" else TinyTransformer()


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad()
        loss = _loss(kind, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compiled_run(kind: str, units: tuple, reshard_policy: str) -> dict:
    import torch.distributed as dist

    import shardfusion as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    model = sf.fully_shard(_build(kind), sf.Topology(sharding=-1, fsdp_outer_degree=2), units=units,
                           reshard_policy=reshard_policy)
    compiled = torch.compile(model, backend="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad()
        loss = _loss(kind, compiled(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "full": sf.full_state_dict(model)}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_inductor_compiled_model_matches_eager_reference() -> None:
    from models import Block

    cases = [("mlp", (nn.Linear,), "after_forward"), ("tiny", (Block,), "after_backward")]
    for kind, units, policy in cases:
        ref_losses, ref_state = _reference(kind)
        results = run_distributed(_compiled_run, 4, kind, units, policy, timeout=JOB_TIMEOUT_S / 2)
        for r in results:
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), kind
            assert set(r["full"]) <= set(ref_state)  # a tied parameter appears once, under its first name
            for name, value in r["full"].items():
                torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")

