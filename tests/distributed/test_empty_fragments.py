"""Parameters that leave some ranks without elements, from the field cases (docs/field-cases.md), each against the
single-process reference.

* F5: parameters with fewer elements than the shard count (1, 3 and 5 elements, each in a module of its own), wrapped
  with one unit per module and with everything in the root unit, at W=1 and at W=4 in (I, O) = (4, 1) and (2, 2):
  losses, parameters and gradients equal the reference; full_state_dict keeps the original shapes; at (4, 1) three
  ranks hold an empty fragment of the 1-element parameter (and still join every collective).
* F9: zero-element parameters (`empty(0)` inside rank 0's half of the buffer, a `Linear(4, 0)`), at W=2 (2, 1) and
  W=4 (2, 2), with clipping: norm, gradients, clipped gradients and parameters equal the reference;
  full_state_dict keeps the shapes (0,) and (0, 4).

The W=2 and W=4 jobs run under TORCH_DISTRIBUTED_DEBUG=DETAIL, so c10d checks that every rank issues the same
collectives (invariant 1 of docs/design.md). The layout math behind both is in tests/unit/test_layout.py; saving and
loading zero-element parameters in tests/distributed/test_checkpoint_resume.py.
"""

from __future__ import annotations

import pytest

from reference import Case, CaseJobs, assemble_all, assert_close_dicts, check_clipped_run, check_parity, reference_train

JOB_TIMEOUT_S = 300
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _f5(world: int, inner: int, outer: int) -> list[Case]:
    return [Case(name=f"F5-W{world}-I{inner}O{outer}-units-{units}", model="tiny_params", world=world,
                 optim="adamw", steps=3, record_grads=True, units=units, sharding=inner * outer, outer=outer)
            for units in ("class", "none")]


def _f9(world: int, inner: int, outer: int) -> list[Case]:
    return [Case(name=f"F9-W{world}-I{inner}O{outer}", model="zero_size", world=world, optim="adamw", steps=3,
                 units="none", clip=(1.0, 2.0), record_grads=True, sharding=inner * outer, outer=outer)]


CASES = {1: _f5(1, 1, 1), 2: _f9(2, 2, 1), 4: [*_f5(4, 4, 1), *_f5(4, 2, 2), *_f9(4, 2, 2)]}
DETAIL_WORLDS = (2, 4)


@pytest.fixture(scope="module")
def jobs():
    return CaseJobs(CASES, env={w: DETAIL for w in DETAIL_WORLDS}, timeout=JOB_TIMEOUT_S)


def _names(prefix: str) -> list[str]:
    return [c.name for cases in CASES.values() for c in cases if c.name.startswith(prefix)]


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


@pytest.mark.parametrize("name", _names("F5-"))
def test_f5_params_smaller_than_shard_count(jobs, name):
    case = jobs.case(name)
    rs = jobs.results(case)
    ref = reference_train(case)
    check_parity(rs, ref, name)
    for r in rs:
        for n, shape in ref["shapes"].items():
            assert tuple(r["full"][n].shape) == shape, f"{name}: full_state_dict[{n}] has shape {r['full'][n].shape}"
    for step in range(case.steps):
        got = assemble_all(rs, "grads", step, ref["shapes"])
        assert_close_dicts(got, ref["grads"][step], f"{name}: gradient, step {step}")
        if case.world == 1:
            assert all(g is not None and g.abs().min() > 0 for g in got.values()), f"{name}: zero gradient {got}"
    if case.inner == 4 and case.units == "class":  # the 1- and 3-element units leave some ranks empty
        empty = [r["coords"]["rank"] for r in rs if r["fragments_at_wrap"]["one.w"].numel() == 0]
        assert len(empty) == 3, f"{name}: expected 3 ranks with an empty fragment of one.w, got {empty}"


@pytest.mark.parametrize("name", _names("F9-"))
def test_f9_zero_element_params(jobs, name):
    case = jobs.case(name)
    rs = jobs.results(case)
    check_clipped_run(rs, case)  # norm equals the reference's (zero-size parameters add nothing), params, grads
    for r in rs:
        full = r["full"]
        shapes = {n: tuple(full[n].shape) for n in ("empty", "lin.weight", "lin.bias", "a", "b")}
        assert shapes == {"empty": (0,), "lin.weight": (0, 4), "lin.bias": (0,), "a": (8,), "b": (24,)}, shapes


@pytest.mark.parametrize("world", DETAIL_WORLDS)
def test_collectives_checked_by_c10d_detail_mode(jobs, world):
    """Invariant 1 (docs/design.md) is only enforced if the job really ran under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    jobs.assert_under_detail(world)
