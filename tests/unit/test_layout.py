"""Pure layout math: offsets, alignment, padding and fragments (no processes)."""

import pytest

import math
import random

from shardfusion._runtime.layout import _fit, build_layout, fragment_shape, row_groups, row_numel


def test_offsets_aligned_and_padded_to_shard_multiple():
    layout = build_layout(["a", "b", "c"], [(3,), (2, 5), (7,)], shard_count=4, align=4)
    # S = 8 would cut b's 2 rows of 5 (8 - 4 = 4 elements into it); at S = 12 b starts on the boundary 12, and c
    # fills the gap before it
    assert [s.offset for s in layout.slots] == [0, 12, 4]
    assert layout.padded_numel == 48 and layout.shard_numel == 12
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


def _check_row_aligned(layout, align):
    """The invariants of [Note: row-aligned shards]: aligned, contiguous, in order, no overlap, every boundary inside a
    parameter between two of its rows, every fragment whole rows of the parameter's trailing shape."""
    S, end = layout.shard_numel, 0
    assert S % align == 0 and layout.padded_numel == S * layout.shard_count
    for slot in sorted(layout.slots, key=lambda s: s.offset):
        if slot.numel == 0:
            continue
        assert slot.offset % align == 0 and slot.offset >= end and slot.end <= layout.padded_numel
        end = slot.end
        row = row_numel(slot.shape)
        for b in range(S, layout.padded_numel, S):
            if slot.offset < b < slot.end:
                assert (b - slot.offset) % row == 0, (slot, b)
    for r in range(layout.shard_count):
        for frag in layout.fragments(r):
            shape = fragment_shape(frag.slot.shape, frag.numel)
            assert math.prod(shape) == frag.numel and frag.param_offset % max(row_numel(frag.slot.shape), 1) == 0
            if frag.slot.shape:
                assert len(shape) == len(frag.slot.shape) and shape[1:] == frag.slot.shape[1:]
            else:  # 0-d: 1-D, see fragment_shape
                assert shape == (frag.numel,)


def _packed_end(shapes, align):
    """The end of the parameters laid out with alignment only (the layout before row-aligned shards)."""
    end = 0
    for shape in shapes:
        if math.prod(shape):
            end = -(-end // align) * align + math.prod(shape)
    return end


def test_random_layouts_keep_rows_whole_and_padding_bounded():
    rng = random.Random(0)
    for _ in range(300):
        shapes = []
        for _ in range(rng.randint(1, 6)):
            dims = rng.randint(0, 3)
            shapes.append(tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 16, 33]) for _ in range(dims)))
        count, align = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 4, 8])
        layout = build_layout([f"p{i}" for i in range(len(shapes))], shapes, count, align)
        _check_row_aligned(layout, align)
        packed = _packed_end(shapes, align)
        assert layout.numel == sum(math.prod(s) for s in shapes)
        if count == 1:  # nothing to cut: the plain aligned layout
            assert layout.padded_numel == -(-packed // align) * align


def test_padding_is_at_most_a_row_per_boundary_when_rows_divide_the_shard():
    # a GPT block: rows are multiples of align and of each other, so S = ceil(total / count) almost works
    d = 64
    shapes = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    for count in (2, 4, 8):
        layout = build_layout([str(i) for i in range(len(shapes))], shapes, count, align=4)
        _check_row_aligned(layout, 4)
        old = -(-_packed_end(shapes, 4) // (4 * count)) * 4 * count
        assert layout.padded_numel - old <= count * 4 * d, (count, layout.padded_numel, old)


def test_one_matrix_crossing_several_boundaries_needs_its_row_to_divide_the_shard():
    layout = build_layout(["w"], [(10, 6)], shard_count=4, align=4)  # 60 elements: S = 16 would cut rows
    assert layout.shard_numel % 6 == 0 and layout.shard_numel % 4 == 0
    assert layout.shard_numel == 24
    assert [fragment_shape((10, 6), f.numel) for r in range(4) for f in layout.fragments(r)] == [
        (4, 6), (4, 6), (2, 6), (0, 6)]


def test_a_row_larger_than_the_balanced_shard_is_not_cut():
    layout = build_layout(["wide", "b"], [(2, 100), (3,)], shard_count=8, align=4)
    _check_row_aligned(layout, 4)
    assert layout.shard_numel == 100  # one row per shard: ranks 0 and 1 hold a row each
    shapes = [fragment_shape(f.slot.shape, f.numel) for r in range(8) for f in layout.fragments(r)
              if f.slot.name == "wide"]
    assert shapes == [(1, 100), (1, 100)] + [(0, 100)] * 6
    single = build_layout(["row"], [(1, 50)], shard_count=4, align=4)
    assert single.shard_numel == 52 and [f.numel for r in range(4) for f in single.fragments(r)] == [50, 0, 0, 0]


def test_zero_dim_and_empty_parameters():
    layout = build_layout(["s", "e", "v"], [(), (0, 3), (5,)], shard_count=4, align=1)
    _check_row_aligned(layout, 1)
    frags = [[fragment_shape(f.slot.shape, f.numel) for f in layout.fragments(r)] for r in range(4)]
    assert [f[0] for f in frags].count((1,)) == 1 and [f[0] for f in frags].count((0,)) == 3
    assert all(f[1] == (0, 3) for f in frags)


def test_fragment_shape_rejects_partial_rows():
    assert fragment_shape((4, 3), 6) == (2, 3) and fragment_shape((4, 3), 0) == (0, 3) and fragment_shape((), 1) == (1,)
    for shape, numel, match in [((4, 3), 5, r"numel\(5\)"), ((), 2, r"numel\(2\)")]:
        with pytest.raises(ValueError, match=match):
            fragment_shape(shape, numel)


def test_negative_dimension_raises_value_error():
    with pytest.raises(ValueError, match=r"'w' has shape \(-1, 2\)"):
        build_layout(["w"], [(-1, 2)], shard_count=2)


def test_large_rows_go_first_when_that_pads_less():
    # a fused expert tensor (E=2, 16, 16): rows of 256. In the given order it starts at 80 and S = 336 puts the
    # boundary after its first row; placed first (b filling the gap before it) S = 320, the least for 592 elements
    shapes = [(16,), (8, 8), (2, 16, 16)]
    layout = build_layout(["a", "b", "experts"], shapes, shard_count=2, align=4)
    _check_row_aligned(layout, 4)
    assert [s.name for s in layout.slots] == ["a", "b", "experts"]  # slots keep the given order
    assert [s.offset for s in layout.slots] == [576, 0, 64] and layout.shard_numel == 320
    given_order_shard, _ = _fit([16, 64, 512], [1, 8, 256], 2, 4, _packed_end(shapes, 4))
    assert given_order_shard == 336


def test_padding_before_a_parameter_is_filled_by_later_ones():
    # S = 12: b (2 rows of 5) waits for the boundary 12; c (7 elements) fits whole in the gap [4, 12)
    layout = build_layout(["a", "b", "c"], [(3,), (2, 5), (7,)], shard_count=4, align=4)
    assert [(s.offset, s.end) for s in layout.slots] == [(0, 3), (12, 22), (4, 11)]


LLAMA_LAYER = [(64,), (64, 64), (16, 64), (16, 64), (64, 64), (64,), (172, 64), (172, 64), (64, 172)]


def test_row_groups_split_unrelated_rows_that_span_several_shards():
    # rows 64 and 172 (lcm 2752): one buffer over 32 shards would need S to be a multiple of 2752
    one = build_layout([str(i) for i in range(len(LLAMA_LAYER))], LLAMA_LAYER, 32, 4)
    groups = row_groups(LLAMA_LAYER, 32, 4)
    assert groups == [[0, 1, 2, 3, 4, 5, 6, 7], [8]]  # the norms go with the larger class
    padded = 0
    for g in groups:
        layout = build_layout([str(i) for i in g], [LLAMA_LAYER[i] for i in g], 32, 4)
        _check_row_aligned(layout, 4)
        rows = max(row_numel(LLAMA_LAYER[i]) for i in g)
        assert layout.padded_numel - layout.numel <= 2 * 32 * rows
        padded += layout.padded_numel
    assert padded < one.padded_numel
    assert row_groups(LLAMA_LAYER, 2, 4) == [list(range(len(LLAMA_LAYER)))]  # 2 shards: one buffer pads little


def test_row_groups_keep_rows_that_divide_each_other_together():
    d = 32  # a GPT block: rows d and 4 d, one class whatever the degree
    block = [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    for count in (1, 2, 4, 8, 16, 64):
        assert row_groups(block, count, 4) == [list(range(len(block)))]
    assert row_groups([], 4, 4) == [[]] and row_groups([(3, 5)], 4, 4) == [[0]]
