"""The fault-tolerance section of the training job's settings (`--ft-lighthouse`, `--ft-replica-id`,
`--ft-replicas`, `--ft-min-replicas`, `--ft-join-wait`, `--ft-timeout`, `--ft-host`, `--ft-quorum-timeout`,
`--ft-max-discards`) and its checks: this module
owns them, `shardfusion.train.config.JobConfig` composes the section (``config.ft``) and calls `check_flags` with the
other sections' checks; the job calls `resolve_host` and `check_lighthouse` in its preflight. The run itself is
`shardfusion.train.job_ft` over `shardfusion.ft`; docs/fault-tolerance.md tells the whole story.

With --ft-lighthouse, each replica group is a job of its own (one per node, or per few nodes), started with the
same flags but its own --ft-replica-id. Inside it the job is FSDP with outer degree 1, with tensor parallel over
--mp consecutive ranks when given; what HSDP's outer all-reduce did goes through torchft over the replica groups
alive each step. The data slices are those of HSDP with --ft-replicas outer groups: data-parallel rank
``replica_id x inner + rank`` of ``ft_replicas x inner`` (inner: the group's data-parallel ranks, its mp ranks
sharing one), so with every replica alive the run trains on the same global batches as HSDP ft_replicas x inner
(x mp).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from shardfusion.train import compat
from shardfusion.train.checkpoint_config import CheckpointConfig
from shardfusion.train.dtype_flags import PrecisionConfig
from shardfusion.train.flag_checks import refuse_first
from shardfusion.train.optim_config import OptimizerConfig
from shardfusion.train.parallel_config import ParallelismConfig
from shardfusion.train.pipeline_config import PipelineConfig
from shardfusion.train.run_config import RunConfig
from shardfusion.train.sections import meta

REPLICA_FOLDER = "replica-{}"
"""Each replica group's outputs (metrics, config, summary, plot) go to OUT/replica-<id>; checkpoints to OUT."""


@dataclass(frozen=True, kw_only=True)
class FTConfig:
    """The fault-tolerance settings of a training run (a section of `JobConfig`: ``config.ft``)."""

    ft_lighthouse: str | None = None
    """http://host:port of a torchft lighthouse (start one with `torchft_lighthouse --min_replicas 1 --bind
    HOST:PORT`): this job is then one fault-tolerant replica group, its gradients averaged with the other groups
    alive each step; needs --ft-replica-id, --ft-replicas and --out; pip install 'shardfusion[ft]'
    (docs/fault-tolerance.md) (default: none, no fault tolerance)."""
    ft_replica_id: int | None = None
    """This replica group's id, 0 .. --ft-replicas - 1: which slice of each global batch it trains on; its metrics
    and summary go to OUT/replica-<id>, the checkpoints of the run to OUT/checkpoints (default: none)."""
    ft_replicas: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Replica groups the run is planned for: the global batch is cut into that many slices, one per group; a
    group that is down leaves its slice out of the step (default: none)."""
    ft_min_replicas: int = field(default=1, metadata=meta(ft_shared=True))
    """A step commits only when at least this many replica groups take part; below, the groups wait and say so
    (default 1)."""
    ft_join_wait: float = 30.0
    """Seconds a run that starts (or whose groups all restart from one checkpoint) waits for all --ft-replicas
    groups to join before it trains with those that did (a later one copies their state) (default 30)."""
    ft_timeout: float = 10.0
    """Seconds after which a collective with a replica group that stopped answering fails, and the step is
    discarded; torchft's RPCs use it too (default 10)."""
    ft_host: str | None = None
    """The address the other replica groups reach this one's store and torchft manager at (default: 127.0.0.1 when
    the lighthouse is on loopback, else this machine's address on the interface that routes to the lighthouse;
    a loopback address with a lighthouse elsewhere is refused)."""
    ft_quorum_timeout: float = 120.0
    """Seconds a quorum may take to form (the lighthouse gone, or a group that sends heartbeats but no longer
    trains) before the group stops with a one-line error (default 120)."""
    ft_max_discards: int = 20
    """The group stops with a one-line error when more than this many steps in a row are discarded with at least
    --ft-min-replicas groups in the quorum (or as many join waits fail): the collectives between the groups keep
    failing (default 20)."""


def enabled(config: FTConfig) -> bool:
    """Whether this job is a fault-tolerant replica group (--ft-lighthouse given)."""
    return config.ft_lighthouse is not None


def check_flags(config: FTConfig, parallelism: ParallelismConfig, pipeline: PipelineConfig, optim: OptimizerConfig,
                checkpoint: CheckpointConfig, precision: PrecisionConfig, run: RunConfig) -> None:
    """The section's flags together, and against the flags it cannot run with (those of the other sections).

    Raises:
        ValueError: naming the flag and the numbers.
    """
    given = [flag for flag, value in (("--ft-replica-id", config.ft_replica_id), ("--ft-replicas", config.ft_replicas))
             if value is not None]
    if not enabled(config):
        if given:
            raise ValueError(f"{given[0]} needs --ft-lighthouse (the torchft lighthouse of the run)")
        return
    if config.ft_replicas is None or config.ft_replicas < 1:
        raise ValueError(f"--ft-lighthouse needs --ft-replicas >= 1 (the replica groups the global batch is cut "
                         f"for), got {config.ft_replicas}")
    if config.ft_replica_id is None:
        raise ValueError(f"--ft-lighthouse needs --ft-replica-id (this replica group's id, 0 .. "
                         f"{config.ft_replicas - 1})")
    if not 0 <= config.ft_replica_id < config.ft_replicas:
        raise ValueError(f"--ft-replica-id {config.ft_replica_id} must be in 0 .. {config.ft_replicas - 1} "
                         f"(--ft-replicas {config.ft_replicas})")
    if not 1 <= config.ft_min_replicas <= config.ft_replicas:
        raise ValueError(f"--ft-min-replicas {config.ft_min_replicas} must be in 1 .. --ft-replicas "
                         f"{config.ft_replicas}")
    if not config.ft_join_wait >= 0:
        raise ValueError(f"--ft-join-wait {config.ft_join_wait} must be >= 0 seconds")
    if not config.ft_timeout > 0:
        raise ValueError(f"--ft-timeout {config.ft_timeout} must be > 0 seconds")
    if not config.ft_quorum_timeout > 0:
        raise ValueError(f"--ft-quorum-timeout {config.ft_quorum_timeout} must be > 0 seconds")
    if config.ft_max_discards < 1:
        raise ValueError(f"--ft-max-discards {config.ft_max_discards} must be >= 1")
    from shardfusion.ft import is_loopback, lighthouse_host  # torch only: no torchft import
    there = lighthouse_host(config.ft_lighthouse)
    if config.ft_host is not None and is_loopback(config.ft_host) and there and not is_loopback(there):
        raise ValueError(f"--ft-host {config.ft_host} is this machine's loopback, but the lighthouse is at {there}: "
                         f"the other replica groups could not reach this one; give an address they reach, or leave "
                         f"--ft-host out (then this machine's address towards the lighthouse is used)")
    if run.out is None:
        raise ValueError("--ft-lighthouse needs --out (a folder every replica group reaches: shared storage on a "
                         "cluster): the groups share its checkpoints, so a timestamped default would differ between "
                         "them")
    p = parallelism
    compat.refuse_first("ft", "--ft-lighthouse", [  # the pairs of modes: shardfusion.train.compat's reasons
        ("pp", "--pp", pipeline.pp, pipeline.pp != 1), ("cp", "--cp", p.cp, p.cp != 1),
        ("hsdp", "--fsdp-outer-degree", p.fsdp_outer_degree, p.fsdp_outer_degree not in (None, 1)),
        ("muon", "--optimizer", optim.optimizer, optim.optimizer != "adamw")])
    if checkpoint.async_save:
        compat.refuse("ft", "async_save", "--async-save", "--ft-lighthouse")
    refuse_first([("--max-restarts", checkpoint.max_restarts, bool(checkpoint.max_restarts)),
                  ("--outer-comm-dtype", precision.outer_comm_dtype, precision.outer_comm_dtype is not None)],
                 "--ft-lighthouse",
                 "a fault-tolerant replica group is FSDP with outer degree 1 and AdamW, its replicas joined by "
                 "torchft, which averages the gradients in their own dtype (restart a replica group with its "
                 "launcher; no --max-restarts or --outer-comm-dtype yet); see docs/fault-tolerance.md")


def resolve_host(config: FTConfig) -> str | None:
    """With --ft-lighthouse: --ft-host, or `shardfusion.ft.reachable_host` when not given; None without.
    (`shardfusion.train.config.resolve` takes it, and sets the outer degree to 1: the replicas are the other jobs.)

    Raises:
        ValueError: no --ft-host given and no route to the lighthouse's host.
    """
    if not enabled(config):
        return None
    from shardfusion.ft import reachable_host
    return config.ft_host or reachable_host(config.ft_lighthouse)


def settings_fingerprint(shared: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the settings every replica group must share for its arithmetic to be its peers' (``shared``:
    `ResolvedJob.marked("ft_shared")`, the fields whose metadata says so: `shardfusion.train.config.FT_SHARED`),
    compared across the quorum's groups (`shardfusion.ft.agreement`). Paths (--out, --data, --init-from) are not
    among them: shared storage may be mounted at other paths on other nodes."""
    return hashlib.sha256(json.dumps(dict(shared), sort_keys=True, default=str).encode()).hexdigest()


def outputs_folder(config: FTConfig, out: str) -> str:
    """Where this job writes its metrics, config.json, summary.json and loss.png: ``out`` itself, or with fault
    tolerance OUT/replica-<id> (each replica group its own). The checkpoints and the tokenizer stay in OUT itself,
    shared: whichever replica group is first in the quorum writes them, and a restarted one resumes from them."""
    return os.path.join(out, REPLICA_FOLDER.format(config.ft_replica_id)) if enabled(config) else out


def data_slices(config: FTConfig, inner_rank: int, inner_world: int) -> tuple[int, int]:
    """(dp_rank, dp_world) of the sampler: this rank's slice of each global batch. ``inner_rank`` and
    ``inner_world``: the group's data-parallel rank and world (`Topology.data_parallel_rank`, dp x sharding: the mp
    ranks of one slice share it). Without fault tolerance the replica group is the whole data-parallel world; with
    it, replica r's ranks take slices r x inner .. of ft_replicas x inner."""
    if not enabled(config):
        return inner_rank, inner_world
    return config.ft_replica_id * inner_world + inner_rank, config.ft_replicas * inner_world


def replicas(config: FTConfig) -> int:
    """Replica groups the global batch is cut for: --ft-replicas, or 1 without fault tolerance."""
    return config.ft_replicas if enabled(config) else 1
