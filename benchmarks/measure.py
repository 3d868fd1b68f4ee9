"""What `benchmarks/compare.py` measures besides time: collectives and memory, the same way for every variant.

Collectives: :class:`CollectiveRecorder` is a ``TorchDispatchMode`` that sees every c10d op a step issues, whichever
library issues it (shardfusion's ``comm`` functions, FSDP2's foreach all-gather and reduce-scatter, DDP's C++
reducer, DTensor's redistributions in FSDP2's gradient clipping). For each one it keeps the op kind, the ranks of its
group, the elements of the *full* tensor (gathered output, reduce-scatter input, all-reduced tensor) and the element
size. Like ``CommDebugMode`` it steps aside (``NotImplemented``) for tensor subclasses, so that a DTensor op is
desugared first and its collectives are seen.

Wire bytes per rank are those of the ring algorithms (the bandwidth-optimal volume; NCCL and gloo's ring reach it):
all-gather and reduce-scatter of N bytes over G ranks send ``(G-1)/G * N`` per rank, an all-reduce ``2(G-1)/G * N``;
a point-to-point send of N bytes sends N, a receive nothing.

Memory: :func:`persistent_bytes` sums the distinct storages of the tensors a rank keeps across steps (parameter
shards, gradients, optimizer state); the transient full buffers are sampled at every op of one step by a callback of
the recorder (see ``variants.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Collective:
    """One collective issued on this rank.

    Attributes:
        kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``all_to_all``, ``p2p_send``,
            ``p2p_recv`` or ``other:<op>``.
        ranks: global ranks of its group, sorted.
        numel: elements of the full tensor (see the module doc).
        elem_size: bytes per element.
    """

    kind: str
    ranks: tuple[int, ...]
    numel: int
    elem_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return self.numel * self.elem_size

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends under the ring algorithm (see the module doc)."""
        return wire_bytes(self.kind, self.nbytes, len(self.ranks))

    def as_dict(self) -> dict:
        return asdict(self)


def wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Per-rank bytes sent by a ring all-gather / reduce-scatter / all-reduce of a full tensor of ``nbytes``."""
    G = group_size
    if kind == "p2p_send":  # the whole tensor goes to one peer
        return float(nbytes)
    if G <= 1 or kind == "p2p_recv":  # a receive sends nothing
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (G - 1) / G * nbytes
    return (G - 1) / G * nbytes  # all-gather, reduce-scatter, broadcast (pipelined), all-to-all


# c10d op -> (kind, index of the argument holding the tensor(s) whose total size is read, whether that size is one
# rank's share, to be multiplied by the group size to give the full tensor).
_OPS = {
    "_allgather_base_": ("all_gather", 0, False),  # (output, input, pg, ...)
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "allgather_": ("all_gather", 0, False),  # (output lists, inputs, pg, ...)
    "allgather_coalesced_": ("all_gather", 0, False),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),  # (output, input, pg, op, ...)
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "reduce_scatter_": ("reduce_scatter", 1, False),  # (outputs, input lists, pg, op, ...)
    "allreduce_": ("all_reduce", 0, False),  # (tensors, pg, op, ...)
    "allreduce_coalesced_": ("all_reduce", 0, False),
    "broadcast_": ("broadcast", 0, False),
    # (output, input, pg, ...): the benchmark's GPT has no MoE, so an all-to-all is shardfusion's reduce-scatter on
    # gloo (all-to-all of the shards + local sum, shardfusion.comm.reduce_scatter)
    "alltoall_base_": ("reduce_scatter", 1, False),
    # functional collectives (DTensor redistributions): the input comes first
    "all_reduce": ("all_reduce", 0, False),
    "all_reduce_": ("all_reduce", 0, False),
    "all_reduce_coalesced": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True),  # (input, group_size, group_name)
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast": ("broadcast", 0, False),
    # point-to-point (pipeline stages' activations and their gradients): (tensors, pg, peer, tag)
    "send": ("p2p_send", 0, False),
    "recv_": ("p2p_recv", 0, False),
    "recv_any_source_": ("p2p_recv", 0, False),
}
_NAMESPACES = {"c10d", "_c10d_functional"}
_IGNORED = {"wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd"}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_ranks(args, kwargs) -> Optional[tuple[int, ...]]:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return tuple(sorted(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))))
            except (RuntimeError, TypeError, ValueError, AttributeError):
                continue
        if isinstance(a, str):
            try:
                pg = dist.distributed_c10d._resolve_process_group(a)
            except (RuntimeError, KeyError, ValueError, AttributeError):
                continue
            return tuple(sorted(dist.get_process_group_ranks(pg)))
    return None


def describe_op(func, args, kwargs) -> Optional[Collective]:
    """A :class:`Collective` for a c10d op (``None`` for other ops and for waits and barriers)."""
    if getattr(func, "namespace", "") not in _NAMESPACES:
        return None
    name = func._schema.name.split("::")[-1]
    if name in _IGNORED:
        return None
    ranks = _group_ranks(args, kwargs) or tuple(range(dist.get_world_size()))
    kind, index, per_rank = _OPS.get(name, (f"other:{name}", 0, False))
    tensors = _tensors(args[index]) if len(args) > index else []
    numel = sum(t.numel() for t in tensors) * (len(ranks) if per_rank else 1)
    elem_size = tensors[0].element_size() if tensors else 0
    return Collective(kind, ranks, numel, elem_size)


def _dispatching_subclass(t: type) -> bool:
    """Whether ``t`` is a tensor subclass with its own ``__torch_dispatch__`` (DTensor), to be desugared first; a
    plain ``nn.Parameter`` (whose dispatch is the disabled default) is not: DeepSpeed's ZeRO-3 reads ``param.data``
    of its parameters inside the step, which must run under the recorder as it is."""
    return (t is not torch.Tensor and issubclass(t, torch.Tensor)
            and getattr(t, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl)


def _parts_of() -> Callable[[], Optional[tuple]]:
    try:
        from shardfusion.comm import collective_of_parts
    except ImportError:  # an older shardfusion (benchmarks.paired_commits times older trees): no such sends
        return lambda: None
    return collective_of_parts


class CollectiveRecorder(TorchDispatchMode):
    """Record every collective issued while active; optionally call ``on_op()`` after every op (memory sampling)."""

    def __init__(self, on_op: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self.collectives: list[Collective] = []
        self.on_op = on_op
        self._part_call: Optional[int] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_dispatching_subclass(t) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops (and collectives) first
        c = describe_op(func, args, kwargs)
        if c is not None and c.kind in ("p2p_send", "p2p_recv"):
            c = self._as_collective(c)
        if c is not None:
            self.collectives.append(c)
        out = func(*args, **kwargs)
        if self.on_op is not None:
            self.on_op()
        return out

    def _as_collective(self, c: Collective) -> Optional[Collective]:
        """A send or receive that is part of a shardfusion collective run as sends and receives on gloo
        (``shardfusion.comm``, [Note: gloo collectives as sends and receives]): the whole collective, once per call
        (``None`` for its other parts); any other send or receive as it is."""
        parts = _parts_of()()
        if parts is None:
            return c
        call, op, full = parts
        if call == self._part_call:
            return None
        self._part_call = call
        return Collective(op, c.ranks, full.numel(), full.element_size())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def persistent_bytes(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes of distinct storages per named group of tensors; a storage already counted in an earlier group is not
    counted again (e.g. DDP's gradients, which are views of its buckets)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            if t is None:
                continue
            st = local_tensor(t).untyped_storage()
            key = st.data_ptr()
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        out[name] = total
    return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (e.g. AdamW's exp_avg, exp_avg_sq, step)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
