"""The int8 wire format of a flat buffer's gradient reduce-scatter (``MixedPrecisionPolicy(grad_comm_dtype="int8")``).

[Note: quantized gradient reduce-scatter]
When the sharding group spans nodes, every unit's gradient reduce-scatter crosses the slow link once per backward.
ZeRO++'s qgZ (Wang et al., 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training")
sends the gradients block-quantized to int8. A ring reduce-scatter cannot do that well: each hop adds its piece to
the partial sum it received, so a quantized ring would dequantize, add and requantize ``G-1`` times, and the errors
of the requantizations pile up along the ring. Here each element is quantized once, on the rank that computed it:

1. each rank quantizes its full gradient buffer ``(P,) = (G*S,)`` chunk by chunk, chunk ``j`` (elements
   ``[j*S, (j+1)*S)``, the shard of group rank ``j``) in blocks of ``B = 256`` elements that start at the chunk's
   start (the last block of a chunk may be shorter), one fp32 scale per block (``compress.quantize_int8``'s format:
   scale ``a / 127``, ``a`` the block's max ``|x|``, values rounded to -127..127);
2. one all-to-all over the reduce group moves chunk ``j`` to group rank ``j``, packed as one int8 row of
   ``4 * ceil(S/B) + S`` bytes per chunk ``[scales as bytes | int8 values]`` (as qwZ packs its shards,
   ``gather_wire.py``);
3. each rank dequantizes the ``G`` pieces of its shard (its own piece too: every contribution is treated alike) and
   sums them in fp32, in group-rank order. The flat buffer then divides the sum by ``grad_divisor`` (after the
   sum, in fp32: the fp32 scales cannot overflow, so nothing is divided before) and adds it into the sharded
   gradient, as after the plain reduce-scatter.

Bytes one rank sends: ``(G-1) * (S + 4 * ceil(S/B))`` (:func:`wire_bytes`), about ``(1 + 4/B) / 4`` of fp32's
``(G-1) * 4S``: the same volume as a ring reduce-scatter, each rank sending its ``G-1`` pieces straight to their
owners. The all-to-all is asynchronous; the dequantization and the sum run where the buffer waits for it
(:class:`QuantizedReduce`), on the thread that finishes the reduce-scatter (the overlapped replicate all-reduce's
worker when it is handed off: ``replicate_sync.py``).

Error, per element ``i`` of the reduced shard, before the division: with ``x_r`` rank ``r``'s gradient (what it
reduce-scatters, in fp32), ``y = sum_r x_r`` the exact sum, and ``a_r`` the max ``|x_r|`` over the block of
rank ``r``'s chunk that holds ``i``:

    |sum[i] - y[i]| <= (1 + 2**-14) * sum_r a_r / 254  +  G * 2**-24 * sum_r a_r

half a quantization step of every contribution (``compress.quantize_int8``; blocks of normal scales, ``a_r >=
127 * 2**-126``), plus the fp32 rounding of ``G-1`` additions of terms at most ``a_r`` each. The first term does
not grow with the number of hops, only with the number of contributions. The division by ``grad_divisor`` adds one
fp32 rounding (``2**-24`` relative). A block holding a non-finite value on any rank comes out as NaN in all its
elements of that shard; other blocks are unaffected.

Error feedback (carrying each rank's quantization error into its next step's gradient) is not implemented: it
needs a persistent ``(P,)`` fp32 residual per buffer and rank, a full gradient buffer's size kept alive across
steps, which is what sharding exists to avoid; the error above is unbiased rounding of each element, without
feedback. ZeRO++'s hierarchical variant (fp32 within the node first, int8 across nodes) is not implemented either:
it needs two dependent collectives per reduction (docs/quantized-reduce-scatter.md, "Not done"). Written here from
the paper's description.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed import ProcessGroup

from shardfusion import comm
from shardfusion._runtime import gather_wire
from shardfusion._runtime.compress import DEFAULT_BLOCK_SIZE, INT8, _dequantize_into, _quantize_rows


def is_quantized(grad_comm_dtype: object) -> bool:
    """Whether ``grad_comm_dtype`` is the block-wise int8 wire format (``"int8"``), not a torch dtype."""
    return isinstance(grad_comm_dtype, str) and grad_comm_dtype == INT8


def row_bytes(shard_numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one packed chunk: ``S + 4 * ceil(S / block_size)`` (the int8 values and one fp32 scale per block),
    the row of qwZ's int8 wire format (``gather_wire.row_bytes``)."""
    return gather_wire.row_bytes(shard_numel, INT8, 1, block_size)


def wire_bytes(shard_numel: int, group_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes one rank sends in the quantized reduce-scatter of a ``(G*S,)`` buffer: ``(G-1) *`` :func:`row_bytes`
    (0 for a group of one). Equals the ``"inner_reduce_scatter"`` record's ``wire_bytes``
    (:class:`shardfusion.comm.CommCounter`)."""
    return float((group_size - 1) * row_bytes(shard_numel, block_size))


def quantize_chunks(grad: torch.Tensor, group_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Step 1 of the note: ``grad`` ``(G*S,)`` (fp32, bf16 or fp16; computed in fp32) as the ``(G*row,)`` int8
    tensor whose row ``j`` (``row = 4 * ceil(S/B) + S`` bytes) packs chunk ``j``'s scales (fp32, as bytes) then its
    int8 values. Blocks start at each chunk's start."""
    g, b = group_size, block_size
    s = grad.numel() // g
    nb = -(-s // b)
    if s % b == 0:  # whole blocks: the chunks' blocks are the buffer's blocks
        x = grad.view(g * nb, b)  # (G*nb, B)
    else:
        x = torch.zeros(g, nb * b, dtype=torch.float32, device=grad.device)  # (G, nb*B) each chunk zero-padded
        x[:, :s] = grad.view(g, s)
        x = x.view(g * nb, b)
    q = torch.empty(g * nb, b, dtype=torch.int8, device=grad.device)  # (G*nb, B)
    scales = torch.empty(g * nb, dtype=torch.float32, device=grad.device)  # (G*nb,)
    _quantize_rows(x, q, scales)
    packed = torch.empty(g, 4 * nb + s, dtype=torch.int8, device=grad.device)  # (G, row)
    packed[:, :4 * nb] = scales.view(torch.int8).view(g, 4 * nb)
    packed[:, 4 * nb:] = q.view(g, nb * b)[:, :s]
    return packed.view(-1)


def sum_chunks(received: torch.Tensor, group_size: int, out: torch.Tensor,
               block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Step 3 of the note: dequantize the ``G`` packed pieces of ``received`` (``(G*row,)`` int8, row ``r`` from
    group rank ``r``) and write their fp32 sum, added in group-rank order, into ``out`` ``(S,)`` fp32."""
    g, s, b = group_size, out.numel(), block_size
    nb = -(-s // b)
    rows = received.view(g, 4 * nb + s)
    piece = torch.empty(s, dtype=torch.float32, device=out.device) if g > 1 else None  # (S,)
    for r in range(g):
        scales = rows[r, :4 * nb].clone().view(torch.float32)  # (nb,) a copy: the byte offset may be unaligned
        _dequantize_into(rows[r, 4 * nb:], scales, b, out if r == 0 else piece)
        if r:
            out.add_(piece)


class QuantizedReduce:
    """The work handle of an issued quantized reduce-scatter: :meth:`wait` waits for the all-to-all, then sums the
    received pieces into the output (once); :meth:`is_completed` says whether the all-to-all has completed."""

    def __init__(self, work: Any, send: torch.Tensor, received: torch.Tensor, out: torch.Tensor, group_size: int,
                 block_size: int) -> None:
        self.work, self.send, self.received, self.out = work, send, received, out  # send: alive until the wait
        self.group_size, self.block_size = group_size, block_size

    def wait(self, *args, **kwargs) -> bool:
        """Wait for the all-to-all, then dequantize and sum the pieces into the output (the first call only).
        Returns True."""
        if self.received is not None:
            if self.work is not None:
                self.work.wait(*args, **kwargs)
            with torch.no_grad():
                sum_chunks(self.received, self.group_size, self.out, self.block_size)
            self.send = self.received = self.work = None
        return True

    def is_completed(self) -> bool:
        """Whether the all-to-all has completed (the sum runs in :meth:`wait`)."""
        return self.received is None or self.work is None or self.work.is_completed()


def reduce_scatter(out: torch.Tensor, grad: torch.Tensor, group: Optional[ProcessGroup],
                   block_size: int = DEFAULT_BLOCK_SIZE) -> Optional[QuantizedReduce]:
    """Issue the quantized reduce-scatter of ``grad`` ``(G*S,)`` over ``group`` into ``out`` ``(S,)`` fp32 (the sum,
    not divided): quantize, then the asynchronous all-to-all of the packed pieces (``comm.reduce_scatter_exchange``,
    recorded as this reduce-scatter). Returns the :class:`QuantizedReduce` to wait for; the sum is in ``out`` after
    its ``wait()``. A group of one sends nothing and quantizes nothing: ``out`` gets ``grad`` itself, and None is
    returned. Every rank of the group must call it with the same ``G*S`` and ``block_size``."""
    g = comm.group_size(group)
    if g == 1:
        out.copy_(grad)
        return None
    with torch.no_grad():
        send = quantize_chunks(grad, g, block_size)  # (G*row,) int8
        received = torch.empty_like(send)
        work = comm.reduce_scatter_exchange(received, send, group, async_op=True)
    return QuantizedReduce(work, send, received, out, g, block_size)
