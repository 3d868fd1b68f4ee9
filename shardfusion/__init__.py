"""shardfusion: fully sharded data parallelism (FSDP) and its hybrid form (HSDP) with fused flat buffers.

Public API (v0; the design: docs/design.md)::

    import shardfusion as sf
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=2)
    model = sf.fully_shard(model, topo, units=(Block,))
    norm = sf.clip_grad_norm_(model, max_norm=1.0)
    full = sf.full_state_dict(model)
    sf.load_safetensors(model, "path/to/hf_model_folder")   # pretrained weights, each rank reads its fragments

    # the outer degree from a cost model (docs/plan.md), before fully_shard:
    choice = sf.plan(model, units=(Block,), world_size=8, local_world_size=4,
                     bandwidth=sf.measure_bandwidth(), max_memory_per_rank=80 << 30)
    topo = sf.Topology(fsdp_outer_degree=choice.fsdp_outer_degree)

    # a 1,024-rank job played in this process: memory and bytes per rank before booking it (docs/dry-run.md):
    report = sf.dry_run(build, step, world_size=1024, ranks_per_node=8, topology={"fsdp_outer_degree": 128},
                        fully_shard={"units": (Block,)})
    print(report.table())

``sf.plan`` and ``sf.dry_run`` are functions; their modules are ``shardfusion.plan`` and ``shardfusion.dry_run``.
"""

from shardfusion import checkpoint, comm, topology
from shardfusion import moe
from shardfusion.amp import install_grad_scaler_sync
from shardfusion.checkpoint.streaming import load_safetensors
from shardfusion.clip import clip_grad_norm_, install_torch_clip_wrappers
from shardfusion.diloco import DiLoCo
from shardfusion.dry_run import DryRun, dry_run
from shardfusion.fully_shard import (
    MixedPrecisionPolicy,
    finish_grad_sync,
    fully_shard,
    get_units,
    no_sync,
    reshard_choice,
    set_is_last_backward,
    set_requires_gradient_sync,
)
from shardfusion.moe import MoE, is_expert, mark_expert
from shardfusion.owners import owner_balance
from shardfusion.plan import Bandwidth, Plan, UnitSize, measure_bandwidth, plan, unit_sizes
from shardfusion.state_dict import full_state_dict
from shardfusion.topology import Topology

install_torch_clip_wrappers()  # torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on fragments: see shardfusion.clip
install_grad_scaler_sync()  # torch.amp.GradScaler agrees on found_inf over the ranks: see shardfusion.amp

__all__ = [
    "Bandwidth",
    "DiLoCo",
    "DryRun",
    "MixedPrecisionPolicy",
    "MoE",
    "Plan",
    "Topology",
    "UnitSize",
    "checkpoint",
    "clip_grad_norm_",
    "comm",
    "dry_run",
    "finish_grad_sync",
    "full_state_dict",
    "fully_shard",
    "get_units",
    "is_expert",
    "load_safetensors",
    "mark_expert",
    "measure_bandwidth",
    "moe",
    "no_sync",
    "owner_balance",
    "plan",
    "reshard_choice",
    "set_is_last_backward",
    "set_requires_gradient_sync",
    "topology",
    "unit_sizes",
]
