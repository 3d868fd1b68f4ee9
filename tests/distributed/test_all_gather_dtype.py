"""The quantized weight all-gather (``MixedPrecisionPolicy(all_gather_dtype=...)``, ZeRO++'s qwZ), W=4 over gloo,
one sharding group of 4 (``fsdp_outer_degree=1``: the layout where the all-gather would cross nodes), the tiny
transformer, fp32 shards and compute; all cases in one spawned job.

* The gathered parameters (the transformer; and the MoE GPT at ep 2, int8, whose expert buffers are gathered
  over their own groups): every unit's full buffer, gathered through the runtime's all-gather, against the exact
  parameters (``gather_copy``: the shards, unquantized). ``None``: bitwise equal. Each wire format: every element
  within its stated bound, computed here from the exact values and the shard blocks (B = 256 elements of each
  rank's shard): int8 ``(1 + 2**-14) * a / 254`` with ``a`` the max |x| of the element's block; fp8 e4m3 with a
  per-block scale ``max(|x| / 16, a / 458752) + a * 2**-20``; bf16 ``|x| * 2**-8``; fp16 ``|x| * 2**-11 + 2**-25``
  (derivations in shardfusion/_runtime/gather_wire.py); not bitwise (something was quantized); bitwise the same on
  every rank (each rank dequantizes its own shard too). A float wire format equal to ``param_dtype`` (bf16) is
  bitwise the all-gather without the option.
* ``None`` trains with the fp32 reference's losses at the parity tolerance (the plain all-gather).
* Training, 8 AdamW steps against the fp32 single-process reference (the reduce-scatter and the optimizer are
  exact, only the compute sees the quantized weights):
  - step 0's loss (same weights in both runs, before any update): ``|L~ - L| <= 2 * sum_i |g_i| * b_i + 1e-6 * L``,
    the first-order change of the loss under a weight error ``|d_i| <= b_i`` (``g``: the reference's gradient at
    step 0, ``b``: the bound above per element), doubled for the second-order term, plus fp32 summation noise;
  - later steps, where the trajectories drift apart: the loss within ``LOSS_RTOL`` relative and every parameter
    within ``PARAM_RTOL`` relative in norm after the last step (per format; measured values at the constants);
    and the losses are not ``None``'s (something was quantized).
* The bytes: every ``inner_all_gather`` record's ``wire_bytes`` equals ``gather_wire.wire_bytes`` of its buffer's
  shard (``(G-1) * (S + 4 * ceil(S / 256))`` for int8 and fp8, ``(G-1) * 2S`` for bf16/fp16), with the shard size S
  taken from the fp32 run's records (same layout); the same number of collectives; int8's and fp8's totals are
  between 0.25 and 0.27 of fp32's (a quarter, plus 4 bytes per started block of 256: this model's shards are small,
  so the partial last blocks weigh: 0.264 measured), bf16's and fp16's half.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from reference import Case, case_results, reference_train, run_cases

JOB_TIMEOUT_S = 240
B = 256
WIRES = ("int8", "float8_e4m3fn", "bfloat16", "float16")
# Measured tolerances, about 2-3 x the measured maximum (deterministic: fixed seeds, gloo on CPU), per format:
# the relative step of the format sets the scale (int8 ~1/254 of a block's max, e4m3 1/16 of the value, bf16 2**-8,
# fp16 2**-11). Loss: max over the 8 steps of |L~ - L| / L (measured: int8 7.2e-3, fp8 2.2e-2, bf16 2.1e-3,
# fp16 2.3e-4). Parameters after the last step, max over parameters of ||p - p_ref|| / ||p_ref|| (measured: int8
# 1.2e-2, fp8 1.2e-1, bf16 2.0e-3, fp16 4.3e-4). The blocks of a flat shard span parameter boundaries, so a block
# holding a LayerNorm weight (1.0) quantizes the small matrix entries next to it with a coarse step: int8 errs more
# on this model than on a matrix alone.
LOSS_RTOL = {"int8": 0.02, "float8_e4m3fn": 0.05, "bfloat16": 0.005, "float16": 0.001}
PARAM_RTOL = {"int8": 0.03, "float8_e4m3fn": 0.25, "bfloat16": 0.005, "float16": 0.001}

_BASE = Case(name="", model="transformer", world=4, sharding=4, outer=1, optim="adamw", steps=8, count_comm=True)
TRAIN_CASES = [_BASE.with_(name="none")] + [_BASE.with_(name=w, all_gather_dtype=w) for w in WIRES]
GATHER_CASES = TRAIN_CASES + [_BASE.with_(name="bf16-param", param_dtype="bfloat16"),
                              _BASE.with_(name="bf16-param-bf16-wire", param_dtype="bfloat16",
                                          all_gather_dtype="bfloat16"),
                              _BASE.with_(name="moe-ep2-int8", model="moe", ep=2, all_gather_dtype="int8")]


def _gathered(case: Case) -> dict:
    """Worker: per flat buffer, the runtime's gathered full buffer, the exact one, S, G and the slots."""
    import shardfusion as sf
    from models import MODEL_SEED, build_model
    from reference import get_topology, wrap_kwargs

    topo = get_topology(case)
    model = build_model(case.model, seed=MODEL_SEED, ep_group=topo.get_group("ep"))
    sf.fully_shard(model, topo, **wrap_kwargs(case))
    out = []
    for unit in sf.get_units(model):
        for g in unit.groups:
            g.unshard()
            full = g.full.clone()
            g.reshard()
            out.append({"full": full, "exact": g.gather_copy(), "S": g.layout.shard_numel,
                        "G": g.layout.shard_count, "slots": [(s.name, s.offset, s.end) for s in g.layout.slots]})
    return {"buffers": out}


def _job() -> dict:
    results = run_cases(TRAIN_CASES)
    for case in GATHER_CASES:
        results["gather-" + case.name] = _gathered(case)
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 4, timeout=JOB_TIMEOUT_S)


def _bound(wire: str, exact: torch.Tensor, s: int) -> torch.Tensor:
    """The stated error bound per element of a gathered buffer (``exact``: ``(G*S,)``), float64."""
    x = exact.double()
    ax = x.abs()
    a = torch.empty_like(ax)  # max |x| over each element's block of its own shard
    for r in range(0, x.numel(), s):
        for k in range(r, r + s, B):
            a[k:min(k + B, r + s)] = ax[k:min(k + B, r + s)].max()
    if wire == "int8":
        return (1 + 2 ** -14) * a / 254
    if wire == "float8_e4m3fn":
        return torch.maximum(ax / 16, a / 458752) + a * 2 ** -20
    if wire == "bfloat16":
        return ax * 2 ** -8
    return ax * 2 ** -11 + 2 ** -25


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("wire, name", [(None, "gather-none")] + [(w, "gather-" + w) for w in WIRES]
                         + [("int8", "gather-moe-ep2-int8")], ids=lambda v: str(v).removeprefix("gather-"))
def test_gathered_parameters_within_bound(results, wire, name):
    per_rank = case_results(results, name)
    for rank, mine in enumerate(per_rank):
        for i, buf in enumerate(mine["buffers"]):
            _check_gathered(wire, f"{name} rank {rank} buffer {i}", buf,
                            [r["buffers"][i] for r in per_rank if torch.equal(r["buffers"][i]["exact"], buf["exact"])])


def _check_gathered(wire, what: str, buf: dict, holders: list[dict]) -> None:
    """``buf``'s gathered buffer against its exact one; ``holders``: the ranks' buffers of the same parameters
    (experts differ across ep ranks), which must compute with bitwise the same full parameters."""
    for other in holders:
        assert torch.equal(other["full"], buf["full"]), f"{what}: ranks holding the same parameters differ"
    full, exact = buf["full"], buf["exact"]
    if wire is None or buf["G"] == 1:
        assert torch.equal(full, exact), f"{what}: not bitwise the exact parameters"
        return
    err = (full.double() - exact.double()).abs()
    bound = _bound(wire, exact, buf["S"])
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= bound).all(), f"{what}: error up to {worst:.3f} x the stated bound"
    assert err.max() > 0, f"{what}: bitwise exact: was anything quantized?"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_none_is_the_exact_all_gather(results):
    """``all_gather_dtype=None`` trains as the plain sharded run does: parity with the fp32 reference."""
    from reference import assert_losses_match

    case = TRAIN_CASES[0]
    assert_losses_match(case_results(results, "none"), reference_train(case.with_(count_comm=False)), "none")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_wire_equal_to_param_dtype_is_the_plain_all_gather(results):
    plain, wired = case_results(results, "gather-bf16-param"), case_results(results, "gather-bf16-param-bf16-wire")
    for p, w in zip(plain, wired):
        for a, b in zip(p["buffers"], w["buffers"]):
            assert a["full"].dtype == torch.bfloat16 and torch.equal(a["full"], b["full"])


def _first_order_bound(case: Case, buffers: list[dict], ref: dict) -> float:
    """``2 * sum_i |g_i| * b_i``: the loss change at step 0 a weight error within the bound can cause."""
    total = 0.0
    for buf in buffers:
        bound = _bound(case.all_gather_dtype, buf["exact"], buf["S"])
        for name, lo, hi in buf["slots"]:
            g = ref["grads"][0][name]
            total += (g.double().reshape(-1).abs() * bound[lo:hi]).sum().item()
    return 2 * total


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("wire", WIRES)
def test_training_tracks_fp32_reference(results, wire):
    case = next(c for c in TRAIN_CASES if c.name == wire)
    rs = case_results(results, wire)
    ref = reference_train(case.with_(all_gather_dtype=None, count_comm=False))
    got, want = torch.tensor(rs[0]["losses"], dtype=torch.float64), torch.tensor(ref["losses"], dtype=torch.float64)
    first = _first_order_bound(case, case_results(results, "gather-" + wire)[0]["buffers"], ref)
    assert abs(got[0] - want[0]) <= first + 1e-6 * want[0], (
        f"{wire}: step 0 loss off by {abs(got[0] - want[0]).item():.3e} > first-order bound {first:.3e}")
    rel = ((got - want).abs() / want.abs()).max().item()
    assert rel <= LOSS_RTOL[wire], f"{wire}: loss differs from fp32 by {rel:.4f} relative (max over {case.steps} steps)"
    assert rs[0]["losses"] != case_results(results, "none")[0]["losses"], f"{wire}: the losses of None: not quantized"
    assert got[-1] < 0.8 * got[0], f"{wire}: did not train: {got.tolist()}"
    from reference import assemble_all

    shapes = {n: tuple(t.shape) for n, t in ref["params"][-1].items()}
    full = assemble_all(rs, "params", case.steps - 1, shapes)
    for n, t in ref["params"][-1].items():
        err = ((full[n] - t).norm() / t.norm()).item()
        assert err <= PARAM_RTOL[wire], f"{wire}: {n} relative error {err:.3e} after {case.steps} steps"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("wire", WIRES)
def test_all_gather_bytes_match_the_wire_format(results, wire):
    from shardfusion._runtime import gather_wire

    fmt = wire if wire == "int8" else getattr(torch, wire)
    for r, r32 in zip(case_results(results, wire), case_results(results, "none")):
        for step, (recs, recs32) in enumerate(zip(r["comm"], r32["comm"])):
            ag = [x for x in recs if x.category == "inner_all_gather"]
            ag32 = [x for x in recs32 if x.category == "inner_all_gather"]
            assert len(ag) == len(ag32) > 0, (wire, step, len(ag), len(ag32))
            for x, x32 in zip(ag, ag32):
                g = len(x32.group_ranks)
                want = gather_wire.wire_bytes(x32.numel // g, g, fmt, 4)
                assert x.wire_bytes == want, (wire, step, x.numel, x32.numel)
            total, total32 = sum(x.wire_bytes for x in ag), sum(x.wire_bytes for x in ag32)
            if gather_wire.is_blockwise(fmt):  # a quarter plus the scales: 4 bytes per started block of each shard
                assert 0.25 < total / total32 <= 0.27, (wire, total / total32)
            else:
                assert total / total32 == 0.5, (wire, total / total32)
