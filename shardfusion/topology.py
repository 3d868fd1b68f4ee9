"""The rank grid and its process groups.

Vocabulary (see docs/design.md): an *axis* is a named direction of the rank grid and its *degree* is its size ("dim" is
kept for tensor dims). The dense axes, slowest first, are ``dp, pp, sharding, sep, cp, mp``; a rank is::

    rank = (((((dp_i*pp + pp_i)*sharding + sh_i)*sep + sep_i)*cp + cp_i)*mp + mp_i

Expert parameters see the sharding axis as ``moe_sharding x ep`` (ep fastest): ``sh_i = moe_i*ep + ep_i``. HSDP
reshapes an fsdp group to ``[outer, inner]`` with ``outer = fsdp_outer_degree``:

* expert: ``moe_i = outer_i*expert_inner + expert_inner_i`` with ``expert_inner = moe_sharding // outer``;
* dense: ``sh_i = outer_i*inner + inner_i`` with ``inner = sharding // outer`` and
  ``inner_i = expert_inner_i*ep + ep_i``.

So the whole grid has eight *atomic* axes, slowest first, ``AXES = (dp, pp, outer, expert_inner, ep, sep, cp, mp)``,
and every kind of group is the set of ranks that differ only along some of them (``KINDS``)::

    sharding      = outer x expert_inner x ep      moe_sharding = outer x expert_inner
    fsdp_inner    = expert_inner x ep              expert_inner = expert_inner
    fsdp_outer    = expert_outer = outer           replicate    = dp x outer x sep x cp (ranks holding the same
                                                                shard: its gradient is summed over them once a step)
    data_parallel = dp x outer x expert_inner x ep (ranks reading different samples)
    expert_data_parallel = dp x outer x expert_inner (ranks holding the same experts, ep index equal)
    context       = sep x cp                       (ranks splitting one sequence: docs/context-parallel.md)
    dense_replicas  = data_parallel x sep x cp     (ranks holding the same dense parameters before sharding)
    expert_replicas = expert_data_parallel x sep x cp
    expert_shard_replicate = dp x sep x cp         (replicas of experts sharded over moe_sharding)

:func:`group_ranks` lists the groups of a kind without any communication; :class:`Topology` creates them all, on every
rank and in one global order, through one ``DeviceMesh``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardfusion import arrival, comm
from shardfusion._runtime.gloo_device import shared_gloo_device

AXES = ("dp", "pp", "outer", "expert_inner", "ep", "sep", "cp", "mp")
"""The atomic axes of the rank grid, slowest first."""

KINDS: dict[str, tuple[str, ...]] = {
    "dp": ("dp",),
    "pp": ("pp",),
    "sharding": ("outer", "expert_inner", "ep"),
    "sep": ("sep",),
    "cp": ("cp",),
    "mp": ("mp",),
    "ep": ("ep",),
    "moe_sharding": ("outer", "expert_inner"),
    "fsdp_inner": ("expert_inner", "ep"),
    "fsdp_outer": ("outer",),
    "expert_inner": ("expert_inner",),
    "expert_outer": ("outer",),
    "replicate": ("dp", "outer", "sep", "cp"),
    "data_parallel": ("dp", "outer", "expert_inner", "ep"),
    "expert_data_parallel": ("dp", "outer", "expert_inner"),
    "context": ("sep", "cp"),
    "stage": ("dp", "outer", "expert_inner", "ep", "sep", "cp", "mp"),
    "dense_replicas": ("dp", "outer", "expert_inner", "ep", "sep", "cp"),
    "expert_replicas": ("dp", "outer", "expert_inner", "sep", "cp"),
    "expert_shard_replicate": ("dp", "sep", "cp"),
    "world": AXES,
}
"""Every kind of group, as the atomic axes its members differ along."""

_DENSE = ("dp", "pp", "sharding", "sep", "cp", "mp")
_DEGREES = (*_DENSE, "ep", "fsdp_outer_degree")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Degrees:
    """The validated degree of every axis; constructing one checks all the rules.

    Raises:
        ValueError: a degree is not an int or is < 1 (``sharding`` may be -1); with ``sharding=-1``, world_size is
            not divisible by the other dense degrees; the dense product != world_size; ``sharding % ep != 0``;
            ``moe_sharding % fsdp_outer_degree != 0``. Every message names all the degrees.
    """

    world_size: int
    """Number of ranks."""
    dp: int = 1
    """Data-parallel replicas (slowest axis). Default 1."""
    pp: int = 1
    """Pipeline stages. Default 1."""
    sharding: int = -1
    """FSDP sharding degree; -1 (default) means the rest: ``world_size // (dp*pp*sep*cp*mp)``."""
    sep: int = 1
    """Segment parallel degree. Default 1."""
    cp: int = 1
    """Context parallel degree. Default 1."""
    mp: int = 1
    """Tensor (model) parallel degree (fastest axis). Default 1."""
    ep: int = 1
    """Expert parallel degree, the fast part of the sharding axis. Default 1."""
    fsdp_outer_degree: int = 1
    """HSDP replication degree of an fsdp group (``outer``); 1 (default) is plain FSDP."""

    def __post_init__(self) -> None:
        for name in ("world_size", *_DEGREES):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}); {self._summary()}")
            object.__setattr__(self, name, int(value))
            if value < 1 and not (name == "sharding" and value == -1):
                hint = " (or -1 for the rest of the world)" if name == "sharding" else ""
                raise ValueError(f"{name}({value}) must be >= 1{hint}; {self._summary()}")
        if self.sharding == -1:
            rest = math.prod(getattr(self, n) for n in _DENSE if n != "sharding")
            if self.world_size % rest:
                factors = " * ".join(f"{n}({getattr(self, n)})" for n in _DENSE if n != "sharding")
                raise ValueError(
                    f"sharding=-1 takes the rest of the world, but world_size({self.world_size}) is not divisible by "
                    f"{factors} = {rest}; change these degrees or the number of ranks"
                )
            object.__setattr__(self, "sharding", self.world_size // rest)
        product = math.prod(getattr(self, n) for n in _DENSE)
        if product != self.world_size:
            factors = " * ".join(f"{n}({getattr(self, n)})" for n in _DENSE)
            raise ValueError(
                f"{factors} = {product} != world_size({self.world_size}); change a degree or pass sharding=-1"
            )
        if self.sharding % self.ep:
            raise ValueError(
                f"sharding({self.sharding}) % ep({self.ep}) = {self.sharding % self.ep} != 0: experts split the "
                f"sharding axis as moe_sharding * ep; {self._summary()}"
            )
        if self.moe_sharding % self.fsdp_outer_degree:
            raise ValueError(
                f"moe_sharding({self.moe_sharding}) = sharding({self.sharding}) // ep({self.ep}), and "
                f"moe_sharding({self.moe_sharding}) % fsdp_outer_degree({self.fsdp_outer_degree}) = "
                f"{self.moe_sharding % self.fsdp_outer_degree} != 0: the outer degree must divide moe_sharding; "
                f"{self._summary()}"
            )

    def _summary(self) -> str:
        return f"world_size({self.world_size}): " + " ".join(f"{n}({getattr(self, n)!r})" for n in _DEGREES)

    @property
    def moe_sharding(self) -> int:
        """Expert fsdp degree: ``sharding // ep``."""
        return self.sharding // self.ep

    @property
    def inner(self) -> int:
        """Dense inner degree: ``sharding // fsdp_outer_degree``."""
        return self.sharding // self.fsdp_outer_degree

    @property
    def expert_inner(self) -> int:
        """Expert inner degree: ``moe_sharding // fsdp_outer_degree``."""
        return self.moe_sharding // self.fsdp_outer_degree

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Degree of each atomic axis, in ``AXES`` order."""
        return {"dp": self.dp, "pp": self.pp, "outer": self.fsdp_outer_degree, "expert_inner": self.expert_inner,
                "ep": self.ep, "sep": self.sep, "cp": self.cp, "mp": self.mp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Index of ``rank`` along each atomic axis, in ``AXES`` order."""
        coords = {}
        for axis, size in reversed(self.axis_sizes.items()):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}


def _kind_axes(kind: str) -> tuple[str, ...]:
    if kind not in KINDS:
        raise ValueError(f"unknown group kind {kind!r}; valid kinds are {sorted(KINDS)}")
    return KINDS[kind]


def _rank_grid(degrees: Degrees, kind: str) -> torch.Tensor:
    """Every group of ``kind`` as a row of an int64 tensor ``(groups, group size)``, each row ascending (the rows
    in no particular order)."""
    members = [AXES.index(a) for a in _kind_axes(kind)]
    others = [i for i in range(len(AXES)) if i not in members]
    sizes = list(degrees.axis_sizes.values())
    grid = torch.arange(degrees.world_size).reshape(sizes).permute(others + members)
    # Member axes stay in slowest-first order, so each row is already ascending.
    return grid.reshape(-1, math.prod(sizes[i] for i in members))


def _ranks_of(degrees: Degrees, kind: str) -> list[list[int]]:
    return sorted(_rank_grid(degrees, kind).tolist())


def group_ranks(world_size: int, kind: str, *, dp: int = 1, pp: int = 1, sharding: int = -1, sep: int = 1,
                cp: int = 1, mp: int = 1, ep: int = 1, fsdp_outer_degree: int = 1) -> list[list[int]]:
    """Every group of ``kind`` as an ascending rank list, the groups ordered by their lowest rank. No communication.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``, or the degrees break a rule (see :class:`Degrees`).
    """
    degrees = Degrees(world_size=world_size, dp=dp, pp=pp, sharding=sharding, sep=sep, cp=cp, mp=mp, ep=ep,
                      fsdp_outer_degree=fsdp_outer_degree)
    return _ranks_of(degrees, kind)


def _group_of(degrees: Degrees, kind: str, rank: int) -> list[int]:
    """The group of ``kind`` that ``rank`` belongs to, as an ascending rank list: its row of :func:`group_ranks`,
    made in time and memory of the group's size, not the world's."""
    members = _kind_axes(kind)
    coords, sizes = degrees.coordinates(rank), degrees.axis_sizes
    strides, stride = {}, 1
    for axis in reversed(AXES):
        strides[axis], stride = stride, stride * sizes[axis]
    ranks = torch.tensor([sum(coords[a] * strides[a] for a in AXES if a not in members)], dtype=torch.int64)
    for axis in (a for a in AXES if a in members):  # slowest first: the rows come out ascending
        ranks = (ranks[:, None] + torch.arange(sizes[axis], dtype=torch.int64) * strides[axis]).reshape(-1)
    return ranks.tolist()


def _inner_kinds_spanning_nodes(degrees: Degrees, local_world_size: int) -> list[str]:
    """The inner kinds (``fsdp_inner``, ``expert_inner``) with a group whose ranks sit on more than one node of
    ``local_world_size`` consecutive ranks. Arithmetic, not a walk over the groups: an inner group of more than one
    rank lies in a block of ``inner x sep x cp x mp`` consecutive ranks (the blocks tile the world, aligned), every
    rank of the block in one of the block's groups; a node boundary inside a block cuts at least one of them, so
    some group spans nodes exactly when the world is more than one node and the block size does not divide
    ``local_world_size``."""
    d = degrees
    cut = d.world_size > local_world_size and local_world_size % (d.inner * d.sep * d.cp * d.mp) != 0
    return [kind for kind, size in (("fsdp_inner", d.inner), ("expert_inner", d.expert_inner)) if cut and size > 1]


def _ranks_per_node(value: object, world_size: int) -> tuple[int, str]:
    """``(ranks per node, where it came from)``: ``value`` (``"ranks_per_node"``), else ``LOCAL_WORLD_SIZE``, else
    the world size (``"one node"``).

    Raises:
        ValueError: ``value`` is not None and not an int >= 1 dividing ``world_size``.
    """
    if value is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and int(local) > 0:
            return min(int(local), world_size), "LOCAL_WORLD_SIZE"
        return world_size, "one node"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or world_size % value:
        raise ValueError(f"ranks_per_node must be an int >= 1 that divides world_size({world_size}): nodes of equal "
                         f"size, got {value!r}")
    return value, "ranks_per_node"


def outer_degree_within_nodes(degrees: Degrees, ranks_per_node: int) -> int | None:
    """The smallest ``fsdp_outer_degree`` (``degrees``' own is ignored) whose inner groups, ``fsdp_inner`` and
    ``expert_inner``, each sit within one node of ``ranks_per_node`` consecutive ranks: HSDP with inner = one node,
    the README's rule. Inner groups of ``inner`` ranks lie in blocks of ``inner x sep x cp x mp`` consecutive ranks,
    which must divide a node (:func:`_inner_kinds_spanning_nodes`), and ``inner = ep x expert_inner`` with
    ``expert_inner`` dividing ``moe_sharding``; so ``expert_inner = gcd(moe_sharding, ranks_per_node / (ep x sep x
    cp x mp))``. With the usual degrees (``dp x pp x ranks_per_node`` divides the world, ``ep x sep x cp x mp``
    divides ``ranks_per_node``) that is ``outer = world / (dp x pp x ranks_per_node)``: an inner group per node.

    Returns:
        The degree; 1 when the world fits in one node; None when no degree keeps them within a node: ``ep x sep x
        cp x mp`` does not divide ``ranks_per_node``, so even the smallest inner groups cross nodes.
    """
    d = degrees
    if d.world_size <= ranks_per_node:
        return 1
    block = d.ep * d.sep * d.cp * d.mp
    if ranks_per_node % block:
        return None
    return d.moe_sharding // math.gcd(d.moe_sharding, ranks_per_node // block)


def _duration(name: str, value: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """``value`` (a ``timedelta``, seconds, or None) as a ``timedelta`` or None.

    Raises:
        ValueError: ``value`` is of another type, or not positive (the message names ``name``).
    """
    if value is not None and not isinstance(value, datetime.timedelta):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a datetime.timedelta or seconds, got {value!r}")
        value = datetime.timedelta(seconds=float(value))
    if value is not None and not value.total_seconds() > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _backend_override(backend: str, timeout: datetime.timedelta | None) -> str | tuple[str, object]:
    # Always name the backend: with no override DeviceMesh reuses the default group for world-sized axes, which
    # would make a reduce twin the very same object as its all-gather group.
    if timeout is None:
        return backend
    opts = dist.ProcessGroupNCCL.Options() if "nccl" in backend else dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    return backend, opts


class Topology:
    """The rank grid of this job and one process group of every kind, created on every rank in one global order.

    ``Topology(*, dp=1, pp=1, sharding=-1, sep=1, cp=1, mp=1, ep=1, fsdp_outer_degree=1, timeout=None,
    arrival_timeout=None, ranks_per_node=None)``, keywords only: degrees as in :class:`Degrees` (``sharding=-1`` takes
    the rest of the world); ``timeout`` (a ``timedelta`` or seconds) applies to every group it creates; a collective
    that times out raises an error naming it and the likely cause (``comm.timeout_error``); the default group keeps its
    own timeout. ``arrival_timeout`` (seconds, or a ``timedelta``; default: ``SHARDFUSION_ARRIVAL_TIMEOUT``, else 60 s)
    bounds the arrival check that starts each rare collective call of a model sharded with it (``model.state_dict()``, a
    checkpoint, a forward in a new mode, ...), whose error names the call and the ranks that did not make it ([Note:
    arrival checks] in ``arrival.py``). ``ranks_per_node`` says where the node boundaries are (nodes of that many
    consecutive ranks; default ``LOCAL_WORLD_SIZE``, else the whole world is one node), so that one machine can declare
    several nodes (a test of a sharding group spanning nodes, ZeRO++'s layout): the inner kinds with a group across
    nodes are ``spanning_groups`` and named by :meth:`describe_nodes`. Groups of size 1 are real groups too. Kinds whose
    ranks coincide for these degrees (e.g. ``sharding`` and ``moe_sharding`` when ep is 1) share one group object.

    Raises:
        ValueError: ``torch.distributed`` is not initialized, ``timeout`` or ``arrival_timeout`` is not positive,
            ``SHARDFUSION_ARRIVAL_TIMEOUT`` is not a positive number, ``ranks_per_node`` is not an int >= 1 that
            divides the world size, or the degrees break a rule of :class:`Degrees`.
    """

    def __init__(self, *, dp: int = 1, pp: int = 1, sharding: int = -1, sep: int = 1, cp: int = 1, mp: int = 1,
                 ep: int = 1, fsdp_outer_degree: int = 1,
                 timeout: datetime.timedelta | float | None = None,
                 arrival_timeout: datetime.timedelta | float | None = None,
                 ranks_per_node: int | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("Topology needs torch.distributed: call torch.distributed.init_process_group() first "
                             "(or run under torchrun)")
        timeout = _duration("timeout", timeout)
        arrival_s = _duration("arrival_timeout", arrival_timeout)
        self.arrival_timeout = None if arrival_s is None else arrival_s.total_seconds()
        """Seconds of the arrival deadline (None: ``SHARDFUSION_ARRIVAL_TIMEOUT``, else 60; ``arrival.deadline``)."""
        arrival.deadline(self)  # a bad SHARDFUSION_ARRIVAL_TIMEOUT is refused here, on every rank
        self.degrees = Degrees(world_size=dist.get_world_size(), dp=dp, pp=pp, sharding=sharding, sep=sep, cp=cp,
                               mp=mp, ep=ep, fsdp_outer_degree=fsdp_outer_degree)
        d = self.degrees
        self.ranks_per_node, rpn_from = _ranks_per_node(ranks_per_node, d.world_size)
        """Ranks per node (consecutive global ranks share a node): the argument, ``LOCAL_WORLD_SIZE``, or the
        world size (one node)."""
        self.spanning_groups: list[str] = [k for k in _inner_kinds_spanning_nodes(d, self.ranks_per_node)
                                           if k == "fsdp_inner" or d.ep > 1]
        """The inner kinds (``fsdp_inner``, ``expert_inner``; the latter only when ep > 1, else its groups are the
        former's) with a group whose ranks sit on more than one node: their all-gathers and reduce-scatters cross
        the network."""
        self.timeout = timeout
        self.world_size, self.rank = d.world_size, dist.get_rank()
        self.dp, self.pp, self.sharding, self.sep, self.cp, self.mp = d.dp, d.pp, d.sharding, d.sep, d.cp, d.mp
        self.ep, self.moe_sharding, self.fsdp_outer_degree = d.ep, d.moe_sharding, d.fsdp_outer_degree
        self.inner, self.expert_inner = d.inner, d.expert_inner

        c = d.coordinates(self.rank)
        self.dp_rank, self.pp_rank, self.sep_rank, self.cp_rank, self.mp_rank = (
            c["dp"], c["pp"], c["sep"], c["cp"], c["mp"])
        self.ep_rank, self.outer_rank, self.expert_inner_rank = c["ep"], c["outer"], c["expert_inner"]
        self.inner_rank = c["expert_inner"] * d.ep + c["ep"]
        self.moe_sharding_rank = c["outer"] * d.expert_inner + c["expert_inner"]
        self.sharding_rank = self.moe_sharding_rank * d.ep + c["ep"]
        self.replicate_rank = ((c["dp"] * d.fsdp_outer_degree + c["outer"]) * d.sep + c["sep"]) * d.cp + c["cp"]
        self.context_rank = c["sep"] * d.cp + c["cp"]
        self.data_parallel_rank = c["dp"] * d.sharding + self.sharding_rank

        backend = str(dist.get_backend())
        self._override = _backend_override(backend, timeout)
        # On torch's fake backend (a dry run: one process plays one rank) only this rank's groups are made, each in
        # the time of its size (_group_of); the mesh would create every group of the world, one new_group call each
        # (O(world) per axis), and is built on first use (`mesh`, `get_mesh`) with groups of its own.
        self._fake = backend == "fake"
        with shared_gloo_device():  # one loop thread for these groups: [Note: one gloo device for many groups]
            self._mesh = None if self._fake else self._make_mesh()
            self._kinds_of: dict[dist.ProcessGroup, list[str]] = {}  # the kinds each created group serves (accounting)
            by_axes: dict[tuple[str, ...], dist.ProcessGroup] = {}
            self._groups = {kind: self._make_group(kind, by_axes) for kind in KINDS
                            if kind not in ("world", "ep", "replicate")}
            # The replicate all-reduces may be issued while backward all-gathers run (overlap, set_is_last_backward), at
            # moments that depend on timing: a group of their own keeps them from interleaving with the all-gathers of a
            # kind over the same ranks (e.g. moe_sharding when expert_inner is 1).
            replicate_size = self.degrees.dp * self.degrees.fsdp_outer_degree * self.degrees.sep * self.degrees.cp
            self._groups["replicate"] = self._make_group("replicate", by_axes if replicate_size == 1 else {},
                                                         twin=replicate_size > 1, name="replicate")
            # The MoE all-to-alls get a group of their own, never shared with the all-gathers of an inner group over the
            # same ranks, so the two streams of collectives cannot interleave differently on different ranks.
            self._groups["ep"] = self._make_group("ep", {}, twin=d.ep > 1, name="ep_dispatch")
            twins: dict[tuple[str, ...], dist.ProcessGroup] = {}
            self._reduce_groups = {kind: self._make_group(kind, twins, twin=True)
                                   for kind in ("fsdp_inner", "expert_inner", "moe_sharding")}
            # Name every group for communication accounting (accounting.py): a group shared by several kinds gets them
            # all; the twins are "<kind>_reduce" and the all-to-all group "ep".
            for group, kinds in self._kinds_of.items():
                comm.label_group(group, kinds)
                comm.mark_within_node(group, self.ranks_per_node)  # how its all-gathers run on gloo (comm.py)
            comm.label_group(dist.group.WORLD, "world")
            self.stage_ranks = _group_of(d, "stage", self.rank)
            """The global ranks of this rank's pipeline stage (the same pp index; the world when pp is 1), ascending:
            those that make a sharded model's collective calls together (the arrival checks of ``arrival.py``)."""
            # The first and the last rank of each pp group: the two pipeline ends, which hold a weight tied across
            # stages (embedding and head; shardfusion.pipeline). Created on every rank, in one order, when pp > 1.
            self._pipeline_ends = None
            if d.pp > 1 and self._fake:
                ends = _group_of(d, "pp", self.rank)[::d.pp - 1]
                self._pipeline_ends = dist.new_group(ends, timeout=timeout) if self.rank in ends else None
            elif d.pp > 1:
                self._pipeline_ends, _ = dist.new_subgroups_by_enumeration(
                    [[g[0], g[-1]] for g in _ranks_of(d, "pp")], timeout=timeout)
            if self._pipeline_ends is not None:  # None on the ranks of a middle pp index
                comm.label_group(self._pipeline_ends, "pipeline_ends")
        self.forward_mode_checks = 0
        """How many forward-mode agreements this rank has joined (``check_forward_mode``; one arrival check each,
        through the store: no collective)."""

        if self.spanning_groups and rpn_from == "LOCAL_WORLD_SIZE":  # declared on purpose: no warning
            warnings.warn(f"{' and '.join(self.spanning_groups)} groups span nodes (LOCAL_WORLD_SIZE="
                          f"{self.ranks_per_node}, {self.describe()}): their all-gathers and reduce-scatters cross "
                          f"the network; raise fsdp_outer_degree so that inner fits in a node", stacklevel=2)

    def _make_group(self, kind: str, cache: dict, twin: bool = False, name: str | None = None) -> dist.ProcessGroup:
        """One group of ``kind`` for this rank, shared through ``cache`` by kinds over the same non-trivial axes.

        A ``twin`` is always a new group (``_flatten`` under a new name, ``name`` or ``{kind}_reduce``, creates one,
        even over a single axis); otherwise a single non-trivial axis reuses the mesh's own group. The group's
        accounting label gets ``kind`` (``{kind}_reduce`` for a reduce twin).
        """
        axes = KINDS[kind]
        key = tuple(a for a in axes if self.degrees.axis_sizes[a] > 1)
        if key not in cache:
            if self._fake:  # this rank's group only (see __init__)
                cache[key] = dist.new_group(_group_of(self.degrees, kind, self.rank), timeout=self.timeout)
            elif not twin and len(key) <= 1:
                cache[key] = self._mesh.get_group((key or axes)[0])
            else:
                submesh = self._mesh[key or axes[:1]]
                flat_name = (name or f"{kind}_reduce") if twin else kind
                cache[key] = submesh._flatten(flat_name, backend_override=self._override).get_group()
        label = f"{kind}_reduce" if twin and name is None else kind
        self._kinds_of.setdefault(cache[key], []).append(label)
        return cache[key]

    def check_forward_mode(self, training: bool, grad_enabled: bool) -> None:
        """Agree over the ranks of this rank's pipeline stage (:attr:`stage_ranks`: the world when pp is 1; stages
        run their forwards at different times) on the mode of the forward about to start (``module.training``, grad
        mode): a sharded model calls it at a forward whose mode differs from its previous forward's (and at its
        first), so an evaluation run on some ranks only (under ``if rank == 0:``) stops here, naming the ranks that
        did not come, instead of consuming the all-gathers of the other ranks' training forward (which pair up
        silently, then mismatch and crash the backend). One arrival check through the store, no collective
        ([Note: arrival checks] in ``arrival.py``), with the mode as its payload.

        Raises:
            ValueError: on every rank, the ranks started forwards of different modes (each mode named with its ranks).
            RuntimeError: within the arrival deadline, on the ranks that came: some rank did not start a forward in
                a new mode at the same time (``arrival.check``: the error names the ranks).
        """
        mode = f"{'train' if training else 'eval'} mode, grad {'enabled' if grad_enabled else 'disabled'}"
        if len(self.stage_ranks) > 1 and not comm.is_fake():
            self.forward_mode_checks += 1
        # a new mode: the first forward, or one after model.train() / model.eval() or a change of grad mode
        modes = arrival.check("a forward in a new mode", self.stage_ranks, arrival.deadline(self), mode)
        if modes is not None:
            raise ValueError(f"the ranks started forwards of different modes ({modes}): every rank must run the same "
                             "forwards, evaluation included (not under `if rank == 0:`); evaluate on every rank and "
                             "reduce the result, or evaluate a plain copy from sf.full_state_dict on one rank")

    def _make_mesh(self) -> DeviceMesh:
        backend = str(dist.get_backend())
        return init_device_mesh("cuda" if "nccl" in backend else "cpu", tuple(self.degrees.axis_sizes.values()),
                                mesh_dim_names=AXES, backend_override={a: self._override for a in AXES})

    @property
    def mesh(self) -> DeviceMesh:
        """The ``DeviceMesh`` over the atomic axes ``AXES`` (slowest first). On a fake group (a dry run) it is made
        on first use, with groups of its own (``get_group`` returns this rank's groups, made without it)."""
        if self._mesh is None:
            self._mesh = self._make_mesh()
        return self._mesh

    def get_mesh(self, kind: str) -> DeviceMesh:
        """The one-dimensional ``DeviceMesh`` of the group of ``kind`` that this rank belongs to, for torch's DTensor
        APIs, e.g. tensor parallel over the mp axis (docs/tensor-parallel.md)::

            parallelize_module(block, topo.get_mesh("mp"), {"attn.q": ColwiseParallel(), ...})

        A kind over one atomic axis (``dp``, ``pp``, ``sep``, ``cp``, ``mp``, ``ep``'s axis, ...) is that dimension
        of :attr:`mesh`, whose process group is the one :meth:`get_group` returns for it (``ep`` excepted: its
        all-to-alls have a group of their own). A kind over several axes is their flattened mesh, created on the
        first call: that first call is collective (every rank must make it, in the same order), later calls return
        the same object.

        Raises:
            ValueError: unknown ``kind``, or ``"world"`` (use :attr:`mesh`).
        """
        axes = _kind_axes(kind)
        if kind == "world":
            raise ValueError("get_mesh('world'): the world is every axis; use Topology.mesh")
        if len(axes) == 1:
            return self.mesh[axes[0]]
        cache = self.__dict__.setdefault("_flat_meshes", {})
        if kind not in cache:
            with shared_gloo_device():
                cache[kind] = self.mesh[axes]._flatten(f"{kind}_mesh", backend_override=self._override)
        return cache[kind]

    def group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` for this topology, as in :func:`group_ranks`.

        Raises:
            ValueError: unknown ``kind``.
        """
        return _ranks_of(self.degrees, kind)

    def get_group(self, kind: str) -> dist.ProcessGroup:
        """The group of ``kind`` (any of ``KINDS``) that this rank belongs to; ``"world"`` is the default group.

        Raises:
            ValueError: unknown ``kind``.
        """
        _kind_axes(kind)
        return dist.group.WORLD if kind == "world" else self._groups[kind]

    def get_pipeline_ends_group(self) -> dist.ProcessGroup:
        """The two ranks of this rank's pp group at its ends (pp index 0 and pp - 1, the other coordinates this
        rank's): the ranks of the first and the last pipeline stage, which sum the gradients of a weight tied across
        them (``shardfusion.pipeline``).

        Raises:
            ValueError: ``pp`` is 1 (no pipeline), or this rank's pp index is neither 0 nor pp - 1.
        """
        if self.pp == 1:
            raise ValueError("get_pipeline_ends_group: pp is 1, there are no pipeline stages")
        if self._pipeline_ends is None:
            raise ValueError(f"get_pipeline_ends_group: this rank's pp index {self.pp_rank} is not an end of the "
                             f"pipeline (0 or {self.pp - 1})")
        return self._pipeline_ends

    def get_fsdp_group(self, is_expert: bool = False) -> dist.ProcessGroup:
        """The group a parameter is sharded over: ``sharding``, or ``moe_sharding`` for experts (the same object when
        ep is 1)."""
        return self._groups["moe_sharding" if is_expert else "sharding"]

    def get_fsdp_inner_group(self, is_expert: bool = False) -> dist.ProcessGroup:
        """The inner group (all-gathers): ``fsdp_inner``, or ``expert_inner`` for experts."""
        return self._groups["expert_inner" if is_expert else "fsdp_inner"]

    def get_fsdp_inner_reduce_group(self, is_expert: bool = False) -> dist.ProcessGroup:
        """A second group over the ranks of :meth:`get_fsdp_inner_group`, for reduce-scatters, so their order is
        independent of the all-gathers'; never the same object as the all-gather group."""
        return self._reduce_groups["expert_inner" if is_expert else "fsdp_inner"]

    def get_reduce_group(self, kind: str) -> dist.ProcessGroup:
        """The reduce-scatter twin of the group of ``kind``: ``"fsdp_inner"``, ``"expert_inner"`` or
        ``"moe_sharding"`` (experts sharded over the whole moe_sharding group, ``expert_policy="shard"``).

        Raises:
            ValueError: another ``kind``.
        """
        if kind not in self._reduce_groups:
            raise ValueError(f"no reduce-scatter group for kind {kind!r}; valid kinds are {sorted(self._reduce_groups)}")
        return self._reduce_groups[kind]

    def get_expert_data_parallel_group(self) -> dist.ProcessGroup:
        """Ranks holding the same experts (``dp x moe_sharding``: every rank with this rank's ep index); expert
        parameters are broadcast over it at wrap time, as dense ones are over the data-parallel group."""
        return self._groups["expert_data_parallel"]

    def get_fsdp_outer_group(self, is_expert: bool = False) -> dist.ProcessGroup:
        """The outer group; dense and expert parameters get the same object."""
        return self._groups["expert_outer" if is_expert else "fsdp_outer"]

    def get_replicate_group(self) -> dist.ProcessGroup:
        """Ranks holding the same shard (``dp x outer``); gradients are all-reduced over it once per step. A process
        group of its own (when larger than one rank): nothing else is issued on it."""
        return self._groups["replicate"]

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        """Ranks reading different samples (``dp x sharding``)."""
        return self._groups["data_parallel"]

    def get_param_replica_group(self, is_expert: bool = False) -> dist.ProcessGroup:
        """Ranks holding the same parameters before sharding: the data-parallel ranks and, with context parallel,
        the ``sep x cp`` ranks that split their sequences (``dense_replicas``; for experts ``expert_replicas``, the
        ranks with this rank's ep index). Initial values and module buffers are broadcast over it; a parameter kept
        whole has its gradient all-reduced over it. The data-parallel group itself when sep and cp are 1."""
        return self._groups["expert_replicas" if is_expert else "dense_replicas"]

    @property
    def gradient_divisor(self) -> int:
        """What each rank's gradient is divided by so that the sum over ranks is the gradient of the mean loss:
        the ranks that compute a loss over different tokens, ``dp * sharding * sep * cp`` (each rank's loss is the
        mean over its own tokens; sep x cp ranks hold equal parts of each sequence)."""
        return self.dp * self.sharding * self.sep * self.cp

    def describe(self) -> str:
        """One line, e.g. ``world 4 = dp1 x pp1 x sharding4 (outer2 x inner2) x sep1 x cp1 x mp1; ep1``."""
        text = (f"world {self.world_size} = dp{self.dp} x pp{self.pp} x sharding{self.sharding} "
                f"(outer{self.fsdp_outer_degree} x inner{self.inner}) x sep{self.sep} x cp{self.cp} x mp{self.mp}; "
                f"ep{self.ep}")
        if self.ep > 1:
            text += (f" (moe_sharding{self.moe_sharding} = outer{self.fsdp_outer_degree} "
                     f"x expert_inner{self.expert_inner})")
        return text

    def describe_nodes(self) -> str:
        """One line on the nodes, e.g. ``2 nodes x 2 ranks; fsdp_inner groups span nodes (inner 4)`` or
        ``1 node x 4 ranks``."""
        nodes = self.world_size // self.ranks_per_node
        text = f"{nodes} node{'s' * (nodes != 1)} x {self.ranks_per_node} ranks"
        if self.spanning_groups:
            sizes = {"fsdp_inner": self.inner, "expert_inner": self.expert_inner}
            text += "; " + ", ".join(f"{k} groups span nodes ({k.removesuffix('_inner')} inner {sizes[k]})"
                                     for k in self.spanning_groups)
        return text

    def __repr__(self) -> str:
        return f"Topology(rank {self.rank}: {self.describe()})"
