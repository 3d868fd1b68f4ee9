"""The one mapping from the job's parallelism and precision sections to the library: the rank grid
(`topology` -> `sf.Topology`), the sharding of a model or a pipeline stage (`shard` -> `sf.fully_shard` with the
`MixedPrecisionPolicy` and the outer wire format of `shardfusion.train.dtype_flags`), and the outer degree the cost
model plans for ``--fsdp-outer-degree auto`` (`plan_outer_degree` -> `sf.plan`, once the process group exists).

The plain job (`shardfusion.train.job`), the pipeline stages (`job_pipeline`) and the dry run (`job_dry_run`, whose
`sf.dry_run` calls `fully_shard` with `shard_options`) all shard through here: `fully_shard(` is called in this
file only. The sections must be the resolved ones (``ResolvedJob.parallelism``: ep and the outer degree ints).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

import shardfusion as sf
from shardfusion.accounting import ranks_per_node_from_env
from shardfusion.comm import call_on_rank0
from shardfusion.plan import default_memory_budget
from shardfusion.train import dtype_flags, job_model
from shardfusion.train import resume as train_state
from shardfusion.train.config import ResolvedJob
from shardfusion.train.dtype_flags import PrecisionConfig
from shardfusion.train.optim import muon_matrices
from shardfusion.train.parallel_config import ParallelismConfig
from shardfusion.train.pipeline_config import PipelineConfig
from shardfusion.train.run_config import RunConfig


def topology_degrees(parallelism: ParallelismConfig, pipeline: PipelineConfig,
                     ranks_per_node: int | None = None) -> dict[str, int]:
    """The `sf.Topology` keywords of the resolved sections: ep, mp, cp, pp and the outer degree (an int); with
    ``ranks_per_node`` (`topology_ranks_per_node`) also where the node boundaries are."""
    degrees = {"fsdp_outer_degree": parallelism.fsdp_outer_degree, "ep": parallelism.ep, "mp": parallelism.mp,
               "cp": parallelism.cp, "pp": pipeline.pp}
    return degrees if ranks_per_node is None else {**degrees, "ranks_per_node": ranks_per_node}


def topology_ranks_per_node(run: RunConfig, world: int) -> int | None:
    """The ``ranks_per_node`` the job's `sf.Topology` gets: --ranks-per-node, one node (``world``) when it is at
    least the world size; None without the flag (the topology then reads LOCAL_WORLD_SIZE itself). A value that
    does not divide a larger world is refused before any worker starts (`config.check_run`)."""
    return None if run.ranks_per_node is None else min(run.ranks_per_node, world)


def topology(parallelism: ParallelismConfig, pipeline: PipelineConfig, ranks_per_node: int | None = None
             ) -> sf.Topology:
    """The rank grid of the resolved sections over the default process group (collective: it makes the groups),
    with nodes of ``ranks_per_node`` consecutive ranks (`topology_ranks_per_node`; None: LOCAL_WORLD_SIZE), so that
    one machine can declare several nodes and the library knows which groups span them.

    Raises:
        ValueError: the degrees do not fit the world (`sf.Topology`'s message; a --ranks-per-node that does not
            divide the world size is refused before any worker starts, by `config.check_run`).
    """
    return sf.Topology(**topology_degrees(parallelism, pipeline, ranks_per_node))


def shard_options(parallelism: ParallelismConfig, precision: PrecisionConfig) -> dict[str, Any]:
    """The `sf.fully_shard` keywords the sections decide: reshard_policy, expert_policy, prefetch, mp_policy
    (--param-dtype, --grad-comm-dtype, --all-gather-dtype) and outer_comm_dtype; with --reshard-policy auto, memory_budget
    (--max-memory-per-rank); with --secondary-shard, secondary_shard."""
    options = {"reshard_policy": parallelism.reshard_policy, "expert_policy": parallelism.expert_policy,
               "prefetch": parallelism.prefetch, "mp_policy": dtype_flags.mixed_precision(precision),
               "outer_comm_dtype": dtype_flags.outer_comm_dtype(precision)}
    if parallelism.secondary_shard:
        options["secondary_shard"] = True
    if parallelism.reshard_policy == "auto":
        options["memory_budget"] = parallelism.max_memory_per_rank
    return options


def shard(module: nn.Module, topo: sf.Topology, parallelism: ParallelismConfig, precision: PrecisionConfig, *,
          units: tuple[type, ...], device: torch.device | None = None, **library: Any) -> nn.Module:
    """``module`` sharded by `sf.fully_shard` over ``topo`` as the sections say (`shard_options`); ``units``: the
    module classes that each form a unit; ``library``: the keywords that are not the flags' (init_fn, whole_params,
    replicate_filter)."""
    return sf.fully_shard(module, topo, units=units, device=device, **shard_options(parallelism, precision), **library)


ZERO_PP: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("all_gather_dtype", "qwZ", lambda value: value is not None),
    ("secondary_shard", "hpZ", bool),
    ("grad_comm_dtype", "qgZ", lambda value: value == "int8"),
)
"""ZeRO++'s three ideas (Wang et al., 2023) as the job's flags: (flag name, the idea's name, whether a value turns
it on). A flag this build does not have is left out of `zero_pp_line`; a new option is one more row."""


def zero_pp_line(flags: dict[str, Any], topo: sf.Topology) -> str | None:
    """Rank 0's start line on the ZeRO++ options of the run (``flags``: `ResolvedJob.flat`) and whether the
    sharding groups span nodes (``topo``'s ``ranks_per_node``: `topology_ranks_per_node`), e.g. ``ZeRO++: qwZ on
    (--all-gather-dtype int8), qgZ off; 2 nodes x 2 ranks; fsdp_inner groups span nodes (fsdp inner 4)``; None on
    one node with every option off (nothing to say)."""
    states = []
    for name, idea, on in ZERO_PP:
        if name not in flags:
            continue
        value, flag = flags[name], "--" + name.replace("_", "-")
        states.append(f"{idea} on ({flag if isinstance(value, bool) else f'{flag} {value}'})" if on(value)
                      else f"{idea} off")
    several = topo.world_size > topo.ranks_per_node
    if not several and not any(s.endswith(")") for s in states):
        return None
    within = "" if topo.spanning_groups or not several else "; every sharding group within a node"
    return f"ZeRO++: {', '.join(states)}; {topo.describe_nodes()}{within}"


def comm_layout(config: ResolvedJob, world: int) -> dict[str, Any]:
    """The node layout the communication accounting assumes: `ranks_per_node` (None: one node), `nodes`, and
    `ranks_per_node_from`, where the figure came from (`--ranks-per-node`, `LOCAL_WORLD_SIZE` or neither)."""
    rpn, source = config.run.ranks_per_node, "--ranks-per-node"
    if rpn is None:
        rpn, source = ranks_per_node_from_env(), "LOCAL_WORLD_SIZE"
    if rpn is None:
        return {"ranks_per_node": None, "nodes": 1, "ranks_per_node_from": "no LOCAL_WORLD_SIZE: one node"}
    return {"ranks_per_node": rpn, "nodes": -(-world // rpn), "ranks_per_node_from": source}


def plan_outer_degree(config: ResolvedJob, device: torch.device, world: int) -> int:
    """`--fsdp-outer-degree auto`: the outer degree `sf.plan` chooses for this run; rank 0 prints its table.
    Collective: every rank probes the links (`sf.measure_bandwidth`, about a second) and gets the same degree.

    Inputs: nodes of `--ranks-per-node` ranks (default LOCAL_WORLD_SIZE: torchrun's ranks per node), the units of the
    job's model (built on meta with every expert, the experts' elements divided by ep), fp32 shards and AdamW state,
    --param-dtype / --grad-comm-dtype / --all-gather-dtype, --grad-accum micro-batches, --reshard-policy, --prefetch,
    --expert-policy, and the budget `--max-memory-per-rank` (default `shardfusion.plan.default_memory_budget`, the least
    over the ranks). A run that resumes a checkpoint keeps the degree of the run it resumes (from OUT/config.json) when
    that fits, so the resume stays exact. With --optimizer muon the plan lays the Muon matrices out in owner layouts for
    each candidate's inner degree (their padding counted: `whole_params`); it still counts AdamW's two states where Muon
    keeps one per matrix element (docs/train-muon.md).

    Raises:
        ValueError: on every rank: no degree fits the budget (naming --max-memory-per-rank and the smallest need),
            or --ranks-per-node does not divide the world size.
    """
    local = comm_layout(config, world)["ranks_per_node"] or world
    if world % local:
        raise ValueError(f"--fsdp-outer-degree auto: the ranks per node ({local}, --ranks-per-node or "
                         f"LOCAL_WORLD_SIZE) must divide the world size {world}")
    t_probe = time.perf_counter()
    bandwidth = sf.measure_bandwidth(local, device=device)
    t_probe = time.perf_counter() - t_probe
    sizes = unit_sizes_per_rank(config, device)
    budget = config.parallelism.max_memory_per_rank
    if budget is None:
        least = torch.tensor([default_memory_budget(device, local)], dtype=torch.float64,
                             device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        budget = int(least.item())
    saved = _resumed_outer_degree(config.out)
    prefer = saved if saved is not None and (world // config.ep) % saved == 0 else None
    mp_policy = dtype_flags.mixed_precision(config.precision)
    try:
        choice = sf.plan(sizes, world_size=world, local_world_size=local, bandwidth=bandwidth,
                         max_memory_per_rank=budget, micro_batches=config.schedule.grad_accum, ep=config.ep,
                         prefetch=config.parallelism.prefetch, expert_policy=config.parallelism.expert_policy,
                         shard_dtype=torch.float32,
                         param_dtype=mp_policy.param_dtype, grad_comm_dtype=mp_policy.grad_comm_dtype,
                         all_gather_dtype=mp_policy.all_gather_dtype,
                         outer_comm_dtype=dtype_flags.outer_comm_dtype(config.precision),
                         secondary_shard=config.parallelism.secondary_shard,
                         reshard_policy=config.reshard_policy,  # auto: the blocks kept gathered per candidate
                         backend="nccl" if "nccl" in str(dist.get_backend()) else "gloo", prefer=prefer)
    except ValueError as error:
        raise ValueError(f"--fsdp-outer-degree auto with --max-memory-per-rank {budget}: {error}") from None
    if dist.get_rank() == 0:
        print(f"shardfusion: --fsdp-outer-degree auto: bandwidth probe {t_probe:.2f} s", flush=True)
        print("\n".join(f"shardfusion: {line}" for line in choice.table().splitlines()), flush=True)
    return choice.fsdp_outer_degree


def unit_sizes_per_rank(config: ResolvedJob, device: torch.device) -> list[sf.UnitSize]:
    """The units of the job's model as one rank holds them, for `sf.plan`: `sf.unit_sizes` of the model built on
    meta with every expert (no process group needed), each unit's expert elements, expert buffers' shapes and
    Muon's expert matrices cut to one ep rank's experts (E / ep of them, all alike); the blocks' reshard setting
    from --reshard-policy (under auto: the blocks the policy decides)."""
    meta = job_model.build(config, None, device)  # on meta, every expert
    whole = muon_matrices(meta.module, meta.units) if config.optim.optimizer == "muon" else None
    ep = config.ep
    return [dataclasses.replace(u, expert_numel=u.expert_numel // ep,
                                expert_whole_shapes=u.expert_whole_shapes[:len(u.expert_whole_shapes) // ep],
                                expert_buffer_shapes=tuple(b[:len(b) // ep] for b in u.expert_buffer_shapes))
            for u in sf.unit_sizes(meta.module, units=meta.units, reshard_policy=config.reshard_policy,
                                   whole_params=whole)]


def _resumed_outer_degree(out: str) -> int | None:
    """The int `fsdp_outer_degree` in OUT/config.json when OUT holds a checkpoint to resume, else None (as rank 0
    reads it). Collective."""
    if train_state.latest(out) is None:
        return None
    return call_on_rank0(lambda: saved_outer_degree(out), f"cannot read {out}/config.json")


def saved_outer_degree(out: str) -> int | None:
    """The int `fsdp_outer_degree` in OUT/config.json (the run that wrote OUT's checkpoints), else None."""
    try:
        value = json.loads((Path(out) / "config.json").read_text()).get("fsdp_outer_degree")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
