"""Live tensor bytes of one process, op by op: what a dry run reports as memory, and what its validation measures.

[Note: live tensor bytes]
:class:`LiveMemory` is a ``TorchDispatchMode`` that registers the storage of every tensor an op returns (weakly:
a storage is counted while any tensor or view keeps it alive) and, after every op, adds up the bytes of the live
storages (``untyped_storage().nbytes()``, so a flat buffer's full storage freed by ``resize_(0)`` counts 0 until it
is gathered again). It works the same on real tensors (the measured run) and on fake tensors under
``FakeTensorMode`` (the dry run, ``shardfusion.dry_run``), which is why a dry run can be checked against a real run
figure by figure. It sees what is dispatched on its own thread: tensors made by other threads, and the caching
allocator's slack (fragmentation, a CUDA allocator's rounding to 512 bytes), are not counted.

Each sample also splits the live bytes into parts (``parts``): the storages of the parameters, of their gradients,
of the optimizer state, of the units' gathered (full) parameter buffers and of their full gradient buffers; what is
left is activations and temporaries. The idea is that of torch's ``torch.distributed._tools.mem_tracker`` (live
storages under a dispatch mode); the code and the parts are ours.
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

PARTS = ("params", "grads", "optimizer", "full_params", "full_grads", "other")
"""The parts of a sample, in report order (bytes each); ``other`` is activations and temporaries."""


@dataclass
class MemorySample:
    """Live bytes at one moment, by part (``PARTS``) and in total."""

    total: int = 0
    parts: dict = field(default_factory=lambda: {p: 0 for p in PARTS})


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
    ``full_params`` and ``full_grads`` of a model (sharded by ``fully_shard`` or not; or a list of them, e.g. the
    pipeline stages of a rank) and its optimizer, as they are when it is called. The parameters (a sharded model's
    fragments live in its shards) and flat buffers are listed once, here; the gradients, the full buffers and the
    optimizer state are read at each call (the optimizer's tensors again only when it holds more of them: its steps
    update them in place)."""
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
        return {"params": fixed, "grads": _storages(p.grad for p in params if p.grad is not None),
                "optimizer": optim["storages"],
                "full_params": _storages(fb.full for fb in buffers if fb.full is not fb.shard),
                "full_grads": _storages(fb.grad_full for fb in buffers if fb.grad_full is not None)}

    return parts


class LiveMemory(TorchDispatchMode):
    """Track the live tensor bytes of this thread op by op (see [Note: live tensor bytes]).

    Use as a context manager around the code to measure (inside ``FakeTensorMode`` for fake tensors). ``watch``
    (called at every sample) returns the current parts (:func:`model_storages`); without it every byte is
    ``other``. The total is kept as storages appear and die; a storage resized in place (a flat buffer's full
    storage, ``resize_``) is read again whenever it is in a part, or an op returns a tensor on it.

    Attributes:
        current: the last :class:`MemorySample`.
        peak: the sample with the largest total since the last :meth:`reset_peak`.
        part_peaks: per part, the largest value it reached (not necessarily at the same moment).
    """

    def __init__(self, watch: Optional[Callable[[], dict[str, dict]]] = None) -> None:
        """``watch``: e.g. ``model_storages(model, optimizer)``; settable later as the attribute ``watch``."""
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # storage id -> (storage, bytes when last read)
        self._total = 0
        self.watch = watch
        self.current = MemorySample()
        self.peak = MemorySample()
        self.part_peaks = {p: 0 for p in PARTS}

    def add(self, tensors: Iterable) -> None:
        """Register tensors made before the mode was entered (e.g. a model built eagerly)."""
        for key, st in _storages(tensors).items():
            self._update(key, st)

    def _update(self, key: int, st: torch.UntypedStorage) -> int:
        """Register ``st`` or read its size again; its bytes now."""
        size = st.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = (weakref.ref(st, lambda _r, k=key: self._drop(k)), size)
            self._total += size
        elif entry[1] != size:
            self._live[key] = (entry[0], size)
            self._total += size - entry[1]
        return size

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._total -= entry[1]

    def reset_peak(self) -> None:
        """Start a new peak from the current sample."""
        self.sample()
        self.peak = self.current
        self.part_peaks = dict(self.current.parts)

    def sample(self) -> MemorySample:
        """The live bytes now, by part; update ``current``, ``peak`` and ``part_peaks``."""
        parts = {p: 0 for p in PARTS}
        if self.watch is not None:
            seen: set[int] = set()
            for part, storages in self.watch().items():
                for key, st in storages.items():
                    if key not in seen:
                        seen.add(key)
                        parts[part] += self._update(key, st)
        total = self._total
        parts["other"] = total - sum(parts.values())
        self.current = MemorySample(total, parts)
        if total > self.peak.total:
            self.peak = self.current
        for p, v in parts.items():
            if v > self.part_peaks[p]:
                self.part_peaks[p] = v
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, st in _storages(tree_leaves(out)).items():
            self._update(key, st)
        self.sample()
        return out
