"""Context parallel: a sequence split over the ranks of the ``context`` group (``sep x cp``), with exact attention.

Each of the ``G`` ranks of the group holds one contiguous chunk of every sequence, positions
``[r * Tl, (r + 1) * Tl)`` for context rank ``r`` (``Topology.context_rank``) and ``Tl = T / G``. Everything but the
attention is per token and runs on the chunk as it is. :func:`attention` gathers the keys and values of the whole
sequence from the group (one all-gather each per layer; backward reduce-scatters their gradients) and attends this
rank's queries to them under the causal mask shifted by the chunk's offset: the same result as attention over the
whole sequence, to rounding (the softmax sums run over the same keys).

The gradients of the parameters differ across the group (each rank's tokens are others); ``fully_shard`` sums them
over the replicate group, which includes ``sep x cp`` (``Topology`` kind ``replicate``), in the same once-per-step
all-reduce that HSDP replicas use, and divides by ``Topology.gradient_divisor`` (which counts sep and cp), so the
result is the gradient of the mean loss over every token. sep and cp are one sequence axis for this library: both
split sequences, and the ``context`` group spans both (docs/context-parallel.md).

The all-gather of K/V follows the simpler of the two exact schemes in the field (Llama 3's context parallel gathers
K/V; ring attention, Liu et al. 2023, passes K/V blocks around a ring to overlap them with compute and never holds
the whole sequence). Its cost per layer and micro-batch: an all-gather of K and of V, ``2 * B * H * T * D`` elements
in all, each rank sending ``(G - 1) / G`` of it; the same again in backward (reduce-scatter). With contiguous chunks
and a causal mask the last rank does the most attention work (``G`` key blocks against rank 0's one): a known
imbalance, which a zig-zag assignment of chunks would remove.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from shardfusion import comm

CATEGORY = "context_parallel"
"""The accounting category of the all-gathers and reduce-scatters here."""


def _gather_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` (B, H, Tl, D) of every rank of ``group``, concatenated along the sequence: (B, H, G * Tl, D)."""
    size = comm.group_size(group)
    full = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)  # (G * B*H*Tl*D,): [rank, B, H, Tl, D]
    comm.all_gather(full, x.contiguous().view(-1), group, category=CATEGORY)
    B, H, Tl, D = x.shape
    return full.view(size, B, H, Tl, D).permute(1, 2, 0, 3, 4).reshape(B, H, size * Tl, D)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence in forward; in backward the gradient of the whole sequence is summed over
    the group (every rank's queries used every rank's keys) and each rank keeps its chunk's: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """x (B, H, Tl, D), any float dtype -> (B, H, G * Tl, D), the chunks of the G ranks in group order."""
        ctx.group, ctx.shape = group, x.shape
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """grad (B, H, G * Tl, D) -> (B, H, Tl, D): this rank's chunk of the gradient summed over the group (one
        reduce-scatter of B*H*G*Tl*D elements)."""
        size = comm.group_size(ctx.group)
        B, H, Tl, D = ctx.shape
        full = grad.reshape(B, H, size, Tl, D).permute(2, 0, 1, 3, 4).contiguous().view(-1)  # [rank, B, H, Tl, D]
        mine = torch.empty(B * H * Tl * D, dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter(mine, full, ctx.group, category=CATEGORY)
        return mine.view(B, H, Tl, D), None


def gather_sequence(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Differentiable all-gather of (B, H, Tl, D) chunks into (B, H, G * Tl, D), in context rank order (``x``
    itself for a group of one rank)."""
    if comm.group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[ProcessGroup],
              dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's chunk of queries over the whole sequence's keys and values.

    q, k, v: (B, H, Tl, D), this context rank's chunk (positions ``[r * Tl, (r + 1) * Tl)``, ``r`` this rank's index
    in ``group``). Returns (B, H, Tl, D): what ``scaled_dot_product_attention(..., is_causal=True)`` over the whole
    sequence gives for these positions. Collective over ``group`` (``None`` or one rank: plain causal attention).

    Raises:
        ValueError: ``dropout_p > 0`` with a group of more than one rank (each rank would drop other weights than
            one process does; use dropout 0 with context parallel).
    """
    size = comm.group_size(group)
    if size == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if dropout_p > 0:
        raise ValueError(f"context-parallel attention over {size} ranks needs attention dropout 0, got {dropout_p}")
    Tl = q.shape[2]
    start = dist.get_rank(group) * Tl
    k_all, v_all = gather_sequence(k, group), gather_sequence(v, group)  # (B, H, T, D)
    q_pos = torch.arange(start, start + Tl, device=q.device)[:, None]  # (Tl, 1)
    k_pos = torch.arange(size * Tl, device=q.device)[None, :]  # (1, T)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=k_pos <= q_pos)  # (B, H, Tl, D)


def sequence_chunk(t: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Chunk ``rank`` of ``size`` of ``t`` along ``dim`` (the sequence): contiguous, equal.

    Raises:
        ValueError: the length along ``dim`` is not a multiple of ``size`` (numbers named).
    """
    length = t.shape[dim]
    if length % size:
        raise ValueError(f"context parallel over {size} ranks needs a sequence length divisible by {size}, got "
                         f"{length}")
    part = length // size
    return t.narrow(dim, rank * part, part)
