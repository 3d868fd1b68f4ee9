"""The accounting formulas of shardfusion/accounting.py without processes: the category of each (op, group kinds),
the order of group labels, the bytes on the wire of each op (ring formulas, docs/accounting.md), the nodes a ring
crosses, and CommCounter's summary and ranks per node. Real training steps are in
tests/distributed/test_comm_accounting.py."""

from __future__ import annotations

import pytest

from shardfusion import accounting
from shardfusion.comm import CommCounter, CommRecord


@pytest.mark.parametrize("op, kinds, category", [
    ("all_gather", ("fsdp_inner",), "inner_all_gather"),
    ("all_gather", ("expert_inner",), "inner_all_gather"),
    ("all_gather", ("moe_sharding", "sharding"), "inner_all_gather"),  # expert_policy="shard"
    ("all_gather", ("replicate", "moe_sharding"), "inner_all_gather"),  # one group, two roles: the op decides
    ("all_gather", ("world",), "other"),
    ("reduce_scatter", ("fsdp_inner_reduce", "expert_inner_reduce"), "inner_reduce_scatter"),
    ("reduce_scatter", ("moe_sharding_reduce",), "inner_reduce_scatter"),
    ("all_reduce", ("replicate", "fsdp_outer", "expert_outer"), "replicate_all_reduce"),
    ("all_reduce", ("dp",), "replicate_all_reduce"),  # experts under expert_policy="shard"
    ("all_reduce", ("replicate", "moe_sharding"), "replicate_all_reduce"),
    ("all_reduce", ("world",), "other"),  # the clipping scalar
    ("all_reduce", ("data_parallel",), "replicate_all_reduce"),  # parameters kept whole (replicate_filter)
    ("all_to_all", ("ep",), "ep_all_to_all"),
    ("all_to_all", (), "other"),
    ("broadcast", ("data_parallel",), "other"),
    ("broadcast", ("replicate",), "other"),
])
def test_category_mapping(op, kinds, category):
    assert accounting.category(op, kinds) == category


def test_label_order():
    assert accounting.order_kinds(["expert_inner", "fsdp_inner", "expert_inner"]) == ("fsdp_inner", "expert_inner")
    assert accounting.order_kinds(["fsdp_outer", "expert_outer", "replicate"]) == (
        "replicate", "fsdp_outer", "expert_outer")
    assert accounting.order_kinds(["mine", "world", "other"]) == ("world", "mine", "other")


def test_wire_formulas():
    n = 1200
    for g in (2, 3, 4, 8):
        assert accounting.wire_bytes("all_gather", g, n) == (g - 1) * n / g
        assert accounting.wire_bytes("reduce_scatter", g, n) == (g - 1) * n / g
        assert accounting.wire_bytes("broadcast", g, n) == (g - 1) * n / g
        assert accounting.wire_bytes("all_reduce", g, n) == 2 * (g - 1) * n / g
    assert accounting.wire_bytes("all_to_all", 3, 60, (8, 20, 32), index=1) == 40.0
    with pytest.raises(ValueError, match="send_bytes"):
        accounting.wire_bytes("all_to_all", 2, 8)
    with pytest.raises(ValueError, match="unknown op 'scatter'"):
        accounting.wire_bytes("scatter", 2, 8)


def test_cross_node_estimates():
    assert accounting.ring_crossings((0, 1, 2, 3), 2) == 2
    assert accounting.ring_crossings((0, 2), 2) == 2
    assert accounting.ring_crossings((0, 1), 2) == 0
    assert accounting.ring_crossings((0, 1, 2, 3), None) == 0
    assert accounting.ring_crossings((0, 4, 8, 12), 8) == 2  # 2 nodes: the ring enters and leaves each once
    assert accounting.ring_crossings((0, 1, 2, 3, 4, 5), 2) == 3
    rec = CommRecord("all_reduce", (0, 1, 2, 3), 100, 400, wire_bytes=600.0)
    assert rec.cross_node_bytes(2) == 300.0 and rec.cross_node_bytes(None) == 0 and rec.cross_node_bytes(1) == 600
    a2a = CommRecord("all_to_all", (4, 5, 6, 7), 10, 40, rank=5, wire_bytes=36.0, send_bytes=(8, 4, 12, 16))
    assert a2a.cross_node_bytes(2) == 28.0  # to ranks 6 and 7
    assert a2a.cross_node_bytes(4) == 0.0


def test_summary_and_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    counter = CommCounter()
    assert counter.ranks_per_node == 2
    counter.records = [
        CommRecord("all_gather", (0, 1), 8, 32, category="inner_all_gather", wire_bytes=16.0, wait_s=0.5),
        CommRecord("all_reduce", (0, 2), 4, 16, category="replicate_all_reduce", wire_bytes=16.0, wait_s=0.25),
        CommRecord("all_reduce", (0, 2), 4, 16, category="replicate_all_reduce", wire_bytes=16.0, wait_s=0.25),
    ]
    s = counter.summary()
    assert list(s) == list(accounting.CATEGORIES)
    assert s["inner_all_gather"] == {"count": 1, "bytes": 32, "wire_bytes": 16.0, "cross_node_bytes": 0.0,
                                     "wait_s": 0.5}
    assert s["replicate_all_reduce"] == {"count": 2, "bytes": 32, "wire_bytes": 32.0, "cross_node_bytes": 32.0,
                                         "wait_s": 0.5}
    assert s["ep_all_to_all"]["count"] == 0 and s["other"]["wire_bytes"] == 0
    assert counter.summary(ranks_per_node=4)["replicate_all_reduce"]["cross_node_bytes"] == 0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert CommCounter().ranks_per_node is None  # one node
    assert CommCounter(ranks_per_node=3).ranks_per_node == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_node must be an int >= 1"):
            CommCounter(ranks_per_node=bad)
