"""A fault-tolerant replica group in the training job (--ft-lighthouse): the steps come from the quorum, not from a
range. `shardfusion.train.job` runs its usual loop over `FTRun.steps`; per step it calls `FTRun.sync` after the
backward (gradients and the step's figures averaged over the live replica groups, then the vote) and
`FTRun.commit` instead of stepping the optimizers. A discarded step is yielded again, with the same batch: its
samples were never applied. `FTRun.report` is the summary's `fault_tolerance` record. The engine is
`shardfusion.ft.ReplicaGroup`; the flags `shardfusion.train.ft_config`; docs/fault-tolerance.md the whole story.
With --outer-sync diloco the job builds `shardfusion.train.job_outer_ft.OuterFTRun` instead (a quorum at the outer
steps only), which shares `FTRun.quorum`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion.ft import FTError, ReplicaGroup
from shardfusion.train import ft_config, outer_config
from shardfusion.train.config import ResolvedJob
from shardfusion.train.ft_config import FTConfig

WAIT_POLL_S = 1.0
"""Seconds between two quorums while fewer than --ft-min-replicas replica groups are up."""
PAUSE_ENV = "SHARDFUSION_FT_PAUSE_AT"
"""Fault injection for tests and benchmarks (benchmarks/ft.py): with this set to a step S (or to steps S1,S2,...),
every rank of the group stops inside the first step >= S it trains (once per S), after its backward and before the
gradients are averaged; rank 0 first writes OUT/replica-<id>/`PAUSED_FILE` (holding the step). The ranks sleep
until the group is killed or the marker is removed (then the step goes on). A kill, or a SIGSTOP, then lands
mid-step, while the peers wait in the average: the case the discard exists for."""
PAUSED_FILE = "paused"
PAUSE_S = 300.0
"""How long `PAUSE_ENV` pauses before the group gives up with an error (a leftover setting cannot hang a run)."""
PAUSE_POLL_S = 0.05
"""Seconds between two looks at the marker while paused."""
LOG_FILE = "torchft.log"
"""torchft's own output, in OUT/replica-<id>/ (`route_torchft_output`): its Python loggers and warnings."""
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
"""torchft's Python loggers: its modules' (``torchft.*``) and the three it names for quorums, commits and errors."""
RUST_LOG_LEVEL = "warn"
"""RUST_LOG for torchft's Rust side, whose log lines go to stderr (about 9 INFO lines per step at its default
level): warnings and errors only, unless RUST_LOG is set already (`quiet_torchft_rust`)."""


def shared_settings(config: ResolvedJob) -> dict[str, Any]:
    """The settings every replica group of the run must share (`shardfusion.ft.agreement` compares their digest):
    the fields marked ``ft_shared``, and with --outer-sync diloco the outer section too (every group runs the same
    outer steps). Without DiLoCo exactly the marked fields, so the digest of a run saved before DiLoCo could run
    under fault tolerance is unchanged."""
    shared = config.marked("ft_shared")
    if outer_config.enabled(config.outer):
        shared["outer"] = dataclasses.asdict(config.outer)
    return shared


def quiet_torchft_rust() -> None:
    """Set RUST_LOG to `RUST_LOG_LEVEL` unless it is set. torchft reads it when it is first imported, so this runs
    before that, in the process that starts the workers (which inherit it) and, under torchrun, in each worker."""
    os.environ.setdefault("RUST_LOG", RUST_LOG_LEVEL)


def route_torchft_output(folder: str | os.PathLike, rank: int) -> Path:
    """Send torchft's Python output to ``folder``/`LOG_FILE` instead of the console: the records of its loggers
    (`TORCHFT_LOGGERS`, INFO and up: the quorums, the commits, the tracebacks of the failures it handles) and the
    warnings raised in its modules, each line tagged with the rank. Appends (every rank of the group, and every
    restart, to the same file). Returns the file's path."""
    path = Path(folder) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", delay=True)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(name)s %(levelname)s: %(message)s"))
    handler._shardfusion = True  # type: ignore[attr-defined]  # a second call replaces it instead of adding one
    handler.addFilter(lambda record: bool(record.getMessage()) or record.exc_info is not None)  # torchft_quorums'
    # and torchft_commits' records carry their data for OpenTelemetry only, with an empty message
    for name in TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if not getattr(h, "_shardfusion", False)] + [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False  # not to the root logger's handlers, nor to logging's last resort (stderr)
    shown = warnings.showwarning
    torchft_files = os.sep + "torchft" + os.sep

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if torchft_files in str(filename):
            logging.getLogger("torchft").warning(warnings.formatwarning(message, category, filename, lineno,
                                                                        line).rstrip())
        else:
            shown(message, category, filename, lineno, file, line)

    if not getattr(shown, "_shardfusion", False):
        show._shardfusion = True  # type: ignore[attr-defined]
        warnings.showwarning = show
    return path


class FTRun:
    """This rank's part of replica group --ft-replica-id (see the module docstring). ``ft``: the fault-tolerance
    section (--ft-host resolved); ``out``: the run folder; ``fingerprint``: the settings every group must share
    (`ft_config.settings_fingerprint` of `shared_settings`); ``start``: the step this job resumed at from its own
    checkpoint (0 for a new one); a peer further on is copied at the first quorum."""

    def __init__(self, ft: FTConfig, out: str, fingerprint: str, model: nn.Module | Sequence[nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer], *, start: int, device: torch.device, is_main: bool,
                 extra_state: tuple[Callable[[], dict], Callable[[dict], None]] | None = None) -> None:
        self.ft, self.out, self.is_main, self.device = ft, out, is_main, device
        self.t0 = time.perf_counter()
        self.log = route_torchft_output(ft_config.outputs_folder(ft, out), dist.get_rank())
        try:
            self.group = ReplicaGroup(model, optimizers, lighthouse=ft.ft_lighthouse,
                                      replica_id=ft.ft_replica_id, replicas=ft.ft_replicas,
                                      min_replicas=ft.ft_min_replicas,
                                      timeout=timedelta(seconds=ft.ft_timeout),
                                      quorum_timeout=timedelta(seconds=ft.ft_quorum_timeout),
                                      max_discards=ft.ft_max_discards, host=ft.ft_host, fingerprint=fingerprint,
                                      extra_state=extra_state, device=device)
        except ValueError as error:  # e.g. the lighthouse refused this group: one line, as the other FT errors
            raise FTError(str(error)) from None
        self.start = start
        if start:
            self.group.manager.load_state_dict({"step": start, "batches_committed": 0})
        if os.environ.get(PAUSE_ENV):
            self._say(f"warning: {PAUSE_ENV}={os.environ[PAUSE_ENV]} is set: this group stops inside the first "
                      f"step from each of these on, for a test's kill (unset it for a real run)")
        self._pause_at = sorted(int(s) for s in os.environ.get(PAUSE_ENV, "").split(",") if s.strip())
        self._say(f"torchft's own log: {self.log}")
        self.participants: int | None = None  # of the last quorum
        self.changes: list[dict[str, Any]] = []  # the quorum's membership: {"step", "participants", "was", "at_s"}
        self.failures: list[dict[str, Any]] = []  # discarded steps: {"step", "participants", "at_s", "lost_s"}
        self.waits: list[dict[str, Any]] = []  # quorums below --ft-min-replicas
        self._open_failure: dict[str, Any] | None = None
        self._step_started = 0.0
        self._first_quorum: float | None = None
        self.poll_s = WAIT_POLL_S

    def _say(self, text: str) -> None:
        if self.is_main:
            print(f"shardfusion: ft replica {self.ft.ft_replica_id}: {text}", flush=True)

    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

    def steps(self, stop: int) -> Iterator[int]:
        """The steps to train, from the quorum: before each, join it (`quorum`); a committed step moves on, a
        discarded one comes again. Ends at ``stop``.

        Raises:
            FTError: what `quorum` raises.
        """
        while True:
            step = self.quorum()
            if step >= stop:
                return
            yield step

    def quorum(self) -> int:
        """Join the next quorum and return its step (a replica behind the others receives the live state here,
        `shardfusion.ft.ReplicaGroup.start_step`). Fewer than --ft-min-replicas groups up, or a run (re)starting
        without all --ft-replicas (for at most --ft-join-wait seconds, `_agree_to_wait`): wait, saying so, and join
        again every `poll_s` seconds.

        Raises:
            FTError: what `shardfusion.ft.ReplicaGroup.start_step` raises, or more than --ft-max-discards waits in
                a row whose collectives failed (the groups cannot reach each other).
        """
        waiting_since, failed_waits = None, 0
        if self._first_quorum is None:
            self._first_quorum = time.perf_counter()
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
            joining = failed = False
            if self.ft.ft_min_replicas <= n < self.ft.ft_replicas:  # n is the quorum's: all groups ask
                wish = (step == self.start and time.perf_counter() - self._first_quorum < self.ft.ft_join_wait)
                joining, failed = self._agree_to_wait(wish)
            failed_waits = failed_waits + 1 if failed else 0
            if failed_waits > self.ft.ft_max_discards:
                raise FTError(f"{failed_waits} quorums in a row whose collectives failed while waiting for "
                              f"--ft-replicas {self.ft.ft_replicas} (--ft-max-discards "
                              f"{self.ft.ft_max_discards}): can every group reach this one at --ft-host "
                              f"{self.ft.ft_host}?")
            if n < self.ft.ft_min_replicas or joining:
                if waiting_since is None:
                    waiting_since = time.perf_counter()
                    why = (f"--ft-min-replicas {self.ft.ft_min_replicas}" if n < self.ft.ft_min_replicas
                           else f"--ft-replicas {self.ft.ft_replicas} (a run starting or restarting from a "
                                f"checkpoint waits up to --ft-join-wait {self.ft.ft_join_wait:g} s for all)")
                    waiting_for = "--ft-min-replicas" if n < self.ft.ft_min_replicas else "--ft-join-wait"
                    self._say(f"waiting at step {step}: {n} replica group(s) in the quorum, waiting for {why}; "
                              f"lighthouse {self.ft.ft_lighthouse}")
                # close this quorum's step without committing it: nothing was trained
                self.group.manager.report_error(RuntimeError("waiting for replica groups"))
                self.group.manager.should_commit()
                time.sleep(self.poll_s)
                continue
            if waiting_since is not None:
                self.waits.append({"step": step, "participants": n, "for": waiting_for,
                                   "seconds": round(time.perf_counter() - waiting_since, 3)})
                self._say(f"{n} replica group(s) in the quorum after {self.waits[-1]['seconds']:.1f} s: training")
            return step

    def _agree_to_wait(self, mine: bool) -> tuple[bool, bool]:
        """(wait, failed): whether the quorum's groups wait for the missing ones, asked at every quorum with
        fewer than --ft-replicas groups. A group wishes to wait (``mine``, its rank 0's: one clock per group) while
        it has made no progress since it started (the quorum's step is still the one it started at: a new run, or
        every group restarted from one checkpoint; a group that joins a running quorum has been healed past it)
        and its --ft-join-wait has not run out; the quorum waits while any group wishes to (a SUM over the groups).
        ``failed``: the collective between the groups failed (then wait: the next quorum asks again). The group's
        ranks then agree (a MAX over the group), so all of them take the same branch. Collective over the group
        and the quorum: two 1-element all-reduces and a broadcast while a group is missing."""
        flag = torch.tensor([int(mine)], dtype=torch.long, device=self.device)  # NCCL's default group: device
        dist.broadcast(flag, 0)
        cross = flag.cpu()  # the replica groups' process group is gloo's
        self.group.manager.allreduce(cross, reduce_op=dist.ReduceOp.SUM).wait()
        failed = self.group.manager.errored() is not None
        verdict = torch.tensor([int(failed), int(failed or int(cross) > 0)], dtype=torch.long, device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        return bool(verdict[1]), bool(verdict[0])

    def sync(self, step: int, loss: torch.Tensor, aux: torch.Tensor, device: torch.device) -> tuple[float, float]:
        """Average the gradients over the live replica groups and vote (`ReplicaGroup.sync_gradients`); returns
        the step's (loss, aux loss), each the mean over this group's ranks and then over the live groups."""
        figures = self._group_figures(step, loss, aux, device)
        self.group.sync_gradients(figures)
        return float(figures[0]), float(figures[1])

    def _group_figures(self, step: int, loss: torch.Tensor, aux: torch.Tensor, device: torch.device
                       ) -> torch.Tensor:
        """(2,) float32: the step's loss and aux loss, each the mean over this group's ranks; then the pause of
        `PAUSE_ENV`, if this step is one. Collective over the group."""
        figures = torch.stack([loss.detach().float(), aux.detach().float()]).to(device)
        dist.all_reduce(figures)
        figures /= dist.get_world_size()
        if self._pause_at and step >= self._pause_at[0]:
            self._pause_at = [s for s in self._pause_at if s > step]  # once each
            self._pause(step)
        return figures

    def _pause(self, step: int) -> None:
        """`PAUSE_ENV`: say so, write the marker, sleep until killed or until the marker is removed. Collective
        over the group (a barrier after the marker is written, so that no rank looks for it before)."""
        marker = Path(ft_config.outputs_folder(self.ft, self.out)) / PAUSED_FILE
        if self.is_main:
            self._say(f"paused inside step {step} ({PAUSE_ENV})")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{step}\n")
        dist.barrier()
        until = time.monotonic() + PAUSE_S
        while marker.exists() and time.monotonic() < until:
            time.sleep(PAUSE_POLL_S)
        if marker.exists():
            raise FTError(f"{PAUSE_ENV}={step}: paused {PAUSE_S:g} s inside step {step} and nobody killed this "
                          f"group; unset {PAUSE_ENV} (a test's fault injection)")
        self._say(f"resumed inside step {step} ({PAUSED_FILE} removed)")

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
        return {"replica_id": self.ft.ft_replica_id, "replicas": self.ft.ft_replicas,
                "min_replicas": self.ft.ft_min_replicas, "committed_steps": record.committed,
                "quorum_changes": self.changes,
                "discarded": [{k: v for k, v in f.items() if not k.startswith("_")} for f in self.failures],
                "recoveries": record.recoveries, "waits": self.waits, "state_digests": digests}

    def shutdown(self) -> None:
        """Stop the replica group's torchft manager (`ReplicaGroup.shutdown`), after the last step. Local."""
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
        lines.append(f"  waited {w['seconds']:.1f} s at step {w['step']} for {w.get('for', '--ft-min-replicas')}")
    return lines
