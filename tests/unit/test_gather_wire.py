"""The wire formats of the quantized weight all-gather (shardfusion/_runtime/gather_wire.py), locally.

Each rank's shard is quantized by ``quantize`` and every gathered shard dequantized by ``dequantize_into``; here the
"gather" is a concatenation of the packed shards of G emulated ranks, so the round trip is exactly what a rank
computes after the real all-gather (tests/distributed/test_all_gather_dtype.py runs it over gloo). The error of
every element is checked against the stated bound, computed here from the input (max |x| of the element's block of
its own shard), not read from the implementation:

- int8: ``|err| <= (1 + 2**-14) * a / 254`` (half a step a/127);
- fp8 e4m3 with a per-block scale a/448: ``|err| <= max(|x| / 16, a / 458752) + a * 2**-20``;
- bf16: ``|err| <= |x| * 2**-8``; fp16: ``|err| <= |x| * 2**-11 + 2**-25``.

The bounds are tight enough to fail on a wrong format: int8's bound is below fp8's error on the same data and fp8's
below what a cast without the scale would give on tiny blocks (checked). Also: the bytes formulas, non-finite blocks,
the policy's validation.
"""

from __future__ import annotations

import pytest
import torch

from shardfusion._runtime import gather_wire
from shardfusion.policies import MixedPrecisionPolicy

B = 256


def _shards(g: int, s: int, seed: int = 0) -> list[torch.Tensor]:
    """G shards of S elements whose blocks differ in magnitude by up to 1e6 (weights of different layers)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(g):
        x = torch.randn(s, generator=gen)
        mags = 10.0 ** torch.randint(-6, 1, (-(-s // B),), generator=gen).float()
        out.append((x.view(-1)[:s] * mags.repeat_interleave(B)[:s]).contiguous())
    return out


def _round_trip(shards: list[torch.Tensor], wire) -> torch.Tensor:
    packed = [gather_wire.quantize(x, wire) for x in shards]
    s = shards[0].numel()
    gathered = gather_wire.gather_buffer(s, len(shards), wire, torch.device("cpu"))
    assert gathered.numel() * gathered.element_size() == len(shards) * gather_wire.row_bytes(s, wire, 4)
    gathered.copy_(torch.cat(packed))
    out = torch.empty(len(shards) * s, dtype=torch.float32)
    gather_wire.dequantize_into(gathered, out, len(shards), wire)
    return out


def _absmax_per_element(shards: list[torch.Tensor]) -> torch.Tensor:
    parts = []
    for x in shards:
        a = torch.empty(x.numel(), dtype=torch.float64)
        for k in range(0, x.numel(), B):
            a[k:k + B] = x[k:k + B].double().abs().max()
        parts.append(a)
    return torch.cat(parts)


def _bound(wire, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    ax = x.double().abs()
    if wire == "int8":
        return (1 + 2 ** -14) * a / 254
    if wire is torch.float8_e4m3fn:
        return torch.maximum(ax / 16, a / 458752) + a * 2 ** -20
    if wire is torch.bfloat16:
        return ax * 2 ** -8
    return ax * 2 ** -11 + 2 ** -25


@pytest.mark.parametrize("wire", ["int8", torch.float8_e4m3fn, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("s", [1024, 1000, 7], ids=lambda s: f"S{s}")
def test_round_trip_error_within_bound(wire, s):
    shards = _shards(4, s)
    x = torch.cat(shards)
    err = (_round_trip(shards, wire).double() - x.double()).abs()
    bound = _bound(wire, x, _absmax_per_element(shards))
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= bound).all(), f"{wire}: error {worst:.3f} x the bound"
    assert err.max() > 0, f"{wire}: bitwise exact: was anything quantized?"


def test_bounds_tell_the_formats_apart():
    """int8 on fp8's data errs by more than int8's bound would allow fp8 to, and vice versa for small values."""
    shards = _shards(2, 1024, seed=1)
    x = torch.cat(shards)
    a = _absmax_per_element(shards)
    fp8_err = (_round_trip(shards, torch.float8_e4m3fn).double() - x.double()).abs()
    assert (fp8_err > _bound("int8", x, a)).any(), "fp8's error fits int8's bound: the int8 test could not fail"
    # tiny blocks (1e-6): a cast to e4m3 without the per-block scale would flush them to zero
    tiny = torch.full((B,), 3e-6)
    assert torch.equal(tiny.to(torch.float8_e4m3fn).float(), torch.zeros(B)), "precondition: e4m3 flushes 3e-6"
    back = _round_trip([tiny], torch.float8_e4m3fn)
    assert ((back.double() - tiny.double()).abs() <= _bound(torch.float8_e4m3fn, tiny, tiny.double().abs())).all()


@pytest.mark.parametrize("wire", ["int8", torch.float8_e4m3fn])
def test_non_finite_block_travels_as_nan(wire):
    x = torch.randn(3 * B)
    x[B + 5] = float("inf")
    back = _round_trip([x], wire)
    assert torch.isnan(back[B:2 * B]).all()
    assert torch.isfinite(back[:B]).all() and torch.isfinite(back[2 * B:]).all()


def test_wire_bytes_formula():
    # S = 1000, G = 4: int8 / fp8 row = 1000 + 4 * ceil(1000/256) = 1016; bf16 2000; None in fp32 4000
    assert gather_wire.wire_bytes(1000, 4, "int8", 4) == 3 * 1016
    assert gather_wire.wire_bytes(1000, 4, torch.float8_e4m3fn, 4) == 3 * 1016
    assert gather_wire.wire_bytes(1000, 4, torch.bfloat16, 4) == 3 * 2000
    assert gather_wire.wire_bytes(1000, 4, None, 4) == 3 * 4000
    assert gather_wire.wire_bytes(1000, 1, "int8", 4) == 0


@pytest.mark.parametrize("bad", [torch.float32, torch.int8, "bf16", "fp8", torch.float8_e5m2, 8])
def test_policy_refuses_other_values(bad):
    with pytest.raises(ValueError, match=r"all_gather_dtype must be None, \"int8\", torch.bfloat16, torch.float16 or "
                                         r"torch.float8_e4m3fn, got"):
        MixedPrecisionPolicy(all_gather_dtype=bad)


@pytest.mark.parametrize("ok", [None, "int8", torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_policy_accepts(ok):
    assert MixedPrecisionPolicy(all_gather_dtype=ok).all_gather_dtype == ok
