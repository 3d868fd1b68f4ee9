"""torch's own torch.nn.utils.clip_grad_norm_ (p = 2, inf, 1; foreach None/True/False) and clip_grad_value_ on a
sharded model's parameters (its fragments) at W=4 (I, O) = (2, 2) equal the same calls on the single-process
reference (norm and parameters); a mix of fragments and plain parameters raises ValueError on every rank.
shardfusion's own clip_grad_norm_ is tested in tests/distributed/test_clipping.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed

JOB_TIMEOUT_S = 240
INF = float("inf")

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
