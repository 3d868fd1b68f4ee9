"""The DiLoCo plug-in of the `Trainer` (--outer-sync diloco; `job_outer.OuterRun`, the engine
`shardfusion.diloco`): the replicas step alone and report their own figures, the outer step runs at the step
boundary, each rank's own state goes into the checkpoints, and the summary adds the ``outer_sync`` record
(docs/slow-links.md)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from shardfusion.train.dtype_flags import PrecisionConfig
from shardfusion.train.job_outer import OuterRun
from shardfusion.train.mode import Mode, Trainer
from shardfusion.train.outer_config import OuterConfig


class OuterMode(Mode):
    """This rank's DiLoCo. ``outer``: the outer-sync section; ``precision``: its wire format (--outer-comm-dtype);
    ``external``: fault-tolerant replica groups are the replicas (`shardfusion.diloco.DiLoCo`'s)."""

    def __init__(self, outer: OuterConfig, precision: PrecisionConfig, *, external: bool = False) -> None:
        self.outer, self.precision, self.external = outer, precision, external
        self.run: Optional[OuterRun] = None
        self._outer_step: Optional[Callable[[int], list[int]]] = None

    def step_through(self, outer_step: Callable[[int], list[int]]) -> None:
        """Run the outer steps through ``outer_step(done) -> fragments`` instead of `OuterRun.step` (fault
        tolerance: through the quorum of the live replica groups, `job_outer_ft.OuterFTRun.outer_step`)."""
        self._outer_step = outer_step

    def attach(self, trainer: Trainer) -> None:
        self.run = OuterRun(self.outer, self.precision, trainer.schedule.steps, trainer.model, trainer.topo,
                            trainer.optimizers, external=self.external)

    def figure_group(self) -> Any:
        return self.run.replica_group  # between outer steps the replicas differ: each reports its own

    def rank_state(self, placeholders: bool) -> dict[str, torch.Tensor]:
        return self.run.placeholders() if placeholders else self.run.rank_tensors()

    def restored(self, loaded: dict[str, torch.Tensor], start: int) -> Optional[str]:
        return self.run.restored(loaded, start)

    def boundary(self, done: int) -> dict[str, Any]:
        return {"outer_synced": (self._outer_step or self.run.step)(done)}  # the fragments due

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        d = self.run.diloco
        return {"outer_sync": {"mode": "diloco", "every": d.every, "lr": d.lr, "momentum": d.momentum,
                               "fragments": len(d.fragments), "outer_steps": list(d.outer_steps),
                               "comm_dtype": self.precision.outer_comm_dtype}}
