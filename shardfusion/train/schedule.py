"""The schedule section of the training job's settings (`--steps`, `--warmup`, `--batch-size`,
`--global-batch-size`, `--grad-accum`, `--seed`, `--eval-every`, `--eval-batches`, `--stop-after`), its checks, its
run-time defaults (`warmup_steps`, `resolve_batch`, called by `shardfusion.train.config.resolve`) and the
learning-rate schedule (`lr_at`, `lr_factor`): a linear warm-up to --lr, then a cosine down to --min-lr.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from shardfusion.train.optim_config import OptimizerConfig
from shardfusion.train.sections import meta

DEFAULT_WARMUP = 20
"""--warmup when it is not given, at most --steps (and no checkpoint is resumed)."""

DEFAULT_BATCH_SIZE = 16
"""--batch-size when neither --batch-size nor --global-batch-size is given (and no checkpoint is resumed)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How many steps of how many sequences, and when to evaluate (a section of `JobConfig`)."""

    batch_size: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Per data-parallel rank: sequences each data-parallel rank takes per micro-batch, B = --global-batch-size /
    the data-parallel world size; give this or --global-batch-size (both only when they agree) (default:
    --global-batch-size / the data-parallel world size, or 16 when neither is given)."""
    global_batch_size: int | None = field(default=None, metadata=meta(resume=True, ft_shared=True))
    """Global: sequences per micro-batch summed over all data-parallel ranks, G. The global batch of a step is the
    same at every world size and layout, and each data-parallel rank takes its G / (data-parallel world size) of
    it, so G must be divisible by the data-parallel world size (default: --batch-size x the data-parallel world
    size; a run that resumes a checkpoint keeps the saved run's G, so another world size keeps the data order)."""
    grad_accum: int = field(default=1, metadata=meta(resume=True, ft_shared=True))
    """Micro-batches per optimizer step (default 1)."""
    steps: int = field(default=200, metadata=meta(resume=True, ft_shared=True))
    """Optimizer steps (default 200)."""
    warmup: int | None = field(default=None, metadata=meta(resume=True, ft_shared=True))
    """Linear warm-up steps, at most --steps (default: 20, or --steps when it is smaller; a resumed run keeps its
    checkpoint's)."""
    seed: int = field(default=42, metadata=meta(resume=True, ft_shared=True))
    """Seed of the model initialisation and the data sampler (default 42)."""
    eval_every: int = 25
    """Evaluate every this many steps; also before the first and after the last step (default 25)."""
    eval_batches: int = 8
    """Validation batches per evaluation, split across the data-parallel ranks and rounded up to a multiple of their
    number (default 8)."""
    stop_after: int | None = None
    """End this run after this many optimizer steps in total (steps of earlier runs in --out included) and save a
    checkpoint there (also without --save-every); the learning-rate schedule still spans --steps, and a run without
    it (or with a larger one) goes on from there. For time-sliced jobs (default: --steps)."""


def check_flags(schedule: ScheduleConfig) -> None:
    """The section's flags on their own and together.

    Raises:
        ValueError: one line naming the flag to change and the numbers.
    """
    s = schedule
    for flag, value in (("--batch-size", s.batch_size), ("--global-batch-size", s.global_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--grad-accum", s.grad_accum), ("--eval-every", s.eval_every),
                        ("--eval-batches", s.eval_batches), ("--steps", s.steps)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if s.warmup is not None and not 0 <= s.warmup <= s.steps:
        raise ValueError(f"--warmup {s.warmup} must be between 0 and --steps {s.steps}: the learning rate "
                         f"rises linearly over the warm-up steps, and a longer warm-up would end the run before "
                         f"it reaches --lr; use --warmup {min(s.steps, DEFAULT_WARMUP)} or less (0: none)")
    if s.stop_after is not None and not 1 <= s.stop_after <= s.steps:
        raise ValueError(f"--stop-after must be between 1 and --steps {s.steps}, got {s.stop_after}")


def warmup_steps(schedule: ScheduleConfig, saved: dict[str, Any] | None = None) -> int:
    """--warmup, or when it is not given the saved run's (saved: a resumed checkpoint's settings), else
    `DEFAULT_WARMUP`; never more than --steps."""
    if schedule.warmup is not None:
        return schedule.warmup
    saved_warmup = (saved or {}).get("warmup")
    return min(schedule.steps, DEFAULT_WARMUP if saved_warmup is None else saved_warmup)


def lr_at(schedule: ScheduleConfig, optim: OptimizerConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up to lr, then cosine down to min_lr."""
    warmup = warmup_steps(schedule)
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    decay_steps = max(1, schedule.steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_factor(schedule: ScheduleConfig, optim: OptimizerConfig, step: int) -> float:
    """The schedule of `lr_at` as a fraction of its peak --lr, for optimizer step `step` (0-based): between
    --min-lr / --lr and 1 (with --lr 0, the schedule's shape with --min-lr 0). Muon's lr at the step is --muon-lr
    times this."""
    if optim.lr > 0:
        return lr_at(schedule, optim, step) / optim.lr
    return lr_at(schedule, dataclasses.replace(optim, lr=1.0, min_lr=0.0), step)


def resolve_batch(schedule: ScheduleConfig, *, dp_world: int, saved: dict[str, Any] | None = None
                  ) -> tuple[int | None, int]:
    """(--batch-size B per data-parallel rank, --global-batch-size G), each filled from the other: G = B x dp_world.

    Neither given: a resumed run (saved: its checkpoint's settings) keeps the saved G, or, for a checkpoint of a run
    before the global data order (no saved G), the saved B; a new run takes B = `DEFAULT_BATCH_SIZE`. Only G given:
    B = G / dp_world when that divides, else B is None for `check_batch` to refuse. Both given: kept as they are
    (`check_batch` compares them)."""
    per_rank, total = schedule.batch_size, schedule.global_batch_size
    if per_rank is None and total is None:
        saved = saved or {}
        total = saved.get("global_batch_size")
        per_rank = saved.get("batch_size", DEFAULT_BATCH_SIZE) if total is None else None
    if total is None:
        total = per_rank * dp_world
    elif per_rank is None and total % dp_world == 0:
        per_rank = total // dp_world
    return per_rank, total


def check_batch(per_rank: int | None, total: int | None, *, dp_world: int, world: str) -> None:
    """The batch flags against the data-parallel world size dp_world: --global-batch-size (``total``) divisible by
    it, and --batch-size (``per_rank``) x dp_world equal to it when both are set. `world` names where dp_world comes
    from in messages (e.g. "--nproc 4").

    Raises:
        ValueError: naming both flags or --global-batch-size and dp_world, and what would fit.
    """
    if total is not None and total % dp_world:
        below, above = total // dp_world * dp_world, -(-total // dp_world) * dp_world
        fits = f"{below} or {above}" if below else f"{above}"
        raise ValueError(f"--global-batch-size {total} is not divisible by the data-parallel world size {dp_world} "
                         f"({world}): each data-parallel rank takes G / {dp_world} sequences; use "
                         f"--global-batch-size {fits}, or another world size")
    if per_rank is not None and total is not None and per_rank * dp_world != total:
        raise ValueError(f"--batch-size {per_rank} (per data-parallel rank) and --global-batch-size {total} disagree: "
                         f"{per_rank} x the data-parallel world size {dp_world} ({world}) = {per_rank * dp_world}; "
                         f"give only one of them")
