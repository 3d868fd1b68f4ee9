"""Communication accounting (shardfusion/accounting.py): categories, bytes on the wire, bytes across nodes, time waited.

The byte counts of a real training step must equal the ring formulas (see [Note: communication accounting]) summed
over the units' flat buffers. Per rank, per step, with P = a buffer's padded numel, I its shard count (inner degree),
O its replicate-group size, K micro-batches, 4 bytes per element (fp32):

    inner all-gather       (I-1)/I * P * 4   per gather: once per micro-batch, twice for a block under after_forward
    inner reduce-scatter   (I-1)/I * P * 4   per trainable buffer per micro-batch
    replicate all-reduce   2(O-1)/O * P/I * 4   once per trainable buffer per step
    other                  the clipping scalar: 2(W-1)/W * 4 bytes over the world

With ranks_per_node=2 (nodes {0,1} and {2,3}) the inner groups [0,1], [2,3] stay in a node and the replicate groups
[0,2], [1,3] cross: cross-node bytes are exactly the replicate all-reduce's; the world ring 0-1-2-3-0 crosses on 2 of
its 4 hops. With the harness's LOCAL_WORLD_SIZE=4 (one node) they are 0. An all-to-all with known splits checks the
exact per-peer count, forward and backward. The gradient all-reduce of parameters kept whole (`replicate_filter`) is a
replicate all-reduce too, not "other". One W=4 job (tiny models) runs every distributed case; the formulas alone are
tested in tests/unit/test_accounting.py.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from shardfusion import accounting
from shardfusion.comm import CommCounter

JOB_TIMEOUT_S = 90
W = 4
STEPS = 2
A2A_C = 3  # row width of the all-to-all case
A2A_SPLITS = [[(r + 2 * j) % 5 for j in range(W)] for r in range(W)]  # rows rank r sends to rank j (some 0)

# (name, model kind, ep, reshard_policy, micro-batches)
MODEL_CASES = [
    ("dense-after_backward-K1", "transformer", 1, "after_backward", 1),
    ("dense-after_forward-K2", "transformer", 1, "after_forward", 2),
    ("moe-ep2-after_backward-K1", "moe", 2, "after_backward", 1),
]


def _buffers(model) -> list[dict]:
    """Every flat buffer of every unit: what the formulas need."""
    import shardfusion as sf

    out = []
    for i, unit in enumerate(sf.get_units(model)):
        for g in unit.groups:
            out.append({"root": i == 0, "P": g.layout.padded_numel, "I": g.layout.shard_count,
                        "O": sf.comm.group_size(g.replicate_group), "trainable": g.requires_grad,
                        "esize": g.shard.element_size()})
    return out


def accounting_job() -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion import comm
    from models import Block, MoEBlock, build_model, loss_fn, make_batch

    rank = dist.get_rank()
    result = {"models": {}}
    topos = {1: sf.Topology(sharding=W, fsdp_outer_degree=2), 2: sf.Topology(sharding=W, ep=2, fsdp_outer_degree=2)}
    dense = topos[1]
    result["labels"] = {
        "inner": comm.group_label(dense.get_fsdp_inner_group()),
        "inner_reduce": comm.group_label(dense.get_fsdp_inner_reduce_group()),
        "replicate": comm.group_label(dense.get_replicate_group()),
        "world": comm.group_label(dist.group.WORLD),
        "ep": comm.group_label(topos[2].get_group("ep")),
        "expert_shard_reduce": comm.group_label(topos[2].get_reduce_group("moe_sharding")),
    }

    for name, kind, ep, policy, K in MODEL_CASES:
        topo = topos[ep]
        base = build_model(kind, ep_group=topo.get_group("ep")) if kind == "moe" else build_model(kind)
        model = sf.fully_shard(base, topo, units=(MoEBlock,) if kind == "moe" else (Block,), reshard_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(43 + topo.data_parallel_rank)
        steps = []
        for _ in range(STEPS):
            with CommCounter() as counter:
                for _m in range(K):
                    (loss_fn(kind, model, make_batch(kind, gen)) / K).backward()
                sf.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
            steps.append({"one_node": counter.summary(), "rpn2": counter.summary(ranks_per_node=2),
                          "rpn1": counter.summary(ranks_per_node=1), "records": counter.records,
                          "env_rpn": counter.ranks_per_node})
        result["models"][name] = {"buffers": _buffers(model), "steps": steps}

    # An all-to-all with known splits on a 4-rank ep group, forward and backward.
    ep_topo = sf.Topology(sharding=W, ep=W)
    group = ep_topo.get_group("ep")
    send = A2A_SPLITS[rank]
    recv = [A2A_SPLITS[j][rank] for j in range(W)]
    x = torch.randn(sum(send), A2A_C, requires_grad=True)  # (N_send, C)
    with CommCounter(ranks_per_node=2) as fwd:
        y = comm.all_to_all_single(x, recv, send, group)
    with CommCounter(ranks_per_node=2) as bwd:
        y.sum().backward()
    result["a2a"] = {"fwd": fwd.records, "bwd": bwd.records, "fwd_summary": fwd.summary(),
                     "bwd_summary": bwd.summary(), "group_ranks": tuple(dist.get_process_group_ranks(group))}

    # Asynchronous handles: wrapped (time waited recorded) only while a counter is active, drop-in either way.
    t = torch.ones(8)
    plain = comm.all_reduce(t, dense.get_replicate_group(), async_op=True)
    plain.wait()
    with CommCounter() as counter:
        work = comm.all_reduce(t, dense.get_replicate_group(), async_op=True)
        completed_type = type(work.is_completed()).__name__
        work.wait()
    result["async"] = {"plain_is_timed": isinstance(plain, comm.TimedWork),
                       "timed_is_timed": isinstance(work, comm.TimedWork), "completed_type": completed_type,
                       "done": work.is_completed(), "record": counter.records[0], "value": t[0].item()}
    result["kept_whole"] = _kept_whole_step(dense)
    return result


def _kept_whole_step(topo) -> dict:
    """One SGD step of the tiny transformer with its norm parameters kept whole (replicate_filter): the summary of
    its collectives, and how many kept-whole flat buffers it has."""
    import shardfusion as sf
    from models import Block, build_model, loss_fn, make_batch

    model = sf.fully_shard(build_model("transformer"), topo, units=(Block,),
                           replicate_filter=lambda n, p: "ln" in n or "norm" in n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    with CommCounter(ranks_per_node=2) as c:
        loss_fn("transformer", model, make_batch("transformer", gen)).backward()
        opt.step()
    whole = sum(len([g for g in u.trainable_groups if g.layout.shard_count == 1]) for u in sf.get_units(model))
    return {"summary": c.summary(), "whole": whole}


@pytest.fixture(scope="module")
def results():
    return run_distributed(accounting_job, W, timeout=JOB_TIMEOUT_S)


def _expected(buffers: list[dict], policy: str, K: int, world: int, first_step: bool = False
              ) -> dict[str, dict[str, float]]:
    """Per-step count, logical bytes and wire bytes of each category, from the formulas. In the first step each of
    the K backwards (gradient sync on) ends with the outer all-reduce: nothing predicts the last one yet."""
    exp = {c: {"count": 0, "bytes": 0, "wire_bytes": 0.0} for c in accounting.CATEGORIES}

    def add(cat: str, n: int, nbytes: int, wire: float) -> None:
        exp[cat]["count"] += n
        exp[cat]["bytes"] += n * nbytes
        exp[cat]["wire_bytes"] += n * wire

    for b in buffers:
        P, I, O, e = b["P"], b["I"], b["O"], b["esize"]
        if I > 1:
            gathers = K * (1 if b["root"] or policy == "after_backward" else 2)
            add("inner_all_gather", gathers, P * e, (I - 1) / I * P * e)
            if b["trainable"]:
                add("inner_reduce_scatter", K, P * e, (I - 1) / I * P * e)
        if O > 1 and b["trainable"]:
            add("replicate_all_reduce", K if first_step else 1, P // I * e, 2 * (O - 1) / O * (P // I) * e)
    add("other", 1, 4, 2 * (world - 1) / world * 4)  # the clipping scalar (fp32) over the world
    return exp


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c[0])
def test_step_bytes_equal_formulas(results, case):
    name, kind, ep, policy, K = case
    for rank, res in enumerate(results):
        model = res["models"][name]
        buffers = model["buffers"]
        assert any(b["I"] > 1 for b in buffers) and any(b["O"] > 1 for b in buffers), buffers
        for step, s in enumerate(model["steps"]):
            exp = _expected(buffers, policy, K, W, first_step=step == 0)
            where = f"{name}, rank {rank}, step {step}"
            got = s["one_node"]
            assert list(got) == list(accounting.CATEGORIES), where
            for cat in ("inner_all_gather", "inner_reduce_scatter", "replicate_all_reduce", "other"):
                for field in ("count", "bytes", "wire_bytes"):
                    assert got[cat][field] == exp[cat][field], (
                        f"{where}: {cat} {field} = {got[cat][field]}, formula {exp[cat][field]} (buffers {buffers})")
            # one outer all-reduce per trainable buffer per step
            assert got["replicate_all_reduce"]["count"] == (K if step == 0 else 1) * sum(
                b["trainable"] and b["O"] > 1 for b in buffers)
            if kind == "moe":  # per MoE layer and micro-batch: counts + rows out + rows back, 2 more in backward
                assert got["ep_all_to_all"]["count"] == 5 * 2 * K, where
                assert got["ep_all_to_all"]["wire_bytes"] > 0, where
            else:
                assert got["ep_all_to_all"]["count"] == 0, where
            for cat, row in got.items():
                assert (row["wait_s"] > 0) == (row["count"] > 0), f"{where}: {cat} {row}"

            # one node (LOCAL_WORLD_SIZE=4 in the harness): nothing crosses
            assert s["env_rpn"] == W
            assert all(row["cross_node_bytes"] == 0 for row in got.values()), f"{where}: {got}"
            # two nodes of 2: exactly the replicate all-reduce crosses, plus 2 of the 4 hops of the world ring
            two = s["rpn2"]
            for cat in ("inner_all_gather", "inner_reduce_scatter", "ep_all_to_all"):
                assert two[cat]["cross_node_bytes"] == 0, f"{where}: {cat} {two[cat]}"
            rep = two["replicate_all_reduce"]
            assert rep["cross_node_bytes"] == rep["wire_bytes"] > 0, f"{where}: {rep}"
            assert two["other"]["cross_node_bytes"] == exp["other"]["wire_bytes"] / 2, where
            # one rank per node: everything on the wire crosses
            assert all(row["cross_node_bytes"] == row["wire_bytes"] for row in s["rpn1"].values()), where


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_records_carry_group_labels(results):
    for res in results:
        labels = res["labels"]
        assert labels["inner"] == "fsdp_inner+expert_inner"  # ep 1: one group serves both kinds
        assert labels["inner_reduce"] == "fsdp_inner_reduce+expert_inner_reduce"
        assert labels["replicate"] == "replicate"  # a group of its own (the outer group is another object)
        assert labels["world"] == "world"
        assert labels["ep"] == "ep"
        assert labels["expert_shard_reduce"].startswith("moe_sharding_reduce")
        by_cat = {}
        for rec in res["models"]["dense-after_backward-K1"]["steps"][0]["records"]:
            by_cat.setdefault(rec.category, set()).add(rec.label)
        assert by_cat == {"inner_all_gather": {labels["inner"]}, "inner_reduce_scatter": {labels["inner_reduce"]},
                          "replicate_all_reduce": {labels["replicate"]}, "other": {"world"}}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_all_to_all_known_splits(results):
    row = A2A_C * 4  # bytes per fp32 row
    for rank, res in enumerate(results):
        a2a = res["a2a"]
        assert a2a["group_ranks"] == tuple(range(W))
        (fwd,), (bwd,) = a2a["fwd"], a2a["bwd"]
        send = A2A_SPLITS[rank]  # forward: my rows to each rank
        back = [A2A_SPLITS[j][rank] for j in range(W)]  # backward: the gradients of the rows I received
        for rec, rows in ((fwd, send), (bwd, back)):
            assert rec.category == "ep_all_to_all" and rec.label == "ep" and rec.rank == rank
            assert rec.send_bytes == tuple(n * row for n in rows)
            assert rec.wire_bytes == sum(n for j, n in enumerate(rows) if j != rank) * row
            other_node = [j for j in range(W) if j // 2 != rank // 2]
            assert rec.cross_node_bytes(2) == sum(rows[j] for j in other_node) * row
            assert rec.cross_node_bytes(None) == 0 and rec.cross_node_bytes(4) == 0
        assert a2a["fwd_summary"]["ep_all_to_all"]["cross_node_bytes"] == fwd.cross_node_bytes(2)
        assert a2a["bwd_summary"]["ep_all_to_all"]["wire_bytes"] == bwd.wire_bytes
    # what the ranks send in total is what they receive: the per-peer counts agree across ranks
    assert sum(r["a2a"]["fwd"][0].wire_bytes for r in results) == sum(
        A2A_SPLITS[i][j] for i in range(W) for j in range(W) if i != j) * row


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_async_handles(results):
    for res in results:
        a = res["async"]
        assert not a["plain_is_timed"] and a["timed_is_timed"]  # no wrapper, no cost, without a counter
        assert a["completed_type"] == "bool" and a["done"]
        rec = a["record"]
        assert rec.category == "replicate_all_reduce" and rec.wait_s > 0
        assert rec.wire_bytes == 2 * 1 / 2 * 32  # 8 fp32 over a group of 2
        assert a["value"] == 4.0  # all-reduced twice over 2 ranks: the wrapper waits for real


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_kept_whole_gradient_all_reduce_is_replicate_category(results):
    r = results[0]["kept_whole"]
    assert r["whole"] == 3
    s = r["summary"]
    # 3 sharded buffers + 3 kept-whole buffers each all-reduce their gradient once per step; no clipping, no buffers.
    assert s["replicate_all_reduce"]["count"] == 6, s
    assert s["other"]["count"] == 0, f"gradient all-reduces of kept-whole parameters counted as 'other': {s['other']}"
