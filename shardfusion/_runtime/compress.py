"""Compressed all-reduce for the replicate (outer, cross-node) gradient all-reduce of HSDP.

[Note: compressed all-reduce]
HSDP sends only the replicate all-reduce across nodes, so that is the one collective worth compressing. Three wire
formats (``outer_comm_dtype``):

- ``torch.bfloat16`` / ``torch.float16``: cast, all-reduce in that dtype, cast back. Half the bytes of fp32. The
  backend adds in the wire dtype, so the rounding error grows with the number of additions (ranks).
- ``"int8"``: block-wise symmetric int8 with one fp32 scale per block of ``block_size`` elements, reduced in fp32:

  1. every rank quantizes its whole input (blocks of the flat tensor: block ``k`` is elements ``[k*B, (k+1)*B)``)
     and sends chunk ``j`` (its int8 values and their scales) to group rank ``j`` with one all-to-all: a
     reduce-scatter whose pieces travel quantized;
  2. rank ``j`` dequantizes the ``n`` pieces of its chunk and adds them in fp32, in group-rank order;
  3. it quantizes the reduced chunk once more, and one all-gather of the int8 chunks and their scales brings every
     rank all of them; every rank dequantizes all chunks (its own too, so that the replicas stay bitwise equal).

  Each element is quantized twice, once on the way in (on every rank) and once on the way out, however many ranks
  the group has: the error does not compound over hops, as it would if a ring requantized each partial sum. This is
  the scheme of ZeRO++'s quantized gradient reduction (qgZ: all-to-all of quantized pieces, reduction at full
  precision, requantization) and of torchft's quantized all-reduce; written here from that description.

Bytes one rank sends for ``S`` elements over a group of ``n``: fp32 ``2(n-1)/n * 4S``; bf16/fp16 ``2(n-1)/n * 2S``;
int8 ``2(n-1) * C * (1 + 4/B)`` with the chunk ``C = ceil(S / (n*B)) * B`` elements (``S`` padded to whole blocks
per rank): about ``(1 + 4/B) / 4`` of fp32 (0.254 for the default ``B = 256``). :func:`wire_bytes` computes them.

Error feedback is not implemented: see docs/compressed-all-reduce.md ("Error feedback") for why and what it takes.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch.distributed import ProcessGroup

from shardfusion import accounting, comm
from shardfusion.policies import MIXED_PRECISION_DTYPES, dtype_named, dtype_names

DEFAULT_BLOCK_SIZE = 256
"""Elements per int8 block (one fp32 scale each: 4/256 = 1.6% of the int8 payload)."""

QMAX = 127
"""The largest int8 magnitude used: the grid is symmetric, -127..127 (-128 is never produced)."""

OUTER_COMM_DTYPES = ("None", "torch.float32", "torch.bfloat16", "torch.float16", '"int8"')
"""The accepted values of ``outer_comm_dtype``, as written in error messages (plus the names of
``policies.dtype_names`` and ``"int8"``)."""

INT8 = "int8"
"""The block-wise int8 wire format (not a torch dtype: see the module's note)."""

OuterCommDtype = Optional[Union[torch.dtype, str]]


def validate_outer_comm_dtype(value: object) -> OuterCommDtype:
    """``value`` as a wire format of the replicate all-reduce: None, a torch dtype or ``"int8"``.

    Accepted: ``None`` (no cast: the gradients travel in their own dtype, i.e. ``grad_comm_dtype``),
    ``torch.float32``, ``torch.bfloat16``, ``torch.float16``, ``"int8"`` (block-wise int8, see
    :func:`compressed_all_reduce`), and the strings ``"fp32"``/``"float32"``, ``"bf16"``/``"bfloat16"``,
    ``"fp16"``/``"float16"`` (lower case), which become the torch dtype. ``torch.int8`` is refused: an all-reduce
    of raw int8 would overflow; the block-quantized scheme is ``"int8"``.

    Returns:
        None, ``torch.float32``, ``torch.bfloat16``, ``torch.float16`` or ``"int8"``.

    Raises:
        ValueError: anything else; the message names ``outer_comm_dtype``, the value and the valid values.
    """
    if value is None or value in MIXED_PRECISION_DTYPES or value == INT8:
        return value
    if isinstance(value, str) and value in dtype_names():
        return dtype_named(value)
    raise ValueError(f"outer_comm_dtype must be one of {', '.join(OUTER_COMM_DTYPES)} (or one of the names "
                     f"{', '.join(repr(n) for n in (*dtype_names(), INT8))}), got {value!r}")


def _check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (elements per int8 block), got {block_size!r}")
    return block_size


def _quantize_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize the rows (blocks) of ``x`` ``(m, B)`` into ``q`` ``(m, B)`` int8 and ``scales`` ``(m,)`` fp32."""
    x = x.float()
    lo, hi = torch.aminmax(x, dim=1)
    scale = torch.maximum(hi, -lo) / QMAX  # NaN or inf for a block with a non-finite value (aminmax keeps NaN)
    finite = torch.isfinite(scale)
    scale = torch.where(finite, scale, torch.full_like(scale, math.nan))
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))  # zero and non-finite blocks: divide by 1
    t = x / safe[:, None]
    t.round_().clamp_(-QMAX, QMAX)  # round half to even; |x / scale| <= 127 up to rounding, so clamp only tidies
    t.masked_fill_(~finite[:, None], 0)  # no NaN reaches the int8 conversion (undefined); the NaN scale marks it
    q.copy_(t)
    scales.copy_(scale)


def _quantize_into(x: torch.Tensor, block_size: int, q: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`quantize_int8` of ``x`` ``(L,)`` into ``q`` ``(L,)`` int8 and ``scales`` ``(ceil(L/B),)`` fp32."""
    n, b = x.numel(), block_size
    full = n // b
    if full:
        _quantize_rows(x[:full * b].view(full, b), q[:full * b].view(full, b), scales[:full])
    tail = n - full * b
    if tail:  # a partial last block: zero-padded to a whole one (zeros do not change its absmax)
        xt = torch.zeros(b, dtype=torch.float32, device=x.device)
        xt[:tail] = x[full * b:]
        qt = torch.empty(b, dtype=torch.int8, device=x.device)
        _quantize_rows(xt.view(1, b), qt.view(1, b), scales[full:])
        q[full * b:] = qt[:tail]


def _dequantize_into(q: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """``out[i] = q[i] * scales[i // B]`` (fp32) for ``q`` ``(L,)``, ``out`` ``(L,)`` fp32."""
    n, b = q.numel(), block_size
    full = n // b
    if full:
        torch.mul(q[:full * b].view(full, b).float(), scales[:full, None], out=out[:full * b].view(full, b))
    if n > full * b:
        torch.mul(q[full * b:].float(), scales[full], out=out[full * b:])


def _check_flat(x: torch.Tensor, name: str, dtypes: tuple) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in dtypes or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor of dtype {' / '.join(str(d) for d in dtypes)}, got "
                         + (f"shape {tuple(x.shape)}, dtype {x.dtype}, contiguous {x.is_contiguous()}"
                            if isinstance(x, torch.Tensor) else repr(type(x))))


def quantize_int8(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric int8 quantization of a flat tensor: one fp32 scale per block of ``block_size``.

    Block ``k`` is ``x[k*B:(k+1)*B]`` (the last one may be shorter). Its scale is ``s = a / 127`` with ``a =
    max |x|`` over the block (fp32), and ``q[i] = round(x[i] / s)`` (half to even), in -127..127. A block of zeros
    gets ``s = 0`` and ``q = 0`` (dequantized exactly). A block holding a non-finite value (inf or NaN) gets
    ``s = NaN`` and ``q = 0``: it dequantizes to NaN in every element, so non-finite gradients stay non-finite (the
    non-finite checks of clipping, a loss scaler or the user see them; an inf comes back as NaN).

    Error (see :func:`dequantize_int8`): ``|dequantize(q, s)[i] - x[i]| <= (1 + 2**-14) * a / 254``, half a step
    ``s / 2`` up to fp32 rounding, for blocks with ``a >= 127 * 2**-126`` (a normal scale); a block with a smaller
    ``a`` errs by at most ``a``.

    Args:
        x: ``(L,)`` contiguous, float32 / bfloat16 / float16 (computed in fp32), on any device; ``L >= 0``.
        block_size: elements per block, an int >= 1.

    Returns:
        ``(q, scales)``: ``q`` ``(L,)`` int8 and ``scales`` ``(ceil(L / block_size),)`` float32, on ``x.device``.

    Raises:
        ValueError: ``x`` is not a contiguous 1-D float32/bfloat16/float16 tensor; ``block_size`` is not an int >= 1.
    """
    _check_flat(x, "x", MIXED_PRECISION_DTYPES)
    b = _check_block_size(block_size)
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    scales = torch.empty(-(-x.numel() // b), dtype=torch.float32, device=x.device)
    with torch.no_grad():
        _quantize_into(x, b, q, scales)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of :func:`quantize_int8`: ``out[i] = q[i] * scales[i // block_size]`` in fp32.

    Args:
        q: ``(L,)`` contiguous int8.
        scales: ``(ceil(L / block_size),)`` contiguous float32 on ``q.device`` (a NaN scale gives NaN elements).
        block_size: the one ``q`` was quantized with, an int >= 1.
        out: optional ``(L,)`` contiguous float32 on ``q.device`` to write into.

    Returns:
        ``out``, or a new ``(L,)`` float32 tensor on ``q.device``.

    Raises:
        ValueError: a tensor of the wrong dtype, shape or layout; ``scales`` not of ``ceil(L / block_size)``
            elements; ``block_size`` not an int >= 1.
    """
    _check_flat(q, "q", (torch.int8,))
    _check_flat(scales, "scales", (torch.float32,))
    b = _check_block_size(block_size)
    if scales.numel() != -(-q.numel() // b):
        raise ValueError(f"scales must have ceil(L / block_size) = ceil({q.numel()} / {b}) = "
                         f"{-(-q.numel() // b)} elements, got {scales.numel()}")
    if out is None:
        out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    else:
        _check_flat(out, "out", (torch.float32,))
        if out.numel() != q.numel():
            raise ValueError(f"out must have L = {q.numel()} elements, got {out.numel()}")
    with torch.no_grad():
        _dequantize_into(q, scales, b, out)
    return out


def _int8_chunk(numel: int, size: int, block_size: int) -> int:
    """Elements of each rank's chunk: ``numel`` padded to whole blocks on every rank, split ``size`` ways."""
    return -(-numel // (size * block_size)) * block_size


def wire_bytes(numel: int, group_size: int, comm_dtype: OuterCommDtype, element_size: int = 4, *,
               block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes one rank sends for :func:`compressed_all_reduce` of ``numel`` elements over ``group_size`` ranks.

    ``comm_dtype`` None means the tensor's own dtype, of ``element_size`` bytes. Float formats: the ring all-reduce,
    ``2(n-1)/n * numel * element_size``. ``"int8"``: the all-to-all and the all-gather each send ``n-1`` chunks of
    ``C`` int8 values and ``C / B`` fp32 scales, ``2(n-1) * C * (1 + 4/B)`` with ``C = ceil(numel / (n*B)) * B``.
    A group of one: 0. These equal the records' ``wire_bytes`` (docs/accounting.md).

    Raises:
        ValueError: a bad ``comm_dtype`` (see :func:`validate_outer_comm_dtype`) or ``block_size``; ``numel`` or
            ``group_size`` not an int (>= 0, >= 1).
    """
    comm_dtype = validate_outer_comm_dtype(comm_dtype)
    b = _check_block_size(block_size)
    for name, v, least in (("numel", numel, 0), ("group_size", group_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
    n = group_size
    if n == 1 or numel == 0:
        return 0.0
    if comm_dtype == INT8:
        c = _int8_chunk(numel, n, b)
        return float(2 * (n - 1) * (c + 4 * (c // b)))
    esize = element_size if comm_dtype is None else torch.empty(0, dtype=comm_dtype).element_size()
    return 2 * (n - 1) / n * numel * esize


def compressed_all_reduce(tensor: torch.Tensor, group: Optional[ProcessGroup], comm_dtype: OuterCommDtype, *,
                          block_size: int = DEFAULT_BLOCK_SIZE, category: Optional[str] = None) -> None:
    """Sum ``tensor`` over ``group`` in place, sending it in ``comm_dtype`` (see [Note: compressed all-reduce]).

    Blocking; every rank of the group must call it with the same length, ``comm_dtype`` and ``block_size``. A group
    of one (or ``None``) issues nothing and leaves ``tensor`` as it is. The result is bitwise the same on every rank
    of the group. Collectives go through ``shardfusion.comm``, so a ``CommCounter`` records the bytes that travel:
    float formats one ``"all_reduce"`` of the cast tensor; ``"int8"`` one ``"all_to_all"`` and one ``"all_gather"``
    of int8 values and fp32 scales packed in one int8 tensor (``numel`` of the records: bytes). All are recorded
    under ``category``, by default the category of an all-reduce on ``group`` (``"replicate_all_reduce"`` on a
    replicate group), so that the compressed all-reduce is counted as the all-reduce it stands for.
    Tensors are made on ``tensor.device`` (CPU with gloo, CUDA with NCCL); peak extra memory for ``"int8"``: about
    ``4S`` bytes of fp32 temporaries while quantizing, ``8S/n`` for the reduction, about ``2S`` bytes of int8
    buffers at a time.

    ``comm_dtype``:
        - None, or the tensor's dtype: a plain all-reduce (exact up to the backend's additions).
        - ``torch.float32`` / ``torch.bfloat16`` / ``torch.float16``: cast, all-reduce in that dtype, cast back.
          Per element, with ``u = 2**-8`` (bf16) / ``2**-11`` (fp16) / ``2**-24`` (fp32) and ``n`` ranks:
          ``|result - exact| <= g * sum_r |x_r|`` with ``g = n*u / (1 - n*u)`` (one rounding of each input and at
          most ``n-1`` rounded additions, in whatever order the backend adds), when nothing overflows (fp16:
          ``|values|`` and partial sums below 65504; beyond, inf) or falls below the normal range (fp16 below
          ``2**-14`` adds at most ``n * 2**-25`` absolute). Non-finite values propagate as the backend adds them.
        - ``"int8"``: blocks of ``B = block_size`` elements of the flat tensor (block ``k``: ``[k*B, (k+1)*B)``).
          For element ``i`` of block ``k``, with ``a_r`` the max ``|x|`` of rank ``r``'s input over block ``k``,
          ``y`` the exact sum of the inputs and ``y~`` the fp32 sum of the dequantized inputs (what is requantized),
          ``a' = max |y~|`` over block ``k``:

              |result[i] - y[i]| <= (1 + 2**-14) * (sum_r a_r + a') / 254  +  n * 2**-24 * sum_r a_r

          that is, half the input step ``a_r / 127`` of every rank, plus half the output step ``a' / 127``, plus
          fp32 rounding of the additions; and ``a' <= max |y| + (1 + 2**-14) * sum_r a_r / 254 + n * 2**-24 *
          sum_r a_r`` over the block (for blocks of normal scales, see :func:`quantize_int8`). A block holding a
          non-finite value on any rank comes out as NaN in all its elements, on every rank; the other blocks are
          unaffected.

    Args:
        tensor: ``(S,)`` contiguous float32 (bfloat16 / float16 also accepted: ``"int8"`` then reduces in fp32 and
            casts the result back), any ``S >= 0``; overwritten with the sum.
        group: the process group (gloo or NCCL), or None (a local no-op).
        comm_dtype: the wire format, validated by :func:`validate_outer_comm_dtype` (strings such as ``"bf16"``
            accepted).
        block_size: elements per int8 block (``"int8"`` only), an int >= 1; every rank must pass the same.
        category: accounting category of the records (one of ``accounting.CATEGORIES``), None for the default.

    Raises:
        ValueError: a bad ``comm_dtype`` (the message names ``outer_comm_dtype``), ``block_size`` or ``category``;
            ``tensor`` not a contiguous 1-D float32/bfloat16/float16 tensor. Raised before any collective, on every
            rank that passes the bad value.
    """
    comm_dtype = validate_outer_comm_dtype(comm_dtype)
    b = _check_block_size(block_size)
    _check_flat(tensor, "tensor", MIXED_PRECISION_DTYPES)
    if category is not None and category not in accounting.CATEGORIES:
        raise ValueError(f"category must be None or one of {accounting.CATEGORIES}, got {category!r}")
    n = comm.group_size(group)
    if n == 1 or tensor.numel() == 0:
        return
    if category is None:
        category = accounting.category("all_reduce", comm.group_kinds(group))
    with torch.no_grad():
        if comm_dtype is None or comm_dtype == tensor.dtype:
            comm.all_reduce(tensor, group, category=category)
        elif comm_dtype != INT8:
            buf = tensor.to(comm_dtype)
            comm.all_reduce(buf, group, category=category)
            tensor.copy_(buf)
        else:
            _int8_all_reduce(tensor, group, n, b, category)


def _int8_all_reduce(tensor: torch.Tensor, group: ProcessGroup, n: int, b: int, category: str) -> None:
    """The ``"int8"`` path of :func:`compressed_all_reduce` (``n > 1``, ``S > 0``)."""
    s, dev = tensor.numel(), tensor.device
    c = _int8_chunk(s, n, b)  # elements per chunk, whole blocks
    nb = c // b  # scales per chunk
    row = 4 * nb + c  # bytes per packed chunk: [scales as bytes | int8 values]

    # 1. quantize the whole input; chunk j (scales and values) goes to group rank j
    q = torch.zeros(n * c, dtype=torch.int8, device=dev)  # padding: zeros (q 0, scale 0) past S
    scales = torch.zeros(n * nb, dtype=torch.float32, device=dev)
    _quantize_into(tensor, b, q[:s], scales[:-(-s // b)])
    send = torch.cat([scales.view(torch.int8).view(n, 4 * nb), q.view(n, c)], dim=1)  # (n, row)
    del q, scales
    recv = torch.empty_like(send)
    comm.all_to_all_equal(recv.view(-1), send.view(-1), group, category=category)
    del send

    # 2. dequantize the n pieces of this rank's chunk and add them in fp32, in group-rank order
    acc = torch.empty(c, dtype=torch.float32, device=dev)
    piece = torch.empty(c, dtype=torch.float32, device=dev)
    for r in range(n):
        _dequantize_into(recv[r, 4 * nb:], recv[r, :4 * nb].clone().view(torch.float32), b, acc if r == 0 else piece)
        if r:
            acc += piece
    del recv, piece

    # 3. requantize the reduced chunk; all-gather every rank's; dequantize all of them (this rank's too)
    mine = torch.empty(row, dtype=torch.int8, device=dev)
    mine_scales = torch.empty(nb, dtype=torch.float32, device=dev)
    _quantize_into(acc, b, mine[4 * nb:], mine_scales)
    mine[:4 * nb] = mine_scales.view(torch.int8)
    del acc
    gathered = torch.empty(n * row, dtype=torch.int8, device=dev)
    comm.all_gather(gathered, mine, group, category=category)
    gathered = gathered.view(n, row)
    out = tensor if tensor.dtype == torch.float32 else torch.empty(s, dtype=torch.float32, device=dev)
    for r in range(n):
        lo, hi = r * c, min(s, (r + 1) * c)
        if hi <= lo:
            break
        _dequantize_into(gathered[r, 4 * nb:4 * nb + hi - lo], gathered[r, :4 * nb].clone().view(torch.float32), b,
                         out[lo:hi])
    if out is not tensor:
        tensor.copy_(out)
