"""A Topology's gloo groups of one rank share one transport device ([Note: one gloo device for many groups] in
shardfusion/_runtime/gloo_device.py): one network loop thread for all of them, the groups of several ranks keep
their own, and every group still computes its sums; torch's class is back in place afterwards. The loop threads the
topology started run as batch work, the default group's as torch left it ([Note: gloo loop threads as batch
work])."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from shardfusion._runtime.gloo_device import loop_threads

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")


def _worker() -> dict:
    from torch.distributed import distributed_c10d as c10d

    import shardfusion as sf

    original = c10d.ProcessGroupGloo
    default_loops = loop_threads()  # the default group's (init_process_group's), before the topology's
    before_groups = set(c10d._world.pg_map)
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=2)
    new = [pg for pg in c10d._world.pg_map if pg not in before_groups]
    sums = []
    for pg in new:  # every new group still works: the sum of (rank + 1) over its ranks
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t, group=pg)
        sums.append((float(t), float(sum(r + 1 for r in dist.get_process_group_ranks(pg)))))
    sizes = [pg.size() for pg in new]
    policies = {tid: os.sched_getscheduler(tid) for tid in loop_threads()}
    return {"sizes": sizes, "threads": len(loop_threads()) - len(default_loops), "sums": sums,
            "restored": c10d.ProcessGroupGloo is original, "degrees": (topo.inner, topo.fsdp_outer_degree),
            "default_loops": sorted(policies[t] for t in default_loops), "new_loops":
            sorted(policies[t] for t in set(policies) - default_loops)}


def test_groups_of_one_rank_share_one_loop_thread():
    results = run_distributed(_worker, 4, timeout=90)
    if not results[0]["default_loops"]:
        pytest.skip("this torch's gloo does not name its loop threads (gloo_tcp_loop): nothing to count")
    for rank, out in enumerate(results):
        singles, multi = out["sizes"].count(1), sum(1 for s in out["sizes"] if s > 1)
        assert out["degrees"] == (2, 2)
        assert singles >= 2, f"rank {rank}: HSDP 2 x 2 on 4 ranks makes several one-rank groups, got {out['sizes']}"
        # torch's default would start one loop per group: len(sizes); shared, the one-rank groups start one together.
        # Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch adds a helper gloo group of the same size beside each group.
        helpers = multi if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" else 0
        assert out["threads"] == multi + helpers + 1, (rank, out)
        assert all(got == want for got, want in out["sums"]), (rank, out["sums"])
        assert out["restored"], f"rank {rank}: torch's ProcessGroupGloo was not put back"
        # [Note: gloo loop threads as batch work]: the topology's loops are batch work, the default group's is not
        assert out["new_loops"] and set(out["new_loops"]) == {os.SCHED_BATCH}, (rank, out)
        assert out["default_loops"] and os.SCHED_BATCH not in out["default_loops"], (rank, out)
