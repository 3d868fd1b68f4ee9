"""The training job's dtype flags (`--param-dtype`, `--grad-comm-dtype`, `--outer-comm-dtype`, `--all-gather-dtype`)
and what every mode's workers make of them.

The names are the library's (`shardfusion.policies.DTYPE_NAMES`: fp32, bf16, fp16; and
`shardfusion._runtime.compress.INT8` for the outer wire format; `shardfusion.policies.ALL_GATHER_DTYPE_NAMES`: int8,
bf16, fp16, fp8 for the parameter all-gather's; `shardfusion.policies.GRAD_COMM_DTYPE_NAMES`: fp32, bf16, fp16, int8
for the reduce-scatter's), never a table of the job's own. `check_flags` checks
them with the other sections' checks (`JobConfig.validate`); `mixed_precision` and `outer_comm_dtype` turn them into the
arguments the library takes, and every mode builds from these two: plain HSDP (`shardfusion.train.job`), the pipeline
stages (`job_pipeline`), DiLoCo and streaming DiLoCo (`job_outer`: the pseudo-gradients' wire format) and the dry run
(`job_dry_run`). A fault-tolerant replica group refuses `--outer-comm-dtype` (`ft_config.check_flags`: torchft
averages the gradients across the groups, in their own dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardfusion._runtime.compress import INT8, OuterCommDtype, validate_outer_comm_dtype
from shardfusion.policies import (ALL_GATHER_DTYPE_NAMES, DTYPE_NAMES, GRAD_COMM_DTYPE_NAMES, MixedPrecisionPolicy,
                                  dtype_named)
from shardfusion.train.sections import FT_SHARED_UNLESS_DEFAULT, meta

VALUES: dict[str, tuple[str, ...]] = {"param_dtype": tuple(DTYPE_NAMES),
                                      "grad_comm_dtype": tuple(GRAD_COMM_DTYPE_NAMES),
                                      "outer_comm_dtype": (*DTYPE_NAMES, INT8),
                                      "all_gather_dtype": tuple(ALL_GATHER_DTYPE_NAMES)}
"""Each dtype field of `PrecisionConfig` and the values its flag takes (``None``, the default, is accepted too)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The dtypes of compute and communication (a section of `JobConfig`); shards and optimizer state stay fp32."""

    param_dtype: str = field(default="fp32", metadata=meta(resume=True, ft_shared=True))
    """Compute dtype of the gathered parameters: fp32, bf16 or fp16; shards and optimizer state stay fp32
    (default fp32)."""
    grad_comm_dtype: str | None = field(default=None, metadata=meta(resume=True, ft_shared=True))
    """Dtype of the reduce-scatter and the outer all-reduce: fp32, bf16 or fp16 (default: --param-dtype); or int8:
    the reduce-scatter sent block-quantized (ZeRO++'s quantized gradients: an all-to-all of int8 pieces summed in
    fp32, about a quarter of fp32's bytes), the outer all-reduce then in fp32 unless --outer-comm-dtype; see
    docs/quantized-reduce-scatter.md."""
    outer_comm_dtype: str | None = field(default=None, metadata=meta(resume=True))
    """Wire format of the HSDP outer (cross-node) all-reduce only: fp32, bf16, fp16, or int8 (block-wise, about a
    quarter of fp32's bytes; see docs/compressed-all-reduce.md) (default: --grad-comm-dtype; fp32 when that is
    int8)."""
    all_gather_dtype: str | None = field(default=None, metadata=meta(resume=True, ft_shared=FT_SHARED_UNLESS_DEFAULT))
    """Wire format of the parameter all-gather only (ZeRO++'s quantized weights): int8 (block-wise, about a quarter
    of fp32's bytes), bf16, fp16 or fp8 (e4m3 with a scale per block); the gathered parameters are dequantized to
    --param-dtype, the shards stay exact; see docs/quantized-all-gather.md (default: in --param-dtype)."""


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a --param-dtype / --grad-comm-dtype value (None stays None: the default).

    Raises:
        ValueError: not a name of `shardfusion.policies.DTYPE_NAMES`.
    """
    return None if name is None else dtype_named(name)


def mixed_precision(config: PrecisionConfig) -> MixedPrecisionPolicy:
    """The `MixedPrecisionPolicy` of --param-dtype, --grad-comm-dtype and --all-gather-dtype, as every mode's
    `fully_shard` takes it (--grad-comm-dtype int8: ``grad_comm_dtype="int8"``)."""
    wire, comm = config.all_gather_dtype, config.grad_comm_dtype
    return MixedPrecisionPolicy(param_dtype=torch_dtype(config.param_dtype),
                                grad_comm_dtype=None if comm is None else GRAD_COMM_DTYPE_NAMES[comm],
                                all_gather_dtype=None if wire is None else ALL_GATHER_DTYPE_NAMES[wire])


def outer_comm_dtype(config: PrecisionConfig) -> OuterCommDtype:
    """--outer-comm-dtype as the library's wire format: ``fully_shard(outer_comm_dtype=)`` of HSDP and the
    pipeline, ``DiLoCo(comm_dtype=)``: None (the default), ``torch.float32``, ``torch.bfloat16``,
    ``torch.float16`` or ``"int8"``."""
    return validate_outer_comm_dtype(config.outer_comm_dtype)


def check_flags(config: PrecisionConfig) -> None:
    """Each dtype flag's value is one of `VALUES` (or None).

    Raises:
        ValueError: naming the flag, the value and the accepted values.
    """
    for name, accepted in VALUES.items():
        value = getattr(config, name)
        if value is not None and value not in accepted:
            raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(accepted)}, got {value!r}")
