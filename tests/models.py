"""Small models for the tests, and the data and loss that go with each.

Every model is built by `build_model(kind)` under `torch.manual_seed(MODEL_SEED)`, so the sharded run and the
single-process reference start from the same values. `make_batch(kind, generator, batch_size)` draws one
micro-batch; `loss_fn(kind, model, batch)` is the mean loss over that micro-batch. Sizes are tiny on purpose: up
to eight ranks share two CPU cores.

Shape legend: B batch, T sequence, D model width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL_SEED = 42

# --- MLP (F1, F6, F11, parity) ----------------------------------------------------------------------------------------


class MLP(nn.Module):
    """8 -> 16 -> 4, tanh; two Linear units when wrapped with units=(nn.Linear,)."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):  # x: (B, d_in)
        return self.fc2(torch.tanh(self.fc1(x)))  # (B, d_out)


# --- tiny transformer-ish model (parity, comm counts, units) ----------------------------------------------------------

VOCAB, WIDTH, SEQ = 16, 8, 6


class Block(nn.Module):
    """Pre-norm residual MLP block: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):  # x: (B, T, D)
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyTransformer(nn.Module):
    """Embedding + learned positions, 2 Blocks, final LayerNorm, output head tied to the embedding.

    `head.weight is tok.weight`: the tied parameter is registered in two modules (tok and head), so it belongs to
    the unit of their lowest common ancestor (the root, unless the whole model is one unit).
    Wrapped with units=(Block,) it has 3 units: the root (tok, pos, norm, head) and the 2 blocks.
    """

    def __init__(self, vocab: int = VOCAB, d: int = WIDTH, seq: int = SEQ, n_blocks: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, d))
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx):  # idx: (B, T) int64
        x = self.tok(idx) + self.pos[: idx.shape[1]]  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V)


# --- F2: sharded Linears plus one parameter kept whole ----------------------------------------------------------------


class ScaledMLP(nn.Module):
    """MLP whose output is multiplied elementwise by `scale` (4 elements); `scale` is the one kept whole (F2)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(4))

    def forward(self, x):  # (B, 8) -> (B, 4)
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


# --- F4: a layer that runs only on some steps, frozen layers ----------------------------------------------------------


class HalfFrozenLinear(nn.Module):
    """A Linear-like unit with a frozen weight and a trainable bias: one unit holding both kinds (F4)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5, requires_grad=False)
        self.bias = nn.Parameter(0.1 * torch.randn(d_out))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class SkipModel(nn.Module):
    """a (always runs) -> b (only when `use_b`) -> head. Units: (nn.Linear, HalfFrozenLinear).

    variant "plain": a and b trainable Linears; "frozen_a": a's parameters frozen; "mixed": b is a HalfFrozenLinear
    (frozen weight, trainable bias in one unit).
    """

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = HalfFrozenLinear(8, 8) if variant == "mixed" else nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        if variant == "frozen_a":
            self.a.requires_grad_(False)

    def forward(self, x, use_b: bool = True):  # x: (B, 6)
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.head(h)  # (B, 3)


# --- F5: parameters smaller than the shard count ----------------------------------------------------------------------


class Vec(nn.Module):
    """x * w for a 1-D parameter w of n elements (a unit's forward must run for the unit to be gathered)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(0.5 + 0.1 * torch.randn(n))

    def forward(self, x):  # (..., n) -> (..., n)
        return x * self.w


class TinyParams(nn.Module):
    """Three parameters of 1, 3 and 5 elements (9 in all), each in its own `Vec` module (F5).

    out = w1 * sum(x[:, :5] * w5) + sum(x[:, 5:] * w3)
    """

    def __init__(self) -> None:
        super().__init__()
        self.one = Vec(1)
        self.three = Vec(3)
        self.five = Vec(5)

    def forward(self, x):  # (B, 8) -> (B,)
        s5 = self.five(x[:, :5]).sum(-1, keepdim=True)  # (B, 1)
        return (self.one(s5) + self.three(x[:, 5:]).sum(-1, keepdim=True)).squeeze(-1)


# --- F9: zero-element parameters --------------------------------------------------------------------------------------


class ZeroSizeModel(nn.Module):
    """Parameters in flat order ones(8), empty(0), ones(24), then a trailing Linear(4, 0) (F9).

    With one unit at inner=2 the empty parameter sits at offset 8, inside rank 0's half of the buffer.
    out = sum(repeat(x * a, 3) * b) + sum(lin(x[:, :4])) + sum(empty) (the last two are 0 but keep the graph)
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(8))
        self.empty = nn.Parameter(torch.empty(0))
        self.b = nn.Parameter(torch.ones(24))
        self.lin = nn.Linear(4, 0)

    def forward(self, x):  # (B, 8) -> (B,)
        h = (x * self.a).repeat(1, 3) * self.b  # (B, 24)
        return h.sum(-1) / 24 + self.lin(x[:, :4]).sum(-1) + self.empty.sum()


# --- checkpoints: an uneven first dimension, a 1-element parameter ----------------------------------------------------


class UnevenNet(nn.Module):
    """a (6 -> 5), b (5 -> 7), c (7 -> 3, no bias), times `scale`: a.weight is (5, 6), a first dim of 5 that
    splits unevenly; `scale` (1 element) leaves empty fragments on most ranks (checkpoints)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 7)
        self.c = nn.Linear(7, 3, bias=False)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


# --- MoE (parity over ep and expert policies, F3) ---------------------------------------------------------------------

MOE_EXPERTS, MOE_TOP_K, AUX_COEF = 4, 2, 0.01


class MoEBlock(nn.Module):
    """Pre-norm residual MoE block: x + moe(ln(x)), 4 experts of hidden 2D, top-2, plus a shared expert."""

    def __init__(self, d: int = WIDTH, ep_group=None) -> None:
        super().__init__()
        from shardfusion.moe import MoE

        self.ln = nn.LayerNorm(d)
        self.moe = MoE(d, 2 * d, MOE_EXPERTS, top_k=MOE_TOP_K, ep_group=ep_group, shared_expert_hidden=d)

    def forward(self, x):  # x: (B, T, D)
        return x + self.moe(self.ln(x))


class TinyMoETransformer(nn.Module):
    """TinyTransformer with MoE blocks: embedding + positions, 2 MoEBlocks, final LayerNorm, tied head.

    Expert parameters differ across ep ranks: ep rank j holds experts j*E/ep .. under their global names.
    """

    def __init__(self, ep_group=None, vocab: int = VOCAB, d: int = WIDTH, seq: int = SEQ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, d))
        self.blocks = nn.ModuleList([MoEBlock(d, ep_group) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):  # idx: (B, T) int64
        x = self.tok(idx) + self.pos[: idx.shape[1]]  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V)

    def aux_loss(self) -> torch.Tensor:
        """Sum of the blocks' load-balancing losses from the last forward (this rank's tokens)."""
        return sum(b.moe.aux_loss for b in self.blocks)


# --- construction, data, loss -----------------------------------------------------------------------------------------

_BUILDERS = {
    "mlp": MLP,
    "transformer": TinyTransformer,
    "scaled_mlp": ScaledMLP,
    "skip": lambda: SkipModel("plain"),
    "skip_frozen_a": lambda: SkipModel("frozen_a"),
    "skip_mixed": lambda: SkipModel("mixed"),
    "tiny_params": TinyParams,
    "zero_size": ZeroSizeModel,
    "moe": TinyMoETransformer,
}

# Unit classes by model kind, for units="class".
UNIT_CLASSES = {
    "mlp": (nn.Linear,),
    "transformer": (Block,),
    "scaled_mlp": (nn.Linear,),
    "skip": (nn.Linear, HalfFrozenLinear),
    "skip_frozen_a": (nn.Linear, HalfFrozenLinear),
    "skip_mixed": (nn.Linear, HalfFrozenLinear),
    "tiny_params": (Vec,),
    "zero_size": (),
    "moe": (MoEBlock,),  # router, shared expert and experts of a block fused in one unit
}


def expert_unit_classes() -> tuple:
    """units for "moe" with every expert in a unit of its own (nested in its block's unit)."""
    from shardfusion.moe import Expert

    return (MoEBlock, Expert)


def build_model(kind: str, seed: int = MODEL_SEED, ep_group=None) -> nn.Module:
    """The model of `kind`, initialized under torch.manual_seed(seed); MoE models take their ep group (None: all
    experts in this process, the reference)."""
    torch.manual_seed(seed)
    if kind == "moe":
        return TinyMoETransformer(ep_group)
    return _BUILDERS[kind]()


def make_batch(kind: str, generator: torch.Generator, batch_size: int = 4) -> dict:
    """One micro-batch for `kind` drawn from `generator`: {"x": input, "y": target}."""
    if kind in ("transformer", "moe"):
        idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)  # (B, T+1)
        return {"x": idx[:, :-1], "y": idx[:, 1:]}
    d_in, d_out = {"mlp": (8, 4), "scaled_mlp": (8, 4), "tiny_params": (8, None), "zero_size": (8, None),
                   "skip": (6, 3), "skip_frozen_a": (6, 3), "skip_mixed": (6, 3)}[kind]
    x = torch.randn(batch_size, d_in, generator=generator)
    y = torch.randn(batch_size, generator=generator) if d_out is None else torch.randn(batch_size, d_out,
                                                                                         generator=generator)
    return {"x": x, "y": y}


def concat_batches(batches: list[dict]) -> dict:
    """The concatenation of micro-batches along the batch dim (the global batch of the reference)."""
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def loss_fn(kind: str, model: nn.Module, batch: dict, **forward_kwargs) -> torch.Tensor:
    """Mean loss over the micro-batch."""
    out = model(batch["x"], **forward_kwargs).float()  # the loss in fp32 also under mixed precision (no-op in fp32)
    if kind == "transformer":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), batch["y"].reshape(-1))
    if kind == "moe":  # the load-balancing loss is over the tokens of this call: one rank's micro-batch
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), batch["y"].reshape(-1)) + AUX_COEF * model.aux_loss()
    return F.mse_loss(out, batch["y"])
