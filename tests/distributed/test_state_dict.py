"""model.state_dict() / model.load_state_dict() of a sharded model and sf.full_state_dict (local_state_dict.py).

One W=4 job. A plain `Outer` model (a plain Linear `pre` plus `net`: an embedding tied with the head, a Linear
whose fragments are uneven, BatchNorm, a non-persistent buffer) is the single-process reference; its `net` is
sharded at (I, O) = (4, 1) and (2, 2) (biases kept whole) inside a fresh, differently initialized `Outer`. Checked:
the plain state dict (full shapes) loads with strict=True through the bigger module (prefix "net.") and
full_state_dict then equals it bitwise; one layout's full_state_dict loads into the other; a rank's own
model.state_dict() (torch.save / torch.load) loads back on that rank; rank 0's state dict loaded on every rank
(the habit, with even and uneven fragments), another layout's or a metadata-less fragment dict, and a load on a
submodule are refused with a ValueError on every rank and nothing is copied; strict=False / strict=True report
missing keys as torch does on the plain model. MoE at ep 2: the plain model (every expert) loads with strict=True
and each rank's own fragments round-trip. Non-persistent buffers are not in full_state_dict, which a plain model
then loads strictly.
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
    out["rank0-uneven"] = _refused_unchanged(m.net, lambda: m.load_state_dict(
        torch.load(os.path.join(tmp, "I4O1-rank0.pt"))))
    out["other-layout"] = _refused_unchanged(m.net, lambda: m.load_state_dict(
        torch.load(os.path.join(tmp, f"I2O2-rank{rank}.pt"))))
    out["no-metadata"] = _refused_unchanged(m.net, lambda: m.load_state_dict(dict(m.state_dict())))
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
    path = os.path.join(tmp, "rank0_state_dict.pt")
    if dist.get_rank() == 0:
        torch.save(m.state_dict(), path)
    dist.barrier()
    out = {"rank0": _refused_unchanged(m, lambda: m.load_state_dict(torch.load(path)))}
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
    path = os.path.join(tmp, f"moe-rank{dist.get_rank()}.pt")
    torch.save(model.state_dict(), path)
    torch.manual_seed(5)
    _outcome(lambda: model.load_state_dict(TinyMoETransformer().state_dict()))
    out["round-trip-incompatible"] = _incompatible(_outcome(lambda: model.load_state_dict(torch.load(path))))
    out["round-trip"] = sf.full_state_dict(model)
    return out


def _all_jobs(tmp: str) -> dict:
    return {"layout": _layout_job(tmp), "habit": _habit_job(tmp), "moe": _moe_job(tmp)}


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
    """The `net.` entries of an Outer state dict, without the prefix (and without the tied alias head.weight)."""
    return {k[len("net."):]: v for k, v in sd.items() if k.startswith("net.") and k != "net.head.weight"}


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
def test_other_layout_state_dict_refused(runs):
    for rank, r in enumerate(runs):
        msg, unchanged = r["layout"]["other-layout"]
        assert unchanged and msg.startswith("raised ValueError: "), (rank, msg)
        assert "rank 0: 'net." in msg and "saved by rank 0 of 4" in msg, (rank, msg)
        assert "keys refused per rank {0: " in msg and "3: " in msg, msg  # every rank's fragments are refused


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
        assert set(moe["full"]) == set(moe["plain"]) - {"head.weight"}, rank  # the tied head appears once
        _assert_equal(moe["full"], moe["plain"], f"rank {rank}: MoE full")
        assert moe["round-trip-incompatible"] == ([], []), (rank, moe["round-trip-incompatible"])
        _assert_equal(moe["round-trip"], moe["plain"], f"rank {rank}: MoE round trip")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nonpersistent_buffers_left_out_of_full_state_dict(runs):
    plain = Cache()
    for r in runs:
        full = r["habit"]["cache-full"]
        assert sorted(full) == sorted(plain.state_dict()) == ["fc.bias", "fc.weight"]
        assert not plain.load_state_dict(full).missing_keys  # strict
        assert "cache" not in r["layout"]["I4O1-full"]
