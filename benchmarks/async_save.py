"""Asynchronous checkpoint saves against synchronous ones: how long the step loop stops per save, paired in one run.

    python -m benchmarks.async_save            # 4 gloo workers, GPT "medium" under HSDP 2 x 2; results/async-save.*
    python -m benchmarks.async_save --preset tiny --pairs 2 --every 2 --name x   # a smoke run
    python -m benchmarks.async_save --device cuda --nproc 1 --outer 1 --name async-save-cuda   # one GPU

One job of ``--nproc`` workers trains a dense GPT (``--preset``) under HSDP (``--outer`` x the rest) with AdamW and
saves a checkpoint every ``--every`` steps, alternately with ``save_checkpoint`` and ``save_checkpoint(...,
async_save=True)``: pairs of saves of the same run, on the same disk, under the same load; the order within a pair
alternates from pair to pair. As the training job does, each save first waits for the asynchronous save in flight
(inside ``save_checkpoint``). Figures per save, each the slowest rank's (the step loop goes on when the last rank
does), ranks aligned by a barrier before each save:

- ``sync_s``: the seconds ``save_checkpoint`` takes (the step loop stops for all of it);
- ``stall_s``: what an asynchronous save stops the loop for: its ``save_checkpoint`` call (``call_s``; of it the
  staging copy made on the calling thread, ``staging_s``: the tensors not copied behind), the optimizer steps'
  waits for the staging copy made behind the loop (``staged_wait_s``: the step pre-hook's ``wait_staged``), and
  the wait for its write in the next save (``wait_s``; about 0 when the write had ended; the last save's: the wait
  at the end of the run);
- ``behind_s``: the seconds of the staging copy made behind the loop, on the staging thread;
- ``write_s``: from the call to the end of the background write and DCP's commit on that rank.

Also the step seconds of steps that began while a background write ran and of the others (the write shares the CPU
with the steps). The result: the ratio of the medians, stall over synchronous save (the goal: <= 0.10), and each
pair's ratio; and a check that a synchronous and an asynchronous save of the same state are equal, bitwise, while
the model trains on during the write.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))
from benchmarks.provenance import RunRecord, describe, write_result  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOAL = 0.10
"""The issue's goal: an asynchronous save stops the step loop for at most this fraction of a synchronous one."""


def _time_calls(owner: type, name: str, record: Callable[[Any, float], None]) -> None:
    """Replace the method ``owner.name`` by one that also passes each call's seconds to ``record(self, seconds)``
    (after the call, also when it raised)."""
    method = getattr(owner, name)

    def timed(self, *args):
        t = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            record(self, time.perf_counter() - t)
    setattr(owner, name, timed)


def _instrument(staging: list[float], waits: list[float]) -> None:
    """Time the asynchronous save's parts:

    - each staging copy on the calling thread (the stager's ``stage``), appended to ``staging``;
    - on each handle, its staging copy made behind the loop (``behind_s``: the stager's staging thread; 0 when
      nothing was copied behind) and the sum of its waits for that copy (``staged_wait_s``:
      ``AsyncSave.wait_staged``, which the optimizer step's pre-hook calls);
    - on each handle, the time its background write and commit ended (``written_at``, before the publish);
    - each wait for a save's own part (``AsyncSave.local_outcome``: inside the next save, or in ``wait()``),
      appended to ``waits``.
    """
    from shardfusion.checkpoint import background

    _time_calls(background._Stager, "stage", lambda _, s: staging.append(s))
    _time_calls(background._Stager, "_behind_loop", lambda stager, s: setattr(stager._handle, "behind_s", s))
    background.AsyncSave.behind_s = 0.0
    _time_calls(background.AsyncSave, "wait_staged",
                lambda handle, s: setattr(handle, "staged_wait_s", getattr(handle, "staged_wait_s", 0.0) + s))
    _time_calls(background.AsyncSave, "local_outcome", lambda _, s: waits.append(s))
    written = background.AsyncSave._written

    def timed_write(self, future) -> None:
        self.written_at = time.perf_counter()
        written(self, future)
    background.AsyncSave._written = timed_write


class _Run:
    """One rank's model, optimizer and timers; ``train`` runs ``--every`` steps, ``save`` one timed save."""

    def __init__(self, args: argparse.Namespace, folder: str) -> None:
        import torch
        import torch.distributed as dist
        import shardfusion as sf
        from benchmarks.spawn import join
        from shardfusion.models.gpt import GPT, PRESETS, Block

        self.args, self.folder, self.device = args, folder, join(args.device)
        topo = sf.Topology(sharding=dist.get_world_size(), fsdp_outer_degree=args.outer)
        torch.manual_seed(0)
        self.model = sf.fully_shard(GPT(PRESETS[args.preset]).to(self.device), topo, units=(Block,))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.seq, self.step = PRESETS[args.preset].seq_len, 0
        self.staging: list[float] = []
        self.waits: list[float] = []
        _instrument(self.staging, self.waits)
        self.saves: list[dict[str, Any]] = []
        self.steps: dict[str, list[float]] = {"writing": [], "idle": []}
        self.pending: Optional[tuple] = None  # (record, handle) of the asynchronous save in flight

    def sync(self) -> None:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train(self) -> None:
        """--every steps, each timed and filed by whether a background write ran at its start."""
        import torch
        for _ in range(self.args.every):
            writing = self.pending is not None and not self.pending[1].done()
            t = time.perf_counter()
            x = torch.randint(0, 256, (self.args.batch, self.seq), generator=torch.Generator().manual_seed(self.step))
            self.model(x.to(self.device), x.to(self.device))[1].backward()
            self.opt.step()
            self.opt.zero_grad()
            self.sync()
            self.step += 1
            self.steps["writing" if writing else "idle"].append(time.perf_counter() - t)

    def save(self, kind: str, root: str, record: Optional[dict] = None):
        """One save of ``kind`` into ``root``, the ranks aligned first; as the job does, it first waits for the
        asynchronous save in flight (inside ``save_checkpoint``), whose record takes that wait. Returns the
        handle of an asynchronous save."""
        import torch.distributed as dist
        import shardfusion as sf
        self.sync()
        dist.barrier()
        count, self.waits[:] = len(self.staging), []
        t = time.perf_counter()
        saved = sf.checkpoint.save_checkpoint(self.model, self.opt, root, self.step, keep=2,
                                              async_save=kind == "async")
        self.sync()
        total, waited = time.perf_counter() - t, sum(self.waits)
        self._settle(waited)
        if record is not None:
            key = "sync_s" if kind == "sync" else "call_s"
            record.update({key: total - waited, "step": self.step, "t0": t, "staging_s": sum(self.staging[count:])})
            self.saves.append(record)
            if kind == "async":
                self.pending = (record, saved)
        return saved

    def finish(self) -> None:
        """Wait for the save in flight (as the job does at its end), its record taking the wait."""
        if self.pending is not None:
            self.waits[:] = []
            self.pending[1].wait()
            self._settle(sum(self.waits))

    def _settle(self, waited: float) -> None:
        if self.pending is not None:
            record, handle = self.pending
            record["wait_s"], record["write_s"] = waited, handle.written_at - record["t0"]
            record["staged_wait_s"] = getattr(handle, "staged_wait_s", 0.0)
            record["behind_s"] = handle.behind_s
            self.pending = None


def worker(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    """One rank: train and save ``2 * pairs`` times, then check one pair of saves of the same state; returns this
    rank's seconds per save and per step."""
    import torch
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion.models.gpt import GPT, PRESETS

    run = _Run(args, folder)
    for pair in range(args.pairs):
        for kind in (("sync", "async") if pair % 2 == 0 else ("async", "sync")):
            run.train()
            run.save(kind, f"{folder}/{kind}", {"kind": kind, "pair": pair})
    run.train()  # the last save's write runs behind these steps too, as in a run that goes on
    run.finish()
    # the check: a synchronous and an asynchronous save of the same state, steps taken while the write runs
    run.save("sync", f"{folder}/check-sync")
    handle = run.save("async", f"{folder}/check-async")
    run.train()
    handle.wait()
    equal = None
    if dist.get_rank() == 0:
        mine, theirs = (sf.checkpoint.read_all(f"{folder}/check-{kind}/step-{handle.step}")
                        for kind in ("async", "sync"))
        equal = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    dist.barrier()
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(PRESETS[args.preset]).parameters())
    return {"saves": run.saves, "steps": run.steps, "params": params, "equal": equal,
            "staging_bytes": sf.checkpoint.staging_bytes(run.model, run.opt),
            "checkpoint_bytes": sf.checkpoint.checkpoint_bytes(f"{folder}/check-sync/step-{handle.step}")}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The slowest rank's seconds per save, the pairs' ratios and the medians."""
    saves = []
    for i, first in enumerate(per_rank[0]["saves"]):
        every = [r["saves"][i] for r in per_rank]
        keys = ("sync_s",) if first["kind"] == "sync" else ("call_s", "staging_s", "wait_s", "staged_wait_s",
                                                            "behind_s", "write_s")
        save = {"kind": first["kind"], "pair": first["pair"], "step": first["step"],
                **{k: max(s[k] for s in every) for k in keys}}
        if first["kind"] == "async":
            save["stall_s"] = max(s["call_s"] + s["wait_s"] + s["staged_wait_s"] for s in every)
        saves.append(save)
    pairs = []
    for pair in sorted({s["pair"] for s in saves}):
        sync, asynchronous = (next(s for s in saves if s["pair"] == pair and s["kind"] == k) for k in ("sync", "async"))
        pairs.append({"pair": pair, "sync_s": sync["sync_s"], "stall_s": asynchronous["stall_s"],
                      "ratio": asynchronous["stall_s"] / sync["sync_s"]})
    median = {k: statistics.median(s[k] for s in saves if k in s)
              for k in ("sync_s", "stall_s", "call_s", "staging_s", "staged_wait_s", "behind_s", "wait_s", "write_s")}
    steps = {k: statistics.median(t for r in per_rank for t in r["steps"][k]) if any(r["steps"][k] for r in per_rank)
             else None for k in ("writing", "idle")}
    return {"saves": saves, "pairs": pairs, "median": median, "ratio": median["stall_s"] / median["sync_s"],
            "pair_ratios": [p["ratio"] for p in pairs], "step_s": steps, "goal": GOAL,
            "staging_bytes_max": max(r["staging_bytes"] for r in per_rank),
            "checkpoint_bytes": per_rank[0]["checkpoint_bytes"], "params": per_rank[0]["params"],
            "async_equals_sync": per_rank[0]["equal"]}


def markdown(result: dict[str, Any]) -> str:
    s, a = result["summary"], result["args"]
    m = s["median"]
    lines = [f"# Asynchronous checkpoint saves: {result['name']}", "",
             f"`{result['command']}`: a dense GPT \"{a['preset']}\" ({s['params']:,} parameters, AdamW) on "
             f"{a['nproc']} {'gloo workers (CPU)' if a['device'] == 'cpu' else 'NCCL workers (CUDA)'}, HSDP "
             f"outer {a['outer']}; a save every {a['every']} steps, synchronous and "
             f"asynchronous alternately, {a['pairs']} pairs. Checkpoint {s['checkpoint_bytes'] / 2**20:.1f} MiB; "
             f"staging copy {s['staging_bytes_max'] / 2**20:.1f} MiB on the rank that writes most.", "",
             describe(result["env"]), "",
             "Seconds per save, the slowest rank's, median over the saves:", "",
             "| figure | seconds |", "|---|---|",
             f"| synchronous save (the loop stops for all of it) | {m['sync_s']:.3f} |",
             f"| asynchronous save: the loop's stall (call + waits) | {m['stall_s']:.3f} |",
             f"| of it the call (checks and gathers, staging copy, the write started) | {m['call_s']:.3f} |",
             f"| of the call the staging copy on the calling thread | {m['staging_s']:.3f} |",
             f"| of it the optimizer steps' wait for the staging copy made behind | {m['staged_wait_s']:.3f} |",
             f"| of it the wait at the next save | {m['wait_s']:.3f} |",
             f"| the staging copy made behind the loop (its thread) | {m['behind_s']:.3f} |",
             f"| the background write (from the call to the end of DCP's commit) | {m['write_s']:.3f} |", "",
             f"Stall over synchronous save: {s['ratio']:.3f} (goal <= {s['goal']:.2f}); per pair: "
             + ", ".join(f"{r:.3f}" for r in s["pair_ratios"]) + ".", "",
             "Check: a synchronous and an asynchronous save of the same state, steps taken while the write ran: "
             + ("equal key by key, bitwise." if s["async_equals_sync"] else "NOT EQUAL."), ""]
    if s["step_s"]["writing"] is not None:
        lines += [f"Step seconds (median over ranks and steps): {s['step_s']['idle']:.3f} for a step begun without "
                  f"a background write, {s['step_s']['writing']:.3f} for one begun while a write ran (it shares the "
                  f"CPU with the step).", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium", help="the GPT's preset (shardfusion.models.gpt.PRESETS)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo workers; cuda: one worker per GPU, NCCL (the staging copy goes to pinned "
                             "host memory)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--outer", type=int, default=2, help="HSDP outer degree")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of saves (synchronous, asynchronous)")
    parser.add_argument("--every", type=int, default=3, help="steps between saves")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--name", default="async-save")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.every < 1 or args.nproc < 1 or args.outer < 1 or args.nproc % args.outer:
        parser.error(f"--pairs ({args.pairs}) and --every ({args.every}) must be >= 1, --outer ({args.outer}) must "
                     f"divide --nproc ({args.nproc})")
    from benchmarks.spawn import run_workers
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="shardfusion-async-save-", dir=args.dir) as folder, RunRecord() as env:
        per_rank = run_workers(worker, (args, folder), args.nproc)
    if per_rank is None:
        return 1
    given = list(argv if argv is not None else sys.argv[1:])
    own = [a for i, a in enumerate(given) if not (a.startswith("--out-dir") or a.startswith("--dir") or
                                                   (i and given[i - 1] in ("--out-dir", "--dir")))]
    result = {"name": args.name, "command": "python -m benchmarks.async_save" + "".join(f" {a}" for a in own),
              "args": {k: v for k, v in vars(args).items() if k not in ("dir", "out_dir")}, "env": env.as_dict(),
              "summary": summarize([per_rank[r] for r in sorted(per_rank)])}
    write_result(Path(args.out_dir), args.name, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
