"""The one interface through which the job's modes plug into `shardfusion.train.trainer.Trainer`: the plain model
(`plain_mode`), pipeline stages (`pipeline_mode`), fault-tolerant replica groups (`ft_mode`) and DiLoCo
(`outer_mode`). docs/design.md draws one step through it and says how to add a mode.

A mode overrides the hooks it changes and leaves the others to the base class (which does nothing). The trainer
holds its modes in a fixed order (`Modes`): the pipeline, fault tolerance, DiLoCo, the plain model. Hooks of two
kinds:

- *decided* hooks (`Modes.first`): the first mode in that order that overrides the hook answers it alone (a run
  has one model mode: `shard`, `forward_backward`, `figures`, `evaluate`, `full_state_dict`; and a plug-in may
  take over `samplers`, `steps`, `commit`, `figure_group`);
- *added* hooks (`Modes.each`): every mode that overrides the hook runs, in that order, and dict results are merged
  in that order (`attach`, `rank_state`, `restored`, `sync`, `boundary`, `record`, `describe`, `end`, `summary`,
  and `may_save`, which every mode must allow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

Trainer = Any
"""A `shardfusion.train.trainer.Trainer`, whose attributes a mode reads (the trainer imports the modes, so a mode
names it without importing it: no import circle, not even through annotations)."""


@dataclass
class StepSums:
    """One step's figures on this rank, before any reduction: the micro-batches' summed cross-entropy and MoE
    load-balancing loss (0-dim, fp32 on the device) and tokens per expert ((L, E) int64; (0, 0) for a dense model).
    A pipeline mode, whose figures live in its stages, leaves them at zero."""

    loss: torch.Tensor
    aux: torch.Tensor
    tokens: torch.Tensor
    micro_batches: int

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, aux loss) means over the step's micro-batches (0-dim tensors)."""
        return self.loss / self.micro_batches, self.aux / self.micro_batches


@dataclass(frozen=True)
class StepFigures:
    """One step's reported figures, the same on every rank that reports them: the mean cross-entropy (nats/token),
    the mean MoE load-balancing loss (0.0 for a dense model) and the (L, E) int64 tokens per expert (None for a dense
    model)."""

    loss: float
    aux: float
    load: Optional[torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """What `Trainer.train_step` hands to the loop for one committed step."""

    figures: StepFigures
    grad_norm: float
    """The global gradient norm before clipping."""
    lr: float
    """AdamW's learning rate of the step."""
    record: dict[str, Any]
    """The modes' fields of the step's metrics record (`Mode.record`, `Mode.boundary`), in their order."""
    comm: dict[str, dict[str, float]]
    """The step's collectives (`sf.comm.CommCounter.summary`)."""


class Mode:
    """A way of running the job's step (see the module docstring). Every hook's default leaves the step as it is."""

    # ---- how the model is built and sharded ----

    def shard(self, trainer: Trainer) -> nn.Module | list[nn.Module]:
        """Decided: the sharded model (or this rank's list of stage models) on ``trainer.device``."""
        raise NotImplementedError

    def attach(self, trainer: Trainer) -> None:
        """Added: the model and ``trainer.optimizers`` exist, before a resume restores them."""

    def samplers(self, trainer: Trainer, train: Any, val: Any, data_order: int) -> tuple[Any, Any]:
        """Decided: (training sampler, evaluation sampler), `shardfusion.train.data.BatchSampler`s over the token
        arrays ``train`` and ``val``."""
        raise NotImplementedError

    def figure_group(self) -> Any:
        """Decided: the process group the step's figures are averaged over (default: the world)."""
        raise NotImplementedError

    # ---- what a checkpoint keeps ----

    def rank_state(self, placeholders: bool) -> dict[str, torch.Tensor]:
        """Added: this rank's own tensors a checkpoint keeps (``placeholders``: empty ones, for a restore to fill)."""
        return {}

    def restored(self, loaded: dict[str, torch.Tensor], start: int) -> Optional[str]:
        """Added: put back what a restore loaded (``loaded``: the placeholders, filled); a note if not exact."""
        return None

    def may_save(self) -> bool:
        """Added (all must allow): whether this rank's group writes this step's checkpoint."""
        return True

    saves_at_stop: bool = False
    """Whether the run's last step is always saved (any mode that says so decides)."""

    # ---- one step ----

    def steps(self, trainer: Trainer, start: int, stop: int) -> Iterable[int]:
        """Decided: the steps to train, from ``start`` to ``stop`` (a step may come again)."""
        raise NotImplementedError

    def forward_backward(self, trainer: Trainer, step: int) -> StepSums:
        """Decided: forward and backward of every micro-batch of ``step``; the gradients are this replica's when it
        returns."""
        raise NotImplementedError

    def sync(self, step: int, sums: StepSums) -> None:
        """Added: synchronize the step's gradients beyond what the sharded model's hooks did (before clipping)."""

    def commit(self, step: int) -> bool:
        """Decided: apply the step (the trainer's default: every optimizer steps); False: discarded, the step
        comes again (`steps`)."""
        raise NotImplementedError

    def boundary(self, done: int) -> dict[str, Any]:
        """Added: what runs after committed step ``done`` (1-based); fields for the step's metrics record."""
        return {}

    def figures(self, trainer: Trainer, sums: StepSums) -> StepFigures:
        """Decided: the step's figures, the same on every reporting rank (collective)."""
        raise NotImplementedError

    def record(self, comm: dict[str, dict[str, float]]) -> dict[str, Any]:
        """Added: fields of the step's metrics record; ``comm``: the step's `CommCounter.summary()`."""
        return {}

    # ---- evaluation and the end of the run ----

    def evaluate(self, trainer: Trainer, num_batches: int) -> float:
        """Decided: the mean validation loss over the fixed validation set, the same on every rank (collective)."""
        raise NotImplementedError

    def full_state_dict(self, trainer: Trainer) -> Optional[dict[str, torch.Tensor]]:
        """Decided: every parameter of the whole model (at least on rank 0). Collective."""
        raise NotImplementedError

    def describe(self, trainer: Trainer) -> list[str]:
        """Added: rank 0's console lines about this mode at the start."""
        return []

    def end(self, trainer: Trainer) -> None:
        """Added: after the last step, before the sample (collective where the mode's engine needs it)."""

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """Added: summary.json's fields of this mode (collective: called on every rank; rank 0 writes them)."""
        return {}


class Modes:
    """The trainer's modes in their fixed order (see the module docstring)."""

    def __init__(self, modes: Iterable[Mode]) -> None:
        self.modes = list(modes)

    def _overrides(self, name: str) -> Iterator[Mode]:
        return (m for m in self.modes if getattr(type(m), name) is not getattr(Mode, name))

    def has(self, name: str) -> bool:
        """Whether any mode overrides hook ``name``."""
        return next(self._overrides(name), None) is not None

    def first(self, name: str, default: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
        """The decided hook ``name``: the first overriding mode's bound method, else ``default``.

        Raises:
            LookupError: no mode overrides it and there is no default (a run without a model mode).
        """
        mode = next(self._overrides(name), None)
        if mode is not None:
            return getattr(mode, name)
        if default is None:
            raise LookupError(f"no mode of {[type(m).__name__ for m in self.modes]} answers {name}")
        return default

    def each(self, name: str) -> list[Callable[..., Any]]:
        """The added hook ``name``: every overriding mode's bound method, in order."""
        return [getattr(m, name) for m in self._overrides(name)]

    def merged(self, name: str, *args: Any) -> dict[str, Any]:
        """The dicts of the added hook ``name`` merged in order."""
        out: dict[str, Any] = {}
        for hook in self.each(name):
            out.update(hook(*args))
        return out

    def __iter__(self) -> Iterator[Mode]:
        return iter(self.modes)
