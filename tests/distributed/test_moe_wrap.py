"""fully_shard on MoE models (shardfusion.moe), W=2 with sharding 2 and ep 2, all scenarios in one job:

1. A router that is a unit of its own (``units=(nn.Linear,)``, or a ``comm_unit_size`` smaller than a MoE layer) is
   gathered for its forward: the wrapped model computes what the unwrapped one does.
2. ``full_state_dict`` returns every expert when the ep ranks hold different numbers of expert flat buffers (one
   expert frozen: a frozen buffer on that ep rank only).
3. Experts marked with ``sf.mark_expert`` under rank-local names (Megatron's ``local_experts.0``) cannot all be in a
   {name: tensor} dict: full_state_dict or fully_shard raises ValueError naming them.
4. ``fully_shard`` refuses a MoE whose ep group is not the topology's (here: none, under ep = 2).
5. Buffers of expert modules stay with their experts (at wrap time and at every training forward), and
   ``full_state_dict`` holds every expert's.
6. A MoE whose input requires grad on some ranks only finishes its backward on every rank with the gradients of the
   all-ranks reference.

Each scenario's topology has a 10-second process-group timeout, so a mismatched collective fails the scenario in
seconds (and the scenarios after it, whose ranks are then out of step) instead of hanging.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

PG_TIMEOUT_S = 10  # Topology timeout: a mismatched collective fails in seconds instead of hanging
JOB_TIMEOUT_S = 180
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _error() -> str:
    return traceback.format_exc()[-1500:]


def _scenario(per_rank: list[dict], name: str) -> list[dict]:
    """The per-rank results of scenario `name`; fails with the first rank's traceback if it raised outside its own
    checks."""
    rs = [r[name] for r in per_rank]
    for rank, r in enumerate(rs):
        if "scenario_error" in r:
            raise AssertionError(f"scenario {name!r} raised on rank {rank}:\n{r['scenario_error']}")
    return rs


def moe_wrap_job() -> dict:
    """Worker: every scenario in order; {name: result, or {"scenario_error": traceback}}."""
    scenarios = {"router_unit": _router_unit_job, "frozen_expert": _frozen_expert_job,
                 "local_names": _local_names_job, "no_ep_group": _no_ep_group_job,
                 "expert_buffers": _expert_buffer_job, "input_grad": _input_grad_job}
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"scenario_error": _error()}
    return out


@pytest.fixture(scope="module")
def moe_wrap_results():
    return run_distributed(moe_wrap_job, 2, timeout=JOB_TIMEOUT_S)



def _router_unit_job() -> dict:
    import shardfusion as sf
    from models import build_model  # tests/models.py

    topo = sf.Topology(sharding=2, ep=2, timeout=PG_TIMEOUT_S)
    out = {}
    for variant, kwargs in (("units=(nn.Linear,)", {"units": (nn.Linear,)}),
                            ("comm_unit_size=500", {"comm_unit_size": 500})):
        model = build_model("moe", ep_group=topo.get_group("ep"))  # 2 MoE blocks of 1312 elements each
        g = torch.Generator().manual_seed(1 + topo.data_parallel_rank)
        x = torch.randint(0, 16, (2, 6), generator=g)  # (B, T)
        with torch.no_grad():
            expected = model(x)  # the unwrapped layer (collective over ep too)
        sf.fully_shard(model, topo, **kwargs)
        routers = [u.name for u in sf.get_units(model) if u.name.endswith("router")]
        try:
            got = model(x)
            got.sum().backward()
            out[variant] = {"expected": expected, "got": got.detach(), "router_units": routers}
        except Exception:  # noqa: BLE001 - reported to the parent
            out[variant] = {"error": _error(), "router_units": routers}
    return out


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_router_in_its_own_unit_is_gathered(moe_wrap_results):
    """units=(nn.Linear,) or a comm_unit_size below one MoE layer make the router a unit of its own: the wrapped
    model computes what the unwrapped one does (a router read as ``router.weight`` instead of called would never be
    gathered, and its forward would fail on the 1-D fragment)."""
    results = _scenario(moe_wrap_results, "router_unit")
    for rank, per_variant in enumerate(results):
        for variant, r in per_variant.items():
            assert r["router_units"], f"{variant}: the router is not a unit of its own; the test proves nothing"
            assert "error" not in r, f"rank {rank}, {variant}: forward/backward raised:\n{r['error']}"
            torch.testing.assert_close(r["got"], r["expected"], **TOL,
                                       msg=lambda m: f"rank {rank}, {variant}: logits differ: {m}")


D, HIDDEN, EXPERTS = 8, 16, 4


def _build_moe(ep_group=None):
    from shardfusion.moe import MoE

    torch.manual_seed(0)
    return MoE(D, HIDDEN, EXPERTS, top_k=2, ep_group=ep_group)


def _frozen_expert_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=2, ep=2, timeout=PG_TIMEOUT_S)
    moe = _build_moe(topo.get_group("ep"))
    for name, p in moe.named_parameters():
        if name.startswith("experts.0."):  # expert 0 lives on ep rank 0 only
            p.requires_grad_(False)
    sf.fully_shard(moe, topo)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(topo.rank))
    moe(x).pow(2).sum().backward()
    try:
        return {"full": sf.full_state_dict(moe)}
    except Exception:  # noqa: BLE001
        return {"error": _error()}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_full_state_dict_with_one_frozen_expert(moe_wrap_results):
    """Freezing expert 0 gives ep rank 0 one more expert flat buffer than ep rank 1; full_state_dict still returns
    every expert (per-buffer collectives over ep would no longer pair up, and time out)."""
    expected = dict(_build_moe().named_parameters())  # ep = 1: every expert, same values (ep-independent init)
    results = _scenario(moe_wrap_results, "frozen_expert")
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: full_state_dict failed:\n{r['error']}"
        assert sorted(r["full"]) == sorted(expected), f"rank {rank}: names {sorted(r['full'])}"
        # nothing was stepped: every value is the initial one
        for name, value in expected.items():
            torch.testing.assert_close(r["full"][name], value.detach(), **TOL)



class _LocalExperts(nn.Module):
    """Two experts per ep rank, named by their local index (Megatron's ``local_experts.i``), marked as experts."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        import shardfusion as sf

        gen = torch.Generator().manual_seed(100 + ep_rank)  # different experts on different ep ranks
        self.local_experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        with torch.no_grad():
            for p in self.local_experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        sf.mark_expert(self.local_experts)

    def forward(self, x):
        return sum(e(x) for e in self.local_experts)


def _local_names_job() -> dict:
    import torch.distributed as dist
    import shardfusion as sf

    topo = sf.Topology(sharding=2, ep=2, timeout=PG_TIMEOUT_S)
    model = _LocalExperts(topo.ep_rank)
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    every: list = [None] * 2
    dist.all_gather_object(every, mine, group=topo.get_group("ep"))
    try:
        sf.fully_shard(model, topo)
        full = sf.full_state_dict(model)
    except ValueError as e:
        return {"raised": str(e)}
    return {"full": full, "every": every}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_expert_names_shared_across_ep_ranks_are_an_error(moe_wrap_results):
    """Experts that carry the same names on every ep rank cannot all be in a {name: tensor} dict: full_state_dict
    (or fully_shard) raises ValueError naming them, instead of silently keeping one ep rank's experts."""
    results = _scenario(moe_wrap_results, "local_names")
    for rank, r in enumerate(results):
        if "raised" in r:
            assert "local_experts.0.weight" in r["raised"], r["raised"]
            continue
        lost = [ep for ep, theirs in enumerate(r["every"])
                if not all(torch.equal(r["full"][n], t) for n, t in theirs.items())]
        pytest.fail(f"rank {rank}: full_state_dict returned {sorted(r['full'])} without an error, and the experts "
                    f"of ep rank(s) {lost} are not in it (silently overwritten by another ep rank's)")



def _no_ep_group_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=2, ep=2, timeout=PG_TIMEOUT_S)
    moe = _build_moe(ep_group=None)  # forgot ep_group=topo.get_group("ep"): every rank holds all 4 experts
    try:
        sf.fully_shard(moe, topo)
    except ValueError as e:
        return {"raised": str(e)}
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(topo.rank))
    moe(x).pow(2).sum().backward()
    sf.finish_grad_sync(moe)
    return {"grads": {n: p.grad.clone() for n, p in moe.named_parameters() if n.startswith("experts.")}}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_moe_ep_group_must_match_the_topology(moe_wrap_results):
    """Topology(ep=2) with a MoE built without its ep group: fully_shard raises ValueError (the layer's ep 1 != the
    topology's ep 2). Accepted, the two ep ranks would hold the same expert names with different gradients (each
    summed over half of the batch), and replicas of the same expert would drift apart."""
    results = _scenario(moe_wrap_results, "no_ep_group")
    if all("raised" in r for r in results):
        return
    g0, g1 = results[0]["grads"], results[1]["grads"]
    differ = [n for n in g0 if not torch.equal(g0[n], g1[n])]
    pytest.fail(f"fully_shard accepted a MoE with ep 1 under Topology(ep=2); the gradients of {len(differ)} expert "
                f"parameters differ between the two copies, e.g. {differ[:3]}")



def _expert_buffer_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=2, ep=2, timeout=PG_TIMEOUT_S)
    moe = _build_moe(topo.get_group("ep"))
    for name, expert in moe.experts.items():  # a per-expert buffer, e.g. a quantization scale
        expert.register_buffer("scale", torch.full((1,), float(int(name) + 1)))
    sf.fully_shard(moe, topo)
    after_wrap = {n: b.clone() for n, b in moe.named_buffers()}
    moe(torch.randn(3, D)).sum().backward()  # a training forward (broadcast_buffers=True)
    after_forward = {n: b.clone() for n, b in moe.named_buffers()}
    full = {n: t for n, t in sf.full_state_dict(moe).items() if n.endswith(".scale")}
    return {"after_wrap": after_wrap, "after_forward": after_forward, "full": full}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_expert_buffers_stay_with_their_experts(moe_wrap_results):
    """Expert g's buffer holds g + 1. After wrapping and a training forward every expert keeps its own value (not
    the value of the expert at the same position on ep rank 0), and full_state_dict holds all four."""
    results = _scenario(moe_wrap_results, "expert_buffers")
    expected = {f"experts.{g}.scale": torch.tensor([float(g + 1)]) for g in range(EXPERTS)}
    for rank, r in enumerate(results):
        for when in ("after_wrap", "after_forward"):
            for name, value in r[when].items():
                assert torch.equal(value, expected[name]), f"rank {rank} {when}: {name} = {value.item()}, " \
                                                           f"expected {expected[name].item()}"
    for rank, r in enumerate(results):
        assert sorted(r["full"]) == sorted(expected), f"rank {rank}: full_state_dict buffers {sorted(r['full'])}"
        for name, value in r["full"].items():
            assert torch.equal(value, expected[name]), f"rank {rank}: full_state_dict {name} = {value.item()}"



def _input_grad_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=2, ep=2, timeout=PG_TIMEOUT_S)
    moe = _build_moe(topo.get_group("ep"))
    sf.fully_shard(moe, topo)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(topo.rank))
    x.requires_grad_(topo.rank == 0)  # e.g. an input-gradient probe on one rank only
    try:
        moe(x).pow(2).sum().backward()
        sf.finish_grad_sync(moe)
    except Exception:  # noqa: BLE001
        return {"error": _error()}
    return {"grads": {n: p.grad.clone() for n, p in moe.named_parameters()}}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_input_requiring_grad_on_some_ranks_only(moe_wrap_results):
    """The expert gradients do not depend on whether the input requires grad; the step finishes on every rank with
    the gradients of the all-ranks reference (every rank issues the dispatch's backward all-to-all, also the rank
    whose input needs no gradient)."""
    results = _scenario(moe_wrap_results, "input_grad")
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: backward failed:\n{r['error']}"
    ref = _build_moe()
    for rank in range(2):
        x = torch.randn(5, D, generator=torch.Generator().manual_seed(rank))
        (ref(x).pow(2).sum() / 2).backward()  # mean over the 2 data-parallel ranks
    grads = dict(ref.named_parameters())
    for rank, r in enumerate(results):
        experts = {n: g for n, g in r["grads"].items() if n.startswith("experts.")}  # whole on each rank here
        assert len(experts) == 2 * 4, sorted(experts)
        for name, g in experts.items():
            torch.testing.assert_close(g, grads[name].grad, **TOL,
                                       msg=lambda m: f"rank {rank}: {name}: {m}")
