"""F3 (shared/cases/CASES.md): experts that receive no tokens must not make ranks issue different collectives.

W=4, inner 2 x outer 2, 4 experts routed top-1 by a fixed router: the router reads the first 4 input features
(times 50), and data-parallel rank r's tokens carry a +1 on feature r mod 4, so rank r routes everything to expert
r mod 4. In step 1 (the second of three) rank r routes to r mod 3 instead: no rank sends anything to expert 3, and
most rank pairs exchange nothing in the all-to-alls (uneven and empty splits). Run at ep 1 and 2, with
every expert in a unit of its own and with the experts fused in the MoE's unit, under both expert policies, in one
job under TORCH_DISTRIBUTED_DEBUG=DETAIL (c10d checks every collective has the same op and shapes on every rank).

Asserts: every step ends within the timeout; expert gradients equal the single-process reference (missing
contributions are zeros) every step; expert 3 is bitwise unchanged by the SGD step (no weight decay) in which it got
no token; parameters equal the reference; replicas are bitwise identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from reference import assemble_all, assert_close_dicts, assert_replicas_identical, placement

JOB_TIMEOUT_S = 240
WORLD, INNER, OUTER, EXPERTS, STEPS, BATCH, LR = 4, 2, 2, 4, 3, 3, 0.1
EMPTY_STEP = 1  # the step in which no rank routes to expert 3


class RoutedMoE(nn.Module):
    """MoE(8 -> 4 experts of hidden 8, top-1) with a fixed router reading features 0..3, then Linear(8, 2)."""

    def __init__(self, ep_group=None) -> None:
        super().__init__()
        from shardfusion.moe import MoE

        self.moe = MoE(8, 8, EXPERTS, top_k=1, ep_group=ep_group)
        with torch.no_grad():
            self.moe.router.weight.zero_()
            self.moe.router.weight[:, :EXPERTS] = 50 * torch.eye(EXPERTS)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # (B, 8) -> (B, 2)
        return self.head(self.moe(x))


def batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `dp_rank`'s micro-batch in `step`: tokens routed to expert dp_rank mod 4 (mod 3 in EMPTY_STEP)."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    x = 0.1 * torch.randn(BATCH, 8, generator=g)  # (B, 8)
    x[:, dp_rank % (3 if step == EMPTY_STEP else EXPERTS)] += 1.0
    return x, torch.randn(BATCH, 2, generator=g)


def build(ep_group=None) -> RoutedMoE:
    torch.manual_seed(42)
    return RoutedMoE(ep_group)


@dataclass(frozen=True)
class Variant:
    ep: int
    units: str  # "separate": each expert a unit; "fused": the whole MoE one unit
    policy: str

    @property
    def name(self) -> str:
        return f"ep{self.ep}-{self.units}-{self.policy}"


VARIANTS = [Variant(ep, units, policy) for ep in (1, 2) for units in ("separate", "fused")
            for policy in ("replicate", "shard")]


def reference() -> dict:
    """One process, all experts: loss = mean over the data-parallel ranks' MSE losses; SGD without weight decay."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads, params = [], []
    for step in range(STEPS):
        losses = [F.mse_loss(model(x), y) for x, y in (batch(r, step) for r in range(WORLD))]
        torch.stack(losses).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"grads": grads, "params": params, "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def _run_variant(v: Variant, topos: dict) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion.moe import Expert, MoE

    if v.ep not in topos:
        topos[v.ep] = sf.Topology(sharding=INNER * OUTER, fsdp_outer_degree=OUTER, ep=v.ep, timeout=60)
    topo = topos[v.ep]
    model = build(topo.get_group("ep"))
    sf.fully_shard(model, topo, units=(Expert,) if v.units == "separate" else (MoE,), expert_policy=v.policy)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"coords": {"rank": dist.get_rank(), "mp_rank": 0}, "placement": placement(model), "grads": [],
           "params": [], "routed": []}
    for step in range(STEPS):
        x, y = batch(topo.data_parallel_rank, step)
        F.mse_loss(model(x), y).backward()
        out["routed"].append(model.moe.tokens_per_expert.tolist())
        sf.finish_grad_sync(model)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    out["units"] = len(sf.get_units(model))
    out["debug_level"] = str(dist.get_debug_level())
    return out


def _job() -> dict:
    topos: dict = {}
    return {v.name: _run_variant(v, topos) for v in VARIANTS}


@pytest.fixture(scope="module")
def f3_results():
    return run_distributed(_job, WORLD, timeout=JOB_TIMEOUT_S, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


@pytest.fixture(scope="module")
def f3_reference():
    return reference()


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_f3_expert_without_tokens(f3_results, f3_reference, variant):
    rs = [r[variant.name] for r in f3_results]
    assert all(r["debug_level"] == "DebugLevel.DETAIL" for r in rs)
    # The routing really is as described: nobody sends to expert 3 in EMPTY_STEP; rank r sends to r mod 4 otherwise.
    for rank, r in enumerate(rs):
        for step, routed in enumerate(r["routed"]):
            target = rank % (3 if step == EMPTY_STEP else EXPERTS)
            assert routed == [BATCH if e == target else 0 for e in range(EXPERTS)], (rank, step, routed)
    expected_units = 1 + (EXPERTS // variant.ep if variant.units == "separate" else 1)  # local experts only
    assert {r["units"] for r in rs} == {expected_units}
    ref = f3_reference
    for step in range(STEPS):
        got = assemble_all(rs, "grads", step, ref["shapes"])
        assert_close_dicts(got, ref["grads"][step], f"F3 {variant.name}: gradient, step {step}")
        got = assemble_all(rs, "params", step, ref["shapes"])
        assert_close_dicts(got, ref["params"][step], f"F3 {variant.name}: params after step {step}")
    before = assemble_all(rs, "params", EMPTY_STEP - 1, ref["shapes"])
    after = assemble_all(rs, "params", EMPTY_STEP, ref["shapes"])
    grads = assemble_all(rs, "grads", EMPTY_STEP, ref["shapes"])
    expert3 = [n for n in ref["shapes"] if n.startswith("moe.experts.3.")]
    assert expert3
    for n in expert3:
        assert not grads[n].any(), f"{n} got a gradient in the step without tokens"
        assert torch.equal(before[n], after[n]), f"{n} changed in the step in which it got no token"
    assert_replicas_identical(rs, "params", f"F3 {variant.name}")
