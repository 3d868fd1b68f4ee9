"""Pipeline parallel (shardfusion/pipeline.py): torch's schedules over stages sharded by fully_shard, against one
process.

A GPT (4 layers, width 32, untied head) is cut into stages with `split_gpt`; each stage is sharded over the sharding
group of its pp index (units: its blocks) and driven by `sf.pipeline.PipelineStage` under torch's GPipe, 1F1B and
Interleaved1F1B (4 stages over pp 2: two stages per rank). Each step takes one global batch of 8 sequences; each
data-parallel rank of a stage takes its rows, the schedule cuts them into micro-batches, the loss is the mean
cross-entropy (torch's `scale_grads` divides by the micro-batch count). AdamW and `sf.clip_grad_norm_` over all the
stages a rank holds (one norm over the whole model). The single-process reference is the whole GPT on the whole
batch with the same optimizer and clipping. Checked: the losses of every step, the norm, every parameter after the
last step (assembled from the stages), and the collectives of a step: one reduce-scatter per unit (1F1B and the
interleaved schedule with gradient accumulation), M with ``reduce_per_microbatch``, one outer all-reduce per unit
under HSDP, and P2P only on the pp group.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed

JOB_TIMEOUT_S = 300
STEPS, LR, CLIP = 3, 1e-2, 0.5
PARAM_ATOL = 2e-5
ROWS, SEQ = 8, 8  # global batch of 8 sequences of 8 bytes
CONFIG = dict(n_layer=4, n_head=2, d_model=32, seq_len=SEQ, tie_embeddings=False)
# (name, world, topology degrees, schedule, stages, micro-batches, reduce_per_microbatch)
CASES = [
    ("W4-pp2-I2-gpipe", 4, dict(pp=2, sharding=2), "gpipe", 2, 2, False),
    ("W4-pp2-I2-1f1b", 4, dict(pp=2, sharding=2), "1f1b", 2, 4, False),
    ("W4-pp2-I2-interleaved", 4, dict(pp=2, sharding=2), "interleaved", 4, 2, False),
    ("W4-pp2-I2-1f1b-rs-per-mb", 4, dict(pp=2, sharding=2), "1f1b", 2, 2, True),
    ("W4-pp2-O2", 4, dict(pp=2, sharding=2, fsdp_outer_degree=2), "1f1b", 2, 2, False),
    ("W8-pp2-O2-I2-1f1b", 8, dict(pp=2, sharding=4, fsdp_outer_degree=2), "1f1b", 2, 2, False),
    ("W8-pp2-O2-I2-interleaved", 8, dict(pp=2, sharding=4, fsdp_outer_degree=2), "interleaved", 4, 2, False),
]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: idx and targets, (ROWS, SEQ) int64 bytes each."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt():
    from shardfusion.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def reference() -> dict:
    model = build_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        logits, _ = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _schedule(kind: str):
    from torch.distributed import pipelining as pl
    return {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B}[kind]


def pipeline_job(cases: list) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion.models import Block
    from shardfusion.models.gpt_pipeline import split_gpt
    from shardfusion.pipeline import PipelineStage, stage_ranks
    out = {}
    for name, world, degrees, kind, num_stages, micro, per_mb in cases:
        topo = sf.Topology(**degrees)
        mine = stage_ranks(num_stages, topo.pp)[topo.pp_rank]
        dp_world, dp_rank = topo.sharding, topo.sharding_rank  # the data-parallel ranks of a stage
        rows = ROWS // dp_world
        mb = rows // micro
        C = CONFIG["d_model"]
        models, stages = [], []
        for s in mine:
            part = sf.fully_shard(split_gpt(build_gpt(), s, num_stages), topo, units=(Block,))
            first, last = s == 0, s == num_stages - 1
            hidden = torch.empty(mb, SEQ, C, device="meta", requires_grad=True)  # activations carry gradients
            inp = torch.empty(mb, SEQ, dtype=torch.long, device="meta") if first else hidden
            outp = torch.empty(mb, SEQ, 256, device="meta", requires_grad=True) if last else hidden
            models.append(part)
            stages.append(PipelineStage(part, topo, s, num_stages, input_args=inp, output_args=outp,
                                        reduce_per_microbatch=per_mb))
        cls = _schedule(kind)
        schedule = cls(stages if kind == "interleaved" else stages[0], n_microbatches=micro, loss_fn=loss_fn)
        params = [p for m in models for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=LR)
        has_first, has_last = 0 in mine, num_stages - 1 in mine
        losses, norms, counts = [], [], []
        for step in range(STEPS):
            x, y = batch(step)
            x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
            mb_losses = []
            with sf.comm.CommCounter() as cc:
                args = (x,) if has_first else ()
                kwargs = {"target": y, "losses": mb_losses} if has_last else {}
                schedule.step(*args, **kwargs)
                norm = sf.clip_grad_norm_(models, CLIP)
            opt.step()
            opt.zero_grad()
            counts.append(Counter((r.op, r.label) for r in cc.records))
            norms.append(float(norm))
            # the step's loss: the mean over the micro-batches and the data-parallel ranks (last stage only)
            loss = torch.stack(mb_losses).detach().mean() if has_last else torch.zeros(())
            dist.all_reduce(loss)
            losses.append(float(loss) / dp_world)
        out[name] = {"losses": losses, "norms": norms, "counts": counts, "stages": mine,
                     "units": [(u.name, len(u.param_names)) for m in models for u in sf.get_units(m)],
                     "inner": topo.inner, "replicas": topo.fsdp_outer_degree * topo.dp,
                     "full": {k: v for m in models for k, v in sf.full_state_dict(m).items()}}
    return out


def _cases_of(world: int) -> list:
    return [c for c in CASES if c[1] == world]


@pytest.fixture(scope="module")
def runs():
    return {4: run_distributed(pipeline_job, 4, _cases_of(4), timeout=JOB_TIMEOUT_S),
            8: run_distributed(pipeline_job, 8, _cases_of(8), timeout=JOB_TIMEOUT_S)}


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_pipeline_matches_single_process(runs, ref, case):
    name, world = case[0], case[1]
    pp = case[2]["pp"]
    runs = runs[world]
    for rank, r in enumerate(runs):
        got = r[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} rank {rank} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} rank {rank} norms: {m}")
    seen = {}
    for r in runs:
        seen.update(r[name]["full"])
    assert sorted(seen) == sorted(ref["params"]), (name, sorted(set(seen) ^ set(ref["params"])))
    for n, want in ref["params"].items():  # AdamW divides by sqrt(v): a near-zero gradient (an embedding row few
        # tokens hit) turns the fp32 rounding of the micro-batch sums into a few 1e-6 of update
        torch.testing.assert_close(seen[n], want, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m: f"{name} {n}: {m}")
    assert all(len(r[name]["stages"]) == case[4] // pp for r in runs)


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_collectives_per_step_not_per_microbatch(runs, case):
    """Per optimizer step, on every rank: one reduce-scatter per unit that holds parameters (M with
    reduce_per_microbatch), on the inner group; one replicate all-reduce per such unit under HSDP; per micro-batch
    an all-gather of each unit in forward and of each block again in backward (reshard after forward; the root unit
    stays gathered); one scalar all-reduce over the world (the norm over every stage). Nothing else."""
    name, world, _, _, _, micro, per_mb = case
    for rank, r in enumerate(runs[world]):
        got = r[name]
        held = [(n, k) for n, k in got["units"] if k]  # units with parameters (a middle stage's root has none)
        sharded = got["inner"] > 1
        want = Counter()
        if sharded:
            want["reduce_scatter"] = len(held) * (micro if per_mb else 1)
            want["all_gather"] = sum(micro * (1 if n == "" else 2) for n, _ in held)
        if got["replicas"] > 1:
            want["replicate_all_reduce"] = len(held)
        want["world_all_reduce"] = 1
        for step, counts in enumerate(got["counts"]):
            seen = Counter()
            for (op, label), n in counts.items():
                key = op if op != "all_reduce" else f"{'world' if label == 'world' else 'replicate'}_all_reduce"
                if op == "all_reduce" and label != "world":
                    assert "replicate" in label, (name, rank, label)
                seen[key] += n
            assert seen == want, f"{name} rank {rank} step {step}: {dict(seen)} != {dict(want)} (units {held})"
