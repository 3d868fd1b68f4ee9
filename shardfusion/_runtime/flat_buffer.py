"""One flat buffer of a unit: its tensors, their lifetimes, and the collectives that move them.

[Note: flat buffer tensors]
A unit keeps one :class:`FlatBuffer` per kind of parameter it holds (same dtype and device, trainable or frozen,
sharded or kept whole, dense or expert). ``P`` is the padded flat length (``layout.padded_numel``),
``S = P / shard_count``.

- ``shard``       # (S,)  persistent. This rank's slice of the flat buffer; the optimizer updates it in place through
                  #       the *fragments*: one ``nn.Parameter`` per original parameter, a view of ``shard`` of shape
                  #       ``(rows_on_this_rank, *shape[1:])`` (whole rows: [Note: row-aligned shards] in layout.py;
                  #       0 rows allowed; a 0-d parameter ``(1,)`` where its element is, ``(0,)`` elsewhere),
                  #       registered in the modules under the original names while sharded. In an owner layout
                  #       (``owner_layout``) that is the whole parameter on its owner rank, 0 rows elsewhere.
- ``full``        # (P,)  alive while unsharded, in ``param_dtype`` (mixed precision) or the shard's dtype. The
                  #       all-gathered buffer; its storage is resized to 0 when resharded. With ``shard_count == 1``
                  #       and no cast it *is* ``shard`` (nothing is gathered or freed). ``full_views``
                  #       are leaf ``nn.Parameter`` views of it with the original shapes, put into the modules while
                  #       unsharded; they are created once and keep pointing at the same storage.
- ``grad_full``   # (P,)  alive from the first gradient of a backward until its reduce-scatter completes (or, while
                  #       gradient sync is off, across micro-batches). In ``full``'s dtype. Allocated uninitialized;
                  #       each view's slice is written by its first gradient ([Note: first gradient by copy]), after
                  #       which the view's ``.grad`` is that slice and autograd accumulates in place.
- ``grad_acc``    # (P,)  mixed precision only, while gradient sync is off: the micro-batches' ``grad_full`` summed in
                  #       the shard's dtype (fp32), so accumulation across micro-batches never rounds to bf16.
- ``grad_shard``  # (S,)  persistent once created. The sharded gradient the optimizer reads: each fragment's ``.grad``
                  #       is a view of it. Reduce-scatter outputs (divided by the data-parallel world size) are added
                  #       into it, or into ``step_grad`` when the user kept last step's gradients (see ``add_reduced``).
- ``step_grad``   # (S,)  this step's not-yet-all-reduced sharded gradient: ``grad_shard`` itself in the common case,
                  #       a temporary when the user did not reset gradients. All-reduced over the replicate group once
                  #       per optimizer step (``sync_replicas``; issued early by ``start_sync_replicas`` when the
                  #       last backward of the step is known), then dropped. Nothing may be added to it while that
                  #       all-reduce is in flight (``sync_in_flight``).
- ``late_grad``   # (S,)  alive from the first gradient reduced into this buffer while its replicate all-reduce
                  #       is in flight (a backward after the one taken for the step's last) until the step
                  #       boundary, where it is all-reduced by itself and added (``sync_replicas``).
- ``direct_grad`` # (S,)  alive from the first *direct* gradient until the end of the next reducing backward (or the
                  #       replicate all-reduce): gradients autograd accumulated into the fragments themselves (a loss
                  #       term computed from ``model.parameters()``, e.g. an explicit L2 penalty), in the shard's
                  #       dtype. They never pass through ``grad_full``: each fragment's hooks move them here
                  #       (``stash_fragment_grad``, ``unstash_fragment_grad``, ``add_direct_grad``) and leave its
                  #       ``.grad`` as it was. Folded into ``step_grad`` divided by the replicate group's size
                  #       (``fold_direct_grad``) before the replicate all-reduce, which so averages them over the
                  #       replicas: a term identical on every replica counts once, as unsharded.

[Note: first gradient by copy]
A parameter's first gradient in a buffer's lifetime is copied into its slice of ``grad_full``; later ones are added
in place. ``grad_full`` is allocated uninitialized (only its padding is zeroed) and a full view's ``.grad`` is
``None`` until its slice holds a value, so autograd hands the new gradient over (it takes the tensor the backward
computed, no copy) and the view's post-accumulate hook copies it into the slice and makes the slice the view's
``.grad``: one pass over the gradient (read it, write the slice), as DDP's reducer copies gradients into its buckets.
Zeroing the buffer and letting autograd add into it took three (write zeros; read both, write the sum). Slices no
gradient wrote (a parameter unused on this rank) are zeroed before the buffer is read whole (``_zero_unwritten``: the
reduce-scatter, the mixed-precision accumulator). A DTensor view (tensor parallel) is the exception: its gradient
may arrive with other placements (Partial, under sequence parallel) and must be added with DTensor semantics, so a
pre-accumulate hook zeroes and attaches its slice first, as before. So does a dry run (``comm.is_fake``): autograd
never hands over a fake tensor (it clones it), which would count one gradient more than a real run holds at that
moment; zeroing and adding in place holds what the real path holds (the buffer and the one incoming gradient), so
the dry run's memory stays the real run's (``tests/distributed/test_dry_run_measured.py``). Under
``create_graph=True`` autograd leaves a new tensor in ``.grad`` (the gradient, or the out-of-place sum with the
slice) and the hook copies it back likewise. Plain views need no pre-accumulate hook at all: 100 fewer Python calls
per backward in the benchmark's GPT. Measured in docs/benchmarks.md ("The `after_backward` step against DDP's,
decomposed").

"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from shardfusion import comm
from shardfusion._runtime import compress, gather_wire, grad_wire
from shardfusion._runtime import tensor_parallel as tp
from shardfusion._runtime.replicate_sync import OverlappedSync, add_reduced
from shardfusion._runtime.layout import FlatLayout, fragment_shape, owned_shape


def _alias(base: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``base``'s storage at ``offset`` elements with ``shape``, with its own version counter.

    Unlike a view, in-place writes into ``base`` (the all-gather) do not bump this tensor's version counter, so
    tensors that autograd saved in forward stay valid when the buffer is refilled for backward.
    """
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    t = torch.empty(0, dtype=base.dtype, device=base.device)
    t.set_(base.untyped_storage(), base.storage_offset() + offset, shape, tuple(reversed(strides)))
    return t


def _gaps(layout: FlatLayout) -> list[tuple[int, int]]:
    """The ``[start, end)`` element ranges of a flat buffer of ``layout`` that no parameter covers (its padding)."""
    gaps, at = [], 0
    for s in sorted(layout.slots, key=lambda s: s.offset):
        if s.offset > at:
            gaps.append((at, s.offset))
        at = max(at, s.end)
    if layout.padded_numel > at:
        gaps.append((at, layout.padded_numel))
    return gaps


class FlatBuffer:
    """One flat buffer of a unit. See [Note: flat buffer tensors] at the top of this file.

    The shard starts as zeros (padding stays zero): the values come from :meth:`fill_from_params` (parameters
    with values, broadcast from the first data-parallel rank) or :meth:`fill_slot` (one parameter at a time, as
    meta-device initialization materializes it), before any forward.

    Args:
        layout: the pure layout (offsets, padding, shard count).
        params: the original parameters in layout order (dtype, ``requires_grad`` and attributes are read; they may
            be on the meta device).
        device: where the shard and every tensor of the note live.
        shard_index: this rank's shard index (its rank in ``shard_group``; 0 when kept whole).
        shard_group: group the buffer is sharded over (all-gather, reduce-scatter); ``None`` or size 1 = kept whole.
        reduce_group: a second group over the same ranks as ``shard_group`` for reduce-scatters, so that their
            order is independent of all-gathers (``None`` = use ``shard_group``).
        replicate_group: group holding identical shards; gradients are all-reduced over it once per step.
        grad_divisor: the number of ranks whose losses average into the step's loss (``Topology.gradient_divisor``:
            dp * sharding * sep * cp); reduced gradients are divided by it so they are the gradient of the mean loss
            over the global batch.
        data_parallel_group: the ranks that hold these parameters before sharding (``Topology.
            get_param_replica_group``: the data-parallel and context ranks; for experts, those with the same ep
            index); the values of its first rank are broadcast.
        is_expert: the buffer holds expert parameters (distinct across the ep ranks); its fragments get
            ``is_expert = True`` too (e.g. for per-expert optimizer groups).
        is_primary: this rank holds the canonical copy of this shard: it is replica 0 of the replicate group and,
            unless the parameters are tensor parallel (``tensor_model_parallel = True``, distinct across mp), mp
            rank 0. Exactly one rank is primary for each element of the model, so the gradient norm counts the
            shard's elements only there (:mod:`shardfusion.clip`) and only there are they written to a checkpoint
            (:mod:`shardfusion.checkpoint.save_load`).
        unit_name: the qualified name of the unit holding this buffer (for error messages).
        param_dtype: dtype of the full buffer, the compute and ``grad_full`` (``None``: the parameters' dtype).
        grad_comm_dtype: dtype of the reduce-scatter and the replicate all-reduce (``None``: ``full``'s dtype).
            Below fp32 the gradient is divided by ``grad_divisor`` before it is reduced (no overflow in fp16).
            ``"int8"``: the reduce-scatter sent block-quantized ([Note: quantized gradient reduce-scatter] in
            ``grad_wire.py``), the replicate all-reduce in the shard's dtype (``reduce_wire``).
        overlap_replicate: whether the replicate all-reduce may be overlapped with backward (``hand_off_sync``):
            only when ``replicate_group`` carries no other collective (see ``replicate_sync.py``); off when it has
            one rank (nothing to all-reduce).
        outer_comm_dtype: wire format of the replicate all-reduce, validated by
            ``compress.validate_outer_comm_dtype``: None (``grad_comm_dtype``), a float dtype, or ``"int8"``
            (block-wise, see ``compress.compressed_all_reduce``); the reduce-scatter keeps ``grad_comm_dtype``.
        tp_specs: per parameter, its :class:`~shardfusion._runtime.tensor_parallel.TensorParallelSpec` (a DTensor
            parameter: the layout holds its local piece, and its full view is a DTensor over that piece) or
            ``None``; default all ``None``.
        owner_layout: ``layout`` puts each parameter whole in one shard (``layout.build_owner_layout``): each
            fragment then has the parameter's shape on its owner and ``(0, *shape[1:])`` on the other ranks. In
            the other layout a fragment and its ``.grad`` have shape ``layout.fragment_shape(shape, numel)``:
            ``(rows_on_this_rank, *shape[1:])``.
        is_replica_primary: this rank holds the canonical copy of this shard within its replica (``is_primary``
            without the replicate-group condition: tensor parallel or mp rank 0); clipping counts it while
            replicate sync is off (default: ``is_primary``).
        all_gather_dtype: the wire format of the all-gather of ``full`` (``MixedPrecisionPolicy.all_gather_dtype``:
            None, ``"int8"``, bf16, fp16, fp8 e4m3; see [Note: quantized weight all-gather] in ``gather_wire.py``).
            A float format equal to ``param_dtype`` is the plain all-gather (None).

    Attributes (besides the tensors of the note): ``shard_index`` (0 for a buffer without elements), ``is_expert``,
    ``is_primary``, ``unit_name``, and, for a later ``fully_shard`` call that absorbs this one, ``originals`` (a weak
    reference to each original parameter) and ``param_attrs`` (each original parameter's ``__dict__``, copied).
    """

    def __init__(
        self,
        layout: FlatLayout,
        params: list[nn.Parameter],
        *,
        device: torch.device,
        shard_index: int,
        shard_group: Optional[ProcessGroup],
        reduce_group: Optional[ProcessGroup],
        replicate_group: Optional[ProcessGroup],
        grad_divisor: int,
        data_parallel_group: Optional[ProcessGroup],
        is_expert: bool,
        is_primary: bool,
        unit_name: str = "",
        param_dtype: Optional[torch.dtype] = None,
        grad_comm_dtype: Optional[torch.dtype] = None,
        overlap_replicate: bool = True,
        outer_comm_dtype: object = None,
        tp_specs: Optional[list] = None,
        owner_layout: bool = False,
        is_replica_primary: Optional[bool] = None,
        all_gather_dtype: object = None,
    ) -> None:
        self.layout = layout
        self.tp_specs = list(tp_specs) if tp_specs is not None else [None] * len(params)
        self.shard_group = shard_group
        self.reduce_group = reduce_group if reduce_group is not None else shard_group
        self.replicate_group = replicate_group
        self.outer_comm_dtype = outer_comm_dtype
        self.synced_grad_divisor = grad_divisor
        self.replicate_sync = True
        """Whether the step's gradient is all-reduced over ``replicate_group`` (``set_replicate_sync``)."""
        self.requires_grad = params[0].requires_grad
        self.is_expert = bool(is_expert)
        self.is_primary = bool(is_primary)
        self.is_replica_primary = bool(is_primary if is_replica_primary is None else is_replica_primary)
        self.replica_group: Optional[ProcessGroup] = None
        """The ranks of this replica (one index of the replicate group), set while replicate sync is off: clipping
        then takes the norm over them (``shardfusion.diloco``)."""
        self.replica_sync_group: Optional[ProcessGroup] = None
        """While replicate sync is off: the ranks of this replica that hold the same elements, over which the step's
        gradient is still all-reduced (a buffer kept whole: the replica's inner ranks; ``shardfusion.diloco`` sets
        it). None for a sharded buffer, whose reduce-scatter already sums over the replica's ranks."""
        self.unit_name = unit_name
        self.originals = [weakref.ref(p) for p in params]
        self.param_attrs = [dict(vars(p)) for p in params]
        dtype = params[0].dtype
        self.param_dtype = param_dtype or dtype
        self.reduce_wire = grad_wire.INT8 if grad_wire.is_quantized(grad_comm_dtype) else None
        """``"int8"``: the reduce-scatter's wire format (``grad_comm_dtype`` then is the shard's dtype, that of the
        replicate all-reduce); None: the reduce-scatter in ``grad_comm_dtype``."""
        self.grad_comm_dtype = dtype if self.reduce_wire else (grad_comm_dtype or self.param_dtype)
        self.all_gather_dtype = None if all_gather_dtype == self.param_dtype else all_gather_dtype
        P, S = layout.padded_numel, layout.shard_numel
        if P == 0:  # only zero-element parameters: nothing to communicate, on every rank alike
            self.shard_group = self.reduce_group = self.replicate_group = None
            data_parallel_group = None
        self._overlap_replicate = bool(overlap_replicate) and comm.group_size(self.replicate_group) > 1
        self.data_parallel_group = data_parallel_group
        self.shard_index = shard_index if P else 0
        self.shard = torch.zeros(S, dtype=dtype, device=device)  # (S,) filled by fill_from_params / fill_slot

        self.fragments: list[nn.Parameter] = []
        self._frag_ranges: list[tuple[int, int]] = []  # (offset in shard, numel) per fragment
        self._frag_param_offsets: list[int] = []  # start of each fragment in its flattened parameter
        self.owner_layout = bool(owner_layout)
        self._frag_shapes: list[tuple[int, ...]] = []  # layout.fragment_shape, in an owner layout owned_shape
        for frag in layout.fragments(shard_index):
            self._frag_ranges.append((frag.shard_offset, frag.numel))
            self._frag_param_offsets.append(frag.param_offset)
            shape = (owned_shape if self.owner_layout else fragment_shape)(frag.slot.shape, frag.numel)
            self._frag_shapes.append(shape)
            view = self.shard[frag.shard_offset:frag.shard_offset + frag.numel].view(shape)
            self.fragments.append(nn.Parameter(view, requires_grad=self.requires_grad))
            if self.is_expert:
                self.fragments[-1].is_expert = True

        if (layout.shard_count == 1 or P == 0) and self.param_dtype == dtype:
            self.full = self.shard
        else:
            self.full = torch.empty(P, dtype=self.param_dtype, device=device)  # (P,)
        self.full_views: list[nn.Parameter] = [
            tp.as_param(_alias(self.full, s.offset, s.shape), spec, self.requires_grad)
            for s, spec in zip(layout.slots, self.tp_specs)
        ]
        if self.full is not self.shard:  # freed after the views exist: making a view would grow it back
            self.full.untyped_storage().resize_(0)
        self._gather_work = None
        self._gather_input: Optional[torch.Tensor] = None  # (S,) the shard cast to param_dtype, while gathering
        self._gather_wire: Optional[torch.Tensor] = None  # the gathered shards in all_gather_dtype, until the wait
        self.secondary = None  # a SecondaryShard with fully_shard(secondary_shard=True): [Note: secondary shard]
        self.is_unsharded = self.full is self.shard

        self.grad_full: Optional[torch.Tensor] = None
        self.grad_views: list[torch.Tensor] = []
        self._grad_written: list[bool] = []  # per view: its slice of grad_full holds a gradient
        self._grad_gaps = _gaps(layout)  # the padding of grad_full, zeroed at each allocation
        self.grad_acc: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        self.step_grad: Optional[torch.Tensor] = None
        self._reduce_out: Optional[torch.Tensor] = None
        self._reduce_in: Optional[torch.Tensor] = None
        self._sync_work = None  # the replicate all-reduce in flight, its buffer, and whether it was issued
        self._sync_buf: Optional[torch.Tensor] = None
        self._sync_started = False
        self._overlapped: Optional[OverlappedSync] = None  # the overlapped all-reduce handed to a worker
        self._reduce_work = None
        self.direct_grad: Optional[torch.Tensor] = None
        self.late_grad: Optional[torch.Tensor] = None
        self._stashed_grads: dict[int, Optional[torch.Tensor]] = {}  # fragment index -> its .grad before autograd
        self._grad_slices: tuple = (None, [], [])  # (grad_shard, its views, their data_ptr): _grad_slice

    # ---- replicas that step alone (DiLoCo's inner steps, shardfusion.diloco) --------------------------------------
    def set_replicate_sync(self, on: bool) -> None:
        """Whether this buffer's gradient is all-reduced over its replicate group each step (True, the default) or
        stays this replica's own (False: no collective on ``replicate_group``, only on ``replica_sync_group`` if
        set; the gradient is the mean over this replica's ranks only, see ``grad_divisor``). Switch only
        between steps (no gradient pending). The layout, ``replicate_group`` and ``is_primary`` stay as they are:
        the shard is still described as replicated (checkpoints, state dicts)."""
        if self.step_grad is not None or self._sync_started or self._reduce_out is not None:
            raise RuntimeError(f"set_replicate_sync on {self._collective('buffer')} with a gradient pending: switch "
                               f"between steps only")
        self.replicate_sync = bool(on)

    @property
    def sync_group(self) -> Optional[ProcessGroup]:
        """The group the step's gradient is all-reduced over: ``replicate_group``, or while replicate sync is off
        ``replica_sync_group`` (None: no collective)."""
        return self.replicate_group if self.replicate_sync else self.replica_sync_group

    @property
    def grad_divisor(self) -> int:
        """What the reduced gradient is divided by: the ranks whose losses average into it (all data-parallel
        ranks; this replica's while replicate sync is off: those of ``replicate_group`` in ``replica_sync_group``)."""
        if self.replicate_sync:
            return self.synced_grad_divisor
        return (self.synced_grad_divisor // comm.group_size(self.replicate_group)
                * comm.group_size(self.replica_sync_group))

    @property
    def overlap_replicate(self) -> bool:
        """Whether the replicate all-reduce may be handed off to overlap with backward (see replicate_sync.py)."""
        return self._overlap_replicate and self.replicate_sync

    # ---- initial values ----------------------------------------------------------------------------------------
    def fill_from_params(self, params: list[Optional[torch.Tensor]]) -> None:
        """Copy this rank's slice of each given parameter (``None``: leave its slot as it is) into the shard, with
        the values of the first rank of ``data_parallel_group`` (one broadcast of a temporary ``(P,)`` buffer), so
        every replica starts from the same weights (docs/field-cases.md, F7). Collective over that group when any
        rank of it passes a parameter; every rank must pass ``None`` for the same slots."""
        P = self.layout.padded_numel
        if P == 0 or all(p is None for p in params):
            return
        with torch.no_grad():
            flat = torch.zeros(P, dtype=self.shard.dtype, device=self.shard.device)  # (P,)
            for slot, p in zip(self.layout.slots, params):
                if p is not None:
                    flat[slot.offset:slot.end].copy_(p.detach().reshape(-1))
            comm.broadcast(flat, self.data_parallel_group)
            S = self.layout.shard_numel
            mine = flat[self.shard_index * S:(self.shard_index + 1) * S]
            for (off, n), p in zip(self._frag_ranges, params):
                if p is not None and n:
                    self.shard[off:off + n].copy_(mine[off:off + n])
        del flat

    def fill_slot(self, index: int, value: torch.Tensor) -> None:
        """Copy this rank's fragment of parameter ``index`` (``layout.slots[index]``) out of ``value``, its full
        tensor (any shape with the slot's number of elements, any device and float dtype; converted). Local: the
        caller makes ``value`` equal on every replica."""
        off, n = self._frag_ranges[index]
        if n:
            start = self._frag_param_offsets[index]
            with torch.no_grad():
                self.shard[off:off + n].copy_(value.detach().reshape(-1)[start:start + n])

    def _collective(self, op: str) -> str:
        """``op`` and whose buffer it moves, for error messages: ``"all_gather of unit 'blocks.1' (...)"``."""
        slots = self.layout.slots
        shown = ", ".join(s.name for s in slots[:3]) + (f", ... ({len(slots)} parameters)" if len(slots) > 3 else "")
        return f"{op} of unit {self.unit_name!r} ({shown})"

    # ---- unshard / reshard -------------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False, keep_secondary: bool = False) -> None:
        """Start (``async_op``) or complete the all-gather of ``full`` over ``shard_group`` (in backward, with a
        secondary copy held, over the node slice: [Note: secondary shard] in ``secondary_shard.py``; a forward's
        gather with ``keep_secondary`` may leave one). Idempotent."""
        if self.is_unsharded or self._gather_work is not None:
            if not async_op:
                self.wait_unshard()
            return
        self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
        from_copy = self.secondary is not None and self.secondary.begin_gather(keep_secondary)  # reads grad mode
        with torch.no_grad():
            send, out, n = self.shard, self.full, comm.group_size(self.shard_group)
            if from_copy:
                self._gather_work, self._gather_wire = self.secondary.all_gather(self.full)
            else:
                if self.all_gather_dtype is not None and n > 1:  # [Note: quantized weight all-gather]
                    send = self._gather_input = gather_wire.quantize(self.shard, self.all_gather_dtype)
                    out = self._gather_wire = gather_wire.gather_buffer(self.shard.numel(), n,
                                                                        self.all_gather_dtype, self.shard.device)
                elif self.shard.dtype != self.full.dtype and n > 1:
                    send = self._gather_input = self.shard.to(self.full.dtype)  # (S,) kept alive until the wait
                self._gather_work = comm.all_gather(out, send, self.shard_group, async_op=True)
        if self._gather_work is None:  # a group of one: nothing was issued
            self._finish_gather()
        elif not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Wait for an in-flight all-gather, if any."""
        if self._gather_work is not None:
            comm.wait(self._gather_work, self._collective("all_gather"))
            self._gather_work = None
            self._finish_gather()

    def _finish_gather(self) -> None:
        """The all-gather arrived: dequantize a wire format into ``full``; the buffer is unsharded."""
        self._gather_input = None
        if self.secondary is not None:
            self.secondary.gathered(self._gather_wire)
        if self._gather_wire is not None:
            with torch.no_grad():
                gather_wire.dequantize_into(self._gather_wire, self.full, comm.group_size(self.shard_group),
                                            self.all_gather_dtype)
            self._gather_wire = None
        self.is_unsharded = True

    def reshard(self, keep_secondary: bool = False) -> None:
        """Free ``full`` (waiting for an in-flight all-gather first). A kept-whole group stays as it is. With
        ``keep_secondary`` (a unit's reshard after its forward) the secondary copy, if armed, stays for the
        backward; otherwise it is freed."""
        self.wait_unshard()
        if self.secondary is not None:
            self.secondary.resharded(self.full if self.is_unsharded else None, keep_secondary)
        if self.full is self.shard or not self.is_unsharded:
            return
        self.full.untyped_storage().resize_(0)
        self.is_unsharded = False

    @property
    def gather_in_flight(self) -> bool:
        """Whether an asynchronous all-gather has been issued and not yet waited for."""
        return self._gather_work is not None

    def gather_copy(self) -> torch.Tensor:
        """The whole flat buffer as a new ``(P,)`` tensor in the shard's dtype, apart from ``full`` (an all-gather over
        ``shard_group``: collective). Parameter ``i`` is ``[slot.offset:slot.end]`` of ``layout.slots[i]``."""
        out = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.shard.device)  # (P,)
        comm.all_gather(out, self.shard, self.shard_group, what=self._collective("all_gather"))
        return out

    # ---- gradients ---------------------------------------------------------------------------------------------
    def ensure_grad_full(self, view_index: Optional[int] = None) -> None:
        """Allocate ``grad_full`` if it is not alive (uninitialized but for its padding, which is zeroed); the views'
        ``.grad`` stay as they are, so autograd hands a first gradient over and :meth:`keep_grad_in_buffer` copies
        it in ([Note: first gradient by copy]).

        With ``view_index`` (the pre-accumulate hook of a view autograd must add into: a DTensor view, any view in a
        dry run): zero that view's slice if no gradient wrote it yet, and make the slice its ``.grad``.
        """
        if self.grad_full is None:
            P = self.layout.padded_numel
            self.grad_full = torch.empty(P, dtype=self.full.dtype, device=self.full.device)  # (P,) full's dtype
            for start, end in self._grad_gaps:
                self.grad_full[start:end].zero_()
            self.grad_views = [_alias(self.grad_full, s.offset, s.shape) for s in self.layout.slots]
            self._grad_written = [False] * len(self.grad_views)
        if view_index is None:
            return
        if not self._grad_written[view_index]:
            self.grad_views[view_index].zero_()
            self._grad_written[view_index] = True
        if not tp.same_storage(self.full_views[view_index].grad, self.grad_views[view_index]):
            self._attach_view_grad(view_index)

    def _attach_view_grad(self, i: int) -> None:
        """Make full view ``i``'s ``.grad`` its slice of ``grad_full`` (a DTensor over it for a DTensor view)."""
        spec, g = self.tp_specs[i], self.grad_views[i]
        self.full_views[i].grad = g if spec is None else tp.as_dtensor(g, spec)

    def keep_grad_in_buffer(self, view_index: int) -> None:
        """After autograd accumulated into a full view without adding into its slice of ``grad_full`` (not
        :meth:`grad_in_place`: the view's first gradient, handed over by autograd; or, in a backward with
        ``create_graph=True``, the sum autograd made out of place): copy the value into the slice and make the slice
        the view's ``.grad``."""
        grad, alias = self.full_views[view_index].grad, self.grad_views[view_index]
        if grad is None:
            return
        with torch.no_grad():
            if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): added into zeros
                alias.zero_().add_(grad)
            else:
                alias.copy_(tp.local(grad))
        self._attach_view_grad(view_index)
        self._grad_written[view_index] = True

    def grad_in_place(self, view_index: int) -> bool:
        """Whether full view ``view_index``'s ``.grad`` is its slice of the live ``grad_full`` (autograd added into
        it in place)."""
        grad = self.full_views[view_index].grad
        return (grad is not None and self.grad_full is not None and grad.layout == torch.strided
                and tp.same_storage(grad, self.grad_views[view_index]))

    def _zero_unwritten(self) -> None:
        """Zero the slices of ``grad_full`` that no gradient wrote (views that got none): before anything reads it
        whole."""
        for i, written in enumerate(self._grad_written):
            if not written:
                self.grad_views[i].zero_()
                self._grad_written[i] = True

    def hold_grads(self) -> None:
        """End of a backward with gradient sync off: keep this backward's gradient for the next one. Under mixed
        precision it is added into the fp32 ``grad_acc`` and ``grad_full`` starts again from zero."""
        if self.grad_full is None or self.full.dtype == self.shard.dtype:
            return  # grad_full itself keeps accumulating
        with torch.no_grad():
            if self.grad_acc is None:
                self.grad_acc = torch.zeros(self.layout.padded_numel, dtype=self.shard.dtype,
                                            device=self.shard.device)  # (P,) fp32
            self._zero_unwritten()
            self.grad_acc.add_(self.grad_full)
            self.grad_full.zero_()  # every slice written (zeros): the next gradients add in place

    def reduce_scatter(self) -> None:
        """Issue the asynchronous reduce-scatter of ``grad_full`` (zeros if no gradient arrived on this rank), plus
        ``grad_acc`` if held, in ``grad_comm_dtype`` (or block-quantized: ``reduce_wire``)."""
        self.ensure_grad_full()
        self._zero_unwritten()
        comm_dtype = self.grad_comm_dtype
        with torch.no_grad():
            grad = self.grad_full
            if self.grad_acc is not None:
                grad, self.grad_acc = self.grad_acc.add_(grad), None
            if self._predivide:  # in the wider dtype, before the cast (grad_full / grad_acc are dropped anyway)
                grad.div_(self.grad_divisor)
            if self.reduce_wire is not None and comm.group_size(self.reduce_group) > 1:  # the sum comes in fp32
                self._reduce_out = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=grad.device)
                self._reduce_work = grad_wire.reduce_scatter(self._reduce_out, grad, self.reduce_group)
                return  # [Note: quantized gradient reduce-scatter] in grad_wire.py
            if grad.dtype != comm_dtype:
                grad = grad.to(comm_dtype)  # (P,)
            if comm.group_size(self.reduce_group) == 1:  # S == P: the gradient is its own shard, nothing to copy
                self._reduce_in, self._reduce_out, self._reduce_work = None, grad, None
                return
            self._reduce_in = grad  # alive until the reduce-scatter completes
            self._reduce_out = torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=self.full.device)
            self._reduce_work = comm.reduce_scatter(self._reduce_out, grad, self.reduce_group, async_op=True)

    @property
    def _predivide(self) -> bool:
        """Divide before communicating when the communication dtype is narrower than fp32 (fp16 could overflow)."""
        return self.grad_comm_dtype.is_floating_point and torch.finfo(self.grad_comm_dtype).bits < 32

    def reduce_done(self) -> bool:
        """Whether the issued reduce-scatter has completed (non-blocking)."""
        return self._reduce_work is None or self._reduce_work.is_completed()

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter, add its output / grad_divisor into this step's gradient, free grad_full."""
        if self._reduce_out is None:
            return
        if self._reduce_work is not None:
            comm.wait(self._reduce_work, self._collective("reduce_scatter"))
            self._reduce_work = None
        out, self._reduce_out, self._reduce_in = self._reduce_out, None, None
        with torch.no_grad():
            target, fresh = self._step_grad_buffer(fresh_ok=True)
            add_reduced(target, out, self.grad_divisor, self._predivide, fresh)
        for view in self.full_views:
            view.grad = None
        self.grad_full, self.grad_views = None, []

    def _step_grad_buffer(self, fresh_ok: bool = False) -> tuple[torch.Tensor, bool]:
        """This step's accumulator and whether it is fresh: ``grad_shard`` if the user reset gradients, else a
        temporary; while this step's all-reduce is in flight, ``late_grad``. A newly taken accumulator is zeroed,
        or with ``fresh_ok`` left as it is and returned with ``fresh`` True: the caller overwrites it at once (the
        first reduce-scatter output of a step, ``add_reduced``), so that the zero-fill is not a pass of its own."""
        self.discard_if_reset()
        if self._sync_started:
            return self._late_buffer(), False
        if self.step_grad is not None:
            return self.step_grad, False
        new = torch.empty_like if fresh_ok else torch.zeros_like
        user_grads = [f.grad for f in self.fragments if f.grad is not None]
        # tensors the user assigned: kept, and added to (sync_replicas); none after zero_grad(set_to_none=True)
        foreign = self._foreign_grads() if user_grads or self._stashed_grads else []
        created = self.grad_shard is None
        if created:
            self.grad_shard = (torch.zeros_like if foreign else new)(self.shard)  # (S,)
        if not foreign and (created or not user_grads or not self.grad_shard.any()):
            if not fresh_ok:
                self.grad_shard.zero_()
            self._attach_fragment_grads()
            self.step_grad = self.grad_shard
        else:
            self.step_grad = new(self.shard)  # (S,)
        return self.step_grad, fresh_ok

    def _late_buffer(self) -> torch.Tensor:
        if self.late_grad is None:
            self.late_grad = torch.zeros_like(self.shard)  # (S,)
        return self.late_grad

    def _grad_slice(self, i: int) -> torch.Tensor:
        """Fragment ``i``'s view of ``grad_shard``, the fragment's shape; the views are made once per ``grad_shard``
        tensor (it is kept across steps) and reused, and one is made again if user code moved it off its place
        (``p.grad.data = t`` or ``p.grad.set_(...)`` on the fragment's ``.grad``, which is this view)."""
        base, slices, places = self._grad_slices
        if base is not self.grad_shard:
            slices = [self._make_grad_slice(k) for k in range(len(self.fragments))]
            places = [t.data_ptr() for t in slices]
            self._grad_slices = (self.grad_shard, slices, places)
        t = slices[i]
        if t.data_ptr() != places[i] or t.shape != self._frag_shapes[i]:
            t = slices[i] = self._make_grad_slice(i)
        return t

    def _make_grad_slice(self, i: int) -> torch.Tensor:
        off, n = self._frag_ranges[i]
        return self.grad_shard[off:off + n].view(self._frag_shapes[i])

    def _attach_fragment_grads(self, skip: frozenset | set = frozenset()) -> None:
        """Make each fragment's ``.grad`` a view of ``grad_shard`` (re-attached after ``zero_grad(set_to_none)``),
        except those in ``skip``."""
        for i, frag in enumerate(self.fragments):
            if not frag.requires_grad or i in skip:  # frozen after wrapping: no gradient, like plain PyTorch
                continue
            g = self._grad_slice(i)
            if frag.grad is None or frag.grad.data_ptr() != g.data_ptr() or frag.grad.numel() != g.numel():
                frag.grad = g

    def _foreign_grads(self) -> list[int]:
        """Indices of trainable fragments whose ``.grad`` is a tensor of the user's (``p.grad = t``), not their view
        of ``grad_shard``: plain PyTorch adds the next gradient to it, so its value is kept."""
        out = []
        for i, frag in enumerate(self.fragments):
            grad = self._stashed_grads.get(i, frag.grad)
            if grad is None or not frag.requires_grad:
                continue
            if self.grad_shard is None:
                out.append(i)
                continue
            g = self._grad_slice(i)
            piece = tp.local(grad)
            if piece.data_ptr() != g.data_ptr() or piece.numel() != g.numel():
                out.append(i)
        return out

    def _user_cleared(self) -> list[int]:
        """Indices of trainable fragments whose ``.grad`` the user set to ``None`` (e.g. ``zero_grad()``)."""
        grads = [self._stashed_grads.get(i, f.grad) for i, f in enumerate(self.fragments)]  # as the user left them
        return [i for i, (f, g) in enumerate(zip(self.fragments, grads)) if f.requires_grad and g is None]

    def discard_if_reset(self) -> bool:
        """If this step's gradient is pending in ``grad_shard`` but the user has since set every fragment's ``.grad``
        to ``None`` (``optimizer.zero_grad()`` without a step), drop it, waiting for its all-reduce if one is in
        flight, as plain PyTorch would. Returns whether it dropped one."""
        if self.step_grad is None or self.step_grad is not self.grad_shard:
            return False
        trainable = sum(1 for f in self.fragments if f.requires_grad)
        if len(self._user_cleared()) != trainable:
            return False
        self._wait_overlapped()
        if self._sync_work is not None:
            comm.wait(self._sync_work, self._collective("all_reduce"))  # issued on every rank earlier: it completes
        self._sync_work, self._sync_buf, self._sync_started = None, None, False
        with torch.no_grad():
            self.grad_shard.zero_()
        self.step_grad = self.direct_grad = self.late_grad = None
        return True

    # ---- direct gradients (autograd reached a fragment itself) ----------------------------------------------------
    def stash_fragment_grad(self, i: int) -> None:
        """Before autograd accumulates into fragment ``i``: set its ``.grad`` aside and to ``None``, so that what
        autograd leaves there is exactly the new direct gradient."""
        frag = self.fragments[i]
        self._stashed_grads[i] = frag.grad
        frag.grad = None

    def unstash_fragment_grad(self, i: int) -> Optional[torch.Tensor]:
        """After autograd accumulated into fragment ``i``: put back the ``.grad`` it had before; returns what autograd
        left there (the direct gradient, the fragment's shape)."""
        frag = self.fragments[i]
        grad, frag.grad = frag.grad, self._stashed_grads.pop(i, None)
        return grad

    def add_direct_grad(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """Add a direct gradient of fragment ``i`` (the fragment's shape, or ``None``: nothing) into ``direct_grad``."""
        if grad is None:
            return
        off, n = self._frag_ranges[i]
        with torch.no_grad():
            if self.direct_grad is None:
                self.direct_grad = torch.zeros_like(self.shard)  # (S,) the shard's dtype
            self.direct_grad[off:off + n].add_(grad.detach().reshape(-1))

    def fold_direct_grad(self) -> None:
        """Add ``direct_grad`` / (replicate group size) into this step's gradient, if both exist (called at the end of
        each reducing backward and before the all-reduce); into ``late_grad`` once the all-reduce is in flight."""
        if self.direct_grad is None or self.step_grad is None:
            return
        with torch.no_grad():
            target = self._late_buffer() if self._sync_started else self.step_grad
            target.add_(self.direct_grad, alpha=1.0 / comm.group_size(self.sync_group))
        self.direct_grad = None

    def restore_fragment_grads(self) -> None:
        """End of backward: put back any ``.grad`` set aside whose accumulation did not happen (``autograd.grad``
        computes a fragment's gradient without accumulating it)."""
        for i in list(self._stashed_grads):
            self.fragments[i].grad = self._stashed_grads.pop(i)

    @property
    def has_pending_sync(self) -> bool:
        """Whether this step's sharded gradient still has to be all-reduced over the replicate group."""
        return self.step_grad is not None

    @property
    def sync_in_flight(self) -> bool:
        """Whether this step's replicate all-reduce has been issued and not yet waited for."""
        return self._sync_started

    def start_sync_replicas(self) -> None:
        """Issue this step's replicate all-reduce asynchronously (no-op if nothing is pending or it was issued)."""
        if self.step_grad is None or self._sync_started:
            return
        self.fold_direct_grad()  # averaged over the replicas by the all-reduce below
        if self._compressed:  # blocking (a sequence of collectives)
            self._sync_buf = self.all_reduce_replicas(self.step_grad)
        else:
            self._sync_buf = self._replicate_comm_buffer(self.step_grad)
            self._sync_work = comm.all_reduce(self._sync_buf, self.sync_group, async_op=True)
        self._sync_started = True

    @property
    def _compressed(self) -> bool:  # the outer wire format is the replicate all-reduce's, never a replica's own
        return self.replicate_sync and self.outer_comm_dtype is not None and comm.group_size(self.sync_group) > 1

    def _replicate_comm_buffer(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` ((S,), the shard's dtype) itself, or a copy in the communication dtype."""
        if grad.dtype == self.grad_comm_dtype or comm.group_size(self.sync_group) == 1:
            return grad
        with torch.no_grad():
            return grad.to(self.grad_comm_dtype)  # (S,)

    def start_all_reduce_replicas(self, grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Issue the all-reduce of ``grad`` ((S,), the shard's dtype) over the replicate group: ``(result, work)``,
        ``work`` None when nothing is left to wait for (a compressed all-reduce runs to its end here)."""
        if self._compressed:
            return self.all_reduce_replicas(grad), None
        buf = self._replicate_comm_buffer(grad)
        return buf, comm.all_reduce(buf, self.sync_group, async_op=True)

    def all_reduce_replicas(self, grad: torch.Tensor) -> torch.Tensor:
        """All-reduce ``grad`` ((S,), the shard's dtype) over the replicate group and wait; returns the result
        (``grad`` itself, or a copy in the communication dtype). With ``outer_comm_dtype``: in place, sent in that
        format (``compress.compressed_all_reduce``)."""
        if self._compressed:
            compress.compressed_all_reduce(grad, self.sync_group, self.outer_comm_dtype)
            return grad
        buf = self._replicate_comm_buffer(grad)
        work = comm.all_reduce(buf, self.sync_group, async_op=True)
        if work is not None:
            comm.wait(work, self._collective("all_reduce"))
        return buf

    # ---- the replicate all-reduce overlapped with backward (see replicate_sync.py) ------------------------------
    def hand_off_sync(self) -> Optional[OverlappedSync]:
        """Take this step's replicate all-reduce out of the buffer, right after its reduce-scatter was issued (or
        completed): this step's accumulator is chosen and the direct gradients folded into it here, on the calling
        thread; the returned :class:`OverlappedSync` finishes the reduce-scatter and runs the all-reduce (on a
        worker thread for CPU tensors). From here on the buffer counts as in flight (later gradients go to
        ``late_grad``); ``grad_full`` is released (its storage lives on as the reduce-scatter's input until that
        completes). None if nothing is pending or the all-reduce was already issued."""
        if self._sync_started or (self._reduce_out is None and self.step_grad is None):
            return None
        # fresh only with a reduce-scatter output to write and no direct gradient to add first
        target, fresh = self._step_grad_buffer(fresh_ok=self._reduce_out is not None and self.direct_grad is None)
        self.fold_direct_grad()
        job = OverlappedSync(self, target, self._reduce_work, self._reduce_out, fresh)
        self._reduce_work = self._reduce_out = self._reduce_in = None
        for view in self.full_views:
            view.grad = None
        self.grad_full, self.grad_views = None, []
        self._overlapped, self._sync_started = job, True
        return job

    def _wait_overlapped(self) -> None:
        """Wait for the handed-off all-reduce (if any) and take back its result as ``_sync_buf``."""
        job, self._overlapped = self._overlapped, None
        if job is not None:
            self._sync_buf = job.result()

    def sync_replicas(self) -> None:
        """All-reduce this step's sharded gradient over the replicate group (waiting for it if already issued) and
        publish it in ``grad_shard``."""
        if self.step_grad is None:
            return
        self._wait_overlapped()
        self.start_sync_replicas()
        if self._sync_work is not None:
            comm.wait(self._sync_work, self._collective("all_reduce"))
        # In grad_shard itself, a gradient the user set to None since the backward stays None for the optimizer
        # (plain PyTorch); into a temporary step_grad, None means "start from zero" and the sum is attached.
        dropped = set(self._user_cleared()) if self.step_grad is self.grad_shard else set()
        with torch.no_grad():
            if self._sync_buf is not self.step_grad:
                self.step_grad.copy_(self._sync_buf)
            # a tensor the user assigned (into grad_shard, when this step's gradient is in a temporary): what this
            # step's gradient is added to, as plain PyTorch adds to it
            foreign = set(self._foreign_grads()) if self.step_grad is not self.grad_shard else set()
            for i, frag in enumerate(self.fragments):
                if frag.grad is None:
                    self._grad_slice(i).zero_()
                elif i in foreign:
                    self._grad_slice(i).copy_(tp.local(frag.grad))
            if self.step_grad is not self.grad_shard:
                self.grad_shard.add_(self.step_grad)
        self._sync_work, self._sync_buf, self._sync_started = None, None, False
        self._add_late_grad(dropped)
        self._attach_fragment_grads(skip=dropped)
        self.step_grad = None

    def _add_late_grad(self, dropped: set) -> None:
        """All-reduce ``late_grad`` (with the direct gradients that came after the all-reduce was issued) over the
        replicate group, by itself and synchronously, and add it into ``grad_shard``, except for fragments whose
        gradient the user dropped."""
        if self.direct_grad is not None:  # direct gradients that came after the all-reduce was issued
            self._late_buffer().add_(self.direct_grad, alpha=1.0 / comm.group_size(self.sync_group))
            self.direct_grad = None
        late, self.late_grad = self.late_grad, None
        if late is None:
            return
        with torch.no_grad():
            buf = self.all_reduce_replicas(late)
            for i in dropped:
                off, n = self._frag_ranges[i]
                buf[off:off + n].zero_()
            self.grad_shard.add_(buf)
