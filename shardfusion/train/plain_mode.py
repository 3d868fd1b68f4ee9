"""The plain model mode of the `Trainer` (no --pp): the whole model sharded by `parallelize.shard`, each step's
--grad-accum micro-batches run forward and backward one after the other, the figures averaged over the data-parallel
ranks. The dry run
plays the same micro-batch (`micro_batch_loss`, `batch`) on fake tensors (`job_dry_run.job_step`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import shardfusion as sf
from shardfusion.train import parallelize
from shardfusion.train.data import BatchSampler, context_parallel_slice
from shardfusion.train.job_model import JobModel
from shardfusion.train.mode import Mode, StepFigures, StepSums, Trainer
from shardfusion.train.model_config import ModelConfig


def global_mean(values: list[float | torch.Tensor], device: torch.device, group=None) -> list[float]:
    """Means of each value over the ranks of ``group`` (default: all), in one all-reduce."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).detach() for v in values])
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def expert_load(tokens: torch.Tensor, topo: sf.Topology, replica_only: bool = False) -> torch.Tensor:
    """(L, E) int64 assignments of tokens to experts, per MoE layer, summed over the data-parallel group: each rank
    counts its own tokens (`GPT.tokens_per_expert`), so the sum is the global count (with context parallel, also
    over the context group: each cp rank holds part of each sequence); mp ranks see the same tokens and are not
    added. ``replica_only`` (DiLoCo's inner steps: nothing crosses the replicas): summed over this replica's
    data-parallel ranks only (its inner group), this replica's load."""
    tokens = tokens.clone()
    dist.all_reduce(tokens, group=topo.get_fsdp_inner_group() if replica_only else topo.get_data_parallel_group())
    if topo.sep * topo.cp > 1:  # the context ranks count the tokens of their parts of the sequences
        dist.all_reduce(tokens, group=topo.get_group("context"))
    return tokens


def context_part(batch: tuple[torch.Tensor, torch.Tensor], context: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """This context-parallel rank's part (B, T / cp) of a data-parallel rank's batch (B, T); ``context``: (context
    rank, context size); the batch itself without context parallel."""
    rank, size = context
    return batch if size == 1 else context_parallel_slice(*batch, rank, size)


def context_of(topo: sf.Topology) -> tuple[int, int]:
    """(context rank, context size) of this rank: each context rank takes its part of every sequence."""
    return topo.context_rank, topo.sep * topo.cp


def micro_batch_loss(job: JobModel, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, aux_loss_coef: float,
                     micro_batches: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One micro-batch's forward: (the loss its backward takes, cross-entropy, MoE load-balancing loss, (L, E)
    tokens per expert or None for a dense model). x, y: (B, T) int64 token ids (this context rank's part). The loss
    backward takes is (cross-entropy + ``aux_loss_coef`` x aux) / ``micro_batches``, so the step's gradient is the
    mean's. aux: 0-dim, a zero constant for a dense model."""
    loss, aux, assigned = job.losses(model, x, y)
    return (loss + aux_loss_coef * aux) / micro_batches, loss, aux, assigned


def evaluate(model: nn.Module, losses, sampler: BatchSampler, num_batches: int,
             device: torch.device, context: tuple[int, int] = (0, 1)) -> float:
    """Mean validation loss (cross-entropy) over the fixed validation set; every rank evaluates its share, the same
    count, so every rank runs as many forwards as its ep peers (a MoE forward is collective over ep). ``context``:
    (context rank, context size): each context-parallel rank evaluates its part of the sequences."""
    model.eval()
    total = torch.zeros((), device=device)
    indices = sampler.val_indices(num_batches)
    with torch.no_grad():
        for i in indices:
            x, y = context_part(sampler.get_batch("val", i), context)
            loss, _, _ = losses(model, x.to(device), y.to(device))
            total += loss
    model.train()
    return global_mean([total / len(indices)], device)[0]


def make_sampler(trainer: Trainer, train: Any, val: Any, data_order: int, *, dp_rank: int,
                 dp_world: int) -> BatchSampler:
    """This rank's `BatchSampler`: slice ``dp_rank`` of ``dp_world`` of each global batch (--global-batch-size)."""
    schedule = trainer.schedule
    return BatchSampler(train=train, val=val, batch_size=schedule.global_batch_size // dp_world,
                        seq_len=trainer.job.seq_len, seed=schedule.seed, dp_rank=dp_rank, dp_world=dp_world,
                        data_order=data_order)


def step_figures(trainer: Trainer, loss: float, aux: float, tokens: torch.Tensor) -> StepFigures:
    """The step's figures from its (loss, aux) means and this rank's tokens per expert: the expert load summed
    over the data-parallel ranks (of this replica only when the figures are a replica's: `Mode.figure_group`)."""
    load = expert_load(tokens, trainer.topo, replica_only=trainer.figure_group is not None) if trainer.job.moe \
        else None
    return StepFigures(loss, aux, load)


class PlainMode(Mode):
    """The whole model on every rank's shards (see the module docstring). ``model``: the model section."""

    def __init__(self, model: ModelConfig) -> None:
        self.aux_loss_coef = model.aux_loss_coef

    def shard(self, trainer: Trainer) -> nn.Module:
        job = trainer.job
        return parallelize.shard(job.module, trainer.topo, trainer.parallelism, trainer.precision, units=job.units,
                                 device=trainer.device, init_fn=job.init_fn,  # built on meta: module by module
                                 whole_params=trainer.matrices)

    def forward_backward(self, trainer: Trainer, step: int) -> StepSums:
        job, model, device = trainer.job, trainer.model, trainer.device
        n = trainer.schedule.grad_accum
        sums = StepSums(torch.zeros((), device=device), torch.zeros((), device=device),
                        torch.zeros((job.n_moe_layers, job.n_experts), dtype=torch.long, device=device), n)
        context = context_of(trainer.topo)
        for micro_step in range(n):
            x, y = context_part(trainer.sampler.get_batch("train", step, micro_step), context)
            scaled, loss, aux, assigned = micro_batch_loss(job, model, x.to(device), y.to(device),
                                                           aux_loss_coef=self.aux_loss_coef, micro_batches=n)
            # the last micro-batch is known: its backward overlaps the outer all-reduce
            sf.set_is_last_backward(model, micro_step == n - 1)
            scaled.backward()
            sums.loss += loss.detach()
            sums.aux += aux.detach()
            if job.moe:
                sums.tokens += assigned
        return sums

    def figures(self, trainer: Trainer, sums: StepSums) -> StepFigures:
        loss, aux = global_mean(list(sums.means()), trainer.device, trainer.figure_group)
        return step_figures(trainer, loss, aux, sums.tokens)

    def evaluate(self, trainer: Trainer, num_batches: int) -> float:
        return evaluate(trainer.model, trainer.job.losses, trainer.val_sampler, num_batches, trainer.device,
                        context_of(trainer.topo))

    def full_state_dict(self, trainer: Trainer) -> Optional[dict[str, torch.Tensor]]:
        return sf.full_state_dict(trainer.model)
