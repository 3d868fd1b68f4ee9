"""DCP checkpoints (shardfusion/checkpoint/): loads into other layouts bitwise.

One W=4 job trains a tiny model two AdamW steps in (I, O) = (2, 2) and (4, 1), saves each, and loads the (2, 2)
checkpoint into fresh, differently initialized models at (4, 1), (1, 4) and (2, 2) with other units
(comm_unit_size), re-saving each; one W=2 job loads it at (2, 1). Checked: full_state_dict after load equals the saved
one bitwise; load_full (one process, no process group) equals it too; every key of every re-saved checkpoint (model,
exp_avg, exp_avg_sq, step) equals the original bitwise; the (2, 2) checkpoint is no bigger than the (4, 1) one
(replicas do not write); and one more step after the load matches one more step without save/load.
Per-rank state (`rank_state`, different keys on each rank) saved at W=4 comes back to the same global rank at W=4,
W=2 and W=8 (ranks 4..7 get their keys removed); a W=8 (4, 2) job loads the (2, 2) checkpoint bitwise (first dim 5
over 4 shards). A W=4 MoE job saves at ep 2 (weight decay 0.1) and loads at ep 2, ep 1 and ep 4 into optimizers
built with weight decay 0.0, expert buffers included: every rank ends with 0.1 (groups matched by index, not by rank
0's parameter names).

Publishing (save_checkpoint / latest_checkpoint) and the errors of a load are in
tests/distributed/test_checkpoint_publish.py; optimizer state across a resume (F9, F10) in
tests/distributed/test_checkpoint_resume.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from harness import run_distributed
from models import UnevenNet
from reference import assert_bitwise

JOB_TIMEOUT_S = 240
RANK_STATE = "I2O2-rank-state"  # the I2O2 checkpoint plus per-rank state


_TOPOS: dict = {}


def _build(inner: int, outer: int, seed: int, unit_kw: dict):
    import shardfusion as sf
    key = (inner, outer)
    if key not in _TOPOS:
        _TOPOS[key] = sf.Topology(sharding=inner * outer, fsdp_outer_degree=outer)
    torch.manual_seed(seed)
    model = sf.fully_shard(UnevenNet(), _TOPOS[key], **unit_kw)
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if "bias" not in n]},
                             {"params": [p for n, p in model.named_parameters() if "bias" in n],
                              "weight_decay": 0.0}], lr=0.05, weight_decay=0.1)
    return model, opt


def _train(model, opt, steps: int, first: int = 0) -> None:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(8, 6, generator=g)  # global batch, split over the data-parallel ranks
        x = x[rank * 8 // world:(rank + 1) * 8 // world]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _saved_rank_state(rank: int) -> dict:
    """What rank `rank` saves as per-rank state: a CPU RNG state (uint8), a tensor of its own size, a key of its
    own."""
    return {"rng": torch.Generator().manual_seed(1000 + rank).get_state(),
            "sized": torch.arange(rank + 1, dtype=torch.float64),
            f"only-{rank}": torch.tensor(rank)}


def _placeholder_rank_state(rank: int) -> dict:
    """What a loading rank passes: `rng` and `only-<rank>` of the stored shape and dtype (filled in place), `sized`
    of another shape (replaced), and a key no rank saved (removed)."""
    return {"rng": torch.zeros_like(torch.get_rng_state()), "sized": torch.zeros(0),
            f"only-{rank}": torch.tensor(-1), "never-saved": torch.zeros(2)}


def _load_rank_state(model, opt, path: str, rank: int) -> dict:
    """Load `path` with a placeholder rank state; report the dict after the load and which tensors were filled in
    place."""
    from shardfusion import checkpoint as ckpt
    state = _placeholder_rank_state(rank)
    before = {k: id(v) for k, v in state.items()}
    extra = ckpt.load(model, opt, path, rank_state=state)
    return {"state": state, "in_place": sorted(k for k, v in state.items() if id(v) == before[k]), "extra": extra}


def _w4_job(root: str) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    out: dict = {}
    by_class = {"units": (nn.Linear,)}
    for inner, outer in ((2, 2), (4, 1)):
        model, opt = _build(inner, outer, seed=0, unit_kw=by_class)
        _train(model, opt, 2)
        ckpt.save(model, opt, os.path.join(root, f"I{inner}O{outer}"), extra={"step": 2})
        if (inner, outer) == (2, 2):  # the same, plus per-rank state (kept apart: I2O2's bytes are measured below)
            ckpt.save(model, opt, os.path.join(root, RANK_STATE), extra={"step": 2},
                      rank_state=_saved_rank_state(dist.get_rank()))
        out[f"saved-I{inner}O{outer}"] = sf.full_state_dict(model)
        if (inner, outer) == (2, 2):
            _train(model, opt, 1, first=2)
            out["continued"] = sf.full_state_dict(model)
    src = os.path.join(root, "I2O2")
    bf16 = sf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for name, inner, outer, unit_kw in (("I4O1", 4, 1, by_class), ("I1O4", 1, 4, by_class),
                                        ("I2O2-size40", 2, 2, {"comm_unit_size": 40}),
                                        ("I4O1-whole-bf16", 4, 1, {"units": (nn.Linear,), "mp_policy": bf16,
                                                                   "replicate_filter": lambda n, p: "bias" in n})):
        model, opt = _build(inner, outer, seed=1, unit_kw=unit_kw)  # other initial values
        if name == "I4O1":
            out["rank_state"] = _load_rank_state(model, opt, os.path.join(root, RANK_STATE), dist.get_rank())
            extra = out["rank_state"]["extra"]
        else:
            extra = ckpt.load(model, opt, src)
        out[f"loaded-{name}"] = sf.full_state_dict(model)
        out[f"extra-{name}"] = extra
        ckpt.save(model, opt, os.path.join(root, f"resaved-{name}"))
        _train(model, opt, 1, first=2)
        out[f"continued-{name}"] = sf.full_state_dict(model)
    dist.barrier()
    return out


def _w2_job(root: str) -> dict:
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    import torch.distributed as dist
    model, opt = _build(2, 1, seed=2, unit_kw={"units": (nn.Linear,)})
    out = {"rank_state": _load_rank_state(model, opt, os.path.join(root, RANK_STATE), dist.get_rank())}
    out["loaded"] = sf.full_state_dict(model)
    ckpt.save(model, opt, os.path.join(root, "resaved-W2"))
    return out


def _w8_job(root: str) -> dict:
    """Load the W=4 (2, 2) checkpoint at W=8 (I, O) = (4, 2): a.weight's first dim 5 splits unevenly over 4."""
    import torch.distributed as dist
    import shardfusion as sf
    model, opt = _build(4, 2, seed=3, unit_kw={"units": (nn.Linear,)})
    out = {"rank_state": _load_rank_state(model, opt, os.path.join(root, RANK_STATE), dist.get_rank())}
    out["loaded"] = sf.full_state_dict(model)
    out["steps"] = sorted({float(st["step"]) for st in opt.state.values()})
    return out


def _moe_job(root: str) -> dict:
    """MoE: save at (ep, O) = (2, 2) with expert_policy "shard", load at (1, 2) and (4, 1) with "replicate". Every
    expert has a buffer, which only the saved model sets: loading restores it on the ranks holding that expert.
    Saved with weight decay 0.1; every load (also one at ep 2 into the saving model, where the ep rank 1 holds
    other experts than rank 0) uses an optimizer built with 0.0: `weight_decay` reports each rank's after the load."""
    import torch.distributed as dist
    import torch.nn.functional as F
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    from models import SEQ, VOCAB, MoEBlock, TinyMoETransformer
    out: dict = {}
    for name, ep, outer, policy, seed in (("ep2O2", 2, 2, "shard", 0), ("ep1O2", 1, 2, "replicate", 1),
                                          ("ep4O1", 4, 1, "replicate", 2)):
        topo = sf.Topology(sharding=4, ep=ep, fsdp_outer_degree=outer)
        torch.manual_seed(seed)
        model = TinyMoETransformer(ep_group=topo.get_group("ep"))
        for block in model.blocks:  # an expert buffer (global name experts.<g>.seen): g + 100 when saved, else 0
            for g, expert in block.moe.experts.items():
                expert.register_buffer("seen", torch.full((3,), float(int(g) + 100) if name == "ep2O2" else 0.0))
        model = sf.fully_shard(model, topo, units=(MoEBlock,), expert_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1 if name == "ep2O2" else 0.0)
        if name == "ep2O2":
            for s in range(2):
                idx = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 * s + dist.get_rank()))
                loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()) + 0.01 * model.aux_loss()
                loss.backward()
                opt.step()
                opt.zero_grad()
            ckpt.save(model, opt, os.path.join(root, "moe"))
            fresh = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
            ckpt.load(model, fresh, os.path.join(root, "moe"))
            out["weight_decay-ep2O2"] = [g["weight_decay"] for g in fresh.param_groups]
        else:
            ckpt.load(model, opt, os.path.join(root, "moe"))
            out[f"weight_decay-{name}"] = [g["weight_decay"] for g in opt.param_groups]
            ckpt.save(model, opt, os.path.join(root, f"moe-resaved-{name}"))
        out[name] = sf.full_state_dict(model)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    w4 = run_distributed(_w4_job, 4, root, timeout=JOB_TIMEOUT_S)
    w2 = run_distributed(_w2_job, 2, root, timeout=JOB_TIMEOUT_S)
    return root, w4, w2


@pytest.fixture(scope="module")
def w8_run(runs):
    root = runs[0]
    return run_distributed(_w8_job, 8, root, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe"))
    return root, run_distributed(_moe_job, 4, root, timeout=JOB_TIMEOUT_S)


def test_moe_other_ep_degrees(moe_runs):
    from shardfusion import checkpoint as ckpt
    root, rs = moe_runs
    saved = rs[0]["ep2O2"]
    assert any(".experts.3." in k for k in saved), sorted(saved)
    for g in range(4):  # expert buffers are in the checkpoint and come back (full_state_dict includes buffers)
        assert torch.equal(saved[f"blocks.1.moe.experts.{g}.seen"], torch.full((3,), g + 100.0))
    for r in range(4):
        for name in ("ep1O2", "ep4O1"):
            assert_bitwise(rs[r][name], saved, f"moe {name} rank {r}")
        for name in ("ep2O2", "ep1O2", "ep4O1"):  # the saved hyperparameters on every rank, whatever experts it holds
            assert rs[r][f"weight_decay-{name}"] == [0.1], (r, name, rs[r][f"weight_decay-{name}"])
    once = {k: v for k, v in saved.items() if k != "head.weight"}  # load_full: the tied head once, as emb.weight
    assert_bitwise(ckpt.load_full(os.path.join(root, "moe")), once, "moe load_full")
    orig = ckpt.read_all(os.path.join(root, "moe"))
    for name in ("ep1O2", "ep4O1"):
        assert_bitwise(ckpt.read_all(os.path.join(root, f"moe-resaved-{name}")), orig, f"moe resaved {name}")


def test_load_into_other_layouts_bitwise(runs):
    _root, w4, w2 = runs
    saved = w4[0]["saved-I2O2"]
    for name in ("I4O1", "I1O4", "I2O2-size40", "I4O1-whole-bf16"):
        for r in range(4):
            assert_bitwise(w4[r][f"loaded-{name}"], saved, f"W4 {name} rank {r}")
        assert w4[0][f"extra-{name}"] == {"step": 2}
    for r in range(2):
        assert_bitwise(w2[r]["loaded"], saved, f"W2 rank {r}")


def test_load_full_single_process(runs):
    from shardfusion import checkpoint as ckpt
    root, w4, _ = runs
    for layout in ("I2O2", "I4O1"):
        full = ckpt.load_full(os.path.join(root, layout))
        assert_bitwise(full, w4[0][f"saved-{layout}"], f"load_full {layout}")
    assert ckpt.load_full(os.path.join(root, "I2O2"))["a.weight"].shape == (5, 6)


def test_optimizer_state_round_trips(runs):
    """Every key (params, exp_avg, exp_avg_sq, step) of a checkpoint re-saved from another layout is bitwise equal."""
    from shardfusion import checkpoint as ckpt
    root, _, _ = runs
    orig = ckpt.read_all(os.path.join(root, "I2O2"))
    assert {"optim/a.weight/exp_avg", "optim/a.weight/exp_avg_sq", "optim/a.weight/step",
            "optim/scale/exp_avg"} <= orig.keys()
    assert float(orig["optim/a.weight/step"]) == 2.0
    for name in ("I4O1", "I1O4", "I2O2-size40", "I4O1-whole-bf16", "W2"):
        assert_bitwise(ckpt.read_all(os.path.join(root, f"resaved-{name}")), orig, f"resaved {name}")


def test_resume_continues_identically(runs):
    """One step after loading into the same layout equals one step without save/load (bitwise); other layouts
    agree to rounding (reduction order differs)."""
    _, w4, _ = runs
    ref = w4[0]["continued"]
    assert_bitwise(w4[0]["continued-I2O2-size40"], ref, "continued I2O2 (other units)")
    for name in ("I4O1", "I1O4"):
        for k in ref:
            torch.testing.assert_close(w4[0][f"continued-{name}"][k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_rank_state_per_rank(runs, w8_run):
    """Each rank saves its own `rank/<r>/...` keys (keys differ by rank); a load at W=4, W=2 and W=8 gives rank r the
    tensors rank r saved (in place where shape and dtype match), and removes the keys saved by no rank r (ranks 4..7
    at W=8 get none)."""
    from shardfusion import checkpoint as ckpt
    root, w4, w2 = runs
    path = os.path.join(root, RANK_STATE)
    assert ckpt.read_meta(path)["world_size"] == 4
    stored = {k: t for k, t in ckpt.read_all(path).items() if k.startswith("rank/")}
    assert_bitwise(stored, {f"rank/{r}/{k}": t for r in range(4) for k, t in _saved_rank_state(r).items()},
                    "stored rank state")
    loads = [("W4 I4O1", w4), ("W2", w2), ("W8", w8_run)]
    for what, results in loads:
        for r, result in enumerate(results):
            got = result["rank_state"]
            expected = _saved_rank_state(r) if r < 4 else {}
            assert_bitwise(got["state"], expected, f"{what} rank {r} rank_state")
            assert got["in_place"] == sorted(k for k in expected if k != "sized"), (what, r, got["in_place"])
            assert got["extra"] == {"step": 2}


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_load_at_world_size_8(runs, w8_run):
    """The W=4 (2, 2) checkpoint loads at W=8 (4, 2): gathered parameters bitwise equal, step restored everywhere."""
    _, w4, _ = runs
    saved = w4[0]["saved-I2O2"]
    for r, result in enumerate(w8_run):
        assert_bitwise(result["loaded"], saved, f"W8 rank {r}")
        assert result["steps"] == [2.0], (r, result["steps"])


def _payload(path: str) -> dict[str, int]:
    """Stored bytes per key, from the DCP metadata (the data files also hold per-item serialization headers)."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata()
    out: dict[str, int] = {}
    for index, info in md.storage_data.items():
        out[index.fqn] = out.get(index.fqn, 0) + info.length
    return out


def test_replicas_do_not_write(runs):
    """(I, O) = (2, 2) at W=4 writes what (2, 1) at W=2 writes: the replicas (ranks 2, 3) write nothing. (4, 1) at W=4
    stores the same elements in more chunks (its bytes differ only by per-chunk headers)."""
    from shardfusion import checkpoint as ckpt
    root, _, _ = runs
    p22, p21, p41 = (os.path.join(root, n) for n in ("I2O2", "resaved-W2", "I4O1"))
    assert os.path.getsize(os.path.join(p22, "__2_0.distcp")) == 0
    assert os.path.getsize(os.path.join(p22, "__3_0.distcp")) == 0
    pay22, pay21 = _payload(p22), _payload(p21)
    assert {k: v for k, v in pay22.items() if k != "meta"} == {k: v for k, v in pay21.items() if k != "meta"}
    data = lambda p: sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p) if f.endswith(".distcp"))
    assert abs(data(p22) - data(p21)) <= 64, (data(p22), data(p21))  # only the pickled `extra` differs
    b22, b41 = ckpt.checkpoint_bytes(p22), ckpt.checkpoint_bytes(p41)
    assert b22 <= b41, (b22, b41)
    print(f"\nbytes: I2O2(W4)={b22} I2O1(W2)={ckpt.checkpoint_bytes(p21)} I4O1(W4)={b41}")
