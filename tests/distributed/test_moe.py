"""The expert-parallel MoE layer (shardfusion.moe) and the differentiable all-to-all behind it (shardfusion.comm),
on gloo ranks. The layer at ep = 1 against a per-token loop is in tests/unit/test_moe_layer.py.

* ep = W (W = 2, 4, one gloo job each): expert g on ep rank j has the weights of expert g of an ep=1 layer built
  under the same seed (and dense parameters made after the layer are unchanged); each rank's output equals the ep=1
  layer on that rank's tokens; with loss = sum over ranks, expert gradients equal the ep=1 layer's over all ranks'
  tokens, and the router / shared-expert gradients summed over ranks equal the reference's.
* routing edge cases at W=4 (a rank with no tokens, an expert nobody routes to, every token to one expert) finish,
  match the reference, and leave unused experts with an exactly-zero gradient.
* num_experts % ep is checked; every all-to-all, forward and backward, is recorded by CommCounter.
* the GPT-MoE of shardfusion.models at ep = 2 is the ep = 1 model split in two (2 ranks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from harness import run_distributed
from shardfusion.models import GPT, PRESETS, VOCAB_SIZE, GPTConfig

C, F_HIDDEN = 8, 12  # d_model, expert hidden size
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---------------------------------------------------------------------------------------------------------------
# ep = W against the ep=1 layer (multi-process)

def _tokens(rank: int, num_tokens: int, bias_feature: float | None):
    """Rank `rank`'s tokens (T, C) and output weights (T, C), the same on every process; feature 0 set to
    `bias_feature` when given (used to force the router)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(num_tokens, C, generator=gen)
    if bias_feature is not None:
        x[:, 0] = bias_feature
    return x, torch.randn(num_tokens, C, generator=gen)


def _check_case(group, world: int, case: dict) -> dict:
    """Build the ep=W layer and an ep=1 reference from one seed, run every rank's tokens, compare; returns facts."""
    import torch.distributed as dist
    from shardfusion.moe import MoE

    rank = dist.get_rank(group)
    E, K, shared = case["E"], case["K"], case.get("shared", 0)
    torch.manual_seed(42)
    moe = MoE(C, F_HIDDEN, E, K, ep_group=group, shared_expert_hidden=shared)
    after = nn.Linear(C, C)  # a dense parameter created after the layer
    torch.manual_seed(42)
    ref = MoE(C, F_HIDDEN, E, K, shared_expert_hidden=shared)
    ref_after = nn.Linear(C, C)

    e_local = E // world
    assert moe.ep_size == world and moe.ep_rank == rank and moe.num_local_experts == e_local
    assert list(moe.experts) == [str(rank * e_local + i) for i in range(e_local)]
    assert torch.equal(after.weight, ref_after.weight), "dense init after the MoE layer depends on ep"
    for name, p in moe.named_parameters():
        assert torch.equal(p, ref.get_parameter(name)), f"{name} differs from the ep=1 layer's"
    if "router_col0" in case:  # force routing through feature 0 (set to a constant in the tokens)
        for module in (moe, ref):
            with torch.no_grad():
                module.router.weight[:, 0] = 0.0
                for e, value in case["router_col0"].items():
                    module.router.weight[e, 0] = value

    biases = case.get("bias_feature", [None] * world)
    data = [_tokens(r, case["T"][r], biases[r]) for r in range(world)]
    x = data[rank][0].clone().requires_grad_()
    out = moe(x)
    (out * data[rank][1]).sum().backward()

    ref_x = [d[0].clone().requires_grad_() for d in data]
    ref_loss, ref_out, ref_counts = 0.0, None, None
    for r, (xr, (_, wr)) in enumerate(zip(ref_x, data)):
        o = ref(xr)
        ref_loss = ref_loss + (o * wr).sum()
        if r == rank:
            ref_out, ref_counts, ref_aux = o.detach(), ref.tokens_per_expert, ref.aux_loss.detach()
    ref_loss.backward()

    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(x.grad, ref_x[rank].grad, **TOL)
    assert torch.equal(moe.tokens_per_expert, ref_counts)
    torch.testing.assert_close(moe.aux_loss.detach(), ref_aux, **TOL)
    for name, p in moe.named_parameters():
        g = p.grad.clone()
        if not name.startswith("experts."):  # dense: each rank holds a partial sum
            dist.all_reduce(g, group=group)
        torch.testing.assert_close(g, ref.get_parameter(name).grad, **TOL, msg=lambda m: f"{name}: {m}")
    zero_grad_experts = sorted(int(g) for g, e in moe.experts.items()
                               if all(not p.grad.any() for p in e.parameters()))
    return {"counts": moe.tokens_per_expert.tolist(), "zero_grad_experts": zero_grad_experts}


def _a2a_check(group, rank: int, world: int) -> None:
    """all_to_all_single directly: uneven and zero splits, extra dims, backward = the swapped all-to-all."""
    from shardfusion import comm

    send = [(rank + j) % 3 for j in range(world)]          # rows this rank sends to rank j (some zero)
    recv = [(j + rank) % 3 for j in range(world)]          # rows rank j sends here
    x = (torch.arange(sum(send) * 2 * 3, dtype=torch.float32).view(-1, 2, 3) + 100 * rank).requires_grad_()
    y = comm.all_to_all_single(x, recv, send, group)
    assert y.shape == (sum(recv), 2, 3)
    (y * (rank + 1)).sum().backward()
    # each row sent to rank j comes back with rank j's weight (j + 1)
    expected = torch.cat([torch.full((n, 2, 3), float(j + 1)) for j, n in enumerate(send)])
    assert torch.equal(x.grad, expected), (x.grad, expected)


def _parity_job(world: int, cases: list[dict]) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion.moe import MoE

    topo = sf.Topology(ep=world)
    group = topo.get_group("ep")
    rank = dist.get_rank(group)
    _a2a_check(group, rank, world)
    result = {"cases": [_check_case(group, world, case) for case in cases]}

    # Every all-to-all is recorded: forward = counts + rows out + rows back, backward = the two row exchanges.
    torch.manual_seed(42)
    moe = MoE(C, F_HIDDEN, 2 * world, 2, ep_group=group)
    x = _tokens(rank, 5 + rank, None)[0].requires_grad_()
    with sf.comm.CommCounter() as fwd:
        out = moe(x)
    with sf.comm.CommCounter() as bwd:
        out.sum().backward()
    result["fwd"], result["bwd"] = fwd.records, bwd.records
    result["group_ranks"] = tuple(dist.get_process_group_ranks(group))
    result["N"] = x.shape[0] * 2

    try:
        MoE(C, F_HIDDEN, 2 * world + 1, 1, ep_group=group)
        result["divisibility_error"] = None
    except ValueError as e:
        result["divisibility_error"] = str(e)
    return result


_PARITY_CASES = [{"E": 4, "K": 1, "T": [7, 4, 6, 5]}, {"E": 8, "K": 2, "T": [7, 4, 6, 5], "shared": 6}]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_ep1_layer(world):
    results = run_distributed(_parity_job, world, world, _PARITY_CASES, timeout=60)
    for res in results:
        assert res["divisibility_error"] is not None
        assert f"num_experts({2 * world + 1}) % ep({world}) = 1" in res["divisibility_error"]

        # Invariant 1 and CommCounter: 3 all-to-alls in forward, 2 in backward, all on the ep group.
        assert [x.op for x in res["fwd"]] == ["all_to_all"] * 3, res["fwd"]
        assert [x.op for x in res["bwd"]] == ["all_to_all"] * 2, res["bwd"]
        assert all(x.group_ranks == res["group_ranks"] == tuple(range(world)) for x in res["fwd"] + res["bwd"])
        counts, rows_out, rows_back = res["fwd"]
        assert counts.numel == 2 * world and counts.nbytes == 8 * 2 * world
        assert rows_out.numel == res["N"] * C and rows_out.nbytes == 4 * res["N"] * C
        # record numel = the input's: backward sends the N gradient rows back, then the N_recv rows
        assert res["bwd"][0].numel == res["N"] * C and res["bwd"][1].numel == rows_back.numel
    received = sum(res["fwd"][2].numel for res in results)
    assert received == sum(res["N"] for res in results) * C  # every row sent is received once, in total


# ---------------------------------------------------------------------------------------------------------------
# Routing edge cases at W = 4, E = 8 (2 experts per rank; expert 3 lives on ep rank 1, expert 5 on ep rank 2)

_EDGE_CASES = [
    # one rank has no tokens
    {"name": "rank2-empty", "E": 8, "K": 2, "T": [6, 5, 0, 7], "shared": 6},
    # nobody routes to expert 3 (its logit is -50 on every token)
    {"name": "expert3-unused", "E": 8, "K": 2, "T": [6, 5, 4, 7], "bias_feature": [1.0] * 4,
     "router_col0": {3: -50.0}},
    # rank 0 sends every token to expert 5; the others route at random
    {"name": "rank0-all-to-5", "E": 8, "K": 1, "T": [6, 5, 4, 7], "bias_feature": [1.0, 0.0, 0.0, 0.0],
     "router_col0": {5: 50.0}},
    # every rank sends everything to expert 5, and rank 1 has no tokens: ranks 0, 1, 3 receive nothing
    {"name": "all-to-5", "E": 8, "K": 1, "T": [6, 0, 4, 7], "bias_feature": [1.0] * 4, "router_col0": {5: 50.0}},
]


def _edge_job(cases: list[dict]) -> list[dict]:
    import shardfusion as sf

    topo = sf.Topology(ep=4)
    return [_check_case(topo.get_group("ep"), 4, case) for case in cases]


@pytest.mark.timeout(90)
def test_routing_edge_cases():
    # DETAIL: c10d checks that every rank issues the same collectives in the same order (invariant 1).
    results = run_distributed(_edge_job, 4, _EDGE_CASES, timeout=60, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    by_case = {case["name"]: [res[i] for res in results] for i, case in enumerate(_EDGE_CASES)}

    assert [r["counts"] for r in by_case["rank2-empty"]][2] == [0] * 8

    unused = by_case["expert3-unused"]
    assert all(r["counts"][3] == 0 for r in unused)
    assert 3 in unused[1]["zero_grad_experts"], unused[1]  # ep rank 1 holds experts 2 and 3

    one = by_case["rank0-all-to-5"]
    assert one[0]["counts"] == [0, 0, 0, 0, 0, 6, 0, 0]

    every = by_case["all-to-5"]
    assert [r["counts"] for r in every] == [[0] * 5 + [n] + [0] * 2 for n in (6, 0, 4, 7)]
    assert [r["zero_grad_experts"] for r in every] == [[0, 1], [2, 3], [4], [6, 7]]


# ---------------------------------------------------------------------------------------------------------------
# The GPT-MoE at ep = 2

TINY_MOE = dataclasses.replace(PRESETS["tiny"], n_experts=4, top_k=2)


def ep_job(config: GPTConfig, seed: int) -> dict:
    """One rank of an ep = 2 GPT-MoE: its parameters, and its outputs on a rank-dependent batch."""
    import torch.distributed as dist

    import shardfusion as sf

    topo = sf.Topology(ep=2)
    torch.manual_seed(seed)
    model = GPT(config, ep_group=topo.get_group("ep"))
    idx = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits, _ = model(idx)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "idx": idx,
            "logits": logits.detach(), "aux": model.aux_loss().detach(), "tokens": model.tokens_per_expert(),
            "num_params": model.num_parameters()}


@pytest.mark.timeout(120)
def test_ep2_model_is_the_ep1_model_split() -> None:
    # The same seed gives the same dense parameters and the same experts at ep = 1 and ep = 2, ep rank j holding
    # experts 2j and 2j + 1 under their global names; and the ep = 2 forward computes what the ep = 1 one does.
    ranks = run_distributed(ep_job, 2, TINY_MOE, 42, timeout=90)
    torch.manual_seed(42)
    full = GPT(TINY_MOE)
    params = dict(full.named_parameters())
    for j, rank in enumerate(ranks):
        held = sorted({n.split(".")[4] for n in rank["params"] if ".experts." in n})
        assert held == [str(2 * j), str(2 * j + 1)]
        assert set(rank["params"]) <= set(params)
        for name, value in rank["params"].items():
            assert torch.equal(value, params[name]), name
        assert rank["num_params"] == full.num_parameters()
        logits, _ = full(rank["idx"])
        torch.testing.assert_close(rank["logits"], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank["aux"], full.aux_loss())
        assert torch.equal(rank["tokens"], full.tokens_per_expert())
    assert set().union(*(r["params"] for r in ranks)) == set(params)
