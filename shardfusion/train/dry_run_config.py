"""The dry-run section of the training job's settings (`--dry-run`, `--world`, `--bandwidth-within`,
`--bandwidth-across`, `--latency-within`, `--latency-across`) and its checks: this module owns them, `shardfusion.train.config.JobConfig` composes the section
(``config.dry``) and calls `check_flags` with the other sections' checks. The run itself is
`shardfusion.train.job_dry_run`; the engine is `shardfusion.dry_run`; docs/dry-run.md tells the whole story.
"""

from __future__ import annotations

from dataclasses import dataclass
from shardfusion.plan import parse_bytes
from shardfusion.train.flag_checks import refuse_first
from shardfusion.train.ft_config import FTConfig
from shardfusion.train.model_config import ModelConfig
from shardfusion.train.optim_config import OptimizerConfig
from shardfusion.train.outer_config import OuterConfig
from shardfusion.train.parallel_config import ParallelismConfig

DEFAULT_RANKS_PER_NODE = 8
"""Ranks per node a dry run assumes without --ranks-per-node: a node of 8 GPUs."""


@dataclass(frozen=True, kw_only=True)
class DryRunConfig:
    """Sizing a job before booking it (a section of `JobConfig`: ``config.dry``)."""

    dry_run: bool = False
    """Do not train: play one optimizer step of a --world-rank job in this one process (torch's fake process group,
    the model on the meta device, fake tensors) and print, per kind of rank, the memory (parameters, gradients,
    optimizer state, full buffers, activations), the collectives with their bytes within and across nodes
    (--ranks-per-node, default 8) and the cost model's step time; with --out also dry-run.json there
    (docs/dry-run.md) (default off)."""
    world: int | None = None
    """With --dry-run: the world size played, e.g. 1024 (default: --nproc, or its default)."""
    bandwidth_within: str = "150GB"
    """With --dry-run: bytes/s per rank to ranks of its own node for the predicted step time, e.g. 150GB (NVLink
    class) or 900MB (default 150GB)."""
    bandwidth_across: str = "25GB"
    """With --dry-run: bytes/s per rank to other nodes, e.g. 25GB (one 200 Gbit/s NIC per GPU) (default 25GB)."""
    latency_within: float = 5.0
    """With --dry-run: microseconds per ring step of a collective within a node (default 5)."""
    latency_across: float = 15.0
    """With --dry-run: microseconds per ring step of a collective that spans nodes (default 15)."""


def enabled(config: DryRunConfig) -> bool:
    """Whether this run is a dry run (--dry-run)."""
    return config.dry_run


def bandwidths(config: DryRunConfig) -> tuple[float, float]:
    """(within, across) in bytes/s from the flags.

    Raises:
        ValueError: a value that is not a size or not > 0, naming the flag.
    """
    out = []
    for flag, text in (("--bandwidth-within", config.bandwidth_within), ("--bandwidth-across", config.bandwidth_across)):
        try:
            value = parse_bytes(text)
        except ValueError as error:
            raise ValueError(f"{flag}: {error}") from None
        if value <= 0:
            raise ValueError(f"{flag} must be > 0 bytes/s, got {text!r}")
        out.append(float(value))
    return out[0], out[1]


def check_flags(config: DryRunConfig, parallelism: ParallelismConfig, optim: OptimizerConfig, outer: OuterConfig,
                ft: FTConfig, model: ModelConfig) -> None:
    """The section's flags together, and against the flags of the other sections a dry run cannot play yet.

    Raises:
        ValueError: naming the flag and the numbers.
    """
    if not enabled(config):
        changed = [flag for flag, given in (("--world", config.world is not None),
                                            ("--bandwidth-within", config.bandwidth_within != "150GB"),
                                            ("--bandwidth-across", config.bandwidth_across != "25GB"),
                                            ("--latency-within", config.latency_within != 5.0),
                                            ("--latency-across", config.latency_across != 15.0)) if given]
        if changed:
            raise ValueError(f"{changed[0]} needs --dry-run (a training run takes its world size from --nproc or "
                             f"torchrun)")
        return
    if config.world is not None and config.world < 1:
        raise ValueError(f"--world {config.world} must be >= 1")
    bandwidths(config)
    for flag, value in (("--latency-within", config.latency_within), ("--latency-across", config.latency_across)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 microseconds, got {value}")
    p = parallelism
    refuse_first([("--mp", p.mp, p.mp != 1),
                  ("--optimizer", optim.optimizer, optim.optimizer != "adamw"),
                  ("--outer-sync", outer.outer_sync, outer.outer_sync != "every-step"),
                  ("--ft-lighthouse", ft.ft_lighthouse, ft.ft_lighthouse is not None),
                  ("--fsdp-outer-degree", p.fsdp_outer_degree, p.fsdp_outer_degree == "auto"),
                  ("--init-from", model.init_from, model.init_from is not None),
                  ("--hf-model", model.hf_model, model.hf_model is not None)],
                 "--dry-run", "a dry run plays the GPT under FSDP/HSDP with AdamW, ep, cp and pp (no --mp, --optimizer "
                 "muon, --outer-sync diloco, --ft-lighthouse, --fsdp-outer-degree auto, --init-from or --hf-model "
                 "yet); see docs/dry-run.md")
