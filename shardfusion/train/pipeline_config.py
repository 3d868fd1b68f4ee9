"""The pipeline-parallel section of the training job's settings (`--pp`, `--pp-schedule`, `--stages-per-rank`,
`--microbatches`) and its checks: this module owns them, `shardfusion.train.config.JobConfig` composes the section
(``config.pipeline``; the flags are generated like every other one) and calls the functions below at their moments:
`check_flags` with the other sections' checks (`JobConfig.validate`), `resolve` with the other run-time defaults
(`config.resolve`), `check_world` with the checks against the world size (`config.check_run`).
The run itself is `shardfusion.train.job_pipeline`; docs/train-pipeline.md describes both.

How the pipeline cuts a step's batch (the data do not depend on the layout): a step trains on --grad-accum (A)
global micro-batches of --global-batch-size (G) sequences, as at --pp 1; each data-parallel rank of a stage takes
its B = G / (data-parallel world) rows of each, A x B rows in micro-step order, and torch's schedule cuts those into
--microbatches (M) pipeline micro-batches of A x B / M rows. The loss is the mean over the rows either way, so a
--pp run and a --pp 1 run of the same flags train on the same sequences with the same loss (the sums run in
another order). With M = A the pipeline micro-batches are the accumulation micro-batches themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfusion.train import compat
from shardfusion.train.model_config import ModelConfig, shape
from shardfusion.train.optim_config import OptimizerConfig
from shardfusion.train.parallel_config import ParallelismConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""The --pp-schedule choices: torch's ScheduleGPipe, Schedule1F1B (one stage per pp rank) and
ScheduleInterleaved1F1B (several stages per pp rank, --stages-per-rank)."""

INTERLEAVED_STAGES_PER_RANK = 2
"""--stages-per-rank when --pp-schedule interleaved does not give it."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The pipeline-parallel settings of a training run (a section of `JobConfig`: ``config.pipeline``)."""

    pp: int = 1
    """Pipeline-parallel degree: the GPT's blocks are cut into consecutive stages (embeddings on the first, final
    norm and head on the last), stage s on pp rank s % pp; each stage is sharded over its world size / pp ranks,
    which take their rows of the same global batch as at --pp 1. A tied head keeps a copy of the embedding on the
    last stage, kept equal to it; GPT and GPT-MoE only (docs/train-pipeline.md) (default 1: no pipeline)."""
    pp_schedule: str = "1f1b"
    """torch schedule with --pp > 1: gpipe (all forwards, then all backwards), 1f1b (one forward, one backward in
    the steady state) or interleaved (1F1B over --stages-per-rank stages per pp rank, a smaller bubble)
    (default 1f1b)."""
    stages_per_rank: int | None = None
    """Pipeline stages each pp rank holds, n_layer / (pp x stages-per-rank) blocks each: 1 for gpipe and 1f1b, >= 2
    for interleaved (default: 1, or 2 with --pp-schedule interleaved)."""
    microbatches: int | None = None
    """Pipeline micro-batches per optimizer step (M), at least the number of stages: each data-parallel rank's
    --grad-accum x --batch-size sequences of the step, the same as at --pp 1, are cut into M micro-batches of
    grad-accum x batch-size / M; M must divide that (default: the number of stages rounded up to a multiple of
    --grad-accum)."""


def num_stages(config: PipelineConfig) -> int:
    """Stages of the pipeline: pp x stages per rank (1 without a pipeline). `stages_per_rank` may be unresolved."""
    return config.pp * stages_per_rank(config)


def stages_per_rank(config: PipelineConfig) -> int:
    """--stages-per-rank, or its default for the schedule."""
    if config.stages_per_rank is not None:
        return config.stages_per_rank
    return INTERLEAVED_STAGES_PER_RANK if config.pp > 1 and config.pp_schedule == "interleaved" else 1


def bubble_fraction(schedule: str, pp: int, per_rank: int, microbatches: int) -> float:
    """The pipeline bubble in theory: the fraction of a step each rank idles when every stage's forward and
    backward of a micro-batch take the same time. GPipe and 1F1B: (p - 1) / (m + p - 1); interleaved 1F1B with v
    stages per rank: (p - 1) / (v m + p - 1) (Narayanan et al. 2021: the bubble shrinks v times). p = pp,
    m = micro-batches per step."""
    v = per_rank if schedule == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def interleaved_rounds(pp: int, microbatches: int) -> int:
    """The rounds torch's ScheduleInterleaved1F1B runs: max(1, M // pp); it needs them to divide M."""
    return max(1, microbatches // pp)


def check_flags(config: PipelineConfig, model: ModelConfig, parallelism: ParallelismConfig,
                optim: OptimizerConfig) -> None:
    """The pipeline flags on their own and against the other sections' (no world size needed); called by
    `JobConfig.validate`.

    Raises:
        ValueError: one line naming the flag to change and the numbers involved.
    """
    pp = config.pp
    if pp < 1:
        raise ValueError(f"--pp must be >= 1, got {pp}")
    if config.pp_schedule not in SCHEDULES:
        raise ValueError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {config.pp_schedule!r}")
    for flag, value in (("--stages-per-rank", config.stages_per_rank), ("--microbatches", config.microbatches)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if pp == 1:
        for flag, value, instead in (("--stages-per-rank", config.stages_per_rank, "--pp > 1"),
                                     ("--microbatches", config.microbatches, "--pp > 1; without a pipeline the "
                                                                             "micro-batches are --grad-accum's")):
            if value is not None:
                raise ValueError(f"{flag} {value} applies only to a pipeline: it needs {instead}")
        return
    what = f"--pp {pp}"
    for other, flag, value, on in (  # the pairs of modes: shardfusion.train.compat's reasons
            ("init_from", "--init-from", model.init_from, model.init_from is not None),
            ("hf", "--hf-model", model.hf_model, model.hf_model is not None),
            ("mp", "--mp", parallelism.mp, parallelism.mp != 1), ("cp", "--cp", parallelism.cp, parallelism.cp != 1),
            ("muon", "--optimizer", optim.optimizer, optim.optimizer != "adamw"),
            ("reshard_auto", "--reshard-policy", parallelism.reshard_policy, parallelism.reshard_policy == "auto")):
        if on:
            compat.refuse("pp", other, what, f"{flag} {value}")
    if parallelism.fsdp_outer_degree == "auto":
        raise ValueError(f"--fsdp-outer-degree auto with {what}: the cost model does not plan pipeline stages; give "
                         f"the outer degree as an int")
    schedule, per_rank = config.pp_schedule, stages_per_rank(config)
    if schedule != "interleaved" and per_rank != 1:
        raise ValueError(f"--stages-per-rank {per_rank} needs --pp-schedule interleaved: {schedule} runs one stage "
                         f"per pp rank")
    if schedule == "interleaved" and per_rank < 2:
        raise ValueError(f"--pp-schedule interleaved needs --stages-per-rank >= 2, got {per_rank}; for one stage per "
                         f"pp rank use --pp-schedule 1f1b")
    stages = pp * per_rank
    n_layer = shape(model).n_layer
    if n_layer % stages:
        below = stages * (n_layer // stages)
        hint = f"use --n-layer {below} or {below + stages}" if below else f"use --n-layer {stages}"
        raise ValueError(f"{what} x {per_rank} stage(s) per rank = {stages} stages must divide n_layer {n_layer} "
                         f"(--n-layer, --preset {model.preset}): each stage holds n_layer / stages consecutive "
                         f"blocks; {hint}")
    if config.microbatches is not None:
        check_microbatches(config, config.microbatches)


def check_microbatches(config: PipelineConfig, m: int) -> None:
    """A given M against the stages and the schedule (`check_flags`; the default M fits them).

    Raises:
        ValueError: one line naming --microbatches and the numbers.
    """
    pp, per_rank = config.pp, stages_per_rank(config)
    stages = pp * per_rank
    flag = f"--microbatches {m}"
    if m < stages:
        raise ValueError(f"{flag} is fewer than the {stages} pipeline stages (--pp {pp} x {per_rank} per rank): "
                         f"every stage must have a micro-batch in flight to keep the pipeline full (torch's 1F1B "
                         f"needs M >= stages); use --microbatches {stages} or more")
    if config.pp_schedule == "interleaved":
        rounds = interleaved_rounds(pp, m)
        if m % rounds:
            fits = [k for k in range(stages, 2 * m + 2) if k % interleaved_rounds(pp, k) == 0]
            near = sorted(fits, key=lambda k: (abs(k - m), k))[:2]
            raise ValueError(f"{flag} with --pp-schedule interleaved and --pp {pp}: torch's Interleaved1F1B runs "
                             f"max(1, M // pp) = {rounds} rounds, which must divide M; use --microbatches "
                             f"{_alternatives(sorted(near))}")


def _alternatives(values: list[int]) -> str:
    """``[2, 3, 6]`` as ``2, 3 or 6``."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


def default_microbatches(config: PipelineConfig, grad_accum: int) -> int:
    """M when --microbatches is not given: the stages rounded up to a multiple of --grad-accum (each accumulation
    micro-batch is cut into the same number of pipeline micro-batches; with grad-accum >= stages, M = grad-accum).
    For the interleaved schedule, the next such M that torch's round rule takes (`interleaved_rounds`)."""
    stages = num_stages(config)
    m = grad_accum * -(-stages // grad_accum)
    if config.pp_schedule == "interleaved":
        while m % interleaved_rounds(config.pp, m):
            m += grad_accum
    return m


RESHARD_POLICY = "after_backward"
"""--reshard-policy of a pipeline run that does not give one: each stage keeps its units gathered from a micro-batch's
forward to its backward. Measured under 1F1B at M = 4 and 8 (docs/pipeline-benchmark.md): 33-44 % fewer all-gathers
and 11-29 % shorter steps than after_forward, peak memory within -8 % to +3 % (the stage's full-size gradient
buffers, kept between micro-batches, already set the peak)."""


def resolve(config: PipelineConfig, grad_accum: int, reshard_policy: str | None) -> dict[str, int | str | None]:
    """The run-time defaults of the section: {"stages_per_rank", "microbatches", "reshard_policy"} for
    `shardfusion.train.config.resolve` (without a pipeline: as given, and after_forward for the reshard policy
    --reshard-policy; with one: `RESHARD_POLICY`). Raises nothing: `check_world` checks the result."""
    if config.pp <= 1:
        return {"stages_per_rank": config.stages_per_rank, "microbatches": config.microbatches,
                "reshard_policy": reshard_policy or "after_forward"}
    m = config.microbatches if config.microbatches is not None else default_microbatches(config, grad_accum)
    return {"stages_per_rank": stages_per_rank(config), "microbatches": m,
            "reshard_policy": reshard_policy or RESHARD_POLICY}


def check_world(config: PipelineConfig, grad_accum: int, batch_size: int | None, *, world_size: int,
                world: str) -> None:
    """The pipeline (resolved: its micro-batches known) against the world size and the batch (--grad-accum,
    --batch-size B), run before any worker starts by `config.check_run`. ``world`` names where world_size comes from
    (e.g. "--nproc 4").

    Raises:
        ValueError: one line naming the flag to change and the numbers involved.
    """
    pp = config.pp
    if pp < 1 or world_size % pp:
        raise ValueError(f"--pp {pp} must divide the {world_size} ranks ({world}): each stage is sharded over "
                         f"world / pp ranks")
    if pp == 1:
        return
    m, accum, per_rank = config.microbatches, grad_accum, batch_size
    if per_rank is not None and m is not None:
        rows = accum * per_rank
        if rows % m:
            stages = num_stages(config)
            fits = [k for k in range(stages, rows + 1) if rows % k == 0]
            hint = (f"use --microbatches {_alternatives(fits[:3])}" if fits else
                    f"raise --batch-size or --grad-accum so that they hold at least {stages} sequences")
            default = " (the default: the stages rounded up to a multiple of --grad-accum)" if (
                m == default_microbatches(config, accum)) else ""
            raise ValueError(f"--microbatches {m}{default} must divide the {rows} sequences each data-parallel rank "
                             f"takes per step (--grad-accum {accum} x --batch-size {per_rank}, {world} / --pp {pp}): "
                             f"each pipeline micro-batch holds an equal share; {hint}")


def describe(config: PipelineConfig) -> str:
    """One line: schedule, stages, micro-batches and the bubble in theory, e.g. ``pp 2, 1f1b, 2 stages (1 per
    rank), 4 micro-batches, bubble 0.200``. config must be resolved."""
    per_rank = stages_per_rank(config)
    bubble = bubble_fraction(config.pp_schedule, config.pp, per_rank, config.microbatches)
    return (f"pp {config.pp}, {config.pp_schedule}, {num_stages(config)} stages ({per_rank} per rank), "
            f"{config.microbatches} micro-batches per step, bubble {bubble:.3f} in theory")

