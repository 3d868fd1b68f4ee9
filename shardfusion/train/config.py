"""The settings of `shardfusion.train`: `JobConfig`, the flags as given, composed of one section per concern; the
command line generated from the sections; `ResolvedJob`, what one `resolve` makes of them for a world of ranks.

Each section is a frozen dataclass its owner module holds and checks (`check_flags` there takes only the sections
it needs); this module composes them and imports them, never the other way round:

    model        ModelConfig        model_config      --preset, --hf-model, --init-from, shape and MoE flags
    parallelism  ParallelismConfig  parallel_config   --ep, --expert-policy, --mp, --cp, --fsdp-outer-degree, ...
    precision    PrecisionConfig    dtype_flags       --param-dtype, --grad-comm-dtype, --outer-comm-dtype, ...  
    optim        OptimizerConfig    optim_config      --optimizer, --lr, --min-lr, --weight-decay, --muon-lr, --clip
    schedule     ScheduleConfig     schedule          --steps, --warmup, the batch sizes, --seed, evaluation, ...
    corpus       DataConfig         data_config       --data, --data-bytes, the tokenizer flags
    checkpoint   CheckpointConfig   checkpoint_config --save-every, --keep, --max-restarts, --async-save
    ft           FTConfig           ft_config         --ft-*: a fault-tolerant replica group
    outer        OuterConfig        outer_config      --outer-*: DiLoCo
    pipeline     PipelineConfig     pipeline_config   --pp, --pp-schedule, --stages-per-rank, --microbatches
    dry          DryRunConfig       dry_run_config    --dry-run, --world, the bandwidths and latencies
    run          RunConfig          run_config        --nproc, --ranks-per-node, --out, --device, ...

A field is a flag: its name in kebab case is the flag (unique across the sections), its docstring the --help text,
its default the flag's. Field metadata (`shardfusion.train.sections`) marks what a checkpoint saves and compares
(`RESUME_FIELDS`, `SAVED_TOKENIZER_FIELDS`) and what fault-tolerant replica groups must share (`FT_SHARED`), so
no list of names is kept by hand. `JobConfig.flat()` / `JobConfig.from_flat()` convert to and from the flat
flag-name dict that config.json records (the format runs before the sections wrote, so they still resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from shardfusion.models.gpt import GPTConfig
from shardfusion.topology import Degrees, outer_degree_within_nodes
from shardfusion.train import (checkpoint_config, data_config, dry_run_config, dtype_flags, ft_config, model_config,
                               optim_config, outer_config, parallel_config, pipeline_config, run_config, schedule)
from shardfusion.train.checkpoint_config import CheckpointConfig
from shardfusion.train.data import corpus_size, min_corpus_bytes, split_sizes
from shardfusion.train.data_config import DataConfig
from shardfusion.train.dry_run_config import DryRunConfig
from shardfusion.train.dtype_flags import PrecisionConfig, torch_dtype  # noqa: F401  # the job imports it here
from shardfusion.train.ft_config import FTConfig
from shardfusion.train.model_config import ModelConfig
from shardfusion.train.optim_config import OPTIMIZERS, OptimizerConfig  # noqa: F401
from shardfusion.train.outer_config import OuterConfig
from shardfusion.train.parallel_config import AUTO, ParallelismConfig, memory_arg, outer_degree_arg  # noqa: F401
from shardfusion.train.pipeline_config import PipelineConfig
from shardfusion.train.run_config import RunConfig
from shardfusion.train.schedule import (DEFAULT_BATCH_SIZE, DEFAULT_WARMUP, ScheduleConfig,  # noqa: F401
                                        warmup_steps)
from shardfusion.train.sections import field_docs, fields_marked, marked_values, meta


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything one training run depends on, as given on the command line: one section per concern (the module
    docstring lists them). Frozen; `replace` returns a changed copy.

    A flag is read from its section (``config.schedule.steps``); `flat` gives them all by name, as config.json
    records them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dry: DryRunConfig = field(default_factory=DryRunConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    corpus: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    @classmethod
    def from_flat(cls, **fields: Any) -> JobConfig:
        """The config of flag-name keywords, e.g. ``JobConfig.from_flat(preset="tiny", steps=4, pp=2)``; flags not
        given keep their defaults.

        Raises:
            TypeError: a name that is no flag of any section.
        """
        unknown = sorted(set(fields) - set(OWNER))
        if unknown:
            raise TypeError(f"JobConfig.from_flat: no such flag: {', '.join(unknown)}")
        return cls(**{name: section(**{k: v for k, v in fields.items() if OWNER[k] == name})
                      for name, section in SECTIONS.items()})

    def flat(self) -> dict[str, Any]:
        """Every flag's value by its name (the sections' fields, in section order), as config.json records them."""
        return {f.name: getattr(getattr(self, name), f.name)
                for name, section in SECTIONS.items() for f in dataclasses.fields(section)}

    def replace(self, **fields: Any) -> JobConfig:
        """A copy with the flags ``fields`` (flag names) changed.

        Raises:
            TypeError: a name that is no flag.
        """
        unknown = sorted(set(fields) - set(OWNER))
        if unknown:
            raise TypeError(f"JobConfig.replace: no such flag: {', '.join(unknown)}")
        changed = {}
        for name in {OWNER[k] for k in fields}:
            changed[name] = dataclasses.replace(getattr(self, name),
                                                **{k: v for k, v in fields.items() if OWNER[k] == name})
        return dataclasses.replace(self, **changed)

    def model_config(self) -> GPTConfig:
        """The model's shape: the preset with the model section's overrides, over the byte vocabulary
        (`model_config.shape`)."""
        return model_config.shape(self.model)

    def validate(self) -> None:
        """Every section's checks (each module's `check_flags`, with the sections it needs).

        Raises:
            ValueError: one line naming the flag to change; float fields must be finite (the command line refuses
                nan and inf already, see `finite_float`).
        """
        for name, value in self.flat().items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        for name in SECTION_CHECKS:
            self.check_section(name)

    def check_section(self, name: str) -> None:
        """One section's checks (`SECTION_CHECKS`: its module's `check_flags` with the sections it needs).

        Raises:
            ValueError: one line naming the flag to change.
        """
        check, needs = SECTION_CHECKS[name]
        check(getattr(self, name), *(getattr(self, other) for other in needs))


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
"""Each section of `JobConfig` by its attribute name, in the order --help lists them."""

SECTION_CHECKS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "model": (model_config.check_flags, ()),
    "parallelism": (parallel_config.check_flags, ("model",)),
    "schedule": (schedule.check_flags, ()),
    "optim": (optim_config.check_flags, ("parallelism",)),
    "checkpoint": (checkpoint_config.check_flags, ()),
    "run": (run_config.check_flags, ()),
    "precision": (dtype_flags.check_flags, ()),
    "pipeline": (pipeline_config.check_flags, ("model", "parallelism", "optim")),
    "corpus": (data_config.check_flags, ("model",)),
    "ft": (ft_config.check_flags, ("parallelism", "pipeline", "optim", "checkpoint", "precision", "run")),
    "outer": (outer_config.check_flags, ("parallelism", "ft", "optim", "model")),
    "dry": (dry_run_config.check_flags, ("parallelism", "optim", "outer", "ft", "model")),
}
"""Each section's checks in the order `JobConfig.validate` runs them: its module's ``check_flags(section, *needs)``
and the names of the other sections it takes (every section's own flags first, then those that refuse pairs)."""

OWNER: dict[str, str] = {f.name: name for name, section in SECTIONS.items() for f in dataclasses.fields(section)}
"""Each flag's field name mapped to the section that holds it."""


class PlannedOuterDegree:
    """The outer degree of ``--fsdp-outer-degree auto`` before the process group exists: the cost model
    (`sf.plan`) chooses it from a bandwidth probe, which needs the workers, so `resolve` leaves this marker and only
    `shardfusion.train.parallelize.plan_outer_degree` turns it into an int (`ResolvedJob.with_outer_degree`)."""

    def __repr__(self) -> str:
        return AUTO

    def __eq__(self, other: object) -> bool:  # compares equal to the flag's own value, "auto"
        return isinstance(other, PlannedOuterDegree) or other == AUTO

    def __hash__(self) -> int:
        return hash(AUTO)

    def __reduce__(self):  # one marker per process, also after pickling to a worker
        return (_planned, ())


def _planned() -> PlannedOuterDegree:
    return PLANNED


PLANNED = PlannedOuterDegree()
"""The one `PlannedOuterDegree`."""


@dataclass(frozen=True, kw_only=True)
class ResolvedJob:
    """A `JobConfig` with every run-time default filled for a world of ranks, made by `resolve` alone; the job's
    workers take this, never a bare `JobConfig`. Its own fields are the values `resolve` decides; a section read by
    its name (``job.schedule``) is the config's section with the resolved values in it (``job.schedule.warmup`` is
    an int): consumers take the sections they need."""

    config: JobConfig
    """The flags as given (after `resolve`'s checks of the world)."""
    world_size: int
    """Ranks of the job (one replica group's with fault tolerance)."""
    device: str
    """cpu or cuda (--device auto resolved)."""
    out: str
    """The output folder (--out, or runs/<timestamp>)."""
    nproc: int | None
    """Local workers this process starts; None under torchrun (its own --nproc-per-node)."""
    ep: int
    """Expert-parallel degree (1 for a Hugging Face model)."""
    fsdp_outer_degree: int | PlannedOuterDegree
    """HSDP replicas of each shard; `PLANNED` until the cost model chooses it (--fsdp-outer-degree auto)."""
    reshard_policy: str
    """after_forward or after_backward (the pipeline's default)."""
    batch_size: int
    """Sequences per micro-batch of one data-parallel rank, B."""
    global_batch_size: int
    """Sequences per micro-batch over all data-parallel ranks (and replica groups), G = B x their number."""
    warmup: int
    """Warm-up steps (a resumed run keeps its checkpoint's)."""
    stages_per_rank: int | None
    """Pipeline stages per pp rank; None without a pipeline (--pp 1)."""
    microbatches: int | None
    """Pipeline micro-batches per step; None without a pipeline (--pp 1: --grad-accum's)."""
    ft_host: str | None
    """The address the other replica groups reach this one at; None without fault tolerance."""
    fused_qkv: bool
    """q/k/v in one projection (the checkpoint's layout when a resume reads a fused one)."""
    tokenizer: str | None = field(default=None, metadata=meta(saved=True))
    """The tokenizer the run reads with (bytes, or a path); None for a dry run, which reads no data."""
    vocab_size: int | None = field(default=None, metadata=meta(ft_shared=True))
    """The tokenizer's vocabulary, the GPT's embedding rows; None for a dry run (the byte vocabulary)."""
    tokenizer_fingerprint: str | None = field(default=None, metadata=meta(saved=True, ft_shared=True))
    """The tokenizer's `Tokenizer.fingerprint`, so a resume can refuse another one; None for a dry run."""
    shape: GPTConfig
    """The model's shape (`model_config.shape` over the tokenizer's vocabulary)."""

    def _section(self, name: str) -> Any:
        """The section ``name`` of ``config`` with the values `resolve` decided for its fields put in."""
        section = getattr(self.config, name)
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(section) if f.name in RESOLVED}
        return dataclasses.replace(section, **own) if own else section

    @property
    def model(self) -> ModelConfig:
        return self._section("model")

    @property
    def parallelism(self) -> ParallelismConfig:
        return self._section("parallelism")

    @property
    def schedule(self) -> ScheduleConfig:
        return self._section("schedule")

    @property
    def optim(self) -> OptimizerConfig:
        return self._section("optim")

    @property
    def precision(self) -> PrecisionConfig:
        return self._section("precision")

    @property
    def run(self) -> RunConfig:
        return self._section("run")

    @property
    def checkpoint(self) -> CheckpointConfig:
        return self._section("checkpoint")

    @property
    def dry(self) -> DryRunConfig:
        return self._section("dry")

    @property
    def outer(self) -> OuterConfig:
        return self._section("outer")

    @property
    def ft(self) -> FTConfig:
        return self._section("ft")

    @property
    def corpus(self) -> DataConfig:
        return self._section("corpus")

    @property
    def pipeline(self) -> PipelineConfig:
        return self._section("pipeline")

    def model_config(self) -> GPTConfig:
        """The model's shape (``shape``)."""
        return self.shape

    def flat(self) -> dict[str, Any]:
        """Every flag by its name with the resolved values in (and the tokenizer's): what config.json records."""
        return {**self.config.flat(), **{name: getattr(self, name) for name in RESOLVED_FLAT}}

    def marked(self, key: str) -> dict[str, Any]:
        """The values of the fields whose metadata sets ``key`` (`shardfusion.train.sections`), by name."""
        return marked_values(MARKED_CLASSES, key, self.flat())

    def replace(self, **fields: Any) -> ResolvedJob:
        """A copy with resolved fields or flags (by name) changed; the shape follows the model flags and the
        vocabulary. For tests and for what the workers learn (rank 0's --out, the planned outer degree)."""
        own = {k: v for k, v in fields.items() if k in RESOLVED}
        flags = {k: v for k, v in fields.items() if k not in RESOLVED}
        config = self.config.replace(**flags) if flags else self.config
        changed = dataclasses.replace(self, config=config, **own)
        return dataclasses.replace(changed, shape=model_config.shape(
            dataclasses.replace(config.model, fused_qkv=changed.fused_qkv), changed.vocab_size))

    def with_outer_degree(self, degree: int) -> ResolvedJob:
        """This job with the outer degree the cost model chose (`PLANNED` before)."""
        return dataclasses.replace(self, fsdp_outer_degree=degree)


RESOLVED = frozenset(f.name for f in dataclasses.fields(ResolvedJob) if f.name not in ("config", "shape"))
"""The fields `resolve` decides, besides the config and the shape."""

RESOLVED_FLAT = tuple(f.name for f in dataclasses.fields(ResolvedJob) if f.name in OWNER or f.metadata)
"""The resolved fields config.json records: the flags they resolve, and the tokenizer's."""

MARKED_CLASSES = (*SECTIONS.values(), ResolvedJob)

RESUME_FIELDS = fields_marked(MARKED_CLASSES, "resume")
"""The fields that decide the learning rate schedule, the data order, the loss or the arithmetic (metadata
``resume``): saved in each checkpoint and compared on resume (`shardfusion.train.resume.restore`)."""

SAVED_TOKENIZER_FIELDS = fields_marked(MARKED_CLASSES, "saved")
"""The fields saved beside `RESUME_FIELDS` but not compared there: the tokenizer (metadata ``saved``)."""

FT_SHARED = fields_marked(MARKED_CLASSES, "ft_shared")
"""The fields every fault-tolerant replica group must share (metadata ``ft_shared``;
`shardfusion.train.ft_config.settings_fingerprint`)."""


@dataclass(frozen=True)
class TokenizerFacts:
    """What `resolve` needs of the run's tokenizer (`data_config.prepare_tokenizer`)."""

    name: str
    vocab_size: int
    fingerprint: str

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerFacts:
        """The facts of a `shardfusion.train.tokenizer.Tokenizer`."""
        return cls(tokenizer.name, tokenizer.vocab_size, tokenizer.fingerprint)


def resolve(config: JobConfig, *, device: str, world_size: int, saved: dict[str, Any] | None = None,
            ranks_per_node: int | None = None, nproc: int | None = None, ft_host: str | None = None,
            fused_qkv: bool | None = None, tokenizer: TokenizerFacts | None = None,
            world: str | None = None) -> ResolvedJob:
    """The one place the run-time defaults are decided, for world_size ranks on ``device``.

    ep: 1 for a Hugging Face model; else 2 when --experts and the sharding degree (world size / (pp x mp x cp)) are
    even, else 1. fsdp_outer_degree: 1 with fault tolerance (the replicas are the other groups); `PLANNED` for auto;
    else `default_outer_degree` over nodes of ranks_per_node ranks (None: one node). Batch sizes
    (`schedule.resolve_batch`), checked here, once (`schedule.check_batch`; ``world`` names where world_size comes
    from in its message). saved: the settings of the checkpoint this run resumes
    (`shardfusion.train.resume.saved_settings`), None for a new run. The pipeline section's defaults:
    `pipeline_config.resolve`. ft_host, fused_qkv (the checkpoint's layout) and tokenizer: what the caller found
    (None: --ft-host as given, --fused-qkv as given, no data read).

    Raises:
        ValueError: the batch flags do not fit the data-parallel world; the rest is `check_run`'s.
    """
    if model_config.is_hf(config.model):
        ep = 1  # Hugging Face models hold every expert (see ModelConfig.hf_model)
    elif config.parallelism.ep is None:
        sharding = data_parallel_size(config, world_size)
        ep = 2 if config.model.experts and config.model.experts % 2 == 0 and sharding % 2 == 0 else 1
    else:
        ep = config.parallelism.ep
    outer = config.parallelism.fsdp_outer_degree
    if ft_config.enabled(config.ft):
        outer = 1  # a fault-tolerant replica group is FSDP: its replicas are the other groups
    elif outer == AUTO:
        outer = PLANNED
    elif outer is None:
        outer, _ = default_outer_degree(config, world_size, ranks_per_node, saved, ep=ep)
    dp_world = batch_world(config, world_size)
    per_rank, total = schedule.resolve_batch(config.schedule, dp_world=dp_world, saved=saved)
    degrees = (("--pp", config.pipeline.pp), ("--mp", config.parallelism.mp), ("--cp", config.parallelism.cp))
    split = "".join(f" / {flag} {degree}" for flag, degree in degrees if degree > 1)
    schedule.check_batch(per_rank, total, dp_world=dp_world, world=(world or f"{world_size} ranks") + split)
    pipeline = pipeline_config.resolve(config.pipeline, config.schedule.grad_accum, config.parallelism.reshard_policy)
    fused = config.model.fused_qkv if fused_qkv is None else fused_qkv
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    return ResolvedJob(
        config=config, world_size=world_size, device=device, nproc=nproc, ep=ep, fsdp_outer_degree=outer,
        out=config.run.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}", batch_size=per_rank, global_batch_size=total,
        warmup=warmup_steps(config.schedule, saved), ft_host=ft_host if ft_host is not None else config.ft.ft_host,
        fused_qkv=fused, tokenizer=tokenizer.name if tokenizer else None, vocab_size=vocab,
        tokenizer_fingerprint=tokenizer.fingerprint if tokenizer else None,
        shape=model_config.shape(dataclasses.replace(config.model, fused_qkv=fused), vocab), **pipeline)


def default_outer_degree(config: JobConfig | ResolvedJob, world_size: int, ranks_per_node: int | None,
                         saved: dict[str, Any] | None = None, *, ep: int | None = None) -> tuple[int, str]:
    """--fsdp-outer-degree when it is not given, and why (one line), for `world_size` ranks on nodes of
    `ranks_per_node` (None, or >= world_size: one node); ep: the resolved expert-parallel degree (default: the
    config's). `saved`: the settings of the checkpoint this run resumes (`resolve`'s): over several nodes its int
    degree is kept when it fits the world, so that a run started with another default (before inner = one node was
    the default) resumes as it ran.

    One node: 2 when the ranks of a pipeline stage (world size / pp) are >= 4 and 2 divides the expert sharding
    degree (sharding / ep), else 1 (`make train`: HSDP 2 x 2). Several nodes: inner = one node, the README's rule:
    the smallest degree whose inner groups sit within a node (`shardfusion.topology.outer_degree_within_nodes`:
    world / (pp x ranks per node) when ep x cp x mp divides a node); when none does (ep x cp x mp does not divide
    ranks_per_node), or the degrees do not fit the world (`check_run` then says which), the one-node rule, and the
    reason says so. Raises nothing."""
    pp, ep = max(1, config.pipeline.pp), max(1, (config.parallelism.ep if ep is None else ep) or 1)
    mp, cp = config.parallelism.mp, config.parallelism.cp
    sharding = data_parallel_size(config, world_size)
    moe_sharding = sharding // ep if sharding % ep == 0 else sharding
    one_node = 2 if world_size // pp >= 4 and moe_sharding % 2 == 0 else 1
    if ranks_per_node is None or ranks_per_node >= world_size:
        return one_node, (f"one node: outer {one_node}, the one-node default (2 when a pipeline stage has >= 4 ranks "
                          f"and 2 divides sharding / ep)")
    nodes = f"{world_size} ranks = {world_size // ranks_per_node} nodes x {ranks_per_node}"
    try:
        degrees = Degrees(world_size=world_size, pp=pp, mp=mp, cp=cp, ep=ep)
    except ValueError:
        return one_node, f"{nodes}: the one-node default {one_node}, as --ep/--pp/--mp/--cp do not fit the world"
    outer = outer_degree_within_nodes(degrees, ranks_per_node)
    kept = (saved or {}).get("fsdp_outer_degree")
    if isinstance(kept, int) and not isinstance(kept, bool) and kept > 0 and degrees.moe_sharding % kept == 0:
        return kept, (f"{nodes}: outer {kept}, kept from the checkpoint this run resumes (the default over several "
                      f"nodes, inner = one node, would be {outer or one_node})")
    if outer is None:
        block = " x ".join(f"{flag} {v}" for flag, v in (("--ep", ep), ("--cp", cp), ("--mp", mp)) if v > 1)
        return one_node, (f"{nodes}: no outer degree keeps the inner groups within a node, as {block} = "
                          f"{ep * cp * mp} ranks do not divide {ranks_per_node}; the one-node default {one_node}")
    inner = degrees.sharding // outer
    span = inner * cp * mp  # consecutive ranks of an inner group's block
    where = "one node" if span == ranks_per_node else f"{span} of the {ranks_per_node} ranks of a node"
    return outer, f"{nodes}: outer {outer} x inner {inner}, each inner group {where}, the default over several nodes"


def data_parallel_size(config: JobConfig | ResolvedJob, world_size: int) -> int:
    """`parallel_config.data_parallel_size` of the config's --pp, --mp and --cp at world_size ranks."""
    par = config.parallelism
    return parallel_config.data_parallel_size(config.pipeline.pp, par.mp, par.cp, world_size)


def batch_world(config: JobConfig | ResolvedJob, world_size: int) -> int:
    """The ranks the global batch is cut for: `data_parallel_size`, times --ft-replicas with fault tolerance (each
    replica group of world_size ranks takes its share; `shardfusion.train.ft_config.data_slices`)."""
    return data_parallel_size(config, world_size) * ft_config.replicas(config.ft)


def check_run(config: ResolvedJob, *, world: str) -> None:
    """The checks that need the world size or the file system, run before any worker starts (or, under torchrun,
    before each worker joins the process group): the HSDP and expert-parallel layout, the output folder and the
    corpus (`resolve` checked the batch flags). `world` names where the world size comes from in messages (e.g.
    "--nproc 4").
    Uses the library's own rules: `shardfusion.topology.Degrees` for the layout, `shardfusion.train.data` for the split.

    Raises:
        ValueError: one line that names the flag to change and the numbers involved.
    """
    _check_layout(config, world)
    _check_out(config)
    if config.model.init_from is not None:
        check_pretrained(config)
    _check_corpus(config)


def _check_layout(config: ResolvedJob, world: str) -> None:
    """`check_run`'s layout rules: --mp, --cp, --pp, the outer degree and --ep against the world size."""
    world_size = config.world_size
    outer, ep, mp, cp = config.fsdp_outer_degree, config.ep, config.parallelism.mp, config.parallelism.cp
    if outer == PLANNED:
        outer = 1  # the cost model picks a degree that fits; the layout check below is the ep one
    for flag, degree in (("--mp", mp), ("--cp", cp)):
        if degree < 1 or world_size % degree:
            raise ValueError(f"{flag} {degree} must be >= 1 and divide the {world_size} ranks ({world})")
        if degree > 1 and config.fsdp_outer_degree == AUTO:
            raise ValueError(f"--fsdp-outer-degree auto with {flag} {degree}: the cost model does not count "
                             "tensor- and context-parallel traffic yet; give the outer degree as an int")
    if world_size % (mp * cp):
        raise ValueError(f"--mp {mp} x --cp {cp} = {mp * cp} must divide the {world_size} ranks ({world})")
    rpn = config.run.ranks_per_node
    if rpn is not None and rpn < world_size and world_size % rpn:
        raise ValueError(f"--ranks-per-node {rpn} must divide the {world_size} ranks ({world}): nodes of equal size "
                         f"(or {world_size} or more: one node)")
    if cp > 1:
        seq_len = config.model_config().seq_len
        if seq_len % cp:
            raise ValueError(f"--cp {cp} must divide the sequence length {seq_len} (--seq-len): each cp rank takes "
                             f"seq_len / cp tokens of every sequence")
        if config.model.dropout:
            raise ValueError(f"--cp {cp} needs --dropout 0 (got {config.model.dropout}): attention dropout would "
                             "differ from one process's")
    pipeline_config.check_world(config.pipeline, config.schedule.grad_accum, config.batch_size, world_size=world_size,
                                world=world)  # --pp divides the world, and more
    outer_config.check_layout(config.outer, config.fsdp_outer_degree, world, config.ft)  # diloco has replicas
    pp = config.pipeline.pp
    with_mp = "".join(f" with {flag} {degree}" for flag, degree in (("--pp", pp), ("--mp", mp), ("--cp", cp))
                      if degree > 1)
    try:
        Degrees(world_size=world_size, sharding=-1, pp=pp, mp=mp, cp=cp, fsdp_outer_degree=outer)
    except ValueError as error:
        raise ValueError(f"--fsdp-outer-degree {outer}{with_mp} does not fit {world_size} ranks ({world}): "
                         f"{error}") from None
    try:
        Degrees(world_size=world_size, sharding=-1, pp=pp, mp=mp, cp=cp, ep=ep, fsdp_outer_degree=outer)
    except ValueError as error:
        raise ValueError(f"--ep {ep} with --fsdp-outer-degree {outer}{with_mp.replace(' with', ' and')} does not fit "
                         f"{world_size} ranks ({world}): {error}") from None
    if mp > 1 and not (config.model.hf_model or config.model.init_from):
        from shardfusion.models.gpt_parallel import check_tensor_parallel
        try:
            check_tensor_parallel(config.model_config(), mp)
        except ValueError as error:
            raise ValueError(f"--mp {mp}: {error}") from None


def _check_out(config: ResolvedJob) -> None:
    """`check_run`'s rules of --data-bytes against the sequence length, and of --out (a writable folder)."""
    need = min_corpus_bytes(config.model_config().seq_len)
    seq = f"seq_len + 1 = {config.model_config().seq_len + 1}"
    data_bytes = config.corpus.data_bytes
    if data_bytes < need:
        n_train, n_val = split_sizes(data_bytes)
        raise ValueError(f"--data-bytes {data_bytes} is too small: it splits into {n_train} train / {n_val} val "
                         f"bytes, but each split needs {seq} bytes; use --data-bytes >= {need} or a smaller --seq-len")
    if config.out is not None:
        out = Path(config.out)
        existing = next(p for p in (out, *out.absolute().parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"--out {config.out}: {existing} exists and is not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"--out {config.out}: the folder {existing} is not writable")


def _check_corpus(config: ResolvedJob) -> None:
    """`check_run`'s rules of a byte corpus (--data, or the standard library): text, and enough of it."""
    if not data_config.plain_bytes(config.corpus, config.model):
        return  # tokens, not bytes: data_config.prepare tokenizes the corpus and checks it
    need = min_corpus_bytes(config.model_config().seq_len)
    seq = f"seq_len + 1 = {config.model_config().seq_len + 1}"
    data, data_bytes = config.corpus.data, config.corpus.data_bytes
    where = "the standard library" if data is None else f"--data {data}"
    try:  # every --data file the run reads is checked to be text; the standard library only as far as needed
        size = corpus_size(data, data_bytes if data is not None else min(data_bytes, need))
    except OSError as error:
        raise ValueError(str(error) if str(error).startswith("--data") else f"{where}: {error}") from None
    if size == 0:
        raise ValueError(f"{where} holds no bytes; pass --data with a non-empty text file or folder (a corpus of "
                         f">= {need} bytes for --seq-len {config.model_config().seq_len})")
    if size < need:
        n_train, n_val = split_sizes(size)
        raise ValueError(f"{where} holds only {size} bytes, which split into {n_train} train / {n_val} val bytes, "
                         f"but each split needs {seq} bytes (a corpus of >= {need} bytes); use more data or a "
                         f"smaller --seq-len")


SLOW_ATTENTION_FLOPS = {"cpu": 1e12, "cuda": 1e15}
"""Attention work of one optimizer step per rank, in FLOPs, above which `seq_len_warning` warns, by device: on CPU,
at the tens of GFLOP/s a core gives, 1e12 is tens of seconds or more per step."""


def attention_flops(config: ResolvedJob) -> float:
    """The causal attention's FLOPs of one optimizer step on one rank (forward and backward): 6 x n_layer x seq_len^2
    x d_model per sequence (q k^T and the weighted sum of v, 2 x seq_len^2 x d_model each, halved by the causal mask,
    times 3 with the backward), x --batch-size x --grad-accum sequences, / (--pp x --mp x --cp). It grows with the
    square of --seq-len, while everything else grows linearly. config must be `resolve`d."""
    model = config.model_config()
    per_sequence = 6.0 * model.n_layer * model.seq_len ** 2 * model.d_model
    split = max(1, config.pipeline.pp) * max(1, config.parallelism.mp) * max(1, config.parallelism.cp)
    return per_sequence * config.batch_size * config.schedule.grad_accum / split


def seq_len_warning(config: ResolvedJob) -> str | None:
    """A warning when --seq-len makes each step's attention work (`attention_flops`) exceed
    `SLOW_ATTENTION_FLOPS` on the run's device, else None (also for --init-from, whose shape is not the flags').
    A --seq-len the corpus cannot serve is an error of `check_run` instead. config must be `resolve`d."""
    if config.model.init_from is not None:
        return None
    flops, limit = attention_flops(config), SLOW_ATTENTION_FLOPS.get(config.device, SLOW_ATTENTION_FLOPS["cpu"])
    if flops <= limit:
        return None
    model = config.model_config()
    # the longest sequence that keeps the attention under the limit, as a power of two
    fits = model.seq_len * math.sqrt(limit / flops)
    shorter = 2 ** max(0, math.floor(math.log2(fits)))
    return (f"--seq-len {model.seq_len}: the attention alone needs about {flops:.1e} FLOPs per rank per optimizer "
            f"step (6 x n_layer {model.n_layer} x seq_len^2 x d_model {model.d_model} x {config.batch_size} "
            f"sequences x --grad-accum {config.schedule.grad_accum}), above {limit:.0e} on {config.device}: expect a "
            f"slow run (it grows with the square of --seq-len); --seq-len {shorter} or less stays under it")


def check_pretrained(config: JobConfig | ResolvedJob) -> None:
    """`model_config.check_pretrained` of the config's --init-from folder, --tokenizer and --seq-len.

    Raises:
        ValueError: one line naming --init-from and what is wrong there.
    """
    spec = data_config.tokenizer_spec(config.corpus, config.model, config.run.out)
    model_config.check_pretrained(config.model, spec, config.model_config().seq_len)


def lr_at(config: JobConfig | ResolvedJob, step: int) -> float:
    """`schedule.lr_at` of the config's schedule and optimizer sections."""
    return schedule.lr_at(config.schedule, config.optim, step)


def lr_factor(config: JobConfig | ResolvedJob, step: int) -> float:
    """`schedule.lr_factor` of the config's schedule and optimizer sections."""
    return schedule.lr_factor(config.schedule, config.optim, step)


def finite_float(text: str) -> float:
    """argparse type of the float flags: a finite number (nan and inf are refused, so a run cannot silently train on
    NaN or turn clipping off).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a number, or not a finite one.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


class OneLineErrors(argparse.ArgumentParser):
    """argparse's parser whose usage errors (its own: an unknown flag, a value of the wrong type; and `usage_error`'s)
    are one line, ``shardfusion-train: error: <message>``, with exit status 2: no usage block before it (``--help``
    shows that)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """An ArgumentParser with one --kebab-case flag per field of `JobConfig`'s sections (in `SECTIONS` order), typed
    from its annotation, its docstring the help. Abbreviated flags are refused (``--step 2`` is not ``--steps 2``),
    float flags take finite numbers only, and a usage error is one line (`OneLineErrors`)."""
    parser = OneLineErrors(
        prog="shardfusion-train",
        description="Train a byte-level GPT with shardfusion (FSDP/HSDP) on this machine's CPUs or GPUs.",
        allow_abbrev=False,
    )
    for section in SECTIONS.values():
        _add_flags(parser, section)
    return parser


def _add_flags(parser: argparse.ArgumentParser, section: type) -> None:
    """The flags of one section's fields (those with ``metadata={"flag": False}`` are set at run time)."""
    docs = field_docs(section)
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        if f.metadata.get("flag", True) is False:
            continue
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args else kind
        flag = "--" + f.name.replace("_", "-")
        help_text = docs.get(f.name, "").replace("%", "%%")
        if "parse" in f.metadata:  # a field with a parser of its own (e.g. an int or "auto")
            parser.add_argument(flag, type=f.metadata["parse"], default=f.default,
                                metavar=f.metadata.get("metavar"), help=help_text)
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=finite_float if base is float else base, default=f.default,
                                metavar=base.__name__.upper(), help=help_text)


def usage_error(message: str) -> NoReturn:
    """Print the one line `shardfusion-train: error: message` to stderr and exit with status 2 (`OneLineErrors`)."""
    build_parser().error(message)


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Parse the command line into a validated JobConfig."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    config = JobConfig.from_flat(**vars(namespace))
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config
