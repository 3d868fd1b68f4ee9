"""The reshard policy chosen by a memory budget: ``fully_shard(..., reshard_policy="auto", memory_budget=B)``.

[Note: reshard policy by budget]
A unit resharded after forward frees its gathered full buffers when its forward ends and gathers them again for its
backward: one more all-gather per micro-batch, no full buffer held between forward and backward. A unit kept
gathered (``after_backward``) saves that all-gather and holds its full buffers from its forward to its backward.
Under ``"auto"`` each unit the policy decides (every unit but the root, those ``reshard_filter`` leaves out and the
units absorbed from earlier ``fully_shard`` calls, which keep their setting) is kept gathered when it fits the
budget, the rest reshard after forward:

1. the memory of a choice is the plan's estimate ([Note: the outer-degree cost model] in ``shardfusion.plan``;
   :func:`memory_parts` is that estimate, used by both): this rank's shards, their sharded gradients, the optimizer
   state (``optim_states`` values of ``optim_bytes`` per trainable shard element: AdamW's two fp32 values by
   default), the full buffers of every unit kept gathered, the ``prefetch + 2`` largest of the resharded units (the
   running one, the prefetched ones, the previous one until its gradient lands) and the 2 largest full gradient
   buffers. Activations are not counted;
2. the units decided are ranked by the all-gather bytes keeping them saves per byte of memory they hold (one
   all-gather of the unit per micro-batch over its full bytes), most first; equal ratios go last unit first
   (backward needs the last units first, and their full buffers are held the shortest);
3. in that order, a unit is kept when the choice with it still fits the budget (a unit that does not fit is passed
   over and smaller ones after it may still be kept).

So a budget below the need with every unit resharded keeps none (the choice is ``after_forward``, and the record
says that it does not fit), and a budget at or above the need with every unit kept keeps them all (with
``reshard_filter="all"`` that is ``after_backward``). The facts read are the flat buffers' sizes, shard counts and
dtypes, equal on every rank of a call by construction (equal shards; ep ranks hold equally sized experts), so every
rank chooses alike; ``fully_shard`` checks that with one all-reduce.

The idea of trading the backward all-gathers for memory per unit is FSDP2's ``reshard_after_forward`` (per module)
and DeepSpeed's ``stage3_max_reuse_distance``/``stage3_max_live_parameters``; choosing it from a budget with the
cost model's memory figures is ours.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["ReshardChoice", "UnitBytes", "apply", "check_budget", "choose", "decided_again", "memory_parts",
           "unit_bytes"]

OPTIM_STATES = 2
"""Optimizer values per trainable shard element the budget counts: AdamW's two (``sf.plan``'s default)."""
OPTIM_BYTES = 4
"""Bytes of each optimizer value the budget counts: fp32 (``sf.plan``'s default ``optim_dtype``)."""


@dataclass(frozen=True)
class UnitBytes:
    """The memory and all-gather facts of one unit on one rank. Bytes everywhere.

    Attributes:
        name: the unit's name (``""``: the root unit).
        shard_bytes: this rank's shards of the unit's flat buffers.
        grad_shard_bytes: this rank's sharded gradients (the trainable shards' bytes).
        optim_elems: trainable shard elements (each holds the optimizer's state).
        full_bytes: the gathered full buffers (0 for a buffer whose shard is its full buffer: kept whole, no cast).
        grad_bytes: the full-size gradient buffers of its trainable buffers.
        gather_bytes: what one all-gather of the unit sends per rank, ``(G-1)/G x full bytes`` summed over its
            buffers sharded over ``G > 1`` ranks (exact, so equal units tie exactly).
        secondary_bytes: with ``secondary_shard`` (hpZ), the copy one rank holds from the unit's forward to its
            backward when it reshards after forward (``secondary_shard.copy_bytes`` of each buffer whose group spans
            nodes; 0 otherwise).
    """

    name: str
    shard_bytes: int
    grad_shard_bytes: int
    optim_elems: int
    full_bytes: int
    grad_bytes: int
    gather_bytes: Fraction = Fraction(0)
    secondary_bytes: int = 0

    @property
    def ratio(self) -> Fraction:
        """All-gather bytes saved per byte of memory held when the unit is kept gathered (0 without full bytes)."""
        return self.gather_bytes / self.full_bytes if self.full_bytes else Fraction(0)


def memory_parts(units: Sequence[UnitBytes], reshard_after_forward: Sequence[bool], *, prefetch: int,
                 optim_states: int = OPTIM_STATES, optim_bytes: int = OPTIM_BYTES, other_bytes: int = 0) -> dict:
    """The plan's memory estimate of one rank (see [Note: the outer-degree cost model] in ``shardfusion.plan``), in
    bytes by part: ``params`` (shards), ``grads`` (sharded gradients), ``optimizer``, ``unsharded`` (the full
    buffers of the units kept gathered, the ``prefetch + 2`` largest resharded ones and the 2 largest full gradient
    buffers), ``other`` (``other_bytes``: what the caller adds, e.g. activations) and, when any unit has
    ``secondary_bytes`` (hpZ), ``secondary``: the copies of every unit resharded after forward (all alive at the
    end of a forward)."""
    resharded = sorted((u.full_bytes for u, r in zip(units, reshard_after_forward) if r), reverse=True)
    kept = sum(u.full_bytes for u, r in zip(units, reshard_after_forward) if not r)
    grads = sorted((u.grad_bytes for u in units), reverse=True)
    return {"params": sum(u.shard_bytes for u in units), "grads": sum(u.grad_shard_bytes for u in units),
            "optimizer": sum(u.optim_elems for u in units) * optim_bytes * optim_states,
            "unsharded": kept + sum(resharded[:prefetch + 2]) + sum(grads[:2]), "other": other_bytes,
            **({"secondary": sum(u.secondary_bytes for u, r in zip(units, reshard_after_forward) if r)}
               if any(u.secondary_bytes for u in units) else {})}


@dataclass(frozen=True)
class ReshardChoice:
    """Which units keep their gathered parameters from forward to backward, and why (:func:`choose`).

    Attributes:
        budget: the memory budget per rank, bytes.
        names: every unit's name, in unit order (the root unit, ``""``, first).
        reshard_after_forward: per unit, the setting chosen (or kept, for a unit the policy does not decide).
        decided: per unit, whether the policy decided it (False: the root, units ``reshard_filter`` leaves out,
            units absorbed from earlier calls).
        order: the decided units' indices in the order they were considered ([Note: reshard policy by budget]).
        needs: the memory estimate (bytes) with the first ``k`` units of ``order`` kept, for ``k = 0 .. len(order)``:
            ``needs[0]`` is every decided unit resharded (``after_forward``), ``needs[-1]`` all kept.
        memory: the chosen setting's estimate by part (:func:`memory_parts`); ``memory_bytes``: their sum.
        fits: ``memory_bytes <= budget`` (False only when even ``needs[0]`` is over the budget).
    """

    budget: int
    names: tuple
    reshard_after_forward: tuple
    decided: tuple
    order: tuple
    needs: tuple
    memory: dict = field(default_factory=dict)
    memory_bytes: int = 0
    fits: bool = True

    @property
    def kept(self) -> tuple:
        """The decided units kept gathered from forward to backward, in unit order."""
        return tuple(n for n, r, d in zip(self.names, self.reshard_after_forward, self.decided) if d and not r)

    @property
    def resharded(self) -> tuple:
        """The decided units resharded after forward, in unit order."""
        return tuple(n for n, r, d in zip(self.names, self.reshard_after_forward, self.decided) if d and r)

    def digest(self) -> int:
        """A 31-bit checksum of the choice (the names and the settings), for comparing it across ranks."""
        text = "|".join(f"{n}:{int(r)}:{int(d)}" for n, r, d in zip(self.names, self.reshard_after_forward,
                                                                      self.decided))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF

    def describe(self) -> list[str]:
        """Lines for a person: the choice, the budget against the estimate, and the extremes."""
        decided = sum(self.decided)
        verdict = (f"fits, {_size(self.budget - self.memory_bytes)} headroom" if self.fits else
                   f"does not fit by {_size(self.memory_bytes - self.budget)}: every unit is resharded after forward "
                   f"and the run needs more than the budget")
        kept = ", ".join(_name(n) for n in self.kept) or "none"
        return [f"reshard policy auto: {len(self.kept)} of {decided} unit{'s' * (decided != 1)} kept gathered from "
                f"forward to backward ({kept}), the rest resharded after forward",
                f"memory budget {_size(self.budget)} per rank: estimate {_size(self.memory_bytes)} without "
                f"activations ({verdict}); all resharded {_size(self.needs[0])}, all kept {_size(self.needs[-1])}"]

    def as_dict(self) -> dict:
        """The record written to a run folder (JSON-ready)."""
        return {"budget": self.budget, "kept": list(self.kept), "resharded": list(self.resharded),
                "memory": dict(self.memory), "memory_bytes": self.memory_bytes, "fits": self.fits,
                "needs": list(self.needs), "units": list(self.names),
                "reshard_after_forward": list(self.reshard_after_forward), "decided": list(self.decided)}


def choose(units: Sequence[UnitBytes], reshard_after_forward: Sequence[bool], decided: Sequence[bool], budget: int,
           *, prefetch: int, optim_states: int = OPTIM_STATES, optim_bytes: int = OPTIM_BYTES,
           other_bytes: int = 0) -> ReshardChoice:
    """The units to keep gathered within ``budget`` bytes ([Note: reshard policy by budget]).

    Args:
        units: every unit's facts, in unit order.
        reshard_after_forward: per unit, its setting before the choice (for a decided unit: True).
        decided: per unit, whether the policy decides it; the others keep ``reshard_after_forward``.
        budget: bytes per rank (any int: a budget under every choice's need keeps nothing).
        prefetch, optim_states, optim_bytes, other_bytes: as :func:`memory_parts` takes them.

    Returns:
        A :class:`ReshardChoice`; deterministic in its arguments.
    """
    flags = [bool(r) or bool(d) for r, d in zip(reshard_after_forward, decided)]  # decided: resharded to start

    def need(setting: list) -> dict:
        return memory_parts(units, setting, prefetch=prefetch, optim_states=optim_states, optim_bytes=optim_bytes,
                            other_bytes=other_bytes)

    order = sorted((i for i, d in enumerate(decided) if d), key=lambda i: (-units[i].ratio, -i))
    needs, prefix = [sum(need(flags).values())], list(flags)
    for i in order:
        prefix[i] = False
        needs.append(sum(need(prefix).values()))
    chosen = list(flags)
    for i in order:
        trial = list(chosen)
        trial[i] = False
        if sum(need(trial).values()) <= budget:
            chosen = trial
    memory = need(chosen)
    total = sum(memory.values())
    return ReshardChoice(budget=int(budget), names=tuple(u.name for u in units), reshard_after_forward=tuple(chosen),
                         decided=tuple(bool(d) for d in decided), order=tuple(order), needs=tuple(needs),
                         memory=memory, memory_bytes=total, fits=total <= budget)


def check_budget(reshard_policy: str, memory_budget: Optional[int]) -> None:
    """``fully_shard``'s ``memory_budget`` against its ``reshard_policy``.

    Raises:
        ValueError: ``"auto"`` without a budget; a budget that is not an int > 0 (bytes); a budget with another
            policy (only ``"auto"`` reads it).
    """
    if memory_budget is None:
        if reshard_policy == "auto":
            raise ValueError("reshard_policy='auto' needs memory_budget (bytes per rank: the units kept gathered "
                             "from forward to backward must fit it)")
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be an int > 0 (bytes per rank), got {memory_budget!r}")
    if reshard_policy != "auto":
        raise ValueError(f"memory_budget({memory_budget}) is read only by reshard_policy='auto', got "
                         f"reshard_policy={reshard_policy!r}; drop memory_budget or use reshard_policy='auto'")


def unit_bytes(unit) -> UnitBytes:
    """The :class:`UnitBytes` of a built unit (``shardfusion._runtime.unit.Unit``), from its flat buffers' layouts:
    padded length ``P``, shard count ``G``, the shard's and the full buffer's element sizes."""
    from shardfusion._runtime.secondary_shard import copy_bytes

    shard = grad_shard = optim = full = grad = secondary = 0
    gather = Fraction(0)
    for g in unit.groups:
        if getattr(g, "secondary", None) is not None:  # hpZ: [Note: secondary shard]
            secondary += copy_bytes(g.layout.padded_numel, g.layout.shard_count, g.secondary.plan.size,
                                    g.all_gather_dtype, g.param_dtype.itemsize)
        P, S, G = g.layout.padded_numel, g.layout.shard_numel, g.layout.shard_count
        param_bytes = g.param_dtype.itemsize
        shard += S * g.shard.element_size()
        if g.requires_grad:
            grad_shard += S * g.shard.element_size()
            optim += S
            grad += P * param_bytes
        if g.full is not g.shard:
            full += P * param_bytes
            if G > 1:
                gather += Fraction((G - 1) * P * param_bytes, G)
    return UnitBytes(unit.name, shard, grad_shard, optim, full, grad, gather, secondary)


def apply(units: Sequence, decided: Sequence[bool], budget: int, *, prefetch: int, group,
          device: torch.device) -> ReshardChoice:
    """Choose within ``budget`` for built units (``shardfusion._runtime.unit.Unit``, in unit order; ``decided``:
    those the policy decides, which start resharded), set each decided unit's ``reshard_after_forward``, check that
    every rank of ``group`` chose alike (:func:`agree`) and return the choice. Collective over ``group``."""
    facts = [unit_bytes(u) for u in units]
    choice = choose(facts, [u.reshard_after_forward for u in units], decided, budget, prefetch=prefetch)
    agree(choice, group, device)
    for u, r in zip(units, choice.reshard_after_forward):
        u.reshard_after_forward = r
    return choice


def decided_again(inner: Sequence) -> set:
    """The units of earlier ``fully_shard`` calls on the submodules ``inner`` (``[(qualified name, submodule)]``,
    still sharded) that a call under ``"auto"`` decides again with its own budget, by their names in the model
    being sharded: those the earlier call's ``"auto"`` decided, and its root when its ``reshard_filter`` selects it.
    Units of calls under a fixed policy keep their setting (the user's choice)."""
    from shardfusion._runtime.state import sharded_state
    from shardfusion._runtime.wrap import reshards_after_forward

    names = set()
    for name, sub in inner:
        state = sharded_state(sub)
        if state.wrap_options.reshard_policy != "auto":
            continue
        if reshards_after_forward(state.wrap_options, name, sub):
            names.add(name)
        choice = getattr(state, "reshard_choice", None)
        if choice is not None:
            names.update(f"{name}.{n}" for n, d in zip(choice.names, choice.decided) if d and n)
    return names


def agree(choice: ReshardChoice, group, device: torch.device) -> None:
    """Check that every rank of ``group`` made the same ``choice`` (one all-reduce of two ints; skipped on a dry
    run's fake group, whose ranks are built by the same code).

    Raises:
        ValueError: the ranks chose differently (their units' sizes differ); on every rank.
    """
    from shardfusion import comm

    digest = choice.digest()
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    comm.all_reduce(both, group, op=dist.ReduceOp.MAX)
    if not comm.is_fake(group) and both[0].item() != -both[1].item():
        raise ValueError(f"reshard_policy='auto' chose differently on the ranks of this call (this rank keeps "
                         f"{len(choice.kept)} unit(s): {', '.join(_name(n) for n in choice.kept) or 'none'}): their "
                         "units' sizes differ; build the same model on every rank")


def _name(name: str) -> str:
    return name or "<root>"


def _size(n: float) -> str:
    """Bytes for a person: GiB, MiB or KiB with 2 decimals, else bytes (``sf.plan``'s tables use it too)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
