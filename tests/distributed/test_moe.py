"""The expert-parallel MoE layer (shardfusion.moe) and the differentiable all-to-all behind it (shardfusion.comm).

* ep = 1 equals a per-token Python reference (softmax, top-k, renormalize, sum of gate * expert(token), plus the
  shared expert): outputs, gradients, aux_loss and tokens_per_expert.
* ep = W (W = 2, 4, one gloo job each): expert g on ep rank j has the weights of expert g of an ep=1 layer built
  under the same seed (and dense parameters made after the layer are unchanged); each rank's output equals the ep=1
  layer on that rank's tokens; with loss = sum over ranks, expert gradients equal the ep=1 layer's over all ranks'
  tokens, and the router / shared-expert gradients summed over ranks equal the reference's.
* routing edge cases at W=4 (a rank with no tokens, an expert nobody routes to, every token to one expert) finish,
  match the reference, and leave unused experts with an exactly-zero gradient.
* errors name the offending numbers; every all-to-all, forward and backward, is recorded by CommCounter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

C, F_HIDDEN = 8, 12  # d_model, expert hidden size
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---------------------------------------------------------------------------------------------------------------
# ep = 1 against a per-token reference (single process)

def _per_token_reference(moe, x_TC: torch.Tensor):
    """Loop over tokens and their top-k experts; returns out (T, C), probs (T, E), expert ids per token."""
    outs, probs_all, chosen = [], [], []
    for t in range(x_TC.shape[0]):
        row = x_TC[t:t + 1]
        probs = torch.softmax(row.float() @ moe.router.weight.float().T, dim=-1)[0]
        gates, idx = probs.topk(moe.top_k)
        if moe.normalize_top_k and moe.top_k > 1:
            gates = gates / gates.sum()
        y = sum(gates[k] * moe.experts[str(int(idx[k]))](row)[0] for k in range(moe.top_k))
        if moe.shared_expert is not None:
            y = y + moe.shared_expert(row)[0]
        outs.append(y)
        probs_all.append(probs)
        chosen.append(idx.tolist())
    return torch.stack(outs), torch.stack(probs_all), chosen


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("top_k,shared,normalize", [(1, 0, True), (1, 6, True), (2, 0, True), (2, 6, True),
                                                    (2, 0, False)])
def test_ep1_matches_per_token_reference(top_k, shared, normalize):
    from shardfusion.moe import MoE, is_expert

    E, T = 4, 11
    torch.manual_seed(0)
    moe = MoE(C, F_HIDDEN, E, top_k, shared_expert_hidden=shared, normalize_top_k=normalize)
    expert_names = {n for n, p in moe.named_parameters() if is_expert(p)}
    assert expert_names == {f"experts.{g}.{p}" for g in range(E) for p in
                            ("fc.weight", "fc.bias", "proj.weight", "proj.bias")}
    x = torch.randn(T, C)
    w = torch.randn(T, C)

    xa = x.clone().requires_grad_()
    out = moe(xa)
    aux, counts = moe.aux_loss, moe.tokens_per_expert
    (aux_grad,) = torch.autograd.grad(aux, moe.router.weight, retain_graph=True)
    (out * w).sum().backward()
    grads = _grads(moe)
    moe.zero_grad()

    xb = x.clone().requires_grad_()
    ref, probs, chosen = _per_token_reference(moe, xb)
    (ref * w).sum().backward(retain_graph=True)  # probs are used again for the hand aux loss
    torch.testing.assert_close(out, ref.detach(), **TOL)
    torch.testing.assert_close(xa.grad, xb.grad, **TOL)
    for name, g in _grads(moe).items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m: f"{name}: {m}")

    # Load-balancing loss by hand: E * sum_e f_e * P_e.
    hand_counts = torch.bincount(torch.tensor(chosen).reshape(-1), minlength=E)
    assert counts.dtype == torch.int64 and torch.equal(counts, hand_counts)
    f = hand_counts.float() / (T * top_k)
    hand_aux = E * (f * probs.mean(dim=0)).sum()
    assert aux.dtype == torch.float32 and aux.dim() == 0
    torch.testing.assert_close(aux, hand_aux, **TOL)
    (hand_aux_grad,) = torch.autograd.grad(hand_aux, moe.router.weight)
    torch.testing.assert_close(aux_grad, hand_aux_grad, **TOL)


@pytest.mark.timeout(30)
def test_ep1_no_tokens_and_batched_shape():
    from shardfusion.moe import MoE

    torch.manual_seed(0)
    moe = MoE(C, F_HIDDEN, 4, 2, shared_expert_hidden=6)
    x = torch.randn(2, 3, C, requires_grad=True)
    out = moe(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(6, C), _per_token_reference(moe, x.detach().reshape(6, C))[0], **TOL)

    empty = torch.zeros(0, C, requires_grad=True)
    out = moe(empty)
    assert out.shape == (0, C)
    assert moe.aux_loss.dim() == 0 and moe.aux_loss.item() == 0.0
    assert torch.equal(moe.tokens_per_expert, torch.zeros(4, dtype=torch.int64))
    moe.zero_grad()
    (out.sum() + moe.aux_loss).backward()
    for name, p in moe.named_parameters():  # every parameter gets a (zero) gradient, none is left None
        assert p.grad is not None and not p.grad.any(), name


@pytest.mark.timeout(30)
def test_expert_init_is_reproducible():
    from shardfusion.moe import MoE

    torch.manual_seed(3)
    moe = MoE(C, F_HIDDEN, 4, 2)
    before = {n: p.clone() for n, p in moe.experts.named_parameters()}
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.add_(1.0)
    moe.reset_expert_parameters()
    for n, p in moe.experts.named_parameters():
        assert torch.equal(p, before[n]), n
    moe.reset_expert_parameters(std=0.5, proj_std=0.0)
    assert not moe.experts["0"].proj.weight.any() and moe.experts["0"].fc.weight.std() > 0.2


@pytest.mark.timeout(30)
def test_errors_name_the_numbers():
    from shardfusion import comm
    from shardfusion.moe import MoE

    with pytest.raises(ValueError, match=r"top_k\(0\).*num_experts\(4\)"):
        MoE(C, F_HIDDEN, 4, 0)
    with pytest.raises(ValueError, match=r"top_k\(5\).*num_experts\(4\)"):
        MoE(C, F_HIDDEN, 4, 5)
    with pytest.raises(ValueError, match=r"d_model.*0"):
        MoE(0, F_HIDDEN, 4, 1)
    with pytest.raises(ValueError, match=r"input_split_sizes=\[2, 1\].*group size 1"):
        comm.all_to_all_single(torch.zeros(3, 2), [3], [2, 1], None)
    with pytest.raises(ValueError, match=r"= 2 != input.shape\[0\] = 3"):
        comm.all_to_all_single(torch.zeros(3, 2), [2], [2], None)
    x = torch.zeros(3, 2)
    assert comm.all_to_all_single(x, [3], [3], None) is x  # a group of one: an identity, nothing issued
    # num_experts % ep is checked in the W=2 job below (it needs an ep group).


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
