"""Gradients across backward passes: accumulation over micro-batches, and gradients discarded by zero_grad().

F6 (docs/field-cases.md), in a W=4 job under TORCH_DISTRIBUTED_DEBUG=DETAIL: the MLP in (I, O) = (2, 2), (4, 1) and
(1, 4), SGD, 2 steps of K=3 micro-batches, with gradient sync off for the first two micro-batches and with sync on
every micro-batch, and a K=1 twin that trains on the three micro-batches concatenated. The gradient is that of the
reference (the mean over the K*W micro-batches of the step: neither divided by K nor multiplied by 2^K), replicas
hold the same gradient, it equals the K=1 twin's, losses and parameters equal the reference; per step the
replicate group carries exactly one all-reduce per unit with parameters and no all-reduce runs on any other group.

zero_grad() (set_to_none=True) after a backward with no optimizer step in between discards that backward's
gradient: the next backward's gradient is its own alone (with and without set_is_last_backward on the discarded
backward), and an optimizer step right after zero_grad() moves no parameter. W=4, (I, O) = (2, 2), the tiny
transformer.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import Block, build_model, loss_fn, make_batch
from reference import (Case, CaseJobs, assemble_all, assert_close_dicts, assert_replicas_identical, check_parity,
                       reference_train)

JOB_TIMEOUT_S = 120
FIELD_JOB_TIMEOUT_S = 300
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
LAYOUTS = ("I2O2", "I4O1", "I1O4")


# --- F6 (docs/field-cases.md): gradient accumulation under HSDP, under DETAIL ---------------------------------------


def _f6(inner: int, outer: int) -> list[Case]:
    base = Case(name="", model="mlp", optim="sgd", lr=0.1, steps=2, micro=3, record_grads=True, count_comm=True,
                sharding=inner * outer, outer=outer)
    return [base.with_(name=f"F6-I{inner}O{outer}-K3-sync-last", no_sync=True),
            base.with_(name=f"F6-I{inner}O{outer}-K3-sync-every"),
            base.with_(name=f"F6-I{inner}O{outer}-K1-batch3x", micro=1, merge_micro=3)]


FIELD_CASES = {4: [*_f6(2, 2), *_f6(4, 1), *_f6(1, 4)]}


@pytest.fixture(scope="module")
def field_jobs():
    return CaseJobs(FIELD_CASES, env={4: DETAIL}, timeout=FIELD_JOB_TIMEOUT_S)


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [c.name for c in FIELD_CASES[4]])
def test_f6_accumulation(field_jobs, name):
    case = field_jobs.case(name)
    rs = field_jobs.results(case)
    ref = reference_train(case)
    check_parity(rs, ref, name)
    for step in range(case.steps):
        got = assemble_all(rs, "grads", step, ref["shapes"])
        assert_close_dicts(got, ref["grads"][step], f"{name}: gradient of the mean over K*W micro-batches, "
                                                    f"step {step}")
    assert_replicas_identical(rs, "grads", name)
    # one outer all-reduce per unit per step; in the first step, with gradient sync on in every micro-batch, one per
    # micro-batch (nothing predicts the last backward yet, and each backward leaves final gradients)
    for r in rs:
        units_with_params = sum(1 for _, names in r["units"] if names)
        replicate = r["coords"]["replicate_ranks"]
        for step, recs in enumerate(r["comm"]):
            n = sum(1 for x in recs if x.op == "all_reduce" and x.group_ranks == replicate)
            want = units_with_params if len(replicate) > 1 else 0
            if step == 0 and not case.no_sync:
                want *= case.micro
            assert n == want, f"{name}: rank {r['coords']['rank']}, step {step}: {n} outer all-reduces, want {want}"
            others = [x for x in recs if x.op == "all_reduce" and x.group_ranks != replicate]
            assert not others, f"{name}: all-reduces outside the replicate group {replicate}: {others}"


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_f6_accumulated_equals_big_batch(field_jobs, layout):
    """K=3 micro-batches of 4 give the gradient of one micro-batch of 12 (same samples): not 1/K, not 2^K."""
    big = field_jobs.case(f"F6-{layout}-K1-batch3x")
    ref_big = reference_train(big)
    g_big = assemble_all(field_jobs.results(big), "grads", 0, ref_big["shapes"])
    for variant in ("sync-last", "sync-every"):
        name = f"F6-{layout}-K3-{variant}"
        g = assemble_all(field_jobs.results(field_jobs.case(name)), "grads", 0, ref_big["shapes"])
        assert_close_dicts(g, g_big, f"{name} vs {big.name}: first-step gradient")


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", sorted(FIELD_CASES))
def test_collectives_checked_by_c10d_detail_mode(field_jobs, world):
    """Invariant 1 (docs/design.md) is only enforced if the job really ran under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    field_jobs.assert_under_detail(world)


# --- zero_grad() without an optimizer step ---------------------------------------------------------------------------


def _discarded_backward(topo) -> dict:
    """{mode: gradients after the second backward, or the RuntimeError}: "only_second" runs the second backward
    alone; the others run a first backward (with set_is_last_backward in "..._overlap") and discard it with
    opt.zero_grad(), as after a skipped step."""
    import shardfusion as sf

    out = {}
    for mode in ("discard_then_backward", "only_second", "discard_then_backward_overlap"):
        model = sf.fully_shard(build_model("transformer"), topo, units=(Block,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g1 = torch.Generator().manual_seed(1 + topo.data_parallel_rank)
        g2 = torch.Generator().manual_seed(100 + topo.data_parallel_rank)
        b1, b2 = make_batch("transformer", g1), make_batch("transformer", g2)
        try:
            if mode != "only_second":
                sf.set_is_last_backward(model, mode.endswith("overlap"))
                loss_fn("transformer", model, b1).backward()
                opt.zero_grad()  # discard this step (no optimizer step, no clip), as after a skipped step
            sf.set_is_last_backward(model, False)
            loss_fn("transformer", model, b2).backward()
            sf.finish_grad_sync(model)
            out[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        except RuntimeError as e:
            out[mode] = f"RuntimeError: {e}"
    return out


def _step_after_zero_grad(topo) -> dict:
    """{overlap: names of the parameters that backward; zero_grad(); step() changed}."""
    import shardfusion as sf

    out = {}
    for overlap in (False, True):
        model = sf.fully_shard(build_model("transformer"), topo, units=(Block,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        sf.set_is_last_backward(model, overlap)
        loss_fn("transformer", model, make_batch("transformer", torch.Generator().manual_seed(1))).backward()
        opt.zero_grad()  # set_to_none=True: plain PyTorch's SGD then skips every parameter
        opt.step()
        out[overlap] = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    return out


def zero_grad_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2, timeout=30)
    return {"discarded": _discarded_backward(topo), "step_after": _step_after_zero_grad(topo)}


@pytest.fixture(scope="module")
def zero_grad_results():
    return run_distributed(zero_grad_job, 4, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("mode", ["discard_then_backward", "discard_then_backward_overlap"])
def test_zero_grad_without_step_discards_gradients(zero_grad_results, mode):
    for rank, r in enumerate(zero_grad_results):
        got, want = r["discarded"][mode], r["discarded"]["only_second"]
        assert not isinstance(got, str), f"rank {rank} {mode}: {got}"
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, f"rank {rank} {mode}: gradients discarded by zero_grad() leaked into the next step: {bad[:4]}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("overlap", [False, True])
def test_step_after_zero_grad_does_not_move_parameters(zero_grad_results, overlap):
    for rank, r in enumerate(zero_grad_results):
        moved = r["step_after"][overlap]
        assert not moved, f"rank {rank}: step after zero_grad() applied the discarded gradients to {moved[:4]}"
