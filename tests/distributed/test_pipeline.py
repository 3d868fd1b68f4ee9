"""Pipeline parallel (shardfusion/pipeline.py): torch's schedules over stages sharded by fully_shard, against one
process.

A GPT (4 layers, width 32, untied head) is cut into stages with `split_gpt`; each stage is sharded over the sharding
group of its pp index (units: its blocks) and driven by `sf.pipeline.PipelineStage` under torch's GPipe, 1F1B and
Interleaved1F1B (4 stages over pp 2: two stages per rank), built by `build_schedule`. Each step takes one global
batch of 8 sequences; each data-parallel rank of a stage takes its rows, the schedule cuts them into micro-batches,
the loss is the mean cross-entropy (torch's `scale_grads` divides by the micro-batch count). AdamW and
`sf.clip_grad_norm_` over all the stages a rank holds (one norm over the whole model). The single-process reference
is the whole GPT on the whole batch with the same optimizer and clipping.

Layouts: W=4 pp 2 x inner 2 (GPipe, 1F1B, interleaved, 1F1B with a reduce-scatter per micro-batch), pp 2 x outer 2;
W=8 pp 2 x outer 2 x inner 2 (1F1B, interleaved); inside the stages a GPT-MoE with its experts over ep 2 (W=4) and
tensor parallel over mp 2 (W=8, pp 2 x inner 2 x mp 2). Checked: the losses and the norm of every step, every
parameter after the last step (assembled from the stages), and for the dense cases the collectives of each step:
one reduce-scatter per unit (M with ``reduce_per_microbatch``), one outer all-reduce per unit under HSDP, the
all-gathers of the reshard policy per micro-batch, one norm all-reduce. The tied cases also run a forward-only
`schedule.eval` of the training schedule between steps (it must not touch the gradients or the tie). Refusals: a stage on the wrong pp rank, a
stage count that is not a multiple of pp, missing shapes, zero-bubble and unknown schedules.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from harness import raised, run_distributed
from reference import lm_loss, token_batch

JOB_TIMEOUT_S = 300
STEPS, LR, CLIP = 3, 1e-2, 0.5
EPS, PARAM_ATOL = 1e-6, 1e-5
"""AdamW's eps: a gradient near zero (an embedding row few tokens hit) moves by lr * g / (|g| + eps), so with torch's
1e-8 the fp32 rounding of the micro-batch sums (1e-10) would show as a few 1e-5 of update; 1e-6 keeps parameter
differences at rounding level."""
ROWS, SEQ = 8, 8  # global batch of 8 sequences of 8 bytes
CONFIG = dict(n_layer=4, n_head=2, d_model=32, seq_len=SEQ)
MODELS = {"dense": dict(tie_embeddings=False), "moe": dict(n_experts=4, top_k=2, tie_embeddings=False),
          "tp": dict(fused_qkv=False, tie_embeddings=False), "tied": dict(tie_embeddings=True),
          "moe_aux": dict(n_experts=4, top_k=2)}
AUX = 0.5  # the load-balancing loss coefficient of "moe_aux" (large, so that a missing term shows)
"""The GPT of each kind of case: dense with an untied head; a GPT-MoE (its experts over the stage's ep group); q, k,
v apart (tensor parallel over mp splits them by heads); the embedding tied with the head (first and last stage); a
tied GPT-MoE whose stages add the load-balancing loss (`split_gpt(..., aux_loss_coef)`)."""
# (name, world, topology degrees, schedule, stages, micro-batches, reduce_per_microbatch), dense GPT
CASES = [
    ("W4-pp2-I2-gpipe", 4, dict(pp=2, sharding=2), "gpipe", 2, 2, False),
    ("W4-pp2-I2-1f1b", 4, dict(pp=2, sharding=2), "1f1b", 2, 4, False),
    ("W4-pp2-I2-interleaved", 4, dict(pp=2, sharding=2), "interleaved", 4, 2, False),
    ("W4-pp2-I2-1f1b-rs-per-mb", 4, dict(pp=2, sharding=2), "1f1b", 2, 2, True),
    ("W4-pp2-O2", 4, dict(pp=2, sharding=2, fsdp_outer_degree=2), "1f1b", 2, 2, False),
    # reshard_policy="after_backward": the stage keeps its units gathered for the whole step (keep_gathered)
    ("W4-pp2-I2-1f1b-keep", 4, dict(pp=2, sharding=2), "1f1b", 2, 4, False),
    ("W4-pp2-I2-interleaved-keep", 4, dict(pp=2, sharding=2), "interleaved", 4, 2, False),
    ("W8-pp2-O2-I2-1f1b", 8, dict(pp=2, sharding=4, fsdp_outer_degree=2), "1f1b", 2, 2, False),
    ("W8-pp2-O2-I2-interleaved", 8, dict(pp=2, sharding=4, fsdp_outer_degree=2), "interleaved", 4, 2, False),
]
# other models inside the stages: experts over ep 2, tensor parallel over mp 2
MODEL_CASES = [
    ("W4-pp2-ep2-moe", 4, dict(pp=2, sharding=2, ep=2), "1f1b", 2, 2, False, "moe"),
    ("W8-pp2-I2-mp2-tp", 8, dict(pp=2, sharding=2, mp=2), "1f1b", 2, 2, False, "tp"),
    ("W4-pp2-I2-1f1b-tied", 4, dict(pp=2, sharding=2), "1f1b", 2, 2, False, "tied"),
    ("W4-pp2-I2-interleaved-tied", 4, dict(pp=2, sharding=2), "interleaved", 4, 2, False, "tied"),
    ("W8-pp2-O2-I2-gpipe-tied", 8, dict(pp=2, sharding=4, fsdp_outer_degree=2), "gpipe", 2, 2, False, "tied"),
    ("W4-pp2-ep2-moe-aux", 4, dict(pp=2, sharding=2, ep=2), "1f1b", 2, 2, False, "moe_aux"),
]
ALL_CASES = [(*c, "dense") for c in CASES] + MODEL_CASES


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: idx and targets, (ROWS, SEQ) int64 bytes each."""
    return token_batch(1000 + step, ROWS, SEQ)


loss_fn = lm_loss


def build_gpt(kind: str, ep_group=None):
    from shardfusion.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG, **MODELS[kind]), ep_group=ep_group)


def _policy(name: str) -> str:
    """The reshard policy of a case: after_backward for the "-keep" cases, else after_forward."""
    return "after_backward" if name.endswith("-keep") else "after_forward"


def reference(kind: str, chunks: int = 4) -> dict:
    """The whole GPT on the whole batch. With the load-balancing loss ("moe_aux"): over `chunks` chunks of the batch
    (2 data-parallel ranks x 2 micro-batches, as the pipeline cases), each chunk's cross-entropy plus AUX times its
    aux loss, the mean over the chunks (the MoE balances each rank's tokens of each micro-batch)."""
    model = build_gpt(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        if kind == "moe_aux":
            parts = []
            for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
                ce = loss_fn(model(xc)[0], yc)
                ((ce + AUX * model.aux_loss()) / chunks).backward()
                parts.append(ce.detach())
            loss = torch.stack(parts).mean()
        else:
            logits, _ = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def pipeline_job(cases: list) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion.models import Block
    from shardfusion.models.gpt_pipeline import split_gpt
    from shardfusion.pipeline import PipelineStage, build_schedule, stage_ranks
    out = {}
    from shardfusion.models.gpt_parallel import block_plan
    from torch.distributed.tensor.parallel import parallelize_module
    for name, world, degrees, kind, num_stages, micro, per_mb, model_kind in cases:
        topo = sf.Topology(**degrees)
        mine = stage_ranks(num_stages, topo.pp)[topo.pp_rank]
        dp_world, dp_rank = topo.sharding, topo.sharding_rank  # the data-parallel ranks of a stage
        rows = ROWS // dp_world
        mb = rows // micro
        C = CONFIG["d_model"]
        models, stages = [], []
        for s in mine:
            part = split_gpt(build_gpt(model_kind, topo.get_group("ep") if topo.ep > 1 else None), s, num_stages,
                             aux_loss_coef=AUX if model_kind == "moe_aux" else 0.0)
            if topo.mp > 1:
                for block in part.blocks.values():
                    parallelize_module(block, topo.get_mesh("mp"), block_plan(part.config))
            tied = part.tied_parameters  # kept whole: both ends hold the same fragment
            part = sf.fully_shard(part, topo, units=(Block,), replicate_filter=lambda n, p, tied=tied: n in tied,
                                  reshard_policy=_policy(name))
            first, last = s == 0, s == num_stages - 1
            hidden = torch.empty(mb, SEQ, C, device="meta", requires_grad=True)  # activations carry gradients
            inp = torch.empty(mb, SEQ, dtype=torch.long, device="meta") if first else hidden
            outp = torch.empty(mb, SEQ, 256, device="meta", requires_grad=True) if last else hidden
            models.append(part)
            stages.append(PipelineStage(part, topo, s, num_stages, input_args=inp, output_args=outp,
                                        reduce_per_microbatch=per_mb))
        schedule = build_schedule(kind, stages, micro, loss_fn)
        params = [p for m in models for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
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
            if model_kind == "tied":  # a forward-only pass of the training schedule between steps changes nothing
                with torch.no_grad():
                    schedule.eval(*args, **({"target": y, "losses": []} if has_last else {}))
            counts.append(Counter((r.op, r.label) for r in cc.records))
            norms.append(float(norm))
            # the step's loss: the mean over the micro-batches and the ranks of the last stage (its mp ranks hold
            # the same rows)
            loss = torch.stack(mb_losses).detach().mean() if has_last else torch.zeros(())
            dist.all_reduce(loss)
            losses.append(float(loss) / (topo.world_size // topo.pp))
        out[name] = {"losses": losses, "norms": norms, "counts": counts, "stages": mine,
                     "units": [(u.name, len(u.param_names)) for m in models for u in sf.get_units(m)],
                     "inner": topo.inner, "replicas": topo.fsdp_outer_degree * topo.dp,
                     "full": {k: v for m in models for k, v in sf.full_state_dict(m).items()}}
    return out


def _raised(fn) -> str:
    """The message of the ValueError ``fn()`` raises (anything else: its type and message, which no check accepts)."""
    kind, message = raised(fn)
    return message if kind == "ValueError" else f"{kind}: {message}"


def refusal_job() -> dict:
    """What PipelineStage and build_schedule refuse, at pp 2 x sharding 2 (each a ValueError on every rank, before
    any communication)."""
    import shardfusion as sf
    from shardfusion.models import Block
    from shardfusion.models.gpt_pipeline import split_gpt
    from shardfusion.pipeline import PipelineStage, build_schedule
    topo = sf.Topology(pp=2, sharding=2)
    mine = topo.pp_rank
    part = sf.fully_shard(split_gpt(build_gpt("dense"), mine, 2), topo, units=(Block,))
    hidden = torch.empty(2, SEQ, CONFIG["d_model"], device="meta", requires_grad=True)
    ok = PipelineStage(part, topo, mine, 2, input_args=hidden, output_args=hidden)
    return {
        "wrong-rank": _raised(lambda: PipelineStage(part, topo, 1 - mine, 2, input_args=hidden, output_args=hidden)),
        "not-multiple": _raised(lambda: PipelineStage(part, topo, mine, 3, input_args=hidden, output_args=hidden)),
        "no-shapes": _raised(lambda: PipelineStage(part, topo, mine, 2, input_args=None, output_args=hidden)),
        "zero-bubble": _raised(lambda: build_schedule("zbv_zero_bubble", [ok], 2, loss_fn)),
        "unknown": _raised(lambda: build_schedule("pipedream", [ok], 2, loss_fn)),
        "two-stages-1f1b": _raised(lambda: build_schedule("1f1b", [ok, ok], 2, loss_fn)),
        "pp_rank": mine,
    }


def w4_job(cases: list) -> dict:
    return {"refusals": refusal_job(), **pipeline_job(cases)}


def _cases_of(world: int) -> list:
    return [c for c in ALL_CASES if c[1] == world]


@pytest.fixture(scope="module")
def runs():
    return {4: run_distributed(w4_job, 4, _cases_of(4), timeout=JOB_TIMEOUT_S),
            8: run_distributed(pipeline_job, 8, _cases_of(8), timeout=JOB_TIMEOUT_S)}


@pytest.fixture(scope="module")
def ref():
    return {kind: reference(kind) for kind in MODELS}


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c[0])
def test_pipeline_matches_single_process(runs, ref, case):
    name, world = case[0], case[1]
    pp = case[2]["pp"]
    runs, ref = runs[world], ref[case[-1]]
    for rank, r in enumerate(runs):
        got = r[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} rank {rank} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} rank {rank} norms: {m}")
    seen = {}
    for r in runs:
        seen.update(r[name]["full"])
    if MODELS[case[-1]].get("tie_embeddings", True):  # the last stage's copy of the embedding: equal to it
        torch.testing.assert_close(seen.pop("lm_head.weight"), seen["wte.weight"], rtol=0, atol=0,
                                   msg=lambda m: f"{name}: the head's copy differs from the embedding: {m}")
    assert sorted(seen) == sorted(ref["params"]), (name, sorted(set(seen) ^ set(ref["params"])))
    for n, want in ref["params"].items():
        torch.testing.assert_close(seen[n], want, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m: f"{name} {n}: {m}")
    assert all(len(r[name]["stages"]) == case[4] // pp for r in runs)


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_collectives_per_step_not_per_microbatch(runs, case):
    """Per optimizer step, on every rank: one reduce-scatter per unit that holds parameters (M with
    reduce_per_microbatch), on the inner group; one replicate all-reduce per such unit under HSDP; per micro-batch
    an all-gather of each unit in forward and of each block again in backward (reshard after forward; the root unit
    stays gathered), or under after_backward one all-gather per unit per step (the stage keeps its units gathered
    between micro-batches); one scalar all-reduce over the world (the norm over every stage). Nothing else."""
    name, world, _, _, _, micro, per_mb = case
    for rank, r in enumerate(runs[world]):  # dense GPT cases (an MoE unit has expert buffers too)
        got = r[name]
        held = [(n, k) for n, k in got["units"] if k]  # units with parameters (a middle stage's root has none)
        sharded = got["inner"] > 1
        want = Counter()
        if sharded:
            want["reduce_scatter"] = len(held) * (micro if per_mb else 1)
            if _policy(name) == "after_backward":  # gathered once, kept for the step (PipelineStage.keep_gathered)
                want["all_gather"] = len(held)
            else:
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


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_bad_stages_and_schedules_refused_on_every_rank(runs):
    for rank, r in enumerate(runs[4]):
        got, mine = r["refusals"], r["refusals"]["pp_rank"]
        assert got["wrong-rank"] == (f"stage {1 - mine} of 2 belongs on pp rank {1 - mine}, but this rank's pp index "
                                     f"is {mine} (pp 2); build stages [{mine}] here"), (rank, got)
        assert got["not-multiple"] == "num_stages must be a positive multiple of the pp degree 2, got 3", (rank, got)
        assert got["no-shapes"].startswith("PipelineStage needs input_args and output_args"), (rank, got)
        assert got["zero-bubble"].startswith("schedule 'zbv_zero_bubble': zero-bubble schedules split backward"), got
        assert got["unknown"].startswith("unknown pipeline schedule 'pipedream'"), (rank, got)
        assert got["two-stages-1f1b"].startswith("schedule '1f1b' runs one stage per pp rank, got 2"), (rank, got)
