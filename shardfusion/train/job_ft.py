"""A fault-tolerant replica group in the training job (--ft-lighthouse): the steps come from the quorum, not from a
range. `shardfusion.train.job` runs its usual loop over `FTRun.steps`; per step it calls `FTRun.sync` after the
backward (gradients and the step's figures averaged over the live replica groups, then the vote) and
`FTRun.commit` instead of stepping the optimizers. A discarded step is yielded again, with the same batch: its
samples were never applied. `FTRun.report` is the summary's `fault_tolerance` record. The engine is
`shardfusion.ft.ReplicaGroup`; the flags `shardfusion.train.ft_config`; docs/fault-tolerance.md the whole story.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion.ft import ReplicaGroup
from shardfusion.train import ft_config

WAIT_POLL_S = 1.0
"""Seconds between two quorums while fewer than --ft-min-replicas replica groups are up."""
PAUSE_ENV = "SHARDFUSION_FT_PAUSE_AT"
"""Fault injection for tests and benchmarks (benchmarks/ft.py): with this set to a step, every rank of the group
stops inside that step, after its backward and before the gradients are averaged, and sleeps until it is killed;
rank 0 first writes OUT/replica-<id>/`PAUSED_FILE`. A kill then lands mid-step, while the peers wait in the
average: the case the discard exists for."""
PAUSED_FILE = "paused"


class FTRun:
    """This rank's part of replica group --ft-replica-id (see the module docstring). ``start``: the step this job
    resumed at from its own checkpoint (0 for a new one); a peer further on is copied at the first quorum."""

    def __init__(self, config: Any, model: nn.Module | Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 *, start: int, device: torch.device, is_main: bool) -> None:
        self.config, self.is_main, self.device = config, is_main, device
        self.t0 = time.perf_counter()
        self.group = ReplicaGroup(model, optimizers, lighthouse=config.ft_lighthouse,
                                  replica_id=config.ft_replica_id, replicas=config.ft_replicas,
                                  min_replicas=config.ft_min_replicas, timeout=timedelta(seconds=config.ft_timeout),
                                  quorum_timeout=timedelta(seconds=config.ft_quorum_timeout),
                                  max_discards=config.ft_max_discards, host=config.ft_host,
                                  fingerprint=ft_config.settings_fingerprint(config), device=device)
        if start:
            self.group.manager.load_state_dict({"step": start, "batches_committed": 0})
        self.participants: int | None = None  # of the last quorum
        self.changes: list[dict[str, Any]] = []  # the quorum's membership: {"step", "participants", "was", "at_s"}
        self.failures: list[dict[str, Any]] = []  # discarded steps: {"step", "participants", "at_s", "lost_s"}
        self.waits: list[dict[str, Any]] = []  # quorums below --ft-min-replicas
        self._open_failure: dict[str, Any] | None = None
        self._step_started = 0.0

    def _say(self, text: str) -> None:
        if self.is_main:
            print(f"shardfusion: ft replica {self.config.ft_replica_id}: {text}", flush=True)

    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

    def steps(self, stop: int) -> Iterator[int]:
        """The steps to train, from the quorum: before each, join it (a replica behind the others receives the
        live state here, `shardfusion.ft.ReplicaGroup.start_step`); a committed step moves on, a discarded one comes
        again. Fewer than --ft-min-replicas groups up, or a new run's first quorum without all --ft-replicas
        (for at most --ft-join-wait seconds): wait, saying so. Ends at ``stop``."""
        waiting_since, first_quorum = None, time.perf_counter()
        while True:
            self._step_started = time.perf_counter()
            recoveries = len(self.group.record.recoveries)
            self.group.start_step()
            step, n = self.group.step, self.group.participants()
            if len(self.group.record.recoveries) > recoveries:
                got = self.group.record.recoveries[-1]
                self._say(f"recovered step {step} from a live peer: {got['bytes'] / 2**20:.1f} MiB of state in "
                          f"{got['seconds']:.2f} s")
            if n != self.participants:
                if self.participants is not None:
                    self._say(f"step {step}: {n} replica group(s) in the quorum (was {self.participants})")
                self.changes.append({"step": step, "participants": n, "was": self.participants, "at_s": self._now()})
                self.participants = n
            joining = (n >= self.config.ft_min_replicas and step == 0 and n < self.config.ft_replicas
                       and self._agree_to_wait(time.perf_counter() - first_quorum < self.config.ft_join_wait))
            if n < self.config.ft_min_replicas or joining:
                if waiting_since is None:
                    waiting_since = time.perf_counter()
                    why = (f"--ft-min-replicas {self.config.ft_min_replicas}" if n < self.config.ft_min_replicas
                           else f"--ft-replicas {self.config.ft_replicas} (a new run waits up to --ft-join-wait "
                                f"{self.config.ft_join_wait:g} s for all)")
                    self._say(f"waiting at step {step}: {n} replica group(s) in the quorum, waiting for {why}; "
                              f"lighthouse {self.config.ft_lighthouse}")
                # close this quorum's step without committing it: nothing was trained
                self.group.manager.report_error(RuntimeError("waiting for replica groups"))
                self.group.manager.should_commit()
                time.sleep(WAIT_POLL_S)
                continue
            if waiting_since is not None:
                self.waits.append({"step": step, "participants": n,
                                   "seconds": round(time.perf_counter() - waiting_since, 3)})
                self._say(f"{n} replica group(s) in the quorum after {self.waits[-1]['seconds']:.1f} s: training")
                waiting_since = None
            if step >= stop:
                return
            yield step

    def _agree_to_wait(self, mine: bool) -> bool:
        """Whether the quorum's groups go on waiting for a new run's missing groups: this group's answer is its
        rank 0's (broadcast: one clock per group), and the quorum waits while any group's does (a SUM over the
        groups). A failed collective: wait, the next quorum asks again. Collective over the group and the
        quorum."""
        flag = torch.tensor([int(mine)], dtype=torch.long, device=self.device)  # NCCL's default group: device
        dist.broadcast(flag, 0)
        flag = flag.cpu()  # the replica groups' process group is gloo's
        self.group.manager.allreduce(flag, reduce_op=dist.ReduceOp.SUM).wait()
        return self.group.manager.errored() is not None or int(flag) > 0

    def sync(self, step: int, loss: torch.Tensor, aux: torch.Tensor, device: torch.device) -> tuple[float, float]:
        """Average the gradients over the live replica groups and vote (`ReplicaGroup.sync_gradients`); returns
        the step's (loss, aux loss), each the mean over this group's ranks and then over the live groups."""
        figures = torch.stack([loss.detach().float(), aux.detach().float()]).to(device)
        dist.all_reduce(figures)
        figures /= dist.get_world_size()
        if os.environ.get(PAUSE_ENV) == str(step):
            self._pause(step)
        self.group.sync_gradients(figures)
        return float(figures[0]), float(figures[1])

    def _pause(self, step: int) -> None:
        """`PAUSE_ENV`: say so, write the marker, sleep until killed."""
        if self.is_main:
            self._say(f"paused inside step {step} ({PAUSE_ENV})")
            folder = Path(ft_config.outputs_folder(self.config, self.config.out))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / PAUSED_FILE).write_text(f"{step}\n")
        while True:
            time.sleep(3600)

    def commit(self, step: int) -> bool:
        """Step the optimizers if the vote passed (`ReplicaGroup.commit`); a discarded step is recorded and said."""
        ok = self.group.commit()
        if ok and self._open_failure is not None:
            self._open_failure["lost_s"] = round(time.perf_counter() - self._open_failure.pop("_t"), 3)
            self._open_failure = None
        if not ok:
            self.failures.append({"step": step, "participants": self.participants, "at_s": self._now(),
                                  "_t": self._step_started})
            self._open_failure = self._open_failure or self.failures[-1]
            self._say(f"step {step} discarded (a replica group failed during it); retrying it with the live ones")
        return ok

    def writes_checkpoints(self) -> bool:
        """Whether this group writes this step's checkpoint: the first of the quorum's groups only."""
        return self.group.manager.participating_rank() == 0

    def report(self) -> dict[str, Any]:
        """The summary's ``fault_tolerance`` record (seconds on this group's rank 0): committed steps, the
        quorum's membership changes, the discarded steps (``lost_s``: from the failed step's start to the next
        commit), the recoveries from a peer (bytes, seconds), the waits below --ft-min-replicas, and each group
        rank's `ReplicaGroup.state_digest` (equal across replica groups: bitwise the same state). Collective over
        the group."""
        record = self.group.record
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, self.group.state_digest())
        return {"replica_id": self.config.ft_replica_id, "replicas": self.config.ft_replicas,
                "min_replicas": self.config.ft_min_replicas, "committed_steps": record.committed,
                "quorum_changes": self.changes,
                "discarded": [{k: v for k, v in f.items() if not k.startswith("_")} for f in self.failures],
                "recoveries": record.recoveries, "waits": self.waits, "state_digests": digests}

    def shutdown(self) -> None:
        self.group.shutdown()


def format_ft(ft: dict[str, Any]) -> list[str]:
    """The summary's fault-tolerance lines."""
    lines = [f"fault tolerance  replica group {ft['replica_id']} of {ft['replicas']} (min {ft['min_replicas']}): "
             f"{ft['committed_steps']} steps committed, {len(ft['discarded'])} discarded, "
             f"{len(ft['recoveries'])} recoveries, {len(ft['quorum_changes']) - 1} quorum changes"]
    for d in ft["discarded"]:
        lost = f", {d['lost_s']:.2f} s to the next commit" if "lost_s" in d else ""
        lines.append(f"  discarded step {d['step']} at {d['at_s']:.1f} s ({d['participants']} groups){lost}")
    for r in ft["recoveries"]:
        lines.append(f"  recovered at step {r['step']}: {r['bytes'] / 2**20:.1f} MiB in {r['seconds']:.2f} s")
    for w in ft["waits"]:
        lines.append(f"  waited {w['seconds']:.1f} s at step {w['step']} for --ft-min-replicas")
    return lines
