"""Block-wise int8 quantization and the local parts of the compressed all-reduce (shardfusion/_runtime/compress.py).

Known tensors: values on a power-of-two grid come back exactly; values a known fraction of a step off the grid come
back off by exactly that fraction; random blocks of very different magnitudes stay within half a step of their own
block (up to fp32 rounding, the stated (1 + 2**-14) factor), with the step computed here from the input (max |x| of
the block / 127), not read from the implementation. Zero blocks, odd lengths and non-finite values; the argument
checks; the bytes formula on hand-computed values. The distributed results: tests/distributed/test_compress.py.
(This file's name differs from that one: test basenames must be unique across the test folders, see conftest.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from shardfusion._runtime.compress import (
    DEFAULT_BLOCK_SIZE,
    compressed_all_reduce,
    dequantize_int8,
    quantize_int8,
    validate_outer_comm_dtype,
    wire_bytes,
)
from shardfusion.comm import CommCounter

SLACK = 1 + 2 ** -14  # fp32 rounding of the scale, the division and the product


def _block_absmax(x: torch.Tensor, b: int) -> torch.Tensor:
    """max |x| of each element's block, per element, in float64 (computed here, independently)."""
    x = x.double()
    out = torch.empty_like(x)
    for k in range(0, x.numel(), b):
        out[k:k + b] = x[k:k + b].abs().max()
    return out


def test_validate_outer_comm_dtype_accepts_and_normalizes():
    for value, expected in [(None, None), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.float16, torch.float16), ("int8", "int8"), ("bf16", torch.bfloat16),
                            ("bfloat16", torch.bfloat16), ("fp16", torch.float16), ("float16", torch.float16),
                            ("fp32", torch.float32), ("float32", torch.float32)]:
        assert validate_outer_comm_dtype(value) == expected, value


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, "int4", "BF16", "", 8, True, object()])
def test_validate_outer_comm_dtype_refuses(bad):
    with pytest.raises(ValueError, match=r"outer_comm_dtype must be one of None, torch\.float32, torch\.bfloat16, "
                                         r"torch\.float16, \"int8\""):
        validate_outer_comm_dtype(bad)


def test_values_on_the_grid_come_back_exactly():
    s = 2.0 ** -7  # a power of two: a = 127 s, a / 127 and every k * s are exact in fp32
    k = torch.arange(-127, 128, dtype=torch.float32)  # 255 values, +-127 included
    x = torch.cat([k * s, k.flip(0) * s * 8]).contiguous()  # two blocks of 255, steps s and 8 s
    q, scales = quantize_int8(x, 255)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (2,)
    assert scales.tolist() == [s, 8 * s]
    assert q.tolist() == k.tolist() + k.flip(0).tolist()
    assert torch.equal(dequantize_int8(q, scales, 255), x)


def test_off_grid_error_is_the_known_fraction_of_a_step():
    s, off = 2.0 ** -5, 0.5 - 2 ** -6  # just under half a step: rounds towards k
    gen = torch.Generator().manual_seed(0)
    k = torch.randint(-126, 126, (3 * 64,), generator=gen).float()
    x = (k + off) * s
    x[::64] = 127 * s  # one element at the block's absmax: the step is exactly s in every block
    d = dequantize_int8(*quantize_int8(x, 64), 64)
    err = (d.double() - x.double()).abs()
    expected = torch.full_like(err, off * s)
    expected[::64] = 0
    assert torch.equal(err, expected)


def test_random_blocks_within_half_a_step_of_their_own_block():
    gen = torch.Generator().manual_seed(1)
    b = 128
    n_blocks = 9
    mags = 10.0 ** torch.arange(-4, 5, dtype=torch.float32)  # each block its own magnitude: 1e-4 .. 1e4
    x = (torch.randn(n_blocks, b, generator=gen) * mags[:, None]).reshape(-1)[:-5].contiguous()  # odd tail
    q, scales = quantize_int8(x, b)
    a = _block_absmax(x, b)
    assert torch.allclose(scales.double() * 127, a[::b], rtol=2 ** -22, atol=0)
    err = (dequantize_int8(q, scales, b).double() - x.double()).abs()
    bound = SLACK * a / 254
    assert (err <= bound).all(), (err / bound).max()
    assert (err / bound).max() > 0.9  # the bound is the real step, not a loose one
    # relative to its own block: a small block next to a large one keeps its precision
    assert (err[:b] <= 1e-4 * 10 / 254).all()


def test_zero_blocks_and_all_zero():
    b = 16
    x = torch.randn(5 * b, generator=torch.Generator().manual_seed(2))
    x[b:2 * b] = 0
    x[4 * b:] = 0
    q, scales = quantize_int8(x, b)
    assert scales[1] == 0 and scales[4] == 0
    assert (q[b:2 * b] == 0).all()
    d = dequantize_int8(q, scales, b)
    assert (d[b:2 * b] == 0).all() and (d[4 * b:] == 0).all() and torch.isfinite(d).all()
    q, scales = quantize_int8(torch.zeros(100), b)
    assert (q == 0).all() and (scales == 0).all()
    assert torch.equal(dequantize_int8(q, scales, b), torch.zeros(100))


@pytest.mark.parametrize("length", [0, 1, 6, 7, 255, 257, 1000])
@pytest.mark.parametrize("b", [1, 7, 256])
def test_odd_lengths(length, b):
    x = torch.randn(length, generator=torch.Generator().manual_seed(length)) * 3
    q, scales = quantize_int8(x, b)
    assert q.shape == (length,) and scales.shape == (math.ceil(length / b),)
    d = dequantize_int8(q, scales, b)
    assert d.shape == (length,) and d.dtype == torch.float32
    assert ((d.double() - x.double()).abs() <= SLACK * _block_absmax(x, b) / 254).all()


def test_bf16_and_fp16_inputs_quantized_in_fp32():
    x = torch.randn(300, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.bfloat16, torch.float16):
        xl = x.to(dtype)
        d = dequantize_int8(*quantize_int8(xl, 64), 64)
        assert ((d.double() - xl.double()).abs() <= SLACK * _block_absmax(xl, 64) / 254).all()


def test_non_finite_blocks_become_nan_others_unaffected():
    b = 8
    x = torch.randn(6 * b, generator=torch.Generator().manual_seed(4))
    x[3] = math.inf
    x[2 * b + 1] = -math.inf
    x[4 * b + 7] = math.nan
    q, scales = quantize_int8(x, b)
    bad = [0, 2, 4]
    assert all(math.isnan(scales[k]) for k in bad) and torch.isfinite(scales[[1, 3, 5]]).all()
    for k in bad:
        assert (q[k * b:(k + 1) * b] == 0).all()  # nothing undefined reached the int8 conversion
    d = dequantize_int8(q, scales, b)
    for k in range(6):
        block = d[k * b:(k + 1) * b]
        if k in bad:
            assert block.isnan().all()
        else:
            xs = x[k * b:(k + 1) * b].double()
            assert ((block.double() - xs).abs() <= SLACK * xs.abs().max() / 254).all()


def test_bad_arguments():
    x = torch.randn(10)
    for bad_x in (torch.randn(2, 5), torch.arange(10), torch.randn(10, dtype=torch.float64), torch.randn(20)[::2],
                  [1.0, 2.0]):
        with pytest.raises(ValueError, match="x must be a contiguous 1-D tensor"):
            quantize_int8(bad_x, 4)
    for bad_b in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="block_size must be an int >= 1"):
            quantize_int8(x, bad_b)
    q, scales = quantize_int8(x, 4)
    with pytest.raises(ValueError, match=r"scales must have ceil\(L / block_size\) = ceil\(10 / 4\) = 3 elements"):
        dequantize_int8(q, scales[:2], 4)
    with pytest.raises(ValueError, match="q must be"):
        dequantize_int8(q.float(), scales, 4)
    with pytest.raises(ValueError, match="out must have L = 10 elements"):
        dequantize_int8(q, scales, 4, out=torch.empty(9))


def test_group_of_one_is_a_no_op_and_bad_arguments_raise():
    x = torch.randn(1000)
    for dtype in (None, torch.bfloat16, torch.float16, "int8"):
        t = x.clone()
        with CommCounter() as counter:
            compressed_all_reduce(t, None, dtype)
        assert torch.equal(t, x) and counter.records == []
    with pytest.raises(ValueError, match="outer_comm_dtype must be one of"):
        compressed_all_reduce(x.clone(), None, torch.int8)
    with pytest.raises(ValueError, match="tensor must be a contiguous 1-D tensor"):
        compressed_all_reduce(torch.randn(4, 4), None, "int8")
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        compressed_all_reduce(x.clone(), None, "int8", block_size=0)
    with pytest.raises(ValueError, match="category must be None or one of"):
        compressed_all_reduce(x.clone(), None, "int8", category="replicate")


def test_wire_bytes_formula_by_hand():
    # int8: chunk C = ceil(S / (n B)) * B, each of the two collectives sends n-1 chunks of C + 4 C / B bytes
    assert wire_bytes(1024, 2, "int8", block_size=256) == 2 * 1 * (512 + 4 * 2)
    assert wire_bytes(1000, 4, "int8", block_size=256) == 2 * 3 * (256 + 4)
    assert wire_bytes(1, 4, "int8", block_size=256) == 2 * 3 * (256 + 4)  # a tiny tensor pays a block per rank
    assert wire_bytes(3000, 3, "int8", block_size=100) == 2 * 2 * (1000 + 40)
    assert wire_bytes(1024, 2, None) == 4096 and wire_bytes(1024, 2, torch.float32) == 4096
    assert wire_bytes(1024, 4, "bf16") == 2 * 3 / 4 * 1024 * 2 and wire_bytes(1024, 4, torch.float16) == 3072
    assert wire_bytes(1024, 1, "int8") == 0
    s, n = 1 << 20, 8
    assert wire_bytes(s, n, "int8") / wire_bytes(s, n, None) == pytest.approx((1 + 4 / DEFAULT_BLOCK_SIZE) / 4)
