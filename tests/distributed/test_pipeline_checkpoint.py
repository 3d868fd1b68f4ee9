"""Checkpoints across pp (shardfusion/checkpoint/save_load.py given lists of pipeline stages), against one process.

A GPT (4 layers, width 32, untied head: `split_gpt` keeps the GPT's parameter names) trains with AdamW in two param
groups (weight decay 0.1 on the matrices, 0.0 on the rest) and `sf.clip_grad_norm_`; each step takes one global
batch of 8 sequences, each data-parallel rank its rows. One W=4 job runs every case as a sub-case:

- saves: pp 2 x sharding 2 under 1F1B (one stage per rank, `save`) and pp 2 under Interleaved1F1B (4 stages, two per
  rank, `save_checkpoint`), each after 2 steps, every rank passing the list of its stages and one optimizer over them;
- loads, into fresh models (other initial values) and fresh optimizers (other lr and weight decay, no state): the pp 2
  checkpoint at pp 1 (sharding 4, the whole GPT as one sharded model) and at pp 2 x outer 2 (1F1B), the interleaved
  one at pp 1; each then trains 2 more steps;
- refusals, a ValueError on every rank: a list holding a module that is not sharded (on rank 1 only), stages sharded
  with two Topology objects, the same stage on both pp ranks (one name on two pp ranks), an optimizer whose lr
  differs between the pp ranks, param groups in another order than saved, an optimizer holding a parameter of no
  given model; and a checkpoint whose meta says version 2 (written with FORMAT_VERSION patched) still loads, one
  saying version 1 is refused; `load_full_state` of the pp 2 checkpoint's `load_full` into the pp 2 x outer 2
  stages. A GPT whose head is tied to its embedding: saved at pp 2 (the last stage holds a copy, saved once under
  the embedding's name) and loaded at pp 1, and saved at pp 1 and loaded at pp 2.

Checked against the single-process reference (the whole GPT, the whole batch, the same optimizer and clipping): the
losses of all 4 steps (2 before the save, 2 after the load), every parameter after the last step, the restored
hyperparameters, and in this process (no process group) `read_meta` (shapes and param groups merged over the ranks),
`load_full` / `read_all` of both checkpoints (parameters, exp_avg, exp_avg_sq, step after 2 steps) and the
safetensors file of `python -m shardfusion.export`'s `main`.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness import raised, run_distributed
from reference import lm_loss, token_batch

JOB_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)

SAVE_AT, STEPS = 2, 4
LR, WD, CLIP = 1e-2, 0.1, 0.5
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-5, 2e-5  # as tests/distributed/test_pipeline.py (AdamW's sqrt(v) of tiny gradients)
STATE_RTOL, STATE_ATOL = 1e-4, 1e-7  # exp_avg, exp_avg_sq: sums of gradients in another order
ROWS, SEQ = 8, 8
CONFIG = dict(n_layer=4, n_head=2, d_model=32, seq_len=SEQ, tie_embeddings=False)
PP2, PP2_O2, PP1 = dict(pp=2, sharding=2), dict(pp=2, sharding=2, fsdp_outer_degree=2), dict(sharding=4)
# name: (degrees, schedule, stages, micro-batches)
SAVES = {"pp2": (PP2, "1f1b", 2, 2), "pp2-interleaved": (PP2, "interleaved", 4, 2)}
# name: (saved run, degrees, schedule, stages, micro-batches); schedule None: the whole GPT, no pipeline
LOADS = {"pp2->pp1": ("pp2", PP1, None, 1, 1), "pp2->pp2xO2": ("pp2", PP2_O2, "1f1b", 2, 2),
         "pp2-interleaved->pp1": ("pp2-interleaved", PP1, None, 1, 1)}
REFUSED = {  # sub-case: words every rank's ValueError must hold
    "not_sharded_on_rank_1": ["sf.checkpoint.save", "rank 1", "model[1] (Linear) is not sharded"],
    "two_topologies": ["sf.checkpoint.load: ranks 0-3: model[1] is sharded with another Topology object than "
                       "model[0]", "outer2"],
    "one_stage_on_both_pp_ranks": ["are held on more than one pp rank", "'wte.weight'", "pp ranks [0, 1]"],
    "lr_differs_between_pp_ranks": ["param group 0 has lr=0.02 on ranks 2, 3 but lr=0.01 on rank 0",
                                    "param group 1 has lr=0.02 on ranks 2, 3"],
    "groups_swapped": ["param group 0 holds", "which the checkpoint has in param group 1", "'blocks.0.ln_1.weight'"],
    "optimizer_outside_models": ["optimizer[0] holds 1 parameter (shapes [(3,)])", "none of the 1 model given"],
    "version_1": ["format version 1", "load reads versions [2, 3]"],
}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: idx and targets, (ROWS, SEQ) int64 bytes each."""
    return token_batch(1000 + step, ROWS, SEQ)


loss_fn = lm_loss


def build_gpt(seed: int = 0, tied: bool = False):
    from shardfusion.models import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CONFIG, "tie_embeddings": tied}))


def param_groups(named, lr: float = LR, decay: float = WD) -> list[dict]:
    """Two groups: weight decay `decay` on the matrices (dim >= 2), none on the rest, in that order."""
    named = list(named)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": decay, "lr": lr},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": lr}]


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference(tied=False)


@pytest.fixture(scope="module")
def tied_ref() -> dict:
    return reference(tied=True)


def reference(tied: bool) -> dict:
    """The whole GPT on the whole batch: losses of every step, parameters and AdamW state by name after SAVE_AT
    steps, parameters after STEPS."""
    model = build_gpt(tied=tied)
    opt = torch.optim.AdamW(param_groups(model.named_parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"losses": []}
    for step in range(STEPS):
        x, y = batch(step)
        logits, _ = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
        if step + 1 == SAVE_AT:
            out["saved"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            out["state"] = {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["decay"] = sorted(n for n, p in model.named_parameters() if p.dim() >= 2)
    out["no_decay"] = sorted(n for n, p in model.named_parameters() if p.dim() < 2)
    return out


# --- the distributed job ------------------------------------------------------------------------------------------


class _Run:
    """This rank's part of one layout: its sharded models (stages, or the whole GPT) and how to take a step."""

    def __init__(self, topo, schedule: str | None, num_stages: int, micro: int, seed: int, tied: bool = False) -> None:
        import shardfusion as sf
        from shardfusion.models import Block
        from shardfusion.models.gpt_pipeline import split_gpt
        from shardfusion.pipeline import PipelineStage, stage_ranks
        from torch.distributed import pipelining as pl
        self.topo, self.rows = topo, ROWS // topo.sharding
        if schedule is None:  # the whole GPT, one sharded model
            self.mine, self.models = [0], [sf.fully_shard(build_gpt(seed, tied), topo, units=(Block,))]
            self.schedule = None
            return
        self.mine = stage_ranks(num_stages, topo.pp)[topo.pp_rank]
        mb, C = self.rows // micro, CONFIG["d_model"]
        self.models, stages = [], []
        for s in self.mine:
            part = split_gpt(build_gpt(seed, tied), s, num_stages)  # tied: a copy of the embedding, kept whole
            part = sf.fully_shard(part, topo, units=(Block,), replicate_filter=lambda n, p, t=part.tied_parameters: n in t)
            hidden = torch.empty(mb, SEQ, C, device="meta", requires_grad=True)
            inp = torch.empty(mb, SEQ, dtype=torch.long, device="meta") if s == 0 else hidden
            outp = torch.empty(mb, SEQ, 256, device="meta", requires_grad=True) if s == num_stages - 1 else hidden
            self.models.append(part)
            stages.append(PipelineStage(part, topo, s, num_stages, input_args=inp, output_args=outp))
        cls = {"1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B}[schedule]
        self.schedule = cls(stages if schedule == "interleaved" else stages[0], n_microbatches=micro, loss_fn=loss_fn)
        self.has_first, self.has_last = 0 in self.mine, num_stages - 1 in self.mine

    def named(self):
        return [(n, p) for m in self.models for n, p in m.named_parameters()]

    def train(self, opt, steps) -> list[float]:
        """Steps `steps` on this rank's rows; the losses (the mean over the global batch, on every rank)."""
        import torch.distributed as dist
        import shardfusion as sf
        losses = []
        for step in steps:
            x, y = batch(step)
            rank = self.topo.sharding_rank
            x, y = x[rank * self.rows:(rank + 1) * self.rows], y[rank * self.rows:(rank + 1) * self.rows]
            if self.schedule is None:
                logits, _ = self.models[0](x)
                loss = loss_fn(logits, y)
                loss.backward()
                loss = loss.detach()
            else:
                mb_losses = []
                self.schedule.step(*((x,) if self.has_first else ()),
                                   **({"target": y, "losses": mb_losses} if self.has_last else {}))
                loss = torch.stack(mb_losses).detach().mean() if self.has_last else torch.zeros(())
            sf.clip_grad_norm_(self.models, CLIP)
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss)  # the ranks holding the loss: the sharding ranks of the last stage
            losses.append(float(loss) / self.topo.sharding)
        return losses

    def full(self) -> dict:
        import shardfusion as sf
        return {k: v for m in self.models for k, v in sf.full_state_dict(m).items()}


def checkpoint_job(root: str) -> dict:
    import torch.distributed as dist
    import torch.nn as nn
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    from shardfusion.checkpoint import save_load
    from shardfusion.models.gpt_pipeline import split_gpt
    from shardfusion.models import Block
    rank = dist.get_rank()
    topos = {key: sf.Topology(**degrees, timeout=60)
             for key, degrees in (("pp2", PP2), ("pp2xO2", PP2_O2), ("pp1", PP1))}
    by_degrees = {str(PP2): topos["pp2"], str(PP2_O2): topos["pp2xO2"], str(PP1): topos["pp1"]}
    out: dict = {"paths": {}, "losses": {}, "hyper": {}, "full": {}, "refused": {}}
    runs = {}
    for name, (degrees, schedule, num_stages, micro) in SAVES.items():
        run = runs[name] = _Run(by_degrees[str(degrees)], schedule, num_stages, micro, seed=0)
        opt = torch.optim.AdamW(param_groups(run.named()))
        run.opt = opt
        out["losses"][name] = run.train(opt, range(SAVE_AT))
        extra = {"step": SAVE_AT, "saved_by": name}
        if name == "pp2":
            path = os.path.join(root, "pp2")
            ckpt.save(run.models, opt, path, extra=extra)
        else:
            path = ckpt.save_checkpoint(run.models, opt, os.path.join(root, "interleaved"), SAVE_AT, extra=extra)
        out["paths"][name] = path
        out["stages"] = {**out.get("stages", {}), name: run.mine}
    loaded = {}
    for name, (source, degrees, schedule, num_stages, micro) in LOADS.items():
        run = loaded[name] = _Run(by_degrees[str(degrees)], schedule, num_stages, micro, seed=1)
        opt = torch.optim.AdamW(param_groups(run.named(), lr=3 * LR, decay=0.0))  # restored by the load
        extra = ckpt.load(run.models, opt, out["paths"][source])
        out["hyper"][name] = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
        out["extra_" + name] = extra
        out["losses"][name] = run.train(opt, range(SAVE_AT, STEPS))
        out["full"][name] = run.full()

    # refusals: a ValueError on every rank
    pp2, pp1, o2 = runs["pp2"], loaded["pp2->pp1"], loaded["pp2->pp2xO2"]
    bad = pp2.models + ([nn.Linear(2, 2)] if rank == 1 else [])
    out["refused"]["not_sharded_on_rank_1"] = raised(lambda: ckpt.save(bad, pp2.opt, os.path.join(root, "bad")))
    out["refused"]["two_topologies"] = raised(
        lambda: ckpt.load([pp2.models[0], o2.models[0]], None, out["paths"]["pp2"]))
    stage0 = sf.fully_shard(split_gpt(build_gpt(), 0, 2), topos["pp2"], units=(Block,))  # on pp rank 1 too
    out["refused"]["one_stage_on_both_pp_ranks"] = raised(lambda: ckpt.save([stage0], None, os.path.join(root, "bad")))
    lr = 2 * LR if topos["pp2"].pp_rank == 1 else LR
    per_pp = torch.optim.AdamW(param_groups(pp2.named(), lr=lr))
    out["refused"]["lr_differs_between_pp_ranks"] = raised(
        lambda: ckpt.save(pp2.models, per_pp, os.path.join(root, "bad")))
    swapped = torch.optim.AdamW(param_groups(pp1.named())[::-1])
    out["refused"]["groups_swapped"] = raised(lambda: ckpt.load(pp1.models, swapped, out["paths"]["pp2"]))
    outside = torch.optim.AdamW([nn.Parameter(torch.zeros(3))] + [p for _, p in pp2.named()])
    out["refused"]["optimizer_outside_models"] = raised(
        lambda: ckpt.save(pp2.models, outside, os.path.join(root, "bad")))
    # a version-2 meta (groups by index, no name check) still loads; version 1 does not
    try:
        for version in (2, 1):
            save_load.FORMAT_VERSION = version
            ckpt.save(pp2.models, pp2.opt, os.path.join(root, f"v{version}"))
    finally:
        save_load.FORMAT_VERSION = 3
    old = torch.optim.AdamW(param_groups(pp1.named(), lr=3 * LR, decay=0.0))
    ckpt.load(pp1.models, old, os.path.join(root, "v2"))
    out["hyper"]["v2->pp1"] = [(g["lr"], g["weight_decay"]) for g in old.param_groups]
    out["full"]["v2->pp1"] = pp1.full()
    out["refused"]["version_1"] = raised(lambda: ckpt.load(pp1.models, None, os.path.join(root, "v1")))
    # a full state dict (load_full of the pp2 checkpoint, read by every rank) into the stages of pp 2 x outer 2
    ckpt.load_full_state(o2.models, ckpt.load_full(out["paths"]["pp2"]))
    out["full"]["load_full_state->pp2xO2"] = o2.full()
    return out


TIED = {"pp2-tied->pp1": (PP2, "1f1b", PP1, None), "pp1-tied->pp2": (PP1, None, PP2, "1f1b")}
"""A GPT whose head is tied to its embedding: (saved at, schedule, loaded at, schedule); the last stage's copy of the
embedding is saved once, under the embedding's name, and loads from it."""


def tied_job(root: str) -> dict:
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    out: dict = {}
    for name, (saved_at, saved_schedule, loaded_at, loaded_schedule) in TIED.items():
        stages = lambda schedule: 2 if schedule else 1  # noqa: E731
        run = _Run(sf.Topology(**saved_at), saved_schedule, stages(saved_schedule), 2, seed=0, tied=True)
        opt = torch.optim.AdamW(param_groups(run.named()))
        losses = run.train(opt, range(SAVE_AT))
        path = os.path.join(root, name)
        ckpt.save(run.models, opt, path)
        other = _Run(sf.Topology(**loaded_at), loaded_schedule, stages(loaded_schedule), 2, seed=1, tied=True)
        opt = torch.optim.AdamW(param_groups(other.named(), lr=3 * LR, decay=0.0))
        ckpt.load(other.models, opt, path)
        out[name] = {"losses": losses + other.train(opt, range(SAVE_AT, STEPS)), "full": other.full(),
                     "stored": sorted(k for k in ckpt.load_full(path))}
    return out


def both_jobs(root: str) -> dict:
    return {**checkpoint_job(root), "tied": tied_job(root)}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("pp_ckpt"))
    return run_distributed(both_jobs, 4, root, timeout=JOB_TIMEOUT_S)


# --- the checks ---------------------------------------------------------------------------------------------------


def _close(got: dict, want: dict, what: str, rtol: float = PARAM_RTOL, atol: float = PARAM_ATOL) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}")


@pytest.mark.parametrize("name", list(LOADS))
def test_resume_continues_like_one_process(job, ref, name):
    """The losses of the saving run (steps 0, 1) and of the loaded one (steps 2, 3) on every rank, and every
    parameter after step 3, equal the uninterrupted single-process run: parameters, AdamW state (exp_avg,
    exp_avg_sq, step) and hyperparameters all came back."""
    source = LOADS[name][0]
    for rank, r in enumerate(job):
        got = r["losses"][source] + r["losses"][name]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=LOSS_ATOL,
                                   msg=lambda m: f"{name} rank {rank} losses: {m}")
        assert r["extra_" + name] == {"step": SAVE_AT, "saved_by": source}
    seen = {}
    for r in job:
        seen.update(r["full"][name])
    _close(seen, ref["params"], name)


def test_interleaved_saves_two_stages_per_rank(job):
    pp_rank = [0, 0, 1, 1]
    assert [r["stages"]["pp2-interleaved"] for r in job] == [[p, p + 2] for p in pp_rank]
    assert [r["stages"]["pp2"] for r in job] == [[p] for p in pp_rank]
    assert all(os.path.basename(r["paths"]["pp2-interleaved"]) == f"step-{SAVE_AT}" for r in job)


@pytest.mark.parametrize("name", list(LOADS) + ["v2->pp1"])
def test_hyperparameters_restored_by_group_index(job, name):
    """Fresh optimizers built with lr 3e-2 and no weight decay take the saved (1e-2, 0.1) and (1e-2, 0.0)."""
    for r in job:
        assert r["hyper"][name] == [(LR, WD), (LR, 0.0)], (name, r["hyper"][name])


def test_meta_is_merged_over_every_rank(job, ref):
    """Rank 0 holds stage 0 only, yet meta has every parameter's shape and state kinds, and each group's
    param_names are those of both pp ranks' groups."""
    from shardfusion.checkpoint import FORMAT_VERSION, read_meta
    for path in job[0]["paths"].values():
        meta = read_meta(path)
        assert meta["version"] == FORMAT_VERSION == 3 and meta["world_size"] == 4
        assert meta["shapes"] == {n: tuple(p.shape) for n, p in ref["params"].items()}
        assert meta["optim_state"] == {n: {"step": "tensor", "exp_avg": "element", "exp_avg_sq": "element"}
                                       for n in ref["params"]}
        assert meta["optimizers"] == ["AdamW"]
        assert [sorted(g["param_names"]) for g in meta["param_groups"]] == [ref["decay"], ref["no_decay"]]
        assert [(g["lr"], g["weight_decay"]) for g in meta["param_groups"]] == [(LR, WD), (LR, 0.0)]


@pytest.mark.parametrize("source", list(SAVES))
def test_load_full_and_read_all_equal_the_reference(job, ref, source):
    """In this process, no process group: the parameters and the AdamW state after SAVE_AT steps."""
    from shardfusion.checkpoint import load_full, read_all
    path = job[0]["paths"][source]
    _close(load_full(path), ref["saved"], f"{source} load_full")
    stored = read_all(path)
    want = {f"optim/{n}/{k}": v for n, st in ref["state"].items() for k, v in st.items()}
    _close({k: v for k, v in stored.items() if k.startswith("optim/")}, want, f"{source} read_all",
           STATE_RTOL, STATE_ATOL)


def test_export_of_the_pp2_checkpoint_equals_the_reference(job, ref, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    from shardfusion.export import main
    assert main([job[0]["paths"]["pp2"], str(tmp_path / "export")]) == 0
    _close(load_file(str(tmp_path / "export" / "model.safetensors")), ref["saved"], "export")


@pytest.mark.parametrize("name", ["v2->pp1", "load_full_state->pp2xO2"])
def test_other_loads_give_the_saved_parameters(job, ref, name):
    """A version-2 meta loads (groups by index); `load_full_state` takes a list of stages too."""
    seen = {}
    for r in job:
        seen.update(r["full"][name])
    _close(seen, ref["saved"], name)


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_input_refused_on_every_rank(job, case):
    for rank, r in enumerate(job):
        kind, msg = r["refused"][case]
        assert kind == "ValueError", (case, rank, kind, msg)
        for words in REFUSED[case]:
            assert words in msg, (case, rank, words, msg)


@pytest.mark.parametrize("name", list(TIED))
def test_tied_embedding_resumes_across_pp(job, tied_ref, name):
    """The tied GPT saved at pp 2 (the head's copy on the last stage) resumes at pp 1 and back: the losses of all
    steps and the parameters equal one process; the checkpoint holds the tied weight once, as wte.weight."""
    full = {}
    for rank, r in enumerate(job):
        got = r["tied"][name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(tied_ref["losses"]), rtol=LOSS_RTOL,
                                   atol=LOSS_ATOL, msg=lambda m: f"{name} rank {rank} losses: {m}")
        full.update(got["full"])  # each stage's parameters (at pp 1: all of them)
        assert "lm_head.weight" not in got["stored"] and "wte.weight" in got["stored"], got["stored"]
    # the last stage's copy, or the tied alias of the whole GPT
    torch.testing.assert_close(full.pop("lm_head.weight"), full["wte.weight"], rtol=0, atol=0)
    _close(full, tied_ref["params"], name)
