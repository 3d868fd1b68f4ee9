"""The int8 wire format of the quantized gradient reduce-scatter (shardfusion/_runtime/grad_wire.py), locally.

G emulated ranks each quantize their full gradient buffer ``(G*S,)`` with ``quantize_chunks``; the "all-to-all" is
done here by hand (row ``j`` of every rank's packed tensor to rank ``j``, in rank order), so each rank's
``sum_chunks`` sees exactly what it receives after the real all-to-all (tests/distributed/test_grad_comm_int8.py
runs it over gloo). Every element of every reduced shard is checked against the exact float64 sum of the inputs
within the stated bound, computed here from the inputs (``a_r``: max |x| of rank r's block holding the element,
blocks of 256 from the start of each chunk):

    |sum - y| <= (1 + 2**-14) * sum_r a_r / 254 + G * 2**-24 * sum_r a_r

The bound tells the int8 path from the fp32 one: the fp32 sum of the unquantized inputs errs at most
``G * 2**-24 * sum_r |x_r|``, far below, and int8's measured error is above that fp32 bound (checked). Also: the
error does not grow with the number of hops (each element is quantized once: the int8 path's error against the
bound stays the same fraction at G = 2 and G = 8), non-finite blocks, the bytes formula, the policy's validation.
"""

from __future__ import annotations

import pytest
import torch

from shardfusion._runtime import grad_wire
from shardfusion.policies import GRAD_COMM_DTYPE_NAMES, MixedPrecisionPolicy

B = 256


def _inputs(g: int, s: int, seed: int = 0) -> list[torch.Tensor]:
    """G ranks' gradient buffers of G*S elements whose blocks differ in magnitude by up to 1e6."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(g):
        n = g * s
        x = torch.randn(n, generator=gen)
        mags = 10.0 ** torch.randint(-6, 1, (-(-n // 64),), generator=gen).float()
        out.append((x * mags.repeat_interleave(64)[:n]).contiguous())
    return out


def _reduce(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every emulated rank's reduced shard (fp32), through quantize_chunks, a hand-made all-to-all, sum_chunks."""
    g = len(inputs)
    s = inputs[0].numel() // g
    row = grad_wire.row_bytes(s)
    packed = [grad_wire.quantize_chunks(x, g).view(g, row) for x in inputs]
    assert all(p.dtype == torch.int8 and p.numel() == g * row for p in packed)
    out = []
    for j in range(g):
        received = torch.cat([p[j] for p in packed])  # (G*row,) row r from rank r
        shard = torch.empty(s, dtype=torch.float32)
        grad_wire.sum_chunks(received, g, shard)
        out.append(shard)
    return out


def _bound(inputs: list[torch.Tensor], s: int) -> torch.Tensor:
    """The stated bound per element of the whole ``(G*S,)`` buffer, float64."""
    a_sum = torch.zeros(inputs[0].numel(), dtype=torch.float64)
    for x in inputs:
        ax = x.double().abs()
        for start in range(0, x.numel(), s):
            for k in range(start, start + s, B):
                end = min(k + B, start + s)
                a_sum[k:end] += ax[k:end].max()
    return (1 + 2 ** -14) * a_sum / 254 + len(inputs) * 2 ** -24 * a_sum


def _errors(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 error, its bound, the fp32 sum's rounding bound) per element, float64."""
    g = len(inputs)
    s = inputs[0].numel() // g
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    got = torch.cat(_reduce(inputs)).double()
    fp32_bound = g * 2 ** -24 * torch.stack([x.double().abs() for x in inputs]).sum(0)
    return (got - exact).abs(), _bound(inputs, s), fp32_bound


@pytest.mark.parametrize("g, s", [(4, 1024), (4, 700), (2, 256), (8, 37), (3, 1)])
def test_reduced_shards_within_bound(g, s):
    err, bound, _ = _errors(_inputs(g, s))
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= bound).all(), f"G={g} S={s}: error up to {worst:.3f} x the stated bound"
    assert err.max() > 0


def test_bound_tells_int8_from_fp32():
    inputs = _inputs(4, 1024)
    err, bound, fp32_bound = _errors(inputs)
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    fp32 = torch.stack(inputs).sum(0).double()  # the fp32 reduce-scatter's sum, unquantized
    assert ((fp32 - exact).abs() <= fp32_bound).all()
    assert (fp32_bound < bound / 1000).all()  # the fp32 path is three orders of magnitude inside the int8 bound
    assert (err > fp32_bound).float().mean() > 0.5  # and the int8 path is outside the fp32 bound


def test_error_does_not_compound_with_group_size():
    """Each contribution is quantized once: the error relative to the bound (a sum over the contributions, not over
    hops) stays the same fraction as the group grows, as a ring that requantized partial sums would not."""
    ratios = []
    for g in (2, 8):
        err, bound, _ = _errors(_inputs(g, 512, seed=g))
        ratios.append((err.sum() / bound.sum()).item())
    assert all(0.1 < r < 0.5 for r in ratios), ratios  # about 1/4 for uniform rounding errors of random sign


def test_non_finite_block_reduces_to_nan():
    g, s = 4, 512
    inputs = _inputs(g, s)
    inputs[2][s + 3] = float("inf")  # rank 2, chunk 1 (rank 1's shard), its first block
    shards = _reduce(inputs)
    assert torch.isnan(shards[1][:B]).all() and torch.isfinite(shards[1][B:]).all()
    assert all(torch.isfinite(shards[j]).all() for j in (0, 2, 3))


def test_wire_bytes_formula():
    assert grad_wire.row_bytes(256) == 256 + 4
    assert grad_wire.row_bytes(257) == 257 + 8
    assert grad_wire.wire_bytes(1000, 4) == 3 * (1000 + 16)
    assert grad_wire.wire_bytes(1000, 1) == 0.0
    assert grad_wire.quantize_chunks(torch.randn(4 * 1000), 4).numel() == 4 * grad_wire.row_bytes(1000)


def test_group_of_one_is_a_copy():
    x = torch.randn(300)
    out = torch.empty(300)
    assert grad_wire.reduce_scatter(out, x, None) is None
    assert torch.equal(out, x)


@pytest.mark.parametrize("bad", [torch.int8, "int4", "INT8", torch.float64, "fp32", 8])
def test_policy_refuses_other_values(bad):
    with pytest.raises(ValueError, match=r'grad_comm_dtype must be None, torch.float32, torch.bfloat16, '
                                         r'torch.float16 or "int8", got'):
        MixedPrecisionPolicy(grad_comm_dtype=bad)


@pytest.mark.parametrize("ok", [None, torch.float32, torch.bfloat16, torch.float16, "int8"])
def test_policy_accepts(ok):
    assert MixedPrecisionPolicy(grad_comm_dtype=ok).grad_comm_dtype is ok or ok == "int8"
    assert GRAD_COMM_DTYPE_NAMES["int8"] == "int8"
