"""The wire format of a flat buffer's parameter all-gather (``MixedPrecisionPolicy(all_gather_dtype=...)``).

[Note: quantized weight all-gather]
A unit all-gathers its parameters once for the forward and (after ``reshard_policy="after_forward"``) once more for
the backward. When the sharding group spans nodes, these all-gathers cross the slow link. The idea of ZeRO++'s qwZ
(Wang et al., 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training") is to send the
weights quantized: each rank quantizes *its own shard* once per gather, the ranks all-gather the quantized shards,
and every rank dequantizes all of them (its own too, so that every rank computes with bitwise the same full
parameters) into the full buffer in ``param_dtype``. The shard itself, the gradients (the reduce-scatter), the
optimizer state and checkpoints stay exact; only the gathered copy the forward and backward compute with carries the
quantization error. Written here from the paper's description.

Wire formats (``S`` = shard elements, ``B`` = block size, ``nb = ceil(S / B)``), bytes one rank sends per gather
over a group of ``G`` ranks, ``(G-1) * row`` with the per-rank ``row``:

- ``None``: the shard cast to ``param_dtype`` (today's all-gather): ``row = S * element_size(param_dtype)``.
- ``torch.bfloat16`` / ``torch.float16``: the shard cast (round to nearest): ``row = 2S``. Error per element: at
  most ``|x| * 2**-8`` (bf16) / ``|x| * 2**-11 + 2**-25`` (fp16, below its 65504; beyond, inf).
- ``"int8"``: block-wise symmetric int8 with one fp32 scale per block of the shard (the outer all-reduce's format,
  :func:`shardfusion._runtime.compress.quantize_int8`): ``row = S + 4 * nb``, about ``(1 + 4/B) / 4`` of fp32.
  Error per element of a block with ``a = max |x|``: at most ``(1 + 2**-14) * a / 254`` (half a step ``a / 127``).
- ``torch.float8_e4m3fn``: per block a fp32 scale ``s = a / 448`` (448: e4m3's largest value) and the values
  ``x / s`` cast to e4m3 (3 mantissa bits): ``row = S + 4 * nb``, as int8. Error per element: at most
  ``max(|x| / 16, a / 458752) + a * 2**-20`` (half an e4m3 step relative to the value, ``2**-10 * s`` in e4m3's
  subnormal range, plus fp32 rounding of the division and the product).

A block holding a non-finite value travels as NaN in all its elements (both block formats), as in the outer
all-reduce's int8. A group of one sends nothing: the full buffer is the shard cast to ``param_dtype``, unquantized.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from shardfusion._runtime.compress import DEFAULT_BLOCK_SIZE, INT8, _dequantize_into, _quantize_into

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite magnitude of ``torch.float8_e4m3fn`` (it has no inf: values beyond become NaN)."""

AllGatherDtype = Optional[Union[str, torch.dtype]]


def is_blockwise(wire: AllGatherDtype) -> bool:
    """Whether ``wire`` travels as one byte per element plus one fp32 scale per block (``"int8"``, fp8)."""
    return wire is FP8 or (isinstance(wire, str) and wire == INT8)


def row_bytes(shard_numel: int, wire: AllGatherDtype, element_size: int,
              block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one rank's shard on the wire: ``S * element_size`` for ``None`` (``element_size``: of
    ``param_dtype``), ``2S`` for bf16/fp16, ``S + 4 * ceil(S / block_size)`` for int8 and fp8."""
    if wire is None:
        return shard_numel * element_size
    if is_blockwise(wire):
        return shard_numel + 4 * -(-shard_numel // block_size)
    return shard_numel * torch.empty(0, dtype=wire).element_size()


def wire_bytes(shard_numel: int, group_size: int, wire: AllGatherDtype, element_size: int,
               block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes one rank sends in the all-gather of ``group_size`` shards of ``shard_numel`` elements: ``(G-1) *``
    :func:`row_bytes` (the ring all-gather; 0 for a group of one). Equals the ``"inner_all_gather"`` records'
    ``wire_bytes`` of a :class:`shardfusion.comm.CommCounter`."""
    return float((group_size - 1) * row_bytes(shard_numel, wire, element_size, block_size))


def _quantize_fp8_into(x: torch.Tensor, block_size: int, values: torch.Tensor, scales: torch.Tensor) -> None:
    """``x`` ``(L,)`` into ``values`` ``(L,)`` e4m3 and ``scales`` ``(ceil(L/B),)`` fp32 (see the module's note)."""
    n, b = x.numel(), block_size
    nb = -(-n // b)
    xp = torch.zeros(nb * b, dtype=torch.float32, device=x.device)  # (nb*B,) zero-padded to whole blocks
    xp[:n] = x
    rows = xp.view(nb, b)
    lo, hi = torch.aminmax(rows, dim=1)
    scale = torch.maximum(hi, -lo) / FP8_MAX  # NaN or inf for a block with a non-finite value
    finite = torch.isfinite(scale)
    scale = torch.where(finite, scale, torch.full_like(scale, math.nan))
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    rows.div_(safe[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    rows.masked_fill_(~finite[:, None], 0)
    values.copy_(xp[:n])  # the cast rounds to nearest (even)
    scales.copy_(scale)


def _dequantize_fp8_into(values: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """``out[i] = float(values[i]) * scales[i // B]`` for ``values`` ``(L,)`` e4m3, ``out`` ``(L,)`` fp32."""
    n, b = values.numel(), block_size
    full = n // b
    if full:
        torch.mul(values[:full * b].view(full, b).float(), scales[:full, None], out=out[:full * b].view(full, b))
    if n > full * b:
        torch.mul(values[full * b:].float(), scales[full], out=out[full * b:])


def quantize(x: torch.Tensor, wire: AllGatherDtype, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """One rank's shard ``x`` ``(S,)`` as it travels: for the block formats one int8 tensor ``(4*nb + S,)``
    packing ``[scales as bytes | values as bytes]``; for bf16/fp16 ``x`` cast, ``(S,)``. Not for ``None``."""
    if not is_blockwise(wire):
        return x.to(wire)
    n = x.numel()
    nb = -(-n // block_size)
    packed = torch.empty(4 * nb + n, dtype=torch.int8, device=x.device)  # (4*nb + S,)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if wire is FP8:
        values = torch.empty(n, dtype=FP8, device=x.device)
        _quantize_fp8_into(x, block_size, values, scales)
        packed[4 * nb:] = values.view(torch.int8)
    else:
        _quantize_into(x, block_size, packed[4 * nb:], scales)
    packed[:4 * nb] = scales.view(torch.int8)
    return packed


def dequantize_into(gathered: torch.Tensor, out: torch.Tensor, group_size: int, wire: AllGatherDtype,
                    block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Write the ``group_size`` gathered shards (as :func:`quantize` made them, concatenated in group-rank order)
    into ``out`` ``(G*S,)`` (``param_dtype``), dequantized."""
    if not is_blockwise(wire):
        out.copy_(gathered)
        return
    s = out.numel() // group_size
    nb = -(-s // block_size)
    rows = gathered.view(group_size, 4 * nb + s)
    dense = out if out.dtype == torch.float32 else torch.empty(s, dtype=torch.float32, device=out.device)
    for r in range(group_size):
        scales = rows[r, :4 * nb].clone().view(torch.float32)  # (nb,) a copy: the byte offset may be unaligned
        piece = dense[r * s:(r + 1) * s] if dense is out else dense
        if wire is FP8:
            _dequantize_fp8_into(rows[r, 4 * nb:].view(FP8), scales, block_size, piece)
        else:
            _dequantize_into(rows[r, 4 * nb:], scales, block_size, piece)
        if dense is not out:
            out[r * s:(r + 1) * s].copy_(piece)


def gather_buffer(shard_numel: int, group_size: int, wire: AllGatherDtype, device: torch.device,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """The receive buffer of the all-gather: ``(G * row,)`` int8 for the block formats, ``(G*S,)`` of ``wire``
    for bf16/fp16."""
    if is_blockwise(wire):
        return torch.empty(group_size * row_bytes(shard_numel, wire, 1, block_size), dtype=torch.int8, device=device)
    return torch.empty(group_size * shard_numel, dtype=wire, device=device)
