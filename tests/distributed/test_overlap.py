"""Overlap: prefetch depth, the replicate all-reduce overlapped with the last backward, the in-flight guard.

* The overlapped path (`set_is_last_backward` on the last micro-batch) and the synchronous one (all-reduce at the
  step boundary) give bitwise-equal fp32 parameters, for prefetch 0, 1 and 2, K = 1 and 3 micro-batches, on the tiny
  transformer (its tied embedding is one parameter used by two modules) and on the tiny GPT-MoE (ep 2); and the
  overlapped run issues exactly one replicate all-reduce per trainable buffer per step, all of them during the last
  backward (the synchronous one: all at the step boundary).
* The guard: a gradient that reaches a buffer whose all-reduce is in flight (a second backward under
  `set_is_last_backward(True)` before the optimizer step) raises RuntimeError on every rank instead of racing.
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
            for m in range(micro):
                sf.set_is_last_backward(model, overlap and m == micro - 1)
                (loss_fn(kind, model, make_batch(kind, gen)) / micro).backward()
            in_backward = counter.count("all_reduce", replicate)  # issued before the step boundary
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
                for overlap in (False, True):
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
            for overlap in (False, True):
                run = r[(kind, micro, prefetch, overlap)]
                for n, t in run["params"].items():
                    assert torch.equal(t, base[n]), f"{kind} K={micro} prefetch={prefetch} overlap={overlap}: {n}"
                expected = (run["buffers"] if overlap else 0, run["buffers"])  # (during backward, in the step)
                assert run["all_reduces"] == [expected] * STEPS, (
                    f"{kind} K={micro} prefetch={prefetch} overlap={overlap}: replicate all-reduces per step "
                    f"{run['all_reduces']}, buffers {run['buffers']}")


def _guard_job() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2, timeout=30)
    model = sf.fully_shard(build_model("transformer"), topo, units=(Block,))
    gen = torch.Generator().manual_seed(1)
    sf.set_is_last_backward(model, True)
    loss_fn("transformer", model, make_batch("transformer", gen)).backward()
    try:
        loss_fn("transformer", model, make_batch("transformer", gen)).backward()
    except RuntimeError as e:
        error = str(e)
    else:
        error = None
    return {"error": error}


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_gradient_into_in_flight_all_reduce_raises():
    results = run_distributed(_guard_job, 4, timeout=JOB_TIMEOUT_S)
    for r in results:
        assert r["error"] is not None and "in flight" in r["error"] and "set_is_last_backward" in r["error"], r


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
