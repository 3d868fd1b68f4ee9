"""shardfusion.comm's all-gather and reduce-scatter against torch's collectives on gloo: over pairs (sends and
receives, [Note: gloo collectives as sends and receives] in shardfusion/comm.py), over 4 ranks in one node (the
all-gather as sends and receives, the reduce-scatter as gloo's all-to-all) and over 4 ranks declared as 2 nodes of 2
(gloo's all-gather), synchronous and asynchronous, several calls in flight at once, and a reduce-scatter whose output
is the own half of its input (in place). Results must be bitwise those of the reference: a gather moves values, a sum
of two is the same in either order; and each call takes the path its group's layout says (counted)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run_distributed

N = 1000  # elements per shard


def _inputs(rank: int, calls: int) -> list[torch.Tensor]:
    """Each call's per-rank input, (G * N,) for a group of G; the same on every run."""
    return [torch.randn(4 * N, generator=torch.Generator().manual_seed(100 * rank + k)) for k in range(calls)]


def _worker() -> list[str]:
    import shardfusion as sf
    from shardfusion import comm

    topo = sf.Topology(sharding=-1, fsdp_outer_degree=2)  # inner pairs {0,1}, {2,3}
    two_nodes = sf.Topology(sharding=-1, ranks_per_node=2)  # its sharding group of 4 spans 2 nodes
    problems = []
    groups = {"pair": topo.get_group("fsdp_inner"), "reduce pair": topo.get_reduce_group("fsdp_inner"),
              "four": topo.get_group("sharding"), "four over 2 nodes": two_nodes.get_group("sharding")}
    exchanges = []  # the ops run as sends and receives, in call order
    real_exchange = comm._exchange
    comm._exchange = lambda *a, **k: exchanges.append(a[4]) or real_exchange(*a, **k)
    for name, group in groups.items():
        size, me = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        for async_op in (False, True):
            calls = 3
            fulls = [x[:size * N].clone() for x in _inputs(dist.get_rank(), calls)]
            shards = [f[me * N:(me + 1) * N].clone() for f in fulls]
            # reference: every rank's input of the group, gathered with torch's all_gather
            everyone = []
            for f in fulls:
                parts = [torch.empty_like(f) for _ in range(size)]
                dist.all_gather(parts, f, group=group)
                everyone.append(parts)
            gathered = [torch.empty(size * N) for _ in range(calls)]
            reduced = [torch.empty(N) for _ in range(calls)]
            works = []
            for k in range(calls):  # all issued before any wait: calls in flight must not take each other's pieces
                works.append(comm.all_gather(gathered[k], shards[k], group, async_op=async_op))
                works.append(comm.reduce_scatter(reduced[k], fulls[k], group, async_op=async_op))
            for w in works:
                if w is not None:
                    w.wait()
            want_ops = {"pair": ["all_gather", "reduce_scatter"], "reduce pair": ["all_gather", "reduce_scatter"],
                        "four": ["all_gather"], "four over 2 nodes": []}[name] * calls
            if sorted(exchanges) != sorted(want_ops):
                problems.append(f"{name}: sends and receives ran {exchanges}, expected {want_ops}")
            exchanges.clear()
            for k in range(calls):
                want_gather = torch.cat([everyone[k][r][r * N:(r + 1) * N] for r in range(size)])
                want_reduce = everyone[k][0][me * N:(me + 1) * N].clone()
                for r in range(1, size):
                    want_reduce += everyone[k][r][me * N:(me + 1) * N]
                if not torch.equal(gathered[k], want_gather):
                    problems.append(f"{name} async={async_op} call {k}: all_gather differs ({ranks})")
                if not torch.equal(reduced[k], want_reduce):
                    problems.append(f"{name} async={async_op} call {k}: reduce_scatter differs ({ranks})")
            # in place: the output is this rank's own half of the input
            full = _inputs(dist.get_rank(), 1)[0][:size * N].clone()
            want = everyone[0][0][me * N:(me + 1) * N].clone()
            for r in range(1, size):
                want += everyone[0][r][me * N:(me + 1) * N]
            out = full[me * N:(me + 1) * N]
            work = comm.reduce_scatter(out, full, group, async_op=async_op)
            if work is not None:
                work.wait()
            if not torch.equal(out, want):
                problems.append(f"{name} async={async_op}: in-place reduce_scatter differs")
            exchanges.clear()
    return problems


def test_all_gather_and_reduce_scatter_equal_torch():
    for rank, problems in enumerate(run_distributed(_worker, 4, timeout=90)):
        assert not problems, f"rank {rank}: {problems}"
