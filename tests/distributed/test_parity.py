"""Invariant 6 (and 3): fp32 training with shardfusion equals a single-process reference on the global batch.

Each configuration trains 5 steps and is compared with `reference.reference_train`: the global mean loss at every
step, every parameter after every step (assembled from one inner group's fragments), `full_state_dict` on every
rank after the last step, all at rtol 1e-5 / atol 1e-6; and replicas (same inner rank) bitwise identical after
every step. The grid covers (I, O) layouts at W=4 and W=8, mp=2, both reshard policies, 3 micro-batches of gradient
accumulation (with and without set_requires_gradient_sync(False) on the first ones), units by class and by
comm_unit_size, and AdamW with two parameter groups chosen by name (the training job's rule, `no_decay`). One spawned
job per world size runs all of its configurations (start-up is paid once); each configuration is its own test.

Replicas, from the field cases (docs/field-cases.md), in W=2 and W=4 jobs of their own under
TORCH_DISTRIBUTED_DEBUG=DETAIL: F7, replicas built from different seeds start from rank 0's weights (the initial
broadcast reaches them); F11, with inner degree 1 (every rank a replica) the replicas still synchronize.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import build_model
from reference import (Case, CaseJobs, assert_replicas_identical, case_results, check_clipped_run, check_parity,
                       reference_train, run_cases)

JOB_TIMEOUT_S = 240
FIELD_JOB_TIMEOUT_S = 300
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}

_T = Case(name="", model="transformer", optim="adamw_groups")


def _layout(world: int, inner: int, outer: int) -> dict:
    return {"world": world, "sharding": inner * outer, "outer": outer}


W4_CASES = [
    # every (I, O) at W=4 under both reshard policies
    *[_T.with_(name=f"transformer-I{i}O{o}-{policy}", reshard_policy=policy, **_layout(4, i, o))
      for i, o in ((4, 1), (2, 2), (1, 4)) for policy in ("after_forward", "after_backward")],
    # gradient accumulation: 3 micro-batches, synced every micro-batch or only on the last
    *[_T.with_(name=f"transformer-I{i}O{o}-accum3", micro=3, **_layout(4, i, o))
      for i, o in ((4, 1), (2, 2), (1, 4))],
    _T.with_(name="transformer-I2O2-accum3-after_backward", micro=3, reshard_policy="after_backward",
             **_layout(4, 2, 2)),
    _T.with_(name="transformer-I2O2-accum3-nosync", micro=3, no_sync=True, **_layout(4, 2, 2)),
    # units by size
    _T.with_(name="transformer-I2O2-size200", units="size", comm_unit_size=200, **_layout(4, 2, 2)),
    _T.with_(name="transformer-I4O1-size400-accum3", units="size", comm_unit_size=400, micro=3,
             **_layout(4, 4, 1)),
    # MLP, one AdamW group
    Case(name="mlp-I2O2", model="mlp", optim="adamw", **_layout(4, 2, 2)),
    Case(name="mlp-I4O1-size100", model="mlp", optim="adamw", units="size", comm_unit_size=100,
         **_layout(4, 4, 1)),
]

W8_CASES = [
    _T.with_(name="transformer-I4O2-after_forward", **_layout(8, 4, 2)),
    _T.with_(name="transformer-I4O2-after_backward", reshard_policy="after_backward", **_layout(8, 4, 2)),
    _T.with_(name="transformer-I4O2-accum3", micro=3, **_layout(8, 4, 2)),
    # mp=2: two sharding groups of 4 ranks, each I=2, O=2; the mp ranks run the same model on the same data
    _T.with_(name="transformer-mp2-I2O2", world=8, mp=2, sharding=4, outer=2),
    _T.with_(name="transformer-mp2-I2O2-accum3-after_backward", world=8, mp=2, sharding=4, outer=2, micro=3,
             reshard_policy="after_backward"),
    Case(name="mlp-I4O2-size100", model="mlp", optim="adamw", units="size", comm_unit_size=100,
         **_layout(8, 4, 2)),
]


@pytest.fixture(scope="module")
def w4_results():
    return run_distributed(run_cases, 4, W4_CASES, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def w8_results():
    return run_distributed(run_cases, 8, W8_CASES, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: c.name)
def test_parity_world4(w4_results, case):
    check_parity(case_results(w4_results, case.name), reference_train(case), case.name)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", W8_CASES, ids=lambda c: c.name)
def test_parity_world8(w8_results, case):
    check_parity(case_results(w8_results, case.name), reference_train(case), case.name)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_parameter_groups_split_by_name(w4_results):
    """The two-group AdamW really has both groups populated (else the test above proves less than it says)."""
    from shardfusion.train.optim import no_decay

    names = case_results(w4_results, W4_CASES[0].name)[0]["names"]
    assert any(no_decay(n) for n in names) and any(not no_decay(n) for n in names), names


# --- F7, F11 (docs/field-cases.md): replicas, under DETAIL ------------------------------------------------------------

# F7: replicas start from the first rank's weights
F7 = [Case(name="F7-I2O2-seed-by-rank", model="transformer", optim="adamw", steps=3, seed_by_rank=True,
           record_wrap=True, sharding=4, outer=2)]


# F11: inner degree 1 (pure replication), and (W, 1) as the control
def _f11(world: int) -> list[Case]:
    base = Case(name="", model="mlp", world=world, optim="adamw", steps=2, clip=(1e6, 2.0), record_grads=True)
    return [base.with_(name=f"F11-W{world}-I1O{world}", sharding=world, outer=world),
            base.with_(name=f"F11-W{world}-I{world}O1-control", sharding=world, outer=1)]


FIELD_CASES = {2: _f11(2), 4: [*F7, *_f11(4)]}


@pytest.fixture(scope="module")
def field_jobs():
    return CaseJobs(FIELD_CASES, env={2: DETAIL, 4: DETAIL}, timeout=FIELD_JOB_TIMEOUT_S)


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
def test_f7_initial_broadcast_reaches_replicas(field_jobs):
    case = F7[0]
    rs = field_jobs.results(case)
    rank0 = build_model(case.model, seed=0).state_dict()
    other = build_model(case.model, seed=1).state_dict()
    assert any(not torch.equal(rank0[n], other[n]) for n in rank0), "the per-rank seeds should give different models"
    for r in rs:
        for n, t in r["full_at_wrap"].items():
            if n in rank0:
                assert torch.equal(t, rank0[n]), f"rank {r['coords']['rank']}: {n} after wrapping != rank 0's original"
    assert_replicas_identical([{**r, "at_wrap": [r["fragments_at_wrap"]]} for r in rs], "at_wrap", case.name)
    check_parity(rs, reference_train(case), case.name)  # includes: replicas bitwise equal after each of 3 steps


@pytest.mark.timeout(2 * FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [c.name for cases in FIELD_CASES.values() for c in cases if c.name.startswith("F11-")])
def test_f11_inner_degree_one(field_jobs, name):
    case = field_jobs.case(name)
    rs = field_jobs.results(case)
    check_clipped_run(rs, case)  # gradients and norm equal the reference, replicas identical after every step
    if case.inner == 1:  # every rank is a replica: whole, bitwise equal parameters everywhere
        for r in rs:
            for step, params in enumerate(r["params"]):
                for n, t in params.items():
                    assert torch.equal(t, rs[0]["params"][step][n]), (
                        f"{name}: {n} differs between rank 0 and rank {r['coords']['rank']} after step {step}")
        assert {r["coords"]["outer_rank"] for r in rs} == set(range(case.world))


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", sorted(FIELD_CASES))
def test_collectives_checked_by_c10d_detail_mode(field_jobs, world):
    """Invariant 1 (docs/design.md) is only enforced if the job really ran under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    field_jobs.assert_under_detail(world)
