"""Hugging Face causal language models in the training job: `--hf-model llama|qwen3_moe|mixtral` (small presets over
the job's byte vocabulary) and `--init-from DIR` (a pretrained folder: config.json and safetensors weights).

transformers is an optional extra (`pip install 'shardfusion[hf]'`): nothing here imports it before a function
that needs it runs (`import_transformers`), so the job's GPT path and `import shardfusion` never load it.

What the job does with an HF model (docs/hf-models.md has the whole story):

- The model is the HF module itself (`AutoModelForCausalLM.from_config`), sharded with `sf.fully_shard`; its
  units are the classes named by `model._no_split_modules` (the decoder layers, see `unit_classes`). Parameter
  names are HF's, so a checkpoint exports straight to an HF folder.
- The loss is computed here, not by HF: the job's batches are (x, y) with y already shifted by one byte, while HF
  shifts `labels` inside. `losses` takes `model(input_ids=x).logits` and the fp32 cross-entropy against y, as the
  GPT does.
- An MoE model (`is_moe`) is called with `output_router_logits=True`: its `aux_loss` (HF's load-balancing loss,
  computed once over the router logits of all layers) is what the job weighs by `--aux-loss-coef`, and the router
  logits give the job's expert-load figures. Experts run in HF's own modules on every rank (ep = 1).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardfusion.models.gpt import sample_next

HF_MODELS = ("llama", "qwen3_moe", "mixtral")
"""The `--hf-model` presets; each is also the HF `model_type` of the model it builds."""

INSTALL_HINT = "pip install 'shardfusion[hf]'"
"""How to get transformers, named by every error about its absence."""

ATTN_IMPLEMENTATION = "sdpa"
"""HF attention kernel: torch's scaled_dot_product_attention (causal), deterministic on the CPU, like the GPT's."""

EXPERTS_IMPLEMENTATION = "eager"
"""HF expert kernel (transformers >= 5 has several): the plain per-expert loop, which every version has."""

VOCAB_SIZE = 256
"""The presets' vocabulary with the byte tokenizer (the job's default)."""

ALIGN = 8
"""Derived intermediate sizes are rounded up to a multiple of this."""


def import_transformers(what: str = "Hugging Face models") -> Any:
    """The transformers module.

    Raises:
        ValueError: transformers is not installed: "<what> needs the transformers package (`INSTALL_HINT`): ...".
    """
    try:
        import transformers
    except ImportError as error:
        raise ValueError(f"{what} needs the transformers package ({INSTALL_HINT}): {error}") from None
    return transformers


def _round_up(n: float) -> int:
    return int(math.ceil(n / ALIGN) * ALIGN)


def swiglu_width(dense_width: int) -> int:
    """The SwiGLU hidden width (three matrices) with the parameters of a GELU MLP of `dense_width` (two matrices):
    2/3 of it, rounded up to a multiple of `ALIGN`."""
    return _round_up(2 * dense_width / 3)


def kv_heads(n_head: int) -> int:
    """Key/value heads of a preset: half the query heads (grouped-query attention) when that is a whole number,
    else as many."""
    return n_head // 2 if n_head % 2 == 0 else n_head


def preset_config(name: str, *, n_layer: int, n_head: int, d_model: int, seq_len: int, n_experts: int, top_k: int,
                  expert_hidden: Optional[int], dropout: float, aux_loss_coef: float,
                  vocab_size: int = VOCAB_SIZE) -> Any:
    """The HF config of the `--hf-model name` preset, from the job's shape flags.

    Every preset: vocab_size (the tokenizer's; 256 for bytes), hidden_size d_model, num_hidden_layers n_layer, num_attention_heads n_head,
    num_key_value_heads `kv_heads(n_head)`, head_dim d_model // n_head, max_position_embeddings seq_len,
    attention_dropout dropout, initializer_range 0.02 (the GPT's), RoPE and RMSNorm at HF's defaults.

    - llama: a SwiGLU MLP of `swiglu_width(4 * d_model)` (the GPT MLP's parameters); tied embeddings, like the GPT.
    - qwen3_moe, mixtral: every layer's MLP a mixture of n_experts SwiGLU experts, top_k per token, each of width
      expert_hidden or `swiglu_width(4 * d_model // top_k)` (the GPT-MoE expert's parameters); top-k gates
      renormalized (as shardfusion.moe.MoE does); router_aux_loss_coef aux_loss_coef (HF applies it only when
      given labels, which the job never passes: it is recorded for whoever trains the export further); untied
      embeddings (HF's default for both).

    Raises:
        ValueError: an unknown name, or a MoE preset with n_experts < 1; transformers is missing.
    """
    if name not in HF_MODELS:
        raise ValueError(f"--hf-model must be one of {', '.join(HF_MODELS)}, got {name!r}")
    if name != "llama" and n_experts < 1:
        raise ValueError(f"--hf-model {name} is a mixture of experts: it needs --experts >= 1, got {n_experts} "
                         f"(--hf-model llama is the dense model)")
    transformers = import_transformers()
    common = dict(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layer, num_attention_heads=n_head,
                  num_key_value_heads=kv_heads(n_head), head_dim=d_model // n_head, max_position_embeddings=seq_len,
                  attention_dropout=dropout, initializer_range=0.02, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if name == "llama":
        config = transformers.LlamaConfig(intermediate_size=swiglu_width(4 * d_model), tie_word_embeddings=True,
                                          **common)
    else:
        width = expert_hidden if expert_hidden is not None else swiglu_width(4 * d_model // top_k)
        moe = dict(num_experts_per_tok=top_k, router_aux_loss_coef=aux_loss_coef, output_router_logits=False,
                   tie_word_embeddings=False)
        if name == "qwen3_moe":
            config = transformers.Qwen3MoeConfig(num_experts=n_experts, moe_intermediate_size=width,
                                                 intermediate_size=swiglu_width(4 * d_model), norm_topk_prob=True,
                                                 decoder_sparse_step=1, mlp_only_layers=[], **moe, **common)
        else:
            config = transformers.MixtralConfig(num_local_experts=n_experts, intermediate_size=width, **moe,
                                                **common)
    config.architectures = [ARCHITECTURES[name]]
    return config


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""The HF class each preset builds (config.json's `architectures`)."""


def load_config(folder: str) -> Any:
    """The HF config of a pretrained folder (its config.json), through `AutoConfig.from_pretrained`."""
    return import_transformers().AutoConfig.from_pretrained(folder)


def config_from_dict(fields: dict[str, Any]) -> Any:
    """An HF config from `config_dict`'s output (e.g. a checkpoint's `extra["hf_config"]`)."""
    fields = dict(fields)
    return import_transformers().AutoConfig.for_model(fields.pop("model_type"), **fields)


def config_dict(config: Any) -> dict[str, Any]:
    """The config as the plain dict HF writes to config.json (`to_dict`), `architectures` included, with the dtype
    of the job's parameters: float32 (shards and checkpoints stay fp32 whatever --param-dtype, also when
    --init-from's weights were stored in another dtype)."""
    fields = config.to_dict()
    for key in ("dtype", "torch_dtype"):  # transformers >= 5 / < 5
        if key in fields:
            fields[key] = "float32"
    return fields


def build_model(config: Any) -> nn.Module:
    """`AutoModelForCausalLM.from_config(config)` with `ATTN_IMPLEMENTATION` attention and `EXPERTS_IMPLEMENTATION`
    experts, initialized from torch's global RNG (seed it first), in float32 (the job's parameters are fp32; a
    pretrained config may name another dtype, which from_config would build in). Works under
    `torch.device("meta")`."""
    transformers = import_transformers()
    config._experts_implementation = EXPERTS_IMPLEMENTATION  # a plain attribute where transformers has no such choice
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    return model.float()


def unit_classes(model: nn.Module) -> tuple[type, ...]:
    """The module classes that `model._no_split_modules` names (HF's list of the blocks that must stay whole: the
    decoder layers), found among the classes of `model.modules()`: the units to give `sf.fully_shard`.

    Raises:
        ValueError: the model names none, or none of its names is the class of one of its modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"{type(model).__name__}._no_split_modules is {sorted(names)}: no module class of the "
                         f"model matches, so it cannot be split into units")
    return tuple(sorted(found, key=lambda cls: cls.__name__))


def moe_shape(config: Any) -> tuple[int, int]:
    """(experts per MoE layer, experts per token) of an HF config; (0, 0) for a dense model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    return (experts, getattr(config, "num_experts_per_tok", 0) or 0) if experts else (0, 0)


def is_moe(config: Any) -> bool:
    """Whether the model routes tokens to experts and can return its router logits (`output_router_logits`)."""
    return moe_shape(config)[0] > 0 and hasattr(config, "output_router_logits")


def num_parameters(model: nn.Module, config: Any, active: bool = False) -> int:
    """Distinct parameter elements (a tied weight counts once). With `active`: those one token uses, counting
    top_k / num_experts of every experts module (a module named `*.experts`)."""
    total = sum(p.numel() for p in model.parameters())
    if not active or not is_moe(config):
        return total
    experts, top_k = moe_shape(config)
    expert_numel = sum(p.numel() for name, m in model.named_modules() if name.endswith(".experts")
                       for p in m.parameters())
    return total - expert_numel + expert_numel * top_k // experts


def losses(model: nn.Module, config: Any, x: torch.Tensor,
           y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One forward of a (sharded) HF model on x (B, T) against the shifted targets y (B, T).

    Returns the mean fp32 cross-entropy of the logits against y (HF's own `labels` loss would shift y once more),
    the model's load-balancing `aux_loss` (0-dim; a zero constant for a dense model), and for an MoE model the
    (L, E) int64 counts of this rank's top-k assignments per MoE layer and expert, from the router logits
    (None for a dense model)."""
    moe = is_moe(config)
    extra = {"output_router_logits": True} if moe else {}
    out = model(input_ids=x, use_cache=False, **extra)
    logits = out.logits  # (B, T, V)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    if not moe:
        return loss, torch.zeros((), device=logits.device), None
    experts, top_k = moe_shape(config)
    tokens = torch.stack([torch.bincount(torch.topk(r.detach(), top_k, dim=-1).indices.reshape(-1),
                                         minlength=experts) for r in out.router_logits])  # (L, E)
    return loss, out.aux_loss.float(), tokens


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, seq_len: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens sampled from an (unsharded) HF model; returns (B, T + new).

    The GPT's sampler (`shardfusion.models.gpt.GPT.generate`) on the model's logits: the context cropped to
    seq_len, no KV cache, only the tokenizer's vocab_size ids eligible (a model's embedding may hold more rows);
    temperature <= 0 is greedy decoding, top_k keeps the k most likely tokens."""
    for _ in range(max_new_tokens):
        logits = model(input_ids=idx[:, -seq_len:], use_cache=False).logits[:, -1, :vocab_size].float()  # (B, V)
        idx = torch.cat([idx, sample_next(logits, temperature, top_k, generator)], dim=1)  # (B, T + 1)
    return idx
