"""Mixed precision: bf16 or fp16 compute with fp32 shards, gradients and optimizer state; fp16 gradient communication.

* F8 (docs/field-cases.md), W=2 (2,1) and W=4 (2,2), under TORCH_DISTRIBUTED_DEBUG=DETAIL: bf16 parameters for
  compute, fp32 gradient reduction, 2 micro-batches; parameter P is used only in the second micro-batch and Q never. Run with gradient sync on every
  micro-batch and with sync off on the first (gradients then accumulate in fp32 across micro-batches). Asserts: no
  error; every gradient the optimizer reads is fp32 (the documented dtype), Q's is zero; P's gradient (and fc's)
  equals the fp32 reference within 1e-2 relative (in norm: bf16 keeps 8 bits of mantissa, so single small elements
  can be off by more); the compute really is bf16.
* bf16 training of the tiny transformer at W=4 (2,2) tracks the fp32 single-process reference loss within 1%
  relative at each of 20 AdamW steps, with fp32 and with bf16 gradient communication.
* The outer all-reduce compressed (``outer_comm_dtype`` bf16 and int8, fp32 compute), W=4 (2,2), in the same job:
  the loss tracks the fp32 single-process reference within 1% relative at each of 20 AdamW steps (and is not
  bitwise it), every parameter within 5% relative in norm at the end, and the bytes each rank sends on the
  replicate group equal the wire format's formula.
* fp16 gradient communication divides by the number of data-parallel ranks *before* the cast to fp16, so a
  per-rank gradient (or a sum of micro-batches accumulated in fp32 under no_sync) above fp16's 65504 does not
  overflow when its mean fits: W=2, one case with fp32 parameters and fp16 communication, one with fp16 parameters
  and 2 micro-batches under no_sync, in one job.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from reference import Case, assemble_all, case_results, reference_train, run_cases

JOB_TIMEOUT_S = 240
F8_RTOL = 1e-2  # relative error of a whole gradient tensor: ||g - g_ref|| / ||g_ref||
LOSS_RTOL = 0.01  # bf16 compute vs the fp32 reference, per step, over 20 steps (measured: 0.25%)


class F8Model(nn.Module):
    """fc (8 -> 8) always; p (8 -> 4) only when `use_p`; q (8 -> 4) never; out (B, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.p = nn.Linear(8, 4)
        self.q = nn.Linear(8, 4)

    def forward(self, x, use_p: bool = False):  # (B, 8) -> (B, 4)
        h = torch.tanh(self.fc(x))
        return h[:, :4] + self.p(h) if use_p else h[:, :4]


def _f8_batch(dp_rank: int, micro: int):
    g = torch.Generator().manual_seed(10 * dp_rank + micro)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _f8_reference(world: int) -> dict:
    torch.manual_seed(42)
    model = F8Model()
    for micro in range(2):
        losses = [F.mse_loss(model(x, use_p=micro == 1), y) for x, y in (_f8_batch(r, micro) for r in range(world))]
        (torch.stack(losses).mean() / 2).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _f8_job(inner: int, outer: int) -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=inner * outer, fsdp_outer_degree=outer, timeout=60)
    out = {}
    for sync_first in (True, False):
        torch.manual_seed(42)
        model = sf.fully_shard(F8Model(), topo, units=(nn.Linear,), mp_policy=sf.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, grad_comm_dtype=torch.float32))
        full_dtypes = set()
        for micro in range(2):
            sf.set_requires_gradient_sync(model, sync_first or micro == 1)
            x, y = _f8_batch(topo.data_parallel_rank, micro)
            pred = model(x, use_p=micro == 1)
            full_dtypes.add(str(pred.dtype))
            (F.mse_loss(pred.float(), y) / 2).backward()
            if micro == 0 and not sync_first:  # held for the next micro-batch in fp32
                held = {str(g.grad_acc.dtype) for u in sf.get_units(model) for g in u.trainable_groups
                        if g.grad_acc is not None}
        sf.finish_grad_sync(model)
        out[sync_first] = {
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "grad_dtypes": {n: str(p.grad.dtype) for n, p in model.named_parameters()},
            "shard_dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
            "compute_dtypes": sorted(full_dtypes),
            "placement": __import__("reference").placement(model),
            "coords": {"rank": topo.rank, "mp_rank": 0},
            "held": None if sync_first else sorted(held),
        }
    return out


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world,inner,outer", [(2, 2, 1), (4, 2, 2)], ids=["W2-I2O1", "W4-I2O2"])
def test_f8_late_and_unused_parameters(world, inner, outer):
    results = run_distributed(_f8_job, world, inner, outer, timeout=JOB_TIMEOUT_S,
                              env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    ref = _f8_reference(world)
    shapes = {n: tuple(t.shape) for n, t in ref.items()} | {"q.weight": (4, 8), "q.bias": (4,)}
    for sync_first in (True, False):
        rs = [{**r[sync_first], "grads": [r[sync_first]["grads"]]} for r in results]
        for r in rs:
            assert set(r["grad_dtypes"].values()) == {"torch.float32"}, r["grad_dtypes"]
            assert set(r["shard_dtypes"].values()) == {"torch.float32"}, r["shard_dtypes"]
            assert r["compute_dtypes"] == ["torch.bfloat16"], r["compute_dtypes"]
            assert r["held"] == (None if sync_first else ["torch.float32"]), r["held"]
        got = assemble_all(rs, "grads", 0, shapes)
        assert not got["q.weight"].any() and not got["q.bias"].any(), "q was never used"
        for name in ("p.weight", "p.bias", "fc.weight", "fc.bias"):
            rel = ((got[name] - ref[name]).norm() / ref[name].norm()).item()
            assert rel <= F8_RTOL, f"sync_first={sync_first} {name}: relative error {rel:.2e} > {F8_RTOL}"


_BF16 = Case(name="", model="transformer", world=4, sharding=4, outer=2, optim="adamw", steps=20,
             param_dtype="bfloat16")
BF16_CASES = [_BF16.with_(name="bf16-comm-fp32", grad_comm_dtype="float32"),
              _BF16.with_(name="bf16-comm-bf16", grad_comm_dtype="bfloat16"),
              _BF16.with_(name="bf16-comm-fp32-accum2-nosync", grad_comm_dtype="float32", micro=2, no_sync=True)]
# fp32 compute, the outer all-reduce compressed (in the same job)
OUTER_CASES = [_BF16.with_(name=f"outer-{d}", param_dtype=None, outer_comm_dtype=d, count_comm=True)
               for d in ("bf16", "int8")]


@pytest.fixture(scope="module")
def bf16_results():
    return run_distributed(run_cases, 4, BF16_CASES + OUTER_CASES, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.name)
def test_bf16_tracks_fp32_reference(bf16_results, case):
    rs = case_results(bf16_results, case.name)
    ref = reference_train(case.with_(param_dtype=None, grad_comm_dtype=None))
    got, want = torch.tensor(rs[0]["losses"]), torch.tensor(ref["losses"])
    rel = ((got - want).abs() / want.abs()).max().item()
    assert rel <= LOSS_RTOL, f"{case.name}: bf16 loss differs from fp32 by {rel:.4f} relative (max over 20 steps)"
    assert got[-1] < 0.8 * got[0], f"{case.name}: bf16 run did not train: {got.tolist()}"
    for r in rs:  # what the optimizer sees stays fp32
        assert all(t.dtype == torch.float32 for t in r["params"][-1].values())


OUTER_LOSS_RTOL = 0.01  # compressed outer all-reduce vs the fp32 reference, per step, over 20 steps
OUTER_PARAM_RTOL = 0.05  # ||p - p_ref|| / ||p_ref|| per parameter after 20 AdamW steps (lr 1e-2)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", OUTER_CASES, ids=lambda c: c.name)
def test_compressed_outer_all_reduce_tracks_fp32_reference(bf16_results, case):
    rs = case_results(bf16_results, case.name)
    ref = reference_train(case.with_(outer_comm_dtype=None, count_comm=False))
    got, want = torch.tensor(rs[0]["losses"]), torch.tensor(ref["losses"])
    rel = ((got - want).abs() / want.abs()).max().item()
    assert rel <= OUTER_LOSS_RTOL, f"{case.name}: loss differs from fp32 by {rel:.4f} relative (max over 20 steps)"
    assert rel > 0, f"{case.name}: bitwise the fp32 losses: was anything compressed?"
    shapes = {n: tuple(t.shape) for n, t in ref["params"][-1].items()}
    full = assemble_all(rs, "params", case.steps - 1, shapes)
    for n, t in ref["params"][-1].items():
        err = ((full[n] - t).norm() / t.norm()).item()
        assert err <= OUTER_PARAM_RTOL, f"{case.name}: {n} relative error {err:.3e} after {case.steps} steps"
    # the bytes each rank sends equal the formula of the wire format for each buffer's S elements (the bf16 case's
    # all-reduce records give S: same layout), over O = 2 ranks
    from shardfusion._runtime.compress import wire_bytes

    bf16 = case_results(bf16_results, "outer-bf16")
    for r, rb in zip(rs, bf16):
        replicate = [x for x in r["comm"][1] if x.category == "replicate_all_reduce"]
        sizes = [x.numel for x in rb["comm"][1] if x.category == "replicate_all_reduce"]
        ops = {x.op for x in replicate}
        assert ops == ({"all_reduce"} if case.outer_comm_dtype == "bf16" else {"all_to_all", "all_gather"}), ops
        want = sum(wire_bytes(S, 2, case.outer_comm_dtype) for S in sizes)
        assert sum(x.wire_bytes for x in replicate) == want, (case.name, sizes)


# --- fp16 communication: the division by the data-parallel size comes before the cast --------------------------------

FP16_CASES = ("fp32_params_fp16_comm", "fp16_params_nosync_accum")
FP16_JOB_TIMEOUT_S = 120


def _fp16_overflow_job() -> dict:
    """Worker: {case: the gradient of every parameter after the step's reduction}, for each of FP16_CASES."""
    import shardfusion as sf

    topo = sf.Topology(sharding=2, fsdp_outer_degree=1, timeout=30)
    out = {}
    for case in FP16_CASES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, bias=False))
        if case == "fp32_params_fp16_comm":  # one backward; rank 0's gradient is 1e5 per element, rank 1's zero
            sf.fully_shard(model, topo, units=(nn.Linear,),
                           mp_policy=sf.MixedPrecisionPolicy(grad_comm_dtype=torch.float16))
            micro, value = 1, 1e5
        else:  # fp16 compute and comm; 2 micro-batches of 6e4 (fits fp16) summed in fp32 under no_sync: 1.2e5
            sf.fully_shard(model, topo, units=(nn.Linear,), mp_policy=sf.MixedPrecisionPolicy(param_dtype=torch.float16))
            micro, value = 2, 6e4
        for m in range(micro):
            sf.set_requires_gradient_sync(model, m == micro - 1)
            x = torch.full((1, 4), value if topo.rank == 0 else 0.0)
            model(x).float().sum().backward()  # d/dW[i, j] = x[j]
        sf.finish_grad_sync(model)
        out[case] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def fp16_results():
    return run_distributed(_fp16_overflow_job, 2, timeout=FP16_JOB_TIMEOUT_S)


@pytest.mark.timeout(FP16_JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", FP16_CASES)
def test_fp16_predivide_does_not_overflow(fp16_results, case):
    """The mean gradient (what is reduced after the division by 2) is 5e4 / 6e4 per element, below fp16's 65504;
    casting the undivided 1e5 / 1.2e5 to fp16 first would give inf."""
    for rank, r in enumerate(fp16_results):
        g = r[case]["0.weight"]
        assert torch.isfinite(g).all(), (
            f"rank {rank} {case}: gradient overflowed to inf in fp16 communication although its mean fits: {g}")
