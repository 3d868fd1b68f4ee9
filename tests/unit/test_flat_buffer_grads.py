"""FlatBuffer's fragment gradients, one process, a buffer kept whole (no group): each fragment's ``.grad`` is a view
of ``grad_shard`` at its place, also after user code moved a ``.grad``'s data elsewhere (the views are reused across
steps, so a moved one must be noticed and made again)."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardfusion._runtime.flat_buffer import FlatBuffer
from shardfusion._runtime.layout import build_layout


def _buffer() -> FlatBuffer:
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    layout = build_layout(["w", "b"], [p.shape for p in params], shard_count=1)
    buf = FlatBuffer(layout, params, device=torch.device("cpu"), shard_index=0, shard_group=None, reduce_group=None,
                     replicate_group=None, grad_divisor=1, data_parallel_group=None, is_expert=False, is_primary=True)
    buf.fill_from_params(params)
    return buf


def _at_its_place(buf: FlatBuffer, i: int, t: torch.Tensor) -> bool:
    off, n = buf._frag_ranges[i]
    return t.data_ptr() == buf.grad_shard[off:].data_ptr() and t.numel() == n


def test_fragment_grads_view_grad_shard_and_a_moved_one_is_made_again():
    buf = _buffer()
    buf._step_grad_buffer()  # creates grad_shard and attaches the fragments' .grad
    first = [f.grad for f in buf.fragments]
    assert all(_at_its_place(buf, i, g) for i, g in enumerate(first))
    buf._attach_fragment_grads()
    assert [f.grad for f in buf.fragments] == first  # reused, not made again
    moved = buf.fragments[0].grad
    moved.data = torch.full((3, 4), 7.0)  # user code moves the .grad's data off grad_shard
    assert _at_its_place(buf, 0, buf._grad_slice(0)), "the moved view was handed out again"
    buf._attach_fragment_grads()
    assert _at_its_place(buf, 0, buf.fragments[0].grad)
    assert torch.equal(moved, torch.full((3, 4), 7.0))  # the user's tensor is left as the user made it


def test_grad_full_padding_zeroed_and_unwritten_slices_zeroed_before_it_is_read(monkeypatch):
    """``grad_full`` is allocated uninitialized ([Note: first gradient by copy]): its padding is zeroed at once, a
    view's first gradient is copied into its slice, and the slices no gradient wrote are zeroed before the buffer is
    read whole (here: a reduce-scatter over no group, whose output is the buffer itself)."""
    from shardfusion._runtime import flat_buffer

    real_empty = torch.empty
    monkeypatch.setattr(flat_buffer.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(float("nan")) if k.get("dtype", torch.float32)
                        .is_floating_point else real_empty(*a, **k))
    params = [nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2, 3))]
    layout = build_layout(["a", "b", "c"], [p.shape for p in params], shard_count=1)
    assert flat_buffer._gaps(layout), "the layout should have padding between parameters"
    buf = FlatBuffer(layout, params, device=torch.device("cpu"), shard_index=0, shard_group=None, reduce_group=None,
                     replicate_group=None, grad_divisor=1, data_parallel_group=None, is_expert=False, is_primary=True)
    buf.ensure_grad_full()
    for start, end in flat_buffer._gaps(layout):
        assert not buf.grad_full[start:end].any(), "padding left uninitialized"
    assert buf.full_views[0].grad is None, "a view's first gradient is handed over, not added into the slice"
    buf.full_views[0].grad = torch.ones(3, 5)  # what autograd does with a first gradient
    buf.keep_grad_in_buffer(0)
    assert buf.full_views[0].grad.data_ptr() == buf.grad_views[0].data_ptr(), "the slice is the view's .grad now"
    buf.ensure_grad_full(0)  # a second gradient: autograd adds into the slice in place
    assert buf.full_views[0].grad.data_ptr() == buf.grad_views[0].data_ptr()
    buf.reduce_scatter()  # b and c got no gradient: their slices read as zeros
    s = layout.slots
    assert torch.equal(buf.grad_full[s[0].offset:s[0].end], torch.ones(15))
    assert not buf.grad_full[s[1].offset:].nan_to_num(1.0).any(), "b and c (and the padding) must be zeros"
