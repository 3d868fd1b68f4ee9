"""The model a run of `shardfusion.train` trains, behind the one interface the training loop uses: the byte-level
GPT (GPT-MoE) of `shardfusion.models.gpt`, or a Hugging Face causal LM (`--hf-model`, `--init-from`; see
`shardfusion.train.hf_models`, which alone imports transformers).

The loop, the checkpoints, the resume checks, the metrics and the sample are the same for both; what differs is
here: how the model is built and split into units, its loss terms per micro-batch, what a checkpoint records
about it, and how a plain copy of it samples text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import shardfusion as sf
from shardfusion.models.gpt import GPT, Block
from shardfusion.train.config import ResolvedJob

Losses = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
"""(model, x, y) -> (cross-entropy, load-balancing loss, (L, E) expert assignments or None): one micro-batch."""


@dataclass(frozen=True, kw_only=True)
class JobModel:
    """One run's model, before `fully_shard`, and what the loop needs to know about it."""

    module: nn.Module
    """The model to shard, built on the meta device: `fully_shard(..., device=, init_fn=)` materializes it module by
    module, so no rank ever holds it whole."""
    init_fn: Optional[Callable[[nn.Module], None]]
    """`fully_shard`'s `init_fn`: None for the GPT (its modules' own `reset_parameters`, bitwise its eager init),
    the HF model's `_init_weights` for an HF model (its initializer_range; it also recomputes the rotary buffers)."""
    units: tuple[type, ...]
    """The module classes that each form a unit (`fully_shard(units=...)`)."""
    name: str
    """How the summary, the plot and the messages name the model."""
    seq_len: int
    """Bytes per training sequence."""
    extra: dict[str, dict[str, Any]]
    """What a checkpoint's `extra` records about the model: {"model": GPTConfig fields} for the GPT (what
    `GPT(GPTConfig(**fields))` needs), {"hf_config": the HF config dict} for an HF model (what
    `python -m shardfusion.export` writes as config.json, and what builds the model again)."""
    num_params: int
    """Distinct parameter elements (a tied weight counts once; every expert counts)."""
    num_active: int
    """Parameter elements one token uses (top_k of the experts of each MoE layer)."""
    n_moe_layers: int
    """Layers that route tokens to experts (0: a dense model)."""
    n_experts: int
    """Experts per MoE layer (0: a dense model)."""
    top_k: int
    """Experts per token."""
    losses: Losses
    """One micro-batch's loss terms on the sharded model (every rank calls it: a forward is collective)."""
    plain: Callable[[], nn.Module]
    """A fresh, unsharded copy of the architecture on the CPU with every expert (it loads a `full_state_dict`)."""
    tied: frozenset[str]
    """Parameter names tied to another one (a state dict may hold them under the other name only)."""
    generate: Callable[[nn.Module, torch.Tensor, int, float, int, torch.Generator], torch.Tensor]
    """(plain model, prompt (1, T), new bytes, temperature, top_k, generator) -> (1, T + new)."""

    @property
    def moe(self) -> bool:
        """Whether the model routes tokens to experts (``n_experts > 0``)."""
        return self.n_experts > 0


def is_hf(config: ResolvedJob) -> bool:
    """Whether the run trains a Hugging Face model (`--hf-model` or `--init-from`)."""
    return config.model.hf_model is not None or config.model.init_from is not None


def hf_config(config: ResolvedJob) -> Any:
    """The HF config of an HF run: `--init-from DIR`'s config.json, or the `--hf-model` preset built from the shape
    flags (`hf_models.preset_config`). `--dropout` sets its attention_dropout either way.

    Raises:
        ValueError: transformers is missing (the message names `pip install 'shardfusion[hf]'`).
    """
    from shardfusion.train import hf_models

    if config.model.init_from is not None:
        hf = hf_models.load_config(config.model.init_from)
        if hasattr(hf, "attention_dropout"):
            hf.attention_dropout = config.model.dropout
        return hf
    shape = config.model_config()
    return hf_models.preset_config(config.model.hf_model, n_layer=shape.n_layer, n_head=shape.n_head,
                                   d_model=shape.d_model, seq_len=shape.seq_len, n_experts=shape.n_experts, top_k=shape.top_k,
                                   expert_hidden=shape.expert_hidden, dropout=config.model.dropout,
                                   aux_loss_coef=config.model.aux_loss_coef, vocab_size=shape.vocab_size)


def meta_model(config: ResolvedJob) -> nn.Module:
    """The run's model on the meta device (no memory, no process group): its parameter names and shapes, for the
    resume check before any worker starts."""
    if is_hf(config):
        from shardfusion.train import hf_models

        hf = hf_config(config)
        with torch.device("meta"):
            return hf_models.build_model(hf)
    with torch.device("meta"):
        return GPT(config.model_config())


def checked_meta_model(config: ResolvedJob) -> nn.Module:
    """`meta_model` of an HF run, with the failures of transformers, of DIR's config and of the model's units as
    one-line errors naming the flag: run before any worker starts.

    Raises:
        ValueError: transformers is missing (naming `pip install 'shardfusion[hf]'`), `--init-from DIR`'s config is
            not one this transformers can build as a causal LM, or the model has no units.
    """
    from shardfusion.train import hf_models

    given = config.model
    flag = f"--init-from {given.init_from}" if given.init_from is not None else f"--hf-model {given.hf_model}"
    hf_models.import_transformers(what=flag)
    try:
        model = meta_model(config)
    except (KeyError, OSError, TypeError, ValueError) as error:
        text = " ".join(str(error).split())  # one line, whatever transformers said
        raise ValueError(f"{flag}: cannot build the model: {text}") from None
    try:
        hf_models.unit_classes(model)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    return model


def load_pretrained(model: nn.Module, folder: str) -> None:
    """Load `--init-from`'s safetensors weights (model.safetensors or a sharded index) into the sharded `model`,
    each rank reading its own slices: `sf.load_safetensors`. Collective.

    Raises:
        ValueError: on every rank: parameters missing from the folder, unexpected ones, or other shapes.
    """
    sf.load_safetensors(model, folder)


def build(config: ResolvedJob, ep_group: Optional[dist.ProcessGroup], device: torch.device,
          mp_mesh=None, context_group: Optional[dist.ProcessGroup] = None) -> JobModel:
    """The run's model on the meta device, to be initialized from `--seed` (the same on every rank) by
    `fully_shard(job.module, ..., device=device, init_fn=job.init_fn)`.

    ep_group: the topology's ep group; a GPT-MoE holds this ep rank's experts (HF models hold all of theirs).
    mp_mesh: with --mp > 1 the topology's mp mesh: the GPT is then built with values on the CPU (the same draws as
    the meta build's initialization) and split over the mesh (`gpt_parallel.parallelize`); fully_shard does not
    initialize DTensors on the meta device yet, so each rank holds the whole model until it is sharded.
    context_group: with --cp > 1 the topology's context group: the GPT then takes this rank's part of each sequence
    and its attention is collective over the group (`shardfusion.context_parallel`)."""
    torch.manual_seed(config.schedule.seed)
    if mp_mesh is not None and mp_mesh.size() > 1:
        from shardfusion.models.gpt_parallel import parallelize
        job = _build_gpt(config, ep_group, context_group)
        parallelize(job.module, mp_mesh)
        return job
    with torch.device("meta"):
        return _build_hf(config) if is_hf(config) else _build_gpt(config, ep_group, context_group)


def _gpt_losses(model: nn.Module, x: torch.Tensor,
                y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    _, loss = model(x, y)
    tokens = model.tokens_per_expert()  # (L, E); (0, 0) for a dense GPT
    return loss, model.aux_loss(), tokens if tokens.numel() else None


def _gpt_generate(model: nn.Module, idx: torch.Tensor, new: int, temperature: float, top_k: int,
                  generator: torch.Generator) -> torch.Tensor:
    return model.generate(idx, new, temperature=temperature, top_k=top_k, generator=generator)


def _build_gpt(config: ResolvedJob, ep_group: Optional[dist.ProcessGroup],
               context_group: Optional[dist.ProcessGroup] = None) -> JobModel:
    shape = config.model_config()
    model = GPT(shape, ep_group=ep_group, context_group=context_group if config.parallelism.cp > 1 else None)
    moe = shape.n_experts > 0
    return JobModel(
        module=model, init_fn=None, units=(Block,), seq_len=shape.seq_len,
        name=(f"{config.model.preset} GPT-MoE ({shape.n_experts} experts, top-{shape.top_k})" if moe
              else f"{config.model.preset} GPT"),
        extra={"model": dataclasses.asdict(shape)}, num_params=model.num_parameters(),
        num_active=model.num_parameters(active=True), n_moe_layers=shape.n_layer if moe else 0,
        n_experts=shape.n_experts, top_k=shape.top_k if moe else 0, losses=_gpt_losses,
        plain=lambda: GPT(shape), tied=frozenset({"lm_head.weight"} if shape.tie_embeddings else ()),
        generate=_gpt_generate)


def _build_hf(config: ResolvedJob) -> JobModel:
    from shardfusion.train import hf_models

    hf = hf_config(config)
    model = hf_models.build_model(hf)
    experts, top_k = hf_models.moe_shape(hf) if hf_models.is_moe(hf) else (0, 0)
    seq_len = config.model_config().seq_len

    def losses(m: nn.Module, x: torch.Tensor, y: torch.Tensor):
        return hf_models.losses(m, hf, x, y)

    def generate(m: nn.Module, idx: torch.Tensor, new: int, temperature: float, k: int, generator: torch.Generator):
        return hf_models.generate(m, idx, new, seq_len, temperature=temperature, top_k=k, generator=generator,
                                  vocab_size=config.vocab_size or hf_models.VOCAB_SIZE)

    def plain() -> nn.Module:
        with torch.device("cpu"):  # build() runs under the meta device; the copy needs storage
            return hf_models.build_model(hf)

    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()}
    source = f"from {config.model.init_from}" if config.model.init_from else f"--hf-model {config.model.hf_model}"
    moe_text = f", {experts} experts, top-{top_k}" if experts else ""
    n_moe = sum(1 for name, _ in model.named_modules() if name.endswith(".experts")) if experts else 0
    return JobModel(
        module=model, init_fn=model._init_weights, units=hf_models.unit_classes(model), seq_len=seq_len,
        name=f"{type(model).__name__} ({source}{moe_text})", extra={"hf_config": hf_models.config_dict(hf)},
        num_params=hf_models.num_parameters(model, hf), num_active=hf_models.num_parameters(model, hf, active=True),
        n_moe_layers=n_moe, n_experts=experts, top_k=top_k, losses=losses, plain=plain,
        tied=frozenset(tied), generate=generate)
