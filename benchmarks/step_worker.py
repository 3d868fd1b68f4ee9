"""One rank of one timed run of the shardfusion (or DDP) step, for `benchmarks/paired_commits.py`.

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 PYTHONPATH=TREE \\
        python benchmarks/step_worker.py --out R.json --regime comm --warmup 3 --steps 20

It imports nothing of `benchmarks` and only the stable public API of `shardfusion` (``fully_shard``, ``Topology``,
``set_is_last_backward``, ``clip_grad_norm_``, ``models.gpt``), so the same file times the step of any tree whose
``shardfusion`` is first on ``PYTHONPATH``: an older commit's and today's are measured by one harness. The step is
`benchmarks/variants.py`'s: forward, backward, clip to norm 1.0, AdamW ``step()``, ``zero_grad(set_to_none=True)``,
on a GPT of `benchmarks/compare.py`'s regime shape built under seed 42, random token ids per rank. A step's time is
the slowest rank's (an all-reduce MAX of the per-step times after the run), its CPU time the sum over the ranks of
each process's CPU seconds in it (``time.process_time``: every thread, gloo's included; the figure a busy machine
moves least); rank 0 writes ``{"step_s": [...], "cpu_s": [...], "loss": [...], "shardfusion": <path of the imported
package>}`` to ``--out``. ``--variant ddp`` times DDP's step instead, ``--spin F`` ends every step with a busy loop of
F times its CPU seconds (a known slowdown, for calibrating the guard), ``--cprofile PATH`` profiles rank 0's timed
steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

REGIMES = {  # (batch, seq, n_layer, d_model, n_head): benchmarks/compare.py's REGIMES
    "comm": (1, 64, 8, 256, 4),
    "compute": (8, 256, 4, 256, 4),
    "tiny": (1, 16, 2, 32, 2),
}


def _build(variant: str, regime: str, outer: int, reshard: str):
    import shardfusion as sf
    from shardfusion.models.gpt import GPT, Block, GPTConfig

    _, seq, n_layer, d_model, n_head = REGIMES[regime]
    torch.manual_seed(42)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq))
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        return model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    topo = sf.Topology(sharding=-1, fsdp_outer_degree=outer)
    sf.fully_shard(model, topo, units=(Block,), reshard_policy=reshard)
    sf.set_is_last_backward(model, True)
    return model, lambda: sf.clip_grad_norm_(model, 1.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variant", default="shardfusion", choices=("shardfusion", "ddp"))
    p.add_argument("--regime", default="comm", choices=sorted(REGIMES))
    p.add_argument("--outer", type=int, default=2)
    p.add_argument("--reshard", default="after_forward")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cprofile", default=None, help="rank 0 writes the cProfile stats of its timed steps here")
    p.add_argument("--spin", type=float, default=0.0,
                   help="calibration: each step ends with a busy loop of this fraction of its CPU seconds so far")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, clip = _build(args.variant, args.regime, args.outer, args.reshard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, seq = REGIMES[args.regime][:2]
    gen = torch.Generator().manual_seed(43 + rank)
    tokens = [torch.randint(0, 256, (batch, seq + 1), generator=gen) for _ in range(args.warmup + args.steps)]
    times, cpu, losses = [], [], []
    profiler = None
    for i, tok in enumerate(tokens):  # tok: (B, T+1) int64
        if i == args.warmup:
            dist.barrier()
            if args.cprofile and rank == 0:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = model(tok[:, :-1], tok[:, 1:])
        loss.backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.spin:  # a known slowdown: the guard must see it (benchmarks/paired_commits.py --candidate-spin)
            end = time.process_time() * (1 + args.spin) - args.spin * c0
            while time.process_time() < end:
                pass
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            losses.append(float(loss.detach()))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.cprofile)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c = torch.tensor(cpu, dtype=torch.float64)
    dist.all_reduce(c, op=dist.ReduceOp.SUM)
    if rank == 0:
        import shardfusion

        with open(args.out, "w") as f:
            json.dump({"step_s": t.tolist(), "cpu_s": c.tolist(), "loss": losses,
                       "shardfusion": os.path.dirname(shardfusion.__file__)}, f)
    dist.barrier()
    os._exit(0)  # as benchmarks/spawn.py: a gloo process group's destructor may abort a normal exit


if __name__ == "__main__":
    main()
