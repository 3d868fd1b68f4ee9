"""Invariant 6 with MoE experts: fp32 training of a tiny GPT-MoE equals the single-process reference.

The model (tests/models.py `TinyMoETransformer`) has 2 MoE blocks of 4 experts (top-2, plus a shared expert) and a
load-balancing loss. Each configuration trains 5 steps of 3 micro-batches with AdamW and global-norm clipping at
0.5, on W=4 with (ep, outer) = (1, 2), (2, 2), (4, 1) and W=8 with (2, 2), (4, 2), each under both expert policies
("replicate": experts sharded over the expert inner group and all-reduced over outer; "shard": sharded over the whole
moe_sharding group). Compared with `reference.reference_train` (all experts in one process): the loss every step,
every parameter after every step (experts assembled from the ranks of their ep index), `full_state_dict` on every
rank (all experts, global names), the global gradient norm of both types measured before clipping every step, and
bitwise-identical replicas. One spawned job per world size runs all of its configurations.

F3 (docs/field-cases.md): experts that receive no tokens must not make ranks issue different collectives. W=4,
inner 2 x outer 2, 4 experts routed top-1 by a fixed router: the router reads the first 4 input features (times 50),
and data-parallel rank r's tokens carry a +1 on feature r mod 4, so rank r routes everything to expert r mod 4. In
step 1 (the second of three) rank r routes to r mod 3 instead: no rank sends anything to expert 3, and most rank
pairs exchange nothing in the all-to-alls (uneven and empty splits). Run at ep 1 and 2, with every expert in a unit
of its own and with the experts fused in the MoE's unit, under both expert policies, in one job under
TORCH_DISTRIBUTED_DEBUG=DETAIL (c10d checks every collective has the same op and shapes on every rank). Asserts:
every step ends within the timeout; expert gradients equal the single-process reference (missing contributions are
zeros) every step; expert 3 is bitwise unchanged by the SGD step (no weight decay) in which it got no token;
parameters equal the reference; replicas are bitwise identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from reference import (Case, assemble_all, assert_close_dicts, assert_replicas_identical, case_results, check_parity,
                       placement, reference_train, run_cases)

JOB_TIMEOUT_S = 300

_M = Case(name="", model="moe", optim="adamw_groups", micro=3, clip=(0.5, 2.0), measure_norms=(2.0, float("inf")))


def _grid(world: int, layouts, policies=("replicate", "shard")) -> list[Case]:
    return [_M.with_(name=f"moe-W{world}-ep{ep}-O{outer}-{policy}", world=world, ep=ep, outer=outer,
                     expert_policy=policy)
            for ep, outer in layouts for policy in policies]


W4_CASES = [
    *[c.with_(count_comm=c.ep == 2) for c in _grid(4, ((1, 2), (2, 2), (4, 1)))],
    # every expert a unit of its own (nested in its block's unit), and the after_backward policy
    _M.with_(name="moe-W4-ep2-O2-expert-units", ep=2, outer=2, units="experts"),
    _M.with_(name="moe-W4-ep2-O2-expert-units-shard-after_backward", ep=2, outer=2, units="experts",
             expert_policy="shard", reshard_policy="after_backward"),
]

W8_CASES = _grid(8, ((2, 2), (4, 2)))


@pytest.fixture(scope="module")
def w4_results():
    return run_distributed(run_cases, 4, W4_CASES, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def w8_results():
    return run_distributed(run_cases, 8, W8_CASES, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: c.name)
def test_moe_parity_world4(w4_results, case):
    check_parity(case_results(w4_results, case.name), reference_train(case), case.name)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", W8_CASES, ids=lambda c: c.name)
def test_moe_parity_world8(w8_results, case):
    check_parity(case_results(w8_results, case.name), reference_train(case), case.name)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_experts_really_distributed_and_clipped(w4_results):
    """The grid proves what it says: at ep=2 each rank holds only half of the experts, expert buffers use the
    groups of their policy, and clipping acted in the reference."""
    rs = case_results(w4_results, "moe-W4-ep2-O2-replicate")
    for r in rs:
        experts = {n.split(".experts.")[1].split(".")[0] for n in r["placement"] if ".experts." in n}
        assert len(experts) == 2, (r["coords"]["rank"], sorted(experts))
    ref = reference_train(W4_CASES[2])
    assert min(ref["norms"]) > 1.0, ref["norms"]  # clip 0.5 acted every step
    shard = case_results(w4_results, "moe-W4-ep2-O2-shard")
    # ep=2, outer=2 at W=4: moe_sharding = 2; "replicate" keeps experts whole per rank (expert_inner 1),
    # "shard" splits them over the two outer ranks.
    name = next(n for n in rs[0]["placement"] if ".experts." in n)
    assert len(rs[0]["placement"][name][0]) == 1
    assert len(shard[0]["placement"][name][0]) == 2


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("policy", ["replicate", "shard"])
def test_collectives_per_step(w4_results, policy):
    """W=4, ep=2, outer=2 (outer groups [r, r+2]): per step, one scalar all-reduce over the world per norm call (2
    measured + 1 clip), the outer all-reduces one per trainable flat buffer (root; per block a dense and an expert
    buffer) and none for experts under "shard" (in the first step, one per buffer and micro-batch: each of its
    backwards leaves final gradients, none is predicted last yet), and 5 all-to-alls per MoE layer per micro-batch on
    the ep group."""
    rs = case_results(w4_results, f"moe-W4-ep2-O2-{policy}")
    for r in rs:
        rank = r["coords"]["rank"]
        outer = tuple(sorted((rank % 2, rank % 2 + 2)))
        ep = tuple(sorted((rank // 2 * 2, rank // 2 * 2 + 1)))
        for step, records in enumerate(r["comm"]):
            def count(op, ranks):
                return sum(1 for c in records if c.op == op and c.group_ranks == ranks)

            where = f"{policy} rank {rank} step {step}"
            assert count("all_reduce", (0, 1, 2, 3)) == 3, where
            per_buffer = 3 if step == 0 else 1  # 3 micro-batches
            assert count("all_reduce", outer) == (5 if policy == "replicate" else 3) * per_buffer, where
            assert count("all_to_all", ep) == 2 * 5 * 3, where  # 2 layers x (3 forward + 2 backward) x 3 micro
            crossing = [c for c in records if c.group_ranks == outer and c.op != "all_reduce"]
            if policy == "replicate":
                assert crossing == [], f"{where}: only all-reduces may cross the outer group: {crossing}"


# --- F3 (docs/field-cases.md): an expert without tokens, under DETAIL ----------------------------------------------

F3_JOB_TIMEOUT_S = 240
F3_WORLD, F3_INNER, F3_OUTER, F3_EXPERTS, F3_STEPS, F3_BATCH, F3_LR = 4, 2, 2, 4, 3, 3, 0.1
EMPTY_STEP = 1  # the step in which no rank routes to expert 3


class RoutedMoE(nn.Module):
    """MoE(8 -> 4 experts of hidden 8, top-1) with a fixed router reading features 0..3, then Linear(8, 2)."""

    def __init__(self, ep_group=None) -> None:
        super().__init__()
        from shardfusion.moe import MoE

        self.moe = MoE(8, 8, F3_EXPERTS, top_k=1, ep_group=ep_group)
        with torch.no_grad():
            self.moe.router.weight.zero_()
            self.moe.router.weight[:, :F3_EXPERTS] = 50 * torch.eye(F3_EXPERTS)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # (B, 8) -> (B, 2)
        return self.head(self.moe(x))


def f3_batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `dp_rank`'s micro-batch in `step`: tokens routed to expert dp_rank mod 4 (mod 3 in EMPTY_STEP)."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    x = 0.1 * torch.randn(F3_BATCH, 8, generator=g)  # (B, 8)
    x[:, dp_rank % (3 if step == EMPTY_STEP else F3_EXPERTS)] += 1.0
    return x, torch.randn(F3_BATCH, 2, generator=g)


def f3_build(ep_group=None) -> RoutedMoE:
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


F3_VARIANTS = [Variant(ep, units, policy) for ep in (1, 2) for units in ("separate", "fused")
            for policy in ("replicate", "shard")]


def f3_reference_run() -> dict:
    """One process, all experts: loss = mean over the data-parallel ranks' MSE losses; SGD without weight decay."""
    model = f3_build()
    opt = torch.optim.SGD(model.parameters(), lr=F3_LR)
    grads, params = [], []
    for step in range(F3_STEPS):
        losses = [F.mse_loss(model(x), y) for x, y in (f3_batch(r, step) for r in range(F3_WORLD))]
        torch.stack(losses).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"grads": grads, "params": params, "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def _f3_variant(v: Variant, topos: dict) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion.moe import Expert, MoE

    if v.ep not in topos:
        topos[v.ep] = sf.Topology(sharding=F3_INNER * F3_OUTER, fsdp_outer_degree=F3_OUTER, ep=v.ep, timeout=60)
    topo = topos[v.ep]
    model = f3_build(topo.get_group("ep"))
    sf.fully_shard(model, topo, units=(Expert,) if v.units == "separate" else (MoE,), expert_policy=v.policy)
    opt = torch.optim.SGD(model.parameters(), lr=F3_LR)
    out = {"coords": {"rank": dist.get_rank(), "mp_rank": 0}, "placement": placement(model), "grads": [],
           "params": [], "routed": []}
    for step in range(F3_STEPS):
        x, y = f3_batch(topo.data_parallel_rank, step)
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


def _f3_job() -> dict:
    topos: dict = {}
    return {v.name: _f3_variant(v, topos) for v in F3_VARIANTS}


@pytest.fixture(scope="module")
def f3_results():
    return run_distributed(_f3_job, F3_WORLD, timeout=F3_JOB_TIMEOUT_S, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


@pytest.fixture(scope="module")
def f3_reference():
    return f3_reference_run()


@pytest.mark.timeout(F3_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("variant", F3_VARIANTS, ids=lambda v: v.name)
def test_f3_expert_without_tokens(f3_results, f3_reference, variant):
    rs = [r[variant.name] for r in f3_results]
    assert all(r["debug_level"] == "DebugLevel.DETAIL" for r in rs)
    # The routing really is as described: nobody sends to expert 3 in EMPTY_STEP; rank r sends to r mod 4 otherwise.
    for rank, r in enumerate(rs):
        for step, routed in enumerate(r["routed"]):
            target = rank % (3 if step == EMPTY_STEP else F3_EXPERTS)
            assert routed == [F3_BATCH if e == target else 0 for e in range(F3_EXPERTS)], (rank, step, routed)
    expected_units = 1 + (F3_EXPERTS // variant.ep if variant.units == "separate" else 1)  # local experts only
    assert {r["units"] for r in rs} == {expected_units}
    ref = f3_reference
    for step in range(F3_STEPS):
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
