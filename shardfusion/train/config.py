"""`TrainConfig`, the settings of `shardfusion.train`, and the command line generated from it.

Each field's docstring is its `--help` text, so a flag is defined once: add a field here and the flag
`--field-name` exists. `None` defaults are resolved at run time (`resolve`), e.g. from the model preset.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import textwrap
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from shardfusion.train.data import corpus_size, min_corpus_bytes, split_sizes
from shardfusion.models.gpt import PRESETS, VOCAB_SIZE, GPTConfig
from shardfusion.policies import EXPERT_POLICIES, RESHARD_POLICIES
from shardfusion.train.hf_models import HF_MODELS
from shardfusion.train import compat, data_config, dry_run_config, dtype_flags, ft_config, outer_config, pipeline_config
from shardfusion.train.dtype_flags import torch_dtype  # noqa: F401  # the job's modules import it from here
from shardfusion.train.data_config import DataConfig
from shardfusion.train.ft_config import FTConfig
from shardfusion.train.dry_run_config import DryRunConfig
from shardfusion.train.outer_config import OuterConfig
from shardfusion.train.tokenizer import BYTES
from shardfusion.train.pipeline_config import PipelineConfig
from shardfusion.plan import parse_bytes
from shardfusion.topology import Degrees, outer_degree_within_nodes


AUTO = "auto"
"""The --fsdp-outer-degree value that asks the cost model (`shardfusion.plan`) for the degree."""

OPTIMIZERS = ("adamw", "muon")
"""The --optimizer choices: AdamW on every parameter, or Muon on the 2-D weights of the blocks and AdamW on the rest
(see `shardfusion.train.optim.build_optimizers`)."""


def outer_degree_arg(text: str) -> int | str:
    """argparse type of --fsdp-outer-degree: an int, or `auto`.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or {AUTO}, got {text!r}") from None


def memory_arg(text: str) -> int:
    """argparse type of --max-memory-per-rank: bytes, from a size such as 8GB, 512MiB or 4096
    (`shardfusion.plan.parse_bytes`).

    Raises:
        argparse.ArgumentTypeError: not such a size.
    """
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True, kw_only=True)
class TrainConfig(PipelineConfig, DataConfig, FTConfig, OuterConfig, DryRunConfig):
    """Everything one training run depends on; written to OUT/config.json.

    Sections owned by other modules are base classes, whose fields are flags like these and whose checks live with
    them: `PipelineConfig` (--pp, --pp-schedule, --stages-per-rank, --microbatches;
    `shardfusion.train.pipeline_config`), `DataConfig` (--data, --data-bytes, --tokenizer, --train-tokenizer,
    --tokenizer-override, --text-field, --data-cache; `shardfusion.train.data_config`) and `FTConfig` (--ft-lighthouse,
    --ft-replica-id,
    --ft-replicas, --ft-min-replicas, --ft-join-wait, --ft-timeout, --ft-host, --ft-quorum-timeout, --ft-max-discards;
    `shardfusion.train.ft_config`) and `OuterConfig` (--outer-sync, --outer-every, --outer-lr, --outer-momentum,
    --outer-fragments; `shardfusion.train.outer_config`) and `DryRunConfig` (--dry-run, --world,
    --bandwidth-within, --bandwidth-across; `shardfusion.train.dry_run_config`). A
    field with ``metadata={"flag": False}`` is set at run time, not on the command line.
    """

    preset: str = "small"
    """Model shape from shardfusion.models.PRESETS (default small); --n-layer etc. override single fields."""
    hf_model: str | None = None
    """Train a Hugging Face transformers model instead of the GPT: llama, qwen3_moe or mixtral, built over the
    byte vocabulary with the shape flags (--preset, --n-layer, --n-head, --d-model, --seq-len; --experts, --top-k
    and --expert-hidden for the MoE ones); needs pip install 'shardfusion[hf]'; --ep must be 1 (default: the GPT)."""
    init_from: str | None = None
    """Start from a pretrained Hugging Face folder (config.json, model.safetensors or a sharded index): the model is
    built from its config.json and loaded with its weights; the shape flags other than --seq-len do not apply
    (default: none, a fresh model)."""
    n_layer: int | None = None
    """Transformer blocks (default: from the preset)."""
    n_head: int | None = None
    """Attention heads per block (default: from the preset)."""
    d_model: int | None = None
    """Residual stream width (default: from the preset)."""
    seq_len: int | None = None
    """Context length in bytes (default: from the preset)."""
    dropout: float = 0.0
    """Dropout probability (default 0.0)."""
    experts: int = 4
    """Experts per MoE layer: every block's MLP becomes a routed mixture of experts (GPT-MoE); 0 gives the dense
    GPT (default 4)."""
    top_k: int = 2
    """Experts each token is routed to, at most --experts (default 2)."""
    expert_hidden: int | None = None
    """Hidden width of each expert (default: 4 * d_model // top_k, the compute of one dense MLP per token)."""
    ep: int | None = None
    """Expert-parallel degree: each layer's experts are split over this many ranks of every sharding group; it must
    divide --experts and the sharding degree (default: 2 when --experts and the world size are even, else 1)."""
    aux_loss_coef: float = 0.01
    """Weight of the MoE load-balancing loss added to the cross-entropy (default 0.01)."""
    expert_policy: str = "replicate"
    """How expert buffers use the HSDP outer group: replicate (sharded over moe_sharding / outer ranks, all-reduced
    over the outer group, like dense buffers) or shard (sharded over all moe_sharding ranks, no outer all-reduce)
    (default replicate)."""
    mp: int = 1
    """Tensor-parallel degree: each block's attention heads and (dense) MLP are split over this many ranks with torch's
    tensor parallel (shardfusion.models.gpt_parallel); they see the same samples, so the data-parallel world is the
    world size / mp. Must divide the world size and n_head (GPT only; default 1)."""
    fused_qkv: bool = False
    """One (3C, C) q/k/v projection per block (the GPT's layout before tensor parallel) instead of three (C, C) ones;
    the same initial weights and arithmetic. A resumed run takes its checkpoint's layout (default: three)."""
    tie_embeddings: bool = True
    """Share one weight between the token embedding and the lm head (GPT only); --no-tie-embeddings gives the head
    a weight of its own, which --pp > 1 needs (the embedding is on the first stage, the head on the last)
    (default: tied)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (contiguous chunks; exact attention by an
    all-gather of keys and values, shardfusion.context_parallel); they see the same samples, so the data-parallel
    world is the world size / (mp x cp). Must divide the world size and --seq-len; needs --dropout 0 (GPT only;
    default 1)."""
    batch_size: int | None = None
    """Per data-parallel rank: sequences each data-parallel rank takes per micro-batch, B = --global-batch-size /
    the data-parallel world size; give this or --global-batch-size (both only when they agree) (default:
    --global-batch-size / the data-parallel world size, or 16 when neither is given)."""
    global_batch_size: int | None = None
    """Global: sequences per micro-batch summed over all data-parallel ranks, G. The global batch of a step is the
    same at every world size and layout, and each data-parallel rank takes its G / (data-parallel world size) of
    it, so G must be divisible by the data-parallel world size (default: --batch-size x the data-parallel world
    size; a run that resumes a checkpoint keeps the saved run's G, so another world size keeps the data order)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (default 1)."""
    steps: int = 200
    """Optimizer steps (default 200)."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warm-up (default 3e-3)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay (default 3e-4)."""
    warmup: int | None = None
    """Linear warm-up steps, at most --steps (default: 20, or --steps when it is smaller; a resumed run keeps its
    checkpoint's)."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (with --optimizer muon: Muon's decoupled weight decay on the blocks'
    matrices); biases, norms and embeddings get none (default 0.1)."""
    optimizer: str = "adamw"
    """adamw: AdamW on every parameter; muon: torch.optim.Muon (momentum 0.95, Nesterov, adjust_lr_fn original) on
    the 2-D weights of the transformer blocks, each kept whole on one owner rank (sf.fully_shard(whole_params=)),
    and AdamW (--lr) on embeddings, head, norms and biases; see docs/train-muon.md. A resume must use the saved
    run's optimizer (default adamw)."""
    muon_lr: float = 0.05
    """Muon's peak learning rate with --optimizer muon; the warm-up + cosine schedule scales it like --lr (at each
    step Muon's lr is --muon-lr x the schedule's fraction of --lr); make train's run learns best near 0.05 of
    0.01 / 0.02 / 0.05 / 0.1 (docs/train-muon.md) (default 0.05)."""
    clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off, the norm is still reported (default 1.0)."""
    seed: int = 42
    """Seed of the model initialisation and the data sampler (default 42)."""
    fsdp_outer_degree: int | str | None = dataclasses.field(
        default=None, metadata={"parse": outer_degree_arg, "metavar": "INT|auto"})
    """HSDP replicas of each shard: 1 = plain FSDP; auto: chosen at start-up by the cost model (sf.plan) from a
    short bandwidth probe within and across nodes, the units' sizes and --max-memory-per-rank; the table is
    printed and the chosen int is written to config.json (default: on several nodes, inner = one node, i.e. world
    size / (pp x ranks per node) when that fits, and the run prints why; on one node 2 when the world size / pp is
    >= 4 and 2 divides world size / ep, else 1)."""
    max_memory_per_rank: int | None = dataclasses.field(
        default=None, metadata={"parse": memory_arg, "metavar": "BYTES"})
    """Memory budget of one rank, bytes with an optional suffix (80GB = 80e9, 74.5GiB, 512MiB, 4096; B, kB, MB, GB,
    TB, KiB, MiB, GiB, TiB): for --fsdp-outer-degree auto, without activations; with --dry-run each kind of rank's
    peak, activations included, is judged against it (fits, or does not fit by how much) (default: the GPU's
    memory; on CPU the host's memory / ranks per node; a dry run: no verdict)."""
    reshard_policy: str | None = None
    """When gathered parameters are freed: after_forward (ZeRO-3) or after_backward (default after_forward; with
    --pp > 1 after_backward: measured faster between micro-batches at the same peak, docs/pipeline-benchmark.md)."""
    param_dtype: str = "fp32"
    """Compute dtype of the gathered parameters: fp32, bf16 or fp16; shards and optimizer state stay fp32
    (default fp32)."""
    grad_comm_dtype: str | None = None
    """Dtype of the reduce-scatter and the outer all-reduce: fp32, bf16 or fp16 (default: --param-dtype)."""
    outer_comm_dtype: str | None = None
    """Wire format of the HSDP outer (cross-node) all-reduce only: fp32, bf16, fp16, or int8 (block-wise, about a
    quarter of fp32's bytes; see docs/compressed-all-reduce.md) (default: --grad-comm-dtype)."""
    prefetch: int = 1
    """Units all-gathered ahead of the running one, in forward and backward; 0 turns prefetching off (default 1)."""
    eval_every: int = 25
    """Evaluate every this many steps; also before the first and after the last step (default 25)."""
    eval_batches: int = 8
    """Validation batches per evaluation, split across the data-parallel ranks and rounded up to a multiple of their
    number (default 8)."""
    nproc: int | None = None
    """Worker processes on this node (default: 4 on CPU, the number of GPUs on CUDA); ignored under torchrun."""
    ranks_per_node: int | None = None
    """Ranks per node for the communication accounting: rank r is on node r // ranks-per-node, and the bytes sent
    between nodes are reported apart. It places no rank; use it to see what a multi-node layout would send across
    nodes. Below the world size it also sets the default --fsdp-outer-degree, as nodes would (default:
    LOCAL_WORLD_SIZE, which torchrun and the local launcher set: one node for a local run)."""
    out: str | None = None
    """Output folder for metrics.jsonl, config.json, loss.png, summary.json and checkpoints/ (default
    runs/<timestamp>). A run whose --out holds a checkpoint resumes from the latest one."""
    save_every: int = 0
    """Save a checkpoint to OUT/checkpoints/step-N every this many optimizer steps and at the last step; 0 saves
    none (default 0)."""
    keep: int = 3
    """Checkpoints kept in OUT/checkpoints: older ones are deleted once a newer one is published (default 3)."""
    stop_after: int | None = None
    """End this run after this many optimizer steps in total (steps of earlier runs in --out included) and save a
    checkpoint there (also without --save-every); the learning-rate schedule still spans --steps, and a run without
    it (or with a larger one) goes on from there. For time-sliced jobs (default: --steps)."""
    max_restarts: int = 0
    """When a worker fails, restart all workers up to this many times (the elastic launcher's restarts); they resume
    from the latest checkpoint in --out, so it needs --save-every. Under torchrun use torchrun's own --max-restarts,
    with --out, --save-every and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (default 0)."""
    sample_tokens: int = 200
    """Bytes to generate for the sample printed at the end; 0 skips it (default 200)."""
    device: str = "auto"
    """cpu, cuda or auto: cuda when available (default auto)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0 (default on)."""

    def model_config(self) -> GPTConfig:
        """The preset with this config's overrides applied."""
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is unknown; choose one of {sorted(PRESETS)}")
        overrides = {
            name: getattr(self, name)
            for name in ("n_layer", "n_head", "d_model", "seq_len", "expert_hidden")
            if getattr(self, name) is not None
        }
        return dataclasses.replace(PRESETS[self.preset], dropout=self.dropout, n_experts=self.experts,
                                   vocab_size=self.vocab_size or VOCAB_SIZE,
                                   top_k=self.top_k, fused_qkv=self.fused_qkv, tie_embeddings=self.tie_embeddings,
                                   **overrides)

    def _validate_hf(self) -> None:
        """The flags that a Hugging Face model (--hf-model, --init-from) refuses."""
        mode, what = ("hf", f"--hf-model {self.hf_model}") if self.init_from is None else (
            "init_from", f"--init-from {self.init_from}")
        compat.refuse_first(mode, what, [  # the pairs of modes: shardfusion.train.compat's reasons
            ("ep", "--ep", self.ep, self.ep is not None and self.ep != 1), ("mp", "--mp", self.mp, self.mp != 1),
            ("cp", "--cp", self.cp, self.cp != 1)])
        if self.init_from is not None:
            for name in ("n_layer", "n_head", "d_model", "expert_hidden"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} does not apply to --init-from {self.init_from}: "
                                     f"the model's shape comes from its config.json; drop the flag")
        elif self.hf_model != "llama" and self.experts < 1:
            raise ValueError(f"--hf-model {self.hf_model} is a mixture of experts: it needs --experts >= 1, got "
                             f"{self.experts} (--hf-model llama is the dense model)")

    def validate(self) -> None:
        """Raise ValueError naming the flag to change.

        Float fields must be finite (the command line refuses nan and inf already, see `finite_float`)."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{field.name.replace('_', '-')} must be a finite number, got {value}")
        if self.hf_model is not None and self.hf_model not in HF_MODELS:
            raise ValueError(f"--hf-model must be one of {', '.join(HF_MODELS)}, got {self.hf_model!r}")
        if self.hf_model is not None or self.init_from is not None:
            self._validate_hf()
        if self.experts < 0:
            raise ValueError(f"--experts must be >= 0, got {self.experts}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"--top-k {self.top_k} must be between 1 and --experts {self.experts}")
        if self.expert_hidden is not None and self.expert_hidden < 1:
            raise ValueError(f"--expert-hidden must be >= 1, got {self.expert_hidden}")
        if self.ep is not None:
            if self.ep < 1:
                raise ValueError(f"--ep must be >= 1, got {self.ep}")
            if self.ep > 1 and not self.experts:
                raise ValueError(f"--ep {self.ep} needs experts to split; use --experts > 0 or --ep 1")
            if self.experts % self.ep:
                raise ValueError(f"--ep {self.ep} must divide --experts {self.experts} (each ep rank holds "
                                 f"experts / ep of them); {self.experts} % {self.ep} = {self.experts % self.ep}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"--aux-loss-coef must be >= 0, got {self.aux_loss_coef}")
        self.model_config()
        for flag, value in (("--batch-size", self.batch_size), ("--global-batch-size", self.global_batch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, value in (("--grad-accum", self.grad_accum),
                            ("--eval-every", self.eval_every), ("--eval-batches", self.eval_batches),
                            ("--steps", self.steps)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise ValueError(f"--warmup {self.warmup} must be between 0 and --steps {self.steps}: the learning rate "
                             f"rises linearly over the warm-up steps, and a longer warm-up would end the run before "
                             f"it reaches --lr; use --warmup {min(self.steps, DEFAULT_WARMUP)} or less (0: none)")
        for flag, value in (("--clip", self.clip),
                            ("--sample-tokens", self.sample_tokens), ("--weight-decay", self.weight_decay),
                            ("--save-every", self.save_every), ("--max-restarts", self.max_restarts)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.muon_lr < 0:
            raise ValueError(f"--muon-lr must be >= 0, got {self.muon_lr}")
        if self.optimizer == "muon" and self.mp != 1:
            compat.refuse("muon", "mp", "--optimizer muon", f"--mp {self.mp}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= --min-lr({self.min_lr}) <= --lr({self.lr})")
        if self.max_restarts and not self.save_every:
            raise ValueError(f"--max-restarts {self.max_restarts} needs --save-every > 0: restarted workers resume "
                             f"from the latest checkpoint, and without one they would start over")
        if self.keep < 1:
            raise ValueError(f"--keep must be >= 1 (the latest checkpoint is always kept), got {self.keep}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after must be between 1 and --steps {self.steps}, got {self.stop_after}")
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.expert_policy not in EXPERT_POLICIES:
            raise ValueError(f"--expert-policy must be {' or '.join(EXPERT_POLICIES)}, got {self.expert_policy!r}")
        dtype_flags.check_flags(self)  # --param-dtype, --grad-comm-dtype, --outer-comm-dtype
        if self.prefetch < 0:
            raise ValueError(f"--prefetch must be >= 0, got {self.prefetch}")
        outer = self.fsdp_outer_degree
        if outer is not None and outer != AUTO and (isinstance(outer, bool) or not isinstance(outer, int)):
            raise ValueError(f"--fsdp-outer-degree must be an int >= 1 or {AUTO}, got {outer!r}")
        budget = self.max_memory_per_rank
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"--max-memory-per-rank must be a size in bytes > 0 (e.g. 8GB, 512MiB), got {budget!r}")
        if self.reshard_policy is not None and self.reshard_policy not in RESHARD_POLICIES:
            raise ValueError(f"--reshard-policy must be {' or '.join(RESHARD_POLICIES)}, got {self.reshard_policy!r}")
        pipeline_config.check_flags(self)  # the pipeline section's own checks
        data_config.check_flags(self)  # the data section's
        ft_config.check_flags(self)  # the fault-tolerance section's
        outer_config.check_flags(self)  # the outer-synchronisation section's
        dry_run_config.check_flags(self)  # the dry-run section's


DEFAULT_WARMUP = 20
"""--warmup when it is not given, at most --steps (and no checkpoint is resumed)."""

DEFAULT_BATCH_SIZE = 16
"""--batch-size when neither --batch-size nor --global-batch-size is given (and no checkpoint is resumed)."""


def data_parallel_size(config: TrainConfig, world_size: int) -> int:
    """The data-parallel world size of the job at world_size ranks: the ranks that take distinct slices of the
    global batch, `topo.dp * topo.sharding` = world_size / (pp x mp x cp) (ep ranks take distinct slices too; the
    mp and cp ranks of one data-parallel rank share its slice: cp ranks take parts of its sequences; every pipeline
    stage has its own data-parallel ranks, which take the same slices). world_size itself when pp x mp x cp does
    not divide it (check_run reports that)."""
    split = max(1, config.pp) * max(1, config.mp) * max(1, config.cp)
    return world_size // split if world_size % split == 0 else world_size


def batch_world(config: TrainConfig, world_size: int) -> int:
    """The ranks the global batch is cut for: `data_parallel_size`, times --ft-replicas with fault tolerance (each
    replica group of world_size ranks takes its share; `shardfusion.train.ft_config.data_slices`)."""
    return data_parallel_size(config, world_size) * ft_config.replicas(config)


def check_batch(config: TrainConfig, *, dp_world: int, world: str) -> None:
    """The batch flags against the data-parallel world size dp_world: --global-batch-size divisible by it, and
    --batch-size x dp_world equal to --global-batch-size when both are set (after `resolve`, they are).
    `world` names where dp_world comes from in messages (e.g. "--nproc 4").

    Raises:
        ValueError: naming both flags or --global-batch-size and dp_world, and what would fit.
    """
    per_rank, total = config.batch_size, config.global_batch_size
    if total is not None and total % dp_world:
        below, above = total // dp_world * dp_world, -(-total // dp_world) * dp_world
        fits = f"{below} or {above}" if below else f"{above}"
        raise ValueError(f"--global-batch-size {total} is not divisible by the data-parallel world size {dp_world} "
                         f"({world}): each data-parallel rank takes G / {dp_world} sequences; use "
                         f"--global-batch-size {fits}, or another world size")
    if per_rank is not None and total is not None and per_rank * dp_world != total:
        raise ValueError(f"--batch-size {per_rank} (per data-parallel rank) and --global-batch-size {total} disagree: "
                         f"{per_rank} x the data-parallel world size {dp_world} ({world}) = {per_rank * dp_world}; "
                         f"give only one of them")


def check_run(config: TrainConfig, *, world_size: int, world: str) -> None:
    """The checks that need the world size or the file system, run before any worker starts (or, under torchrun,
    before each worker joins the process group): the batch flags (`check_batch`), the HSDP and expert-parallel
    layout, the output folder and the corpus.

    config must be `resolve`d; `world` names where world_size comes from in messages (e.g. "--nproc 4").
    Uses the library's own rules: `shardfusion.topology.Degrees` for the layout, `shardfusion.train.data` for the split.

    Raises:
        ValueError: one line that names the flag to change and the numbers involved.
    """
    outer, ep, mp, cp = config.fsdp_outer_degree, config.ep, config.mp, config.cp
    if outer == AUTO:
        outer = 1  # the cost model picks a degree that fits; the layout check below is the ep one
    for flag, degree in (("--mp", mp), ("--cp", cp)):
        if degree < 1 or world_size % degree:
            raise ValueError(f"{flag} {degree} must be >= 1 and divide the {world_size} ranks ({world})")
        if degree > 1 and config.fsdp_outer_degree == AUTO:
            raise ValueError(f"--fsdp-outer-degree auto with {flag} {degree}: the cost model does not count "
                             "tensor- and context-parallel traffic yet; give the outer degree as an int")
    if world_size % (mp * cp):
        raise ValueError(f"--mp {mp} x --cp {cp} = {mp * cp} must divide the {world_size} ranks ({world})")
    if cp > 1:
        seq_len = config.model_config().seq_len
        if seq_len % cp:
            raise ValueError(f"--cp {cp} must divide the sequence length {seq_len} (--seq-len): each cp rank takes "
                             f"seq_len / cp tokens of every sequence")
        if config.dropout:
            raise ValueError(f"--cp {cp} needs --dropout 0 (got {config.dropout}): attention dropout would differ "
                             "from one process's")
    pipeline_config.check_world(config, world_size=world_size, world=world)  # --pp divides the world, and more
    outer_config.check_layout(config, world)  # diloco has replicas
    pp = config.pp
    split = "".join(f" / {flag} {degree}" for flag, degree in (("--pp", pp), ("--mp", mp), ("--cp", cp))
                    if degree > 1)
    check_batch(config, dp_world=batch_world(config, world_size), world=world + split)
    with_mp = "".join(f" with {flag} {degree}" for flag, degree in (("--pp", pp), ("--mp", mp), ("--cp", cp))
                      if degree > 1)
    try:
        Degrees(world_size=world_size, sharding=-1, pp=pp, mp=mp, cp=cp, fsdp_outer_degree=outer)
    except ValueError as error:
        raise ValueError(f"--fsdp-outer-degree {outer}{with_mp} does not fit {world_size} ranks ({world}): "
                         f"{error}") from None
    try:
        Degrees(world_size=world_size, sharding=-1, pp=pp, mp=mp, cp=cp, ep=ep, fsdp_outer_degree=outer)
    except ValueError as error:
        raise ValueError(f"--ep {ep} with --fsdp-outer-degree {outer}{with_mp.replace(' with', ' and')} does not fit "
                         f"{world_size} ranks ({world}): {error}") from None
    if mp > 1 and not (config.hf_model or config.init_from):
        from shardfusion.models.gpt_parallel import check_tensor_parallel
        try:
            check_tensor_parallel(config.model_config(), mp)
        except ValueError as error:
            raise ValueError(f"--mp {mp}: {error}") from None

    need = min_corpus_bytes(config.model_config().seq_len)
    seq = f"seq_len + 1 = {config.model_config().seq_len + 1}"
    if config.data_bytes < need:
        n_train, n_val = split_sizes(config.data_bytes)
        raise ValueError(f"--data-bytes {config.data_bytes} is too small: it splits into {n_train} train / {n_val} val "
                         f"bytes, but each split needs {seq} bytes; use --data-bytes >= {need} or a smaller --seq-len")
    if config.out is not None:
        out = Path(config.out)
        existing = next(p for p in (out, *out.absolute().parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"--out {config.out}: {existing} exists and is not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"--out {config.out}: the folder {existing} is not writable")

    if config.init_from is not None:
        check_pretrained(config)
    if not data_config.plain_bytes(config):
        return  # tokens, not bytes: data_config.prepare tokenizes the corpus and checks it
    where = "the standard library" if config.data is None else f"--data {config.data}"
    try:  # every --data file the run reads is checked to be text; the standard library only as far as needed
        size = corpus_size(config.data, config.data_bytes if config.data is not None else min(config.data_bytes, need))
    except OSError as error:
        raise ValueError(str(error) if str(error).startswith("--data") else f"{where}: {error}") from None
    if size == 0:
        raise ValueError(f"{where} holds no bytes; pass --data with a non-empty text file or folder (a corpus of "
                         f">= {need} bytes for --seq-len {config.model_config().seq_len})")
    if size < need:
        n_train, n_val = split_sizes(size)
        raise ValueError(f"{where} holds only {size} bytes, which split into {n_train} train / {n_val} val bytes, "
                         f"but each split needs {seq} bytes (a corpus of >= {need} bytes); use more data or a "
                         f"smaller --seq-len")


SLOW_ATTENTION_FLOPS = {"cpu": 1e12, "cuda": 1e15}
"""Attention work of one optimizer step per rank, in FLOPs, above which `seq_len_warning` warns, by device: on CPU,
at the tens of GFLOP/s a core gives, 1e12 is tens of seconds or more per step."""


def attention_flops(config: TrainConfig) -> float:
    """The causal attention's FLOPs of one optimizer step on one rank (forward and backward): 6 x n_layer x seq_len^2
    x d_model per sequence (q k^T and the weighted sum of v, 2 x seq_len^2 x d_model each, halved by the causal mask,
    times 3 with the backward), x --batch-size x --grad-accum sequences, / (--pp x --mp x --cp). It grows with the
    square of --seq-len, while everything else grows linearly. config must be `resolve`d."""
    model = config.model_config()
    per_sequence = 6.0 * model.n_layer * model.seq_len ** 2 * model.d_model
    split = max(1, config.pp) * max(1, config.mp) * max(1, config.cp)
    return per_sequence * config.batch_size * config.grad_accum / split


def seq_len_warning(config: TrainConfig) -> str | None:
    """A warning when --seq-len makes each step's attention work (`attention_flops`) exceed
    `SLOW_ATTENTION_FLOPS` on the run's device, else None (also for --init-from, whose shape is not the flags').
    A --seq-len the corpus cannot serve is an error of `check_run` instead. config must be `resolve`d."""
    if config.init_from is not None:
        return None
    flops, limit = attention_flops(config), SLOW_ATTENTION_FLOPS.get(config.device, SLOW_ATTENTION_FLOPS["cpu"])
    if flops <= limit:
        return None
    model = config.model_config()
    # the longest sequence that keeps the attention under the limit, as a power of two
    fits = model.seq_len * math.sqrt(limit / flops)
    shorter = 2 ** max(0, math.floor(math.log2(fits)))
    return (f"--seq-len {model.seq_len}: the attention alone needs about {flops:.1e} FLOPs per rank per optimizer "
            f"step (6 x n_layer {model.n_layer} x seq_len^2 x d_model {model.d_model} x {config.batch_size} "
            f"sequences x --grad-accum {config.grad_accum}), above {limit:.0e} on {config.device}: expect a slow "
            f"run (it grows with the square of --seq-len); --seq-len {shorter} or less stays under it")


PRETRAINED_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
"""The weight files a --init-from folder holds (one of them): one safetensors file, or the index of several."""


def check_pretrained(config: TrainConfig) -> None:
    """The checks of `--init-from DIR` that need no transformers: DIR holds a readable config.json with a
    model_type (the --hf-model one, if given), a vocabulary of at least the 256 bytes, room for --seq-len positions,
    and safetensors weights (`PRETRAINED_WEIGHTS`).

    Raises:
        ValueError: one line naming --init-from and what is wrong there.
    """
    folder = Path(config.init_from)
    flag = f"--init-from {config.init_from}"
    try:
        fields = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag}: cannot read a Hugging Face config.json there: {error}") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if not model_type:
        raise ValueError(f"{flag}: its config.json names no model_type; it is not a Hugging Face model folder")
    if config.hf_model is not None and config.hf_model != model_type:
        raise ValueError(f"{flag} holds a {model_type} model, not --hf-model {config.hf_model}; drop --hf-model (the "
                         f"folder's config.json decides the model) or make them agree")
    vocab = fields.get("vocab_size")
    spec = data_config.tokenizer_spec(config)  # a folder without a tokenizer: bytes only for a byte vocabulary
    if isinstance(vocab, int) and vocab < 256 and spec == BYTES:
        raise ValueError(f"{flag}: its vocab_size is {vocab}, but the job's tokens are the 256 byte values")
    positions = fields.get("max_position_embeddings")
    seq_len = config.model_config().seq_len
    if isinstance(positions, int) and seq_len > positions:
        raise ValueError(f"{flag}: --seq-len {seq_len} is longer than its max_position_embeddings {positions}; use "
                         f"--seq-len {positions} or less")
    if not any((folder / name).is_file() for name in PRETRAINED_WEIGHTS):
        raise ValueError(f"{flag} holds no weights: neither {' nor '.join(PRETRAINED_WEIGHTS)}")


def warmup_steps(config: TrainConfig, saved: dict[str, Any] | None = None) -> int:
    """--warmup, or when it is not given the saved run's (saved: a resumed checkpoint's settings), else
    `DEFAULT_WARMUP`; never more than --steps."""
    if config.warmup is not None:
        return config.warmup
    saved_warmup = (saved or {}).get("warmup")
    return min(config.steps, DEFAULT_WARMUP if saved_warmup is None else saved_warmup)


def lr_at(config: TrainConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up to lr, then cosine down to min_lr."""
    warmup = warmup_steps(config)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    decay_steps = max(1, config.steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_factor(config: TrainConfig, step: int) -> float:
    """The schedule of `lr_at` as a fraction of its peak --lr, for optimizer step `step` (0-based): between
    --min-lr / --lr and 1 (with --lr 0, the schedule's shape with --min-lr 0). Muon's lr at the step is --muon-lr
    times this."""
    if config.lr > 0:
        return lr_at(config, step) / config.lr
    return lr_at(dataclasses.replace(config, lr=1.0, min_lr=0.0), step)


def resolve(config: TrainConfig, *, device: str, world_size: int, saved: dict[str, Any] | None = None,
            ranks_per_node: int | None = None) -> TrainConfig:
    """Fill the run-time defaults: device, ep, fsdp_outer_degree, out, warmup (`warmup_steps`) and the batch sizes.

    ep: 1 for a Hugging Face model; else 2 when --experts and the sharding degree (world size / (pp x mp x cp)) are
    even, else 1. fsdp_outer_degree: `default_outer_degree` over nodes of ranks_per_node ranks (None: one node).
    Batch sizes (`resolve_batch`): saved is the settings of the checkpoint this run resumes
    (`shardfusion.train.resume.saved_settings`), None for a new run. The pipeline section's defaults:
    `pipeline_config.resolve`. Raises nothing: `check_run` checks the result."""
    ep = config.ep
    if config.hf_model is not None or config.init_from is not None:
        ep = 1  # Hugging Face models hold every expert (see TrainConfig.hf_model)
    elif ep is None:
        sharding = data_parallel_size(config, world_size)
        ep = 2 if config.experts and config.experts % 2 == 0 and sharding % 2 == 0 else 1
    outer = config.fsdp_outer_degree  # auto stays: the job plans it at start-up (shardfusion.train.job)
    if outer is None:
        outer, _ = default_outer_degree(dataclasses.replace(config, ep=ep), world_size, ranks_per_node, saved)
    out = config.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    config = resolve_batch(config, dp_world=batch_world(config, world_size), saved=saved)
    return dataclasses.replace(config, device=device, ep=ep, fsdp_outer_degree=outer, out=out,
                               warmup=warmup_steps(config, saved), **pipeline_config.resolve(config))


def default_outer_degree(config: TrainConfig, world_size: int, ranks_per_node: int | None,
                         saved: dict[str, Any] | None = None) -> tuple[int, str]:
    """--fsdp-outer-degree when it is not given, and why (one line), for `world_size` ranks on nodes of
    `ranks_per_node` (None, or >= world_size: one node); config's ep must be resolved. `saved`: the settings of the
    checkpoint this run resumes (`resolve`'s): over several nodes its int degree is kept when it fits the world, so
    that a run started with another default (before inner = one node was the default) resumes as it ran.

    One node: 2 when the ranks of a pipeline stage (world size / pp) are >= 4 and 2 divides the expert sharding
    degree (sharding / ep), else 1 (`make train`: HSDP 2 x 2). Several nodes: inner = one node, the README's rule:
    the smallest degree whose inner groups sit within a node (`shardfusion.topology.outer_degree_within_nodes`:
    world / (pp x ranks per node) when ep x cp x mp divides a node); when none does (ep x cp x mp does not divide
    ranks_per_node), or the degrees do not fit the world (`check_run` then says which), the one-node rule, and the
    reason says so. Raises nothing."""
    pp, ep = max(1, config.pp), max(1, config.ep or 1)
    sharding = data_parallel_size(config, world_size)
    moe_sharding = sharding // ep if sharding % ep == 0 else sharding
    one_node = 2 if world_size // pp >= 4 and moe_sharding % 2 == 0 else 1
    if ranks_per_node is None or ranks_per_node >= world_size:
        return one_node, (f"one node: outer {one_node}, the one-node default (2 when a pipeline stage has >= 4 ranks "
                          f"and 2 divides sharding / ep)")
    nodes = f"{world_size} ranks = {world_size // ranks_per_node} nodes x {ranks_per_node}"
    try:
        degrees = Degrees(world_size=world_size, pp=pp, mp=config.mp, cp=config.cp, ep=ep)
    except ValueError:
        return one_node, f"{nodes}: the one-node default {one_node}, as --ep/--pp/--mp/--cp do not fit the world"
    outer = outer_degree_within_nodes(degrees, ranks_per_node)
    kept = (saved or {}).get("fsdp_outer_degree")
    if isinstance(kept, int) and not isinstance(kept, bool) and kept > 0 and degrees.moe_sharding % kept == 0:
        return kept, (f"{nodes}: outer {kept}, kept from the checkpoint this run resumes (the default over several "
                      f"nodes, inner = one node, would be {outer or one_node})")
    if outer is None:
        block = " x ".join(f"{flag} {v}" for flag, v in (("--ep", ep), ("--cp", config.cp), ("--mp", config.mp))
                           if v > 1)
        return one_node, (f"{nodes}: no outer degree keeps the inner groups within a node, as {block} = "
                          f"{ep * config.cp * config.mp} ranks do not divide {ranks_per_node}; the one-node default "
                          f"{one_node}")
    inner = degrees.sharding // outer
    span = inner * config.cp * config.mp  # consecutive ranks of an inner group's block
    where = "one node" if span == ranks_per_node else f"{span} of the {ranks_per_node} ranks of a node"
    return outer, f"{nodes}: outer {outer} x inner {inner}, each inner group {where}, the default over several nodes"


def resolve_batch(config: TrainConfig, *, dp_world: int, saved: dict[str, Any] | None = None) -> TrainConfig:
    """Fill --batch-size (B, per data-parallel rank) and --global-batch-size (G) from each other: G = B x dp_world.

    Neither given: a resumed run (saved: its checkpoint's settings) keeps the saved G, or, for a checkpoint of a run
    before the global data order (no saved G), the saved B; a new run takes B = `DEFAULT_BATCH_SIZE`. Only G given:
    B = G / dp_world when that divides, else B stays None for `check_batch` to refuse. Both given: kept as they
    are (`check_batch` compares them)."""
    per_rank, total = config.batch_size, config.global_batch_size
    if per_rank is None and total is None:
        saved = saved or {}
        total = saved.get("global_batch_size")
        per_rank = saved.get("batch_size", DEFAULT_BATCH_SIZE) if total is None else None
    if total is None:
        total = per_rank * dp_world
    elif per_rank is None and total % dp_world == 0:
        per_rank = total // dp_world
    return dataclasses.replace(config, batch_size=per_rank, global_batch_size=total)


def _field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written under it in the class body (of the class that
    declares it: `TrainConfig`'s sections are its base classes)."""
    docs: dict[str, str] = {}
    for owner in reversed(cls.__mro__):
        if dataclasses.is_dataclass(owner):
            docs.update(_own_field_docs(owner))
    return docs


@functools.lru_cache(maxsize=None)
def _own_field_docs(cls: type) -> dict[str, str]:
    """`_field_docs` of the fields declared in ``cls``'s own body (read once per class: parsing the source is most
    of what building the parser costs; the caller must not change the dict)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def finite_float(text: str) -> float:
    """argparse type of the float flags: a finite number (nan and inf are refused, so a run cannot silently train on
    NaN or turn clipping off).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a number, or not a finite one.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


class OneLineErrors(argparse.ArgumentParser):
    """argparse's parser whose usage errors (its own: an unknown flag, a value of the wrong type; and `usage_error`'s)
    are one line, ``shardfusion-train: error: <message>``, with exit status 2: no usage block before it (``--help``
    shows that)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser(cls: type = TrainConfig) -> argparse.ArgumentParser:
    """An ArgumentParser with one --kebab-case flag per dataclass field, typed from its annotation. Abbreviated flags
    are refused (``--step 2`` is not ``--steps 2``), float flags take finite numbers only, and a usage error is one
    line (`OneLineErrors`)."""
    parser = OneLineErrors(
        prog="shardfusion-train",
        description="Train a byte-level GPT with shardfusion (FSDP/HSDP) on this machine's CPUs or GPUs.",
        allow_abbrev=False,
    )
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    own = cls.__dict__.get("__annotations__", {})  # the class's own fields first, then its sections' (base classes)
    for field in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        if field.metadata.get("flag", True) is False:  # set at run time (e.g. DataConfig.vocab_size)
            continue
        kind = hints[field.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args else kind
        flag = "--" + field.name.replace("_", "-")
        help_text = docs.get(field.name, "").replace("%", "%%")
        if "parse" in field.metadata:  # a field with a parser of its own (e.g. an int or "auto")
            parser.add_argument(flag, type=field.metadata["parse"], default=field.default,
                                metavar=field.metadata.get("metavar"), help=help_text)
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
        else:
            parser.add_argument(flag, type=finite_float if base is float else base, default=field.default,
                                metavar=base.__name__.upper(), help=help_text)
    return parser


def usage_error(message: str) -> NoReturn:
    """Print the one line `shardfusion-train: error: message` to stderr and exit with status 2 (`OneLineErrors`)."""
    build_parser().error(message)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line into a validated TrainConfig."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    config = TrainConfig(**vars(namespace))
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config
