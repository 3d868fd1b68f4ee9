"""shardfusion: fully sharded data parallelism (FSDP) and its hybrid form (HSDP) with fused flat buffers.

Public API (v0, see DESIGN.md)::

    import shardfusion as sf
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=2)
    model = sf.fully_shard(model, topo, units=(Block,))
    norm = sf.clip_grad_norm_(model, max_norm=1.0)
    full = sf.full_state_dict(model)
"""

from shardfusion import topology
from shardfusion.topology import Topology

__all__ = ["Topology", "topology"]
