"""Bytes per training step by category under tensor and context parallel: the FSDP/HSDP and context-parallel
collectives (shardfusion's own accounting, ``sf.comm.CommCounter``) next to the tensor-parallel all-reduces that
torch's DTensor issues (which that accounting does not see: they are ``torch.ops._c10d_functional`` ops, counted
here by a dispatch mode), against the formulas of docs/tensor-parallel.md and docs/context-parallel.md.

    python -m benchmarks.parallel_comm --nproc 4 --mp 2 --cp 1 --outer 1 [--preset tiny --batch 4 --seq 32]

One step of the reference GPT (AdamW, clipping) after a warm-up step, on CPU with gloo; prints a table and writes
``benchmarks/results/parallel-comm.md`` (one section per run, appended). Per-rank figures of rank 0; "payload" is the tensor each collective reduces
(bytes), "wire" what a ring sends per rank (2 (n-1)/n x payload for an all-reduce).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.spawn import join, run_workers

RESULTS = Path(__file__).resolve().parent / "results" / "parallel-comm.md"
_COLLECTIVES = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                "reduce_scatter_tensor": "reduce_scatter"}


class FunctionalCollectives(TorchDispatchMode):
    """Counts the functional collectives (DTensor's redistributions) dispatched on this thread: ``{op: [count,
    payload bytes]}``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            op = _COLLECTIVES.get(func._opname)
            if op is not None:
                entry = self.ops.setdefault(op, [0, 0])
                entry[0] += 1
                entry[1] += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _worker(opts: dict) -> dict:
    import shardfusion as sf
    from shardfusion.context_parallel import sequence_chunk
    from shardfusion.models import GPT, PRESETS, Block
    from shardfusion.models.gpt_parallel import parallelize

    join("cpu")
    torch.set_num_threads(1)
    topo = sf.Topology(mp=opts["mp"], cp=opts["cp"], fsdp_outer_degree=opts["outer"])
    config = dataclasses.replace(PRESETS[opts["preset"]], seq_len=opts["seq"], fused_qkv=False,
                                 n_experts=opts["experts"])
    torch.manual_seed(0)
    model = GPT(config, context_group=topo.get_group("context"))
    model = sf.fully_shard(parallelize(model, topo.get_mesh("mp")), topo, units=(Block,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(topo.data_parallel_rank)
    x = torch.randint(0, 256, (opts["batch"], opts["seq"]), generator=g)  # (B, T) whole sequences
    x = sequence_chunk(x, topo.context_rank, topo.sep * topo.cp)  # (B, T / cp) this rank's part

    def step():
        loss = model(x, x)[1]
        loss.backward()
        sf.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    functional = FunctionalCollectives()
    with sf.comm.CommCounter() as counter, functional:
        step()
    return {"fsdp": counter.summary(), "tp": functional.ops, "layout": topo.describe(),
            "n_layer": config.n_layer, "d_model": config.d_model, "n_head": config.n_head}


def _report(opts: dict, r: dict) -> str:
    mp, cp = opts["mp"], opts["cp"]
    tokens = opts["batch"] * opts["seq"] // cp  # this rank's tokens
    act = tokens * r["d_model"] * 4  # one (B, T / cp, C) fp32 activation, bytes
    expected = 4 * r["n_layer"]  # 2 forward + 2 backward all-reduces per block (docs/tensor-parallel.md)
    kv = opts["batch"] * opts["seq"] * r["d_model"] // mp * 4  # K (or V) of the whole sequence, this rank's heads
    lines = [f"## mp {mp}, cp {cp}, outer {opts['outer']}\n",
             f"`python -m benchmarks.parallel_comm --nproc {opts['nproc']} --mp {mp} --cp {cp} --outer "
             f"{opts['outer']} --preset {opts['preset']} --batch {opts['batch']} --seq {opts['seq']} --experts "
             f"{opts['experts']}` ({r['layout']}; rank 0, one step after a warm-up).\n",
             "| category | count | payload bytes | wire bytes per rank |", "|---|---|---|---|"]
    for op, (count, payload) in sorted(r["tp"].items()):
        wire = payload * 2 * (mp - 1) / mp if op == "all_reduce" else payload
        lines.append(f"| tensor-parallel {op} (mp {mp}) | {count} | {payload:,} | {wire:,.0f} |")
    for category, s in r["fsdp"].items():
        if s["count"]:
            lines.append(f"| {category} | {s['count']:.0f} | {s['bytes']:,.0f} | {s['wire_bytes']:,.0f} |")
    tp_count, tp_payload = r["tp"].get("all_reduce", [0, 0])
    lines.append("")
    if mp > 1:
        lines.append(f"Tensor parallel: 4 all-reduces per block x {r['n_layer']} blocks = {expected}, each of one "
                     f"(B, T / cp, C) fp32 activation = {act:,} bytes, {expected * act:,} bytes in all; measured "
                     f"{tp_count} and {tp_payload:,}.")
    if cp > 1:
        got = r["fsdp"]["context_parallel"]
        lines.append(f"Context parallel: per block an all-gather of K and of V and a reduce-scatter of each gradient = "
                     f"{4 * r['n_layer']} collectives of the whole sequence's K or V ({kv:,} bytes: B x T x C / mp x 4), "
                     f"{4 * r['n_layer'] * kv:,} bytes in all, each rank sending (cp - 1) / cp of it; measured "
                     f"{got['count']:.0f} and {got['bytes']:,.0f}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--mp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--outer", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--experts", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    opts = vars(parser.parse_args(argv))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_workers(_worker, (opts,), opts["nproc"])
    if results is None:
        return 1
    text = _report(opts, results[0])
    print(text)
    if not opts["no_write"]:
        head = "# Bytes per step under tensor and context parallel\n"
        old = RESULTS.read_text() if RESULTS.exists() else head
        RESULTS.write_text((old if old.startswith(head) else head) + "\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
