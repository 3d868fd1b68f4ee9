"""The outer-synchronisation section of the training job's settings (`--outer-sync`, `--outer-every`,
`--outer-lr`, `--outer-momentum`, `--outer-fragments`) and its checks: this module owns them,
`shardfusion.train.config.JobConfig` composes the section (``config.outer``) and calls `check_flags` with the other
sections' checks and `check_layout` with the world-size checks. The engine is `shardfusion.diloco`;
docs/slow-links.md tells the whole story.

``--outer-sync every-step`` (the default) is HSDP as it is: one gradient all-reduce per step across the replicas,
exact. ``--outer-sync diloco`` takes --outer-every inner steps per replica without any traffic between nodes, then
one outer Nesterov step on the pseudo-gradients (sent in --outer-comm-dtype when given).

The job's default outer optimizer is not the paper's (`shardfusion.diloco`'s defaults, lr 0.7 with Nesterov momentum
0.9, tuned for H = 500 and runs of hundreds of outer steps): it is plain averaging, lr 1 without momentum
(`JOB_LR`, `JOB_MOMENTUM`), and its default H is 4 (`JOB_EVERY`), for the runs people start first (a few hundred
steps: 50 outer steps in the default run). The rule: the outer step's steady-state gain on the mean pseudo-gradient is lr / (1 - momentum), 7 for the
paper's; with few outer steps and a small H that gain overshoots. Measured on the default
run (200 steps, H = 4):
benchmarks/results/diloco-loss.md (`python -m benchmarks.diloco_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardfusion.train import compat
from shardfusion.train.flag_checks import refuse_first
from shardfusion.train.ft_config import FTConfig
from shardfusion.train.model_config import ModelConfig
from shardfusion.train.optim_config import OptimizerConfig
from shardfusion.train.parallel_config import ParallelismConfig
from shardfusion.train.sections import meta

OUTER_SYNCS = ("every-step", "diloco")
JOB_LR = 1.0
"""The job's default --outer-lr: with `JOB_MOMENTUM` 0 the outer step sets every replica to the mean of the replicas'
parameters (the module docstring says why not the paper's 0.7)."""
JOB_MOMENTUM = 0.0
"""The job's default --outer-momentum (the paper's: 0.9)."""
JOB_EVERY = 4
"""The job's default --outer-every H (the library's `shardfusion.diloco.DEFAULT_EVERY` is 16, the paper's 500): on the
default run (200 steps) H = 16 ended x1.041 of synchronous training's final validation loss; H = 4 is measured in
benchmarks/results/diloco-loss.md. A long run raises it, with the paper's outer optimizer."""


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """How the replicas of HSDP synchronise (a section of `JobConfig`: ``config.outer``)."""

    outer_sync: str = field(default="every-step", metadata=meta(resume=True))
    """every-step (HSDP: one gradient all-reduce across the replicas per step, exact) or diloco (each replica steps
    alone for --outer-every steps, then an outer Nesterov step on the change of the parameters; Douillard et al.,
    2023; needs --fsdp-outer-degree > 1, or fault-tolerant replica groups: --ft-lighthouse with --ft-replicas > 1;
    docs/slow-links.md) (default every-step)."""
    outer_every: int = field(default=JOB_EVERY, metadata=meta(resume=True))
    """With --outer-sync diloco: H, the inner steps between two outer steps (default 4, for runs of a few hundred steps;
    the paper used 500 with its outer optimizer, docs/slow-links.md)."""
    outer_lr: float = field(default=JOB_LR, metadata=meta(resume=True))
    """With --outer-sync diloco: the outer learning rate (default 1.0; with --outer-momentum 0, plain averaging of the
    replicas, for runs of few outer steps; the paper's, for H in the hundreds and long runs: --outer-lr 0.7
    --outer-momentum 0.9; docs/slow-links.md)."""
    outer_momentum: float = field(default=JOB_MOMENTUM, metadata=meta(resume=True))
    """With --outer-sync diloco: the outer Nesterov momentum (default 0; the paper's 0.9)."""
    outer_fragments: int = field(default=1, metadata=meta(resume=True))
    """With --outer-sync diloco: streaming DiLoCo, the model cut into this many fragments synchronised at staggered
    steps, so no step carries more than about 1/F of the model's bytes (default 1: all at once)."""


def enabled(config: OuterConfig) -> bool:
    """Whether the replicas synchronise by DiLoCo (--outer-sync diloco)."""
    return config.outer_sync == "diloco"


def check_flags(config: OuterConfig, parallelism: ParallelismConfig, ft: FTConfig, optim: OptimizerConfig,
                model: ModelConfig) -> None:
    """The section's flags together, and against the flags of the other sections they cannot run with (pipeline
    stages are not among them: DiLoCo takes one outer step per stage's replicas).

    Raises:
        ValueError: naming the flag and the numbers.
    """
    if config.outer_sync not in OUTER_SYNCS:
        raise ValueError(f"--outer-sync must be {' or '.join(OUTER_SYNCS)}, got {config.outer_sync!r}")
    if not enabled(config):
        changed = [flag for flag, value, default in (
            ("--outer-every", config.outer_every, JOB_EVERY), ("--outer-lr", config.outer_lr, JOB_LR),
            ("--outer-momentum", config.outer_momentum, JOB_MOMENTUM),
            ("--outer-fragments", config.outer_fragments, 1)) if value != default]
        if changed:
            raise ValueError(f"{changed[0]} needs --outer-sync diloco (with every-step the replicas synchronise each "
                             f"step)")
        return
    if config.outer_every < 1:
        raise ValueError(f"--outer-every {config.outer_every} must be >= 1 (inner steps between two outer steps)")
    if not config.outer_lr > 0:
        raise ValueError(f"--outer-lr {config.outer_lr} must be > 0")
    if not 0 <= config.outer_momentum < 1:
        raise ValueError(f"--outer-momentum {config.outer_momentum} must be in [0, 1)")
    if not 1 <= config.outer_fragments <= config.outer_every:
        raise ValueError(f"--outer-fragments {config.outer_fragments} must be in 1 .. --outer-every "
                         f"{config.outer_every} (each fragment is synchronised every H steps, at its own step)")
    policy = parallelism.expert_policy
    compat.refuse_first("diloco", "--outer-sync diloco", [  # the pairs of modes: shardfusion.train.compat's reasons
        ("cp", "--cp", parallelism.cp, parallelism.cp != 1),
        ("muon", "--optimizer", optim.optimizer, optim.optimizer != "adamw")])
    refuse_first([("--expert-policy", policy, bool(model.experts) and policy == "shard")],
                 "--outer-sync diloco", "DiLoCo runs on replicas (HSDP's, or fault-tolerant replica groups) with AdamW "
                 "inside, each replica's experts "
                 "whole on it (no --expert-policy shard yet); see docs/slow-links.md")


def check_layout(config: OuterConfig, fsdp_outer_degree: object, world: str, ft: FTConfig | None = None) -> None:
    """With diloco, the resolved layout must have replicas: ``fsdp_outer_degree``, the resolved outer degree (an
    int, or the marker of auto, which DiLoCo does not take); with fault tolerance (``ft`` with --ft-lighthouse) the
    replicas are the replica groups, each of outer degree 1: --ft-replicas >= 2.

    Raises:
        ValueError: --fsdp-outer-degree 1 (or auto) with --outer-sync diloco, or --ft-replicas 1 with it.
    """
    if enabled(config) and ft is not None and ft.ft_lighthouse is not None:
        if ft.ft_replicas is not None and ft.ft_replicas < 2:
            raise ValueError(f"--outer-sync diloco needs replicas: --ft-replicas {ft.ft_replicas} (under fault "
                             f"tolerance the replicas are the replica groups); plan the run for 2 groups or more")
        return
    if enabled(config) and (not isinstance(fsdp_outer_degree, int) or fsdp_outer_degree < 2):
        raise ValueError(f"--outer-sync diloco needs replicas: --fsdp-outer-degree {fsdp_outer_degree} "
                         f"({world}); give an outer degree >= 2 (one replica per node)")
