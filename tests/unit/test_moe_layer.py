"""The MoE layer (shardfusion.moe) at ep = 1, one process: it equals a per-token Python reference (softmax, top-k,
renormalize, sum of gate * expert(token), plus the shared expert) in outputs, gradients, aux_loss and
tokens_per_expert; empty and batched inputs; reproducible expert init; errors name the offending numbers. The layer
at ep = W is in tests/distributed/test_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


C, F_HIDDEN = 8, 12  # d_model, expert hidden size
TOL = {"rtol": 1e-5, "atol": 1e-6}


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
    # num_experts % ep is checked in tests/distributed/test_moe.py (it needs an ep group).
