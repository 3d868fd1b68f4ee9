"""Pure layout math: offsets, alignment, padding and fragments (no processes)."""

import pytest

from shardfusion._runtime.layout import build_layout


def test_offsets_aligned_and_padded_to_shard_multiple():
    layout = build_layout(["a", "b", "c"], [(3,), (2, 5), (7,)], shard_count=4, align=4)
    assert [s.offset for s in layout.slots] == [0, 4, 16]
    assert layout.padded_numel % (4 * 4) == 0 and layout.padded_numel >= 23
    assert layout.numel == 3 + 10 + 7
    assert layout.shard_numel * 4 == layout.padded_numel


def test_fragments_cover_every_element_exactly_once():
    shapes = [(1,), (3,), (5,), (0,), (4, 0), (17,)]
    layout = build_layout([f"p{i}" for i in range(len(shapes))], shapes, shard_count=4, align=2)
    covered = {s.name: [0] * s.numel for s in layout.slots}
    for rank in range(4):
        for frag in layout.fragments(rank):
            assert 0 <= frag.shard_offset and frag.shard_offset + frag.numel <= layout.shard_numel
            for k in range(frag.numel):
                covered[frag.slot.name][frag.param_offset + k] += 1
    assert all(c == [1] * len(c) for c in covered.values())


def test_zero_element_parameters_take_no_space():
    layout = build_layout(["a", "empty", "b"], [(8,), (0,), (24,)], shard_count=2, align=4)
    assert [(s.offset, s.numel) for s in layout.slots] == [(0, 8), (8, 0), (8, 24)]
    assert all(f.numel == 0 for r in range(2) for f in layout.fragments(r) if f.slot.name == "empty")


def test_all_empty_layout_has_no_buffer():
    layout = build_layout(["w"], [(0, 4)], shard_count=4)
    assert layout.padded_numel == 0 and layout.shard_numel == 0


def test_fewer_elements_than_shards_leaves_empty_fragments():
    layout = build_layout(["tiny"], [(3,)], shard_count=4, align=1)
    sizes = [layout.fragments(r)[0].numel for r in range(4)]
    assert sizes == [1, 1, 1, 0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(shard_count=0), r"shard_count\(0\)"),
    (dict(shard_count=2, align=0), r"align\(0\)"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_layout(["a"], [(4,)], **kwargs)


def test_bad_shard_index_raises_value_error():
    layout = build_layout(["a"], [(4,)], shard_count=2)
    with pytest.raises(ValueError, match=r"shard_index\(2\)"):
        layout.fragments(2)
