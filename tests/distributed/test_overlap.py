"""Overlap: prefetch depth, the replicate all-reduce overlapped with the last backward, the in-flight guard.

* The overlapped path (`set_is_last_backward` on the last micro-batch) and the synchronous one (all-reduce at the
  step boundary) give bitwise-equal fp32 parameters, for prefetch 0, 1 and 2, K = 1 and 3 micro-batches, on the tiny
  transformer (its tied embedding is one parameter used by two modules) and on the tiny GPT-MoE (ep 2); and the
  overlapped run issues exactly one replicate all-reduce per trainable buffer per step, all of them during the last
  backward (the synchronous one: all at the step boundary).
* By default (no `set_is_last_backward`) the last backward is predicted from the previous step's count: bitwise the
  synchronous result, one replicate all-reduce per trainable buffer per step, overlapped from the second step on.
* A wrong prediction (the number of micro-batches changes from step to step) or a wrong `set_is_last_backward(True)`
  (on two backwards of a step) is correct: the later gradients are all-reduced by themselves at the step boundary,
  one more all-reduce per buffer they reached; parameters equal the synchronous run to fp32 rounding.
* The bound on live full buffers: with after_forward, at most prefetch + 1 non-root units hold a full buffer at once
  in forward and prefetch + 2 in backward; and prefetching really happens (the peak reaches prefetch + 1).
All at W=4, inner 2 x outer 2.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import MODEL_SEED, Block, MoEBlock, TinyTransformer, build_model, loss_fn, make_batch

JOB_TIMEOUT_S = 240
STEPS = 3


def _train(kind: str, topo, prefetch: int, micro: int, overlap: bool) -> dict:
    import shardfusion as sf

    model = build_model(kind, ep_group=topo.get_group("ep"))
    sf.fully_shard(model, topo, units=(MoEBlock,) if kind == "moe" else (Block,), prefetch=prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7 + topo.data_parallel_rank)
    replicate = tuple(sorted(torch.distributed.get_process_group_ranks(topo.get_replicate_group())))
    all_reduces = []
    for _ in range(STEPS):
        with sf.comm.CommCounter() as counter:
            before = model._sf_state.handed_off_syncs
            for m in range(micro):
                if overlap is not None:  # None: the default, predicted
                    sf.set_is_last_backward(model, overlap and m == micro - 1)
                (loss_fn(kind, model, make_batch(kind, gen)) / micro).backward()
            in_backward = model._sf_state.handed_off_syncs - before  # handed off during backward (overlapped)
            sf.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
        all_reduces.append((in_backward, counter.count("all_reduce", replicate)))
    buffers = sum(len(u.trainable_groups) for u in sf.get_units(model))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "all_reduces": all_reduces,
            "buffers": buffers}


def _equality_job() -> dict:
    import shardfusion as sf

    topos = {ep: sf.Topology(sharding=4, fsdp_outer_degree=2, ep=ep, timeout=60) for ep in (1, 2)}
    out = {}
    for kind, ep in (("transformer", 1), ("moe", 2)):
        for micro in (1, 3):
            for prefetch in (0, 1, 2):
                for overlap in (False, True, None):
                    out[(kind, micro, prefetch, overlap)] = _train(kind, topos[ep], prefetch, micro, overlap)
    return out


@pytest.fixture(scope="module")
def equality_results():
    return run_distributed(_equality_job, 4, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("kind", ["transformer", "moe"])
@pytest.mark.parametrize("micro", [1, 3])
def test_overlapped_equals_synchronous_bitwise(equality_results, kind, micro):
    for r in equality_results:
        base = r[(kind, micro, 1, False)]["params"]
        for prefetch in (0, 1, 2):
            for overlap in (False, True, None):
                run = r[(kind, micro, prefetch, overlap)]
                for n, t in run["params"].items():
                    what = f"{kind} K={micro} prefetch={prefetch} overlap={overlap}: {n}"
                    if overlap is None and micro > 1:
                        # The first step all-reduces each of its K backwards' gradients (final after each: nothing
                        # predicts the last yet): a sum of K all-reduces instead of one, equal up to rounding.
                        torch.testing.assert_close(t, base[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")
                    else:
                        assert torch.equal(t, base[n]), what
                B = run["buffers"]
                expected = [(B if overlap else 0, B)] * STEPS  # (during backward, in the step)
                if overlap is None:  # predicted from the previous step; in the first each backward ends with them
                    expected = [(0, micro * B)] + [(B, B)] * (STEPS - 1)
                assert run["all_reduces"] == expected, (
                    f"{kind} K={micro} prefetch={prefetch} overlap={overlap}: replicate all-reduces per step "
                    f"{run['all_reduces']}, buffers {run['buffers']}")


SCHEDULE = (1, 2, 1, 3)  # micro-batches per step: the prediction is wrong in steps 1 and 3


def _mispredict_train(topo, mode: str) -> dict:
    """``mode``: "sync" (all-reduces at the step boundary), "predicted" (the default), "wrong" (set_is_last_backward
    True on every backward)."""
    import shardfusion as sf

    model = sf.fully_shard(build_model("transformer"), topo, units=(Block,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3 + topo.data_parallel_rank)
    replicate = tuple(sorted(torch.distributed.get_process_group_ranks(topo.get_replicate_group())))
    counts = []
    for micro in SCHEDULE:
        with sf.comm.CommCounter() as counter:
            before = model._sf_state.handed_off_syncs
            for _ in range(micro):
                if mode != "predicted":
                    sf.set_is_last_backward(model, mode == "wrong")
                (loss_fn("transformer", model, make_batch("transformer", gen)) / micro).backward()
            in_backward = model._sf_state.handed_off_syncs - before
            opt.step()
            opt.zero_grad()
        counts.append((in_backward, counter.count("all_reduce", replicate)))
    buffers = sum(len(u.trainable_groups) for u in sf.get_units(model))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "counts": counts,
            "buffers": buffers}


def _mispredict_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2, timeout=30)
    return {mode: _mispredict_train(topo, mode) for mode in ("sync", "predicted", "wrong")}


@pytest.fixture(scope="module")
def mispredicted():
    return run_distributed(_mispredict_job, 4, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("mode", ["predicted", "wrong"])
def test_a_wrong_last_backward_is_correct(mispredicted, mode):
    for r in mispredicted:
        for n, t in r[mode]["params"].items():
            torch.testing.assert_close(t, r["sync"]["params"][n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{mode} {n}: {m}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_wrong_prediction_costs_one_more_all_reduce_per_buffer(mispredicted):
    for r in mispredicted:
        B = r["predicted"]["buffers"]
        # step 0: nothing to predict from, the backward ends with them; step 1 (K=2): the first backward taken for
        # the last, the second's gradient all-reduced at the step boundary; step 2 (K=1): the previous step had 2, so
        # none taken; step 3 (K=3): the first taken, the other two summed and all-reduced at the boundary
        assert r["predicted"]["counts"] == [(0, B), (B, 2 * B), (0, B), (B, 2 * B)], r["predicted"]["counts"]
        assert r["sync"]["counts"] == [(0, B)] * len(SCHEDULE), r["sync"]["counts"]
        # every backward said to be the last leaves final gradients: each one's all-reduces, overlapped
        assert r["wrong"]["counts"] == [(B * k, B * k) for k in SCHEDULE], r["wrong"]["counts"]


def _bound_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2, timeout=60)
    out = {}
    for prefetch in (0, 1, 2):
        torch.manual_seed(MODEL_SEED)
        model = sf.fully_shard(TinyTransformer(n_blocks=6), topo, units=(Block,), prefetch=prefetch)
        state = model._sf_state
        gen = torch.Generator().manual_seed(2)
        peaks = []
        for _ in range(2):
            batch = make_batch("transformer", gen)
            state.peak_unsharded_units = 0
            loss = loss_fn("transformer", model, batch)
            forward_peak = state.peak_unsharded_units
            state.peak_unsharded_units = 0
            loss.backward()
            peaks.append((forward_peak, state.peak_unsharded_units))
        out[prefetch] = peaks
    return out


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_live_full_buffers_bounded_by_prefetch():
    results = run_distributed(_bound_job, 4, timeout=JOB_TIMEOUT_S)
    for r in results:
        for prefetch, peaks in r.items():
            for forward_peak, backward_peak in peaks:
                assert forward_peak <= prefetch + 1 and backward_peak <= prefetch + 2, (prefetch, peaks)
            assert max(f for f, _ in peaks[1:]) == prefetch + 1, f"prefetch {prefetch} not reached: {peaks}"
    print("peaks (forward, backward) per prefetch:", results[0])
