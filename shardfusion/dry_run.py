"""A dry run of one training step at cluster scale, in one process: memory and collectives of the ranks it plays.

[Note: dry run]
:func:`dry_run` plays one rank of a world of ``world_size`` ranks at a time. It joins torch's fake process group
(``init_process_group("fake", rank=r, world_size=W)``: every collective returns at once and moves nothing), builds
the :class:`~shardfusion.Topology` with every group a real run would make, builds the model on the meta device and
shards it with :func:`~shardfusion.fully_shard` under ``FakeTensorMode`` (each tensor has a shape, a dtype and a
device, and no storage), then runs the step the caller describes (``micro_batches`` forwards and backwards, the
clipping, ``optimizer.step()``) through the library's own code: the same units, flat buffers, hooks, prefetches and
collectives as on the cluster. While it runs:

- :class:`~shardfusion.comm.CommCounter` records every collective (op, group, bytes; bytes across nodes with
  ``ranks_per_node`` consecutive ranks per node, [Note: communication accounting]);
- :class:`~shardfusion.live_memory.LiveMemory` adds up the live tensor bytes after every op, by part: parameters,
  gradients, optimizer state, the units' full parameter and gradient buffers, and the rest (activations and
  temporaries) ([Note: live tensor bytes]).

The ranks it plays are one per *kind*: ranks whose figures can differ. These are the pipeline stages (each holds
other layers); within a stage every rank holds the same number of elements (shards are equal, expert-parallel ranks
hold ``E / ep`` experts each) and sends the same bytes (the accounting shares a ring's bytes equally over its
ranks), so a stage's first rank stands for all of it.

What a dry run cannot know, and assumes: an even MoE router (each expert gets ``1/E`` of the assignments:
``moe._even_routing``; a real router's imbalance moves the all-to-all bytes and the expert activations), and no
data-dependent control flow (agreement checks that read other ranks' values are skipped: ``comm.is_fake``). The
step time is not simulated: it is the cost model's (:func:`shardfusion.plan`) on the bandwidths given.

The fake process group and fake tensors are torch's (``torch.distributed`` fake backend,
``torch._subclasses.FakeTensorMode``); using them to size a job before booking it is the idea of torchtitan's and
FSDP2's memory estimators. The figures, the kinds and the report are ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import resource
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardfusion import accounting, checkpoint, comm
from shardfusion.clip import clip_grad_norm_
from shardfusion.fully_shard import fully_shard as fully_shard_model
from shardfusion.fully_shard import get_units, reshard_choice, set_is_last_backward
from shardfusion.live_memory import LiveMemory, model_storages
from shardfusion.plan import _size
from shardfusion.plan import plan as plan_outer
from shardfusion.plan import unit_sizes
from shardfusion.probe import Bandwidth, _check_int, check_bandwidth
from shardfusion.dry_run_report import _layout_notes, _peak_line, _verdict, link_terms
from shardfusion.topology import Degrees, Topology

__all__ = ["DEFAULT_BANDWIDTH", "DryRun", "RankFigures", "check_world_fits", "dry_run", "kinds_of", "link_terms",
           "measure_step"]

DEFAULT_BANDWIDTH = Bandwidth(within=150e9, across=25e9, latency_within=5e-6, latency_across=15e-6)
"""Links assumed when none are given: 150 GB/s per rank inside a node (NVLink class), 25 GB/s per rank across nodes
(one 200 Gbit/s NIC per GPU), 5 and 15 us per ring step. Measure yours with :func:`shardfusion.measure_bandwidth`."""

BOOKKEEPING_BYTES_PER_RANK = 2048
"""Memory a dry run needs per rank of the world it plays, whatever the model: torch's fake process group and the
played rank's world-sized groups keep a dict entry and an int per member rank, the communication records a tuple
of them, and the cost model lays every group of a kind out as int64 tensors. Measured: the job's dry run of the tiny
preset grows by 591 bytes of peak RSS per rank from 65,536 to 2,097,152 ranks (0.87 GiB at 1,048,576;
benchmarks/results/dry-run-scale-tiny.md); this bound keeps a margin of about 3.5 x for layouts with more
world-sized groups."""


def _available_memory() -> int:
    """Bytes this machine can still give: MemAvailable in /proc/meminfo (Linux), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_world_fits(world_size: int) -> None:
    """Refuse, before anything is allocated, a world whose bookkeeping in a dry run (``world_size x``
    :data:`BOOKKEEPING_BYTES_PER_RANK`) is more than this machine's available memory (a world of 10^9 ranks needs
    2 TB: it would be killed for memory).

    Raises:
        ValueError: naming the world size, the bytes it needs, the bytes available and the largest world that fits.
    """
    need, available = world_size * BOOKKEEPING_BYTES_PER_RANK, _available_memory()
    if need > available:
        raise ValueError(f"world_size({world_size:,}) is more than this machine can play: a dry run keeps about "
                         f"{BOOKKEEPING_BYTES_PER_RANK} bytes per rank of the world (its process groups' rank lists), "
                         f"{_size(need)} here, and {_size(available)} is available; at most about "
                         f"{available // BOOKKEEPING_BYTES_PER_RANK:,} ranks fit")


Build = Callable[["object"], nn.Module]
Step = Callable[[nn.Module, "object"], torch.Tensor]


@dataclass
class RankFigures:
    """What one played rank holds and sends in one optimizer step. Bytes everywhere.

    Attributes:
        rank: the global rank played; ``coordinates``: its index on every mesh axis (``pp``, ``ep``, ...).
        kind: how the report names it (e.g. ``"pp stage 1"``, ``"all ranks"``).
        memory: after the step, before ``zero_grad``: ``params`` (this rank's shards), ``grads`` (sharded
            gradients), ``optimizer`` (state), and the step's peaks: ``full_params`` / ``full_grads`` (largest total
            of gathered parameter / full gradient buffers alive at once), ``activations`` (live bytes outside the
            parameters, gradients, optimizer state and full buffers that the forward made and kept: what backward
            keeps; for a step that runs its own backwards, a pipeline schedule's, the peak of its activations and
            temporaries), ``other_peak`` (largest live bytes outside
            the parameters, gradients, optimizer state and full buffers: activations and temporaries), ``peak`` (the
            largest live total), ``transient`` (the largest live bytes outside the parameters, gradients and
            optimizer state: what a step needs beyond what it keeps, so a later step, which holds the optimizer
            state from its start, peaks at ``params + grads + optimizer + transient``; :attr:`transient_peak` says
            what it is made of), ``largest_full_unit``
            (the largest unit's gathered parameters). These with every collective complete as soon as issued
            (communication keeps up); with ``dry_run(bounds=True)`` also ``full_grads_slow``, ``other_peak_slow``,
            ``peak_slow``, ``transient_slow``: with none complete before it is waited for. A sharded model frees
            its buffers at points fixed by the program ([Note: gradient reductions in flight] in
            ``shardfusion/_runtime/scheduler.py``), so the two ends agree and a real run measures the same figures;
            they differ only where a step's own code frees on a collective's completion.
        collectives: one row per (op, group label, group size): ``count``, ``bytes`` (logical), ``wire_bytes`` (sent
            by this rank), ``within_bytes`` / ``across_bytes`` (of the wire bytes, to the same node / other nodes).
        categories: :meth:`CommCounter.summary` (per accounting category).
        seconds: time of the dry run of this rank: ``topology``, ``wrap``, ``step`` (and ``step_slow``).
    """

    rank: int
    coordinates: dict
    kind: str
    memory: dict
    collectives: list
    categories: dict
    seconds: dict
    peak_parts: dict = field(default_factory=dict)
    """The live bytes at ``memory["peak"]`` by part (``shardfusion.live_memory.PARTS``: ``params``, ``grads``,
    ``optimizer``, ``full_params``, ``full_grads``, ``activations``, ``comm_buffers``, ``optimizer_step``,
    ``other``); with ``bounds`` also those of ``peak_slow``, under the key ``"slow"``."""
    reshard: list = field(default_factory=list)
    """Under ``reshard_policy="auto"``: per sharded model of the rank (a pipeline rank's stages), the choice's record
    (``ReshardChoice.as_dict()``: the units kept gathered, the budget, the estimate); empty otherwise."""
    transient_peak: dict = field(default_factory=dict)
    """At the moment of ``memory["transient"]``: ``parts`` (bytes by part, as :attr:`peak_parts`) and ``units`` (per
    part ``full_params`` / ``full_grads``, the bytes of each unit then alive: ``{part: {unit name: bytes}}``, the
    root unit ``""``)."""

    def reshard_verdict(self) -> list[str]:
        """Under ``reshard_policy="auto"``: the choice, then its budget's verdict on this rank's measured step: the
        bytes the budget counts (``params + grads + optimizer`` after the step, plus the peaks of ``full_params``
        and ``full_grads``: each part at its own peak, so at least their largest sum at once) against the budget
        and against the choice's estimate; with ``bounds``, also at the slow end (``full_grads_slow``: every full
        gradient buffer alive until its reduce-scatter is waited for, which the estimate's two do not bound).
        Empty under another policy."""
        if not self.reshard:
            return []
        m = self.memory
        measured = m["params"] + m["grads"] + m["optimizer"] + m["full_params"] + m["full_grads"]
        slow = measured - m["full_grads"] + m["full_grads_slow"] if "full_grads_slow" in m else None
        def judge(need: int, budget: int) -> str:
            return (f"fits, {_size(budget - need)} headroom" if need <= budget else
                    f"does not fit by {_size(need - budget)}")

        lines = []
        for choice in self.reshard:
            budget, estimate = choice["budget"], choice["memory_bytes"]
            lines.append(f"reshard policy auto: {len(choice['kept'])} of {sum(choice['decided'])} units kept gathered "
                         f"({', '.join(choice['kept']) or 'none'}); budget {_size(budget)} without activations: "
                         f"estimate {_size(estimate)} ({judge(estimate, budget)}), measured {_size(measured)} "
                         f"(params + grads + optimizer + peak full params + peak full grads): "
                         f"{judge(measured, budget)}" + ("" if slow is None else
                                                         f" (slow end {_size(slow)}: {judge(slow, budget)})"))
        return lines

    def budget(self, max_memory_per_rank: int) -> dict:
        """This rank against a memory budget (bytes): ``fits`` (its ``peak`` does), ``headroom`` (budget - peak:
        negative when short), with ``bounds`` ``fits_slow`` / ``headroom_slow`` (the ``peak_slow`` end), and
        ``largest``: the parts of the peak, largest first, as ``(part, bytes)``."""
        m, out = self.memory, {"budget": max_memory_per_rank}
        for end in ("", "_slow"):
            if "peak" + end in m:
                out["fits" + end] = m["peak" + end] <= max_memory_per_rank
                out["headroom" + end] = max_memory_per_rank - m["peak" + end]
        parts = {k: v for k, v in self.peak_parts.items() if k != "slow"}
        out["largest"] = sorted(parts.items(), key=lambda kv: -kv[1])
        return out

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends per step, all collectives and P2P sends together."""
        return sum(c["wire_bytes"] for c in self.collectives)

    @property
    def across_bytes(self) -> float:
        """Of :attr:`wire_bytes`, the bytes sent to ranks on other nodes."""
        return sum(c["across_bytes"] for c in self.collectives)


@dataclass
class DryRun:
    """The result of :func:`dry_run`.

    Attributes:
        world_size, ranks_per_node: the cluster played.
        layout: ``Topology.describe()`` of the layout.
        ranks: one :class:`RankFigures` per kind of rank played.
        plan: the cost model's :class:`~shardfusion.plan.Candidate` for this layout's outer degree (``step_s``: the
            predicted communication time of a step), or ``None`` when the model could not be planned (``plan_error``).
        bandwidth: the links the prediction used.
        seconds: wall time of the whole dry run; ``max_rss_bytes``: this process's peak resident memory.
        plan_error: why ``plan`` is None; notes: what the figures assume, and layout warnings (inner groups that
            span nodes); max_memory_per_rank: the budget each kind of rank is judged against (bytes; None: none).
    """

    world_size: int
    ranks_per_node: int
    layout: str
    ranks: list
    plan: object
    bandwidth: Bandwidth
    seconds: float
    max_rss_bytes: int
    plan_error: str = ""
    notes: list = field(default_factory=list)
    max_memory_per_rank: Optional[int] = None

    def table(self) -> str:
        """The report as text: per kind of rank, memory by part, collectives with bytes within and across nodes,
        then the predicted step time."""
        nodes = self.world_size // self.ranks_per_node
        out = [f"dry run: world {self.world_size} = {nodes} node{'s' if nodes > 1 else ''} x {self.ranks_per_node} "
               f"ranks; {self.layout}"]
        for r in self.ranks:
            m = r.memory
            out.append(f"rank {r.rank} ({r.kind}; " + ", ".join(f"{k} {v}" for k, v in r.coordinates.items()
                                                                 if k != "world_size") + ")")
            out.append("  memory: " + ", ".join(
                f"{k} {_size(m[k])}" + (f" (slow: {_size(m[k + '_slow'])})" if k + "_slow" in m else "")
                for k in ("params", "grads", "optimizer", "full_params", "full_grads", "secondary_params",
                          "activations", "other_peak", "peak") if k != "secondary_params" or m.get(k)))
            persistent = m["params"] + m["grads"] + m["optimizer"]
            out.append(f"  persistent (params + grads + optimizer) {_size(persistent)}; largest unit gathered "
                       f"{_size(m['largest_full_unit'])}")
            out.append("  " + _peak_line(r))
            if "staging" in m:
                out.append(f"  async save: staging copy {_size(m['staging'])} of host memory per rank (pinned on "
                           f"CUDA), {_size(m['staging'] * self.ranks_per_node)} for a node of {self.ranks_per_node} "
                           f"such ranks, held from the first save on (each save reuses it); not in the peak above")
            out.append(f"  {'collective':<15} {'group':<44} {'size':>6} {'count':>6} {'MB':>11} {'within MB':>11} "
                       f"{'across MB':>11}")
            for c in r.collectives:
                out.append(f"  {c['op']:<15} {c['label'][:44]:<44} {c['group_size']:>6} {c['count']:>6} "
                           f"{c['bytes'] / 1e6:>11.3f} {c['within_bytes'] / 1e6:>11.3f} "
                           f"{c['across_bytes'] / 1e6:>11.3f}")
            out.append(f"  per step: {r.wire_bytes / 1e6:.3f} MB sent, {r.across_bytes / 1e6:.3f} MB across nodes")
            if self.max_memory_per_rank is not None:
                out.append("  " + _verdict(r.budget(self.max_memory_per_rank)))
            out += [f"  {line}" for line in r.reshard_verdict()]
        if self.plan is not None:
            p = self.plan
            out.append(f"cost model ({self.bandwidth.describe()}): outer {p.outer} inner {p.inner}: within "
                       f"{p.within_bytes / 1e6:.3f} MB ({p.within_s * 1e3:.3f} ms), across {p.across_bytes / 1e6:.3f} "
                       f"MB ({p.across_s * 1e3:.3f} ms); predicted step {p.step_s * 1e3:.3f} ms of communication "
                       f"(serial {p.serial_s * 1e3:.3f} ms; compute not modelled)")
            out += [f"  {line}" for line in link_terms(p, self.bandwidth)]
        elif self.plan_error:
            out.append(f"cost model: not run ({self.plan_error})")
        out += [f"note: {n}" for n in self.notes]
        out.append(f"dry run itself: {self.seconds:.1f} s, peak RSS {_size(self.max_rss_bytes)}")
        return "\n".join(out)


def _check_keywords(name: str, kwargs: dict, fn) -> None:
    """Every key of ``kwargs`` is a keyword parameter of ``fn``, else ValueError naming ``name`` and the key."""
    import inspect

    accepted = set(inspect.signature(fn).parameters) - {"self", "model", "topology"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"{name}: unknown keyword(s) {unknown}; {name} takes {sorted(accepted)}")


def kinds_of(degrees: Degrees) -> list[tuple[int, str]]:
    """``(rank, kind)`` of the ranks a dry run plays: the first rank of each pipeline stage."""
    if degrees.pp == 1:
        return [(0, "all ranks")]
    stage = degrees.world_size // (degrees.dp * degrees.pp)  # ranks per pp index and dp index: pp is the 2nd axis
    return [(s * stage, f"pp stage {s}") for s in range(degrees.pp)]


def dry_run(build: Build, step: Step, *, world_size: int, ranks_per_node: int, topology: Optional[dict] = None,
            fully_shard: Optional[dict] = None, optimizer: Callable = None, micro_batches: int = 1,
            max_norm: Optional[float] = 1.0, ranks: Optional[Sequence[int]] = None, backend: str = "nccl",
            bandwidth: Optional[Bandwidth] = None, plan_model: bool = True, bounds: bool = True,
            step_runs_backward: bool = False, max_memory_per_rank: Optional[int] = None,
            async_save: bool = False) -> DryRun:
    """Play one optimizer step of a ``world_size``-rank job in this process and report, for each kind of rank, its
    memory and its collectives (see [Note: dry run]).

    Args:
        build: ``build(topo) -> model``, called under ``torch.device("meta")`` (parameters are materialized as fake
            tensors by the wrap; a model that reads ``topo``, e.g. an MoE layer's ``ep_group``, gets the played
            rank's groups). Called once more, for the cost model, when ``plan_model``.
        step: ``step(model, topo) -> loss`` for one micro-batch: make the inputs (``torch.randint``/``torch.randn``
            make fake tensors here) and run the forward; the dry run calls ``loss.backward()`` (the loss: a
            0-dim tensor). With ``step_runs_backward=True`` it runs the backward itself and returns None (a
            pipeline schedule's ``step``, whose ``build`` returns the stages, sharded).
        world_size: ranks of the job played (>= 1); ``ranks_per_node``: consecutive ranks per node (divides it).
        topology: keyword arguments of :class:`~shardfusion.Topology` (``dp``, ``pp``, ``sharding``, ``ep``,
            ``fsdp_outer_degree``, ...); its ``ranks_per_node`` is the argument's.
        fully_shard: keyword arguments of :func:`~shardfusion.fully_shard` (``units``, ``mp_policy``,
            ``reshard_policy``, ``prefetch``, ...; not ``device``).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (default: AdamW, lr 1e-3, its default
            implementation).
        micro_batches: forwards and backwards per optimizer step (>= 1); ``max_norm``: clip with
            :func:`~shardfusion.clip_grad_norm_` (None: no clipping).
        ranks: the global ranks to play (default: one per kind, :func:`kinds_of`).
        backend: ``"nccl"`` (default) or ``"gloo"``: whose collectives to record (gloo's reduce-scatter is an
            all-to-all with a full-size receive buffer).
        bandwidth: links for the predicted step time (default :data:`DEFAULT_BANDWIDTH`).
        plan_model: run the cost model (:func:`shardfusion.plan`) on a second meta copy of the model.
        bounds: play each rank's step twice: with every collective complete as soon as it is issued
            (communication keeps up with compute: the figures), then with none complete before it is waited for
            (``full_grads_slow``, ``other_peak_slow``, ``peak_slow``). False: once.
        step_runs_backward: see ``step``.
        max_memory_per_rank: a memory budget per rank in bytes: the report judges each kind of rank's ``peak``
            (and ``peak_slow``) against it (:meth:`RankFigures.budget`). None (default): no verdict.
        async_save: the job saves checkpoints asynchronously (``save_checkpoint(..., async_save=True)``): each kind
            of rank also reports ``memory["staging"]``, the staging copy of a save (host memory, not in ``peak``).

    Returns:
        :class:`DryRun`.

    Raises:
        ValueError: a process group is already initialized in this process (a dry run needs its own, fake one); a
            bad ``world_size``, ``ranks_per_node``, ``micro_batches``, ``backend``, ``max_memory_per_rank`` or rank;
            a world whose bookkeeping would not fit this machine (:func:`check_world_fits`, before anything is
            allocated); the layout's degree errors (:class:`~shardfusion.topology.Degrees`).
    """
    _check_int("world_size", world_size, 1)
    _check_int("ranks_per_node", ranks_per_node, 1)
    _check_int("micro_batches", micro_batches, 1)
    if max_memory_per_rank is not None:
        _check_int("max_memory_per_rank", max_memory_per_rank, 1)
    check_world_fits(world_size)
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node({ranks_per_node}) must divide world_size({world_size})")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if dist.is_initialized():
        raise ValueError("dry_run needs a process without a process group: it joins a fake one of world_size ranks "
                         "(run it before, or instead of, torch.distributed.init_process_group)")
    topo_kwargs = dict(topology or {})
    fs_kwargs = dict(fully_shard or {})
    if "device" in fs_kwargs:
        raise ValueError("fully_shard: a dry run picks the device itself (fake tensors); drop 'device'")
    _check_keywords("topology", topo_kwargs, Topology.__init__)
    _check_keywords("fully_shard", fs_kwargs, fully_shard_model)
    bandwidth = bandwidth or DEFAULT_BANDWIDTH
    check_bandwidth(bandwidth)
    degrees = Degrees(world_size=world_size, **{k: v for k, v in topo_kwargs.items() if k != "timeout"})
    played = kinds_of(degrees)
    if ranks is not None:
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise ValueError(f"ranks: {r!r} is not a rank of world_size({world_size})")
        kind = dict(played)
        played = [(r, kind.get(r, "chosen rank")) for r in ranks]
    t0 = time.perf_counter()
    figures, layout = [], ""
    saved_backend = comm._emulated_backend["fake"]
    comm._emulated_backend["fake"] = backend
    try:
        for rank, kind in played:
            fig, layout = _play(rank, kind, world_size, ranks_per_node, build, step, topo_kwargs, fs_kwargs,
                                optimizer, micro_batches, max_norm, bounds, step_runs_backward, async_save)
            figures.append(fig)
    finally:
        comm._emulated_backend["fake"] = saved_backend
    candidate, plan_error = None, ""
    if plan_model:
        candidate, plan_error = _predict(build, degrees, world_size, ranks_per_node, fs_kwargs, micro_batches,
                                         backend, bandwidth, figures[0].reshard)
    notes = _layout_notes(degrees, ranks_per_node)
    if fs_kwargs.get("secondary_shard"):
        notes.append(_secondary_note(figures[0]))
    if any(c["op"] == "all_to_all" and c["label"] == "ep" for f in figures for c in f.collectives):
        notes.append("MoE all-to-alls and expert activations assume an even router (1/E of the assignments each)")
        if candidate is not None:
            notes.append("the cost model leaves out the MoE all-to-alls (in the table above, not in its time)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return DryRun(world_size, ranks_per_node, layout, figures, candidate, bandwidth, time.perf_counter() - t0, rss,
                  plan_error, notes, max_memory_per_rank)


def _secondary_note(fig: RankFigures) -> str:
    """What ``secondary_shard=True`` did on the first played rank: the backward's all-gathers on node groups and the
    copies' peak, or that it changed nothing (no sharding group spans nodes, or no unit is gathered again)."""
    local = [c for c in fig.collectives if c["op"] == "all_gather" and c["label"].endswith("_node")]
    peak = fig.memory.get("secondary_params", 0)
    if not local and not peak:
        return ("secondary_shard changes nothing here: no sharding group spans nodes, or no unit is resharded after "
                "forward (after_backward keeps them gathered)")
    groups = ", ".join(f"{c['label']} ({c['group_size']} ranks)" for c in local) or "of one rank: local copies"
    return (f"secondary_shard: the backward's all-gathers of the units resharded after forward run within the node, "
            f"on {groups}; their copies peak at {_size(peak)} per rank (memory: secondary_params)")


def _play(rank, kind, world_size, ranks_per_node, build, step, topo_kwargs, fs_kwargs, optimizer, micro_batches,
          max_norm, bounds, step_runs_backward, async_save=False) -> tuple[RankFigures, str]:
    """One rank: fake group, topology, then :func:`measure_step` on fake tensors, with the collectives complete as
    soon as issued and, with ``bounds``, again with none complete before it is waited for."""
    t = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        topo = Topology(**{"ranks_per_node": ranks_per_node, **topo_kwargs})  # the nodes played (hpZ's node groups)
        topology_s = time.perf_counter() - t
        runs = []
        for at_once in (True, False) if bounds else (True,):
            comm._fake_completion["at_once"] = at_once
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            # FakeTensorMode's dispatch cache keeps some outputs' storages alive past their last use (measured: a
            # unit's full gradient buffer after its reduce-scatter, a pipeline stage's outputs), which a real run
            # frees: off, so that live bytes are the real run's
            fake_mode.cache_enabled = False
            with fake_mode, warnings.catch_warnings():
                # torch notes that a fake tensor's data_ptr() is not a real one: the runtime only compares them
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                runs.append(measure_step(build, step, topo, ranks_per_node=ranks_per_node, fully_shard=fs_kwargs,
                                         optimizer=optimizer, micro_batches=micro_batches, max_norm=max_norm,
                                         kind=kind, step_runs_backward=step_runs_backward,
                                         async_save=async_save))
        fig = runs[0]
        if bounds:  # the same collectives; the buffers that wait for them live longer
            slow = runs[1]
            for part in ("full_grads", "other_peak", "peak", "transient"):
                fig.memory[f"{part}_slow"] = slow.memory[part]
            fig.peak_parts["slow"] = slow.peak_parts
            fig.seconds["step_slow"] = slow.seconds["step"]
        fig.seconds["topology"] = topology_s
        return fig, topo.describe()
    finally:
        comm._fake_completion["at_once"] = False
        comm._group_ranks.clear()  # the played rank's groups, up to world-sized rank lists: gone with them
        dist.destroy_process_group()


def measure_step(build: Build, step: Step, topo, *, ranks_per_node: int, fully_shard: Optional[dict] = None,
                 optimizer: Optional[Callable] = None, micro_batches: int = 1, max_norm: Optional[float] = 1.0,
                 kind: str = "this rank", device: str = "cpu",
                 step_context: Optional[Callable[[], object]] = None,
                 step_runs_backward: bool = False, async_save: bool = False) -> RankFigures:
    """Build, shard and step a model on the process group that ``topo`` was made on, under
    :class:`~shardfusion.live_memory.LiveMemory` and a :class:`~shardfusion.comm.CommCounter`, and return this rank's
    figures. :func:`dry_run` calls it on fake tensors and a fake group; on a real group (every rank calls it, as any
    step) it measures the same figures, which is how a dry run is validated (``benchmarks/dry_run_check.py``).
    Arguments as in :func:`dry_run`; ``device``: where the wrap materializes the model; ``step_context``: a context
    manager factory entered around the step only (e.g. another recorder of its collectives); ``async_save``: also
    ``memory["staging"]``, the bytes of an asynchronous checkpoint save's staging copy after the step
    (:func:`shardfusion.checkpoint.staging_bytes`: this rank's written fragments, their optimizer state, the
    scalars and buffers; host memory, held from the first save on, so not part of ``peak``).
    """
    from shardfusion._runtime.state import is_sharded

    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    seconds: dict[str, float] = {}
    coords = {a: getattr(topo, f"{a}_rank") for a in ("dp", "pp", "sep", "cp", "mp", "ep", "outer", "inner")}
    tracker, p2p = LiveMemory(), _SendRecorder(ranks_per_node)
    with tracker:
        t = time.perf_counter()
        with torch.device("meta"):
            built = build(topo)
        models = list(built) if isinstance(built, (list, tuple)) else [built]
        models = [m if is_sharded(m) else fully_shard_model(m, topo, device=device, **(fully_shard or {}))
                  for m in models]
        model = models if isinstance(built, (list, tuple)) else models[0]
        opt = optimizer([p for m in models for p in m.parameters()])
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizer(params) must return a torch.optim.Optimizer, got {type(opt).__name__}")
        tracker.watch = model_storages(model, opt)
        seconds["wrap"] = time.perf_counter() - t
        t = time.perf_counter()
        largest_unit = max((sum(g.full.numel() * g.full.element_size() for g in u.groups if g.full is not g.shard)
                            for m in models for u in get_units(m)), default=0)
        gc.collect()  # what the build left in reference cycles would otherwise die at a moment the step does not set
        tracker.reset_peak()
        activations = 0
        if not step_runs_backward:
            # every micro-batch reduce-scatters its gradients (as the training job's loop); the replicate all-reduces
            # run at the step boundary, on this thread (the same collectives as overlapped with the last backward,
            # where a CPU run would issue them from a worker thread that no dispatch mode sees)
            for m in models:
                set_is_last_backward(m, False)
        with comm.CommCounter(ranks_per_node) as counter, p2p, (step_context or contextlib.nullcontext)():
            for _ in range(micro_batches):
                if not step_runs_backward:
                    tracker.phase = "activations"  # what the forward makes ([Note: live tensor bytes])
                before = tracker.sample().parts["activations"]
                loss = step(model, topo)
                tracker.phase = "other"
                if step_runs_backward:  # a pipeline schedule: its peak of activations and temporaries stands for them
                    if loss is not None:
                        raise ValueError("step_runs_backward=True: step must run the backward itself and return None, "
                                         f"got {type(loss).__name__}")
                    activations = max(activations, tracker.unwatched_peak)
                    continue
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
                    raise ValueError(f"step(model, topo) must return the micro-batch's loss, a 0-dim tensor, got {what}"
                                     " (a step that runs its own backward, e.g. a pipeline schedule's: pass "
                                     "step_runs_backward=True and return None)")
                # what backward keeps: the live bytes the forward made (a unit kept gathered from forward to
                # backward, e.g. the root, is in full_params, not here)
                activations = max(activations, tracker.sample().parts["activations"] - before)
                loss.backward()
            tracker.phase = "optimizer_step"
            if max_norm is not None:
                clip_grad_norm_(model, max_norm)
            opt.step()
            tracker.phase = "other"
            after = tracker.sample()
            opt.zero_grad(set_to_none=True)
        seconds["step"] = time.perf_counter() - t
    memory = {p: after.parts[p] for p in ("params", "grads", "optimizer")}
    memory.update(full_params=tracker.part_peaks["full_params"], full_grads=tracker.part_peaks["full_grads"],
                  secondary_params=tracker.part_peaks["secondary_params"], activations=activations, other_peak=tracker.unwatched_peak, peak=tracker.peak.total,
                  transient=tracker.transient_peak.transient, largest_full_unit=largest_unit)
    if async_save:
        memory["staging"] = checkpoint.staging_bytes(model, opt)  # imports DCP (shardfusion.checkpoint)
    choices = [c.as_dict() for m in models if (c := reshard_choice(m)) is not None]
    at = tracker.transient_peak
    return RankFigures(topo.rank, coords, kind, memory, _collectives(counter, ranks_per_node) + p2p.rows(),
                       counter.summary(ranks_per_node), seconds, dict(tracker.peak.parts), choices,
                       transient_peak={"parts": dict(at.parts), "units": at.units})


class _SendRecorder(TorchDispatchMode):
    """The point-to-point sends of a step (pipeline activations and their gradients), which ``CommCounter`` does
    not see: one row like :func:`_collectives`' (op ``p2p_send``), bytes within / across nodes by the peer's node."""

    def __init__(self, ranks_per_node: int) -> None:
        super().__init__()
        self.ranks_per_node = ranks_per_node
        self.row = {"op": "p2p_send", "label": "pp", "group_size": 2, "count": 0, "bytes": 0, "wire_bytes": 0.0,
                    "within_bytes": 0.0, "across_bytes": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (tensors, process group, peer's group rank, tag); not those of a collective run as sends (comm.py)
        if func is torch.ops.c10d.send.default and not comm.sends_are_parts():
            tensors, group, peer = args[0], args[1], args[2]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            pg = dist.ProcessGroup.unbox(group) if hasattr(dist.ProcessGroup, "unbox") else group
            dst = dist.get_global_rank(pg, peer)
            across = dst // self.ranks_per_node != dist.get_rank() // self.ranks_per_node
            self.row["count"] += 1
            self.row["bytes"] += nbytes
            self.row["wire_bytes"] += nbytes
            self.row["across_bytes" if across else "within_bytes"] += nbytes
        return func(*args, **(kwargs or {}))

    def rows(self) -> list[dict]:
        """The sends as one row of :attr:`RankFigures.collectives` (none when there were none)."""
        return [dict(self.row)] if self.row["count"] else []


def _collectives(counter, ranks_per_node: int) -> list[dict]:
    """The counter's records added up per (op, group label, group size)."""
    rows: dict[tuple, dict] = {}
    for r in counter.records:
        key = (r.op, r.label, len(r.group_ranks))
        row = rows.setdefault(key, {"op": r.op, "label": r.label, "group_size": len(r.group_ranks), "count": 0,
                                    "bytes": 0, "wire_bytes": 0.0, "within_bytes": 0.0, "across_bytes": 0.0})
        across = accounting.cross_node_bytes(r, ranks_per_node)
        row["count"] += 1
        row["bytes"] += r.nbytes
        row["wire_bytes"] += r.wire_bytes
        row["across_bytes"] += across
        row["within_bytes"] += r.wire_bytes - across
    return sorted(rows.values(), key=lambda c: -c["wire_bytes"])


def _predict(build, degrees, world_size, ranks_per_node, fs_kwargs, micro_batches, backend, bandwidth,
             reshard=()):
    """The cost model's candidate for this layout's outer degree, on a fresh meta model (None and why on failure).
    Under ``reshard_policy="auto"`` the units keep the settings the played rank chose (``reshard``: its
    ``RankFigures.reshard``)."""
    mp = fs_kwargs.get("mp_policy")
    kwargs = {k: fs_kwargs[k] for k in ("units", "comm_unit_size", "reshard_policy", "prefetch", "expert_policy",
                                        "whole_params") if k in fs_kwargs}
    if kwargs.get("reshard_policy") == "auto":
        if len(reshard) != 1:
            return None, "reshard_policy='auto': the cost model covers one sharded model per rank"
        kwargs["reshard_policy"] = "after_forward"  # the units it decides start resharded; the choice is set below
    if degrees.pp > 1 or degrees.mp > 1 or degrees.sep * degrees.cp > 1:
        return None, "the cost model covers pp, mp, sep and cp 1 only"
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        topo = Topology(dp=degrees.dp, sharding=degrees.sharding, sep=degrees.sep, cp=degrees.cp, ep=degrees.ep,
                        fsdp_outer_degree=degrees.fsdp_outer_degree)
        with torch.device("meta"):
            model = build(topo)
        if reshard:
            chosen = dict(zip(reshard[0]["units"], reshard[0]["reshard_after_forward"]))
            sizes = unit_sizes(model, **{k: v for k, v in kwargs.items() if k in ("units", "comm_unit_size",
                                                                                  "reshard_policy", "whole_params")})
            model = [dataclasses.replace(u, reshard_after_forward=chosen.get(u.name, u.reshard_after_forward))
                     for u in sizes]
            kwargs = {k: v for k, v in kwargs.items() if k in ("prefetch", "expert_policy")}
        p = plan_outer(model, world_size=world_size, local_world_size=ranks_per_node, bandwidth=bandwidth,
                    max_memory_per_rank=2**62, micro_batches=micro_batches, dp=degrees.dp, ep=degrees.ep,
                    param_dtype=getattr(mp, "param_dtype", None), grad_comm_dtype=getattr(mp, "grad_comm_dtype", None),
                    all_gather_dtype=getattr(mp, "all_gather_dtype", None),
                    secondary_shard=bool(fs_kwargs.get("secondary_shard")),
                    backend=backend, outer_degrees=[degrees.fsdp_outer_degree], **kwargs)
        return p.chosen, ""
    except (ValueError, TypeError) as e:
        return None, str(e)
    finally:
        dist.destroy_process_group()
