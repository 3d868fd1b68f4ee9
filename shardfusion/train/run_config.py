"""The run section of the training job's settings (`--nproc`, `--ranks-per-node`, `--out`, `--sample-tokens`,
`--device`, `--progress`, `--log`): where the run happens and what it shows, nothing that changes a step's arithmetic
except the device. This module owns them; `shardfusion.train.config.JobConfig` composes the section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardfusion.train import trackers
from shardfusion.train.sections import meta

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where the run happens and what it shows (a section of `JobConfig`)."""

    nproc: int | None = None
    """Worker processes on this node (default: 4 on CPU, the number of GPUs on CUDA); ignored under torchrun."""
    ranks_per_node: int | None = None
    """Ranks per node: rank r is on node r // ranks-per-node, for the communication accounting (the bytes sent
    between nodes are reported apart) and for the library's topology (which sharding groups span nodes; the ranks
    of a node for options that keep traffic inside it). It places no rank; use it to play a multi-node layout on one
    machine. Below the world size it must divide it, and it also sets the default --fsdp-outer-degree, as nodes
    would (default: LOCAL_WORLD_SIZE, which torchrun and the local launcher set: one node for a local run)."""
    out: str | None = None
    """Output folder for metrics.jsonl, config.json, loss.png, summary.json and checkpoints/ (default
    runs/<timestamp>). A run whose --out holds a checkpoint resumes from the latest one."""
    sample_tokens: int = 200
    """Bytes to generate for the sample printed at the end; 0 skips it (default 200)."""
    device: str = field(default="auto", metadata=meta(resume=True, ft_shared=True))
    """cpu, cuda or auto: cuda when available (default auto)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0 (default on)."""
    log: str = ""
    """Experiment trackers that also get every metrics.jsonl record, the config and the loss plot: any of
    tensorboard, wandb, trackio, comma-separated (each needs its package: the extra of the same name). TensorBoard
    writes OUT/tensorboard, W&B an offline run in OUT/wandb unless WANDB_MODE says otherwise, trackio a local
    project in OUT/trackio; a resumed run continues the same runs (docs/trackers.md; default: none)."""


def check_flags(run: RunConfig) -> None:
    """The section's flags.

    Raises:
        ValueError: one line naming the flag to change.
    """
    if run.sample_tokens < 0:
        raise ValueError(f"--sample-tokens must be >= 0, got {run.sample_tokens}")
    if run.nproc is not None and run.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {run.nproc}")
    if run.ranks_per_node is not None and run.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be >= 1, got {run.ranks_per_node}")
    if run.device not in DEVICES:
        raise ValueError(f"--device must be auto, cpu or cuda, got {run.device!r}")
    trackers.check_installed(trackers.parse_log(run.log))  # a missing package: before any worker starts
