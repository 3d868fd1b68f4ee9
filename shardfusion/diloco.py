"""Outer synchronisation every H steps (DiLoCo: Douillard et al., 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"; the streaming variant: Douillard et al., 2025) on top of HSDP.

Under HSDP (``fsdp_outer_degree > 1``) each step all-reduces every flat buffer's sharded gradient over its replicate
group, the only traffic between nodes. `DiLoCo` turns that all-reduce off: each replica (the ranks with one index
in the replicate group: one outer index, one dp index) takes H *inner* steps with its own optimizer on its own data,
its gradients reduce-scattered inside the node only (divided by its own ranks, so each is the mean over that
replica's samples), and clipping takes the replica's own norm. Every H steps the *outer* step runs on the shards:

    delta    = snapshot - shard          the pseudo-gradient, (S,) per flat buffer, this replica's change
    delta    = mean over replicas        one all-reduce over the replicate group (plain, bf16 or int8 on the wire)
    momentum = mu * momentum + delta
    update   = delta + mu * momentum     (Nesterov; without: update = momentum)
    snapshot = snapshot - lr * update    and shard = snapshot: every replica bitwise the same

``snapshot`` (the parameters of the last outer step) and ``momentum`` live on the shards: 2 x 1/inner of the
model per rank, in the shard's dtype. The paper's outer optimizer, our defaults: SGD with Nesterov momentum 0.9 and
learning rate 0.7; H = 500 in the paper for large models (we default to 16 for the small runs here). With lr 1,
momentum 0 and H = 1 the outer step is the mean of the replicas' parameters: with plain SGD as the inner optimizer
that is synchronous HSDP with SGD, to fp32 rounding.

Streaming (``fragments`` > 1): the flat buffers are cut into that many fragments of about equal size, in unit
order; fragment f is synchronised at the inner steps t with ``(t + f * H // fragments) % H == 0``, so every
fragment is synchronised every H steps and no step carries more than about 1/fragments of the model's bytes.

Layouts this supports: sep = cp = 1 (their gradients are summed over the replicate group, which inner steps skip);
element-sharded and owner-layout buffers, whose replicate group is the Topology's, and buffers kept whole
(``replicate_filter``), replicated over the stage's data-parallel ranks (``Topology.get_param_replica_group``): in
an inner step their gradient is all-reduced over the replica's inner ranks only (``FlatBuffer.replica_sync_group``),
and the outer step averages their pseudo-gradients over all their holders, the inner ranks of a replica holding the
same values. Not experts under the ``shard`` policy. Anything else is a ValueError at construction.

Pipeline stages (pp > 1): a replica is one index of the replicate group over every pp index (``replica_groups``: the
stages of one model copy), and the replicate group of a stage's buffers is its own pp index's, so the outer step of
each stage runs over that stage's replicas only, with its own snapshot and momentum; every rank calls `step` after
every optimizer step, so the outer steps of all stages happen at the same inner step. Pass this rank's stages as a
list. With fragments, each rank cuts its own stages' buffers into the fragments (fragment f of every stage is
synchronised at the same steps); the count must fit the rank with the fewest buffers. A weight tied across the
pipeline's ends (kept whole on both, its gradients summed over the ends group, inside one replica) stays equal on
both ends: both copies move by the same mean pseudo-gradient.

Replicas in other jobs (``external=True``): fault-tolerant replica groups (`shardfusion.ft`), each a job of its own
whose Topology has outer degree 1. The caller then runs the outer step of each due fragment in three parts: this
replica's `pseudo_gradients`, their mean over the replica groups alive at that moment (torchft's quorum:
``shardfusion.ft.ReplicaGroup.average_over_quorum``), and `apply`; the semi-synchronous setting of torchft's own
DiLoCo, the outer state (snapshot, momentum) the part each group must not lose (docs/fault-tolerance.md).

What still crosses the replicas in an inner step, outside the flat buffers: a model's module buffers (BatchNorm
statistics, rotary caches), which every training forward broadcasts from the first data-parallel rank over the
parameter-replica group (``Topology.get_param_replica_group``), and a ``torch.amp.GradScaler``'s found-inf flag
(all-reduced over the world, ``shardfusion.amp``). Both are a few bytes for a transformer; a model with large
buffers pays them every step.

Construct it after the weights are final (loaded from a checkpoint or a pretrained file): the snapshot is taken
then. After loading weights into a model that already has a DiLoCo, call `reset`.

Peak memory at an outer step: the pseudo-gradients of one fragment (1/fragments of the shard) beside the snapshot
and the momentum (``sf.plan`` counts all three); the int8 wire format adds its temporaries
(``compress.compressed_all_reduce``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
from shardfusion._runtime import compress
from shardfusion._runtime.state import flat_buffers
from shardfusion.topology import Topology

DEFAULT_EVERY = 16
DEFAULT_LR = 0.7
DEFAULT_MOMENTUM = 0.9
STATE_KEYS = ("snapshot", "momentum")


def replica_groups(topology: Topology) -> list[list[int]]:
    """The ranks of each replica: those with the same index in the replicate group (``Topology.replicate_rank``),
    in rank order, one list per replica, in replica order."""
    degrees = topology.degrees
    by_replica: dict[int, list[int]] = {}
    for rank in range(topology.world_size):
        c = degrees.coordinates(rank)
        index = ((c["dp"] * degrees.fsdp_outer_degree + c["outer"]) * degrees.sep + c["sep"]) * degrees.cp + c["cp"]
        by_replica.setdefault(index, []).append(rank)
    return [by_replica[i] for i in sorted(by_replica)]


def check_layout(topology: Topology, external: bool = False) -> None:
    """Raise ValueError (naming the degrees) when the layout has no replicas (unless ``external``: the replicas
    are other jobs, `DiLoCo`'s argument) or axes DiLoCo cannot skip."""
    replicas = topology.dp * topology.fsdp_outer_degree
    if replicas < 2 and not external:
        raise ValueError(f"DiLoCo needs replicas to synchronise: dp x fsdp_outer_degree is {topology.dp} x "
                         f"{topology.fsdp_outer_degree} = {replicas}; use fsdp_outer_degree > 1 (HSDP)")
    bad = [(name, value) for name, value in (("sep", topology.sep), ("cp", topology.cp)) if value != 1]
    if bad:
        name, value = bad[0]
        raise ValueError(f"DiLoCo with {name}={value}: its ranks' gradients are summed by the replicate all-reduce, "
                         f"which inner steps skip; use {name}=1")


def _whole_group(topology: Topology, buffer) -> dist.ProcessGroup:
    """The group a buffer kept whole is replicated over: the ranks holding its parameters before sharding."""
    return topology.get_param_replica_group(is_expert=buffer.is_expert)


def _fewest(count: int, buffers: list) -> int:
    """The least ``count`` over the world (one all-reduce; ``count`` itself in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    least = torch.tensor([count], dtype=torch.long, device=buffers[0].shard.device if buffers else None)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())


def _fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Indices 0 .. len(sizes)-1 cut into ``count`` contiguous runs of about equal total size (none empty)."""
    total, runs, current, acc = sum(sizes), [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        acc += size
        left_items, left_runs = len(sizes) - i - 1, count - len(runs) - 1
        if left_runs and (acc >= total * (len(runs) + 1) / count or left_items == left_runs):
            runs.append(current)
            current = []
    runs.append(current)
    return runs


class DiLoCo:
    """Inner steps without cross-node traffic and an outer Nesterov step every ``every`` steps (module docstring).

    Construct it after ``sf.fully_shard`` and before the first step; call `step` after every inner optimizer step.

    Args:
        models: the sharded model, or a list of them, all wrapped over ``topology`` (with pp > 1: this rank's
            pipeline stages).
        topology: the `Topology` (``dp x fsdp_outer_degree`` replicas; sep, cp 1).
        every: H, inner steps per outer step (>= 1).
        lr: the outer learning rate (> 0; 0.7 the paper's).
        momentum: the outer momentum mu (0 <= mu < 1; 0.9 the paper's).
        nesterov: Nesterov momentum (the paper's) or heavy ball.
        comm_dtype: the pseudo-gradient's wire format: None (the shard's dtype), ``torch.bfloat16``,
            ``torch.float16`` or ``"int8"`` (``shardfusion._runtime.compress``; every replica gets the same result,
            bitwise).
        fragments: streaming: the flat buffers cut into this many fragments, synchronised at staggered steps
            (1 <= fragments <= min(every, trainable buffers of the rank with the fewest)).
        external: the replicas are other jobs, not in ``topology`` (fault-tolerant replica groups joined by torchft,
            ``shardfusion.ft.ReplicaGroup.average_over_quorum``; the training job's ``job_outer_ft``): the layout
            needs no replicas of its own, and the caller runs each due fragment's outer step itself
            (`pseudo_gradients`, their mean over the replicas, `apply`) instead of `step` / `finish`.

    Raises:
        ValueError: a bad argument (naming it and its value), a layout without replicas or with sep or cp > 1,
            a buffer replicated over another group (experts under the ``shard`` policy). Raised on every rank
            (the fragment count is checked against the least buffer count over the world).
    """

    def __init__(self, models: nn.Module | Sequence[nn.Module], topology: Topology, *, every: int = DEFAULT_EVERY,
                 lr: float = DEFAULT_LR, momentum: float = DEFAULT_MOMENTUM, nesterov: bool = True,
                 comm_dtype: object = None, fragments: int = 1, external: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every (H, inner steps per outer step) must be an int >= 1, got {every!r}")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr (the outer learning rate) must be > 0, got {lr!r}")
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"momentum (the outer momentum) must be in [0, 1), got {momentum!r}")
        check_layout(topology, external)
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        # a buffer of zero-element parameters only has nothing to synchronise (and no replicate group)
        self.buffers = [b for m in self.models for b in flat_buffers(m, trainable_only=True)
                        if b.layout.padded_numel > 0]
        replicate = topology.get_replicate_group()
        for b in self.buffers:
            if b.replicate_group is not replicate and b.replicate_group is not _whole_group(topology, b):
                raise ValueError(f"DiLoCo: {b._collective('the buffer')} is replicated over neither the Topology's "
                                 f"replicate group nor its data-parallel ranks (experts under the 'shard' policy); "
                                 f"its gradient needs the all-reduce inner steps skip")
        fewest = _fewest(len(self.buffers), self.buffers)  # pipeline stages differ: one answer on every rank
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not (
                1 <= fragments <= min(every, max(1, fewest))):
            raise ValueError(f"fragments must be an int in 1 .. min(every {every}, trainable buffers "
                             f"{fewest}{'' if fewest == len(self.buffers) else ' on the rank with the fewest'}), got "
                             f"{fragments!r}")
        self.every, self.lr, self.momentum, self.nesterov = every, float(lr), float(momentum), bool(nesterov)
        self.comm_dtype = compress.validate_outer_comm_dtype(comm_dtype)
        self.topology, self.group = topology, replicate
        self.replicas = comm.group_size(replicate)
        self.replica_group, _ = dist.new_subgroups_by_enumeration(replica_groups(topology))
        comm.label_group(self.replica_group, "replica")
        self.fragments = _fragments([b.shard.numel() for b in self.buffers], fragments)
        self.offsets = [f * every // fragments for f in range(fragments)]
        self.inner_steps = 0
        """Inner steps taken (the optimizer steps `step` was called after)."""
        self.outer_steps = [0] * fragments
        """Outer steps taken, per fragment."""
        with torch.no_grad():
            self.snapshot = [b.shard.detach().clone() for b in self.buffers]  # (S,) each
            self.momentum_buffers = [torch.zeros_like(b.shard) for b in self.buffers]  # (S,) each
        for b in self.buffers:
            b.set_replicate_sync(False)
            b.replica_group = self.replica_group
            if b.replicate_group is not replicate:  # kept whole: the replica's own ranks still sum its gradient
                b.replica_sync_group = topology.get_fsdp_inner_reduce_group(is_expert=b.is_expert)

    def reset(self) -> None:
        """Start a new outer period from the shards as they are: snapshot = shard, momentum = 0 (e.g. after
        loading weights). Local; the replicas must hold the same shards (as after a load), or the next outer step
        averages their differences."""
        with torch.no_grad():
            for snap, m, b in zip(self.snapshot, self.momentum_buffers, self.buffers):
                snap.copy_(b.shard)
                m.zero_()

    # ---- the outer step ---------------------------------------------------------------------------------------
    def due(self, inner_steps: Optional[int] = None) -> list[int]:
        """The fragments synchronised after inner step ``inner_steps`` (default: the count so far)."""
        t = self.inner_steps if inner_steps is None else inner_steps
        return [f for f, offset in enumerate(self.offsets) if t > 0 and (t + offset) % self.every == 0]

    def step(self) -> list[int]:
        """Count one inner step; run the outer step of every fragment now due. Returns those fragments' indices.
        Collective over the replicate group when a fragment is due (the same steps on every rank)."""
        self.inner_steps += 1
        due = self.due()
        for f in due:
            self.sync(f)
        return due

    def finish(self) -> list[int]:
        """The outer step of every fragment not synchronised at this step (the end of a run: the replicas end as
        one model). Returns those fragments. Collective over the replicate group."""
        done = set(self.due())
        rest = [f for f in range(len(self.fragments)) if f not in done]
        for f in rest:
            self.sync(f)
        return rest

    def sync(self, fragment: int) -> None:
        """The outer step of one fragment (module docstring): all-reduce the pseudo-gradients over the replicas,
        the Nesterov update of the snapshot, every replica's shard set to it."""
        indices = self.fragments[fragment]
        deltas = self.pseudo_gradients(fragment)
        with torch.no_grad():
            groups = [self.buffers[i].replicate_group for i in indices]  # a buffer kept whole: all its holders
            if self.comm_dtype is None:
                works = [comm.all_reduce(d, g, async_op=True) for d, g in zip(deltas, groups)]
                for work, i in zip(works, indices):
                    if work is not None:
                        comm.wait(work, self.buffers[i]._collective("outer all_reduce"))
            else:
                for d, g in zip(deltas, groups):
                    compress.compressed_all_reduce(d, g, self.comm_dtype)
            for delta, g in zip(deltas, groups):
                delta.div_(comm.group_size(g))
        self.apply(fragment, deltas)

    def pseudo_gradients(self, fragment: int) -> list[torch.Tensor]:
        """This replica's change since the fragment's last outer step: snapshot - shard, a new (S,) tensor per
        trainable flat buffer of the fragment, in the shard's dtype. Local."""
        with torch.no_grad():
            return [self.snapshot[i] - self.buffers[i].shard for i in self.fragments[fragment]]

    def apply(self, fragment: int, deltas: Sequence[torch.Tensor]) -> None:
        """The outer Nesterov step of one fragment from ``deltas``, the mean over the replicas of their
        `pseudo_gradients` (consumed: changed in place): momentum, snapshot and every shard of the fragment set to
        the new snapshot; counts the fragment's outer step. Local: every replica that applies the same mean to the
        same snapshot and momentum ends bitwise the same."""
        with torch.no_grad():
            for i, delta in zip(self.fragments[fragment], deltas):
                m = self.momentum_buffers[i]
                m.mul_(self.momentum).add_(delta)
                update = delta.add_(m, alpha=self.momentum) if self.nesterov else m
                self.snapshot[i].sub_(update, alpha=self.lr)
                self.buffers[i].shard.copy_(self.snapshot[i])
        self.outer_steps[fragment] += 1

    # ---- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state: ``inner_steps``, ``outer_steps`` and per trainable buffer i ``snapshot/i`` and
        ``momentum/i`` ((S,) tensors, the live ones: copy before changing them)."""
        state: dict[str, Any] = {"inner_steps": self.inner_steps, "outer_steps": list(self.outer_steps)}
        for key, tensors in (("snapshot", self.snapshot), ("momentum", self.momentum_buffers)):
            for i, t in enumerate(tensors):
                state[f"{key}/{i}"] = t
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put `state_dict`'s result (this rank's, of the same layout) back.

        Raises:
            ValueError: missing keys or shapes that differ (another layout or model).
        """
        for key, tensors in (("snapshot", self.snapshot), ("momentum", self.momentum_buffers)):
            for i, t in enumerate(tensors):
                saved = state.get(f"{key}/{i}")
                if not isinstance(saved, torch.Tensor) or saved.shape != t.shape:
                    got = None if saved is None else tuple(getattr(saved, "shape", ()))
                    raise ValueError(f"DiLoCo state: {key}/{i} has shape {got}, this layout's is {tuple(t.shape)}: "
                                     f"resume a DiLoCo run with the layout and world size it was saved with")
                with torch.no_grad():
                    t.copy_(saved)
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = [int(x) for x in state["outer_steps"]]
        if len(self.outer_steps) != len(self.fragments):
            raise ValueError(f"DiLoCo state has {len(self.outer_steps)} fragments, this run {len(self.fragments)}")

    def close(self) -> None:
        """Turn the replicate all-reduce back on (every step synchronous again). Call after an outer step of every
        fragment, or the replicas keep their differences."""
        for b in self.buffers:
            b.set_replicate_sync(True)
            b.replica_sync_group = None
