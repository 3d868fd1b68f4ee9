"""Owner layouts for whole parameters (shardfusion._runtime.layout.build_owner_layout): each parameter lies whole
in one shard, owners balance the Newton-Schulz cost, shards stay equal (the rest is padding)."""

from __future__ import annotations

import math

import pytest

from shardfusion._runtime.layout import build_owner_layout, newton_schulz_cost, owned_shape, owner_report


def test_each_parameter_whole_in_exactly_one_shard():
    shapes = [(64, 32), (32, 32), (128, 16), (7, 5), (0, 4), (16, 64), (33,)]
    layout = build_owner_layout([f"p{i}" for i in range(len(shapes))], shapes, shard_count=4, align=4)
    S = layout.shard_numel
    assert layout.padded_numel == 4 * S and S % 4 == 0
    for slot in layout.slots:
        if slot.numel:
            assert slot.offset // S == (slot.end - 1) // S, slot  # does not cross a shard boundary
            assert slot.offset % 4 == 0
    for shard in range(4):
        frags = layout.fragments(shard)
        for frag in frags:
            assert frag.numel in (0, frag.slot.numel)  # whole or nothing
    for i, slot in enumerate(layout.slots):
        owners = [r for r in range(4) if layout.fragments(r)[i].numel]
        assert len(owners) == (1 if slot.numel else 0), (slot, owners)
    # no two parameters overlap
    spans = sorted((s.offset, s.end) for s in layout.slots if s.numel)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_owners_balance_the_cost():
    # a transformer's matrices: 4 layers x (q, k, v, o: C x C; fc: 4C x C; proj: C x 4C)
    C = 64
    shapes = [s for _ in range(4) for s in [(C, C)] * 4 + [(4 * C, C), (C, 4 * C)]]
    layout = build_owner_layout([str(i) for i in range(len(shapes))], shapes, shard_count=4)
    report = owner_report(layout)
    assert report["cost_imbalance"] <= 1.25, report
    assert sum(report["cost"]) == sum(newton_schulz_cost(s) for s in shapes)
    assert sum(report["numel"]) == sum(math.prod(s) for s in shapes)
    assert report["padding"] == layout.padded_numel - sum(math.prod(s) for s in shapes)


def test_newton_schulz_cost_is_symmetric():
    assert newton_schulz_cost((256, 64)) == newton_schulz_cost((64, 256)) == 256 * 64 ** 2
    assert newton_schulz_cost((10,)) == 10


def test_one_shard_and_bad_arguments():
    layout = build_owner_layout(["a", "b"], [(3, 3), (2, 2)], shard_count=1, align=4)
    assert [s.offset for s in layout.slots] == [0, 12] and layout.padded_numel == 16
    with pytest.raises(ValueError, match=r"shard_count\(0\)"):
        build_owner_layout(["a"], [(2, 2)], shard_count=0)
    with pytest.raises(ValueError, match="differ"):
        build_owner_layout(["a"], [(2, 2)], shard_count=2, costs=[1, 2])


def test_base_load_balances_over_units():
    """A GPT block's matrices (4 of d x d, 2 of 4d x d) cannot balance over 4 ranks in one unit (4/3 of the mean at
    best); carrying each rank's load to the next block's layout balances two blocks exactly."""
    d = 32
    shapes = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    names = [f"m{i}" for i in range(len(shapes))]
    first = build_owner_layout(names, shapes, 4)
    one = owner_report(first)
    assert one["cost_imbalance"] == pytest.approx(4 / 3)
    second = build_owner_layout(names, shapes, 4, base_load=one["cost"])
    total = [a + b for a, b in zip(one["cost"], owner_report(second)["cost"])]
    assert max(total) == min(total) == 2 * sum(newton_schulz_cost(s) for s in shapes) // 4
    with pytest.raises(ValueError, match=r"len\(base_load\)\(3\) != shard_count\(4\)"):
        build_owner_layout(names, shapes, 4, base_load=[0, 0, 0])


def test_owned_shape():
    assert owned_shape((8, 4), 32) == (8, 4)
    assert owned_shape((8, 4), 0) == (0, 4)
    assert owned_shape((2, 3, 4), 0) == (0, 3, 4)
    assert owned_shape((5,), 0) == (0,)
    assert owned_shape((), 0) == (0,)
    assert owned_shape((), 1) == ()
