"""What the Trainer's and Fabric's strategies share in starting their processes: each rank's place in the world and
the default process group (Lightning's cluster environment gives the node and local ranks; the backend follows the
root device: gloo on CPU, nccl on CUDA). Imports lightning-fabric: only `shardfusion.lightning` imports this."""

from __future__ import annotations

from typing import Any

from lightning_fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning_fabric.utilities.distributed import _init_dist_connection
from lightning_fabric.utilities.rank_zero import rank_zero_only
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only


def set_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment this process's global rank (node_rank x processes per node + local rank) and the
    world size (nodes x processes per node), and Lightning's rank-zero helpers the global rank."""
    environment = strategy.cluster_environment
    if environment is not None:
        environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def connect(strategy: Any) -> str:
    """Seed, ranks (`set_world_ranks`) and the default process group of ``strategy`` (its ``_process_group_backend``
    if set, else the root device's default, with its ``_timeout``); returns the backend's name."""
    reset_seed()
    set_world_ranks(strategy)
    backend = strategy._process_group_backend or _get_default_process_group_backend_for_device(strategy.root_device)
    device_id = strategy.root_device if strategy.root_device.type != "cpu" else None
    _init_dist_connection(strategy.cluster_environment, backend, timeout=strategy._timeout, device_id=device_id)
    return backend
