"""Tensor parallel for the reference GPT, with torch's own engine (``torch.distributed.tensor.parallel``).

Megatron's split of a transformer layer (Shoeybi et al., 2019): in each block the projections that fan out are
column-wise (each mp rank computes some output features: q, k and v hold whole heads, ``mlp.fc`` a slice of the
hidden width), the ones that fan back in are row-wise (each rank multiplies its slice of the input features and the
partial outputs are summed by one all-reduce over mp). So a block costs two all-reduces of the activations (B, T, C)
in forward (after each row-wise projection) and two in backward (the gradient of the attention's and of the MLP's
input, partial sums on each rank), and every other tensor stays local. Embeddings, norms, the lm head and the MoE
experts stay whole on every mp rank (replicated: identical values and gradients across mp).

Use it before ``fully_shard``, on a GPT built with ``fused_qkv=False``::

    model = GPT(replace(config, fused_qkv=False))
    parallelize(model, topo.get_mesh("mp"))
    model = sf.fully_shard(model, topo, units=(Block,))
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from shardfusion.models.gpt import GPT, GPTConfig


def check_tensor_parallel(config: GPTConfig, mp: int) -> None:
    """The shape rules of tensor parallel at degree ``mp``.

    Raises:
        ValueError: ``fused_qkv`` is set (mp > 1), or mp does not divide n_head, or (dense MLP) 4 * d_model; each
            message names the numbers.
    """
    if mp == 1:
        return
    if config.fused_qkv:
        raise ValueError(f"tensor parallel (mp {mp}) needs GPTConfig(fused_qkv=False): q, k and v are split by heads")
    if config.n_head % mp:
        raise ValueError(f"tensor parallel: mp({mp}) must divide n_head({config.n_head}); each mp rank holds whole "
                         "heads")
    if not config.n_experts and (4 * config.d_model) % mp:
        raise ValueError(f"tensor parallel: mp({mp}) must divide the MLP width 4 * d_model = {4 * config.d_model}")


def block_plan(config: GPTConfig) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of one ``Block``: module path -> parallel style. The MLP is split only when it
    is dense (a GPT-MoE's experts stay whole: expert parallel places them)."""
    plan: dict[str, ParallelStyle] = {
        # x enters the attention once as a replicated DTensor: the gradients of q, k and v with respect to it add up
        # as partial sums, so backward all-reduces them once, not once per projection.
        "attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                   use_local_output=False),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
    }
    if not config.n_experts:
        plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    return plan


def parallelize(model: GPT, mesh) -> GPT:
    """Split every block of ``model`` over ``mesh`` (a 1-D DeviceMesh, e.g. ``topo.get_mesh("mp")``) in place; its
    parameters become DTensors (``Shard(0)`` column-wise, ``Shard(1)`` row-wise weights, ``Replicate()`` row-wise
    biases). Returns ``model``.

    Raises:
        ValueError: the shape rules of :func:`check_tensor_parallel` for the mesh's size.
    """
    check_tensor_parallel(model.config, mesh.size())
    if mesh.size() > 1:
        plan = block_plan(model.config)
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
    return model
