"""``fully_shard(..., reshard_policy="auto", memory_budget=B)`` on 4 gloo ranks, FSDP (inner 4) and HSDP (2 x 2),
a 6-block TinyTransformer, 3 AdamW steps per case, all in one spawned job.

Per layout: a budget under every choice's need keeps no unit (the units' settings are after_forward's, the run is
bitwise after_forward's); the need with every unit kept keeps all (after_backward's, bitwise); the need with two
units kept (``needs[2]`` of the record) keeps the last two blocks (equal units: last first), fits its estimate,
issues two fewer all-gathers per step than after_forward, is the same on every rank, and trains as one process
does on the global batch (and bitwise as after_forward, since the policy moves no value). Bad budgets raise the same
ValueError on every rank; a unit ``reshard_filter`` leaves out stays gathered and is not decided.
"""

from __future__ import annotations

import pytest
import torch

from harness import raised, run_distributed
from models import MODEL_SEED, Block, TinyTransformer, loss_fn, make_batch
from reference import DATA_SEED, RTOL, ATOL, assert_bitwise, assert_close_dicts, seeded

WORLD, N_BLOCKS, STEPS, LR = 4, 6, 3, 1e-2
LAYOUTS = {"fsdp": 1, "hsdp": 2}  # name -> fsdp_outer_degree
JOB_TIMEOUT_S = 240


def _model() -> torch.nn.Module:
    return seeded(lambda: TinyTransformer(n_blocks=N_BLOCKS), MODEL_SEED)


def _train(topo, **wrap) -> dict:
    """STEPS AdamW steps of this rank's data-parallel slice; the global mean loss per step, the all-gathers per
    step, the full state after the last, the units' settings and the auto choice."""
    import torch.distributed as dist
    import shardfusion as sf

    model = sf.fully_shard(_model(), topo, units=(Block,), **wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    gen = torch.Generator().manual_seed(DATA_SEED + topo.data_parallel_rank + 1)
    losses, gathers = [], []
    for _ in range(STEPS):
        with sf.comm.CommCounter() as counter:
            loss = loss_fn("transformer", model, make_batch("transformer", gen))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        gathers.append(counter.count("all_gather"))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    choice = sf.reshard_choice(model)
    return {"losses": losses, "gathers": gathers, "full": {k: v.clone() for k, v in sf.full_state_dict(model).items()},
            "flags": {u.name: u.reshard_after_forward for u in sf.get_units(model)},
            "choice": None if choice is None else choice.as_dict()}


def _worker() -> dict:
    import shardfusion as sf

    out = {}
    for layout, outer in LAYOUTS.items():
        topo = sf.Topology(fsdp_outer_degree=outer)
        probe = sf.fully_shard(_model(), topo, units=(Block,), reshard_policy="auto", memory_budget=1)
        needs = sf.reshard_choice(probe).needs
        out[layout] = {"needs": needs, "after_forward": _train(topo, reshard_policy="after_forward"),
                       "after_backward": _train(topo, reshard_policy="after_backward"),
                       "none_fits": _train(topo, reshard_policy="auto", memory_budget=needs[0] - 1),
                       "all_fit": _train(topo, reshard_policy="auto", memory_budget=needs[-1]),
                       "two_fit": _train(topo, reshard_policy="auto", memory_budget=needs[2])}
    topo = sf.Topology(fsdp_outer_degree=1)
    keep_first = sf.fully_shard(_model(), topo, units=(Block,), reshard_policy="auto", memory_budget=1,
                                reshard_filter=lambda name, module: name != "blocks.0")
    out["filter"] = {"flags": {u.name: u.reshard_after_forward for u in sf.get_units(keep_first)},
                     "choice": sf.reshard_choice(keep_first).as_dict()}
    # FSDP2's idiom: each block by its own call, then the root; the root's "auto" decides the blocks again, except
    # the one sharded under a fixed policy (blocks.5: kept as after_forward said)
    nested = _model()
    for i, block in enumerate(nested.blocks):
        policy = {"reshard_policy": "after_forward"} if i == 5 else {"reshard_policy": "auto", "memory_budget": 1}
        sf.fully_shard(block, topo, **policy)
    sf.fully_shard(nested, topo, reshard_policy="auto", memory_budget=out["fsdp"]["needs"][2])
    out["nested"] = {"flags": {u.name: u.reshard_after_forward for u in sf.get_units(nested)},
                     "choice": sf.reshard_choice(nested).as_dict()}
    bad = {"auto without budget": {"reshard_policy": "auto"},
           "negative budget": {"reshard_policy": "auto", "memory_budget": -5},
           "budget with after_forward": {"reshard_policy": "after_forward", "memory_budget": 10**9}}
    out["errors"] = {k: raised(lambda kw=kw: sf.fully_shard(_model(), topo, units=(Block,), **kw))
                     for k, kw in bad.items()}
    return out


def _reference() -> dict:
    """One process on the global batch (every data-parallel rank's draw, in rank order)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    gens = [torch.Generator().manual_seed(DATA_SEED + r + 1) for r in range(WORLD)]
    losses = []
    for _ in range(STEPS):
        draws = [make_batch("transformer", g) for g in gens]
        batch = {k: torch.cat([d[k] for d in draws]) for k in draws[0]}
        loss = loss_fn("transformer", model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "full": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=JOB_TIMEOUT_S)


BLOCKS = [f"blocks.{i}" for i in range(N_BLOCKS)]


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_extremes_equal_the_fixed_policies_bitwise(results, layout) -> None:
    for r in results:
        got = r[layout]
        none_fits, all_fit = got["none_fits"], got["all_fit"]
        assert none_fits["choice"]["kept"] == [] and not none_fits["choice"]["fits"]
        assert none_fits["flags"] == got["after_forward"]["flags"]
        assert all_fit["choice"]["kept"] == BLOCKS and all_fit["choice"]["fits"]
        assert all_fit["flags"] == got["after_backward"]["flags"]
        for case, fixed in (("none_fits", "after_forward"), ("all_fit", "after_backward")):
            assert got[case]["losses"] == got[fixed]["losses"], f"{layout} {case}"
            assert got[case]["gathers"] == got[fixed]["gathers"], f"{layout} {case}"
            assert_bitwise(got[case]["full"], got[fixed]["full"], f"{layout} {case} vs {fixed}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_between_keeps_the_last_units_within_the_budget(results, layout) -> None:
    for r in results:
        got = r[layout]
        two = got["two_fit"]
        choice = two["choice"]
        assert choice["kept"] == ["blocks.4", "blocks.5"], choice["kept"]
        assert choice["memory_bytes"] <= choice["budget"] == got["needs"][2] and choice["fits"]
        assert got["needs"][0] < got["needs"][2] < got["needs"][-1]
        assert two["flags"] == {"": False, **{b: b not in ("blocks.4", "blocks.5") for b in BLOCKS}}
        # after_forward: root once, each block twice (forward, backward); two blocks kept: 2 fewer
        assert got["after_forward"]["gathers"] == [1 + 2 * N_BLOCKS] * STEPS
        assert two["gathers"] == [1 + 2 * N_BLOCKS - 2] * STEPS
        assert got["after_backward"]["gathers"] == [1 + N_BLOCKS] * STEPS
    choices = [r[layout]["two_fit"]["choice"] for r in results]
    assert all(c == choices[0] for c in choices), "the ranks chose differently"


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_between_trains_as_one_process(results, layout) -> None:
    ref = _reference()
    for r in results:
        two = r[layout]["two_fit"]
        torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        assert_close_dicts(two["full"], ref["full"], f"{layout} auto vs one process")
        assert_bitwise(two["full"], r[layout]["after_forward"]["full"], f"{layout} auto vs after_forward")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_filter_keeps_the_users_choice(results) -> None:
    for r in results:
        got = r["filter"]
        assert got["flags"]["blocks.0"] is False  # left out by the filter: gathered until backward
        assert got["choice"]["decided"] == [False, False] + [True] * (N_BLOCKS - 1)
        assert got["choice"]["kept"] == [] and all(got["flags"][b] for b in BLOCKS[1:])


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bad_budgets_raise_on_every_rank(results) -> None:
    for r in results:
        errors = r["errors"]
        assert errors["auto without budget"] == ("ValueError", errors["auto without budget"][1])
        assert "memory_budget" in errors["auto without budget"][1]
        assert errors["negative budget"][0] == "ValueError" and "-5" in errors["negative budget"][1]
        kind, message = errors["budget with after_forward"]
        assert kind == "ValueError" and "1000000000" in message and "after_forward" in message


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_nested_calls_decide_their_auto_units_again(results) -> None:
    for r in results:
        got = r["nested"]
        assert got["choice"]["decided"] == [False] + [True] * 5 + [False]
        assert got["flags"]["blocks.5"] is True  # after_forward, as its own call said; counted as resharded
        # the budget of 2 kept blocks (as flat): the last decided ones, blocks.4 and blocks.3
        assert got["choice"]["kept"] == ["blocks.3", "blocks.4"], got["choice"]["kept"]
