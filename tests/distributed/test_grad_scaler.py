"""Loss scaling: ``torch.amp.GradScaler`` and FSDP's ``ShardedGradScaler`` step or skip alike on every rank.

One W=4 job, HSDP 2 x 2 and FSDP 4. The model is one ``Linear(8, 8, bias=False)`` unit; in the first step the loss
weights output 0 by ``inf``, so only the rows of ``weight`` that hold output 0 get non-finite gradients: they lie in
one inner rank's shard, and that rank alone finds an inf (before the fix: ``found_inf`` ``[1, 0, 1, 0]``, ranks
disagreeing on the step, then a hang). The loop is torch's recipe:
``scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt); scaler.update()``.

Against one process running the same recipe on the global batch with ``torch.amp.GradScaler``: the first step is
skipped (the parameters unchanged, the scale halved) on every rank, the later steps step, and the parameters and the
scale after every step equal the reference's.

With fp16 compute (``MixedPrecisionPolicy(param_dtype=torch.float16)``) and a scale large enough to overflow fp16
gradients, there is no fp32 reference; every rank still agrees on each step and on the scale, and the replicas stay
identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_distributed
from reference import global_randn, rank_randn

WORLD = 4
TAG = 83
STEPS, LR = 4, 0.1
JOB_TIMEOUT_S = 180


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))


def weights(step: int) -> torch.Tensor:
    """(8,) per-output loss weights: output 0 weighted by inf in the first step."""
    w = torch.ones(8)
    if step == 0:
        w[0] = float("inf")
    return w


def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
    return (out.pow(2) * weights(step)).mean()


def reference() -> dict:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    params, scales = [], []
    for step in range(STEPS):
        x = global_randn(TAG, step, WORLD, 2, 8)
        scaler.scale(loss_of(model(x), step)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales}


def scaler_job() -> dict:
    import shardfusion as sf
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out = {}
    for outer in (2, 1):
        topo = sf.Topology(sharding=WORLD, fsdp_outer_degree=outer, timeout=30)
        for kind in ("torch", "sharded", "fp16"):
            mp = sf.MixedPrecisionPolicy(param_dtype=torch.float16) if kind == "fp16" else None
            model = sf.fully_shard(build(), topo, units=(nn.Linear,), mp_policy=mp)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            init = 2.0 ** 20 if kind == "fp16" else 2.0 ** 8  # fp16: the scaled gradients overflow at first
            scaler = (ShardedGradScaler(device="cpu", init_scale=init) if kind == "sharded"
                      else torch.amp.GradScaler("cpu", init_scale=init))
            params, scales, found = [], [], []
            for step in range(STEPS):
                x = rank_randn(TAG, step, topo.data_parallel_rank, 2, 8)
                scaler.scale(loss_of(model(x), step if kind != "fp16" else 1)).backward()
                scaler.unscale_(opt)
                found.append(float(sum(v.item() for v in scaler._found_inf_per_device(opt).values())))
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                params.append(sf.full_state_dict(model))
                scales.append(scaler.get_scale())
            out[(outer, kind)] = {"params": params, "scales": scales, "found": found}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(scaler_job, WORLD, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("kind", ["torch", "sharded"])
@pytest.mark.parametrize("outer", [2, 1])
def test_grad_scaler_skips_alike_and_matches_single_process(results, outer, kind):
    ref = reference()
    assert ref["scales"][0] == 2.0 ** 7, ref["scales"]  # the reference skipped its first step
    for rank, r in enumerate(results):
        got = r[(outer, kind)]
        what = f"{kind} scaler, outer {outer}, rank {rank}"
        assert got["found"][0] > 0 and not any(got["found"][1:]), f"{what}: found_inf per step {got['found']}"
        assert got["scales"] == ref["scales"], f"{what}: scales {got['scales']} != reference {ref['scales']}"
        for step in range(STEPS):
            for n, want in ref["params"][step].items():
                torch.testing.assert_close(got["params"][step][n], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what}, step {step}: {n}: {m}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("outer", [2, 1])
def test_fp16_overflow_agreed_on_every_rank(results, outer):
    runs = [r[(outer, "fp16")] for r in results]
    first = runs[0]
    assert first["found"][0] > 0, f"the first step should overflow fp16: {first['found']}"
    assert first["scales"][0] < 2.0 ** 20, first["scales"]
    for rank, got in enumerate(runs[1:], start=1):
        assert got["found"] == first["found"], f"rank {rank}: found_inf {got['found']} != rank 0's {first['found']}"
        assert got["scales"] == first["scales"], f"rank {rank}: scales {got['scales']} != rank 0's"
        for step in range(STEPS):
            for n, t in got["params"][step].items():
                assert torch.equal(t, first["params"][step][n]), f"rank {rank}, step {step}: {n} differs"
