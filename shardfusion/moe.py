"""An expert-parallel mixture-of-experts feed-forward layer with dropless top-k routing.

[Note: MoE dispatch]
Shape legend: T tokens on this rank, C d_model, F expert hidden size, E experts, ep expert-parallel degree,
E_local = E / ep experts held by each rank, K top-k, N = T*K (token, expert) assignments made on this rank,
N_recv assignments that this rank's experts receive (from every rank of the ep group).

The router picks K experts per token (Switch Transformer, Fedus et al. 2021, with K = 1; GShard, Lepikhin et al.
2020, with K = 2). Nothing is dropped (no capacity factor), as in MegaBlocks (Gale et al. 2022): each expert gets
however many rows were routed to it, and the all-to-alls carry uneven splits. One forward, on every rank of the
ep group:

1. route:    logits (T, E) in fp32 -> softmax probs (T, E) -> top-k gates (T, K), expert ids (T, K).
2. sort:     the N assignments stably sorted by global expert id; counts (E,) per expert.
3. counts:   all-to-all of the counts in ep chunks of E_local: how many rows each source rank sends each local expert.
4. dispatch: all-to-all of the sorted rows (N, C) -> (N_recv, C), ordered by source rank, then local expert.
5. experts:  rows regrouped by local expert; EVERY local expert runs on its slice, even an empty one.
6. combine:  regrouping undone, all-to-all back (N_recv, C) -> (N, C), rows scaled by their gates and summed per
             token into a new (T, C) tensor; a shared expert (if any) adds its output for every token.

Step 5 never skips an expert and no rank returns early (T == 0 included), so every rank builds the same autograd
graph and issues the same sequence of collectives in forward and backward (docs/design.md, invariant 1), and every
expert parameter gets a gradient (zeros when it saw no row): the sharding runtime then reduces the same buffers
everywhere.
With ep = 1 the same code runs and the all-to-alls issue nothing.

Expert parameters carry ``param.is_expert = True`` (:data:`EXPERT_ATTR`, set by :func:`mark_expert`): ``fully_shard``
puts them into expert flat buffers, sharded over the expert inner group. The router and the shared expert are dense.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from shardfusion import comm

EXPERT_ATTR = "is_expert"
"""Name of the boolean attribute that marks a parameter as an expert parameter (read by :func:`is_expert`)."""


def mark_expert(module_or_param: Union[nn.Module, nn.Parameter]) -> Union[nn.Module, nn.Parameter]:
    """Mark every parameter of a module (or one parameter) as an expert parameter; returns its argument."""
    params = [module_or_param] if isinstance(module_or_param, torch.Tensor) else module_or_param.parameters()
    for p in params:
        setattr(p, EXPERT_ATTR, True)
    return module_or_param


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked as an expert parameter (see :func:`mark_expert`)."""
    return bool(getattr(param, EXPERT_ATTR, False))


DEFAULT_EXPERT_STD = 0.02
"""Standard deviation of the routed experts' weights when none is given."""


class _SeedBox:
    """The expert seed of one :class:`MoE`, drawn by its router's first ``reset_parameters`` and read by its
    experts' layers. A plain object shared by reference, so ``copy.deepcopy`` of the layer keeps it shared."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Optional[int] = None


class ExpertLinear(nn.Linear):
    """An ``nn.Linear`` whose ``reset_parameters`` draws the weight from ``N(0, init_std)`` and zeroes the bias.

    With a seed (``seed_box``, ``expert``): from a CPU generator seeded ``seed_box.value + expert``, after drawing
    ``skip_shape`` normals from it (so an expert's second layer continues the stream of its first), never from the
    global generator (``init_std=None``: 0.02); without one: from the global generator (a dense layer, e.g. a shared
    expert), or with ``init_std=None`` torch's default ``nn.Linear`` initialization. Drawing in
    ``reset_parameters`` makes construction and meta-device initialization (``fully_shard`` on a model built on the
    meta device) give the same values.
    """

    def __init__(self, in_features: int, out_features: int, *, init_std: Optional[float] = None,
                 seed_box: Optional[_SeedBox] = None, expert: int = 0, skip_shape: Optional[tuple] = None,
                 device=None, dtype=None) -> None:
        self.init_std, self.seed_box, self.expert, self.skip_shape = init_std, seed_box, expert, skip_shape
        super().__init__(in_features, out_features, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw the weight (see the class), zero the bias. No-op on the meta device.

        Raises:
            RuntimeError: a seeded layer whose seed was not drawn yet (its router was never initialized).
        """
        if self.weight.is_meta:
            return
        if self.seed_box is None:
            if self.init_std is None:
                super().reset_parameters()
                return
            nn.init.normal_(self.weight, 0.0, self.init_std)
        else:
            if self.seed_box.value is None:
                raise RuntimeError("expert layer initialized before its MoE router drew the expert seed: initialize "
                                   "the router first (reset_parameters in module order)")
            gen = torch.Generator().manual_seed(self.seed_box.value + self.expert)
            if self.skip_shape is not None:
                torch.empty(self.skip_shape).normal_(0.0, 1.0, generator=gen)
            std = DEFAULT_EXPERT_STD if self.init_std is None else self.init_std
            self.weight.copy_(torch.empty(self.weight.shape).normal_(0.0, std, generator=gen))
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Expert(nn.Module):
    """A two-layer GELU MLP: ``Expert(d_model, d_hidden)`` maps (N, C) -> (N, C), N == 0 included.

    Its layers are :class:`ExpertLinear` (``fc`` with ``N(0, std)``, ``proj`` with ``N(0, proj_std or std)``), drawn
    from the seed of ``seed_box`` and ``expert`` when given, else from the global generator (``std=None``: see
    :class:`ExpertLinear`). Not marked expert by
    itself: :class:`MoE` marks its routed experts, a shared expert stays dense.
    """

    def __init__(self, d_model: int, d_hidden: int, *, std: Optional[float] = None, proj_std: Optional[float] = None,
                 seed_box: Optional[_SeedBox] = None, expert: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        self.fc = ExpertLinear(d_model, d_hidden, init_std=std, seed_box=seed_box, expert=expert,
                               device=device, dtype=dtype)
        self.act = nn.GELU()
        self.proj = ExpertLinear(d_hidden, d_model, init_std=std if proj_std is None else proj_std,
                                 seed_box=seed_box, expert=expert,
                                 skip_shape=None if seed_box is None else (d_hidden, d_model), device=device,
                                 dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (N, C), N == 0 included."""
        return self.proj(self.act(self.fc(x)))  # (N, C) -> (N, F) -> (N, C)


class Router(nn.Linear):
    """The dense router ``Router(C, E)``: (T, C) -> fp32 logits (T, E), computed in fp32.

    ``reset_parameters`` draws the weight from ``N(0, init_std)`` (``None``: torch's default ``nn.Linear``
    initialization), from the global generator, and then, the first time only, the expert seed of its MoE into
    ``seed_box`` (one draw of the global generator).

    Called as a module, never through ``router.weight`` from outside, so that a unit holding only the router (e.g.
    ``fully_shard(..., units=(nn.Linear,))`` or a small ``comm_unit_size``) is gathered by its forward hooks.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, init_std: Optional[float] = None,
                 seed_box: Optional[_SeedBox] = None, device=None, dtype=None) -> None:
        self.init_std, self.seed_box = init_std, seed_box
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw the weight, zero the bias; draw the expert seed if it is not drawn yet. No-op on meta."""
        if self.weight.is_meta:
            return
        if self.init_std is None:
            super().reset_parameters()
        else:
            nn.init.normal_(self.weight, 0.0, self.init_std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)
        if self.seed_box is not None and self.seed_box.value is None:
            # a dry run's tensors are fake (no values to read), and its values do not matter
            self.seed_box.value = 0 if comm.is_fake() else int(torch.randint(0, 2**62, (1,), device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, C) any float dtype -> fp32 logits (T, E)."""
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def _route(x_TC: torch.Tensor, router: Router, top_k: int, normalize: bool):
    """Router in fp32: probs (T, E), gates (T, K) and expert ids (T, K)."""
    logits_TE = router(x_TC)  # (T, E) fp32
    probs_TE = logits_TE.softmax(dim=-1)
    gates_TK, idx_TK = probs_TE.topk(top_k, dim=-1)
    if normalize and top_k > 1:
        gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
    return probs_TE, gates_TK, idx_TK


def _dispatch(x_TC: torch.Tensor, idx_TK: torch.Tensor, num_experts: int, group: Optional[ProcessGroup]):
    """Steps 2-4 of [Note: MoE dispatch]: sort, exchange counts, send rows to the ranks holding their experts.

    Returns the received rows (N_recv, C) and a plan (dict) for the experts and the way back.
    """
    ep = comm.group_size(group)
    e_local = num_experts // ep
    idx_N = idx_TK.reshape(-1)
    order_N = torch.argsort(idx_N, stable=True)                       # (N,) assignments sorted by expert
    fake = comm.is_fake()  # a dry run: fake tensors have no values to count (shardfusion.dry_run)
    counts_E = (idx_N.new_zeros(num_experts) if fake                  # (E,) int64
                else torch.bincount(idx_N, minlength=num_experts))
    recv_counts = comm.all_to_all_counts(counts_E, group).view(ep, e_local)  # (ep, E_local): [source, local expert]
    plan = {
        "order": order_N,
        "token": order_N // idx_TK.shape[1],                          # (N,) token of each sorted assignment
        "counts": counts_E,
    }
    if fake:  # an even router instead of the counts
        plan.update(_even_routing(idx_N.numel(), num_experts, ep, comm.group_rank(group)))
    else:
        plan.update(send=counts_E.view(ep, e_local).sum(dim=1).tolist(),  # rows to each ep rank
                    recv=recv_counts.sum(dim=1).tolist(),                 # rows from each ep rank
                    expert_sizes=recv_counts.sum(dim=0).tolist())         # rows for each local expert
    x_NC = x_TC.index_select(0, plan["token"])
    x_recv = comm.all_to_all_single(x_NC, plan["recv"], plan["send"], group)  # (N_recv, C)
    if fake:  # the rows' order does not matter to shapes and bytes
        plan["regroup"] = torch.arange(x_recv.shape[0], device=x_TC.device)
        return x_recv, plan
    local_id = torch.arange(e_local, device=x_TC.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    plan["regroup"] = torch.argsort(local_id, stable=True)             # (N_recv,) rows grouped by local expert
    return x_recv, plan


def _even_routing(n: int, num_experts: int, ep: int, ep_rank: int) -> dict[str, list[int]]:
    """The send / recv / expert_sizes of :func:`_dispatch` under a perfectly even router, as a dry run assumes
    (``shardfusion.dry_run``): expert ``e`` gets ``n // E`` of this rank's ``n`` assignments, plus one for ``e <
    n % E``, and every ep rank routes alike."""
    per_expert = [n // num_experts + (e < n % num_experts) for e in range(num_experts)]
    e_local = num_experts // ep
    per_rank = [sum(per_expert[j * e_local:(j + 1) * e_local]) for j in range(ep)]
    mine = per_expert[ep_rank * e_local:(ep_rank + 1) * e_local]
    return {"send": per_rank, "recv": [per_rank[ep_rank]] * ep, "expert_sizes": [ep * c for c in mine]}


def _run_experts(x_recv: torch.Tensor, plan: dict, experts: list[nn.Module]) -> torch.Tensor:
    """Step 5: every local expert on its slice (empty slices included); returns (N_recv, C) in received order."""
    x_grouped = x_recv.index_select(0, plan["regroup"])
    y_grouped = torch.cat([expert(rows) for expert, rows in zip(experts, x_grouped.split(plan["expert_sizes"]))])
    return y_grouped.new_zeros(y_grouped.shape).index_copy(0, plan["regroup"], y_grouped)


def _combine(y_recv: torch.Tensor, plan: dict, gates_TK: torch.Tensor, x_TC: torch.Tensor,
             group: Optional[ProcessGroup]) -> torch.Tensor:
    """Step 6: rows back to their source ranks, scaled by their gates, summed per token into a new (T, C)."""
    y_NC = comm.all_to_all_single(y_recv, plan["send"], plan["recv"], group)  # (N, C) in sorted order
    gates_N = gates_TK.reshape(-1).index_select(0, plan["order"])              # (N,)
    weighted_NC = (y_NC * gates_N.unsqueeze(1).to(y_NC.dtype)).to(x_TC.dtype)
    return x_TC.new_zeros(x_TC.shape).index_add(0, plan["token"], weighted_NC)


class MoE(nn.Module):
    """Expert-parallel MoE feed-forward layer: (..., C) -> (..., C). See [Note: MoE dispatch].

    Args:
        d_model: C. d_hidden: F, each expert's hidden size.
        num_experts: E, the global number of experts; must be divisible by the ep group size.
        top_k: K, experts per token, in [1, E] (default 2).
        ep_group: the expert-parallel group (e.g. ``topo.get_group("ep")``); ``None`` (default) or a group of one
            holds every expert. Group rank j holds the experts ``j*E_local .. (j+1)*E_local - 1``. Kept as the
            attribute ``ep_group``, by which ``fully_shard`` recognizes an expert-parallel layer and checks that it
            dispatches over the topology's ep group.
        shared_expert_hidden: hidden size of a dense :class:`Expert` applied to every token and added to the routed
            output; 0 (default) for none.
        normalize_top_k: renormalize the K gates of a token to sum to 1 when K > 1 (default True).

    Attributes:
        router: :class:`Router` (an ``nn.Linear(C, E, bias=False)``), dense, applied in fp32.
        experts: ``nn.ModuleDict`` of this rank's E_local experts only, keyed by their global index (``"5"``), so
            parameter names are global (``experts.5.fc.weight``); every parameter is marked :data:`EXPERT_ATTR`.
        shared_expert: the dense shared :class:`Expert`, or ``None``.
        expert_seed: the one seed of the experts, drawn from the global RNG by the router's first
            ``reset_parameters`` (see :meth:`reset_expert_parameters`).
        aux_loss: after a forward, the load-balancing loss over this rank's tokens, a 0-dim fp32 tensor
            ``E * sum_e f_e * P_e`` (f_e: fraction of the N assignments routed to e, no gradient; P_e: mean router
            probability of e over the T tokens, differentiable); 0 when T == 0. Not added to anything: the caller
            adds ``coef * aux_loss`` to its loss (Switch Transformer, GShard).
        tokens_per_expert: after a forward, (E,) int64, this rank's assignments per global expert (detached).

        init_std: standard deviation of the normal initialization of the router, the shared expert and the
            experts' first layers; ``None`` (default): torch's default ``nn.Linear`` initialization for the router
            and the shared expert, 0.02 for the experts. proj_init_std: of the experts' (and the shared expert's)
            output layers (default: as ``init_std``). Routed experts' biases start at 0.

    Initialization does not depend on ep: the global RNG gives the router's weight and then exactly one seed (in
    the router's ``reset_parameters``), whatever ep is, and each expert g is drawn from its own generator seeded
    ``expert_seed + g``; so expert g, and any parameter created later, has the same values at every ep. Every draw
    happens in a ``reset_parameters``, in module order, so a MoE built on the meta device and initialized by
    ``fully_shard`` gets the values of eager construction.

    Raises:
        ValueError: a dim < 1 (``shared_expert_hidden`` < 0), ``top_k`` not in [1, E], ``num_experts % ep != 0``.
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int = 2, *,
                 ep_group: Optional[ProcessGroup] = None, shared_expert_hidden: int = 0,
                 normalize_top_k: bool = True, init_std: Optional[float] = None,
                 proj_init_std: Optional[float] = None) -> None:
        super().__init__()
        for name, value, low in (("d_model", d_model, 1), ("d_hidden", d_hidden, 1), ("num_experts", num_experts, 1),
                                 ("shared_expert_hidden", shared_expert_hidden, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"MoE: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k({top_k!r}) must be in [1, num_experts({num_experts})]")
        ep = comm.group_size(ep_group)
        if num_experts % ep:
            raise ValueError(f"MoE: num_experts({num_experts}) % ep({ep}) = {num_experts % ep} != 0: each rank of the "
                             f"ep group holds num_experts / ep experts")
        self.ep_group = ep_group
        self._ep_size, self._ep_rank = ep, (0 if ep == 1 else dist.get_rank(ep_group))
        self._num_experts, self._top_k, self.normalize_top_k = num_experts, top_k, normalize_top_k

        self._seed_box = _SeedBox()
        self.router = Router(d_model, num_experts, bias=False, init_std=init_std, seed_box=self._seed_box)
        e_local = self.num_local_experts
        first = self._ep_rank * e_local
        self.experts = nn.ModuleDict({
            str(g): mark_expert(Expert(d_model, d_hidden, std=init_std, proj_std=proj_init_std,
                                       seed_box=self._seed_box, expert=g))
            for g in range(first, first + e_local)
        })
        self.shared_expert = (Expert(d_model, shared_expert_hidden, std=init_std, proj_std=proj_init_std)
                              if shared_expert_hidden > 0 else None)
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    @property
    def expert_seed(self) -> Optional[int]:
        """The seed of the experts, drawn by the router's first ``reset_parameters`` (``None`` until then, e.g. on
        the meta device)."""
        return self._seed_box.value

    @torch.no_grad()
    def reset_expert_parameters(self, std: Optional[float] = None, proj_std: Optional[float] = None) -> None:
        """(Re)initialize this rank's experts: ``fc.weight ~ N(0, std)``, ``proj.weight ~ N(0, proj_std or std)``,
        biases 0, each expert g from a CPU generator seeded ``expert_seed + g`` (the same values on every call).
        ``None``: the standard deviations given at construction (``init_std``, ``proj_init_std``)."""
        for expert in self.experts.values():
            if std is not None:
                expert.fc.init_std = std
                expert.proj.init_std = std if proj_std is None else proj_std
            elif proj_std is not None:
                expert.proj.init_std = proj_std
            expert.fc.reset_parameters()
            expert.proj.reset_parameters()

    @property
    def num_experts(self) -> int:
        """E, the global number of experts."""
        return self._num_experts

    @property
    def num_local_experts(self) -> int:
        """E_local = E / ep, the experts this rank holds."""
        return self._num_experts // self._ep_size

    @property
    def ep_size(self) -> int:
        """Size of the ep group (1 without one)."""
        return self._ep_size

    @property
    def ep_rank(self) -> int:
        """This rank's index in the ep group (0 without one)."""
        return self._ep_rank

    @property
    def top_k(self) -> int:
        """K, experts per token."""
        return self._top_k

    def extra_repr(self) -> str:
        """E, K, the ep degree and rank, for ``print(model)``."""
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, ep={self.ep_size}, ep_rank={self.ep_rank}, "
                f"normalize_top_k={self.normalize_top_k}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., C); sets :attr:`aux_loss` and :attr:`tokens_per_expert`. Collective over the ep group:
        every rank of it must call it, also with no tokens."""
        x_TC = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled() and not x_TC.requires_grad:
            # The input may need no gradient on this rank but one elsewhere: build the same graph (and so the same
            # backward all-to-alls) on every rank.
            x_TC = x_TC.detach().requires_grad_()
        num_tokens = x_TC.shape[0]
        probs_TE, gates_TK, idx_TK = _route(x_TC, self.router, self.top_k, self.normalize_top_k)
        x_recv, plan = _dispatch(x_TC, idx_TK, self.num_experts, self.ep_group)
        y_recv = _run_experts(x_recv, plan, list(self.experts.values()))
        out_TC = _combine(y_recv, plan, gates_TK, x_TC, self.ep_group)
        if self.shared_expert is not None:
            out_TC = out_TC + self.shared_expert(x_TC)

        counts_E = plan["counts"]
        f_E = counts_E.float() / max(num_tokens * self.top_k, 1)       # no gradient
        p_E = probs_TE.sum(dim=0) / max(num_tokens, 1)                   # differentiable
        self.aux_loss = self.num_experts * (f_E * p_E).sum()
        self.tokens_per_expert = counts_E.detach()
        return out_TC.view(x.shape)
