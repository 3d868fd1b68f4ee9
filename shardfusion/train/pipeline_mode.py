"""The pipeline model mode of the `Trainer` (--pp > 1): this rank's stages of `job_pipeline.PipelineRun`, a step
run through torch's pipeline schedule, evaluation forward only through the pipeline, the summary's ``pipeline``
record (docs/train-pipeline.md).

`job_pipeline` (and with it `shardfusion.pipeline` and ``torch.distributed.pipelining``, which imports
``torch._dynamo``: about 0.5 s of CPU) is imported when the stages are built, not with this module: the trainer
imports this module in every run, and in the job's launching process, which builds no stage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn

from shardfusion.train import pipeline_config
from shardfusion.train.mode import Mode, StepFigures, StepSums, Trainer
from shardfusion.train.pipeline_config import PipelineConfig

if TYPE_CHECKING:
    from shardfusion.train.job_pipeline import PipelineRun


class PipelineMode(Mode):
    """This rank's pipeline stages (see the module docstring). ``pipeline``: the pipeline section (resolved)."""

    def __init__(self, pipeline: PipelineConfig) -> None:
        self.pipeline = pipeline
        self.run: Optional[PipelineRun] = None

    def shard(self, trainer: Trainer) -> list[nn.Module]:
        from shardfusion.train.job_pipeline import PipelineRun  # the stages' imports: see the module doc

        rpn = trainer.comm_layout["ranks_per_node"]
        job = trainer.config
        self.run = PipelineRun(trainer.topo, trainer.device, pipeline=self.pipeline, schedule=trainer.schedule,
                               parallelism=trainer.parallelism, precision=trainer.precision, model=job.model,
                               shape=job.shape, node_of=lambda r: r // rpn if rpn else 0)
        return self.run.models  # clipping, the optimizers and the checkpoints take the list of stages

    def forward_backward(self, trainer: Trainer, step: int) -> StepSums:
        self.run.forward_backward(trainer.sampler, step)  # the step's micro-batches, forward and backward
        zero = torch.zeros((), device=trainer.device)  # the figures live in the stages (`figures`)
        return StepSums(zero, zero.clone(), torch.zeros((0, 0), dtype=torch.long), 1)

    def figures(self, trainer: Trainer, sums: StepSums) -> StepFigures:
        # load: (L, E) or None; DiLoCo: this replica's (its ranks of every stage), as at --pp 1
        return StepFigures(*self.run.step_figures(trainer.figure_group))

    def record(self, comm: dict[str, dict[str, float]]) -> dict[str, Any]:
        self.run.record_comm(comm)
        return {}

    def evaluate(self, trainer: Trainer, num_batches: int) -> float:
        return self.run.evaluate(trainer.sampler, num_batches)

    def full_state_dict(self, trainer: Trainer) -> Optional[dict[str, torch.Tensor]]:
        return self.run.full_state_dict()

    def describe(self, trainer: Trainer) -> list[str]:
        return [f"pipeline: {pipeline_config.describe(self.pipeline)}; {self.run.microbatch_rows} sequences per "
                f"micro-batch and data-parallel rank"]

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        report = self.run.report(trainer.optimizers)  # collective: before rank 0 goes on alone
        return {"pipeline": report} if report is not None else {}
