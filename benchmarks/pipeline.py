"""Pipeline parallel: shardfusion stages (`sf.fully_shard` + `sf.pipeline.PipelineStage`) against PyTorch FSDP2
stages (`torch.distributed.fsdp.fully_shard` + torch's own `PipelineStage`), the same GPT split, the same torch
schedule, the same data, side by side in one run.

    python -m benchmarks.pipeline                     # CPU: 4 gloo workers, pp 2 x sharding 2
    python -m benchmarks.pipeline --schedules 1f1b --microbatches 2 --study-microbatches "" \\
        --repeats 1 --warmup 0 --steps 1 --n-layer 2 --d-model 32 --n-head 2 --seq 16      # smoke run

Cases: every schedule of ``--schedules`` (torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B; the
interleaved one with two stages per pp rank) at ``--microbatches`` micro-batches with blocks resharded after forward,
plus the reshard-policy study: Schedule1F1B at each of ``--study-microbatches`` under both ``after_forward`` and
``after_backward``. In every case both variants run:

- ``shardfusion``: each stage (``split_gpt``) wrapped by ``sf.fully_shard(stage, topo, units=(Block,),
  reshard_policy=...)`` and driven through ``sf.pipeline.PipelineStage``; ``sf.clip_grad_norm_`` over the stages of
  the rank (one norm over the whole model);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each block of the stage (``reshard_after_forward`` True under
  ``after_forward``, False under ``after_backward``) then on the stage module (its default: the root stays gathered
  from forward to backward), over the ``shard`` dimension of a ``(pp, replicate, shard)`` device mesh laid out as
  shardfusion's Topology; torch's ``PipelineStage`` (which special-cases FSDP2: no gradient sync until its
  ``perform_reduce_grad``); clipping by the global norm: ``torch.nn.utils.get_total_norm`` over the DTensor
  gradients, its square summed over the pp group, ``clip_grads_with_norm_``.

Method (as ``benchmarks/compare.py``): each repeat runs every case, its two variants back to back (the order of the
cases rotates by one each repeat, the two variants swap each repeat); each variant is built fresh under the same seed,
runs ``--warmup`` steps, a barrier, ``--steps`` timed steps. A step is ``schedule.step``, clipping,
``optimizer.step()``, ``zero_grad(set_to_none=True)``; its time is the slowest rank's. On every rank the time spent
in the stage's work (``forward_one_chunk``, ``backward_one_chunk``, ``perform_reduce_grad``: compute and the
data-parallel collectives issued inside them) is summed; the rest of ``schedule.step`` is the measured bubble (waits
for activations and gradients from the neighbour stage, the schedule's own work). After the first repeat's timed
steps each variant runs three untimed instrumented steps: one under ``benchmarks.measure.CollectiveRecorder`` (every
c10d op, P2P sends and receives included; each tagged with the stage action it ran in), sampling the library's full
parameter and gradient buffers after every op; two under ``torch.profiler`` with ``profile_memory=True``, whose CPU
allocation events give the second step's peak allocated bytes over its start (the first one only makes every block
freed in the second known to the profiler), and the part of the step where it was reached (a stage action and its
micro-batch, clipping or the optimizer step). Results: ``<out-dir>/<name>.json`` (raw and
summary) and ``<name>.md`` (``benchmarks/report.py``, ``pipeline_summary``); docs/pipeline-benchmark.md reads them.
CPU and gloo only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (also in the spawned workers)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.measure import CollectiveRecorder
from benchmarks.provenance import RunRecord

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("shardfusion", "fsdp2")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
POLICIES = ("after_forward", "after_backward")
VOCAB = 256  # the GPT's byte vocabulary
MAX_NORM, LR = 1.0, 1e-3


@dataclass(frozen=True)
class Case:
    """One schedule, micro-batch count and reshard policy; both variants run it."""

    schedule: str
    micro: int
    reshard: str

    @property
    def name(self) -> str:
        return f"{self.schedule}-M{self.micro}-{self.reshard}"

    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved" else 1


def cases_of(schedules: list[str], micro: int, study: list[int]) -> list[Case]:
    """The run's cases: each schedule at ``micro`` under ``after_forward``, then 1F1B at each of ``study`` under
    both policies (without duplicates)."""
    out = [Case(s, micro, "after_forward") for s in schedules]
    out += [Case("1f1b", m, r) for m in study for r in POLICIES]
    return list(dict.fromkeys(out))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ",".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of the schedule comparison")
    p.add_argument("--study-microbatches", default="4,8",
                   help="micro-batch counts of the reshard-policy study (1F1B, after_forward and after_backward); "
                        "empty: no study")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3, help="rounds over all cases")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant per repeat")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per repeat")
    p.add_argument("--nproc", type=int, default=4, help="local gloo workers")
    p.add_argument("--pp", type=int, default=2, help="pipeline degree; sharding = nproc / (pp x outer)")
    p.add_argument("--outer", type=int, default=1, help="HSDP replicas within a stage (replicate all-reduce)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--mb-rows", type=int, default=1, help="sequences per micro-batch per data-parallel rank")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per worker, the same for every variant (default: cores / workers, at least 1)")
    p.add_argument("--seed", type=int, default=42, help="model seed; data-parallel rank d's batches use seed + 1 + d")
    p.add_argument("--name", default="pipeline-cpu", help="result file stem")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    args.schedule_list = [s for s in args.schedules.split(",") if s]
    args.study_list = [int(m) for m in args.study_microbatches.split(",") if m.strip()]
    args.variant_list = [v for v in args.variants.split(",") if v]
    for s in args.schedule_list:
        if s not in SCHEDULES:
            p.error(f"--schedules: unknown schedule {s!r}; pick from {SCHEDULES}")
    for v in args.variant_list:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; pick from {VARIANTS}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.microbatches < 1:
        p.error("--repeats, --steps and --microbatches must be >= 1, --warmup >= 0")
    if args.nproc % (args.pp * args.outer):
        p.error(f"--nproc {args.nproc} is not a multiple of --pp x --outer ({args.pp * args.outer})")
    most = max([c.stages_per_rank() for c in cases_of(args.schedule_list, args.microbatches, args.study_list)] or [1])
    if args.n_layer % (args.pp * most):
        p.error(f"--n-layer {args.n_layer} does not split into {args.pp * most} stages")
    return args


# ---- worker -----------------------------------------------------------------------------------------------------
def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _ranks(group) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group)))


@dataclass
class Piped:
    """One variant's stages on this rank, ready to step."""

    name: str
    models: list  # the stage modules (wrapped)
    stages: list  # their PipelineStages
    schedule: object
    optimizer: torch.optim.Optimizer
    clip: Callable[[], object]
    sample_transient: Callable[[], dict[str, int]]
    has_first: bool
    has_last: bool
    busy_s: float = 0.0
    phase: Optional[str] = None  # the stage action running now: "F<stage>", "B<stage>", "R<stage>"
    profiling: bool = False  # name each action and the step's parts for the profiler (record_function)


def _timed(p: Piped, stage, method: str, tag: str) -> None:
    """Replace ``stage.<method>`` by a version that adds its wall time to ``p.busy_s`` and sets ``p.phase``."""
    inner = getattr(stage, method)

    def timed(*args, **kwargs):
        saved, p.phase = p.phase, f"{tag}{stage.stage_index}"
        t0 = time.perf_counter()
        try:
            if p.profiling:  # e.g. "B0:3": stage 0's backward of micro-batch 3
                with torch.profiler.record_function(p.phase if tag == "R" else f"{p.phase}:{args[0] if args else '?'}"):
                    return inner(*args, **kwargs)
            return inner(*args, **kwargs)
        finally:
            p.busy_s += time.perf_counter() - t0
            p.phase = saved

    setattr(stage, method, timed)


def _schedule_class(kind: str):
    from torch.distributed import pipelining as pl

    return {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B}[kind]


def _stage_modules(config, num_stages: int, mine: list[int], seed: int) -> list:
    """This rank's stage modules, each split from a GPT built under ``seed`` (the same weights on every rank)."""
    from shardfusion.models.gpt import GPT
    from shardfusion.models.gpt_pipeline import split_gpt

    out = []
    for s in mine:
        torch.manual_seed(seed)
        out.append(split_gpt(GPT(config), s, num_stages))
    return out


def _fsdp2_groups(stage_modules: list) -> list[tuple[bool, object]]:
    """``(is a stage root, FSDPParamGroup)`` of every FSDP2 module of the stages (a root without parameters has
    none)."""
    out = []
    for root in stage_modules:
        for m in [root, *root.blocks.values()]:
            pg = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            if pg is not None:
                out.append((m is root, pg))
    return out


def _fsdp2_clip(params: list, pp_group) -> torch.Tensor:
    """Clip by the norm over the whole model: the stage's DTensor norm made whole over the shard group, its square
    summed over the pp group."""
    from torch.distributed.tensor import DTensor

    grads = [q.grad for q in params if q.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    square = norm.detach() ** 2
    dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    coef = min(1.0, MAX_NORM / (float(total) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def build(case: Case, variant: str, ctx: dict) -> Piped:
    """A fresh model cut into ``case``'s stages, wrapped as ``variant``, with its schedule and optimizer."""
    import shardfusion as sf
    from shardfusion.models.gpt import Block

    topo, config = ctx["topo"], ctx["config"]
    pp = topo.pp
    num_stages = pp * case.stages_per_rank()
    mine = ctx["stage_ranks"](num_stages, pp)[topo.pp_rank]
    mods = _stage_modules(config, num_stages, mine, ctx["seed"])
    mb, T, C = ctx["mb_rows"], ctx["seq"], config.d_model
    stages = []
    if variant == "shardfusion":
        from shardfusion.pipeline import PipelineStage

        for s, m in zip(mine, mods):
            sf.fully_shard(m, topo, units=(Block,), reshard_policy=case.reshard)
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage as TorchStage

        for m in mods:
            for block in m.blocks.values():
                fully_shard(block, mesh=ctx["fsdp_mesh"], reshard_after_forward=case.reshard == "after_forward")
            fully_shard(m, mesh=ctx["fsdp_mesh"])
    for s, m in zip(mine, mods):
        hidden = torch.empty(mb, T, C, device="meta", requires_grad=True)
        inp = torch.empty(mb, T, dtype=torch.long, device="meta") if s == 0 else hidden
        outp = torch.empty(mb, T, VOCAB, device="meta", requires_grad=True) if s == num_stages - 1 else hidden
        if variant == "shardfusion":
            stages.append(PipelineStage(m, topo, s, num_stages, input_args=inp, output_args=outp,
                                        device=torch.device("cpu")))
        else:
            stages.append(TorchStage(m, s, num_stages, torch.device("cpu"), input_args=inp, output_args=outp,
                                     group=topo.get_group("pp")))
    cls = _schedule_class(case.schedule)
    schedule = cls(stages if case.schedule == "interleaved" else stages[0], n_microbatches=case.micro,
                   loss_fn=loss_fn)
    params = [q for m in mods for q in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR)
    if variant == "shardfusion":
        from benchmarks.variants import shardfusion_transient

        units = [u for m in mods for u in sf.get_units(m)]
        clip = lambda: sf.clip_grad_norm_(mods, MAX_NORM)  # noqa: E731
        sample = lambda: shardfusion_transient(units)  # noqa: E731
    else:
        from benchmarks.variants import _fsdp2_transient

        groups = _fsdp2_groups(mods)
        pp_group = topo.get_group("pp")
        clip = lambda: _fsdp2_clip(params, pp_group)  # noqa: E731
        sample = lambda: _fsdp2_transient(groups)  # noqa: E731
    p = Piped(variant, mods, stages, schedule, optimizer, clip, sample, 0 in mine, num_stages - 1 in mine)
    for st in stages:
        _timed(p, st, "forward_one_chunk", "F")
        _timed(p, st, "backward_one_chunk", "B")
        _timed(p, st, "perform_reduce_grad", "R")
    return p


def _part(p: Piped, name: str):
    """A profiler range named ``name`` while profiling, else nothing."""
    return torch.profiler.record_function(name) if p.profiling else contextlib.nullcontext()


def step(p: Piped, x: torch.Tensor, y: torch.Tensor, after_optimizer: Optional[Callable[[], None]] = None) -> dict:
    """One training step; its times on this rank and (last stage) its loss, the mean over the micro-batches."""
    losses: list = []
    args = (x,) if p.has_first else ()
    kwargs = {"target": y, "losses": losses} if p.has_last else {}
    p.busy_s = 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    p.schedule.step(*args, **kwargs)
    t1 = time.perf_counter()
    with _part(p, "clip"):
        p.clip()
    with _part(p, "optimizer.step"):
        p.optimizer.step()
    if after_optimizer is not None:
        after_optimizer()
    p.optimizer.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    loss = float(torch.stack([l.detach() for l in losses]).mean()) if losses else None
    return {"step_s": t2 - t0, "pipe_s": t1 - t0, "busy_s": p.busy_s, "cpu_s": time.process_time() - c0,
            "loss": loss}


class PhasedRecorder(CollectiveRecorder):
    """A :class:`CollectiveRecorder` that also notes, for each collective, the stage action it ran in
    (``phase_of()``: ``"F<stage>"``, ``"B<stage>"``, ``"R<stage>"`` or ``None`` between actions)."""

    def __init__(self, phase_of: Callable[[], Optional[str]], on_op=None) -> None:
        super().__init__(on_op=on_op)
        self.phase_of = phase_of
        self.phases: list[Optional[str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.collectives)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.collectives) > n:
            self.phases.append(self.phase_of())
        return out


def _storages(tensors) -> int:
    from benchmarks.measure import persistent_bytes

    return persistent_bytes({"t": tensors})["t"]


_PARTS = re.compile(r"^([FBR]\d+(:\d+)?|clip|optimizer\.step)$")
"""The names of the profiler ranges of a step's parts (``_timed``, ``_part``)."""


def _cpu_peak_growth(prof, window: str) -> tuple[int, str]:
    """The peak bytes allocated during the ``record_function(window)`` range of a ``profile_memory=True`` profile,
    over those allocated when the range began: the largest running sum of its CPU allocation events (a block
    allocated before profiling began has no event when freed, hence the range is a second step, after one whole
    step under the profiler); and the part of the step it was reached in: the innermost range of ``_PARTS``
    around it (``"schedule"``: between the stage's actions)."""
    events = list(prof.profiler.kineto_results.events())
    span = next(e for e in events if e.name() == window)
    start, end = span.start_ns(), span.start_ns() + span.duration_ns()
    mem = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.start_ns())
    run, base, peak, at = 0, None, 0, start
    for e in mem:
        if e.start_ns() >= start and base is None:
            base = peak = run
        if e.start_ns() > end:
            break
        run += e.nbytes()
        if base is not None and run > peak:
            peak, at = run, e.start_ns()
    parts = [e for e in events if _PARTS.match(e.name()) and e.start_ns() <= at <= e.start_ns() + e.duration_ns()]
    where = min(parts, key=lambda e: e.duration_ns()).name() if parts else "schedule"
    return (0 if base is None else peak - base), where


def instrument(p: Piped, batch, groups: dict) -> dict:
    """Two untimed steps (see the module doc): collectives with their actions and the full-buffer peaks; memory."""
    import shardfusion as sf
    from benchmarks.measure import optimizer_state_tensors
    from benchmarks.report import collective_table, group_label

    peaks: dict[str, int] = {}

    def sample() -> None:
        for k, v in p.sample_transient().items():
            if v > peaks.get(k, -1):
                peaks[k] = v

    rec = PhasedRecorder(lambda: p.phase, on_op=sample)
    with sf.comm.CommCounter() as counter, rec:
        step(p, *batch)
    coll, phases = [c.as_dict() for c in rec.collectives], list(rec.phases)
    cross_check = None
    if p.name == "shardfusion":  # shardfusion's own count against the dispatch-level one (no P2P in it)
        # Under HSDP shardfusion hands the replicate all-reduces of the last backward to a worker thread, which the
        # dispatch mode (thread-local) does not see; its own counter does: those are taken from it.
        outer, taken = tuple(groups["outer"]), 0
        if len(outer) > 1:
            got = sum(c["kind"] == "all_reduce" and tuple(c["ranks"]) == outer for c in coll)
            theirs = [r for r in counter.records if r.op == "all_reduce" and tuple(sorted(r.group_ranks)) == outer]
            for r in theirs[got:]:
                coll.append({"kind": "all_reduce", "ranks": outer, "numel": r.numel,
                             "elem_size": r.nbytes // max(1, r.numel)})
                phases.append("worker thread")
                taken += 1
        ours = Counter(r.op for r in counter.records)
        seen = Counter(c["kind"] for c in coll if not c["kind"].startswith("p2p"))
        cross_check = {"comm_counter": dict(ours), "dispatch": dict(seen),
                       "outer_all_reduces_from_comm_counter": taken,
                       "agree": all(seen.get(k, 0) == n for k, n in ours.items())}
    by_phase: Counter = Counter()
    timeline: list = []  # runs of (action, op/group): when each collective was issued
    for c, ph in zip(coll, phases):
        key = f"{c['kind']}/{group_label(tuple(c['ranks']), groups)}"
        where = "thread" if ph == "worker thread" else (ph[0] if ph else "between")
        by_phase[f"{key}@{where}"] += 1
        tag = [ph or "-", key]
        if timeline and timeline[-1][:2] == tag:
            timeline[-1][2] += 1
        else:
            timeline.append(tag + [1])
    out = {"collectives": collective_table(coll, groups), "by_phase": dict(by_phase), "timeline": timeline,
           "transient": peaks}
    if cross_check is not None:
        out["cross_check"] = cross_check
    params = [q for m in p.models for q in m.parameters()]
    mem: dict = {"live_before_bytes": _storages(params + optimizer_state_tensors(p.optimizer))}

    def after() -> None:
        mem["persistent_bytes"] = _storages(params + [q.grad for q in params]
                                            + optimizer_state_tensors(p.optimizer))

    p.profiling = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(p, *batch)
        with torch.profiler.record_function("measured_step"):
            step(p, *batch, after_optimizer=after)
    p.profiling = False
    mem["step_peak_growth_bytes"], mem["step_peak_at"] = _cpu_peak_growth(prof, "measured_step")
    out["memory"] = mem
    return out


def _batches(n: int, rows: int, seq: int, seed: int, dp_rank: int) -> list[tuple]:
    """n (x, y) pairs of random token ids (rows, seq) for this data-parallel rank; the same for every variant."""
    gen = torch.Generator().manual_seed(seed + 1 + dp_rank)
    out = []
    for _ in range(n):
        tok = torch.randint(0, VOCAB, (rows, seq + 1), generator=gen)  # (B, T+1)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))  # (B, T) each
    return out


def _units_held(ctx: dict, case: Case) -> list[list]:
    """``[kind, parameter elements, stage]`` of the units this rank holds for ``case`` (kind "root" or "block"; a
    root without parameters left out), counted on the meta device."""
    from shardfusion.models.gpt import GPT
    from shardfusion.models.gpt_pipeline import split_gpt

    pp = ctx["topo"].pp
    num_stages = pp * case.stages_per_rank()
    out = []
    for s in ctx["stage_ranks"](num_stages, pp)[ctx["topo"].pp_rank]:
        with torch.device("meta"):
            m = split_gpt(GPT(ctx["config"]), s, num_stages)
        blocks = [sum(q.numel() for q in b.parameters()) for b in m.blocks.values()]
        root = sum(q.numel() for q in m.parameters()) - sum(blocks)
        if root:
            out.append(["root", root, s])
        out += [["block", n, s] for n in blocks]
    return out


def worker(opts: dict) -> dict | None:
    """One rank's whole benchmark; rank 0 returns every rank's results, the other ranks None."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardfusion as sf
    from shardfusion.models.gpt import GPTConfig
    from shardfusion.pipeline import stage_ranks
    from benchmarks.spawn import join

    join("cpu")
    world, pp, outer = dist.get_world_size(), opts["pp"], opts["outer"]
    topo = sf.Topology(pp=pp, sharding=world // pp, fsdp_outer_degree=outer)
    inner = topo.inner
    mesh = init_device_mesh("cpu", (pp, outer, inner), mesh_dim_names=("pp", "replicate", "shard"))
    fsdp_mesh = mesh["shard"] if outer == 1 else mesh["replicate", "shard"]
    # the two libraries' groups must be the same ranks
    assert _ranks(mesh["pp"].get_group()) == _ranks(topo.get_group("pp")), "pp groups differ"
    assert _ranks(mesh["shard"].get_group()) == _ranks(topo.get_fsdp_inner_group()), "shard groups differ"
    groups = {"inner": _ranks(topo.get_fsdp_inner_group()) if inner > 1 else (dist.get_rank(),),
              "outer": _ranks(topo.get_replicate_group()) if outer > 1 else (dist.get_rank(),),
              "pp": _ranks(topo.get_group("pp")), "world": tuple(range(world))}
    config = GPTConfig(n_layer=opts["n_layer"], n_head=opts["n_head"], d_model=opts["d_model"], seq_len=opts["seq"],
                       tie_embeddings=False)
    ctx = {"topo": topo, "config": config, "fsdp_mesh": fsdp_mesh, "stage_ranks": stage_ranks,
           "seed": opts["seed"], "mb_rows": opts["mb_rows"], "seq": opts["seq"]}
    cases = [Case(**c) for c in opts["cases"]]
    variants = opts["variants"]
    dp_rank = topo.sharding_rank
    n_steps = opts["warmup"] + opts["steps"]
    data = {m: _batches(n_steps, m * opts["mb_rows"], opts["seq"], opts["seed"], dp_rank)
            for m in sorted({c.micro for c in cases})}
    res = {c.name: {v: {"steps": [], "losses": []} for v in variants} for c in cases}
    units = {c.name: _units_held(ctx, c) for c in cases}
    rank = dist.get_rank()
    for r in range(opts["repeats"]):
        k = r % len(cases)
        for case in cases[k:] + cases[:k]:
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                out = res[case.name][v]
                if out.get("error"):
                    continue
                try:
                    p = build(case, v, ctx)
                except Exception as e:  # noqa: BLE001 - kept as the variant's result; the run goes on
                    out["error"] = f"build: {type(e).__name__}: {e}"
                    continue
                batches = data[case.micro]
                for x, y in batches[:opts["warmup"]]:
                    step(p, x, y)
                dist.barrier()
                timed = [step(p, x, y) for x, y in batches[opts["warmup"]:]]
                out["steps"].append([{k2: t[k2] for k2 in ("step_s", "pipe_s", "busy_s", "cpu_s")} for t in timed])
                out["losses"].append([t["loss"] for t in timed])
                if r == 0:
                    out.update(instrument(p, batches[0], groups))
                del p
                gc.collect()
                dist.barrier()
                if rank == 0:
                    med = sorted(t["step_s"] for t in timed)[len(timed) // 2]
                    print(f"[{case.name}] repeat {r} {v}: median {med:.3f} s (rank 0)", flush=True)
    mine = {"rank": rank, "pp_rank": topo.pp_rank, "dp_rank": dp_rank, "groups": groups, "units": units,
            "results": res}
    got: list = [None] * world
    dist.all_gather_object(got, mine)
    dist.barrier()
    result = None
    if rank == 0:
        result = {"ranks": got, "inner": inner, "world_size": world, "backend": dist.get_backend(),
                  "threads": torch.get_num_threads()}
    dist.destroy_process_group()
    return result


# ---- parent -----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    from benchmarks import report
    from benchmarks.pipeline import worker as entry  # pickled by module name for the spawned workers
    from benchmarks.spawn import run_workers

    args = parse_args(argv)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    cases = cases_of(args.schedule_list, args.microbatches, args.study_list)
    opts = {"cases": [asdict(c) for c in cases], "variants": args.variant_list, "repeats": args.repeats,
            "warmup": args.warmup, "steps": args.steps, "pp": args.pp, "outer": args.outer, "n_layer": args.n_layer,
            "d_model": args.d_model, "n_head": args.n_head, "seq": args.seq, "mb_rows": args.mb_rows,
            "seed": args.seed, "lr": LR, "max_norm": MAX_NORM}
    record = RunRecord().__enter__()  # commit and load (benchmarks/provenance.py)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    results = run_workers(entry, (opts,), args.nproc)
    if results is None:
        return 1
    res = results[0]
    record.__exit__(None, None, None)
    env = record.as_dict()
    cfg = {**opts, "world_size": res["world_size"], "inner": res["inner"], "backend": res["backend"],
           "threads": res["threads"], "command": "python -m benchmarks.pipeline "
           + shlex.join(sys.argv[1:] if argv is None else argv)}
    raw = {"benchmark": "pipeline", "name": args.name, "config": cfg, "env": env, "ranks": res["ranks"]}
    js, md = report.write_pipeline(raw, Path(args.out_dir))
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
