"""Invariant 2: sf.clip_grad_norm_ counts each gradient element once and returns the same norm on every rank.

For every layout of the parity grid (W=4: (I, O) = (4,1), (2,2), (1,4); W=8: (4,2) and mp=2 with I=2, O=2) and
norm types 2 and inf, a 3-step SGD run clips every step; compared with torch.nn.utils.clip_grad_norm_ on the
single-process reference: the returned norm (rtol 1e-5), bitwise the same on every rank; the gradients before and
after clipping (assembled from fragments); the parameters after every step. max_norm=0.05 makes clipping act
(asserted on the reference); max_norm=1e6 leaves the gradients unscaled, so only the norm is under test.
Non-finite gradients: the norm is non-finite on every rank, and error_if_nonfinite=True raises on every rank.
Communication: clipping adds exactly one all-reduce of one scalar over the world per step.
torch's own torch.nn.utils.clip_grad_norm_ (p = 2, inf, 1; foreach None/True/False) and clip_grad_value_ on
model.parameters() at W=4 (I, O) = (2, 2) equal the same calls on the single-process reference (norm and parameters);
a mix of fragments and plain parameters raises ValueError on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from reference import Case, case_results, check_clipped_run, get_topology, run_cases

JOB_TIMEOUT_S = 240
SMALL, HUGE = 0.05, 1e6
INF = float("inf")

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
    return run_cases(cases), nonfinite


@pytest.fixture(scope="module")
def w4_results():
    per_rank = run_distributed(clip_job, 4, W4_CASES, timeout=JOB_TIMEOUT_S)
    return [r[0] for r in per_rank], [r[1] for r in per_rank]


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
    """Clipping adds one all-reduce of one scalar over the world; the step keeps one outer all-reduce per unit."""
    results, cases = (w4_results[0], W4_CASES) if world == 4 else (w8_results, W8_CASES)
    case = next(c for c in cases if c.count_comm)
    for r in case_results(results, case.name):
        replicate, units = r["coords"]["replicate_ranks"], sum(1 for _, names in r["units"] if names)
        for step, recs in enumerate(r["comm"]):
            where = f"{case.name}, rank {r['coords']['rank']}, step {step}"
            scalar = [x for x in recs if x.op == "all_reduce" and x.group_ranks == tuple(range(world))]
            assert len(scalar) == 1 and scalar[0].numel == 1, f"{where}: world all-reduces {scalar}"
            outer = [x for x in recs if x.op == "all_reduce" and x.group_ranks == replicate]
            assert len(outer) == (units if len(replicate) > 1 else 0), f"{where}: replicate all-reduces {outer}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nonfinite_norm(w4_results):
    outs = w4_results[1]
    for rank, out in enumerate(outs):
        assert isinstance(out[False], float) and not math.isfinite(out[False]), (
            f"rank {rank}: error_if_nonfinite=False should return a non-finite norm, got {out[False]!r}")
        assert isinstance(out[True], str) and out[True].startswith("RuntimeError"), (
            f"rank {rank}: error_if_nonfinite=True should raise RuntimeError on every rank, got {out[True]!r}")


# --- torch's own clip_grad_norm_ / clip_grad_value_ on a sharded model's parameters ---------------------------------
# (I, O) = (2, 2) at W=4: each variant trains 2 SGD steps, clipping with torch.nn.utils every step, against the same
# calls on the single-process reference: the returned norm (bitwise the same on every rank) and the parameters.
TORCH_CLIP_VARIANTS = [("norm", 2.0, None), ("norm", 2.0, True), ("norm", 2.0, False), ("norm", INF, None),
                       ("norm", 1.0, False), ("value", None, None), ("value", None, False)]
TORCH_CLIP_MAX, TORCH_CLIP_VALUE, TORCH_CLIP_STEPS = 0.1, 0.01, 2


def _variant_id(v: tuple) -> str:
    kind, norm_type, foreach = v
    return f"{kind}-p{norm_type:g}-foreach{foreach}" if kind == "norm" else f"{kind}-foreach{foreach}"


def _torch_clip_train(model, chunk, variant: tuple) -> list:
    """TORCH_CLIP_STEPS SGD steps of the mlp, clipped by torch.nn.utils; returns the norms (empty for value), or
    the RuntimeError that a clipping call raised (on some ranks only, for torch's own inf norm of an empty
    fragment: the step goes on, so that every rank issues the same collectives)."""
    import torch.nn.functional as F

    kind, norm_type, foreach = variant
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(TORCH_CLIP_STEPS):
        g = torch.Generator().manual_seed(200 + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        F.mse_loss(model(chunk(x)), chunk(y)).backward()
        try:
            if kind == "norm":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), TORCH_CLIP_MAX,
                                                            norm_type=norm_type, foreach=foreach).item())
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), TORCH_CLIP_VALUE, foreach=foreach)
        except RuntimeError as e:
            norms.append(f"RuntimeError: {e}")
        opt.step()
        opt.zero_grad()
    return norms


def torch_clip_job() -> dict:
    """Worker: every variant on a fresh sharded mlp (I=2, O=2); then a mix of fragments and a plain parameter."""
    import torch.distributed as dist
    import torch.nn as nn
    import shardfusion as sf
    from models import build_model

    topo, out = sf.Topology(sharding=-1, fsdp_outer_degree=2), {}
    rank = topo.data_parallel_rank
    for v in TORCH_CLIP_VARIANTS:
        model = sf.fully_shard(build_model("mlp"), topo, units=(nn.Linear,))
        norms = _torch_clip_train(model, lambda t: t.chunk(dist.get_world_size())[rank], v)
        out[_variant_id(v)] = {"norms": norms, "full": sf.full_state_dict(model)}
    try:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + [nn.Parameter(torch.ones(2))], 1.0)
        out["mixed"] = "no error"
    except ValueError as e:
        out["mixed"] = f"ValueError: {e}"
    return out


@pytest.fixture(scope="module")
def torch_clip_results():
    return run_distributed(torch_clip_job, 4, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("variant", TORCH_CLIP_VARIANTS, ids=_variant_id)
def test_torch_clip_on_fragments_matches_single_process(torch_clip_results, variant):
    from models import build_model

    ref = build_model("mlp")
    ref_norms = _torch_clip_train(ref, lambda t: t, variant)
    for rank, r in enumerate(torch_clip_results):
        got = r[_variant_id(variant)]
        assert not [n for n in got["norms"] if isinstance(n, str)], f"rank {rank}: {got['norms']}"
        assert got["norms"] == torch_clip_results[0][_variant_id(variant)]["norms"], f"rank {rank}: norms differ"
        for n, rn in zip(got["norms"], ref_norms):
            assert math.isclose(n, rn, rel_tol=1e-5), f"rank {rank}: norm {n} vs single process {rn}"
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(got["full"][name], p, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    if variant[0] == "norm":
        assert ref_norms[0] > TORCH_CLIP_MAX, "clipping must act in this test"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_torch_clip_norm_refuses_fragments_mixed_with_plain_parameters(torch_clip_results):
    for rank, r in enumerate(torch_clip_results):
        assert r["mixed"].startswith("ValueError") and "4 shardfusion fragments and 1 tensors" in r["mixed"], (
            f"rank {rank}: {r['mixed']}")
