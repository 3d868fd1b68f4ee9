"""Meta-device initialization (shardfusion/_runtime/materialize.py): a model built under ``torch.device("meta")``
and materialized by ``fully_shard`` equals the same model built eagerly under the same seed, bitwise; what cannot be
initialized is refused at wrap time on every rank.

The reference is the plain model built eagerly in the same process under the same seed (every expert held: no ep
group), compared with ``full_state_dict`` of the sharded one. Tied parameters: every registering module's init runs
on the one tensor in ``named_modules()`` order (last writer wins), also where the first one's init leaves it alone;
a root with no parameters of its own still gets ``init_fn``. One W=4 job runs every layout and case; each check is a
test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from harness import raised, run_distributed

JOB_TIMEOUT_S = 240
WORLD = 4
SEED = 11
LAYOUTS = {  # name -> (Topology kwargs, GPT-MoE experts or 0)
    "fsdp": (dict(sharding=4), 0),
    "hsdp": (dict(sharding=4, fsdp_outer_degree=2), 0),
    "moe-ep1": (dict(sharding=4, fsdp_outer_degree=2), 4),
    "moe-ep2": (dict(sharding=4, ep=2), 4),
    "moe-ep2-hsdp": (dict(sharding=4, ep=2, fsdp_outer_degree=2), 4),
}


class Rotary(nn.Module):
    """A non-persistent buffer computed in ``__init__`` (a rotary ``inv_freq``) and recomputed by reset_parameters."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(self._inv_freq())


class Scale(nn.Module):
    """A parameter of its own and no reset_parameters: on meta it cannot be initialized without an init_fn."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))


class Net(nn.Module):
    def __init__(self, with_scale: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.rot = Rotary()
        self.scale = Scale() if with_scale else None
        self.out = nn.Linear(8, 8)


class Lookup(nn.Module):
    """An embedding whose table is another module's (tied to the head after construction): its reset_parameters
    draws nothing and writes nothing, so a meta build must get the table's values from the head's init."""

    def __init__(self, vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab, dim))

    def reset_parameters(self) -> None:
        pass


class TiedLookup(nn.Module):
    """emb (first in module order) tied to the table head (a plain Linear) creates: ``emb.weight = head.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = Lookup()
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.emb.weight = self.head.weight


class TiedLM(nn.Module):
    """The usual tie, ``head.weight = emb.weight`` (nn.Embedding first, nn.Linear head), and no parameter of the root's
    own."""

    def __init__(self, pad_first: bool = False) -> None:
        super().__init__()
        if pad_first:  # the head registers the table first, the embedding (which zeroes its padding row) after it
            self.head = nn.Linear(8, 12, bias=False)
            self.mid = nn.Linear(8, 8)
            self.emb = nn.Embedding(12, 8, padding_idx=0)
            self.emb.weight = self.head.weight
        else:
            self.emb = nn.Embedding(12, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 12, bias=False)
            self.head.weight = self.emb.weight


def _linear_only(m: nn.Module) -> None:
    """An init_fn that initializes the Linear layers only (and the padding row of an Embedding that has one)."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding) and m.padding_idx is not None:
        m.weight[m.padding_idx].zero_()


def _gpt(experts: int, ep_group=None):
    from shardfusion.models.gpt import GPT, GPTConfig

    config = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=16, n_experts=experts, top_k=2)
    return GPT(config, ep_group=ep_group)


def _reference(model: nn.Module) -> dict:
    """What ``full_state_dict`` holds for ``model``: its state dict (a tied parameter under each of its names)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(full: dict, ref: dict) -> list[str]:
    """Names whose tensors differ (or are missing or extra) between the sharded model's full state and the
    reference."""
    return sorted({k for k, v in ref.items() if k not in full or not torch.equal(full[k], v)} | (set(full) - set(ref)))


def _layouts() -> dict:
    import shardfusion as sf
    from shardfusion.models.gpt import Block

    out = {}
    for name, (kwargs, experts) in LAYOUTS.items():
        topo = sf.Topology(**kwargs)
        torch.manual_seed(SEED)
        ref = _reference(_gpt(experts))
        rng_after_eager = torch.get_rng_state()
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = _gpt(experts, topo.get_group("ep"))
        model = sf.fully_shard(model, topo, units=(Block,))
        full = sf.full_state_dict(model)
        out[name] = {"diff": _equal(full, ref), "n": len(ref),
                     "rng_equal": torch.equal(torch.get_rng_state(), rng_after_eager)}
    return out


def _seeds_differ() -> dict:
    """Every rank seeded differently: the meta wrap gives rank 0's model everywhere, as the eager wrap does."""
    import torch.distributed as dist

    import shardfusion as sf
    from shardfusion.models.gpt import Block

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2)
    torch.manual_seed(SEED)
    ref = _reference(_gpt(0))
    torch.manual_seed(SEED + 100 * dist.get_rank())  # rank 0: SEED
    with torch.device("meta"):
        model = _gpt(0)
    full = sf.full_state_dict(sf.fully_shard(model, topo, units=(Block,)))
    return {"diff": _equal(full, ref)}


def _train_meta_vs_eager() -> dict:
    """Two AdamW steps on a meta-built and an eager-built GPT-MoE (ep 2, HSDP): the same losses, bitwise."""
    import shardfusion as sf
    from shardfusion.models.gpt import Block

    losses = {}
    for build in ("eager", "meta"):
        topo = sf.Topology(sharding=4, ep=2, fsdp_outer_degree=2)
        torch.manual_seed(SEED)
        if build == "meta":
            with torch.device("meta"):
                model = _gpt(4, topo.get_group("ep"))
        else:
            model = _gpt(4, topo.get_group("ep"))
        model = sf.fully_shard(model, topo, units=(Block,))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        seen = []
        for _ in range(2):
            idx = torch.randint(0, 256, (2, 16), generator=g)
            _, loss = model(idx, idx.roll(-1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append(loss.item())
        losses[build] = seen
    return losses


def _buffers_and_partial() -> dict:
    """A module's buffer computed in __init__ comes out right; in a partly-meta model the tensors with values keep
    them."""
    import shardfusion as sf

    topo = sf.Topology(sharding=4)
    torch.manual_seed(SEED)
    eager = Net()
    ref = _reference(eager)
    torch.manual_seed(SEED)
    inp = nn.Linear(8, 8)  # with values, kept
    with torch.device("meta"):
        model = Net()
    model.inp = inp
    torch.manual_seed(SEED)
    nn.Linear(8, 8)  # the draws inp made, so that out draws what eager construction drew
    model = sf.fully_shard(model, topo)
    full = sf.full_state_dict(model)
    out = {"diff": _equal(full, ref), "inv_freq": torch.equal(model.rot.inv_freq, Rotary().inv_freq)}

    norm = nn.BatchNorm1d(8)  # statistics with values, parameters on meta: reset_parameters must not zero them
    with torch.no_grad():
        norm.running_mean.fill_(5.0)
        norm.num_batches_tracked.fill_(7)
    norm.weight = nn.Parameter(torch.empty(8, device="meta"))
    norm.bias = nn.Parameter(torch.empty(8, device="meta"))
    norm = sf.fully_shard(nn.Sequential(norm), topo)
    full = sf.full_state_dict(norm)
    out["batchnorm"] = [full["0.running_mean"].tolist(), int(full["0.num_batches_tracked"]),
                        full["0.weight"].tolist(), full["0.bias"].tolist()]
    return out


def _refusals() -> dict:
    import torch.distributed as dist

    import shardfusion as sf

    topo = sf.Topology(sharding=4)
    errors = {}
    with torch.device("meta"):
        model = Net(with_scale=True)
    errors["no-reset"] = raised(lambda: sf.fully_shard(model, topo))

    def init_fn(m: nn.Module) -> None:  # the user's own init for every module with meta tensors
        if isinstance(m, Scale):
            m.gain.fill_(2.0)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    with torch.device("meta"):
        model = Net(with_scale=True)
    model = sf.fully_shard(model, topo, init_fn=init_fn)
    errors["init-fn-gain"] = sf.full_state_dict(model)["scale.gain"].tolist()

    if dist.get_rank() == 0:
        mixed = Net()
    else:
        with torch.device("meta"):
            mixed = Net()
    errors["ranks-disagree"] = raised(lambda: sf.fully_shard(mixed, topo))
    errors["bad-device"] = raised(lambda: sf.fully_shard(Net(), topo, device="meta"))
    errors["bad-init-fn"] = raised(lambda: sf.fully_shard(Net(), topo, init_fn=3))
    return errors


def _tied() -> dict:
    """Tied parameters under meta init: every registering module's init runs on the one tensor, in module order
    (last writer wins). References: eager construction (reset_parameters), or an eager build whose modules get
    init_fn in module order on the tied model (init_fn); each case also checks the generator's end state."""
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2)
    out = {}
    cases = {"reset-noop-first": (TiedLookup, None), "init-fn-noop-first": (TiedLM, _linear_only),
             "init-fn-composed": (lambda: TiedLM(pad_first=True), _linear_only)}
    for case, (build, init_fn) in cases.items():
        torch.manual_seed(SEED)
        eager = build()
        if init_fn is not None:
            torch.manual_seed(SEED)
            with torch.no_grad():
                for m in eager.modules():
                    init_fn(m)
        ref, rng_after_eager = _reference(eager), torch.get_rng_state()
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = build()
        full = sf.full_state_dict(sf.fully_shard(model, topo, init_fn=init_fn))
        out[case] = {"diff": _equal(full, ref), "n": len(ref), "finite": all(v.isfinite().all() for v in full.values()),
                     "rng_equal": torch.equal(torch.get_rng_state(), rng_after_eager)}

    calls = []  # a root with no parameters of its own still gets init_fn, first (module order)

    def recording(m: nn.Module) -> None:
        calls.append(type(m).__name__)
        _linear_only(m)

    with torch.device("meta"):
        model = TiedLM()
    sf.fully_shard(model, topo, init_fn=recording)
    out["root-calls"] = calls
    return out


def _job() -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "layouts": _layouts(), "seeds": _seeds_differ(), "train": _train_meta_vs_eager(),
            "buffers": _buffers_and_partial(), "refusals": _refusals(), "tied": _tied()}


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, WORLD, timeout=JOB_TIMEOUT_S)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_init_equals_eager_construction_bitwise(job, layout):
    for r in job:
        got = r["layouts"][layout]
        assert got["n"] > 0 and got["diff"] == [], f"rank {r['rank']}: {layout}: differ from eager: {got['diff']}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_init_leaves_the_generator_where_eager_construction_does(job, layout):
    assert all(r["layouts"][layout]["rng_equal"] for r in job)


@pytest.mark.parametrize("case", ["reset-noop-first", "init-fn-noop-first", "init-fn-composed"])
def test_tied_parameter_gets_every_registering_modules_init_in_module_order(job, case):
    for r in job:  # fails if the tied table is left uninitialized or keeps only its first module's init
        got = r["tied"][case]
        assert got["n"] > 0 and got["diff"] == [] and got["finite"], f"rank {r['rank']}: {case}: {got}"
        assert got["rng_equal"], f"rank {r['rank']}: {case}: the generator ends elsewhere than in the eager build"


def test_root_without_parameters_of_its_own_gets_init_fn_first(job):
    for r in job:
        assert r["tied"]["root-calls"] == ["TiedLM", "Embedding", "Linear", "Linear"], r["tied"]["root-calls"]


def test_differently_seeded_ranks_all_get_rank0s_model(job):
    assert all(r["seeds"]["diff"] == [] for r in job), [r["seeds"]["diff"] for r in job]


def test_a_meta_built_model_trains_like_an_eager_built_one(job):
    for r in job:
        assert r["train"]["meta"] == r["train"]["eager"], r["train"]
        assert all(math.isfinite(x) for x in r["train"]["meta"])


def test_buffers_computed_in_init_and_partly_meta_models(job):
    for r in job:
        assert r["buffers"]["diff"] == [] and r["buffers"]["inv_freq"], r["buffers"]


def test_tensors_with_values_keep_them_through_their_modules_init(job):
    for r in job:  # BatchNorm's reset_parameters resets its statistics too; they had values, so they are kept
        assert r["buffers"]["batchnorm"] == [[5.0] * 8, 7, [1.0] * 8, [0.0] * 8], r["buffers"]["batchnorm"]


def test_a_module_that_cannot_be_initialized_is_refused_at_wrap(job):
    for r in job:
        kind, msg = r["refusals"]["no-reset"]
        assert kind == "ValueError" and "'scale'" in msg and "Scale" in msg and "'gain'" in msg, msg
        assert "init_fn" in msg and "reset_parameters" in msg, msg


def test_init_fn_initializes_what_reset_parameters_cannot(job):
    assert all(r["refusals"]["init-fn-gain"] == [2.0] * 8 for r in job)


@pytest.mark.parametrize("case,words", [("ranks-disagree", ["disagree", "meta"]), ("bad-device", ["device='meta'"]),
                                        ("bad-init-fn", ["init_fn", "3"])])
def test_bad_meta_input_is_refused_on_every_rank(job, case, words):
    for r in job:
        kind, msg = r["refusals"][case]
        assert kind == "ValueError" and all(w in msg for w in words), (r["rank"], kind, msg)
