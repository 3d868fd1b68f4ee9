"""The Muon runs of the whole-parameter tests: a tiny GPT (GPT-MoE for ep > 1), Muon on the block matrices and
AdamW on the rest, trained on a fixed global batch; one process (``reference``) and sharded (``build``,
``sharded_loss_fn``). Used by tests/distributed/test_whole_params*.py.
"""

from __future__ import annotations

import contextlib

import torch

from reference import rank_loss_fn, rows_of, sliced_loss_fn, token_batch

STEPS = 3
SEQ = 16
GLOBAL_BATCH = 8
MAX_NORM = 0.5  # below the measured norms (~1-2): clipping is active every step
RTOL, ATOL = 1e-5, 1e-6  # losses, norms
PARAM_ATOL = 1e-5  # parameters, fp32 Newton-Schulz; AdamW's parameters in the bf16 run too
MUON_BF16_ATOL = 1e-3  # the Muon matrices with torch's bf16 Newton-Schulz: see the module docstring
MUON_LR, ADAMW_LR = 0.02, 1e-3


def config(experts: int = 0):
    from shardfusion.models import GPTConfig
    return GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=SEQ, fused_qkv=False, n_experts=experts, top_k=1,
                     tie_embeddings=True)


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    """The parameters Muon updates: the 2-D weights of the blocks (attention, MLP, router, experts)."""
    return name.startswith("blocks.") and p.dim() == 2


def optimizers(model) -> list[torch.optim.Optimizer]:
    """Muon on the block matrices, AdamW on the rest. On a sharded model the whole fragments are 2-D (the matrix on
    its owner, ``(0, n)`` elsewhere) and the element-sharded ones are the rest (biases, norms: 1-D; embeddings
    outside the blocks), so the same rule picks the same parameters."""
    named = list(model.named_parameters())
    muon = [p for n, p in named if is_block_matrix(n, p)]
    rest = [p for n, p in named if not is_block_matrix(n, p)]
    return [torch.optim.Muon(muon, lr=MUON_LR, weight_decay=0.1, adjust_lr_fn="original"),
            torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.1)]


@contextlib.contextmanager
def newton_schulz(fp32: bool):
    """With ``fp32``: torch's Muon runs its Newton-Schulz iteration (same coefficients, same steps) in fp32."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz

    def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        tall = grad.size(0) > grad.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    if fp32:
        _muon._zeropower_via_newtonschulz = fp32_newton_schulz
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (GLOBAL_BATCH, SEQ) inputs and targets, int64."""
    return token_batch(2000 + step, GLOBAL_BATCH, SEQ)


def slice_batch(step: int, dp_world: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s rows of the global batch of ``step``."""
    return rows_of(batch(step), dp_world, dp_rank)


def train(model, optimizers, loss_fn, steps: range) -> dict:
    """Per step: ``loss_fn(step)`` (forward, backward; returns the global loss), clip by global norm, step both."""
    import shardfusion as sf
    from shardfusion._runtime.state import is_sharded

    losses, norms = [], []
    for step in steps:
        losses.append(float(loss_fn(step)))
        clip = sf.clip_grad_norm_ if is_sharded(model) else torch.nn.utils.clip_grad_norm_
        norms.append(float(clip(model if is_sharded(model) else model.parameters(), MAX_NORM)))
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms}


def reference(experts: int = 0, dp_world: int = 1, fp32: bool = True) -> dict:
    """One process: each step the mean of the losses of the ``dp_world`` slices of the global batch (a MoE routes
    each slice by itself, as each rank does)."""
    from shardfusion.models import GPT
    torch.manual_seed(0)
    model = GPT(config(experts))

    loss_fn = sliced_loss_fn(model, slice_batch, dp_world)
    with newton_schulz(fp32):
        out = train(model, optimizers(model), loss_fn, range(STEPS))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return out


def build(layout: dict, whole: bool = True):
    import shardfusion as sf
    from shardfusion.models import GPT, Block

    topo = sf.Topology(**layout)
    torch.manual_seed(0)
    experts = 4 if topo.ep > 1 else 0
    model = GPT(config(experts), ep_group=topo.get_group("ep") if experts else None)
    model = sf.fully_shard(model, topo, units=(Block,), whole_params=is_block_matrix if whole else None)
    return topo, model


def sharded_loss_fn(model, topo):
    """This data-parallel rank's loss of a step (``reference.rank_loss_fn``)."""
    return rank_loss_fn(model, slice_batch, topo)


def max_errors(got: dict, want: dict) -> dict:
    """Largest absolute differences (losses, norms, parameters): the figures docs/whole-params.md reports."""
    return {"loss": max(abs(a - b) for a, b in zip(got["losses"], want["losses"])),
            "norm": max(abs(a - b) for a, b in zip(got["norms"], want["norms"])),
            "param": max(float((got["params"][n] - v).abs().max()) for n, v in want["params"].items())}
