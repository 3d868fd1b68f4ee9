"""The checkpoint section of the training job's settings (`--save-every`, `--keep`, `--max-restarts`,
`--async-save`) and its checks: this module owns them; `shardfusion.train.config.JobConfig` composes the section. What a checkpoint of the
job holds and how a run resumes from one: `shardfusion.train.resume`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When the job saves, how many checkpoints it keeps, and how often its workers restart from them (a section
    of `JobConfig`)."""

    save_every: int = 0
    """Save a checkpoint to OUT/checkpoints/step-N every this many optimizer steps and at the last step; 0 saves
    none (default 0)."""
    keep: int = 3
    """Checkpoints kept in OUT/checkpoints: older ones are deleted once a newer one is published (default 3)."""
    max_restarts: int = 0
    """When a worker fails, restart all workers up to this many times (the elastic launcher's restarts); they resume
    from the latest checkpoint in --out, so it needs --save-every. Under torchrun use torchrun's own --max-restarts,
    with --out, --save-every and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (default 0)."""
    async_save: bool = False
    """Write each checkpoint in the background: the step loop waits only while this rank's shards are copied to
    host memory, the next save (and the end of the run) waits for the write, and a checkpoint is published once
    every rank has written it, so a run killed during a write resumes from the one before (docs/checkpoints.md;
    default off: each save returns when the checkpoint is written)."""


def check_flags(checkpoint: CheckpointConfig) -> None:
    """The section's flags on their own and together.

    Raises:
        ValueError: one line naming the flag to change.
    """
    for flag, value in (("--save-every", checkpoint.save_every), ("--max-restarts", checkpoint.max_restarts)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if checkpoint.max_restarts and not checkpoint.save_every:
        raise ValueError(f"--max-restarts {checkpoint.max_restarts} needs --save-every > 0: restarted workers resume "
                         f"from the latest checkpoint, and without one they would start over")
    if checkpoint.keep < 1:
        raise ValueError(f"--keep must be >= 1 (the latest checkpoint is always kept), got {checkpoint.keep}")
