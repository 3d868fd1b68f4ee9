"""The secondary shard within the node (``fully_shard(..., secondary_shard=True)``, ZeRO++'s hpZ), W=4 over gloo,
one sharding group of 4 over two declared nodes of 2 ranks (``Topology(sharding=4, ranks_per_node=2)``), the tiny
transformer (and the MoE GPT at ep 2), 2 micro-batches per step, ``reshard_policy="after_forward"``; all cases in
one spawned job.

* Exact: with ``all_gather_dtype`` None and int8, the losses and the parameters after every step are bitwise those
  of the same run without hpZ (the backward's gathered copy is bitwise the forward's), and the None run matches the
  fp32 single-process reference at the parity tolerance. The MoE GPT at ep 2 (int8): its expert buffers are sharded
  over 2 ranks on 2 different nodes (one rank per node: the copy is the whole wire copy, the backward's gather a
  local copy), bitwise the run without hpZ.
* The collectives: every step's backward all-gathers run on the 2-rank node groups (``{0, 1}``, ``{2, 3}``,
  labelled ``fsdp_inner_node``), one per block and micro-batch, each of the wire copy's bytes (``P * 4`` for
  None, ``G * (S + 4 * ceil(S / 256))`` for int8), sending half of it and nothing across nodes; the 4-rank group
  carries only the forward's all-gathers (the plain run's count less the backward's).
* ``after_backward``: the option changes nothing: bitwise the plain run, the same collectives, no node group.
* The memory: after a forward, each block's buffer holds a copy of ``1/2`` of the wire copy (the formula, from the
  buffer's layout), counted in ``model_storages``' ``secondary_params`` part; after the backward none is held.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from reference import Case, case_results, reference_train, run_cases

JOB_TIMEOUT_S = 180
B = 256

_BASE = Case(name="", model="transformer", world=4, sharding=4, outer=1, optim="adamw", steps=3, micro=2,
             count_comm=True, ranks_per_node=2)
PAIRS = {"none": _BASE, "int8": _BASE.with_(all_gather_dtype="int8"),
         "after-backward": _BASE.with_(reshard_policy="after_backward"),
         "moe-int8": _BASE.with_(model="moe", ep=2, all_gather_dtype="int8")}
CASES = [c for name, base in PAIRS.items()
         for c in (base.with_(name="plain-" + name), base.with_(name="hpz-" + name, secondary_shard=True))]


def _memory(case: Case) -> dict:
    """Worker: per flat buffer, its secondary copy's bytes after a forward and after the backward, the bytes
    ``model_storages`` counts in ``secondary_params`` then, and the layout facts of the formula."""
    import torch.distributed as dist

    import shardfusion as sf
    from models import MODEL_SEED, build_model, loss_fn
    from reference import DATA_SEED, draw_batch, get_topology, wrap_kwargs
    from shardfusion.live_memory import model_storages

    topo = get_topology(case)
    model = build_model(case.model, seed=MODEL_SEED, ep_group=topo.get_group("ep"))
    sf.fully_shard(model, topo, **wrap_kwargs(case))
    parts = model_storages(model)
    gen = torch.Generator().manual_seed(DATA_SEED + dist.get_rank() + 1)
    loss = loss_fn(case.model, model, draw_batch(case, gen))
    after_forward = [(u.name, g.secondary.nbytes if g.secondary is not None else None, g.layout.padded_numel,
                      g.layout.shard_count, u.reshard_after_forward) for u in sf.get_units(model) for g in u.groups]
    counted_forward = sum(st.nbytes() for st in parts()["secondary_params"].values())
    loss.backward()
    after_backward = [g.secondary.nbytes for u in sf.get_units(model) for g in u.groups if g.secondary is not None]
    counted_backward = sum(st.nbytes() for st in parts()["secondary_params"].values())
    return {"after_forward": after_forward, "counted_forward": counted_forward, "after_backward": after_backward,
            "counted_backward": counted_backward}


def _whole_params(case: Case) -> dict:
    """Worker: 2 AdamW steps of the model with its 2-D weights in owner layouts (``whole_params``), without and with
    hpZ: losses, parameters, and how many buffers held a secondary copy after the first forward."""
    import torch.distributed as dist

    import shardfusion as sf
    from models import MODEL_SEED, build_model, loss_fn
    from reference import DATA_SEED, draw_batch, get_topology, wrap_kwargs

    topo = get_topology(case)
    out = {}
    for hpz in (False, True):
        model = build_model(case.model, seed=MODEL_SEED, ep_group=topo.get_group("ep"))
        sf.fully_shard(model, topo, **wrap_kwargs(case.with_(secondary_shard=hpz)),
                       whole_params=lambda name, p: p.dim() == 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(DATA_SEED + dist.get_rank() + 1)
        losses, copies = [], None
        for _ in range(2):
            loss = loss_fn(case.model, model, draw_batch(case, gen))
            if copies is None:
                copies = sum(g.secondary is not None for u in sf.get_units(model) for g in u.groups)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[hpz] = {"losses": losses, "copies": copies,
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def _job() -> dict:
    results = run_cases(CASES)
    for name in ("none", "int8"):
        results["memory-" + name] = _memory(PAIRS[name].with_(secondary_shard=True))
    results["whole-params"] = _whole_params(_BASE.with_(micro=1))
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 4, timeout=JOB_TIMEOUT_S)


def _ok(per_rank: list[dict], name: str) -> list[dict]:
    for r in per_rank:
        assert "error" not in r, f"{name}: {r.get('error')}"
    return per_rank


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(PAIRS))
def test_bitwise_the_run_without_it(results, name):
    plain, hpz = _ok(case_results(results, "plain-" + name), name), _ok(case_results(results, "hpz-" + name), name)
    for p, h in zip(plain, hpz):
        assert p["losses"] == h["losses"], f"{name}: losses {p['losses']} vs {h['losses']}"
        for step, (a, b) in enumerate(zip(p["params"], h["params"])):
            for n in a:
                assert torch.equal(a[n], b[n]), f"{name}: {n} after step {step} differs"
        for n in p["full"]:
            assert torch.equal(p["full"][n], h["full"][n]), f"{name}: full_state_dict {n} differs"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_matches_the_single_process_reference(results):
    from reference import check_parity

    case = PAIRS["none"].with_(count_comm=False, ranks_per_node=None)
    check_parity(_ok(case_results(results, "hpz-none"), "hpz-none"), reference_train(case), "hpz-none")


def _gathers(records) -> tuple[list, list]:
    """A step's parameter all-gathers: (on the 4-rank group, on the node groups)."""
    ag = [r for r in records if r.op == "all_gather" and r.category == "inner_all_gather"]
    return [r for r in ag if len(r.group_ranks) == 4], [r for r in ag if len(r.group_ranks) < 4]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name, wire", [("none", None), ("int8", "int8")])
def test_backward_all_gathers_stay_in_the_node(results, name, wire):
    from shardfusion._runtime import gather_wire

    plain, hpz = case_results(results, "plain-" + name), case_results(results, "hpz-" + name)
    # P of each buffer gathered, from the fp32 plain run's records (the same layout in every case)
    elems = {r.numel for step in case_results(results, "plain-none")[0]["comm"] for r in _gathers(step)[0]}
    want = {p * 4 if wire is None else 4 * gather_wire.row_bytes(p // 4, wire, 4) for p in elems}
    for p, h in zip(plain, hpz):
        rank = h["coords"]["rank"]
        node = (0, 1) if rank < 2 else (2, 3)
        blocks = sum(1 for unit, _ in h["units"] if unit)  # every unit but the root reshards after forward
        for step, (p_rec, h_rec) in enumerate(zip(p["comm"], h["comm"])):
            p_world, p_node = _gathers(p_rec)
            world, local = _gathers(h_rec)
            assert not p_node, f"{name}: the plain run gathers on a node group"
            assert len(local) == blocks * _BASE.micro, f"{name} rank {rank} step {step}: {len(local)} node gathers"
            assert len(world) == len(p_world) - len(local), f"{name}: forward all-gathers {len(world)}"
            for r in local:
                assert r.group_ranks == node and r.label == "fsdp_inner_node", (r.group_ranks, r.label)
                assert r.cross_node_bytes(2) == 0
                # the wire copy's bytes: P fp32 elements, or G = 4 packed int8 rows of a shard of P / 4
                assert r.nbytes in want and r.wire_bytes == r.nbytes / 2, (r.nbytes, r.wire_bytes, want)
            across = sum(r.cross_node_bytes(2) for r in world + local)
            assert across < sum(r.cross_node_bytes(2) for r in p_world)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", ["after-backward", "moe-int8"])
def test_no_node_group_gather_where_nothing_is_gathered_again(results, name):
    """after_backward keeps every unit gathered; the MoE's dense buffers still use the node groups, its expert
    buffers (one rank per node) gather their copy locally: no collective."""
    plain, hpz = case_results(results, "plain-" + name), case_results(results, "hpz-" + name)
    for p, h in zip(plain, hpz):
        for p_rec, h_rec in zip(p["comm"], h["comm"]):
            if name == "after-backward":
                assert [(r.op, r.group_ranks, r.nbytes) for r in p_rec] == [
                    (r.op, r.group_ranks, r.nbytes) for r in h_rec]
            else:  # the expert groups' all-gathers: the forward's only (those of the backward are local copies)
                experts = [[r for r in rec if r.op == "all_gather" and r.label.startswith("expert_inner")]
                           for rec in (p_rec, h_rec)]
                assert experts[0] and 2 * len(experts[1]) == len(experts[0]), [len(e) for e in experts]
                assert {r.label for r in h_rec if r.label.endswith("_node")} == {"fsdp_inner_node"}


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("wire", [None, "int8"])
def test_memory_holds_the_copy_between_forward_and_backward(results, wire):
    from shardfusion._runtime import gather_wire

    for r in case_results(results, "memory-" + ("none" if wire is None else wire)):
        assert "error" not in r, r.get("error")
        total = 0
        for name, nbytes, padded, count, resharded in r["after_forward"]:
            if not resharded:
                assert not nbytes, f"{name!r} is kept gathered: no copy"
                continue
            want = padded * 4 // 2 if wire is None else count * gather_wire.row_bytes(padded // count, wire, 4) // 2
            assert nbytes == want, f"{name}: copy of {nbytes} bytes, want {want}"
            total += want
        assert total > 0 and r["counted_forward"] == total
        assert r["after_backward"] and not any(r["after_backward"]) and r["counted_backward"] == 0


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_owner_layouts_bitwise_the_run_without_it(results):
    """whole_params (each 2-D weight whole on one owner rank) with hpZ: the copies are made (the owner layouts'
    buffers all-gather like the others) and the run is bitwise the one without."""
    for rank, r in enumerate(results):
        got = r["whole-params"]
        assert got[False]["copies"] == 0 and got[True]["copies"] > 0, (rank, got[False]["copies"], got[True]["copies"])
        assert got[True]["losses"] == got[False]["losses"], rank
        for n, t in got[False]["params"].items():
            assert torch.equal(t, got[True]["params"][n]), (rank, n)
