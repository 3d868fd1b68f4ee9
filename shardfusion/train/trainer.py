"""The training job's `Trainer`: one worker's run as build, loop and finish, whose `Trainer.train_step` is the data
flow of one optimizer step. Pipeline stages, fault-tolerant replica groups and DiLoCo plug in through the `Mode`
interface (`shardfusion.train.mode`), composed by `modes_for`; docs/design.md draws one step and says how to add a
mode. `shardfusion.train.job.train` runs it in each worker.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

import shardfusion as sf
from shardfusion.train import data_config, ft_config, job_model, outer_config, parallelize
from shardfusion.train import resume as train_state
from shardfusion.train import tokenizer as tokenizers
from shardfusion.train.config import PLANNED, ResolvedJob
from shardfusion.train.data import DATA_ORDER
from shardfusion.train.ft_mode import FTMode
from shardfusion.train.job_ft import shared_settings
from shardfusion.train.metrics import MetricsLog
from shardfusion.train.mode import Mode, Modes, StepResult
from shardfusion.train.optim import balance_record, build_optimizers, muon_matrices, set_learning_rates
from shardfusion.train.outer_mode import OuterMode
from shardfusion.train.pipeline_mode import PipelineMode
from shardfusion.train.plain_mode import PlainMode, make_sampler
from shardfusion.train import trainer_outputs as outputs


def modes_for(config: ResolvedJob) -> Modes:
    """The run's modes in their fixed order: the pipeline (--pp > 1), fault tolerance (--ft-lighthouse), DiLoCo
    (--outer-sync diloco), the plain model (--pp 1). Each takes its own section (fault tolerance also the digest of
    the settings every replica group must share, and under DiLoCo the DiLoCo mode, whose outer steps then go through
    the quorum; DiLoCo its wire format)."""
    modes: list[Mode] = []
    if config.pipeline.pp > 1:
        modes.append(PipelineMode(config.pipeline))
    ft = ft_config.enabled(config.ft)
    outer = OuterMode(config.outer, config.precision, external=ft) if outer_config.enabled(config.outer) else None
    if ft:  # under DiLoCo: the quorum at its outer steps
        modes.append(FTMode(config.ft, ft_config.settings_fingerprint(shared_settings(config)), outer))
    if outer is not None:
        modes.append(outer)
    if config.pipeline.pp == 1:
        modes.append(PlainMode(config.model))
    return Modes(modes)


class Trainer:
    """One worker's training run (every rank builds one; collective where the step is).

    Args:
        config: the resolved job (`shardfusion.train.config.resolve`); the trainer reads its sections.
        device: this rank's device (`shardfusion.train.launch.init_worker`).
    """

    def __init__(self, config: ResolvedJob, device: torch.device) -> None:
        self.t_start = time.perf_counter()
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.modes = modes_for(config)
        self._take(config)
        self.start, self.elapsed_before, self.notes, self.data_order = 0, 0.0, [], DATA_ORDER
        self.resume_from: Optional[str] = None
        self.log: Optional[MetricsLog] = None
        self.saving: Optional[sf.checkpoint.AsyncSave] = None  # --async-save: the save being written behind

    def _take(self, config: ResolvedJob) -> None:
        """Hold ``config`` and the sections the trainer reads (resolved: `ResolvedJob` fills them)."""
        self.config = config
        self.schedule, self.optim, self.checkpoint = config.schedule, config.optim, config.checkpoint
        self.run_settings, self.parallelism, self.precision = config.run, config.parallelism, config.precision

    # ---- build ----

    def build(self) -> bool:
        """Build the model, its optimizers, the resumed state, the data and the outputs. Returns False when nothing
        is left to train (said on rank 0; nothing written). Collective."""
        self._agree_on_outputs()
        self._build_model()
        self.optimizers = build_optimizers(self.model, self.optim, self.matrices)
        for attach in self.modes.each("attach"):  # e.g. DiLoCo's outer state over the inner optimizers
            attach(self)
        self.figure_group = self.modes.first("figure_group", lambda: None)()  # None: the world
        self.resume()
        self.stop = self.schedule.stop_after or self.schedule.steps
        # Save at the last step of this run also without --save-every when the run ends early (--stop-after) or
        # resumed from a checkpoint: the next run then goes on from there, or knows that nothing is left to train;
        # and when a mode says so (fault tolerance: every replica group then agrees on it).
        self.save_at_stop = (bool(self.checkpoint.save_every) or self.stop < self.schedule.steps
                             or self.resume_from is not None or any(m.saves_at_stop for m in self.modes))
        if self.start >= self.stop:
            if self.is_main:
                print(outputs.nothing_to_train(self), flush=True)
            return False
        self._build_data()
        outputs.open_run(self)
        return True

    def _agree_on_outputs(self) -> None:
        """Rank 0's --out on every rank (under torchrun each rank made its own timestamp), and the outer degree the
        cost model chooses (--fsdp-outer-degree auto). Collective."""
        shared = [self.config.out]
        dist.broadcast_object_list(shared, src=0)
        self._take(self.config.replace(out=shared[0]))
        self.out = Path(ft_config.outputs_folder(self.config.ft, self.config.out))  # checkpoints: config.out
        if self.config.fsdp_outer_degree == PLANNED:  # an int from here on (config.json records it)
            self._take(self.config.with_outer_degree(parallelize.plan_outer_degree(self.config, self.device,
                                                                                   self.world)))

    def _build_model(self) -> None:
        """The topology, the model's description (`job_model.build`) and the sharded model, which the model mode
        builds (`Mode.shard`); --init-from's weights unless a checkpoint is resumed."""
        config = self.config
        self.topo = topo = parallelize.topology(self.parallelism, config.pipeline,
                                                parallelize.topology_ranks_per_node(config.run, self.world))
        self.job = job_model.build(config, topo.get_group("ep"), self.device, mp_mesh=topo.get_mesh("mp"),
                                   context_group=topo.get_group("context"))
        self.matrices = muon_matrices(self.job.module, self.job.units) if self.optim.optimizer == "muon" else None
        self.comm_layout = parallelize.comm_layout(config, self.world)
        self.model = self.modes.first("shard")(self)
        self.balance = balance_record(sf.owner_balance(self.model)) if self.matrices is not None else None
        self.resume_from = train_state.latest(config.out)
        if config.model.init_from is not None and self.resume_from is None:  # a resume: the checkpoint's weights
            job_model.load_pretrained(self.model, config.model.init_from)

    def _build_data(self) -> None:
        """The tokenizer, the splits and this rank's samplers (`Mode.samplers`; default: this rank's
        data-parallel slice of each global batch, evaluating on the same one)."""
        self.tokenizer = tokenizers.load(self.config.tokenizer or tokenizers.BYTES)  # resolved by preflight
        self.train_data, self.val_data, self.data_info = data_config.load_splits(self.config.corpus, self.config.model,
                                                                                 self.tokenizer)
        self.sampler, self.val_sampler = self.modes.first("samplers", self._samplers)(
            self, self.train_data, self.val_data, self.data_order)
        self.tokens_per_step = self.schedule.global_batch_size * self.job.seq_len * self.schedule.grad_accum

    def _samplers(self, trainer: Trainer, train: Any, val: Any, data_order: int) -> tuple[Any, Any]:
        """The default samplers: this rank's data-parallel slice of each global batch, for training and evaluation."""
        sampler = make_sampler(self, train, val, data_order, dp_rank=self.topo.data_parallel_rank,
                               dp_world=self.topo.dp * self.topo.sharding)
        return sampler, sampler

    # ---- checkpoints ----

    def resume(self) -> None:
        """Restore the latest checkpoint in --out, if any, with this run's hyperparameters (the lr: per step) and
        the modes' own state (`Mode.rank_state`, `Mode.restored`); the saved run's data order. Collective."""
        if self.resume_from is None:
            return
        flags = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in self.optimizers]
        rank_state = self.modes.merged("rank_state", True) if self.modes.has("rank_state") else None
        self.start, self.elapsed_before, self.notes, self.data_order = train_state.restore(
            self.model, self.optimizers, self.resume_from, settings=self.config.flat(), model_extra=self.job.extra,
            layout=self.topo.describe(), device=self.device, rank_extra=rank_state)
        for restored in self.modes.each("restored"):
            note = restored(rank_state, self.start)
            self.notes += [note] if note else []
        for opt, mine in zip(self.optimizers, flags):
            for group, settings in zip(opt.param_groups, mine):
                group.update(settings)

    def save(self, done: int) -> Optional[str]:
        """Publish the checkpoint of step ``done`` in --out (with the modes' per-rank state), unless a mode keeps
        this group from writing it (`Mode.may_save`); returns its path (None then). With --async-save the save first
        waits for the previous one (`shardfusion.checkpoint.save_checkpoint` does), then returns once the copy of
        this rank's shards has begun (the next optimizer step waits for it): the write runs behind, in `saving`.
        Collective.

        Raises:
            ValueError: on every rank: the save, or the previous asynchronous one, failed (`train_state.save`).
        """
        if not all(may_save() for may_save in self.modes.each("may_save")):
            return None
        rank_state = self.modes.merged("rank_state", False) if self.modes.has("rank_state") else None
        previous, self.saving = self.saving, None
        saved = train_state.save(self.model, self.optimizers, self.config.out, step=done, keep=self.checkpoint.keep,
                                 settings=self.config.flat(), model_extra=self.job.extra, layout=self.topo.describe(),
                                 elapsed_s=self.elapsed(), device=self.device, data_order=self.data_order,
                                 rank_extra=rank_state, async_save=self.checkpoint.async_save)
        if previous is not None:
            self._published(previous)  # agreed on by the save above: no collective
        if isinstance(saved, str):
            return saved
        self.saving = saved
        return saved.path

    def finish_saving(self) -> None:
        """Wait until the asynchronous save in flight (--async-save), if any, is written by every rank and published,
        and say so on rank 0. Collective.

        Raises:
            ValueError: on every rank: its write or publish failed on some rank (`AsyncSave.wait`).
        """
        if self.saving is not None:
            saving, self.saving = self.saving, None
            self._published(saving, at_end=True)

    def _published(self, saving: sf.checkpoint.AsyncSave, at_end: bool = False) -> None:
        """Wait for ``saving`` (`AsyncSave.wait`: collective unless the next save agreed on it already) and say so
        on rank 0 (``at_end``: with the seconds the run waited for it)."""
        t = time.perf_counter()
        path = saving.wait()
        if self.is_main:
            waited = f"; the run waited {time.perf_counter() - t:.2f} s for it" if at_end else ""
            tqdm.write(f"step {saving.step:5d}  published {path} (written in the background{waited})")

    # ---- the loop ----

    def elapsed(self) -> float:
        """Training seconds, those of the runs this one resumed included."""
        return self.elapsed_before + time.perf_counter() - self.t_train

    def steps(self) -> Iterable[int]:
        """The steps this run trains (`Mode.steps`; default: from the resumed step to the stop)."""
        return self.modes.first("steps", lambda trainer, start, stop: range(start, stop))(self, self.start,
                                                                                        self.stop)

    def train_step(self, step: int) -> Optional[StepResult]:
        """One optimizer step ``step`` (0-based), as data flows through it (docs/design.md draws it); None when a
        mode discards it (fault tolerance: the step comes again). Collective."""
        lr = set_learning_rates(self.optimizers, self.schedule, self.optim, step)
        with sf.comm.CommCounter(self.comm_layout["ranks_per_node"]) as step_comm:  # this step's collectives
            sums = self.modes.first("forward_backward")(self, step)  # every micro-batch, forward and backward
            for sync in self.modes.each("sync"):  # beyond the units' reduce-scatter / all-reduce
                sync(step, sums)
            grad_norm = sf.clip_grad_norm_(self.model, self.max_norm)  # over the whole model, every optimizer
            if not self.modes.first("commit", self._commit)(step):
                return None
            boundary = self.modes.merged("boundary", step + 1)  # e.g. DiLoCo's outer step
        figures = self.modes.first("figures")(self, sums)
        comm = step_comm.summary()
        return StepResult(figures, float(grad_norm), lr, {**self.modes.merged("record", comm), **boundary}, comm)

    def _commit(self, step: int) -> bool:
        """The default commit: every optimizer steps on the step's gradients, which are then dropped."""
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return True

    def evaluate(self, step: int, elapsed_s: float) -> float:
        """The mean validation loss at ``step`` (0: before the first; `Mode.evaluate`), logged with the training
        seconds ``elapsed_s``. Collective."""
        val_loss = self.modes.first("evaluate")(self, self.schedule.eval_batches)
        outputs.log_val(self, step, val_loss, elapsed_s)
        return val_loss

    def fit(self) -> None:
        """The loop: evaluate first (a new run), then train_step, log, evaluate every --eval-every and at the stop,
        save every --save-every (and at the stop: `build`)."""
        self.t_train = time.perf_counter()
        if self.start == 0:
            self.evaluate(0, 0.0)
        self.max_norm = self.optim.clip if self.optim.clip > 0 else float("inf")
        self.bar = tqdm(total=self.stop, initial=self.start, disable=not (self.is_main and self.run_settings.progress),
                        dynamic_ncols=True, desc="train", file=sys.stderr)
        steps = self.steps()
        self.t_step = time.perf_counter()
        for step in steps:
            result = self.train_step(step)
            if result is None:
                continue
            outputs.log_step(self, step, result)
            done = step + 1
            if done % self.schedule.eval_every == 0 or done == self.stop:
                self.evaluate(done, self.elapsed())
                self.t_step = time.perf_counter()  # keep evaluation time out of the next step's tokens/s
            save_every = self.checkpoint.save_every
            if (save_every and done % save_every == 0) or (self.save_at_stop and done == self.stop):
                t_save = time.perf_counter()
                path = self.save(done)
                if path is not None:
                    if self.is_main:
                        now = time.perf_counter()
                        tqdm.write(f"step {done:5d}  saving {path} in the background (the loop waited "
                                   f"{now - t_save:.2f} s)" if self.saving is not None else
                                   f"step {done:5d}  saved {path} in {now - self.t_step:.1f} s")
                    self.t_step = time.perf_counter()
        self.finish_saving()  # the last checkpoint is complete before the run ends
        self.bar.close()
        self.train_s = time.perf_counter() - self.t_train

    def finish(self) -> Optional[dict[str, Any]]:
        """The end of the run: the modes' ends, the sample, the modes' summaries (collective), then on rank 0 the
        plot, summary.json and the printed summary. Returns the summary on rank 0, None elsewhere."""
        for end in self.modes.each("end"):
            end(self)
        sample = outputs.generate_sample(self) if self.run_settings.sample_tokens else None
        extra = self.modes.merged("summary", self)
        if self.log is None:
            return None
        return outputs.write_summary(self, sample, extra)
