"""DiLoCo across fault-tolerant replica groups (--outer-sync diloco with --ft-lighthouse): torchft's semi-synchronous
setting. Each replica group (a job of its own, `shardfusion.train.job_ft`) takes its --outer-every inner steps alone,
with no quorum and no traffic between the groups; the outer steps are where the groups meet: a torchft quorum of the
groups alive, the mean of their pseudo-gradients over it, the vote, and the same Nesterov step on every group.

`shardfusion.train.job` builds an `OuterFTRun` in place of the `job_ft.FTRun` when both modes are on and runs its
usual loop: `steps` yields the inner steps, `sync` gives the step's figures (this group's mean), `commit` steps the
optimizers locally, and `outer_step` after each inner step runs the outer step of the fragments due, through the
quorum. The engines: `shardfusion.diloco.DiLoCo` (``external=True``: the replicas are the groups) and
`shardfusion.ft.ReplicaGroup.average_over_quorum`; docs/fault-tolerance.md and docs/slow-links.md the whole story.

Committed: what an outer step that the quorum voted for wrote (the snapshot, the momentum, the outer step counts;
every group bitwise the same). Nothing committed is lost when a group dies:

- between outer steps (in its inner steps): the survivors notice nothing until their next outer step, whose quorum
  forms without the dead group (after the lighthouse's heartbeat timeout); its mean is over the survivors;
- during an outer step (a collective fails, or the vote): the survivors' quorum does not commit; they join a new
  one and run the same outer step again from the same pseudo-gradients (snapshot - shard: neither changed);
- a restarted group resumes from the run's checkpoint, then joins the quorum before its first inner step and waits
  there (up to --ft-join-wait) for the others' next outer step. At that quorum it is behind, so torchft copies a
  live peer's state to it (shards, AdamW, snapshot, momentum, outer step counts, the step itself), and it takes part
  in that outer step with no pseudo-gradient of its own (`shardfusion.ft.ReplicaGroup.average_over_quorum`'s
  ``contributes`` False): the step is what the groups that trained the period compute, and every group ends it
  bitwise the same.

Whose data a period trains: each group its own slice of each global batch (`ft_config.data_slices`), as HSDP's
replicas; a group that is down leaves its slices out of the period's outer step, and a group that joins at an outer
step trains from the next period on (its share of the periods it missed is not made up).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion.train.ft_config import FTConfig
from shardfusion.train.job_ft import FTRun
from shardfusion.train.job_outer import OuterRun

JOIN_POLL_S = 0.05
"""Seconds between two quorums while a group waits to join (`job_ft.FTRun.quorum`): the others come to a quorum only
at their outer steps, so the waiting group asks almost without pause (each lone quorum itself takes the
lighthouse's join timeout) and is in the quorum the moment they are."""


class OuterFTRun(FTRun):
    """This rank's part of replica group --ft-replica-id under DiLoCo (see the module docstring). ``outer``: the
    group's `job_outer.OuterRun` (its DiLoCo built with ``external=True``, its checkpoint state already restored);
    the rest as `job_ft.FTRun`."""

    def __init__(self, ft: FTConfig, out: str, fingerprint: str, model: nn.Module | Sequence[nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer], outer: OuterRun, *, start: int, device: torch.device,
                 is_main: bool) -> None:
        self.outer, self.optimizers = outer, list(optimizers)
        super().__init__(ft, out, fingerprint, model, optimizers, start=start, device=device, is_main=is_main,
                         extra_state=(outer.recovery_state, outer.load_recovery_state))
        self.poll_s = JOIN_POLL_S
        self._at = start

    def steps(self, stop: int) -> Iterator[int]:
        """The inner steps to train: first a quorum before any (the start, or the join of a restarted group, which
        may move this group to a live peer's step), then ``at``, ``at + 1``, ... as `outer_step` moves them, up to
        ``stop``."""
        self._at = self._outer_quorum(self.start, trained=False)
        while self._at < stop:
            yield self._at

    def sync(self, step: int, loss: torch.Tensor, aux: torch.Tensor, device: torch.device) -> tuple[float, float]:
        """The step's (loss, aux loss), each the mean over this group's ranks (an inner step: nothing crosses the
        groups)."""
        figures = self._group_figures(step, loss, aux, device)
        return float(figures[0]), float(figures[1])

    def commit(self, step: int) -> bool:
        """An inner step: the optimizers step on this group's own gradients. Always True."""
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return True

    def outer_step(self, done: int) -> list[int]:
        """After inner step ``done`` (1-based): the outer step of the fragments due then (`OuterRun.due_at`),
        through the quorum; returns them (empty: no quorum at this step)."""
        self._at = done
        fragments = self.outer.due_at(done)
        if fragments:
            self._at = self._outer_quorum(done, trained=True)
        return fragments

    def _outer_quorum(self, step: int, trained: bool) -> int:
        """Join a quorum at ``step`` and run the outer step of the fragments due at the quorum's step, with this
        group's pseudo-gradients if ``trained`` (it took inner steps since the last outer step and was not healed
        at this quorum); again, from a new quorum, until one commits. Returns the quorum's step."""
        manager, d = self.group.manager, self.outer.diloco
        while True:
            manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})
            recoveries = len(self.group.record.recoveries)
            at = self.quorum()  # a group behind the quorum's step is healed here: a live peer's state and step
            contributes = trained and at == step and len(self.group.record.recoveries) == recoveries
            fragments = self.outer.due_at(at)
            deltas = [d.pseudo_gradients(f) for f in fragments]
            contributing = self.group.average_over_quorum([t for ts in deltas for t in ts], contributes)
            if contributing is None:
                self._say(f"the outer step at step {at} did not commit (a replica group failed during it); running "
                          f"it again with the live ones")
                self.failures.append({"step": at, "participants": self.participants, "at_s": self._now()})
                step, trained = at, contributes
                continue
            if contributing:
                for f, mean in zip(fragments, deltas):
                    d.apply(f, mean)
            d.inner_steps = at
            return at

    def report(self) -> dict[str, Any]:
        """`job_ft.FTRun.report`, and each group rank's digest of its parameters alone (``shard_digests``:
        `shardfusion.ft.ReplicaGroup.state_digest` without the optimizers; equal across the groups after an outer
        step they all took, while each keeps its own AdamW state). Collective over the group."""
        record = super().report()
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, self.group.state_digest(optimizers=False))
        return {**record, "shard_digests": digests}
