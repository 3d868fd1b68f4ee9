"""Live tensor bytes of one process, op by op: what a dry run reports as memory, and what its validation measures.

[Note: live tensor bytes]
:class:`LiveMemory` is a ``TorchDispatchMode`` that registers the storage of every tensor an op returns (weakly:
a storage is counted while any tensor or view keeps it alive) and, after every op, adds up the bytes of the live
storages (``untyped_storage().nbytes()``, so a flat buffer's full storage freed by ``resize_(0)`` counts 0 until it
is gathered again). It works the same on real tensors (the measured run) and on fake tensors under
``FakeTensorMode`` (the dry run, ``shardfusion.dry_run``), which is why a dry run can be checked against a real run
figure by figure. It sees what is dispatched on its own thread: tensors made by other threads, and the caching
allocator's slack (fragmentation, a CUDA allocator's rounding to 512 bytes), are not counted.

Each sample also splits the live bytes into parts (``parts``, :data:`PARTS`): the storages of the parameters, of
their gradients, of the optimizer state, of the units' gathered (full) parameter buffers and of their full gradient
buffers, of the secondary copies of ``fully_shard(..., secondary_shard=True)`` (hpZ: held from a unit's forward to
its backward, ``shardfusion/_runtime/secondary_shard.py``), read from the model at each sample (``watch``); the rest by where it comes from: a storage passed to a
collective (a reduce-scatter's receive buffer or cast input, an all-gather's cast input) is ``comm_buffers`` from
that op on; any other counts in the part the caller set as the ``phase`` when the op that made it ran:
``activations`` (made during forward: what backward keeps, the loss, the logits), ``optimizer_step`` (made by the
clipping and ``optimizer.step()``: e.g. a foreach optimizer's temporaries), ``other`` (made during backward: gradients
of activations and the ops' temporaries). The peak sample also names the units whose full buffers are alive
(``units``). The idea is that of torch's ``torch.distributed._tools.mem_tracker`` (live storages under a dispatch
mode); the code and the parts are ours.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveMemory", "MemorySample", "model_storages"]

PARTS = ("params", "grads", "optimizer", "full_params", "full_grads", "secondary_params", "activations", "comm_buffers",
         "optimizer_step", "other")
"""The parts of a sample, in report order (bytes each; see [Note: live tensor bytes])."""
WATCHED = PARTS[:6]
"""The parts read from the model at each sample (``watch``); the others go by where a storage comes from."""
PHASES = ("activations", "optimizer_step", "other")
"""The parts a ``phase`` can name: where a storage made outside the watched parts counts."""
PERSISTENT = ("params", "grads", "optimizer")
"""The parts kept from step to step; the rest of a peak is its transient part."""
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass
class MemorySample:
    """Live bytes at one moment, by part (``PARTS``) and in total; for a peak sample also ``units``: per part
    ``full_params`` / ``full_grads``, the bytes of each unit alive then (``{part: {unit name: bytes}}``, the root
    unit named ``""``), when the watched parts carry labels."""

    total: int = 0
    parts: dict = field(default_factory=lambda: {p: 0 for p in PARTS})
    units: dict = field(default_factory=dict)

    @property
    def transient(self) -> int:
        """The bytes outside the parameters, gradients and optimizer state (``PERSISTENT``)."""
        return self.total - sum(self.parts[p] for p in PERSISTENT)


def _storages(tensors: Iterable) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in tensors:
        # a fake tensor stands for a tensor on its fake_device (asking it is_meta would dispatch an op); a meta one
        # (e.g. a pipeline stage's shape records) holds nothing
        if (t.fake_device.type != "meta") if type(t) is FakeTensor else (isinstance(t, torch.Tensor) and not t.is_meta):
            st = t.untyped_storage()
            out[st._cdata] = st
    return out


def model_storages(model, optimizer: Optional[torch.optim.Optimizer] = None) -> Callable[[], dict[str, dict]]:
    """A function that returns ``{part: {storage id: storage}}`` for the parts ``params``, ``grads``, ``optimizer``,
    ``full_params``, ``full_grads`` and ``secondary_params`` (hpZ's copies) of a model (sharded by ``fully_shard`` or not; or a list of them, e.g. the
    pipeline stages of a rank) and its optimizer, as they are when it is called. The parameters (a sharded model's
    fragments live in its shards) and flat buffers are listed once, here; the gradients (and the flat buffers'
    sharded gradients, kept from step to step whether ``.grad`` is set or not), the full buffers (a unit's
    gathered parameters; its gradient buffer and, under mixed precision while sync is off, its fp32 accumulator) and
    the optimizer state are read at each call (the optimizer's tensors again only when it holds more of them: its
    steps update them in place). Its attribute ``labels`` maps the full buffers' storage ids to their unit's name
    after each call (:attr:`MemorySample.units`)."""
    from shardfusion._runtime.state import flat_buffers, is_sharded

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    params = [p for m in models for p in m.parameters()]
    buffers = [fb for m in models if is_sharded(m) for fb in flat_buffers(m)]
    fixed = _storages(params)
    optim: dict = {"seen": -1, "storages": {}}

    def parts() -> dict[str, dict]:
        entries = -1 if optimizer is None else sum(len(v) for v in optimizer.state.values())
        if entries != optim["seen"]:  # new state (tensors made one by one: count them all)
            optim["seen"] = entries
            optim["storages"] = _storages(v for s in optimizer.state.values() for v in s.values())
        full, grads, secondary, labels = {}, {}, {}, {}
        for fb in buffers:
            for part, t in ((full, fb.full if fb.full is not fb.shard else None), (grads, fb.grad_full),
                            (grads, fb.grad_acc), (secondary, getattr(fb.secondary, "copy", None))):
                for key, st in _storages([t] if t is not None else []).items():
                    part[key] = st
                    labels[key] = fb.unit_name
        parts.labels = labels
        grad_storages = _storages([p.grad for p in params if p.grad is not None]
                            + [fb.grad_shard for fb in buffers if fb.grad_shard is not None])
        return {"params": fixed, "grads": grad_storages, "optimizer": optim["storages"], "full_params": full,
                "full_grads": grads, "secondary_params": secondary}

    parts.labels = {}
    return parts


class LiveMemory(TorchDispatchMode):
    """Track the live tensor bytes of this thread op by op (see [Note: live tensor bytes]).

    Use as a context manager around the code to measure (inside ``FakeTensorMode`` for fake tensors). ``watch``
    (called at every sample) returns the current watched parts (:func:`model_storages`); without it every byte goes
    by where it comes from. The total is kept as storages appear and die; a storage resized in place (a flat buffer's
    full storage, ``resize_``) is read again whenever it is in a part, or an op returns a tensor on it.

    Attributes:
        phase: the part (one of :data:`PHASES`) that storages made from now on count in, outside the watched parts
            and the collectives' buffers; the caller sets it around forward (``activations``), backward (``other``)
            and the optimizer step (``optimizer_step``). Default ``other``.
        current: the last :class:`MemorySample`.
        peak: the sample with the largest total since the last :meth:`reset_peak` (with ``units``).
        part_peaks: per part, the largest value it reached (not necessarily at the same moment).
        unwatched_peak: the largest sum of the parts outside the watched ones (``WATCHED``): activations and
            temporaries of every origin at once.
        transient_peak: the sample with the largest :attr:`MemorySample.transient` (bytes outside the parameters,
            gradients and optimizer state) since the last :meth:`reset_peak` (with ``units``): in a step after the
            first, whose persistent parts are alive throughout, the same moment as ``peak``; in a first step (an
            optimizer's state is made by its step) the peak a later step will reach, less its persistent bytes.
    """

    def __init__(self, watch: Optional[Callable[[], dict[str, dict]]] = None) -> None:
        """``watch``: e.g. ``model_storages(model, optimizer)``; settable later as the attribute ``watch``."""
        super().__init__()
        # storage id -> (storage, bytes when last read, the part it counts in when not watched)
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}
        self._total = 0
        self._by_origin = {p: 0 for p in PARTS[len(WATCHED):]}  # live bytes per part of origin, watched or not
        self._phase = "other"
        self.watch = watch
        self.current = MemorySample()
        self.peak = MemorySample()
        self.part_peaks = {p: 0 for p in PARTS}
        self.unwatched_peak = 0
        self.transient_peak = MemorySample()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {value!r}")
        self._phase = value

    def add(self, tensors: Iterable) -> None:
        """Register tensors made before the mode was entered (e.g. a model built eagerly)."""
        for key, st in _storages(tensors).items():
            self._update(key, st)

    def _update(self, key: int, st: torch.UntypedStorage) -> int:
        """Register ``st`` (made now: in the current phase) or read its size again; its bytes now."""
        size = st.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = (weakref.ref(st, lambda _r, k=key: self._drop(k)), size, self._phase)
            self._total += size
            self._by_origin[self._phase] += size
        elif entry[1] != size:
            self._live[key] = (entry[0], size, entry[2])
            self._total += size - entry[1]
            self._by_origin[entry[2]] += size - entry[1]
        return size

    def _retag(self, key: int, origin: str) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[2] != origin:
            self._live[key] = (entry[0], entry[1], origin)
            self._by_origin[entry[2]] -= entry[1]
            self._by_origin[origin] += entry[1]

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._total -= entry[1]
            self._by_origin[entry[2]] -= entry[1]

    def reset_peak(self) -> None:
        """Start a new peak from the current sample."""
        self.sample()
        self.peak = self.transient_peak = self.current
        self.part_peaks = dict(self.current.parts)
        self.unwatched_peak = self.current.total - sum(self.current.parts[p] for p in WATCHED)

    def sample(self) -> MemorySample:
        """The live bytes now, by part; update ``current``, ``peak`` (and its ``units``) and ``part_peaks``."""
        parts = {p: 0 for p in PARTS}
        watched: dict[int, tuple[str, int]] = {}  # storage id -> (part, bytes)
        if self.watch is not None:
            for part, storages in self.watch().items():
                for key, st in storages.items():
                    if key not in watched:
                        watched[key] = (part, self._update(key, st))
                        parts[part] += watched[key][1]
        for part, n in self._by_origin.items():
            parts[part] += n
        for key, (_, size) in watched.items():  # counted in their watched part, not in their part of origin
            parts[self._live[key][2]] -= size
        self.current = MemorySample(self._total, parts)
        new_peak = self._total > self.peak.total
        new_transient = self.current.transient > self.transient_peak.transient
        if new_peak or new_transient:
            labels = getattr(self.watch, "labels", {})
            units: dict = {"full_params": {}, "full_grads": {}}
            for key, (part, size) in watched.items():
                if part in units and key in labels and size:
                    units[part][labels[key]] = units[part].get(labels[key], 0) + size
            self.current.units = units
            if new_peak:
                self.peak = self.current
            if new_transient:
                self.transient_peak = self.current
        for p, v in parts.items():
            if v > self.part_peaks[p]:
                self.part_peaks[p] = v
        self.unwatched_peak = max(self.unwatched_peak, self._total - sum(parts[p] for p in WATCHED))
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, st in _storages(tree_leaves(out)).items():
            self._update(key, st)
        if getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES:  # its buffers: comm_buffers from now on
            for key, st in _storages(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)).items():
                self._update(key, st)
                self._retag(key, "comm_buffers")
        self.sample()
        return out
