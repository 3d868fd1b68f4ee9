"""Pipeline stages of a `GPT`: the embeddings on the first stage, consecutive blocks on every stage, the final norm
and the lm head on the last (torchtitan's split by module, not a traced graph).

`split_gpt(model, stage_index, num_stages)` moves the modules of one stage out of a `GPT` into a `GPTStage`
(no copy: the same parameters, under the same names as in the `GPT`, e.g. ``blocks.4.attn.qkv.weight`` on the
stage that holds block 4), so that a stage's `fully_shard`, state dict and checkpoints name every parameter as the
whole model does. A tied GPT (``tie_embeddings=True``, the default) keeps its embedding on the first stage and a copy
of it as ``lm_head.weight`` on the last (`GPTStage.tied_parameters`); `shardfusion.pipeline.PipelineStage` copies the
values at its start and sums the two gradients each step (keep both copies whole: ``replicate_filter``). Build the `GPT` on the meta device to split a model larger than one rank; `fully_shard` then
materializes only this stage's modules.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardfusion.models.gpt import GPT, Block, NormalLinear
from shardfusion.moe import MoE

__all__ = ["GPTStage", "split_gpt", "stage_layers"]


def stage_layers(n_layer: int, num_stages: int) -> list[range]:
    """The blocks of each stage: ``n_layer / num_stages`` consecutive blocks each.

    Raises:
        ValueError: ``num_stages`` is not a positive divisor of ``n_layer``.
    """
    if not isinstance(num_stages, int) or num_stages < 1 or n_layer % num_stages:
        raise ValueError(f"the {n_layer} layers do not split evenly into {num_stages} pipeline stages; pick a number "
                         f"of stages that divides n_layer")
    per = n_layer // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


class GPTStage(nn.Module):
    """Stage `stage_index` of `num_stages` of a GPT (see `split_gpt`).

    forward: on the first stage ``idx`` (B, T) int64 byte values, on the others the hidden states (B, T, C) of the
    previous stage. Returns the hidden states (B, T, C), or on the last stage the logits (B, T, V) (fp32 loss outside:
    the schedule's ``loss_fn``). Context parallel is not split across stages here (a GPT with a context group is
    refused by `split_gpt`).
    """

    def __init__(self, model: GPT, stage_index: int, num_stages: int, aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        layers = stage_layers(model.config.n_layer, num_stages)[stage_index]
        self.config, self.stage_index, self.num_stages = model.config, stage_index, num_stages
        self.aux_loss_coef = float(aux_loss_coef)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        tied = model.config.tie_embeddings and num_stages > 1
        self.tied_parameters: tuple[str, ...] = ()
        """This stage's copy of the weight tied across the ends (``wte.weight`` on the first stage,
        ``lm_head.weight`` on the last), which `shardfusion.pipeline.PipelineStage` keeps equal."""
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
            self.tied_parameters = ("wte.weight",) if tied else ()
        # Block i keeps its name blocks.i: a ModuleDict keyed by the global index
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            if tied:  # a copy of its own (the same tensor may sit on the first stage of this rank too); it keeps
                # weight_tied, so a meta-built head draws as the tied GPT does, and PipelineStage copies the first
                # stage's values into it
                head = model.lm_head
                with torch.device("meta"):  # no draw: the weight is set below
                    self.lm_head = NormalLinear(head.in_features, head.out_features, bias=False,
                                                init_std=head.init_std)
                self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone(),
                                                   requires_grad=model.wte.weight.requires_grad)
                self.lm_head.weight_tied = True
                self.tied_parameters = ("lm_head.weight",)
                self.checkpoint_aliases = {"lm_head.weight": "wte.weight"}  # saved once, by the first stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)  # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))  # (B, T, V)
        layers = [m for m in self.modules() if isinstance(m, MoE)]
        if self.aux_loss_coef and layers:
            # this stage's share of coef * GPT.aux_loss() (the mean over every MoE layer of the model)
            aux = torch.stack([m.aux_loss for m in layers]).sum() * (self.aux_loss_coef / self.config.n_layer)
            x = _AddToLoss.apply(x, aux)
        return x


class _AddToLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also differentiates ``aux`` (a 0-dim term of the loss computed inside the
    stage) with gradient 1: a stage adds its MoE load-balancing loss to the pipeline's loss without sending it to
    the last stage (the output's gradient comes from there). Megatron-LM scales its MoE aux loss the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_ones(ctx.aux_shape, dtype=torch.float32)


def split_gpt(model: GPT, stage_index: int, num_stages: int, aux_loss_coef: float = 0.0) -> GPTStage:
    """Stage `stage_index` of `model` cut into `num_stages` stages (`stage_layers`); the modules of the other
    stages are left in `model` (drop it after splitting). With `aux_loss_coef` and MoE blocks, each stage adds its
    share of ``aux_loss_coef * model.aux_loss()`` (the MoE load-balancing loss, a mean over all layers) to the loss in
    backward (`_AddToLoss`): per micro-batch, over this rank's tokens, as the job's gradient accumulation does.

    Raises:
        ValueError: `num_stages` does not divide `n_layer`; `stage_index` out of range; the GPT has a context group.
    """
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, num_stages={num_stages}), got {stage_index!r}")
    if model.context_group is not None:
        raise ValueError("split_gpt: a GPT with a context group (context parallel) is not split into stages here")
    return GPTStage(model, stage_index, num_stages, aux_loss_coef)

