"""The optimizer section of the training job's settings (`--optimizer`, `--lr`, `--min-lr`, `--weight-decay`,
`--muon-lr`, `--clip`) and its checks: this module owns them; `shardfusion.train.config.JobConfig` composes the
section and calls `check_flags` with the other sections' checks. The optimizers themselves are built by
`shardfusion.train.optim`; the learning-rate schedule over the steps is `shardfusion.train.schedule`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardfusion.train import compat
from shardfusion.train.parallel_config import ParallelismConfig
from shardfusion.train.sections import meta

OPTIMIZERS = ("adamw", "muon")
"""The --optimizer choices: AdamW on every parameter, or Muon on the 2-D weights of the blocks and AdamW on the rest
(see `shardfusion.train.optim.build_optimizers`)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer and its peak learning rates (a section of `JobConfig`)."""

    lr: float = field(default=3e-3, metadata=meta(resume=True, ft_shared=True))
    """Peak learning rate, reached at the end of warm-up (default 3e-3)."""
    min_lr: float = field(default=3e-4, metadata=meta(resume=True, ft_shared=True))
    """Learning rate at the end of the cosine decay (default 3e-4)."""
    weight_decay: float = field(default=0.1, metadata=meta(resume=True, ft_shared=True))
    """AdamW weight decay on matrices (with --optimizer muon: Muon's decoupled weight decay on the blocks'
    matrices); biases, norms and embeddings get none (default 0.1)."""
    optimizer: str = field(default="adamw", metadata=meta(resume=True, ft_shared=True))
    """adamw: AdamW on every parameter; muon: torch.optim.Muon (momentum 0.95, Nesterov, adjust_lr_fn original) on
    the 2-D weights of the transformer blocks, each kept whole on one owner rank (sf.fully_shard(whole_params=)),
    and AdamW (--lr) on embeddings, head, norms and biases; see docs/train-muon.md. A resume must use the saved
    run's optimizer (default adamw)."""
    muon_lr: float = field(default=0.05, metadata=meta(resume=True))
    """Muon's peak learning rate with --optimizer muon; the warm-up + cosine schedule scales it like --lr (at each
    step Muon's lr is --muon-lr x the schedule's fraction of --lr); make train's run learns best near 0.05 of
    0.01 / 0.02 / 0.05 / 0.1 (docs/train-muon.md) (default 0.05)."""
    clip: float = field(default=1.0, metadata=meta(resume=True, ft_shared=True))
    """Max global gradient norm; 0 turns clipping off, the norm is still reported (default 1.0)."""


def check_flags(optim: OptimizerConfig, parallelism: ParallelismConfig) -> None:
    """The section's flags, and Muon against tensor parallel.

    Raises:
        ValueError: one line naming the flag to change and the numbers.
    """
    for flag, value in (("--clip", optim.clip), ("--weight-decay", optim.weight_decay)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if optim.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {optim.optimizer!r}")
    if optim.muon_lr < 0:
        raise ValueError(f"--muon-lr must be >= 0, got {optim.muon_lr}")
    if optim.optimizer == "muon" and parallelism.mp != 1:
        compat.refuse("muon", "mp", "--optimizer muon", f"--mp {parallelism.mp}")
    if not 0 <= optim.min_lr <= optim.lr:
        raise ValueError(f"need 0 <= --min-lr({optim.min_lr}) <= --lr({optim.lr})")
