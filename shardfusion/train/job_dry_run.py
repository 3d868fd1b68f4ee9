"""`--dry-run`: one optimizer step of a `--world`-rank job played in this process (`shardfusion.dry_run`), with the
job's own model, units, layout and batch flags. Nothing is trained, no worker is started, no data is read.

    python -m shardfusion.train --dry-run --world 1024 --ranks-per-node 8 --fsdp-outer-degree 128 \
        --n-layer 32 --d-model 4096 --n-head 32 --seq-len 4096 --global-batch-size 1024 --param-dtype bf16
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

import shardfusion as sf
from shardfusion.plan import Bandwidth
from shardfusion.train import dry_run_config, job_model, parallelize
from shardfusion.dry_run import check_world_fits
from shardfusion.train.config import JobConfig, ResolvedJob, check_run, default_outer_degree, resolve
from shardfusion.train.plain_mode import context_of, context_part, micro_batch_loss
from shardfusion.train.dry_run_config import DEFAULT_RANKS_PER_NODE
from shardfusion.train.launch import default_nproc

def prepare(config: JobConfig) -> tuple[ResolvedJob, int, int]:
    """The resolved config, the world size and the ranks per node of the dry run. Without --fsdp-outer-degree the
    degree is the job's default for that many nodes (`outer_degree_line` says which and why).

    Raises:
        ValueError: a world whose bookkeeping would not fit this machine's memory (`sf.dry_run.check_world_fits`,
            before anything is allocated); the layout or batch flags do not fit --world (the job's own checks,
            naming the flag).
    """
    world = config.dry.world or config.run.nproc or default_nproc("cpu")
    try:
        check_world_fits(world)
    except ValueError as error:
        raise ValueError(f"--world {world}: {error}") from None
    ranks_per_node = config.run.ranks_per_node or min(DEFAULT_RANKS_PER_NODE, world)
    if world % ranks_per_node:
        raise ValueError(f"--ranks-per-node {ranks_per_node} must divide --world {world}")
    job = resolve(config, device="cuda", world_size=world, ranks_per_node=ranks_per_node, world=f"--world {world}")
    check_run(job, world=f"--world {world}")  # the job's own layout, batch and pipeline rules
    return job, world, ranks_per_node


def outer_degree_line(given: JobConfig, config: ResolvedJob, world: int, ranks_per_node: int) -> str:
    """One line: the outer degree of the dry run and why, for the flags `given` and their resolved `config`."""
    if given.parallelism.fsdp_outer_degree is not None:
        return f"--fsdp-outer-degree {config.fsdp_outer_degree}, as given"
    return (f"--fsdp-outer-degree {config.fsdp_outer_degree} by default: "
            f"{default_outer_degree(config, world, ranks_per_node)[1]}")


class RandomBatches:
    """The dry run's stand-in for the job's `BatchSampler`: ``get_batch("train", step, micro_step)`` gives random
    token ids (B, T) int64 inputs and targets of the job's shapes (fake tensors inside `sf.dry_run`), B = ``rows``
    (this data-parallel rank's sequences per micro-batch)."""

    def __init__(self, rows: int, seq_len: int, vocab: int) -> None:
        self.rows, self.seq_len, self.vocab = rows, seq_len, vocab

    def get_batch(self, split: str, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.rows, self.seq_len + 1))  # (B, T + 1)
        return tokens[:, :-1], tokens[:, 1:]


def job_step(config: ResolvedJob, ranks_per_node: int):
    """``(build, step)`` of one optimizer step of the job as ``config`` (resolved) describes it, for
    ``sf.dry_run`` or ``measure_step``, playing the `Trainer`'s own forward on random token ids of the job's shapes
    (`RandomBatches`): the model mode's micro-batch (`plain_mode.micro_batch_loss` on this context rank's part of
    a ``(--global-batch-size / data-parallel ranks, seq_len)`` batch, as `PlainMode.forward_backward` runs each of
    the step's micro-batches; the library runs its backward, the clipping and the optimizer step in the order of
    `Trainer.train_step`), or with --pp the played rank's stages of `job_pipeline.PipelineRun`, sharded, whose
    `PipelineRun.run_rows` (the step's --grad-accum x --batch-size rows through the schedule, as
    `PipelineMode.forward_backward` runs them) returns None: ``step_runs_backward=config.pp > 1``."""
    job = job_model.build(config, None, torch.device("cpu"))  # on meta: the sequence length and the losses
    vocab = config.model_config().vocab_size
    pipe = []  # --pp > 1: the played rank's PipelineRun (its stages, sharded, and its schedule)

    def build(topo):
        if config.pipeline.pp > 1:
            from shardfusion.train.job_pipeline import PipelineRun

            pipe[:] = [PipelineRun(topo, torch.device("cpu"), pipeline=config.pipeline, schedule=config.schedule,
                                   parallelism=config.parallelism, precision=config.precision, model=config.model,
                                   shape=config.shape, node_of=lambda r: r // ranks_per_node)]
            return pipe[0].models
        return job_model.build(config, topo.get_group("ep"), torch.device("cpu"),
                               context_group=topo.get_group("context")).module

    def step(model, topo):
        if pipe:  # the schedule runs every micro-batch's forward and backward (the rows of --grad-accum steps)
            rows = config.schedule.grad_accum * config.batch_size
            pipe[0].run_rows(*RandomBatches(rows, job.seq_len, vocab).get_batch("train", 0))
            return None
        batches = RandomBatches(config.global_batch_size // (topo.dp * topo.sharding), job.seq_len, vocab)
        x, y = context_part(batches.get_batch("train", 0), context_of(topo))
        return micro_batch_loss(job, model, x, y, aux_loss_coef=config.model.aux_loss_coef,
                                micro_batches=config.schedule.grad_accum)[0]

    return build, step


def run(config: JobConfig) -> int:
    """Play the step and print the report (and write OUT/dry-run.json with --out); returns the exit status.

    Raises:
        ValueError: as :func:`prepare`.
    """
    given, given_out = config, config.run.out
    config, world, ranks_per_node = prepare(config)
    within, across = dry_run_config.bandwidths(config.dry)
    job = job_model.build(config, None, torch.device("cpu"))  # on meta: the units and the figures of the header

    build, step = job_step(config, ranks_per_node)

    fully_shard = {"units": job.units, **parallelize.shard_options(config.parallelism, config.precision)}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on fake tensors' data pointers and deprecated names
        report = sf.dry_run(build, step, step_runs_backward=config.pipeline.pp > 1, world_size=world,
                            ranks_per_node=ranks_per_node,
                            topology=parallelize.topology_degrees(config.parallelism, config.pipeline),
                            fully_shard=fully_shard,
                            micro_batches=1 if config.pipeline.pp > 1 else config.schedule.grad_accum,
                            max_norm=config.optim.clip or None,
                            max_memory_per_rank=config.parallelism.max_memory_per_rank,
                            async_save=config.checkpoint.async_save,
                            bandwidth=Bandwidth(within=within, across=across,
                                                latency_within=config.dry.latency_within * 1e-6,
                                                latency_across=config.dry.latency_across * 1e-6))
    shape = config.model_config()
    model = (f"GPT of {shape.n_layer} layers x {shape.d_model}" +
             (f", {shape.n_experts} experts top-{shape.top_k}" if shape.n_experts else ""))
    accum = config.schedule.grad_accum
    batches = (f"{config.pipeline.microbatches} pipeline micro-batches of the step's {accum * config.schedule.batch_size}"
               f" sequences per data-parallel rank" if config.pipeline.pp > 1 else
               f"{accum} micro-batch{'es' if accum > 1 else ''} per step")
    header = (f"shardfusion: dry run of a {model} ({job.num_params:,} parameters), global batch "
              f"{config.schedule.global_batch_size} x {job.seq_len} tokens, {batches}")
    print(header)
    print(f"shardfusion: {outer_degree_line(given, config, world, ranks_per_node)}")
    print(report.table(), flush=True)
    if given_out is not None:
        out = Path(given_out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"config": config.flat(), "report": _as_dict(report)}
        (out / "dry-run.json").write_text(json.dumps(record, indent=1, default=str))
        print(f"shardfusion: wrote {out / 'dry-run.json'}")
    return 0


def _as_dict(report) -> dict:
    out = dataclasses.asdict(report)
    out["plan"] = None if report.plan is None else dataclasses.asdict(report.plan)
    out["bandwidth"] = dataclasses.asdict(report.bandwidth)
    return out
