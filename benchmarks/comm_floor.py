"""The CPU floor of a step's collectives: DDP's all-reduce against HSDP 2 x 2's collective set, no model.

    python -m benchmarks.comm_floor --rounds 3 --name comm-floor

One "step" is the collectives of one training step of the ``comm`` regime's GPT (8 blocks of 789,760 fp32 elements
and a root unit of 82,432; `benchmarks/variants.py`, ``unit_sizes``), resharded after backward, on 4 gloo ranks:

- ``ddp``: what DDP moves: one all-reduce of the whole gradient over the 4 ranks, in DDP's buckets (the first of
  1 MiB, then 25 MiB), divided by 4.
- ``pairs-torch``: what HSDP 2 x 2 moves, written with torch's calls directly: per unit, in forward (prefetching
  one unit ahead) an all-gather over the inner pair (an ``isend`` of the shard, an ``irecv`` into the peer's half,
  a copy of the own half), in backward a reduce-scatter over the pair's reduce group (an ``isend`` of the peer's
  half, an ``irecv``, an add and a divide by 4) and, once it completed, an all-reduce of the shard over the outer
  pair. The bytes across the links equal DDP's: each rank sends 1.5 P elements either way.
- ``pairs-shardfusion``: the same set through ``shardfusion.comm`` (the calls the library makes:
  [Note: gloo collectives as sends and receives] in ``shardfusion/comm.py``), on a ``Topology``'s groups.

There is no compute, so the wall time is not a step's; the CPU seconds are what the collectives cost the machine
(every thread of every rank, ``time.process_time``). ``pairs-torch`` against ``ddp`` is the floor any HSDP 2 x 2
on gloo pays beyond DDP for the same bytes (more, smaller messages); ``pairs-shardfusion`` against
``pairs-torch`` is the cost of shardfusion's communication layer. The step's own overhead beyond these is the rest of
the gap in `benchmarks/thread_cpu.py` (docs/benchmarks.md, "The collectives' floor").
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.rounds import add_run_args, interleaved, paired_summary, run_and_store

ROOT, BLOCK, BLOCKS = 82_432, 789_760, 8
"""The comm regime's unit sizes in elements (``benchmarks.variants.unit_sizes``), checked by the worker."""
VARIANTS = ("ddp", "pairs-torch", "pairs-shardfusion")
DDP_BUCKETS = (1 << 20, 25 << 20)  # bytes: DDP's first bucket, then its bucket_cap_mb default


def _ddp_step(flat: torch.Tensor) -> None:
    first = DDP_BUCKETS[0] // flat.element_size()
    pieces = [flat[:first]] + list(flat[first:].split(DDP_BUCKETS[1] // flat.element_size()))
    import torch.distributed as dist

    works = [dist.all_reduce(p, async_op=True) for p in pieces]
    for w, p in zip(works, pieces):
        w.wait()
        p.div_(4)


class _Pairs:
    """HSDP 2 x 2's collectives for units of ``sizes`` elements, with torch's calls or with shardfusion.comm."""

    def __init__(self, sizes: list[int], library: bool) -> None:
        import torch.distributed as dist

        import shardfusion as sf

        topo = sf.Topology(sharding=-1, fsdp_outer_degree=2)
        self.inner, self.reduce = topo.get_group("fsdp_inner"), topo.get_reduce_group("fsdp_inner")
        self.outer = topo.get_group("replicate")
        self.me = dist.get_rank(self.inner)
        self.peer = dist.get_global_rank(self.inner, 1 - self.me)
        self.reduce_me = dist.get_rank(self.reduce)
        self.reduce_peer = dist.get_global_rank(self.reduce, 1 - self.reduce_me)
        self.sizes, self.library = sizes, library
        self.shards = [torch.randn(n // 2) for n in sizes]  # (n/2,) this rank's half of each unit
        self.grads = [torch.randn(n) for n in sizes]  # (n,) each unit's full gradient

    def _gather(self, k: int):
        from shardfusion import comm

        full, shard, half = torch.empty(self.sizes[k]), self.shards[k], self.sizes[k] // 2
        if self.library:
            return comm.all_gather(full, shard, self.inner, async_op=True), full
        import torch.distributed as dist

        works = [dist.isend(shard, self.peer, group=self.inner, tag=k),
                 dist.irecv(full[(1 - self.me) * half:(2 - self.me) * half], self.peer, group=self.inner, tag=k)]
        full[self.me * half:(self.me + 1) * half].copy_(shard)
        return works, full

    def _reduce(self, k: int):
        from shardfusion import comm

        grad, half = self.grads[k], self.sizes[k] // 2
        out = torch.empty(half)
        if self.library:
            return comm.reduce_scatter(out, grad, self.reduce, async_op=True), out, None
        import torch.distributed as dist

        mine = self.reduce_me
        works = [dist.isend(grad[(1 - mine) * half:(2 - mine) * half], self.reduce_peer, group=self.reduce,
                            tag=100 + k),
                 dist.irecv(out, self.reduce_peer, group=self.reduce, tag=100 + k)]
        return works, out, grad[mine * half:(mine + 1) * half]

    def _all_reduce(self, pending):
        import torch.distributed as dist

        works, out, own = pending
        for w in works if isinstance(works, list) else [works]:
            w.wait()
        if own is not None:
            out.add_(own)  # the reduce-scatter's sum of the two halves
        out.div_(4)
        return dist.all_reduce(out, group=self.outer, async_op=True)

    def step(self) -> None:
        gathers = [self._gather(0)]
        for k in range(1, len(self.sizes)):  # forward, one unit prefetched
            gathers.append(self._gather(k))
            _wait(gathers[k - 1][0])
        _wait(gathers[-1][0])
        all_reduces, pending = [], None
        for k in reversed(range(len(self.sizes))):  # backward: reduce-scatter, then the previous unit's all-reduce
            issued = self._reduce(k)
            if pending is not None:
                all_reduces.append(self._all_reduce(pending))
            pending = issued
        all_reduces.append(self._all_reduce(pending))
        for w in all_reduces:
            w.wait()


def _wait(works) -> None:
    for w in works if isinstance(works, list) else [works]:
        w.wait()


def _worker(variant: str, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from benchmarks.spawn import join
    from benchmarks.step_worker import REGIMES
    from benchmarks.variants import unit_sizes
    from shardfusion.models.gpt import GPTConfig

    join("cpu")
    _, seq, n_layer, d_model, n_head = REGIMES["comm"]
    root, blocks = unit_sizes(GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq))
    if (root, blocks) != (ROOT, [BLOCK] * BLOCKS):
        raise SystemExit(f"comm_floor: the comm regime's units are {root}, {blocks}; update ROOT, BLOCK, BLOCKS")
    sizes = [root] + blocks
    if variant == "ddp":
        flat = torch.randn(sum(sizes))  # (P,)
        step = lambda: _ddp_step(flat)  # noqa: E731
    else:
        step = _Pairs(sizes, library=variant == "pairs-shardfusion").step
    cpu, wall = [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"wall_s": wall, "cpu_s": cpu}


def run(args) -> dict:
    rounds, env = interleaved(_worker, VARIANTS, args.rounds, lambda name: (name, args.warmup, args.steps), args.steps)
    return {"config": vars(args), "env": env, "rounds": rounds, "summary": paired_summary(rounds, VARIANTS)}


def report(result: dict) -> str:
    from benchmarks.provenance import describe

    s, cfg = result["summary"], result["config"]
    lines = [f"# The collectives' CPU floor: {cfg['name']}", "",
             f"4 gloo ranks, the collectives of one comm-regime step resharded after backward, no model; "
             f"{cfg['rounds']} rounds x ({cfg['warmup']} warm-up + {cfg['steps']} timed steps), variants interleaved; "
             "medians. CPU: seconds per step summed over the 4 ranks, every thread.", "", describe(result["env"]), "",
             "| variant | CPU ms per step | vs DDP (paired) | wall ms |", "|---|---|---|---|"]
    for name, v in s.items():
        lines.append(f"| {name} | {1e3 * v['cpu_s']:.1f} | {v['cpu_s_vs_ddp']:.3f} | {1e3 * v['wall_s']:.1f} |")
    lines += ["", "`pairs-torch` - `ddp`: the floor of HSDP 2 x 2's collectives on gloo beyond DDP's for the same "
              "bytes; `pairs-shardfusion` - `pairs-torch`: shardfusion's communication layer.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, "comm-floor")
    run_and_store(p, run, report, argv)


if __name__ == "__main__":
    main()
