"""The pipeline-parallel run of the training job (`--pp > 1`; the flags and their checks:
`shardfusion.train.pipeline_config`; docs/train-pipeline.md).

Each rank builds the GPT eagerly on the CPU under --seed (the same draws as a --pp 1 run's model, which fully_shard
initializes module by module from the meta device, bitwise the eager values), cuts out the stages its pp index holds
(`split_gpt`: stage s on pp rank s % pp), shards each with `fully_shard(units=(Block,))` and the run's policies over
the sharding group of its pp index, and drives them with `sf.pipeline.PipelineStage` under torch's ScheduleGPipe,
Schedule1F1B or ScheduleInterleaved1F1B. A step's rows are the --grad-accum global micro-batches of a --pp 1 run
(`step_rows`); the schedule cuts them into --microbatches pipeline micro-batches, the loss on the last stage is the
fp32 cross-entropy, and torch's `scale_grads` divides by the micro-batch count, so the gradient is that of the mean
over the rows, as at --pp 1. A GPT-MoE's load-balancing loss, a per-layer value inside the stages, enters the
gradient in each stage's backward (`split_gpt(..., aux_loss_coef)`: coefficient / n_layer per micro-batch, the --pp 1
loss's weight). A tied head keeps a copy of the embedding on the last stage (kept whole on both ends, kept equal by
`PipelineStage`: docs/pipeline.md).

Evaluation runs forward only through the pipeline: torch's `schedule.eval` (no backward, under no_grad) on a second
set of stages over the same sharded modules, whose micro-batches are the validation batches (their shapes differ
from the training micro-batches', and a stage's shapes are fixed at construction); GPipe's order (LoopedBFS with
several stages per rank), which is every schedule's order without backwards.

Measured here for the summary (`PipelineRun.report`): per rank the seconds inside the stages' forwards and backwards
against the seconds inside `schedule.step` (the measured bubble), the activations and gradients each stage sends to
its neighbours (P2P, which `sf.comm.CommCounter` does not see), the collectives per accounting category (each
step's `CommCounter`), the shard and optimizer-state bytes and the peak memory.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardfusion as sf
from shardfusion.accounting import CATEGORIES
from shardfusion.models.gpt import GPT, Block, GPTConfig
from shardfusion.models.gpt_pipeline import split_gpt, stage_layers
from shardfusion.moe import MoE
from shardfusion.pipeline import PipelineStage, build_schedule, stage_ranks
from shardfusion.train import dtype_flags, parallelize, pipeline_config
from shardfusion.train.dtype_flags import PrecisionConfig
from shardfusion.train.model_config import ModelConfig
from shardfusion.train.parallel_config import ParallelismConfig
from shardfusion.train.pipeline_config import PipelineConfig
from shardfusion.train.schedule import ScheduleConfig
from shardfusion.train.data import BatchSampler
from shardfusion.train.metrics import COMM_FIELDS

P2P_FIELDS = ("count", "wire_bytes", "cross_node_bytes")
"""Figures of a stage's point-to-point sends per step: tensors sent, their bytes, the bytes sent to another node."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's loss_fn: the mean fp32 cross-entropy of one micro-batch, logits (B, T, V), targets (B, T) (the
    GPT's own loss)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _MeasuredStage(PipelineStage):
    """`sf.pipeline.PipelineStage` that adds up the seconds of its forwards and backwards (``busy_s``) and tallies the
    tensors it sends to its neighbours (``sent``: `P2P_FIELDS`); ``node_of(rank)`` gives a global rank's node."""

    def __init__(self, *args: Any, node_of, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy_s = 0.0
        self.sent = dict.fromkeys(P2P_FIELDS, 0.0)
        self._node_of, self._node = node_of, node_of(dist.get_rank())

    def forward_one_chunk(self, *args: Any, **kwargs: Any):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def _timed(self, work, *args: Any, **kwargs: Any):
        """``work(*args, **kwargs)``, its seconds added to ``busy_s``."""
        t0 = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return self._tally(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._tally(super().get_bwd_send_ops(bwd_chunk_id))

    def _tally(self, ops: list) -> list:
        for op in ops:
            nbytes = op.tensor.numel() * op.tensor.element_size()
            self.sent["count"] += 1
            self.sent["wire_bytes"] += nbytes
            if self._node_of(op.peer) != self._node:
                self.sent["cross_node_bytes"] += nbytes
        return ops


def step_rows(sampler: BatchSampler, step: int, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of optimizer step ``step``: its slices of the --grad-accum global micro-batches,
    in micro-step order, inputs and targets (grad_accum x B, T) int64: the sequences a --pp 1 run trains on."""
    xs, ys = zip(*(sampler.get_batch("train", step, k) for k in range(grad_accum)))
    return torch.cat(xs), torch.cat(ys)


class PipelineRun:
    """This rank's pipeline stages, their schedules and what the job reports about them.

    Args:
        topo: the job's topology (``pp`` = --pp).
        device: where the shards and the compute live.
        job: the resolved run settings (``pp > 1``), of which the stages read the pipeline, schedule, parallelism,
            precision and model sections and the model's shape; activations between stages are in --param-dtype.
        node_of: global rank -> node, for the P2P bytes across nodes.
    """

    def __init__(self, topo: sf.Topology, device: torch.device, *, pipeline: PipelineConfig, schedule: ScheduleConfig,
                 parallelism: ParallelismConfig, precision: PrecisionConfig, model: ModelConfig, shape: GPTConfig,
                 node_of) -> None:
        self.topo, self.device = topo, device
        self.pipeline, self.grad_accum, self.shape = pipeline, schedule.grad_accum, shape
        mp_policy = dtype_flags.mixed_precision(precision)
        self.num_stages = pipeline_config.num_stages(pipeline)
        self.stage_ids = stage_ranks(self.num_stages, topo.pp)[topo.pp_rank]
        self.has_first, self.has_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        self.dp_world = topo.dp * topo.sharding  # the data-parallel ranks of each stage
        self.n_layer, self.moe = shape.n_layer, shape.n_experts > 0
        self.layers = stage_layers(shape.n_layer, self.num_stages)
        rows = schedule.grad_accum * schedule.batch_size
        self.microbatch_rows = rows // pipeline.microbatches
        act_dtype = mp_policy.param_dtype or torch.float32

        torch.manual_seed(schedule.seed)
        whole = GPT(shape, ep_group=topo.get_group("ep"))  # eager: the --pp 1 run's values (see the module doc)
        self.models: list[nn.Module] = []
        self._moe_layers: list[tuple[int, MoE]] = []  # (global block index, layer) of this rank's stages
        for s in self.stage_ids:
            # a GPT-MoE's stages add their load-balancing loss in backward (split_gpt's aux_loss_coef)
            part = split_gpt(whole, s, self.num_stages, aux_loss_coef=model.aux_loss_coef)
            if self.moe:
                layers = [(int(i), m) for i, block in part.blocks.items() for m in block.modules()
                          if isinstance(m, MoE)]
                self._moe_layers += layers
                part.register_forward_hook(self._aux_hook(layers))
            tied = part.tied_parameters  # a tied head's copy of the embedding: kept whole on both ends
            self.models.append(parallelize.shard(
                part, topo, parallelism, precision, units=(Block,), device=device,
                replicate_filter=lambda n, p, tied=tied: n in tied))
        del whole
        self.stages = self._stages(self.microbatch_rows, shape, act_dtype, measured=True, node_of=node_of)
        self.schedule = build_schedule(pipeline.pp_schedule, self.stages, pipeline.microbatches, cross_entropy)
        self._eval_schedule = None
        self._eval_shape = (shape, act_dtype, node_of)
        self._aux_sum = torch.zeros((), device=device)
        self._tokens: Optional[torch.Tensor] = None
        self._losses: list[torch.Tensor] = []
        self._steps: list[tuple[float, float]] = []  # (seconds in schedule.step, of them in forwards / backwards)
        self._comm = {cat: dict.fromkeys(COMM_FIELDS, 0.0) for cat in CATEGORIES}
        self._comm_steps = 0

    # ---- building ----

    def _stages(self, rows: int, shape, act_dtype: torch.dtype, *, measured: bool, node_of) -> list[PipelineStage]:
        """One `PipelineStage` per stage of this rank for micro-batches of ``rows`` sequences (static shapes)."""
        stages = []
        for s, part in zip(self.stage_ids, self.models):
            first, last = s == 0, s == self.num_stages - 1
            hidden = torch.empty(rows, shape.seq_len, shape.d_model, dtype=act_dtype, device="meta",
                                 requires_grad=True)  # activations carry gradients back
            inputs = torch.empty(rows, shape.seq_len, dtype=torch.long, device="meta") if first else hidden
            outputs = (torch.empty(rows, shape.seq_len, 256, dtype=act_dtype, device="meta", requires_grad=True)
                       if last else hidden)
            kwargs = dict(input_args=inputs, output_args=outputs, device=self.device)
            if measured:
                stages.append(_MeasuredStage(part, self.topo, s, self.num_stages, node_of=node_of, **kwargs))
            else:  # evaluation: forward only, so no gradients of a tied weight to sum
                stages.append(PipelineStage(part, self.topo, s, self.num_stages, tied_parameters=(), **kwargs))
        return stages

    def _aux_hook(self, layers: list[tuple[int, MoE]]):
        """The forward hook of a MoE stage: in training, add its aux losses and the tokens per expert to this step's
        figures (the stage itself adds the aux loss to the gradient: `split_gpt`'s ``aux_loss_coef``)."""

        def hook(module: nn.Module, args: Any, output: torch.Tensor):
            if not (module.training and torch.is_grad_enabled()):
                return None
            aux = torch.stack([m.aux_loss for _, m in layers]).sum()
            self._aux_sum += aux.detach()
            counts = torch.stack([m.tokens_per_expert for _, m in layers])  # (layers, E)
            if self._tokens is None:
                self._tokens = torch.zeros((self.n_layer, counts.shape[1]), dtype=torch.long, device=counts.device)
            self._tokens[[i for i, _ in layers]] += counts
            return None

        return hook

    # ---- training ----

    def forward_backward(self, sampler: BatchSampler, step: int) -> None:
        """Forward and backward of optimizer step ``step`` through the schedule (collective over the pipeline and
        the stages' groups); the gradients are final when it returns. The figures: `step_figures`."""
        self.run_rows(*step_rows(sampler, step, self.grad_accum))

    def run_rows(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Forward and backward of one step's rows through the schedule: inputs and targets (grad_accum x B, T)
        int64 (`step_rows`; the dry run's are random, `job_dry_run.job_step`). Collective, as `forward_backward`."""
        self._losses = []
        self._aux_sum.zero_()
        if self._tokens is not None:
            self._tokens.zero_()
        args = (x.to(self.device),) if self.has_first else ()
        kwargs = {"target": y.to(self.device), "losses": self._losses} if self.has_last else {}
        busy = sum(stage.busy_s for stage in self.stages)
        t0 = time.perf_counter()
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self._steps.append((time.perf_counter() - t0, sum(stage.busy_s for stage in self.stages) - busy))

    def step_figures(self, group: Optional[dist.ProcessGroup] = None) -> tuple[float, float, Optional[torch.Tensor]]:
        """(loss, aux loss, (n_layer, E) tokens per expert or None) of the last `forward_backward`, the same on every
        rank of ``group``: the mean cross-entropy over the step's rows (the last stage's micro-batch losses, averaged
        over its data-parallel ranks), the mean over the layers, micro-batches and data-parallel ranks of the MoE aux
        losses, and the step's token assignments summed over the ranks. ``group``: the world (default), or a group
        spanning every stage, e.g. DiLoCo's replica (`shardfusion.diloco.replica_groups`: the figures of that
        replica's rows, as a --pp 1 replica logs them). Collective (all-reduces over ``group``)."""
        m = self.pipeline.microbatches
        # the data-parallel ranks of each stage in the group (it holds the same share of every stage's ranks)
        dp_ranks = self.dp_world * dist.get_world_size(group) // dist.get_world_size()
        loss = torch.stack(self._losses).detach().mean() if self.has_last else torch.zeros((), device=self.device)
        sums = torch.stack([loss.float(), self._aux_sum.float() / m])
        dist.all_reduce(sums, group=group)
        loss_value = float(sums[0]) / dp_ranks
        aux_value = float(sums[1]) / (dp_ranks * self.n_layer) if self.moe else 0.0
        tokens = None
        if self.moe:
            tokens = self._tokens.clone()  # every rank has MoE layers: each stage holds blocks
            dist.all_reduce(tokens, group=group)  # the data-parallel ranks' tokens, the other stages' rows
        return loss_value, aux_value, tokens

    def record_comm(self, summary: dict[str, dict[str, float]]) -> None:
        """Add one step's `CommCounter.summary()` of this rank to the per-stage figures of `report`."""
        for cat in CATEGORIES:
            for f in COMM_FIELDS:
                self._comm[cat][f] += summary[cat][f]
        self._comm_steps += 1

    # ---- evaluation ----

    def evaluate(self, sampler: BatchSampler, num_batches: int) -> float:
        """Mean validation loss over the fixed validation set, the same on every rank, as `plain_mode.evaluate` gives it
        at --pp 1: each data-parallel rank's validation batches (`BatchSampler.val_indices`) are the micro-batches
        of one forward-only pass through the pipeline (`schedule.eval`). Collective."""
        indices = sampler.val_indices(num_batches)
        if self._eval_schedule is None:
            from torch.distributed import pipelining
            shape, act_dtype, node_of = self._eval_shape
            stages = self._stages(sampler.batch_size, shape, act_dtype, measured=False, node_of=node_of)
            if len(stages) == 1:
                self._eval_schedule = pipelining.ScheduleGPipe(stages[0], len(indices), loss_fn=cross_entropy)
            else:
                self._eval_schedule = pipelining.ScheduleLoopedBFS(stages, len(indices), loss_fn=cross_entropy)
        xs, ys = zip(*(sampler.get_batch("val", i) for i in indices))
        losses: list[torch.Tensor] = []
        args = (torch.cat(xs).to(self.device),) if self.has_first else ()
        kwargs = {"target": torch.cat(ys).to(self.device), "losses": losses} if self.has_last else {}
        for model in self.models:
            model.eval()
        try:
            with torch.no_grad():
                self._eval_schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            for model in self.models:
                model.train()
        mean = torch.stack(losses).float().mean() if self.has_last else torch.zeros((), device=self.device)
        dist.all_reduce(mean)
        return float(mean) / self.dp_world

    # ---- the end of the run ----

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Every parameter of the whole model on rank 0 (on the CPU), None elsewhere: each stage's
        `sf.full_state_dict` (collective over its ranks), sent to rank 0 by its first data-parallel rank.
        Collective."""
        full: dict[str, torch.Tensor] = {}
        for model in self.models:
            full.update({k: v.cpu() for k, v in sf.full_state_dict(model).items()})
        rank = dist.get_rank()
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(full if self.topo.data_parallel_rank == 0 else None, gathered, dst=0)
        if rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        return merged

    def stage_params(self) -> list[int]:
        """Parameter elements of each stage of the whole model (every expert counted; the last stage's copy of a
        tied embedding too: it holds it), by stage index."""
        with torch.device("meta"):
            whole = GPT(self.shape)
        return [sum(p.numel() for p in split_gpt(whole, s, self.num_stages).parameters())
                for s in range(self.num_stages)]

    def report(self, optimizers: list[torch.optim.Optimizer]) -> Optional[dict[str, Any]]:
        """The pipeline's part of summary.json on rank 0 (None elsewhere); collective (a gather to rank 0).

        ``schedule``, ``pp``, ``stages``, ``stages_per_rank``, ``microbatches``, ``microbatch_sequences`` (per
        data-parallel rank), ``bubble_fraction_theory`` (`pipeline_config.bubble_fraction`),
        ``bubble_fraction_measured`` (the mean over the ranks of 1 - the seconds in the stages' forwards and
        backwards / the seconds in `schedule.step`, over the steps after the first: it counts the waits for the
        neighbours' activations and gradients, and on an oversubscribed CPU also the time a rank was not
        scheduled), ``stage_table`` (per stage: its pp rank, blocks and parameter elements) and ``per_pp_rank``
        (per pp rank: its stages, parameter elements, the shard, optimizer-state and peak memory bytes, the most
        over its ranks; the measured bubble, the mean over them; ``comm_per_step``, the collectives per category
        of its first data-parallel rank, mean per step, and ``p2p_per_step``, that rank's point-to-point sends)."""
        steps = self._steps[1:] or self._steps
        wall, busy = sum(s for s, _ in steps), sum(b for _, b in steps)
        n = max(1, self._comm_steps)
        sent = {f: sum(stage.sent[f] for stage in self.stages) / max(1, len(self._steps)) for f in P2P_FIELDS}
        if self.device.type == "cuda":
            peak, kind = torch.cuda.max_memory_allocated(self.device), "cuda max_memory_allocated"
        else:
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS (ru_maxrss)"
        state_bytes = sum(t.numel() * t.element_size() for opt in optimizers for state in opt.state.values()
                          for t in state.values() if torch.is_tensor(t))
        mine = {"rank": dist.get_rank(), "pp_rank": self.topo.pp_rank, "dp_rank": self.topo.data_parallel_rank,
                "param_shard_bytes": sum(p.numel() * p.element_size() for m in self.models for p in m.parameters()),
                "optimizer_state_bytes": state_bytes, "peak_memory_bytes": peak,
                "bubble": 1.0 - busy / wall if wall > 0 else float("nan"),
                "comm": {cat: {f: v / n for f, v in row.items()} for cat, row in self._comm.items()}, "p2p": sent}
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return None
        pipeline, params = self.pipeline, self.stage_params()
        placement = stage_ranks(self.num_stages, pipeline.pp)
        per_rank = []
        for p in range(pipeline.pp):
            ranks = [r for r in gathered if r["pp_rank"] == p]
            first = min(ranks, key=lambda r: r["dp_rank"])
            per_rank.append({
                "pp_rank": p, "stages": placement[p], "num_params": sum(params[s] for s in placement[p]),
                "ranks": sorted(r["rank"] for r in ranks),
                **{k: max(r[k] for r in ranks) for k in ("param_shard_bytes", "optimizer_state_bytes",
                                                         "peak_memory_bytes")},
                "peak_memory": kind,
                "bubble_fraction_measured": sum(r["bubble"] for r in ranks) / len(ranks),
                "comm_rank": first["rank"], "comm_per_step": first["comm"], "p2p_per_step": first["p2p"]})
        per_stage = pipeline_config.stages_per_rank(pipeline)
        return {
            "pp": pipeline.pp, "schedule": pipeline.pp_schedule, "stages": self.num_stages,
            "stages_per_rank": per_stage, "microbatches": pipeline.microbatches,
            "microbatch_sequences": self.microbatch_rows,
            "bubble_fraction_theory": pipeline_config.bubble_fraction(pipeline.pp_schedule, pipeline.pp, per_stage,
                                                                      pipeline.microbatches),
            "bubble_fraction_measured": sum(r["bubble"] for r in gathered) / len(gathered),
            "stage_table": [{"stage": s, "pp_rank": s % pipeline.pp, "blocks": list(self.layers[s]),
                             "num_params": params[s]} for s in range(self.num_stages)],
            "per_pp_rank": per_rank,
        }


