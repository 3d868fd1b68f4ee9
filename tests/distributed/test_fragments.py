"""What a sharded model's parameters are: zero-size parameters (wrap, step, full_state_dict), frozen ones (no gradient,
unchanged), the unit states around forward and backward under both reshard policies, fragments and full-shape
parameters as views of one buffer (invariant 5 of docs/design.md), `model.parameters()` after a forward without
backward or between forward and backward: still the fragments of wrap time, and an optimizer built then trains as
one process does; shape-true fragments (docs/shape-true-parameters.md): `p.dim()`, trailing dimensions and
`p.grad.shape` of every fragment, and nanoGPT's `p.dim() >= 2` weight-decay groups giving the single-process run
at FSDP 4 and HSDP 2 x 2.

Everything runs in one W=4 job on (I, O) = (2, 2) (the nanoGPT check also on (4, 1)); each check is a test; one
more W=8 job checks a unit split into two flat buffers by row class (`layout.row_groups`). Which unit each parameter
lands in is in
tests/distributed/test_units.py.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from models import Block, HalfFrozenLinear, TinyTransformer, build_model, loss_fn, make_batch
from reference import assert_close_dicts, global_randn, rank_randn, seeded, sgd_step, state_snapshot

JOB_TIMEOUT_S = 180
WORLD, INNER, OUTER = 4, 2, 2
LR = 0.1
POLICIES = ("after_forward", "after_backward")


def _describe(model, sf) -> dict:
    return {
        "units": [(u.name, list(u.param_names)) for u in sf.get_units(model)],
        "names": [n for n, _ in model.named_parameters()],
        "fragments": {n: (p.numel(), p.dim(), p.requires_grad) for n, p in model.named_parameters()},
    }


def _attribute(module, dotted: str):
    """``module.a.b.weight`` for ``"a.b.weight"``: attribute lookup, as forward code does it."""
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def seq2() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


AFTER_FORWARD_TAG, AFTER_FORWARD_STEPS = 3, 2


def _scenario(fn, *args):
    """fn(*args), or {"error": traceback} if it raised (on every rank alike: the job goes on with the next check)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def _params_view(model) -> tuple[list, list]:
    named = list(model.named_parameters())
    return [(n, id(p)) for n, p in named], [(n, tuple(p.shape), isinstance(p, nn.Parameter)) for n, p in named]


def parameters_after_forward(topo) -> dict:
    """Worker: model.parameters() after a forward without backward and between forward and backward; an optimizer
    built after a warm-up forward (whose graph is still alive) trains 2 SGD steps."""
    import shardfusion as sf

    dp_rank, out = topo.data_parallel_rank, {}
    for policy in POLICIES:
        for units_name, units in (("root-only", None), ("linear-units", (nn.Linear,))):
            model = sf.fully_shard(seeded(seq2), topo, units=units, reshard_policy=policy)
            at_wrap, _ = _params_view(model)
            warm = model(rank_randn(AFTER_FORWARD_TAG, 99, dp_rank, 2, 8))  # grad enabled, no backward
            ids_warm, shapes_warm = _params_view(model)
            opt = torch.optim.SGD(model.parameters(), lr=LR)  # built while `warm`'s graph is alive
            del warm
            between = []
            for step in range(AFTER_FORWARD_STEPS):
                x = rank_randn(AFTER_FORWARD_TAG, step, dp_rank, 4, 8)
                y = rank_randn(AFTER_FORWARD_TAG, 50 + step, dp_rank, 4, 4)
                loss = F.mse_loss(model(x), y)
                ids, shapes = _params_view(model)
                between.append((ids == at_wrap, shapes))
                loss.backward()
                opt.step()
                opt.zero_grad()
            out[f"{policy}/{units_name}"] = {"after_warm_same": ids_warm == at_wrap, "shapes_warm": shapes_warm,
                                             "between": between, "full": sf.full_state_dict(model)}
    return out


def parameters_after_forward_reference(world: int) -> dict:
    model = seeded(seq2)
    for step in range(AFTER_FORWARD_STEPS):
        x = global_randn(AFTER_FORWARD_TAG, step, world, 4, 8)
        y = global_randn(AFTER_FORWARD_TAG, 50 + step, world, 4, 4)
        F.mse_loss(model(x), y).backward()
        sgd_step(model, LR)
    return state_snapshot(model)


NANO_CONFIG = dict(n_layer=2, n_head=2, d_model=32, seq_len=16)
NANO_STEPS, NANO_LR, NANO_DECAY, NANO_ROWS = 3, 1e-2, 0.5, 8
# Adam's eps: the keys' bias has an exactly-zero gradient (softmax ignores a shift), so its float noise (~1e-10,
# summed in another order by the reduce-scatter) would be normalized to steps of +-lr with torch's 1e-8.
NANO_EPS = 1e-4
NANO_TOPOLOGIES = ((4, 1), (2, 2))  # (inner, outer): FSDP 4 and HSDP 2 x 2


def _nano_gpt():
    from shardfusion.models import GPT, GPTConfig

    torch.manual_seed(42)
    return GPT(GPTConfig(**NANO_CONFIG))


def _nano_batch(step: int, dp_world: int, dp_rank: int) -> tuple:
    from reference import rows_of, token_batch

    return rows_of(token_batch(42 + step, NANO_ROWS, NANO_CONFIG["seq_len"]), dp_world, dp_rank)


def _nano_optimizer(model) -> tuple[torch.optim.Optimizer, int]:
    """nanoGPT's configure_optimizers: every tensor of 2 or more dims decays (matrices, embeddings), the rest not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    keep = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": NANO_DECAY}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=NANO_LR, eps=NANO_EPS), len(decay)


def nanogpt_weight_decay() -> dict:
    """Worker: a small GPT trained NANO_STEPS AdamW steps with nanoGPT's groups at each of NANO_TOPOLOGIES; per
    topology the losses, the final full parameters, the size of the decay group and every fragment's shapes."""
    import shardfusion as sf
    from reference import rank_loss_fn
    from shardfusion.models.gpt import Block as GPTBlock

    out = {}
    for inner, outer in NANO_TOPOLOGIES:
        topo = sf.Topology(sharding=inner * outer, fsdp_outer_degree=outer)
        full_shapes = {n: tuple(p.shape) for n, p in _nano_gpt().named_parameters()}
        model = sf.fully_shard(_nano_gpt(), topo, units=(GPTBlock,))
        opt, n_decay = _nano_optimizer(model)
        loss_fn = rank_loss_fn(model, _nano_batch, topo)
        losses, shapes = [], {}
        for step in range(NANO_STEPS):
            losses.append(loss_fn(step))
            sf.finish_grad_sync(model)
            if step == 0:
                shapes = {n: (tuple(p.shape), p.ndim, p.dim(), None if p.grad is None else tuple(p.grad.shape))
                          for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[f"{inner}x{outer}"] = {"losses": losses, "full": sf.full_state_dict(model), "n_decay": n_decay,
                                   "shapes": shapes, "full_shapes": full_shapes, "inner_rank": topo.inner_rank,
                                   "outer_rank": topo.outer_rank}
    return out


def nanogpt_reference() -> dict:
    from reference import sliced_loss_fn

    model = _nano_gpt()
    opt, n_decay = _nano_optimizer(model)
    loss_fn = sliced_loss_fn(model, _nano_batch, WORLD)
    losses = []
    for step in range(NANO_STEPS):
        losses.append(loss_fn(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "full": {n: p.detach().clone() for n, p in model.named_parameters()}, "n_decay": n_decay}


def fragments_job() -> dict:
    """Worker: zero-size and frozen parameters, unit states and views around forward and backward, parameters() after
    a forward."""
    import torch.distributed as dist
    import shardfusion as sf

    topo = sf.Topology(sharding=INNER * OUTER, fsdp_outer_degree=OUTER)
    out: dict = {"rank": dist.get_rank(), "inner_rank": topo.inner_rank}

    def wrap(model, **kw):
        names = [n for n, _ in model.named_parameters()]
        sf.fully_shard(model, topo, **kw)
        return names, _describe(model, sf)

    # zero-size parameters: wrap, forward, backward, step, full_state_dict
    model = build_model("zero_size")
    names, desc = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn("zero_size", model, make_batch("zero_size", torch.Generator().manual_seed(1))).backward()
    opt.step()
    out["zero_size"] = (names, desc, {n: tuple(t.shape) for n, t in sf.full_state_dict(model).items()})

    # frozen parameters: a frozen unit and a unit with a frozen weight next to a trainable bias
    model = build_model("skip_frozen_a")
    model.b = HalfFrozenLinear(8, 8)
    full_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names, desc = wrap(model, units=(nn.Linear, HalfFrozenLinear))
    frag_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        loss_fn("skip", model, make_batch("skip", torch.Generator().manual_seed(2))).backward()
        sf.finish_grad_sync(model)
        grads = {n: p.grad is not None for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["frozen"] = {
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "has_grad": grads,
        "unchanged": {n: torch.equal(p.detach(), frag_before[n]) for n, p in model.named_parameters()},
        "full": {n: torch.equal(t, full_before[n]) for n, t in sf.full_state_dict(model).items() if n in full_before},
    }

    # unit states around forward and backward
    states = {}
    for policy in ("after_forward", "after_backward"):
        torch.manual_seed(0)
        model = sf.fully_shard(TinyTransformer(), topo, units=(Block,), reshard_policy=policy)
        units = sf.get_units(model)
        seen = {}

        def during_block1(mod, args, units=units, seen=seen):  # runs after the runtime's own pre-forward hook
            # What forward code sees: the attributes (module.weight) are full-shape views of one gathered buffer,
            # while named_parameters() keeps yielding the fragments (this rank's rows) the optimizer holds.
            seen["in_block1"] = {u.name: u.is_unsharded for u in units}
            attrs = {n: _attribute(mod, n) for n, _ in mod.named_parameters()}
            seen["storages"] = len({t.untyped_storage().data_ptr() for t in attrs.values()})
            seen["shapes"] = {n: tuple(t.shape) for n, t in attrs.items()}
            seen["registered_dims"] = {n: p.dim() for n, p in mod.named_parameters()}

        model.blocks[1].register_forward_pre_hook(during_block1)
        st = {"after_wrap": {u.name: u.is_unsharded for u in units},
              "fragment_storages": len({p.untyped_storage().data_ptr() for p in model.blocks[1].parameters()})}
        loss = loss_fn("transformer", model, make_batch("transformer", torch.Generator().manual_seed(3)))
        st["in_block1"] = seen["in_block1"]
        st["full_storages"], st["full_shapes"] = seen["storages"], seen["shapes"]
        st["registered_dims"] = seen["registered_dims"]
        st["after_forward"] = {u.name: u.is_unsharded for u in units}
        loss.backward()
        st["after_backward"] = {u.name: u.is_unsharded for u in units}
        states[policy] = st
    out["states"] = states

    out["after_forward"] = _scenario(parameters_after_forward, topo)
    out["nanogpt"] = _scenario(nanogpt_weight_decay)
    return out


@pytest.fixture(scope="module")
def job():
    return run_distributed(fragments_job, WORLD, timeout=JOB_TIMEOUT_S)


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


def test_zero_size_parameters(job):
    for r in job:
        names, desc, full_shapes = r["zero_size"]
        assert desc["names"] == names
        for n in ("empty", "lin.weight", "lin.bias"):
            assert desc["fragments"][n][0] == 0, f"rank {r['rank']}: {n} fragment {desc['fragments'][n]}"
        assert full_shapes["empty"] == (0,) and full_shapes["lin.weight"] == (0, 4) and full_shapes["lin.bias"] == (0,)
        assert full_shapes["a"] == (8,) and full_shapes["b"] == (24,)


def test_frozen_parameters(job):
    frozen = {"a.weight", "a.bias", "b.weight"}
    for r in job:
        f = r["frozen"]
        for n, rg in f["requires_grad"].items():
            assert rg == (n not in frozen), f"rank {r['rank']}: {n}.requires_grad is {rg}"
        for n in frozen:
            assert not f["has_grad"][n], f"rank {r['rank']}: frozen {n} has a gradient"
            assert f["unchanged"][n], f"rank {r['rank']}: frozen {n} changed"
            assert f["full"][n], f"rank {r['rank']}: frozen {n} in full_state_dict differs from its initial value"
        for n in ("b.bias", "head.weight", "head.bias"):
            assert f["has_grad"][n], f"rank {r['rank']}: trainable {n} has no gradient"
        assert not all(f["unchanged"][n] for n in ("b.bias", "head.weight", "head.bias")), (
            f"rank {r['rank']}: trainable parameters did not move")


def test_unit_states_around_forward_and_backward(job):
    for r in job:
        for policy, st in r["states"].items():
            where = f"rank {r['rank']}, {policy}"
            assert not any(st["after_wrap"].values()), f"{where}: unsharded right after wrapping: {st['after_wrap']}"
            assert st["in_block1"]["blocks.1"], f"{where}: blocks.1 not unsharded during its forward"
            blocks_after_fwd = {n: v for n, v in st["after_forward"].items() if n}
            if policy == "after_forward":
                assert not any(blocks_after_fwd.values()), f"{where}: blocks still unsharded: {st['after_forward']}"
            else:
                assert all(blocks_after_fwd.values()), (
                    f"{where}: blocks resharded before backward: {st['after_forward']}")
            assert not any(st["after_backward"].values()), f"{where}: unsharded after backward: {st['after_backward']}"


def test_unit_parameters_are_views_of_one_buffer(job):
    """Invariant 5: a unit's fragments are views of one shard, and during forward its full-shape parameters are
    views of one gathered buffer (no per-parameter tensors)."""
    torch.manual_seed(0)
    shapes = {n: tuple(p.shape) for n, p in Block().named_parameters()}
    for r in job:
        for policy, st in r["states"].items():
            where = f"rank {r['rank']}, {policy}"
            assert st["fragment_storages"] == 1, (
                f"{where}: blocks.1's fragments span {st['fragment_storages']} storages")
            assert st["full_storages"] == 1, f"{where}: blocks.1's parameters span {st['full_storages']} storages"
            assert st["full_shapes"] == shapes, f"{where}: shapes during forward {st['full_shapes']}"
            dims = {n: len(s) for n, s in shapes.items()}
            assert st["registered_dims"] == dims, (
                f"{where}: parameters() during forward must yield fragments of the parameters' dims {dims}, got "
                f"{st['registered_dims']}")


def test_parameters_are_fragments_after_forward_and_train(job):
    rs = [r["after_forward"] for r in job]
    ref = parameters_after_forward_reference(WORLD)
    full_shapes = {n: tuple(t.shape) for n, t in ref.items()}
    for rank, r in enumerate(rs):
        assert "error" not in r, f"rank {rank} raised:\n{r['error']}"
        assert set(r) == {f"{p}/{u}" for p in POLICIES for u in ("root-only", "linear-units")}
        for key, got in r.items():
            what = f"{key}, rank {rank}"
            assert got["after_warm_same"], f"{what}: parameters() after a forward without backward are not the " \
                                           f"fragments of wrap time: {got['shapes_warm']}"
            for n, shape, is_param in got["shapes_warm"]:
                assert shape[1:] == full_shapes[n][1:] and len(shape) == len(full_shapes[n]) and is_param, (
                    f"{what}: {n} has shape {shape} after a forward (full {full_shapes[n]})")
            local = sum(math.prod(shape) for _, shape, _ in got["shapes_warm"])
            assert local < sum(math.prod(s) for s in full_shapes.values()), (
                f"{what}: the parameters hold {local} elements, the whole model (not a shard): {got['shapes_warm']}")
            for step, (same, shapes) in enumerate(got["between"]):
                assert same, f"{what}, step {step}: parameters() between forward and backward changed: {shapes}"
                assert shapes == got["shapes_warm"], f"{what}, step {step}: {shapes}"
            assert_close_dicts(got["full"], ref, what)


def test_fragments_keep_dims_and_trailing_shape(job):
    """Every fragment is (rows_on_this_rank, *shape[1:]) with p.ndim == p.dim() == the parameter's, its .grad has
    its shape, and an inner group's fragments hold every row exactly once."""
    for key in (f"{i}x{o}" for i, o in NANO_TOPOLOGIES):
        rows: dict = {}
        for r in job:
            assert "error" not in r["nanogpt"], f"rank {r['rank']} raised:\n{r['nanogpt']['error']}"
            got = r["nanogpt"][key]
            for n, (shape, ndim, dim, grad) in got["shapes"].items():
                full = got["full_shapes"][n]
                where = f"{key}, rank {r['rank']}, {n}"
                assert ndim == dim == len(full) and shape[1:] == full[1:], f"{where}: fragment {shape}, full {full}"
                assert grad == shape, f"{where}: grad shape {grad} != fragment shape {shape}"
                rows.setdefault((got["outer_rank"], n), []).append(shape[0])
        for (outer, n), counts in rows.items():
            assert sum(counts) == job[0]["nanogpt"][key]["full_shapes"][n][0], f"{key}, outer {outer}, {n}: {counts}"


def test_nanogpt_weight_decay_groups_match_one_process(job):
    """nanoGPT's `p.dim() >= 2` decay group is the single-process one, and training with it gives the same losses and
    final parameters (on 1-D fragments nothing would decay)."""
    ref = nanogpt_reference()
    for key in (f"{i}x{o}" for i, o in NANO_TOPOLOGIES):
        for r in job:
            assert "error" not in r["nanogpt"], f"rank {r['rank']} raised:\n{r['nanogpt']['error']}"
            got = r["nanogpt"][key]
            what = f"{key}, rank {r['rank']}"
            assert got["n_decay"] == ref["n_decay"], f"{what}: {got['n_decay']} decaying tensors, one process " \
                                                     f"{ref['n_decay']}"
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-6,
                                       msg=lambda m: f"{what}: losses: {m}")
            assert_close_dicts(got["full"], ref["full"], what, rtol=0, atol=1e-6)


SPLIT_TAG, SPLIT_WORLD, SPLIT_STEPS = 7, 8, 2


def split_mlp() -> nn.Sequential:
    """Rows of 20 and 24 elements, each weight more than 2 shards of 8: one buffer would need S % 120 == 0."""
    return nn.Sequential(nn.Linear(20, 24), nn.Tanh(), nn.Linear(24, 20))


def split_job() -> dict:
    """Worker (W=8, sharding 8): the root unit of split_mlp in two flat buffers; 2 AdamW steps."""
    import shardfusion as sf
    from shardfusion._runtime.state import flat_buffers

    topo = sf.Topology(sharding=SPLIT_WORLD)
    model = sf.fully_shard(seeded(split_mlp), topo)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    shapes = {}
    for step in range(SPLIT_STEPS):
        x = rank_randn(SPLIT_TAG, step, topo.data_parallel_rank, 2, 20)
        F.mse_loss(model(x), torch.zeros(2, 20)).backward()
        sf.finish_grad_sync(model)
        shapes = {n: (tuple(p.shape), tuple(p.grad.shape)) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"buffers": [[s.name for s in b.layout.slots] for b in flat_buffers(model)], "shapes": shapes,
            "full": sf.full_state_dict(model)}


def test_unit_split_by_row_class_matches_one_process():
    rs = run_distributed(split_job, SPLIT_WORLD, timeout=JOB_TIMEOUT_S)
    model = seeded(split_mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(SPLIT_STEPS):
        x = global_randn(SPLIT_TAG, step, SPLIT_WORLD, 2, 20)
        F.mse_loss(model(x), torch.zeros(2 * SPLIT_WORLD, 20)).backward()
        opt.step()
        opt.zero_grad()
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for rank, r in enumerate(rs):
        assert r["buffers"] == [["0.weight"], ["0.bias", "2.weight", "2.bias"]], f"rank {rank}: {r['buffers']}"
        for n, (shape, grad) in r["shapes"].items():
            assert shape[1:] == full[n][1:] and len(shape) == len(full[n]) and grad == shape, (rank, n, shape, grad)
        assert_close_dicts(r["full"], state_snapshot(model), f"rank {rank}")
