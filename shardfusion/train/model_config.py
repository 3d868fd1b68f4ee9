"""The model section of the training job's settings (`--preset`, `--hf-model`, `--init-from`, the shape flags, the
MoE flags) and its checks: this module owns them; `shardfusion.train.config.JobConfig` composes the section and calls
`check_flags` with the other sections' checks. `shape` turns the section into the `GPTConfig` the job builds
(`shardfusion.train.job_model`); `check_pretrained` checks an --init-from folder before any worker starts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from shardfusion.models.gpt import PRESETS, VOCAB_SIZE, GPTConfig
from shardfusion.train.hf_models import HF_MODELS
from shardfusion.train.sections import meta

PRETRAINED_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
"""The weight files a --init-from folder holds (one of them): one safetensors file, or the index of several."""

SHAPE_OVERRIDES = ("n_layer", "n_head", "d_model", "seq_len", "expert_hidden")
"""The fields that override the preset's when given."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What model the job trains and its shape (a section of `JobConfig`)."""

    preset: str = field(default="small", metadata=meta(ft_shared=True))
    """Model shape from shardfusion.models.PRESETS (default small); --n-layer etc. override single fields."""
    hf_model: str | None = field(default=None, metadata=meta(resume=True, ft_shared=True))
    """Train a Hugging Face transformers model instead of the GPT: llama, qwen3_moe or mixtral, built over the
    byte vocabulary with the shape flags (--preset, --n-layer, --n-head, --d-model, --seq-len; --experts, --top-k
    and --expert-hidden for the MoE ones); needs pip install 'shardfusion[hf]'; --ep must be 1 (default: the GPT)."""
    init_from: str | None = field(default=None, metadata=meta(resume=True))
    """Start from a pretrained Hugging Face folder (config.json, model.safetensors or a sharded index): the model is
    built from its config.json and loaded with its weights; the shape flags other than --seq-len do not apply
    (default: none, a fresh model)."""
    n_layer: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Transformer blocks (default: from the preset)."""
    n_head: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Attention heads per block (default: from the preset)."""
    d_model: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Residual stream width (default: from the preset)."""
    seq_len: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Context length in bytes (default: from the preset)."""
    dropout: float = field(default=0.0, metadata=meta(resume=True, ft_shared=True))
    """Dropout probability (default 0.0)."""
    experts: int = field(default=4, metadata=meta(ft_shared=True))
    """Experts per MoE layer: every block's MLP becomes a routed mixture of experts (GPT-MoE); 0 gives the dense
    GPT (default 4)."""
    top_k: int = field(default=2, metadata=meta(ft_shared=True))
    """Experts each token is routed to, at most --experts (default 2)."""
    expert_hidden: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Hidden width of each expert (default: 4 * d_model // top_k, the compute of one dense MLP per token)."""
    aux_loss_coef: float = field(default=0.01, metadata=meta(resume=True, ft_shared=True))
    """Weight of the MoE load-balancing loss added to the cross-entropy (default 0.01)."""
    fused_qkv: bool = field(default=False, metadata=meta(ft_shared=True))
    """One (3C, C) q/k/v projection per block (the GPT's layout before tensor parallel) instead of three (C, C) ones;
    the same initial weights and arithmetic. A resumed run takes its checkpoint's layout (default: three)."""
    tie_embeddings: bool = field(default=True, metadata=meta(ft_shared=True))
    """Share one weight between the token embedding and the lm head (GPT only); --no-tie-embeddings gives the head
    a weight of its own, which --pp > 1 needs (the embedding is on the first stage, the head on the last)
    (default: tied)."""


def is_hf(model: ModelConfig) -> bool:
    """Whether the run trains a Hugging Face model (--hf-model or --init-from) rather than the GPT."""
    return model.hf_model is not None or model.init_from is not None


def shape(model: ModelConfig, vocab_size: int | None = None) -> GPTConfig:
    """The preset with the section's overrides applied, over ``vocab_size`` ids (None: the byte vocabulary).

    Raises:
        ValueError: an unknown --preset.
    """
    if model.preset not in PRESETS:
        raise ValueError(f"--preset {model.preset!r} is unknown; choose one of {sorted(PRESETS)}")
    overrides = {name: getattr(model, name) for name in SHAPE_OVERRIDES if getattr(model, name) is not None}
    return dataclasses.replace(PRESETS[model.preset], dropout=model.dropout, n_experts=model.experts,
                               vocab_size=vocab_size or VOCAB_SIZE, top_k=model.top_k, fused_qkv=model.fused_qkv,
                               tie_embeddings=model.tie_embeddings, **overrides)


def check_flags(model: ModelConfig) -> None:
    """The section's flags on their own and together (the HF model against the parallel degrees:
    `shardfusion.train.parallel_config.check_flags`).

    Raises:
        ValueError: one line naming the flag to change.
    """
    if model.hf_model is not None and model.hf_model not in HF_MODELS:
        raise ValueError(f"--hf-model must be one of {', '.join(HF_MODELS)}, got {model.hf_model!r}")
    if model.init_from is not None:
        for name in ("n_layer", "n_head", "d_model", "expert_hidden"):
            if getattr(model, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} does not apply to --init-from {model.init_from}: "
                                 f"the model's shape comes from its config.json; drop the flag")
    elif model.hf_model is not None and model.hf_model != "llama" and model.experts < 1:
        raise ValueError(f"--hf-model {model.hf_model} is a mixture of experts: it needs --experts >= 1, got "
                         f"{model.experts} (--hf-model llama is the dense model)")
    if model.experts < 0:
        raise ValueError(f"--experts must be >= 0, got {model.experts}")
    if model.experts and not 1 <= model.top_k <= model.experts:
        raise ValueError(f"--top-k {model.top_k} must be between 1 and --experts {model.experts}")
    if model.expert_hidden is not None and model.expert_hidden < 1:
        raise ValueError(f"--expert-hidden must be >= 1, got {model.expert_hidden}")
    if model.aux_loss_coef < 0:
        raise ValueError(f"--aux-loss-coef must be >= 0, got {model.aux_loss_coef}")
    shape(model)


def check_pretrained(model: ModelConfig, tokenizer_spec: str, seq_len: int) -> None:
    """The checks of `--init-from DIR` that need no transformers: DIR holds a readable config.json with a
    model_type (the --hf-model one, if given), a vocabulary of at least the 256 bytes (when ``tokenizer_spec``, what
    --tokenizer resolves to, is bytes), room for ``seq_len`` positions, and safetensors weights
    (`PRETRAINED_WEIGHTS`).

    Raises:
        ValueError: one line naming --init-from and what is wrong there.
    """
    from shardfusion.train.tokenizer import BYTES
    folder = Path(model.init_from)
    flag = f"--init-from {model.init_from}"
    try:
        fields = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag}: cannot read a Hugging Face config.json there: {error}") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if not model_type:
        raise ValueError(f"{flag}: its config.json names no model_type; it is not a Hugging Face model folder")
    if model.hf_model is not None and model.hf_model != model_type:
        raise ValueError(f"{flag} holds a {model_type} model, not --hf-model {model.hf_model}; drop --hf-model (the "
                         f"folder's config.json decides the model) or make them agree")
    vocab = fields.get("vocab_size")
    if isinstance(vocab, int) and vocab < 256 and tokenizer_spec == BYTES:
        raise ValueError(f"{flag}: its vocab_size is {vocab}, but the job's tokens are the 256 byte values")
    positions = fields.get("max_position_embeddings")
    if isinstance(positions, int) and seq_len > positions:
        raise ValueError(f"{flag}: --seq-len {seq_len} is longer than its max_position_embeddings {positions}; use "
                         f"--seq-len {positions} or less")
    if not any((folder / name).is_file() for name in PRETRAINED_WEIGHTS):
        raise ValueError(f"{flag} holds no weights: neither {' nor '.join(PRETRAINED_WEIGHTS)}")
