"""model.state_dict() / model.load_state_dict() of a sharded model, torch's DCP state-dict API, sf.full_state_dict
(local_state_dict.py, dtensor_state_dict.py, optimizer_state_dict.py).

One W=4 job. A plain `Outer` model (a plain Linear `pre` plus `net`: an embedding tied with the head, a Linear
whose fragments are uneven, BatchNorm, a non-persistent buffer) is the single-process reference; its `net` is
sharded at (I, O) = (4, 1) and (2, 2) (biases kept whole) inside a fresh, differently initialized `Outer`. Checked:
the plain state dict (full shapes) loads with strict=True through the bigger module (prefix "net.") and
full_state_dict then equals it bitwise, the tied alias included (a plain Net loads it strictly); one layout's
full_state_dict loads into the other; a rank's own model.state_dict() (full-shape DTensors; torch.save /
torch.load) loads back on that rank, and the other layout's too; a state dict whose metadata says rank 0 saved it,
loaded on every rank (the habit, with even and uneven fragments), fragments without metadata, a DTensor of another
shape, and a load on a submodule are refused with a ValueError on every rank and nothing is copied; strict=False /
strict=True report missing keys as torch does on the plain model. MoE at ep 2: the plain model (every expert) loads
with strict=True, state_dict() holds this ep rank's experts as DTensors over the ranks of its ep index, and each
rank's own state dict round-trips, and so does a DCP checkpoint of it into ep 1. Non-persistent buffers are not in
full_state_dict, which a plain model then loads strictly. A model whose attention splits its fused qkv on save
(torch.chunk in its own state-dict hook) and fuses it on load: the sharded state_dict() equals the plain one after
full_tensor(), and both load back. torch's
get/set_model_state_dict and get/set_optimizer_state_dict with dcp.save / dcp.load: saved at FSDP 4 after 2 AdamW
steps, loaded at HSDP 2x2 bitwise, 2 more steps equal the single-process run; full state dicts
(`full_state_dict=True`) into dp 2 x sharding 2; the checkpoint into a plain model in one process; torch's own
load_state_dict calls (model and optimizer) before a first step; an optimizer state of another shape refused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

JOB_TIMEOUT_S = 240
LAYOUTS = {"I4O1": ({"sharding": 4}, {}),
           "I2O2": ({"sharding": 4, "fsdp_outer_degree": 2}, {"replicate_filter": lambda n, p: n.endswith("bias")})}


class Net(nn.Module):
    """emb (7, 6) tied with head; a (6, 6) + bias (42 elements: fragments 12, 12, 12, 0 + bias); BatchNorm;
    a non-persistent buffer `cache`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6)
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("cache", torch.arange(3.0), persistent=False)

    def forward(self, idx):  # idx: (B,) int64 -> (B, 7)
        return self.head(torch.tanh(self.bn(self.a(self.emb(idx)))))


class Outer(nn.Module):
    """A plain Linear and a Net: the sharded Net is a submodule (state dict prefix "net.")."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.net = Net()


class Cache(nn.Module):
    """The habit's model: a Linear and a non-persistent mask buffer."""

    def __init__(self, max_len: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mask", torch.ones(max_len, max_len).tril(), persistent=False)

    def forward(self, x):
        return self.fc(x)


def _split_qkv(module, state_dict, prefix, local_metadata) -> None:
    """A model's own state-dict hook: save the fused qkv Linear as q, k, v, split by shape (torch.chunk, dim 0)."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}")  # (18, 6) / (18,)
        for name, part in zip("qkv", torch.chunk(fused, 3, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = part


def _fuse_qkv(module, state_dict, prefix, *rest) -> None:
    """Its load pre-hook: q, k, v back into qkv (torch.cat, dim 0)."""
    for kind in ("weight", "bias"):
        parts = [state_dict.pop(f"{prefix}{name}.{kind}", None) for name in "qkv"]
        if all(p is not None for p in parts):
            state_dict[f"{prefix}qkv.{kind}"] = torch.cat(parts, dim=0)


class Attn(nn.Module):
    """A fused qkv Linear (6 -> 18) whose state dict holds q, k, v (6 -> 6 each) through `_split_qkv`, fused back on
    load by `_fuse_qkv`."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(6, 18)
        self._register_state_dict_hook(_split_qkv)
        self._register_load_state_dict_pre_hook(_fuse_qkv, with_module=True)

    def forward(self, x):  # (B, 6) -> (B, 6)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return q * k + v


class TiedLM(nn.Module):
    """emb (7, 6) tied with head; attn (a qkv split on save, see Attn; with `split=False` a plain (6, 6) Linear),
    LayerNorm."""

    def __init__(self, split: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6)
        self.attn = Attn() if split else nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):  # idx: (B,) int64 -> (B, 7)
        return self.head(self.ln(torch.tanh(self.attn(self.emb(idx)))))


DCP_STEPS = 2  # optimizer steps before the checkpoint, and after the resume
DCP_BATCH = 8  # global batch; each of the 4 ranks takes 2 rows


def dcp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: (idx (8,), targets (8,)), int64."""
    g = torch.Generator().manual_seed(42 + step)
    return torch.randint(0, 7, (DCP_BATCH,), generator=g), torch.randint(0, 7, (DCP_BATCH,), generator=g)


def _dcp_steps(model, optim, steps, rows: slice) -> list[float]:
    """Train `steps` (global batch rows `rows` on this rank); the losses (this rank's mean, over the data-parallel
    ranks averaged by the caller)."""
    losses = []
    for step in steps:
        idx, target = dcp_batch(step)
        loss = nn.functional.cross_entropy(model(idx[rows]), target[rows])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _mean_over_ranks(losses: list[torch.Tensor]) -> list[float]:
    import torch.distributed as dist
    t = torch.stack(losses)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _cloned(tree):
    """`tree` with every tensor cloned (an optimizer state dict holds the live `step` tensors)."""
    from torch.utils._pytree import tree_map_only
    return tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


def _dcp_job(tmp: str) -> dict:
    """FSDP 4 trains DCP_STEPS and saves with torch's DCP state-dict API (model and AdamW); HSDP 2x2 loads it into a
    differently initialized model and optimizer and trains DCP_STEPS more."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor
    import shardfusion as sf
    rank = dist.get_rank()
    rows = slice(2 * rank, 2 * rank + 2)
    full = StateDictOptions(full_state_dict=True)
    ckpt = os.path.join(tmp, "dcp")
    out = {}

    torch.manual_seed(0)
    model = sf.fully_shard(TiedLM(split=False), sf.Topology(sharding=4), units=(nn.Linear,))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    out["losses-before"] = _mean_over_ranks(_dcp_steps(model, optim, range(DCP_STEPS), rows))
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
    out["types"] = ({k: type(v).__name__ for k, v in msd.items()},
                    {k: type(v).__name__ for k, v in osd["state"]["attn.weight"].items()})
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    out["saved-model"] = get_model_state_dict(model, options=full)
    saved_optim = _cloned(get_optimizer_state_dict(model, optim, options=full))
    out["saved-optim"] = saved_optim["state"]
    out["fragments-kept"] = all(not isinstance(p, DTensor) for p in model.parameters()) and all(
        not isinstance(t, DTensor) for st in optim.state.values() for t in st.values())

    # torch's own calls, no DCP: model.load_state_dict / optimizer.load_state_dict of the DTensors, before a step
    torch.manual_seed(11)
    again = sf.fully_shard(TiedLM(split=False), sf.Topology(sharding=4), units=(nn.Linear,))
    optim4 = torch.optim.AdamW(again.parameters(), lr=0.05, weight_decay=0.1)
    again.load_state_dict(model.state_dict())
    optim4.load_state_dict(optim.state_dict())
    out["plain-api-loss"] = _mean_over_ranks(_dcp_steps(again, optim4, range(DCP_STEPS, 2 * DCP_STEPS), rows))
    out["plain-api-fragments"] = all(not isinstance(t, DTensor) for st in optim4.state.values() for t in st.values())
    bad = optim4.state_dict()
    bad["state"][0] = dict(bad["state"][0], exp_avg=torch.zeros(3, 3))  # emb.weight is (7, 6)
    out["optim-wrong-shape"] = _outcome(lambda: optim4.load_state_dict(bad))

    torch.manual_seed(9)
    resumed = sf.fully_shard(TiedLM(split=False), sf.Topology(sharding=4, fsdp_outer_degree=2), units=(nn.Linear,),
                             replicate_filter=lambda n, p: n.endswith("bias"))
    optim2 = torch.optim.AdamW(resumed.parameters(), lr=0.05, weight_decay=0.1)
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, optim2)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, optim2, state["optim"])
    out["loaded-model"] = get_model_state_dict(resumed, options=full)
    out["loaded-optim"] = _cloned(get_optimizer_state_dict(resumed, optim2, options=full)["state"])
    out["losses-after"] = _mean_over_ranks(_dcp_steps(resumed, optim2, range(DCP_STEPS, 2 * DCP_STEPS), rows))
    out["final"] = sf.full_state_dict(resumed)

    # full state dicts through torch's API: into a third layout with full_state_dict=True
    torch.manual_seed(10)
    third = sf.fully_shard(TiedLM(split=False), sf.Topology(sharding=2, dp=2), units=(nn.Linear,))
    optim3 = torch.optim.AdamW(third.parameters(), lr=0.05, weight_decay=0.1)
    set_model_state_dict(third, out["saved-model"], options=full)
    set_optimizer_state_dict(third, optim3, saved_optim, options=full)
    out["third-model"] = sf.full_state_dict(third)
    out["third-optim"] = get_optimizer_state_dict(third, optim3, options=full)["state"]
    return out


def _raise(module, state_dict, prefix, local_metadata) -> None:
    raise RuntimeError("a state-dict hook failed")


def _qkv_job(tmp: str) -> dict:
    """model.state_dict() of a TiedLM whose attention splits its fused qkv on save, in each layout."""
    from torch.distributed.tensor import DTensor
    import shardfusion as sf
    out = {}
    for tag, (topo_kw, wrap_kw) in LAYOUTS.items():
        torch.manual_seed(0)
        model = sf.fully_shard(TiedLM(), sf.Topology(**topo_kw), units=(nn.Linear,), **wrap_kw)
        sd = model.state_dict()
        w = sd["ln.weight"]
        out[tag] = {"keys": list(sd),
                    "values": {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in sd.items()},
                    "dtensors": sorted(k for k, v in sd.items() if isinstance(v, DTensor)),
                    "ln": (tuple(w.shape), w.device_mesh.mesh_dim_names, tuple(map(str, w.placements)),
                           tuple(w.to_local().shape)),
                    "fragments-back": all(not isinstance(p, DTensor) for p in model.parameters())}
        handle = model.ln.register_state_dict_post_hook(_raise)
        out[tag]["hook-raised"] = _outcome(model.state_dict)
        handle.remove()
        out[tag]["forward-after-raise"] = _outcome(lambda: model(torch.arange(4)).shape)
        out[tag]["fragments-after-raise"] = all(not isinstance(p, DTensor) for p in model.parameters())
        torch.manual_seed(1)
        other = sf.fully_shard(TiedLM(), sf.Topology(**topo_kw), units=(nn.Linear,), **wrap_kw)
        out[tag]["load-split"] = _outcome(lambda: _incompatible(other.load_state_dict(sd)))  # split DTensors
        out[tag]["load-split-full"] = sf.full_state_dict(other)
        torch.manual_seed(0)
        plain = TiedLM().state_dict()  # split plain tensors
        torch.manual_seed(1)
        other = sf.fully_shard(TiedLM(), sf.Topology(**topo_kw), units=(nn.Linear,), **wrap_kw)
        out[tag]["load-plain"] = _outcome(lambda: _incompatible(other.load_state_dict(plain)))
        out[tag]["load-plain-full"] = sf.full_state_dict(other)
    return out


def _runtime_error(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return ""


def _outcome(fn):
    """`fn()`, or what it raised as a string (so that the job goes on and each test reports its own failure)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"raised {type(e).__name__}: {e}"


def _incompatible(result) -> tuple | str:
    return result if isinstance(result, str) else (sorted(result.missing_keys), sorted(result.unexpected_keys))


def _outer(seed: int, layout: str | None):
    import shardfusion as sf
    torch.manual_seed(seed)
    model = Outer()
    if layout is not None:
        topo_kw, wrap_kw = LAYOUTS[layout]
        sf.fully_shard(model.net, sf.Topology(**topo_kw), units=(nn.Linear,), **wrap_kw)
    return model


def _refused_unchanged(model, load) -> tuple[str, bool]:
    """(what `load()` raised, or "returned ...", whether the sharded model's full state stayed as it was)."""
    import shardfusion as sf
    before = sf.full_state_dict(model)
    result = _outcome(load)
    msg = result if isinstance(result, str) else f"returned {result}"
    after = sf.full_state_dict(model)
    return msg, all(torch.equal(before[k], after[k]) for k in before)


def _as_saved_by_rank0(sd):
    """`sd` (a sharded model's state_dict()) as rank 0's, torch.save'd and loaded on this rank, says: its metadata
    names rank 0 (a real rank 0 file does not even unpickle on ranks outside rank 0's process groups)."""
    for entry in sd._metadata.values():
        if "shardfusion" in entry:
            entry["shardfusion"] = dict(entry["shardfusion"], rank=0)
    return sd


def _layout_job(tmp: str) -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    rank = dist.get_rank()
    plain = _outer(0, None).state_dict()
    out: dict = {}
    models = {}
    for tag in LAYOUTS:
        model = models[tag] = _outer(1, tag)
        out[f"{tag}-incompatible"] = _incompatible(_outcome(lambda: model.load_state_dict(plain)))
        out[f"{tag}-full"] = sf.full_state_dict(model.net)
        out[f"{tag}-pre"] = model.pre.weight.detach().clone()
        torch.save(model.state_dict(), os.path.join(tmp, f"{tag}-rank{rank}.pt"))
        before = sf.full_state_dict(model.net)
        _outcome(lambda: model.load_state_dict(_outer(2, None).state_dict()))  # other values
        loaded = _outcome(lambda: model.load_state_dict(torch.load(os.path.join(tmp, f"{tag}-rank{rank}.pt"))))
        out[f"{tag}-round-trip"] = (before, sf.full_state_dict(model.net), _incompatible(loaded))
    # one layout's full_state_dict into the other (tied head.weight appears once in it)
    fresh = _outer(3, "I2O2")
    full = sf.full_state_dict(models["I4O1"].net)
    out["I4O1-full-into-I2O2-incompatible"] = _incompatible(_outcome(lambda: fresh.net.load_state_dict(full)))
    out["I4O1-full-into-I2O2"] = sf.full_state_dict(fresh.net)
    dist.barrier()
    m = models["I4O1"]
    out["rank0-uneven"] = _refused_unchanged(m.net, lambda: m.load_state_dict(_as_saved_by_rank0(m.state_dict())))
    # this rank's DTensors of the other layout (torch.save'd by this rank): full shapes, so they load
    out["other-layout"] = _outcome(lambda: _incompatible(m.load_state_dict(
        torch.load(os.path.join(tmp, f"I2O2-rank{rank}.pt")))))
    out["other-layout-full"] = (sf.full_state_dict(m.net), sf.full_state_dict(models["I2O2"].net))
    fragments = {k: v.detach().clone() for k, v in m.net.named_parameters()}  # this rank's fragments, no metadata
    out["no-metadata"] = _refused_unchanged(m.net, lambda: m.net.load_state_dict(fragments, strict=False))
    wrong = m.state_dict()
    wrong["net.a.weight"] = wrong["net.emb.weight"]  # a DTensor of another shape
    out["wrong-dtensor"] = _refused_unchanged(m.net, lambda: m.load_state_dict(wrong))
    out["submodule"] = _refused_unchanged(m.net, lambda: m.net.a.load_state_dict(_outer(2, None).net.a.state_dict()))
    partial = {k: v for k, v in _outer(2, None).state_dict().items() if k != "net.a.weight"}
    out["partial"] = _incompatible(_outcome(lambda: m.load_state_dict(partial, strict=False)))
    out["partial-full"] = sf.full_state_dict(m.net)
    out["strict-missing"] = _runtime_error(lambda: m.load_state_dict(partial))
    return out


def _habit_job(tmp: str) -> dict:
    """The habit: rank 0's model.state_dict(), torch.save'd, loaded on every rank (even fragments: 64 each)."""
    import torch.distributed as dist
    import shardfusion as sf
    torch.manual_seed(0)
    m = sf.fully_shard(nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False)),
                       sf.Topology(sharding=-1), units=(nn.Linear,))
    out = {"rank0": _refused_unchanged(m, lambda: m.load_state_dict(_as_saved_by_rank0(m.state_dict())))}
    cache = sf.fully_shard(Cache(), sf.Topology(sharding=-1), units=(nn.Linear,))
    out["cache-full"] = sf.full_state_dict(cache)
    return out


def _moe_job(tmp: str) -> dict:
    """MoE at ep 2: each ep rank holds 2 of the 4 experts of each block under their global names."""
    import torch.distributed as dist
    import shardfusion as sf
    from models import MoEBlock, TinyMoETransformer
    topo = sf.Topology(sharding=4, ep=2)
    torch.manual_seed(3)
    plain = TinyMoETransformer()  # every expert
    torch.manual_seed(4)
    model = sf.fully_shard(TinyMoETransformer(ep_group=topo.get_group("ep")), topo, units=(MoEBlock,))
    out = {"incompatible": _incompatible(_outcome(lambda: model.load_state_dict(plain.state_dict()))),
           "full": sf.full_state_dict(model), "plain": plain.state_dict()}
    from torch.distributed.tensor import DTensor
    sd = model.state_dict()  # this ep rank's experts, as full-shape DTensors over their own meshes
    out["dtensors"] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    out["expert-mesh"] = next(tuple(v.device_mesh.mesh.flatten().tolist()) for k, v in sd.items()
                              if ".experts." in k and isinstance(v, DTensor))
    path = os.path.join(tmp, f"moe-rank{dist.get_rank()}.pt")
    torch.save(model.state_dict(), path)
    torch.manual_seed(5)
    _outcome(lambda: model.load_state_dict(TinyMoETransformer().state_dict()))
    out["round-trip-incompatible"] = _incompatible(_outcome(lambda: model.load_state_dict(torch.load(path))))
    out["round-trip"] = sf.full_state_dict(model)
    # torch's DCP state-dict API: saved at ep 2 (each ep rank its own experts), loaded at ep 1 x outer 2 (every expert)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(tmp, "moe-dcp"))
    topo1 = sf.Topology(sharding=4, fsdp_outer_degree=2)
    torch.manual_seed(6)
    other = sf.fully_shard(TinyMoETransformer(ep_group=topo1.get_group("ep")), topo1, units=(MoEBlock,))
    state = {"model": get_model_state_dict(other)}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "moe-dcp"))
    set_model_state_dict(other, state["model"])
    out["dcp-ep1"] = sf.full_state_dict(other)
    return out


class Scaled(nn.Module):
    """A (4, 4) Linear times a learned 0-dim temperature `scale` (a fragment of shape (1,) on one rank, (0,) on the
    others)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):  # (B, 4) -> (B, 4)
        return self.fc(x) * self.scale


def _scalar_steps(model, optim) -> None:
    """One AdamW step on a fixed batch: the full batch on every rank (so the sharded run equals one process)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _scalar_job(tmp: str) -> dict:
    """The optimizer state of a 0-dim parameter through get/set_optimizer_state_dict (a DTensor of shape ())."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    import shardfusion as sf
    torch.manual_seed(0)
    model = sf.fully_shard(Scaled(), sf.Topology(sharding=4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _scalar_steps(model, optim)
    sharded = get_optimizer_state_dict(model, optim)
    full = _cloned(get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)))
    torch.manual_seed(1)
    other = sf.fully_shard(Scaled(), sf.Topology(sharding=4))
    optim2 = torch.optim.AdamW(other.parameters(), lr=0.1)
    loaded = _outcome(lambda: set_optimizer_state_dict(other, optim2, sharded))
    frag = dict(other.named_parameters())["scale"]
    return {"shape": tuple(sharded["state"]["scale"]["exp_avg"].shape), "full": full["state"], "loaded": loaded,
            "fragment": {k: (v.clone(), tuple(v.shape)) for k, v in optim2.state[frag].items() if k != "step"},
            "frag-shape": tuple(frag.shape)}


def _all_jobs(tmp: str) -> dict:
    return {"layout": _layout_job(tmp), "habit": _habit_job(tmp), "moe": _moe_job(tmp), "qkv": _qkv_job(tmp),
            "dcp": _dcp_job(tmp), "scalar": _scalar_job(tmp), "dcp-dir": tmp}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all_jobs, 4, str(tmp_path_factory.mktemp("state_dict")), timeout=JOB_TIMEOUT_S)


def _plain(seed: int) -> dict:
    torch.manual_seed(seed)
    return Outer().state_dict()


def _assert_equal(actual: dict, expected: dict, what: str) -> None:
    for k, v in actual.items():
        assert torch.equal(v, expected[k]), f"{what}: {k} differs"


def _net(sd: dict) -> dict:
    """The `net.` entries of an Outer state dict, without the prefix (the tied alias head.weight too)."""
    return {k[len("net."):]: v for k, v in sd.items() if k.startswith("net.")}


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_full_shape_dict_loads_into_each_layout(runs):
    plain = _plain(0)
    for r in runs:
        for tag in LAYOUTS:
            lay = r["layout"]
            assert lay[f"{tag}-incompatible"] == ([], []), (tag, lay[f"{tag}-incompatible"])
            assert sorted(lay[f"{tag}-full"]) == sorted(_net(plain)), tag
            _assert_equal(lay[f"{tag}-full"], _net(plain), tag)
            assert torch.equal(lay[f"{tag}-pre"], plain["pre.weight"]), tag  # the plain part of the bigger module


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_full_state_dict_loads_into_another_layout(runs):
    for r in runs:
        incompatible = r["layout"]["I4O1-full-into-I2O2-incompatible"]
        assert incompatible == ([], []), incompatible
        _assert_equal(r["layout"]["I4O1-full-into-I2O2"], _net(_plain(0)), "I4O1 full_state_dict into I2O2")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_own_state_dict_round_trips_on_the_same_rank(runs):
    for r in runs:
        for tag in LAYOUTS:
            before, after, incompatible = r["layout"][f"{tag}-round-trip"]
            assert incompatible == ([], []), (tag, incompatible)
            _assert_equal(after, before, f"{tag} round trip")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_rank0_state_dict_refused_on_every_rank(runs):
    for rank, r in enumerate(runs):
        for msg, unchanged in (r["habit"]["rank0"], r["layout"]["rank0-uneven"]):
            assert unchanged, f"rank {rank}: the model changed"
            assert msg.startswith("raised ValueError: ") and "saved by rank 0 of 4" in msg, (rank, msg)
            assert "refused on every rank" in msg, msg
            assert "rank 1: '" in msg and "full_state_dict" in msg and "shardfusion.checkpoint" in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_other_layout_dtensor_state_dict_loads(runs):
    for rank, r in enumerate(runs):
        assert r["layout"]["other-layout"] == ([], []), (rank, r["layout"]["other-layout"])
        loaded, source = r["layout"]["other-layout-full"]
        _assert_equal(loaded, source, f"rank {rank}: I2O2 state_dict() into I4O1")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_dtensor_of_another_shape_refused(runs):
    for rank, r in enumerate(runs):
        msg, unchanged = r["layout"]["wrong-dtensor"]
        assert unchanged and msg.startswith("raised ValueError: "), (rank, msg)
        assert "'net.a.weight' has shape (7, 6): neither the full shape (6, 6)" in msg, (rank, msg)
        assert "keys refused per rank {0: 1, 1: 1, 2: 1, 3: 1}" in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_fragments_without_metadata_refused(runs):
    for rank, r in enumerate(runs):
        msg, unchanged = r["layout"]["no-metadata"]
        assert unchanged and msg.startswith("raised ValueError: "), (rank, msg)
        assert "no shardfusion metadata" in msg and "not the full shape" in msg, (rank, msg)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_load_on_a_submodule_refused(runs):
    for rank, r in enumerate(runs):
        msg, unchanged = r["layout"]["submodule"]
        assert unchanged and msg.startswith("raised ValueError: "), (rank, msg)
        assert "load_state_dict on 'a'" in msg and "call load_state_dict on the sharded model" in msg, (rank, msg)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_strict_semantics_as_torch(runs):
    partial = {k: v for k, v in _plain(2).items() if k != "net.a.weight"}
    torch.manual_seed(1)
    reference = Outer()
    result = reference.load_state_dict(partial, strict=False)
    expected = (sorted(result.missing_keys), sorted(result.unexpected_keys))
    assert expected == (["net.a.weight"], [])
    ref_net = _net(reference.state_dict())
    for r in runs:
        assert r["layout"]["partial"] == expected
        full = r["layout"]["partial-full"]
        _assert_equal({k: v for k, v in full.items() if k != "a.weight"}, ref_net, "strict=False")
        assert "Missing key(s) in state_dict: \"net.a.weight\"" in r["layout"]["strict-missing"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_expert_parameters_load_full_and_own_fragments(runs):
    for rank, r in enumerate(runs):
        moe = r["moe"]
        assert moe["incompatible"] == ([], []), (rank, moe["incompatible"])
        assert set(moe["full"]) == set(moe["plain"]), rank  # the tied head under both names
        _assert_equal(moe["full"], moe["plain"], f"rank {rank}: MoE full")
        experts = {k for k in moe["plain"] if ".experts." in k}
        mine = set(moe["dtensors"]) & experts
        assert mine and len(mine) == len(experts) // 2 and set(moe["dtensors"]) - experts == set(moe["plain"]) - experts
        _assert_equal(moe["dtensors"], moe["plain"], f"rank {rank}: MoE state_dict() DTensors")
        assert moe["expert-mesh"] == ((0, 2) if rank % 2 == 0 else (1, 3)), moe["expert-mesh"]  # same ep index
        assert moe["round-trip-incompatible"] == ([], []), (rank, moe["round-trip-incompatible"])
        _assert_equal(moe["round-trip"], moe["plain"], f"rank {rank}: MoE round trip")
        assert sorted(moe["dcp-ep1"]) == sorted(moe["plain"]), rank
        _assert_equal(moe["dcp-ep1"], moe["plain"], f"rank {rank}: MoE through DCP, ep 2 -> ep 1")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nonpersistent_buffers_left_out_of_full_state_dict(runs):
    plain = Cache()
    for r in runs:
        full = r["habit"]["cache-full"]
        assert sorted(full) == sorted(plain.state_dict()) == ["fc.bias", "fc.weight"]
        assert not plain.load_state_dict(full).missing_keys  # strict
        assert "cache" not in r["layout"]["I4O1-full"]


def _reference_lm(steps: int):
    """The single-process TiedLM(split=False) and its AdamW after `steps` global batches, and the losses."""
    torch.manual_seed(0)
    model = TiedLM(split=False)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses = [float(x) for x in _dcp_steps(model, optim, range(steps), slice(None))]
    return model, optim, losses


def _close(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), (what, sorted(actual), sorted(expected))
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {k}: {m}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_state_dict_hooks_see_full_shape_dtensors(runs):
    """A model's own hook splits qkv by torch.chunk: the sharded model's state_dict() equals the plain one's."""
    torch.manual_seed(0)
    plain = TiedLM().state_dict()
    assert {"attn.q.weight", "attn.v.bias", "emb.weight", "head.weight"} <= set(plain)
    assert "attn.qkv.weight" not in plain
    for rank, r in enumerate(runs):
        for tag in LAYOUTS:
            got = r["qkv"][tag]
            assert got["keys"] == list(plain), (rank, tag, got["keys"])
            _assert_equal(got["values"], plain, f"rank {rank} {tag}")
            assert got["fragments-back"], (rank, tag)
            # a hook that raises leaves the DTensors in the modules until the next forward, that restores the fragments
            assert got["hook-raised"] == "raised RuntimeError: a state-dict hook failed", got["hook-raised"]
            assert got["forward-after-raise"] == torch.Size([4, 7]) and got["fragments-after-raise"], (rank, tag)
            # and back, through the model's own load pre-hook that fuses q, k, v (its DTensors, a plain state dict)
            torch.manual_seed(0)
            want = TiedLM(split=True)
            want_full = {n: p.detach() for n, p in want.named_parameters(remove_duplicate=False)}
            for key in ("load-split", "load-plain"):
                assert got[key] == ([], []), (rank, tag, key, got[key])
                _assert_equal(got[f"{key}-full"], want_full, f"rank {rank} {tag} {key}")
        # every parameter is a DTensor (kept-whole biases too); Shard(0) over the inner group, Replicate over outer
        assert r["qkv"]["I4O1"]["dtensors"] == sorted(plain)
        assert r["qkv"]["I4O1"]["ln"] == ((6,), ("replicate", "shard"), ("R", "S(0)"), (2,) if rank < 3 else (0,))
        assert r["qkv"]["I2O2"]["ln"] == ((6,), ("replicate", "shard"), ("R", "S(0)"), (3,))


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_dcp_state_dict_api_round_trip_across_layouts(runs):
    """get/set_model_state_dict and get/set_optimizer_state_dict with dcp.save / dcp.load: saved at FSDP 4, loaded
    at HSDP 2x2 (bitwise), trained on like the single-process reference; and through full state dicts."""
    ref_model, ref_optim, ref_losses = _reference_lm(2 * DCP_STEPS)
    mid_model, mid_optim, _ = _reference_lm(DCP_STEPS)
    names = {id(p): n for n, p in mid_model.named_parameters()}
    mid_state = {names[id(p)]: {k: v for k, v in st.items()} for p, st in mid_optim.state.items()}
    for rank, r in enumerate(runs):
        d = r["dcp"]
        model_types, optim_types = d["types"]
        assert set(model_types.values()) == {"DTensor"}, model_types
        assert optim_types == {"step": "Tensor", "exp_avg": "DTensor", "exp_avg_sq": "DTensor"}, optim_types
        assert d["fragments-kept"], rank
        _close(d["saved-model"], mid_model.state_dict(), f"rank {rank} saved model")
        _close(d["saved-optim"], mid_state, f"rank {rank} saved optimizer")
        _assert_equal(d["loaded-model"], d["saved-model"], f"rank {rank} dcp model round trip")
        for name, st in d["saved-optim"].items():
            _assert_equal(d["loaded-optim"][name], st, f"rank {rank} dcp optimizer round trip {name}")
        torch.testing.assert_close(d["losses-before"] + d["losses-after"], ref_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d["plain-api-loss"], ref_losses[DCP_STEPS:], rtol=1e-5, atol=1e-6)
        assert d["plain-api-fragments"], rank
        assert d["optim-wrong-shape"].startswith("raised ValueError: optimizer state 'exp_avg' of 'emb.weight' has "
                                                 "shape (3, 3), neither the parameter's full shape (7, 6)"), d
        _close(d["final"], ref_model.state_dict(), f"rank {rank} after resume")
        _assert_equal(d["third-model"], d["saved-model"], f"rank {rank} full_state_dict=True into dp2 x sharding2")
        for name, st in d["saved-optim"].items():
            _assert_equal(d["third-optim"][name], st, f"rank {rank} full optimizer state into dp2 x sharding2")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_dcp_checkpoint_loads_into_a_plain_model(runs):
    """DCP's resharding: the FSDP 4 checkpoint loads into a single-process plain model."""
    import torch.distributed.checkpoint as dcp
    ckpt = os.path.join(str(runs[0]["dcp-dir"]), "dcp")
    torch.manual_seed(5)
    plain = TiedLM(split=False)
    sd = plain.state_dict()
    dcp.load({"model": sd}, checkpoint_id=ckpt)
    assert not plain.load_state_dict(sd).missing_keys
    _assert_equal(plain.state_dict(), runs[0]["dcp"]["saved-model"], "plain model from the DCP checkpoint")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_full_state_dict_loads_strictly_into_a_plain_model_with_tied_weights(runs):
    for rank, r in enumerate(runs):
        full = r["layout"]["I4O1-full"]
        assert "head.weight" in full and torch.equal(full["head.weight"], full["emb.weight"]), rank
        plain = Net()
        result = plain.load_state_dict(full)  # strict
        assert (result.missing_keys, result.unexpected_keys) == ([], []), result
        assert plain.head.weight is plain.emb.weight


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_dcp_optimizer_state_of_a_0dim_parameter_loads_as_its_fragment(runs):
    """A 0-dim parameter's AdamW state is a DTensor of shape () in the sharded optimizer state dict, equals one
    process's in the full one, and loads back as this rank's fragment ((1,) on the rank that holds it, (0,) else)."""
    torch.manual_seed(0)
    ref = Scaled()
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.1)
    _scalar_steps(ref, ref_optim)
    want = ref_optim.state[ref.scale]
    for rank, r in enumerate(runs):
        s = r["scalar"]
        assert s["shape"] == (), (rank, s["shape"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s["full"]["scale"][name], want[name], rtol=1e-6, atol=1e-7)
        assert s["loaded"] is None, (rank, s["loaded"])
        for name, (value, shape) in s["fragment"].items():
            assert shape == s["frag-shape"], (rank, name, shape, s["frag-shape"])
            if shape == (1,):
                torch.testing.assert_close(value[0], want[name], rtol=1e-6, atol=1e-7)
    assert sorted(r["scalar"]["frag-shape"] for r in runs).count((1,)) == 1, [r["scalar"]["frag-shape"] for r in runs]
