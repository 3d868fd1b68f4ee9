"""A byte-level, decoder-only GPT, dense or mixture-of-experts (GPT-MoE): the reference model that
`shardfusion.train` shards.

Shape legend used in the comments below:
  B  batch size             T  sequence length (<= seq_len)
  C  d_model                H  n_head              D  head size = C / H
  V  vocabulary size (256: one token per byte)
  L  MoE layers (= n_layer) E  n_experts

Every transformer layer is one `Block`, so `fully_shard(model, topo, units=(Block,))` gives one unit per layer; the
embeddings, the final LayerNorm and the (tied) lm head stay with the root. With `n_experts > 0` each Block's MLP is
a `shardfusion.moe.MoE`: a dense router and the experts of this expert-parallel (ep) rank, whose parameters carry
`is_expert = True` and keep their global names (`blocks.0.mlp.experts.3.fc.weight`), so `fully_shard` puts them in
expert buffers and a `GPT(config)` without an ep group holds every expert (e.g. to load a `full_state_dict`).

Initialisation does not depend on ep: the same seed gives the same dense parameters and the same experts whether a
rank holds all experts or some (see `GPT.reset_parameters`). Every random draw happens in some module's
`reset_parameters`, in module order, so a GPT built under `with torch.device("meta")` and materialized by
`fully_shard` equals one built eagerly under the same seed, bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardfusion import comm, context_parallel
from shardfusion.moe import MoE, is_expert

VOCAB_SIZE = 256
"""The default vocabulary: bytes are tokens (`GPTConfig.vocab_size`)."""

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of every weight matrix and embedding."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a `GPT`. Presets live in `PRESETS`."""

    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide `d_model`."""
    d_model: int
    """Width of the residual stream (C)."""
    seq_len: int
    """Longest context the model accepts; the size of the learned position table."""
    vocab_size: int = VOCAB_SIZE
    """Token ids are in [0, vocab_size): the rows of the embedding and the lm head (default 256: one token per
    byte; the training job sets its tokenizer's, `shardfusion.train.tokenizer`)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches (default 0.0: off)."""
    tie_embeddings: bool = True
    """Share one Parameter between the token embedding and the lm head (default True)."""
    n_experts: int = 0
    """Experts per MoE layer (E); 0 (default) gives a dense MLP in every block, > 0 a GPT-MoE whose every block's
    MLP is a routed mixture of experts."""
    top_k: int = 2
    """Experts each token is routed to, 1 <= top_k <= n_experts (default 2; unused when n_experts is 0)."""
    expert_hidden: int | None = None
    """Hidden width of each expert (F); None (default) means 4 * d_model // top_k, so a token's routed experts do
    the work of one dense 4 * d_model MLP (see `expert_hidden_size`)."""
    shared_expert_hidden: int = 0
    """Hidden width of an always-on shared expert beside the routed ones; 0 (default) means none."""
    fused_qkv: bool = True
    """One (3C, C) projection ``attn.qkv`` for queries, keys and values (default True), or three (C, C) ones
    ``attn.q``, ``attn.k``, ``attn.v``: the layout tensor parallel needs, where each mp rank holds whole heads of each
    (`shardfusion.models.gpt_parallel`). Both draw the same weights from the same seed (q, k and v are the rows of
    the fused weight: one normal draw of 3C x C values fills the same stream as three of C x C) and compute the same
    function; only the parameter names differ (tests/unit/test_gpt.py)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model({self.d_model}) % n_head({self.n_head}) != 0; "
                             f"pick n_head dividing d_model")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        for name in ("n_experts", "shared_expert_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"GPTConfig.{name} must be an int >= 0, got {value!r}")
        if self.n_experts:
            if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"GPTConfig: top_k({self.top_k}) must be in [1, n_experts({self.n_experts})]")
            if self.expert_hidden is not None and (not isinstance(self.expert_hidden, int) or self.expert_hidden < 1):
                raise ValueError(f"GPTConfig.expert_hidden must be a positive int or None, got {self.expert_hidden!r}")
            if self.expert_hidden_size < 1:
                raise ValueError(f"GPTConfig: the default expert_hidden = 4 * d_model({self.d_model}) // "
                                 f"top_k({self.top_k}) is 0; set expert_hidden")

    @property
    def expert_hidden_size(self) -> int:
        """Each expert's hidden width: `expert_hidden`, or 4 * d_model // top_k when that is None."""
        return self.expert_hidden if self.expert_hidden is not None else 4 * self.d_model // self.top_k


PRESETS: dict[str, GPTConfig] = {
    # 2 layers of width 64: fast enough for end-to-end tests.
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=64),
    # The default of `make train` (with 4 experts per layer, see shardfusion.train): 4 gloo processes on 2 CPU cores,
    # about 2.5 minutes for 200 steps.
    "small": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
    # A larger model for a GPU.
    "medium": GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=512),
}
"""Named model shapes; `--preset` picks one and `--n-layer` etc. override single fields."""


class NormalLinear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters`` draws the weight from ``N(0, init_std)`` and zeroes the bias (GPT-2's
    initialization). Every draw happens in ``reset_parameters``, in module order, so a GPT built on the meta device
    and initialized by ``fully_shard`` equals one built eagerly under the same seed (docs/design.md, "Models larger
    than one rank").

    ``weight_tied`` (default False) is set by a model that replaces the weight by another module's after
    construction (the GPT's tied lm head): ``reset_parameters`` then draws what construction drew into a scratch
    tensor and leaves the weight, the other module's, as it is, as eager construction does (the tie replaced the
    draw). Meta-device initialization runs every registering module's init on a tied weight, in module order."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, init_std: float = INIT_STD,
                 device=None, dtype=None) -> None:
        self.init_std = init_std
        self.weight_tied = False
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weight ~ N(0, init_std) (with ``weight_tied``: the draw goes to a scratch tensor), bias 0."""
        target = torch.empty_like(self.weight) if self.weight_tied else self.weight
        nn.init.normal_(target, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters`` draws the table from ``N(0, INIT_STD)``."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weight ~ N(0, INIT_STD)."""
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


def _resid_std(config: "GPTConfig") -> float:
    """The residual output projections' std: INIT_STD / sqrt(2 * n_layer), so the residual stream's variance does
    not grow with depth (GPT-2)."""
    return INIT_STD / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    """Multi-head attention in which position t sees positions <= t only."""

    def __init__(self, config: GPTConfig, context_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.context_group = context_group
        self.n_head = config.n_head
        self.head_size = config.d_model // config.n_head
        self.dropout = config.dropout
        if config.fused_qkv:
            self.qkv = NormalLinear(config.d_model, 3 * config.d_model)
        else:
            self.q, self.k, self.v = (NormalLinear(config.d_model, config.d_model) for _ in range(3))
        self.proj = NormalLinear(config.d_model, config.d_model, init_std=_resid_std(config))
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal multi-head self-attention: ``x`` (B, T, C) float -> (B, T, C).

        Under tensor parallel (`gpt_parallel`) q, k and v hold this mp rank's H / mp heads: Hl below."""
        B, T, C = x.shape
        D = self.head_size
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)  # 3 x (B, T, Hl * D)
        q = q.view(B, T, -1, D).transpose(1, 2)  # (B, Hl, T, D)
        k = k.view(B, T, -1, D).transpose(1, 2)  # (B, Hl, T, D)
        v = v.view(B, T, -1, D).transpose(1, 2)  # (B, Hl, T, D)
        # causal; with a context group, this rank's chunk of queries over the whole sequence's keys and values
        y = context_parallel.attention(q, k, v, self.context_group,
                                       dropout_p=self.dropout if self.training else 0.0)  # (B, Hl, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hl * D)
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward layer: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = NormalLinear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.proj = NormalLinear(4 * config.d_model, config.d_model, init_std=_resid_std(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C) float -> (B, T, C)."""
        h = self.act(self.fc(x))  # (B, T, 4C)
        return self.proj(h)  # (B, T, C)


class Block(nn.Module):
    """One pre-LayerNorm transformer layer; the unit `fully_shard` gathers and reduces as a whole.

    Its MLP is dense, or with `config.n_experts > 0` a `MoE` over `ep_group` (None: this rank holds every expert)."""

    def __init__(self, config: GPTConfig, ep_group: dist.ProcessGroup | None = None,
                 context_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, context_group)
        self.ln_2 = nn.LayerNorm(config.d_model)
        if config.n_experts:
            self.mlp: nn.Module = MoE(config.d_model, config.expert_hidden_size, config.n_experts, config.top_k,
                                      ep_group=ep_group, shared_expert_hidden=config.shared_expert_hidden,
                                      init_std=INIT_STD, proj_init_std=_resid_std(config))
        else:
            self.mlp = MLP(config)
        self.mlp_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual attention then residual MLP: ``x`` (B, T, C) float -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp_drop(self.mlp(self.ln_2(x)))  # (B, T, C)
        return x


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` Blocks, a final LayerNorm and an lm head over the 256 bytes.

    `ep_group`: the expert-parallel group of a GPT-MoE (`topo.get_group("ep")`); this rank then builds only its
    share of each layer's experts, and every forward is collective over the group. None (default): all experts.
    `context_group`: context parallel (`topo.get_group("context")`): `forward` then takes this rank's chunk of each
    sequence (`shardfusion.context_parallel.sequence_chunk`), and attention is collective over the group.
    """

    def __init__(self, config: GPTConfig, ep_group: dist.ProcessGroup | None = None,
                 context_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.context_group = context_group
        self.wte = NormalEmbedding(config.vocab_size, config.d_model)
        self.wpe = NormalEmbedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        # A MoE draws the same amount from the global RNG at any ep (one seed for its experts; see `MoE`).
        self.blocks = nn.ModuleList(Block(config, ep_group, context_group) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = NormalLinear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # One Parameter registered in two modules: named_parameters() yields it once, as "wte.weight". The head's
            # draw above is replaced; weight_tied keeps its later reset_parameters off the embedding's values.
            self.lm_head.weight = self.wte.weight
            self.lm_head.weight_tied = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw every parameter as construction does: each module's own ``reset_parameters``, in module order
        (normal(0, INIT_STD) weights, zero biases, unit LayerNorm gains; the residual output projections scaled down
        by sqrt(2 * n_layer) so the residual stream's variance does not grow with depth).

        Dense parameters (the MoE routers included) are drawn from the global RNG; experts are not, since a rank holds
        only some: each expert is drawn from a generator of its own, seeded from the seed its MoE drew once
        (`shardfusion.moe.MoE`), so the same seed gives the same model at any ep. The tied lm head draws into a
        scratch tensor (`NormalLinear.weight_tied`), as at construction, where its draw is replaced by the
        embedding. This is what `fully_shard` does for a GPT built on the meta device."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def moe_layers(self) -> list[MoE]:
        """The MoE layers, in block order (empty for a dense GPT)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def num_parameters(self, active: bool = False) -> int:
        """Count of distinct parameter elements of the whole model (a tied weight counts once; every expert counts,
        also those held by other ep ranks). With `active`: the elements one token uses (top_k experts per layer)."""
        total = sum(p.numel() for p in self.parameters() if not is_expert(p))
        for moe in self.moe_layers():
            per_expert = sum(p.numel() for p in next(iter(moe.experts.values())).parameters())
            total += per_expert * (self.config.top_k if active else self.config.n_experts)
        return total

    def aux_loss(self) -> torch.Tensor:
        """Mean of the MoE layers' load-balancing losses from the last forward: 0-dim fp32, differentiable (a zero
        constant for a dense GPT)."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros((), device=self.wte.weight.device)
        return torch.stack([m.aux_loss for m in layers]).mean()

    def tokens_per_expert(self) -> torch.Tensor:
        """(L, E) int64: the last forward's assignments of this rank's tokens to each global expert, per MoE layer
        ((0, 0) for a dense GPT)."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros((0, 0), dtype=torch.long, device=self.wte.weight.device)
        return torch.stack([m.tokens_per_expert for m in layers])  # (L, E)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 byte values. Returns logits (B, T, V) and the mean cross-entropy, or None.

        With a context group of G ranks, idx and targets are this rank's chunk (T = the sequence length / G, at
        positions ``[r * T, (r + 1) * T)``), and the loss is the mean over the chunk's tokens."""
        B, T = idx.shape
        chunks = comm.group_size(self.context_group)
        if T * chunks > self.config.seq_len:
            raise ValueError(f"sequence length {T * chunks} > seq_len({self.config.seq_len}); crop the input or raise "
                             f"--seq-len")
        start = dist.get_rank(self.context_group) * T if chunks > 1 else 0
        pos = torch.arange(start, start + T, device=idx.device)  # (T,) this chunk's positions
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, logits.shape[-1]), targets.reshape(B * T))  # fp32 loss
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled bytes; returns (B, T + max_new_tokens).

        temperature <= 0 means greedy decoding; top_k keeps only the k most likely bytes before sampling.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.seq_len:]  # (B, <= seq_len)
            logits, _ = self(context)
            next_idx = sample_next(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat([idx, next_idx], dim=1)  # (B, T + 1)
        return idx


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One sampled token per row of ``logits`` (B, V) float: (B, 1) int64. temperature <= 0 is greedy decoding;
    top_k keeps only the k most likely tokens before sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)  # (B, 1)
