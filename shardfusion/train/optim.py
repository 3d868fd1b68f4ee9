"""The optimizers of the training job: AdamW with name-based weight-decay groups, or (``--optimizer muon``) Muon on
the 2-D weights of the units, kept whole on one owner rank by ``fully_shard(whole_params=...)``, with AdamW on the
rest; the learning rates of each step; the owner balance the job records (docs/train-muon.md).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from shardfusion.train.optim_config import OptimizerConfig
from shardfusion.train.schedule import ScheduleConfig, lr_at, lr_factor

ADAM_BETAS = (0.9, 0.95)
MUON_MOMENTUM = 0.95
MUON_ADJUST_LR = "original"
"""torch.optim.Muon's adjust_lr_fn for --optimizer muon: each matrix's lr is --muon-lr x sqrt(max(1, rows / cols))
(Keller Jordan's Muon), so --muon-lr is the step size of the orthogonalized update itself (0.02 to 0.05 in his
recipes; the job's default 0.05 was measured best on make train's run); see docs/train-muon.md for why not
"match_rms_adamw"."""

EMBEDDINGS = ("wte", "wpe", "embed_tokens", "embed_positions")
"""Module names of embeddings: the GPT's and those of Hugging Face decoders."""


def no_decay(name: str) -> bool:
    """Whether the parameter called `name` is exempt from weight decay: biases, norms and embeddings.

    Decided by name (the job's choice; after `fully_shard` fragments keep `p.dim()`, so nanoGPT's `p.dim() >= 2`
    works too, see docs/shape-true-parameters.md): embeddings are 2-D and exempt here. A norm
    is a module whose name starts with "ln" or holds "norm" (the GPT's `ln_1`, `ln_f`; HF's `input_layernorm`,
    `model.norm`, Qwen3's `q_norm`); embeddings are `EMBEDDINGS`. Everything else decays: matrices, MoE routers
    (`mlp.gate.weight`), HF's fused expert tensors (`mlp.experts.gate_up_proj`) and an untied `lm_head.weight`."""
    parts = name.split(".")
    return (parts[-1] == "bias"
            or any(p.startswith("ln") or "norm" in p or p in EMBEDDINGS for p in parts[:-1]))


Models = Union[nn.Module, Sequence[nn.Module]]
"""A sharded model, or the list of pipeline stages one rank holds (each named as in the whole model)."""


def named_parameters(model: Models) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()``, over every stage of a list of stage models in turn; a stage's copy of a weight
    tied across stages under that weight's name (``checkpoint_aliases``: the last GPT stage's ``lm_head.weight`` is
    ``wte.weight``), so both copies land in the same group and stay equal."""
    for module in ([model] if isinstance(model, nn.Module) else model):
        aliases = getattr(module, "checkpoint_aliases", {})
        for name, param in module.named_parameters():
            yield aliases.get(name, name), param


def param_groups(model: Models, weight_decay: float,
                 leave_out: Optional[Callable[[str, nn.Parameter], bool]] = None) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices decay, the rest do not (see `no_decay`); the parameters ``leave_out(name,
    param)`` chooses (Muon's, see `build_optimizers`) are in neither. Both groups are always there (maybe empty), so
    a checkpoint's groups match by index. ``model``: a model or a list of this rank's pipeline stages."""
    decay, keep = [], []
    for name, param in named_parameters(model):
        if param.requires_grad and not (leave_out is not None and leave_out(name, param)):
            (keep if no_decay(name) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def muon_matrices(module: nn.Module, units: tuple[type, ...]) -> Callable[[str, nn.Parameter], bool]:
    """The parameters `--optimizer muon` gives to Muon: the 2-D weights inside the units, by name (``name``: as
    ``module.named_parameters()`` gives it before and after `fully_shard`). For the GPT the units are its `Block`s:
    the attention's q/k/v (or fused qkv) and output projections, the MLP's two matrices, and in a GPT-MoE the
    router and every expert's two matrices; for a Hugging Face model its decoder layers: q/k/v/o, the MLP's gate,
    up and down projections, a MoE's router (`mlp.gate`); its fused 3-D expert tensors (`mlp.experts.gate_up_proj`,
    `down_proj`) are not matrices and stay with AdamW. Embeddings, the head, norms and biases are outside the units
    or not 2-D.

    The same predicate is `fully_shard`'s ``whole_params`` (on the meta model: every matrix 2-D) and picks Muon's
    parameters on the sharded model, where a whole fragment is the matrix on its owner, ``(0, n)`` elsewhere (an
    element-sharded fragment is 2-D too, some rows of a matrix: Muon is refused on it, see
    ``optimizer_hook._check_whole``)."""
    inside = {f"{prefix}.{name}" for prefix, unit in module.named_modules() if isinstance(unit, units)
              for name, _ in unit.named_parameters()}

    def chosen(name: str, param: nn.Parameter) -> bool:
        return name in inside and param.dim() == 2

    return chosen


def build_optimizers(model: Models, optim: OptimizerConfig,
                     matrices: Optional[Callable[[str, nn.Parameter], bool]]) -> list[torch.optim.Optimizer]:
    """The run's optimizers, each parameter in one: ``[AdamW]`` (``matrices`` None: --optimizer adamw), or
    ``[Muon, AdamW]``: torch.optim.Muon on the parameters ``matrices`` chooses (`muon_matrices`; whole on their
    owner rank, empty elsewhere) with lr --muon-lr, momentum `MUON_MOMENTUM` (Nesterov), decoupled weight decay
    --weight-decay and `MUON_ADJUST_LR`; AdamW (`param_groups`, lr --lr, betas `ADAM_BETAS`) on the rest. The lr of
    every group is set per step (`set_learning_rates`)."""
    if matrices is None:
        return [torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr, betas=ADAM_BETAS)]
    muon = [p for name, p in named_parameters(model) if p.requires_grad and matrices(name, p)]
    return [torch.optim.Muon(muon, lr=optim.muon_lr, weight_decay=optim.weight_decay, momentum=MUON_MOMENTUM,
                             nesterov=True, adjust_lr_fn=MUON_ADJUST_LR),
            torch.optim.AdamW(param_groups(model, optim.weight_decay, leave_out=matrices), lr=optim.lr,
                              betas=ADAM_BETAS)]


def set_learning_rates(optimizers: list[torch.optim.Optimizer], schedule: ScheduleConfig, optim: OptimizerConfig,
                       step: int) -> float:
    """Set every group's lr for optimizer step ``step`` (0-based): AdamW's groups `lr_at` (warm-up to --lr, cosine
    down to --min-lr), Muon's --muon-lr times the same schedule's fraction of its peak (`lr_factor`). Returns
    AdamW's lr. ``schedule``: resolved (its warm-up an int)."""
    lr = lr_at(schedule, optim, step)
    for optimizer in optimizers:
        value = optim.muon_lr * lr_factor(schedule, optim, step) if isinstance(optimizer, torch.optim.Muon) else lr
        for group in optimizer.param_groups:
            group["lr"] = value
    return lr


def balance_record(balance: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The figures of `sf.owner_balance` that the job records, per kind of shard group (dense, expert): the cost and
    elements per owner shard, ``cost_imbalance``, ``numel_imbalance``, ``padding`` (elements),
    ``padded_numel`` and ``padding_fraction``."""
    keys = ("cost", "numel", "cost_imbalance", "numel_imbalance", "padding", "padded_numel", "padding_fraction")
    return {kind: {k: report[k] for k in keys} for kind, report in balance.items()}


def format_balance(balance: dict[str, dict[str, Any]]) -> str:
    """One line of `balance_record`'s figures: per kind, the owners' cost max / mean and the padding."""
    return "; ".join(f"{kind} shards: Newton-Schulz cost max/mean {r['cost_imbalance']:.3f}, elements max/mean "
                     f"{r['numel_imbalance']:.3f}, padding {r['padding']:,} of {r['padded_numel']:,} elements "
                     f"({100 * r['padding_fraction']:.2f} %)" for kind, r in balance.items()) or "no whole matrices"
