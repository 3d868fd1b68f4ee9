"""The fault-tolerant replica group plug-in of the `Trainer` (--ft-lighthouse; `job_ft.FTRun`, the engine
`shardfusion.ft.ReplicaGroup`): the steps come from the quorum, the gradients and figures are averaged over the live
replica groups after the backward, the commit is the vote (a discarded step comes again), the quorum's first group
writes the checkpoints, and the summary adds the ``fault_tolerance`` record (docs/fault-tolerance.md).

Under DiLoCo (``outer``: the run's `OuterMode`) the engine is `job_outer_ft.OuterFTRun` instead: the inner steps
are this group's alone (its `sync` gives this group's figures, its `commit` steps the optimizers), and DiLoCo's outer
step at the step boundary goes through the quorum (`OuterMode.step_through`)."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from shardfusion.train import ft_config
from shardfusion.train.ft_config import FTConfig
from shardfusion.train.job_ft import FTRun
from shardfusion.train.job_outer_ft import OuterFTRun
from shardfusion.train.mode import Mode, StepFigures, StepSums, Trainer
from shardfusion.train.outer_mode import OuterMode
from shardfusion.train.plain_mode import make_sampler, step_figures


class FTMode(Mode):
    """This rank's part of replica group --ft-replica-id. ``ft``: the fault-tolerance section (--ft-host resolved);
    ``fingerprint``: the digest of the settings every group must share (`job_ft.shared_settings`)."""

    saves_at_stop = True  # every group agrees on the last step's checkpoint: a late restart finds it

    def __init__(self, ft: FTConfig, fingerprint: str, outer: Optional[OuterMode] = None) -> None:
        self.ft, self.fingerprint, self.outer = ft, fingerprint, outer
        self.run: Optional[FTRun] = None
        self._figures: tuple[float, float] = (0.0, 0.0)
        self._report: Optional[dict[str, Any]] = None

    def samplers(self, trainer: Trainer, train: Any, val: Any, data_order: int) -> tuple[Any, Any]:
        topo = trainer.topo
        inner_rank, inner_world = topo.data_parallel_rank, topo.dp * topo.sharding
        dp_rank, dp_world = ft_config.data_slices(self.ft, inner_rank, inner_world)  # this group's slices
        sampler = make_sampler(trainer, train, val, data_order, dp_rank=dp_rank, dp_world=dp_world)
        # a replica group evaluates the whole validation set (the same one as HSDP)
        val_sampler = make_sampler(trainer, train, val, data_order, dp_rank=inner_rank, dp_world=inner_world)
        return sampler, val_sampler

    def steps(self, trainer: Trainer, start: int, stop: int) -> Iterable[int]:
        args = (self.ft, trainer.config.out, self.fingerprint, trainer.model, trainer.optimizers)
        if self.outer is None:
            self.run = FTRun(*args, start=start, device=trainer.device, is_main=trainer.is_main)
        else:  # DiLoCo: the inner steps alone, the quorum at the outer steps only
            self.run = OuterFTRun(*args, self.outer.run, start=start, device=trainer.device, is_main=trainer.is_main)
            self.outer.step_through(self.run.outer_step)
        return self.run.steps(stop)

    def sync(self, step: int, sums: StepSums) -> None:
        loss, aux = sums.means()  # gradients and figures over the live replica groups, then the vote
        self._figures = self.run.sync(step, loss, aux, loss.device)

    def commit(self, step: int) -> bool:
        return self.run.commit(step)  # False: discarded, the quorum gives this step again

    def figures(self, trainer: Trainer, sums: StepSums) -> StepFigures:
        return step_figures(trainer, *self._figures, sums.tokens)  # the expert load: this group's

    def record(self, comm: dict[str, dict[str, float]]) -> dict[str, Any]:
        return {"ft_participants": self.run.participants}

    def may_save(self) -> bool:
        return self.run.writes_checkpoints()  # the quorum's first group saves

    def end(self, trainer: Trainer) -> None:
        self._report = self.run.report()
        self.run.shutdown()

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        return {"fault_tolerance": self._report}
