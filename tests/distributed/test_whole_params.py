"""Whole parameters for matrix optimizers: ``fully_shard(..., whole_params=f)`` and ``torch.optim.Muon``.

The GPT of the tests (2 blocks, d 32, q/k/v separate; a GPT-MoE of 4 experts for ep 2) is sharded with its block
matrices whole (``mr.is_block_matrix``); Muon updates them, AdamW the rest (embeddings, norms, biases), as the public
Muon recipes do. Each layout trains the same global batch for 3 steps with clipping by global norm and is compared
with one process training the unsharded model with the same two optimizers.

Each layout runs twice. First with torch's Muon as it is: its Newton-Schulz iteration runs in bf16 (the momentum is
cast to bf16 first). The sharded gradient differs from the one-process gradient by fp32 rounding (the reduce-scatter
sums the ranks' gradients in another order); where such a difference crosses a bf16 rounding boundary the
orthogonalized update moves by a bf16 step of its entries, times lr (0.02). One process against itself, with the
global batch's gradient summed in 1, 2 or 4 slices, differs by up to 4.7e-4 after 3 steps (measured), so the Muon
matrices are compared with atol 1e-3 (a wrong owner, a lost gradient or a stale momentum moves a matrix by ~lr a
step, 20x more). Second with the same iteration in fp32 (``_fp32_newton_schulz``, in the reference too): then every
parameter agrees to atol 1e-5 and losses and norms to rtol 1e-5 / atol 1e-6, as in the other parity tests: that is
the exact check; the bf16 run checks torch's own Muon.

``test_whole_params_change_only_the_layout``: with an element-wise optimizer (SGD with momentum) the same run with
and without ``whole_params`` agrees to 1e-6 (bf16 compute, a meta-device build, ``no_sync`` micro-batches, a penalty
on ``model.parameters()``, clipping): only the layout differs.
"""

from __future__ import annotations

import pytest
import torch

import muon_reference as mr
from harness import run_distributed
from reference import assert_close_dicts

JOB_TIMEOUT_S = 300


def _ownership(model, topo) -> dict:
    """Per whole parameter: this rank's fragment shape, and the index of this rank in its shard group."""
    import shardfusion as sf
    from shardfusion._runtime.state import named_fragments

    out = {}
    for f in named_fragments(model):
        if f.buffer.owner_layout:
            out[f.name] = {"shape": tuple(f.param.shape), "full": f.shape, "expert": f.buffer.is_expert,
                           "grad": None if f.param.grad is None else tuple(f.param.grad.shape)}
    return {"owned": out, "balance": sf.owner_balance(model), "inner_rank": topo.inner_rank,
            "outer_rank": topo.outer_rank, "ep_rank": topo.ep_rank}


def sharded(cases: list[tuple[dict, bool]]) -> list[dict]:
    """Per case ``(layout, fp32 Newton-Schulz)``: losses, norms, full parameters (every rank), ownership,
    collectives of the optimizer steps."""
    results = []
    for layout, fp32 in cases:
        with mr.newton_schulz(fp32):
            results.append(_run(layout) | {"fp32": fp32})
    return results


def _run(layout: dict) -> dict:
    import shardfusion as sf

    topo, model = mr.build(layout)
    optimizers = mr.optimizers(model)
    out = mr.train(model, optimizers, mr.sharded_loss_fn(model, topo), range(mr.STEPS - 1))
    # the last step with its optimizer steps counted: Muon works where each matrix lives, no collective
    out["losses"].append(float(mr.sharded_loss_fn(model, topo)(mr.STEPS - 1)))
    out["norms"].append(float(sf.clip_grad_norm_(model, mr.MAX_NORM)))
    owned = _ownership(model, topo)  # .grad shapes while the gradients are there
    sf.finish_grad_sync(model)
    with sf.comm.CommCounter() as counter:
        for opt in optimizers:
            opt.step()
    out["step_collectives"] = len(counter.records)
    out.update(owned)
    out["params"] = sf.full_state_dict(model, buffers=False)
    out["layout"] = layout
    return out


def _assert_matches(got: dict, want: dict) -> None:
    what = f"{got['layout']}, {'fp32' if got['fp32'] else 'bf16'} Newton-Schulz"
    loose = not got["fp32"]  # torch's bf16 iteration: losses after the first step move with the matrices
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=1e-4 if loose else mr.RTOL,
                                   atol=1e-4 if loose else mr.ATOL, msg=lambda m: f"{what}: {key}: {m}")
    matrices = [n for n, p in want["params"].items() if mr.is_block_matrix(n, p)]
    others = [n for n in want["params"] if n not in matrices]
    assert sorted(got["params"]) == sorted(want["params"]), what
    assert_close_dicts(got["params"], want["params"], what, atol=mr.MUON_BF16_ATOL if loose else mr.PARAM_ATOL,
                       names=matrices)
    assert_close_dicts(got["params"], want["params"], what, atol=mr.PARAM_ATOL, names=others)


W4_LAYOUTS = {"fsdp4": dict(sharding=4), "hsdp-outer2-inner2": dict(sharding=4, fsdp_outer_degree=2),
              "moe-ep2": dict(sharding=4, ep=2)}
# Every layout with the fp32 iteration (the exact check); torch's bf16 one on the dense layouts only: on the MoE the
# router's 4 x 32 gradient is nearly rank-deficient and orthogonalizing it turns fp32 rounding into differences of
# ~3e-3 (measured), beyond what one bf16 step explains.
W4_CASES = [(name, True) for name in W4_LAYOUTS] + [("fsdp4", False), ("hsdp-outer2-inner2", False)]
W4_IDS = [f"{name}-{'fp32' if fp32 else 'torch-bf16'}-newton-schulz" for name, fp32 in W4_CASES]


@pytest.fixture(scope="module")
def w4_results():
    return run_distributed(sharded, 4, [(W4_LAYOUTS[name], fp32) for name, fp32 in W4_CASES], timeout=JOB_TIMEOUT_S)


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 120)


@pytest.mark.parametrize("index", range(len(W4_CASES)), ids=W4_IDS)
def test_muon_matches_single_process(w4_results, index):
    name, fp32 = W4_CASES[index]
    layout = W4_LAYOUTS[name]
    want = mr.reference(experts=4 if layout.get("ep", 1) > 1 else 0, dp_world=4, fp32=fp32)
    print(W4_IDS[index], mr.max_errors(w4_results[0][index], want))
    for rank in range(4):
        _assert_matches(w4_results[rank][index], want)


@pytest.mark.parametrize("index", range(len(W4_LAYOUTS)), ids=list(W4_LAYOUTS))
def test_each_matrix_is_whole_on_exactly_one_rank_of_its_group(w4_results, index):
    """Every rank of a shard group (inner group; for experts the expert inner group of one ep index) holds each
    whole parameter either with its full shape (the owner) or as ``(0, *shape[1:])``, its ``.grad`` alike; exactly
    one rank of the group is the owner; replicas (outer ranks) have the same owner; the optimizer step issues no
    collective; owners' load is within 1.25 x of the mean."""
    rs = [r[index] for r in w4_results]  # the fp32 case of each layout
    names = set().union(*(r["owned"] for r in rs))
    assert any(n.endswith("attn.q.weight") for n in names) and any(n.endswith("mlp.fc.weight") or "experts" in n
                                                                   for n in names), sorted(names)
    for name in names:
        groups: dict[tuple, list[dict]] = {}  # the shard group of the parameter: dense, the inner group; experts,
        for r in rs:                          # the expert inner group of one ep index
            h = r["owned"].get(name)
            if h is not None:
                groups.setdefault((r["outer_rank"], r["ep_rank"] if h["expert"] else None), []).append(h)
        for key, held in groups.items():
            full = held[0]["full"]
            owners = [h for h in held if h["shape"] == full]
            assert len(owners) == 1, f"{W4_CASES[index][0]}: {name}: owners {len(owners)} in group {key}: {held}"
            for h in held:
                want = full if h is owners[0] else (0, *full[1:])
                assert h["shape"] == want and h["grad"] in (want, None), f"{name}: {h}"
            assert owners[0]["grad"] == full, f"{name}: the owner's .grad {owners[0]['grad']}"
    by_inner = {}
    for r in rs:  # replicas across the outer group agree on who owns what
        owned = sorted(n for n, h in r["owned"].items() if h["shape"] == h["full"])
        by_inner.setdefault((r["inner_rank"], r["ep_rank"]), set()).add(tuple(owned))
    assert all(len(v) == 1 for v in by_inner.values()), by_inner
    for r in rs:
        assert r["step_collectives"] == 0, f"rank: the optimizer steps issued {r['step_collectives']} collectives"
        for kind, report in r["balance"].items():
            assert report["cost_imbalance"] <= 1.25, f"{W4_CASES[index][0]} {kind}: {report}"


def layout_only_job() -> dict:
    """The same training with and without ``whole_params``, SGD with momentum (element-wise, so only the layout
    differs): bf16 compute (``MixedPrecisionPolicy``), the model built on meta, 2 micro-batches under ``no_sync``,
    an L2 penalty on ``model.parameters()`` (a direct gradient into the fragments), clipping. HSDP 2 x 2."""
    import shardfusion as sf
    from shardfusion.models import GPT, Block

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2)
    dp_world, dp_rank = topo.dp * topo.sharding, topo.data_parallel_rank
    out = {}
    for whole in (False, True):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(mr.config())
        model = sf.fully_shard(model, topo, units=(Block,), whole_params=mr.is_block_matrix if whole else None,
                               mp_policy=sf.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(mr.STEPS):
            x, y = mr.slice_batch(step, dp_world, dp_rank)
            with sf.no_sync(model):
                model(x[:1], y[:1])[1].backward()
            loss = model(x[1:], y[1:])[1]
            (loss + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())).backward()  # the penalty: per fragment
            losses.append(float(loss))
            sf.clip_grad_norm_(model, mr.MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[whole] = {"losses": losses, "params": sf.full_state_dict(model, buffers=False)}
    return out


def test_whole_params_change_only_the_layout():
    rs = run_distributed(layout_only_job, 4, timeout=JOB_TIMEOUT_S)
    for r in rs:
        torch.testing.assert_close(torch.tensor(r[True]["losses"]), torch.tensor(r[False]["losses"]), rtol=1e-6,
                                   atol=1e-6)
        assert_close_dicts(r[True]["params"], r[False]["params"], "whole vs element-sharded", rtol=1e-6, atol=1e-6)
