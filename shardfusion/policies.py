"""The values :func:`shardfusion.fully_shard`'s policy options take, defined once.

``fully_shard`` validates its options against these, and so does anything that maps its own settings onto them (the
training job's flags), so the accepted values are never repeated elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

RESHARD_POLICIES = ("after_forward", "after_backward", "auto")
"""``reshard_policy``: free a unit's gathered parameters after its forward (ZeRO-3), keep them until its backward, or
keep those that fit a memory budget (``fully_shard(..., memory_budget=)``; ``shardfusion.reshard_budget``)."""

RESHARD_FILTERS = ("all", "none")
"""The named ``reshard_filter`` values (a callable ``(qualified_name, module) -> bool`` is accepted too)."""

EXPERT_POLICIES = ("replicate", "shard")
"""``expert_policy``: expert buffers sharded over the expert inner group and all-reduced over the outer group, or
sharded over the whole moe_sharding group."""

DTYPE_NAMES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The short names of the floating dtypes that mixed precision and the gradient communication take, and the torch
dtype each stands for: the one table of dtype names in shardfusion. The training job's flags (``--param-dtype``,
``--grad-comm-dtype``, ``--outer-comm-dtype``) take these names; ``fully_shard(outer_comm_dtype=)`` and
``DiLoCo(comm_dtype=)`` accept them and torch's own names (``"float32"``, ...) too (:func:`dtype_named`)."""

MIXED_PRECISION_DTYPES = tuple(DTYPE_NAMES.values())
"""The dtypes a :class:`MixedPrecisionPolicy` field may name (or ``None``): ``torch.float32``, ``torch.bfloat16``,
``torch.float16``."""


ALL_GATHER_DTYPE_NAMES: dict[str, object] = {"int8": "int8", "bf16": torch.bfloat16, "fp16": torch.float16,
                                             "fp8": torch.float8_e4m3fn}
"""The short name of each wire format :attr:`MixedPrecisionPolicy.all_gather_dtype` takes besides ``None`` and the
value it stands for (``"int8"``: block-wise int8, not a torch dtype); the training job's ``--all-gather-dtype``
takes these names. See [Note: quantized weight all-gather] in ``shardfusion/_runtime/gather_wire.py``."""

ALL_GATHER_DTYPES: tuple = tuple(ALL_GATHER_DTYPE_NAMES.values())
"""The values of :data:`ALL_GATHER_DTYPE_NAMES`: ``"int8"``, ``torch.bfloat16``, ``torch.float16``,
``torch.float8_e4m3fn``."""

ALL_GATHER_DTYPE_TEXT = 'None, "int8", torch.bfloat16, torch.float16 or torch.float8_e4m3fn'
"""The accepted values of ``all_gather_dtype``, as error messages write them."""


GRAD_COMM_DTYPE_NAMES: dict[str, object] = {**DTYPE_NAMES, "int8": "int8"}
"""The short name of each value :attr:`MixedPrecisionPolicy.grad_comm_dtype` takes besides ``None``, and the value
it stands for: the float dtypes of :data:`DTYPE_NAMES`, and ``"int8"`` (the reduce-scatter sent block-quantized,
ZeRO++'s qgZ: [Note: quantized gradient reduce-scatter] in ``shardfusion/_runtime/grad_wire.py``); the training
job's ``--grad-comm-dtype`` takes these names."""

GRAD_COMM_DTYPE_TEXT = 'None, torch.float32, torch.bfloat16, torch.float16 or "int8"'
"""The accepted values of ``grad_comm_dtype``, as error messages write them."""


_NAMED: dict[str, torch.dtype] = {**DTYPE_NAMES, **{str(d).removeprefix("torch."): d for d in DTYPE_NAMES.values()}}


def dtype_names() -> tuple[str, ...]:
    """Every name :func:`dtype_named` accepts: the short ones, then torch's (``fp32, bf16, fp16, float32, ...``)."""
    return tuple(_NAMED)


def dtype_named(name: object) -> torch.dtype:
    """The torch dtype of a name in :data:`DTYPE_NAMES` (``"bf16"``) or of torch's name of one of its dtypes
    (``"bfloat16"``); lower case.

    Raises:
        ValueError: anything else; the message lists the accepted names.
    """
    if isinstance(name, str) and name in _NAMED:
        return _NAMED[name]
    raise ValueError(f"unknown dtype name {name!r}: expected one of {', '.join(_NAMED)}")


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Mixed precision of a sharded model, as FSDP2's ``MixedPrecisionPolicy``: ``fully_shard(model, topology,
    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=torch.float32))``.

    The default, ``MixedPrecisionPolicy()``, is off: everything runs in the parameters' own dtype. Shards, the
    gradients the optimizer reads and so the optimizer state always stay in the parameters' own dtype (fp32).
    Only floating-point parameters are cast.

    Raises:
        ValueError: ``param_dtype`` neither ``None`` nor one of ``torch.float32``, ``torch.bfloat16``,
            ``torch.float16``; ``grad_comm_dtype`` none of these nor ``"int8"``; ``all_gather_dtype`` not one of
            :data:`ALL_GATHER_DTYPES` or ``None`` (the message names the field, the value and the accepted values).
    """

    param_dtype: Optional[torch.dtype] = None
    """The dtype of the all-gathered full buffers and so of the forward and backward compute (``None``: the
    parameters' own dtype). Each all-gather sends the shard cast to it. Floating-point tensors passed to the model's
    forward are cast to it (FSDP2's ``cast_forward_inputs``). Gradients accumulated over micro-batches with gradient
    sync off are summed in the parameters' dtype (fp32), never in ``param_dtype``."""

    grad_comm_dtype: Optional[object] = None
    """The dtype of the reduce-scatter and of the replicate all-reduce (``None``: ``param_dtype`` if given, else the
    parameters' dtype). Reduced gradients are added into the fp32 sharded gradient; below 32 bits they are divided
    by ``dp * sharding`` before the reduction (no overflow in fp16). ``"int8"`` (ZeRO++'s quantized gradients, qgZ:
    Wang et al., 2023): the reduce-scatter over the sharding group sends block-wise int8 (one fp32 scale per 256
    elements, 1 + 4/256 bytes per element, about a quarter of fp32): each rank quantizes its gradient buffer once,
    one all-to-all moves the quantized pieces, each rank dequantizes the pieces of its shard and sums them in fp32
    (the error does not compound over hops, as requantizing each partial sum of a ring would); the replicate
    all-reduce then runs in the parameters' dtype (fp32) unless ``fully_shard(outer_comm_dtype=)`` says otherwise,
    and buffers kept whole (no reduce-scatter) are all-reduced in it too. Error per element of the reduced
    gradient (before the division by ``dp * sharding``): at most ``sum_r (1 + 2**-14) * a_r / 254`` plus fp32
    rounding of the sum, ``a_r`` the max |gradient| of rank ``r`` over the element's block ([Note: quantized
    gradient reduce-scatter] in ``shardfusion/_runtime/grad_wire.py``; docs/quantized-reduce-scatter.md)."""

    all_gather_dtype: Optional[object] = None
    """The wire format of the parameter all-gather only (ZeRO++'s quantized weights, qwZ: Wang et al., 2023): each
    rank quantizes its own shard once per gather, and every rank dequantizes the gathered shards (its own too) into
    the full buffer in ``param_dtype``; the shard, the gradients, the optimizer state and checkpoints stay exact.
    ``None`` (default): the all-gather in ``param_dtype``, as without this option. Bytes one rank sends per element
    of its shard: ``torch.bfloat16`` / ``torch.float16`` 2 (a cast); ``"int8"`` 1 + 4/256 (block-wise symmetric
    int8, one fp32 scale per 256 elements: the compressed outer all-reduce's format, about a quarter of fp32);
    ``torch.float8_e4m3fn`` 1 + 4/256 (e4m3 with one fp32 scale per block of 256). Error bounds per element are in
    [Note: quantized weight all-gather] (``shardfusion/_runtime/gather_wire.py``); e.g. int8: at most
    ``max |x| / 254`` over the element's block of the shard. A group of one (a buffer kept whole) sends nothing and
    quantizes nothing."""

    def __post_init__(self) -> None:
        for name, accepted, int8, text in (
                ("param_dtype", MIXED_PRECISION_DTYPES, False, "None, torch.float32, torch.bfloat16 or torch.float16"),
                ("grad_comm_dtype", MIXED_PRECISION_DTYPES, True, GRAD_COMM_DTYPE_TEXT),
                ("all_gather_dtype", ALL_GATHER_DTYPES[1:], True, ALL_GATHER_DTYPE_TEXT)):
            value = getattr(self, name)
            if value is None or (int8 and isinstance(value, str) and value == "int8") or any(
                    value is d for d in accepted):
                continue
            raise ValueError(f"MixedPrecisionPolicy: {name} must be {text}, got {value!r}")
