"""Invariant 2: sf.clip_grad_norm_ counts each gradient element once and returns the same norm on every rank.

For every layout of the parity grid (W=4: (I, O) = (4,1), (2,2), (1,4); W=8: (4,2) and mp=2 with I=2, O=2) and
norm types 2 and inf, a 3-step SGD run clips every step; compared with torch.nn.utils.clip_grad_norm_ on the
single-process reference: the returned norm (rtol 1e-5), bitwise the same on every rank; the gradients before and
after clipping (assembled from fragments); the parameters after every step. max_norm=0.05 makes clipping act
(asserted on the reference); max_norm=1e6 leaves the gradients unscaled, so only the norm is under test.
Non-finite gradients: the norm is non-finite on every rank, and error_if_nonfinite=True raises on every rank.
Communication: clipping adds exactly one all-reduce of one scalar over the world per step.

The field cases F1 and F2 (docs/field-cases.md), in a W=4 job of their own under TORCH_DISTRIBUTED_DEBUG=DETAIL:
the HSDP norm does not grow with O (the MLP in (I, O) = (4, 1), (2, 2), (1, 4), 2- and inf-norm, max_norm huge and
0.1), and a parameter kept whole on every rank (replicate_filter) counts once.

Steps whose gradients are not finite (one rank's loss times inf or nan), skipped by the user: the norm is non-finite
on every rank in those steps and finite again after them, and the run equals the reference that skips the same
steps (W=4 HSDP (2, 2), and W=2 FSDP under DETAIL). A norm measured after zero_grad(set_to_none=True) and no
backward is 0, not the last one.

torch's own clip_grad_norm_ / clip_grad_value_ on the fragments are in tests/distributed/test_torch_clip.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from models import build_model
from reference import (Case, CaseJobs, assert_close_dicts, case_results, check_clipped_run, get_topology, rank_randn,
                       run_cases, seeded, state_snapshot)

JOB_TIMEOUT_S = 240
FIELD_JOB_TIMEOUT_S = 300
SMALL, HUGE = 0.05, 1e6
INF = float("inf")
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}

_C = Case(name="", model="transformer", optim="sgd", lr=0.1, steps=3, record_grads=True)


def _grid(world: int, layouts: list[tuple[str, dict]]) -> list[Case]:
    cases = []
    for tag, layout in layouts:
        for norm_type in (2.0, INF):
            for max_norm in (SMALL, HUGE):
                nt = "inf" if norm_type == INF else "2"
                cases.append(_C.with_(name=f"{tag}-norm{nt}-max{max_norm:g}", world=world,
                                      clip=(max_norm, norm_type), **layout))
    # the norm's finish_grad_sync is the only one in the step (no explicit call before clipping)
    tag, layout = layouts[-1]
    cases.append(_C.with_(name=f"{tag}-implicit-sync", world=world, clip=(SMALL, 2.0), record_grads=False,
                          micro=2, count_comm=True, **layout))
    return cases


W4_CASES = _grid(4, [("I4O1", dict(sharding=4, outer=1)), ("I1O4", dict(sharding=4, outer=4)),
                     ("I2O2", dict(sharding=4, outer=2))])
W8_CASES = _grid(8, [("I4O2", dict(sharding=8, outer=2)), ("mp2-I2O2", dict(sharding=4, outer=2, mp=2))])


def nonfinite_check(case: Case) -> dict:
    """Worker: a NaN in one rank's gradient makes the norm non-finite everywhere; error_if_nonfinite raises."""
    import torch.distributed as dist
    import shardfusion as sf
    from models import build_model, loss_fn, make_batch, UNIT_CLASSES

    topo = get_topology(case)
    model = sf.fully_shard(build_model("mlp"), topo, units=UNIT_CLASSES["mlp"])
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    out = {}
    for error in (False, True):
        scale = float("nan") if dist.get_rank() == 1 else 1.0  # one rank's contribution only
        (loss_fn("mlp", model, make_batch("mlp", gen)) * scale).backward()
        try:
            out[error] = sf.clip_grad_norm_(model, 1.0, error_if_nonfinite=error).item()
        except RuntimeError as e:
            out[error] = f"RuntimeError: {e}"
        for p in model.parameters():
            p.grad = None
    return out


def clip_job(cases: list[Case]) -> tuple:
    nonfinite = nonfinite_check(Case(name="nonfinite", model="mlp", sharding=4, outer=2))
    skipped = skipped_nonfinite_steps(get_topology(Case(name="", sharding=4, outer=2)))
    return run_cases(cases), nonfinite, skipped


@pytest.fixture(scope="module")
def w4_results():
    """(per-rank case results, per-rank non-finite check, per-rank skipped non-finite steps) of the W=4 job."""
    per_rank = run_distributed(clip_job, 4, W4_CASES, timeout=JOB_TIMEOUT_S)
    return [r[0] for r in per_rank], [r[1] for r in per_rank], [r[2] for r in per_rank]


@pytest.fixture(scope="module")
def w8_results():
    return run_distributed(run_cases, 8, W8_CASES, timeout=JOB_TIMEOUT_S)


def check_clip(rs: list[dict], case: Case) -> None:
    check_clipped_run(rs, case, small=SMALL)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: c.name)
def test_clip_world4(w4_results, case):
    check_clip(case_results(w4_results[0], case.name), case)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", W8_CASES, ids=lambda c: c.name)
def test_clip_world8(w8_results, case):
    check_clip(case_results(w8_results, case.name), case)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_norm_same_for_every_layout(w4_results, w8_results):
    """F1's symptom: the norm must not grow with O (or with mp). Same model and global batch -> same norm."""
    for nt in ("2", "inf"):
        # cases with the same number of data-parallel ranks train on the same global batch
        by_batch: dict[int, dict[str, float]] = {}
        for results, cases in ((w4_results[0], W4_CASES), (w8_results, W8_CASES)):
            for c in cases:
                if c.name.endswith(f"-norm{nt}-max{SMALL:g}"):
                    by_batch.setdefault(c.data_parallel, {})[c.name] = case_results(results, c.name)[0]["norms"][0]
        assert sorted(len(v) for v in by_batch.values()) == [1, 4], by_batch  # W=8 mp=2 has 4 like W=4
        for vals in by_batch.values():
            first = next(iter(vals.values()))
            for v in vals.values():
                assert math.isclose(v, first, rel_tol=1e-5), f"norm{nt} differs across layouts: {vals}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", [4, 8])
def test_clip_communication(w4_results, w8_results, world):
    """Clipping adds one all-reduce of one scalar over the world; the step keeps one outer all-reduce per unit (in
    the first step one per unit and micro-batch: each backward leaves final gradients, none is predicted last yet)."""
    results, cases = (w4_results[0], W4_CASES) if world == 4 else (w8_results, W8_CASES)
    case = next(c for c in cases if c.count_comm)
    for r in case_results(results, case.name):
        replicate, units = r["coords"]["replicate_ranks"], sum(1 for _, names in r["units"] if names)
        for step, recs in enumerate(r["comm"]):
            where = f"{case.name}, rank {r['coords']['rank']}, step {step}"
            scalar = [x for x in recs if x.op == "all_reduce" and x.group_ranks == tuple(range(world))]
            assert len(scalar) == 1 and scalar[0].numel == 1, f"{where}: world all-reduces {scalar}"
            outer = [x for x in recs if x.op == "all_reduce" and x.group_ranks == replicate]
            per_unit = case.micro if step == 0 and not case.no_sync else 1
            assert len(outer) == (units * per_unit if len(replicate) > 1 else 0), (
                f"{where}: replicate all-reduces {outer}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nonfinite_norm(w4_results):
    outs = w4_results[1]
    for rank, out in enumerate(outs):
        assert isinstance(out[False], float) and not math.isfinite(out[False]), (
            f"rank {rank}: error_if_nonfinite=False should return a non-finite norm, got {out[False]!r}")
        assert isinstance(out[True], str) and out[True].startswith("RuntimeError"), (
            f"rank {rank}: error_if_nonfinite=True should raise RuntimeError on every rank, got {out[True]!r}")


# --- F1, F2 (docs/field-cases.md): under DETAIL -----------------------------------------------------------------------


def _lay(inner: int, outer: int) -> dict:
    return {"sharding": inner * outer, "outer": outer}


# F1: HSDP norm must not grow with O
F1 = [Case(name=f"F1-I{i}O{o}-norm{'inf' if nt == INF else 2}-max{mx:g}", model="mlp", optim="sgd", lr=0.1,
           steps=2, clip=(mx, nt), record_grads=True, **_lay(i, o))
      for i, o in ((4, 1), (2, 2), (1, 4)) for nt in (2.0, INF) for mx in (HUGE, 0.1)]
# F2: a parameter kept whole on every rank is counted once
F2 = [Case(name="F2-I2O2-replicated-scale", model="scaled_mlp", optim="sgd", lr=0.1, steps=2, clip=(HUGE, 2.0),
           record_grads=True, replicate=("scale",), **_lay(2, 2)),
      Case(name="F2-I2O2-replicated-scale-clip", model="scaled_mlp", optim="sgd", lr=0.1, steps=2,
           clip=(0.1, 2.0), record_grads=True, replicate=("scale",), **_lay(2, 2))]
FIELD_CASES = {4: [*F1, *F2]}


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


def field_cases_job(cases: list[Case]) -> dict:
    """Worker: F2's scaling check, then every case; {case name: result, "_f2_scale": the check's result}."""
    f2 = f2_scale_check(F2[0])
    return {**run_cases(cases), "_f2_scale": f2}


@pytest.fixture(scope="module")
def field_jobs():
    return CaseJobs(FIELD_CASES, env={4: DETAIL}, worker=field_cases_job, timeout=FIELD_JOB_TIMEOUT_S)


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [c.name for c in F1])
def test_f1_hsdp_norm(field_jobs, name):
    case = field_jobs.case(name)
    check_clipped_run(field_jobs.results(case), case, small=0.1)


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
def test_f1_norm_independent_of_layout(field_jobs):
    for suffix in ("norm2-max1e+06", "norminf-max1e+06"):
        norms = {n: field_jobs.results(field_jobs.case(n))[0]["norms"] for n in field_jobs.names("F1-")
                 if n.endswith(suffix)}
        assert len(norms) == 3, norms
        first = next(iter(norms.values()))
        for n, v in norms.items():
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(v, first)), f"{suffix}: {norms}"


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [c.name for c in F2])
def test_f2_whole_parameter_counted_once(field_jobs, name):
    case = field_jobs.case(name)
    rs = field_jobs.results(case)
    for r in rs:  # the parameter really is kept whole on every rank
        assert r["params"][0]["scale"].numel() == 4, f"rank {r['coords']['rank']}: scale fragment is not whole"
    check_clipped_run(rs, case, small=0.1)


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
def test_f2_scaling_whole_parameter_grad(field_jobs):
    for r in field_jobs.get(4):
        out = r["_f2_scale"]
        assert out["scale_numel"] == 4
        diff, want = out["n2"] ** 2 - out["n1"] ** 2, 99 * out["g2"]
        assert want > 1e-3 * out["n2"] ** 2, f"the scale gradient is too small to tell: {out}"
        assert math.isclose(diff, want, rel_tol=1e-4, abs_tol=1e-5 * out["n2"] ** 2), (
            f"rank {out['rank']}: norm^2 grew by {diff}, expected 99 * ||g||^2 = {want} "
            f"(ratio {diff / want:.3f}: the whole-kept parameter is counted {diff / want:.2f} times)")


@pytest.mark.timeout(FIELD_JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", sorted(FIELD_CASES))
def test_collectives_checked_by_c10d_detail_mode(field_jobs, world):
    """Invariant 1 (docs/design.md) is only enforced if the job really ran under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    field_jobs.assert_under_detail(world)


# --- steps with non-finite gradients skipped by the user; the norm after zero_grad ------------------------------------

NONFINITE_TAG, NONFINITE_STEPS, NONFINITE_MAX_NORM, NONFINITE_LR = 7, 6, 1.0, 0.1
BAD_STEPS = {1: (0, math.inf), 3: (-1, math.nan)}  # step -> (rank whose loss is multiplied, factor); -1: the last rank


def odd_mlp() -> nn.Sequential:
    """Odd sizes: the flat buffers of Linear(5, 3) and Linear(3, 1) have alignment gaps and padding."""
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def skipped_nonfinite_steps(topo) -> dict:
    """Worker: steps whose gradients are not finite (one rank's loss times inf or nan) are skipped by the user, then
    zero_grad(set_to_none=False). Then, on a fresh model: the norm after zero_grad(set_to_none=True) and no
    backward."""
    import torch.distributed as dist
    import shardfusion as sf

    world, dp_rank = dist.get_world_size(), topo.data_parallel_rank
    bad = {s: (r % world, f) for s, (r, f) in BAD_STEPS.items()}
    model = sf.fully_shard(seeded(odd_mlp), topo, units=(nn.Linear,))
    opt = torch.optim.SGD(model.parameters(), lr=NONFINITE_LR)
    norms, stepped = [], []
    for step in range(NONFINITE_STEPS):
        x, y = rank_randn(NONFINITE_TAG, step, dp_rank, 4, 5), rank_randn(NONFINITE_TAG, 50 + step, dp_rank, 4, 1)
        loss = F.mse_loss(model(x), y)
        if step in bad and bad[step][0] == dp_rank:
            loss = loss * bad[step][1]
        loss.backward()
        norm = sf.clip_grad_norm_(model, NONFINITE_MAX_NORM)
        norms.append(norm.item())
        stepped.append(bool(torch.isfinite(norm)))
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=False)
    full = sf.full_state_dict(model)

    model = sf.fully_shard(seeded(odd_mlp), topo, units=(nn.Linear,))
    opt = torch.optim.SGD(model.parameters(), lr=NONFINITE_LR)
    x, y = rank_randn(NONFINITE_TAG, 90, dp_rank, 4, 5), rank_randn(NONFINITE_TAG, 91, dp_rank, 4, 1)
    F.mse_loss(model(x), y).backward()
    norm_after_backward = sf.clip_grad_norm_(model, 1e9).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    norm_no_grads = sf.clip_grad_norm_(model, 1e9).item()
    grads_none = all(p.grad is None for p in model.parameters())
    return {"norms": norms, "stepped": stepped, "full": full, "norm_after_backward": norm_after_backward,
            "norm_without_grads": norm_no_grads, "grads_none": grads_none}


def skipped_nonfinite_job() -> dict:
    """Worker of the W=2 plain-FSDP job (under DETAIL)."""
    return skipped_nonfinite_steps(get_topology(Case(name="", world=2, sharding=2, outer=1)))


@pytest.fixture(scope="module")
def w2_detail_skipped():
    return run_distributed(skipped_nonfinite_job, 2, timeout=JOB_TIMEOUT_S, env=DETAIL)


def _skipped_results(world: int, w4_results, w2_detail_skipped) -> list[dict]:
    return w4_results[2] if world == 4 else w2_detail_skipped


def skipped_nonfinite_reference(world: int) -> dict:
    """One process: the global loss is the mean of the ranks' losses (inf or nan on a bad step), clipped by torch."""
    model = seeded(odd_mlp)
    bad = {s: (r % world, f) for s, (r, f) in BAD_STEPS.items()}
    norms = []
    for step in range(NONFINITE_STEPS):
        total = 0.0
        for r in range(world):
            loss = F.mse_loss(model(rank_randn(NONFINITE_TAG, step, r, 4, 5)),
                              rank_randn(NONFINITE_TAG, 50 + step, r, 4, 1))
            if step in bad and bad[step][0] == r:
                loss = loss * bad[step][1]
            total = total + loss
        (total / world).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), NONFINITE_MAX_NORM)
        norms.append(norm.item())
        if torch.isfinite(norm):
            with torch.no_grad():
                for p in model.parameters():
                    p -= NONFINITE_LR * p.grad
        model.zero_grad(set_to_none=False)
    return {"norms": norms, "final": state_snapshot(model)}


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", (4, 2))
def test_norm_recovers_after_skipped_nonfinite_step(w4_results, w2_detail_skipped, world):
    """W=4 is HSDP (2, 2); W=2 is plain FSDP under DETAIL."""
    rs = _skipped_results(world, w4_results, w2_detail_skipped)
    ref = skipped_nonfinite_reference(world)
    for step, ref_norm in enumerate(ref["norms"]):
        bad = step in BAD_STEPS
        assert math.isfinite(ref_norm) != bad, f"reference step {step}: norm {ref_norm} (bad step: {bad})"
    for rank, r in enumerate(rs):
        assert r["norms"] == rs[0]["norms"] or all(
            (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(r["norms"], rs[0]["norms"])), (
            f"norms differ across ranks: rank 0 {rs[0]['norms']} vs rank {rank} {r['norms']}")
        for step, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            if step in BAD_STEPS:
                assert not math.isfinite(got), f"W={world} rank {rank} step {step}: norm {got} should not be finite"
            else:
                assert math.isfinite(got), (f"W={world} rank {rank} step {step}: norm {got} after a skipped "
                                            f"non-finite step (all norms: {r['norms']})")
                assert math.isclose(got, want, rel_tol=1e-5), (
                    f"W={world} rank {rank} step {step}: norm {got} != reference {want}")
        assert r["stepped"] == [s not in BAD_STEPS for s in range(NONFINITE_STEPS)]
        assert_close_dicts(r["full"], ref["final"], f"W={world} rank {rank} after {NONFINITE_STEPS} steps")


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", (4, 2))
def test_norm_is_zero_after_zero_grad_set_to_none(w4_results, w2_detail_skipped, world):
    for rank, r in enumerate(_skipped_results(world, w4_results, w2_detail_skipped)):
        assert r["norm_after_backward"] > 0, f"rank {rank}: the step before had no gradient to forget"
        assert r["grads_none"], f"rank {rank}: zero_grad(set_to_none=True) left gradients"
        assert r["norm_without_grads"] == 0.0, (
            f"W={world} rank {rank}: clip_grad_norm_ with no gradients returned {r['norm_without_grads']} "
            f"(the previous norm was {r['norm_after_backward']})")
