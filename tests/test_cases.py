"""The failure cases from the field (shared/cases/CASES.md) that belong to the runtime and clipping:
F1, F2, F4, F5, F6, F7, F9 (without save/load) and F11, each against the single-process reference.

One spawned job per world size (1, 2, 4) runs every configuration of that size; each configuration is a test.
The W=2 and W=4 jobs run with TORCH_DISTRIBUTED_DEBUG=DETAIL, so c10d checks that every collective has the same op
and shapes on every rank of its group (invariant 1) in the cases most likely to break it: a unit without gradient
(F4), empty fragments (F5, F9), replication only (F11), accumulation without sync (F6).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from models import build_model
from reference import (Case, assemble_all, assert_close_dicts, assert_replicas_identical, case_results,
                       check_clipped_run, check_parity, get_topology, reference_train, run_cases)

JOB_TIMEOUT_S = 300
HUGE, SMALL, INF = 1e6, 0.05, float("inf")
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
DETAIL_WORLDS = (2, 4)  # jobs whose collectives c10d checks for the same op and shapes on every rank


def _lay(inner: int, outer: int) -> dict:
    return {"sharding": inner * outer, "outer": outer}


# --- F1: HSDP norm must not grow with O -----------------------------------------------------------------------------
F1 = [Case(name=f"F1-I{i}O{o}-norm{'inf' if nt == INF else 2}-max{mx:g}", model="mlp", optim="sgd", lr=0.1,
           steps=2, clip=(mx, nt), record_grads=True, **_lay(i, o))
      for i, o in ((4, 1), (2, 2), (1, 4)) for nt in (2.0, INF) for mx in (HUGE, 0.1)]


# --- F2: a parameter kept whole on every rank is counted once -------------------------------------------------------
F2 = [Case(name="F2-I2O2-replicated-scale", model="scaled_mlp", optim="sgd", lr=0.1, steps=2, clip=(HUGE, 2.0),
           record_grads=True, replicate=("scale",), **_lay(2, 2)),
      Case(name="F2-I2O2-replicated-scale-clip", model="scaled_mlp", optim="sgd", lr=0.1, steps=2,
           clip=(0.1, 2.0), record_grads=True, replicate=("scale",), **_lay(2, 2))]


# --- F4: a unit without gradient in a step; frozen parameters -------------------------------------------------------
def _f4(world: int, inner: int, outer: int) -> list[Case]:
    return [Case(name=f"F4-W{world}-I{inner}O{outer}-{kind}-{policy}", model=kind, world=world, optim="sgd",
                 lr=0.1, steps=4, record_grads=True, check_resharded=True, reshard_policy=policy, **_lay(inner, outer))
            for kind in ("skip", "skip_frozen_a", "skip_mixed") for policy in ("after_forward", "after_backward")]


# --- F5: parameters with fewer elements than the shard count --------------------------------------------------------
def _f5(world: int, inner: int, outer: int) -> list[Case]:
    return [Case(name=f"F5-W{world}-I{inner}O{outer}-units-{units}", model="tiny_params", world=world,
                 optim="adamw", steps=3, record_grads=True, units=units, **_lay(inner, outer))
            for units in ("class", "none")]


# --- F6: gradient accumulation under HSDP ---------------------------------------------------------------------------
def _f6(inner: int, outer: int) -> list[Case]:
    base = Case(name="", model="mlp", optim="sgd", lr=0.1, steps=2, micro=3, record_grads=True, count_comm=True,
                **_lay(inner, outer))
    return [base.with_(name=f"F6-I{inner}O{outer}-K3-sync-last", no_sync=True),
            base.with_(name=f"F6-I{inner}O{outer}-K3-sync-every"),
            base.with_(name=f"F6-I{inner}O{outer}-K1-batch3x", micro=1, merge_micro=3)]


# --- F7: replicas start from the first rank's weights ---------------------------------------------------------------
F7 = [Case(name="F7-I2O2-seed-by-rank", model="transformer", optim="adamw", steps=3, seed_by_rank=True,
           record_wrap=True, **_lay(2, 2))]


# --- F9: zero-element parameters ------------------------------------------------------------------------------------
def _f9(world: int, inner: int, outer: int) -> list[Case]:
    return [Case(name=f"F9-W{world}-I{inner}O{outer}", model="zero_size", world=world, optim="adamw", steps=3,
                 units="none", clip=(1.0, 2.0), record_grads=True, **_lay(inner, outer))]


# --- F11: inner degree 1 (pure replication) -------------------------------------------------------------------------
def _f11(world: int) -> list[Case]:
    base = Case(name="", model="mlp", world=world, optim="adamw", steps=2, clip=(HUGE, 2.0), record_grads=True)
    return [base.with_(name=f"F11-W{world}-I1O{world}", **_lay(1, world)),
            base.with_(name=f"F11-W{world}-I{world}O1-control", **_lay(world, 1))]


W1_CASES = _f5(1, 1, 1)
W2_CASES = [*_f4(2, 2, 1), *_f9(2, 2, 1), *_f11(2)]
W4_CASES = [*F1, *F2, *_f4(4, 2, 2), *_f5(4, 4, 1), *_f5(4, 2, 2), *_f6(2, 2), *_f6(4, 1), *_f6(1, 4), *F7,
            *_f9(4, 2, 2), *_f11(4)]
ALL_CASES = {c.name: c for c in (*W1_CASES, *W2_CASES, *W4_CASES)}


def f2_scale_check(case: Case) -> dict:
    """Worker (F2): scale only the whole-kept parameter's gradient by 10; norm^2 must grow by 99 * ||g||^2."""
    import torch.distributed as dist
    import shardfusion as sf
    from models import loss_fn
    from reference import DATA_SEED, draw_batch, wrap_kwargs

    topo = get_topology(case)
    model = sf.fully_shard(build_model(case.model), topo, **wrap_kwargs(case))
    gen = torch.Generator().manual_seed(DATA_SEED + topo.data_parallel_rank + 1)
    loss_fn(case.model, model, draw_batch(case, gen)).backward()
    sf.finish_grad_sync(model)
    scale = dict(model.named_parameters())["scale"]
    g2 = scale.grad.double().pow(2).sum().item()
    n1 = sf.clip_grad_norm_(model, HUGE).item()
    scale.grad.mul_(10)
    n2 = sf.clip_grad_norm_(model, HUGE).item()
    return {"rank": dist.get_rank(), "n1": n1, "n2": n2, "g2": g2, "scale_numel": scale.numel()}


def cases_job(cases: list[Case], with_f2: bool) -> tuple:
    f2 = f2_scale_check(F2[0]) if with_f2 else None
    return run_cases(cases), f2


def _job(world: int, cases: list[Case], env=None, with_f2: bool = False):
    per_rank = run_distributed(cases_job, world, cases, with_f2, timeout=JOB_TIMEOUT_S, env=env)
    return [r[0] for r in per_rank], [r[1] for r in per_rank]


@pytest.fixture(scope="module")
def jobs():
    """Lazily run each world size's job once per module."""
    cache = {}

    def get(world: int):
        if world not in cache:
            cases = {1: W1_CASES, 2: W2_CASES, 4: W4_CASES}[world]
            cache[world] = _job(world, cases, env=DETAIL if world in DETAIL_WORLDS else None, with_f2=world == 4)
        return cache[world]

    return get


def _results(jobs, case: Case) -> list[dict]:
    return case_results(jobs(case.world)[0], case.name)


def _names(prefix: str) -> list[str]:
    return [n for n in ALL_CASES if n.startswith(prefix)]


# --- F1 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F1-"))
def test_f1_hsdp_norm(jobs, name):
    case = ALL_CASES[name]
    check_clipped_run(_results(jobs, case), case, small=0.1)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_f1_norm_independent_of_layout(jobs):
    for suffix in ("norm2-max1e+06", "norminf-max1e+06"):
        norms = {n: _results(jobs, ALL_CASES[n])[0]["norms"] for n in _names("F1-") if n.endswith(suffix)}
        assert len(norms) == 3, norms
        first = next(iter(norms.values()))
        for n, v in norms.items():
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(v, first)), f"{suffix}: {norms}"


# --- F2 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F2-"))
def test_f2_whole_parameter_counted_once(jobs, name):
    case = ALL_CASES[name]
    rs = _results(jobs, case)
    for r in rs:  # the parameter really is kept whole on every rank
        assert r["params"][0]["scale"].numel() == 4, f"rank {r['coords']['rank']}: scale fragment is not whole"
    check_clipped_run(rs, case, small=0.1)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_f2_scaling_whole_parameter_grad(jobs):
    for out in jobs(4)[1]:
        assert out["scale_numel"] == 4
        diff, want = out["n2"] ** 2 - out["n1"] ** 2, 99 * out["g2"]
        assert want > 1e-3 * out["n2"] ** 2, f"the scale gradient is too small to tell: {out}"
        assert math.isclose(diff, want, rel_tol=1e-4, abs_tol=1e-5 * out["n2"] ** 2), (
            f"rank {out['rank']}: norm^2 grew by {diff}, expected 99 * ||g||^2 = {want} "
            f"(ratio {diff / want:.3f}: the whole-kept parameter is counted {diff / want:.2f} times)")


# --- F4 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F4-"))
def test_f4_unit_without_gradient(jobs, name):
    case = ALL_CASES[name]
    rs = _results(jobs, case)
    ref = reference_train(case)
    check_parity(rs, ref, name)
    frozen = {n for n, p in build_model(case.model).named_parameters() if not p.requires_grad}
    skipped = {n for n in ref["shapes"] if n.startswith("b.") and n not in frozen}
    assert (case.model == "skip") or frozen, f"{name}: the model should have frozen parameters"
    for step in range(case.steps):
        got = assemble_all(rs, "grads", step, ref["shapes"])
        assert_close_dicts(got, ref["grads"][step], f"{name}: gradient, step {step}", none_is_zero=True)
    for r in rs:
        rank = r["coords"]["rank"]
        before = r["fragments_at_wrap"]
        for step in range(case.steps):
            after = r["params"][step]
            for n in frozen:
                assert r["grads"][step][n] is None, f"{name}: rank {rank}: frozen {n} has a gradient at step {step}"
                assert torch.equal(after[n], r["fragments_at_wrap"][n]), f"{name}: rank {rank}: frozen {n} changed"
            if step % 2 == 0:  # b did not run
                for n in skipped:
                    assert torch.equal(after[n], before[n]), (
                        f"{name}: rank {rank}: {n} changed at step {step}, when its layer did not run")
            before = after
            assert r["unsharded_after_step"][step] == [], (
                f"{name}: rank {rank}: units {r['unsharded_after_step'][step]} still hold a full buffer after "
                f"step {step}")


# --- F5 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F5-"))
def test_f5_params_smaller_than_shard_count(jobs, name):
    case = ALL_CASES[name]
    rs = _results(jobs, case)
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


# --- F6 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F6-"))
def test_f6_accumulation(jobs, name):
    case = ALL_CASES[name]
    rs = _results(jobs, case)
    ref = reference_train(case)
    check_parity(rs, ref, name)
    for step in range(case.steps):
        got = assemble_all(rs, "grads", step, ref["shapes"])
        assert_close_dicts(got, ref["grads"][step], f"{name}: gradient of the mean over K*W micro-batches, "
                                                    f"step {step}")
    assert_replicas_identical(rs, "grads", name)
    # exactly one outer all-reduce per unit per step
    for r in rs:
        units_with_params = sum(1 for _, names in r["units"] if names)
        replicate = r["coords"]["replicate_ranks"]
        for step, recs in enumerate(r["comm"]):
            n = sum(1 for x in recs if x.op == "all_reduce" and x.group_ranks == replicate)
            want = units_with_params if len(replicate) > 1 else 0
            assert n == want, f"{name}: rank {r['coords']['rank']}, step {step}: {n} outer all-reduces, want {want}"
            others = [x for x in recs if x.op == "all_reduce" and x.group_ranks != replicate]
            assert not others, f"{name}: all-reduces outside the replicate group {replicate}: {others}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("layout", ["I2O2", "I4O1", "I1O4"])
def test_f6_accumulated_equals_big_batch(jobs, layout):
    """K=3 micro-batches of 4 give the gradient of one micro-batch of 12 (same samples): not 1/K, not 2^K."""
    big = ALL_CASES[f"F6-{layout}-K1-batch3x"]
    ref_big = reference_train(big)
    g_big = assemble_all(_results(jobs, big), "grads", 0, ref_big["shapes"])
    for variant in ("sync-last", "sync-every"):
        name = f"F6-{layout}-K3-{variant}"
        g = assemble_all(_results(jobs, ALL_CASES[name]), "grads", 0, ref_big["shapes"])
        assert_close_dicts(g, g_big, f"{name} vs {big.name}: first-step gradient")


# --- F7 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_f7_initial_broadcast_reaches_replicas(jobs):
    case = F7[0]
    rs = _results(jobs, case)
    rank0 = build_model(case.model, seed=0).state_dict()
    other = build_model(case.model, seed=1).state_dict()
    assert any(not torch.equal(rank0[n], other[n]) for n in rank0), "the per-rank seeds should give different models"
    for r in rs:
        for n, t in r["full_at_wrap"].items():
            if n in rank0:
                assert torch.equal(t, rank0[n]), f"rank {r['coords']['rank']}: {n} after wrapping != rank 0's original"
    assert_replicas_identical([{**r, "at_wrap": [r["fragments_at_wrap"]]} for r in rs], "at_wrap", case.name)
    check_parity(rs, reference_train(case), case.name)  # includes: replicas bitwise equal after each of 3 steps


# --- F9 -------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F9-"))
def test_f9_zero_element_params(jobs, name):
    case = ALL_CASES[name]
    rs = _results(jobs, case)
    check_clipped_run(rs, case)  # norm equals the reference's (zero-size parameters add nothing), params, grads
    for r in rs:
        full = r["full"]
        shapes = {n: tuple(full[n].shape) for n in ("empty", "lin.weight", "lin.bias", "a", "b")}
        assert shapes == {"empty": (0,), "lin.weight": (0, 4), "lin.bias": (0,), "a": (8,), "b": (24,)}, shapes


# --- F11 ------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _names("F11-"))
def test_f11_inner_degree_one(jobs, name):
    case = ALL_CASES[name]
    rs = _results(jobs, case)
    check_clipped_run(rs, case)  # gradients and norm equal the reference, replicas identical after every step
    if case.inner == 1:  # every rank is a replica: whole, bitwise equal parameters everywhere
        for r in rs:
            for step, params in enumerate(r["params"]):
                for n, t in params.items():
                    assert torch.equal(t, rs[0]["params"][step][n]), (
                        f"{name}: {n} differs between rank 0 and rank {r['coords']['rank']} after step {step}")
        assert {r["coords"]["outer_rank"] for r in rs} == set(range(case.world))


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", DETAIL_WORLDS)
def test_collectives_checked_by_c10d_detail_mode(jobs, world):
    """Invariant 1 is only enforced if the job really ran under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    name = next(c.name for c in {2: W2_CASES, 4: W4_CASES}[world])
    for r in _results(jobs, ALL_CASES[name]):
        assert r["coords"]["debug_level"] == "DebugLevel.DETAIL", r["coords"]
