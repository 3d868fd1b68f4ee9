"""Measure the links a step will use: a short all-reduce probe within a node and across nodes (:class:`Bandwidth`).

The figures feed :func:`shardfusion.plan` (the outer-degree cost model in ``plan.py``); the job runs the probe at
start-up under ``--fsdp-outer-degree auto``.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from shardfusion import comm


@dataclass(frozen=True)
class Bandwidth:
    """Measured links, per rank, while every rank of a node uses them at once (see :func:`measure_bandwidth`).

    Attributes:
        within: bytes/s one rank sends to ranks of its own node (``inf``: one rank per node, never used).
        across: bytes/s one rank sends to other nodes (``inf``: one node, never used).
        latency_within: seconds per ring step of a collective within a node.
        latency_across: seconds per ring step of a collective that spans nodes.
    """

    within: float
    across: float
    latency_within: float = 0.0
    latency_across: float = 0.0

    def describe(self) -> str:
        """One line, e.g. ``within 1.20 GB/s (latency 80 us), across 6.10 MB/s (latency 420 us)``."""
        return (f"within {_rate(self.within)} (latency {self.latency_within * 1e6:.0f} us), "
                f"across {_rate(self.across)} (latency {self.latency_across * 1e6:.0f} us)")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_seconds(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or (
            value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def check_bandwidth(bandwidth) -> None:
    """Raise ValueError naming the field unless ``bandwidth`` is a :class:`Bandwidth` with positive ``within`` /
    ``across`` (bytes/s) and non-negative latencies (seconds)."""
    if not isinstance(bandwidth, Bandwidth):
        raise ValueError(f"bandwidth must be a shardfusion.plan.Bandwidth, got {bandwidth!r}")
    for name in ("within", "across"):
        _check_seconds(f"bandwidth.{name}", getattr(bandwidth, name), positive=True)
    for name in ("latency_within", "latency_across"):
        _check_seconds(f"bandwidth.{name}", getattr(bandwidth, name), positive=False)


def measure_bandwidth(local_world_size: Optional[int] = None, *, device: Optional[Union[torch.device, str]] = None,
                      target_s: float = 0.05, max_bytes: int = 64 << 20, repeats: int = 3) -> Bandwidth:
    """Measure the links within a node and across nodes with short all-reduces; collective over the default group.

    Groups (``torch.distributed.new_group``, created by every rank in one order, its own destroyed afterwards):
    each node's ``local_world_size`` ranks, and for each local rank the ranks with that local rank on every node.
    First every node all-reduces within itself, all nodes at once; then every cross-node group all-reduces, all
    local ranks at once (so a node's shared link is shared as in training). Each phase: ``3 * repeats``
    1-element all-reduces (the latency), then one all-reduce of a tensor from 64 KiB growing 4x until it takes
    ``target_s`` seconds and 10 times the latency (bandwidth-bound) or reaches ``max_bytes``, then ``repeats``
    all-reduces of that size (the bandwidth). Each timing starts after a barrier (the concurrent groups start
    together) and runs its all-reduces back to back (so a buffer that fills while a link is idle, a token bucket's
    burst, helps only the first one); it is the slowest rank's (one all-reduce over the default group), so every
    rank gets the same :class:`Bandwidth` and plans the same degree, and every rank runs the same collectives: no
    rank waits alone. About ``(2 + 4/3) * repeats * target_s`` seconds per phase on a slow link, plus the group
    set-up; a phase that does not exist (one node, or one rank per node) reports ``inf`` bandwidth.

    Figures, per rank: bandwidth = all-reduce wire bytes ``2(G-1)/G * N`` / (time of ``N`` - time of 1 element);
    latency = time of 1 element / ``2(G-1)`` ring steps.

    Args:
        local_world_size: ranks per node (consecutive global ranks); default ``LOCAL_WORLD_SIZE`` (torchrun sets
            it), else the whole world on one node.
        device: where the probe tensors live; default ``cuda`` (current device) under NCCL, else ``cpu``.
        target_s: seconds one timed all-reduce should last (> 0).
        max_bytes: the largest probe tensor, bytes (>= 64 KiB).
        repeats: timed all-reduces per size (>= 1).

    Raises:
        ValueError: ``torch.distributed`` is not initialized, or a bad argument (``local_world_size`` not dividing
            the world size, ...): before any collective, so on every rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("measure_bandwidth needs torch.distributed: call torch.distributed.init_process_group() "
                         "first (or run under torchrun)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        local_world_size = int(env) if env.isdigit() and int(env) > 0 else world
    local = _check_int("local_world_size", local_world_size, 1)
    if world % local:
        raise ValueError(f"local_world_size({local}) must divide the world size({world})")
    target_s = _check_seconds("target_s", target_s, positive=True)
    max_bytes = _check_int("max_bytes", max_bytes, 64 << 10)
    repeats = _check_int("repeats", repeats, 1)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    device = torch.device(device)
    nodes = world // local

    within = across = (math.inf, 0.0)
    if local > 1:
        groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
        within = _probe(groups[rank // local], local, device, target_s, max_bytes, repeats)
        dist.destroy_process_group(groups[rank // local])
    if nodes > 1:
        groups = [dist.new_group(list(range(j, world, local))) for j in range(local)]
        across = _probe(groups[rank % local], nodes, device, target_s, max_bytes, repeats)
        dist.destroy_process_group(groups[rank % local])
    return Bandwidth(within=within[0], across=across[0], latency_within=within[1], latency_across=across[1])


def _timed(tensor: torch.Tensor, group, times: int) -> float:
    """Seconds per all-reduce of ``tensor`` over ``group`` (this rank's; the groups of a phase run at the same time):
    after one untimed warm-up and a barrier of the default group (so the concurrent groups start together and share
    the links as in training), ``times`` all-reduces back to back (so buffers that fill up while a link is idle, such
    as a token bucket's burst, help only the first), their mean; the slowest rank's (one all-reduce, MAX, over the
    default group), the same on every rank."""
    def sync() -> None:
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    with comm.explain_timeout("the bandwidth probe's all-reduces (sf.probe, for sf.plan)"):
        dist.all_reduce(tensor, group=group)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(times):
            dist.all_reduce(tensor, group=group)
        sync()
        slowest = torch.tensor([(time.perf_counter() - t0) / times], dtype=torch.float64, device=tensor.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _probe(group, size: int, device: torch.device, target_s: float, max_bytes: int,
           repeats: int) -> tuple[float, float]:
    """(bandwidth bytes/s per rank, latency s per ring step) of all-reduces over ``group`` of ``size`` ranks."""
    steps = 2 * (size - 1)
    t_small = _timed(torch.zeros(1, dtype=torch.float32, device=device), group, 3 * repeats)
    nbytes = 64 << 10
    while True:
        x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        t = _timed(x, group, 1)
        if (t >= target_s and t >= 10 * t_small) or nbytes >= max_bytes:  # bandwidth-bound, not latency-bound
            break
        nbytes = min(nbytes * 4, max_bytes)
    t_big = _timed(x, group, repeats)
    wire = steps / size * nbytes
    bandwidth = wire / max(t_big - t_small, t_big * 1e-3, 1e-9)
    return bandwidth, t_small / steps


def _rate(r: float) -> str:
    if math.isinf(r):
        return "inf (unused)"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if r >= scale:
            return f"{r / scale:.2f} {unit}"
    return f"{r:.0f} B/s"
