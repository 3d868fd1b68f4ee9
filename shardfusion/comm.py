"""The collectives the runtime issues, in one place, with a record of each for counting and accounting.

Every collective shardfusion issues goes through the functions here. A group of one rank issues nothing (the
operation is done locally), so world size 1 runs the same code path as any other (no branch on the world size).
While a :class:`CommCounter` is active, each issued collective appends a :class:`CommRecord`; tests assert counts per group
from it and cross-check the totals with ``torch.distributed.tensor.debug.CommDebugMode``, and
:meth:`CommCounter.summary` adds the records up per category (see [Note: communication accounting] in
``accounting.py``: categories, bytes on the wire, bytes across nodes, time waited).

An asynchronous call returns the torch work handle itself when no counter is active, else a thin wrapper with the
same ``wait()`` and ``is_completed()`` (anything else is passed through) that adds the time spent in ``wait()`` to
the record.

A backend timeout of any of them (in the call, in :func:`wait`, or in the object collectives issued through
:func:`explain_timeout`) becomes a ``RuntimeError`` that names the collective, the rank and the likely cause, calls
made on some ranks only (:func:`timeout_error`, ``LIKELY_CAUSES``); the library's rare collective calls start with an
arrival check that names the ranks that did not make them, and a watchdog reports a wait past that deadline
(``arrival.py``), through :data:`waiting`. Host objects travel without numpy ([Note: host objects without numpy]).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import pickle
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardfusion import accounting

_active_counters: list["CommCounter"] = []
waiting: dict[int, tuple[Any, float]] = {}
"""The blocking collective each thread waits in now: ``{thread id: (what, time.monotonic() at its start)}``, ``what``
a string or the ``(op, group, what)`` of :func:`describe_wait`; set and removed around each wait (no store, no
collective), read by the arrival watchdog ([Note: arrival checks] in ``arrival.py``)."""
_group_kinds: dict[ProcessGroup, tuple[str, ...]] = {}  # label_group; keeps the labelled groups alive
_group_ranks: dict[ProcessGroup, tuple] = {}  # _record: (ranks, this rank's index) once per group, not per collective

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (down to 2.4) have only the old names.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_fake(group: Optional[ProcessGroup] = None) -> bool:
    """Whether ``group`` (default: the world) runs on torch's fake backend (``init_process_group("fake")``): a dry
    run (``shardfusion.dry_run``) playing one rank of a larger world. Its collectives move no data and its tensors
    are fake (shapes only), so agreement checks whose answer needs the other ranks' values are skipped: in a dry run
    every rank is built by the same code from the same arguments."""
    return dist.is_initialized() and dist.get_backend(group) == "fake"


_emulated_backend = {"fake": "nccl"}
"""The backend a dry run's fake groups stand for (``shardfusion.dry_run(backend=...)`` sets it): the collectives
it records are those that backend would run (gloo issues its reduce-scatters as all-to-alls)."""


_fake_completion = {"at_once": False}
"""Whether a dry run's fake collectives report themselves complete as soon as they are issued (the case where
communication keeps up with compute), or only when waited for (the slowest case: a unit's full gradient buffer is
then freed at the end of the backward). ``shardfusion.dry_run`` runs the step both ways and sets it back to False,
so that outside a dry run :func:`_issue` does not look at the backend."""


class _DoneWork:
    """A fake group's work handle that reports itself complete (``_fake_completion["at_once"]``)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def is_completed(self) -> bool:
        return True

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def backend(group: Optional[ProcessGroup] = None) -> str:
    """The backend of ``group``, or for a dry run's fake group the one it emulates (``"nccl"`` unless set)."""
    name = str(dist.get_backend(group))
    return _emulated_backend.get(name, name)


@dataclass
class CommRecord:
    """One issued collective (see [Note: communication accounting] in ``accounting.py``).

    Attributes:
        op: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"broadcast"`` or ``"all_to_all"``.
        group_ranks: global ranks of the group, in group-rank order (ascending for Topology's groups).
        numel: elements of the full (unsharded) tensor involved: the gathered output, the reduce-scatter input, the
            all-reduced or broadcast tensor, the all-to-all's input on this rank.
        nbytes: ``numel * element_size`` in bytes (the logical size).
        label: the group's kinds joined by ``+`` (e.g. ``"fsdp_inner+expert_inner"``; ``"unlabeled"`` for a group
            that no Topology created).
        category: one of ``accounting.CATEGORIES``.
        rank: this process's global rank.
        wire_bytes: bytes this rank sends (ring formulas; exact for the all-to-all).
        send_bytes: for an all-to-all, and a reduce-scatter issued as one (gloo): bytes for each group rank, in
            group-rank order (its own share included).
        wait_s: host seconds spent in the call and, for an asynchronous one, in ``wait()`` (grows until waited).
    """

    op: str
    group_ranks: tuple[int, ...]
    numel: int
    nbytes: int
    label: str = "unlabeled"
    category: str = "other"
    rank: int = 0
    wire_bytes: float = 0.0
    send_bytes: Optional[tuple[int, ...]] = None
    wait_s: float = 0.0

    def cross_node_bytes(self, ranks_per_node: Optional[int]) -> float:
        """The part of ``wire_bytes`` that crosses nodes of ``ranks_per_node`` ranks (None: one node, 0)."""
        return accounting.cross_node_bytes(self, ranks_per_node)


class CommCounter:
    """Context manager that records the collectives shardfusion issues while it is active (on this rank).

    ``ranks_per_node`` (for :meth:`summary`'s cross-node bytes): consecutive global ranks per node; default
    ``LOCAL_WORLD_SIZE`` from the environment, or one node if it is unset.

    Raises:
        ValueError: ``ranks_per_node`` is not None or an int >= 1.
    """

    def __init__(self, ranks_per_node: Optional[int] = None) -> None:
        self.records: list[CommRecord] = []
        self.ranks_per_node = (accounting.check_ranks_per_node(ranks_per_node) if ranks_per_node is not None
                               else accounting.ranks_per_node_from_env())

    def __enter__(self) -> "CommCounter":
        _active_counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_counters.remove(self)

    def count(self, op: str, group_ranks: Optional[tuple[int, ...]] = None) -> int:
        """Number of records of ``op``, optionally only those on the group with these ranks."""
        return sum(
            1 for r in self.records if r.op == op and (group_ranks is None or r.group_ranks == tuple(group_ranks))
        )

    def nbytes(self, op: str, group_ranks: Optional[tuple[int, ...]] = None) -> int:
        """Total bytes of ``op`` records, optionally only those on the group with these ranks."""
        return sum(
            r.nbytes for r in self.records if r.op == op and (group_ranks is None or r.group_ranks == tuple(group_ranks))
        )

    def summary(self, ranks_per_node: Optional[int] = None) -> dict[str, dict[str, float]]:
        """``{category: {"count", "bytes", "wire_bytes", "cross_node_bytes", "wait_s"}}`` for every category of
        ``accounting.CATEGORIES`` (zeros included), with this counter's ``ranks_per_node`` unless one is given."""
        rpn = accounting.check_ranks_per_node(ranks_per_node) if ranks_per_node is not None else self.ranks_per_node
        return accounting.summarize(self.records, rpn)


class TimedWork:
    """A torch work handle whose ``wait()`` adds the seconds it blocks to its record's ``wait_s``; a drop-in for the
    handle itself (``is_completed()`` and every other attribute are the handle's)."""

    __slots__ = ("work", "record")

    def __init__(self, work: Any, record: CommRecord) -> None:
        self.work = work
        self.record = record

    def wait(self, *args, **kwargs):
        """Wait for the collective (the handle's ``wait``), adding the seconds blocked to the record's ``wait_s``."""
        t0 = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.record.wait_s += time.perf_counter() - t0

    def is_completed(self) -> bool:
        """Whether the collective has completed (non-blocking; no time is recorded)."""
        return self.work.is_completed()

    def __getattr__(self, name: str):
        if name in TimedWork.__slots__:  # not set yet (e.g. while copying): no recursion through self.work
            raise AttributeError(name)
        return getattr(self.work, name)


def label_group(group: ProcessGroup, kinds) -> None:
    """Name ``group`` for accounting by the kinds of group it serves (a kind or several, e.g.
    ``("fsdp_inner", "expert_inner")``), replacing any earlier label. :class:`~shardfusion.Topology` labels every
    group it creates; the default group is ``"world"`` unless labelled otherwise."""
    _group_kinds[group] = accounting.order_kinds((kinds,) if isinstance(kinds, str) else kinds)


def group_kinds(group: ProcessGroup) -> tuple[str, ...]:
    """The kinds ``group`` was labelled with (``("world",)`` for an unlabelled default group, else ``()``)."""
    kinds = _group_kinds.get(group)
    if kinds is None:
        return ("world",) if group is dist.group.WORLD else ()
    return kinds


def group_label(group: ProcessGroup) -> str:
    """``group``'s kinds joined by ``+``, or ``"unlabeled"``."""
    return "+".join(group_kinds(group)) or "unlabeled"


def group_size(group: Optional[ProcessGroup]) -> int:
    """Size of ``group`` (1 for ``None``, meaning "no group": a local operation)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This rank's index in ``group`` (0 for ``None``, a group of one)."""
    return 0 if group is None else dist.get_rank(group)


def _check_category(category: Optional[str]) -> None:
    if category is not None and category not in accounting.CATEGORIES:
        raise ValueError(f"category must be None or one of {accounting.CATEGORIES}, got {category!r}")


def _record(op: str, group: ProcessGroup, tensor: torch.Tensor,
            send_rows: Optional[list[int]] = None, category: Optional[str] = None) -> Optional[CommRecord]:
    """Append a record of ``op`` to every active counter; None when none is active. ``send_rows``: the
    all-to-all's input split sizes (rows of ``tensor`` for each group rank). ``category``: the record's category
    when it is not the one the rules give ``op`` on this group (a collective that is one step of another, e.g. the
    all-to-all of a compressed all-reduce, is counted under that all-reduce's category)."""
    if not _active_counters:
        return None
    rank = dist.get_rank()
    if group not in _group_ranks:  # a dry run's groups can hold a million ranks
        ranks = tuple(dist.get_process_group_ranks(group))
        _group_ranks[group] = ranks, ranks.index(rank)
    ranks, index = _group_ranks[group]
    kinds = group_kinds(group)
    nbytes = tensor.numel() * tensor.element_size()
    send_bytes = None
    if send_rows is not None:
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        send_bytes = tuple(int(n) * row_bytes for n in send_rows)
    rec = CommRecord(op, ranks, tensor.numel(), nbytes, label="+".join(kinds) or "unlabeled",
                     category=category or accounting.category(op, kinds), rank=rank,
                     wire_bytes=accounting.wire_bytes(op, len(ranks), nbytes, send_bytes, index),
                     send_bytes=send_bytes)
    for c in _active_counters:
        c.records.append(rec)
    return rec


def _op_name(call: Callable) -> str:
    """The collective ``call`` runs, for messages: its ``op_name`` if set, else its function name."""
    return getattr(call, "op_name", call.__name__)


def _issue(rec: Optional[CommRecord], call, *args, async_op: bool = False, what: Optional[str] = None, **kwargs):
    """``call(*args, async_op=async_op, **kwargs)``, timed into ``rec`` (if any); an async handle comes back
    wrapped in :class:`TimedWork` when there is a record. A backend timeout raised by the call (a synchronous
    collective) becomes :func:`timeout_error` naming ``what`` (default: the op and the group); an asynchronous one
    is explained where it is waited for (:func:`wait`)."""
    t0 = time.perf_counter()
    thread = threading.get_ident()
    if not async_op:
        waiting[thread] = ((_op_name(call), kwargs.get("group"), what), time.monotonic())
    try:
        work = call(*args, async_op=async_op, **kwargs)
    except RuntimeError as e:
        if getattr(e, "shardfusion_explained", False) or not _is_timeout(e):
            raise
        raise timeout_error(_what(_op_name(call), kwargs["group"], what), e) from e
    finally:
        if not async_op:
            waiting.pop(thread, None)
        if rec is not None:
            rec.wait_s += time.perf_counter() - t0
    if async_op and work is not None and _fake_completion["at_once"] and is_fake(kwargs.get("group")):
        work = _DoneWork(work)
    return TimedWork(work, rec) if rec is not None and async_op and work is not None else work


LIKELY_CAUSES = (
    "the ranks' collectives no longer match, so one rank waits for a collective that another rank is not in. Most "
    "likely some ranks made a call the others did not: a forward (an evaluation under `if rank == 0:`: its "
    "all-gathers and buffer broadcast are collectives of every rank), a checkpoint save or load, "
    "sf.full_state_dict or another collective called on some ranks only; or the ranks ran different units in "
    "forward or backward (e.g. LayerDrop or an early exit that skips a unit on some ranks). Every rank must make the "
    "same calls and run the same units in the same order: evaluate on every rank (each on its slice, or all on the "
    "same batch), or on a plain model loaded from sf.full_state_dict; to skip a layer, run it and zero its "
    "contribution instead"
)
"""Why a collective of shardfusion times out, as every timeout error says it."""


def _is_timeout(error: BaseException) -> bool:
    """A backend timeout, or a peer that closed the connection (gloo closes its pairs when a collective of its
    times out, so the ranks that wait in another collective with it fail at the same moment)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or _is_closed(text)


def _is_closed(text: str) -> bool:
    return "connection closed by peer" in text or "connection reset by peer" in text


def timeout_error(what: str, error: BaseException) -> RuntimeError:
    """The ``RuntimeError`` a backend timeout of ``what`` becomes on this rank: ``what``, the rank, the likely
    causes (``LIKELY_CAUSES``) and the backend's own error (shortened)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _is_closed(str(error).lower()):
        head = (f"{what} failed on rank {rank}: a peer closed the connection, either because it timed out in a "
                "collective this rank is not in (see that rank's error) or because it crashed. If it timed out")
    else:
        head = f"{what} timed out on rank {rank}"
    explained = RuntimeError(f"{head}: {LIKELY_CAUSES}. Backend error: {type(error).__name__}: {str(error)[:300]}")
    explained.shardfusion_explained = True
    return explained


@contextlib.contextmanager
def explain_timeout(what: str):
    """Run the block; a backend timeout raised in it becomes :func:`timeout_error` (``what``: the collective and what
    it serves, e.g. ``"all_gather_object of the load_state_dict check"``). For the collectives shardfusion issues on
    torch's API directly (object collectives); other errors, and errors already explained, pass through unchanged.

    Raises:
        RuntimeError: the backend reported a timeout (the original error is chained as ``__cause__``).
    """
    try:
        yield
    except RuntimeError as e:
        if getattr(e, "shardfusion_explained", False) or not _is_timeout(e):
            raise
        raise timeout_error(what, e) from e


def wait(work: Any, what: str) -> None:
    """``work.wait()``; a backend timeout becomes a ``RuntimeError`` that names ``what`` (the collective and the unit
    it serves, e.g. ``"all_gather of unit 'blocks.1'"``) and the likely cause (``LIKELY_CAUSES``).

    A collective that times out has usually been issued on some ranks only: a forward or an evaluation run on some
    ranks (``if rank == 0:``), another collective call made on some ranks only, or ranks that ran different units
    (LayerDrop, early exit, a branch taken on some ranks), so their all-gathers and reduce-scatters no longer match.
    Other errors pass through unchanged.

    Raises:
        RuntimeError: the backend reported a timeout (the original error is chained as ``__cause__``).
    """
    thread = threading.get_ident()
    waiting[thread] = (what, time.monotonic())
    try:
        work.wait()
    except RuntimeError as e:  # as explain_timeout (inline: this runs for every wait of every step)
        if getattr(e, "shardfusion_explained", False) or not _is_timeout(e):
            raise
        raise timeout_error(what, e) from e
    finally:
        waiting.pop(thread, None)


def describe_wait(what: Any) -> str:
    """The name of a wait in :data:`waiting`: ``what`` itself, or for ``(op, group, what)`` the collective's name as
    a timeout error gives it."""
    return what if isinstance(what, str) else _what(*what)


def _what(op: str, group: Optional[ProcessGroup], what: Optional[str]) -> str:
    if what is not None:
        return what
    ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    return f"{op} over ranks {ranks}"


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: Optional[ProcessGroup], async_op: bool = False,
               category: Optional[str] = None, what: Optional[str] = None):
    """All-gather equal 1-D shards into ``full`` (``full.numel() == shard.numel() * group size``).

    ``category``: record it under this accounting category instead of the one the rules give (see ``_record``).
    ``what``: what a timeout of a synchronous call names (default: the op and the group).
    Returns a work handle when ``async_op`` and a collective was issued, else ``None``.

    Raises:
        ValueError: ``category`` is not None or one of ``accounting.CATEGORIES``.
    """
    _check_category(category)
    if group_size(group) == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return None
    record = _record("all_gather", group, full, category=category)
    if _gloo_pair(group) or _gloo_within_node(group):
        return _issue(record, _gloo_all_gather, full, shard, group=group, async_op=async_op, what=what)
    return _issue(record, _all_gather_base, full, shard, group=group, async_op=async_op, what=what)


def all_to_all_equal(output: torch.Tensor, input: torch.Tensor, group: Optional[ProcessGroup],
                     category: Optional[str] = None) -> None:
    """Exchange equal 1-D chunks, blocking and not differentiable: ``input`` and ``output`` are 1-D tensors of the
    same dtype, device and length ``G*k`` (``G`` = group size); chunk ``i`` of ``input`` (elements ``[i*k,
    (i+1)*k)``) goes to group rank ``i``, and chunk ``i`` of ``output`` is what group rank ``i`` sent to this rank. A
    group of one (or ``None``) issues nothing and copies ``input`` into ``output``. Recorded as ``"all_to_all"``
    (``numel = input.numel()``; the wire bytes are the ``G-1`` chunks sent to other ranks), under ``category`` when
    given (see ``_record``).

    Raises:
        ValueError: the tensors are not 1-D, differ in length or dtype, or their length is not a multiple of the
            group size; ``category`` is not None or one of ``accounting.CATEGORIES``.
    """
    _check_category(category)
    size = group_size(group)
    _check_equal_split("all_to_all_equal", ("input", input), ("output", output), size)
    if size == 1:
        output.copy_(input)
        return
    rows = [input.numel() // size] * size
    _issue(_record("all_to_all", group, input, rows, category=category), dist.all_to_all_single, output, input,
           group=group)


def _check_equal_split(call: str, a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor], size: int) -> None:
    """ValueError unless the named tensors ``a`` and ``b`` are 1-D, of one dtype and one length divisible by ``size``
    (an all-to-all in equal chunks)."""
    (na, x), (nb, y) = a, b
    if x.dim() != 1 or y.dim() != 1 or x.numel() != y.numel() or x.dtype != y.dtype or x.numel() % size:
        raise ValueError(f"{call}: {na} and {nb} must be 1-D of one dtype and one length divisible by the group size "
                         f"({size}), got {na} {tuple(x.shape)} {x.dtype}, {nb} {tuple(y.shape)} {y.dtype}")


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group: Optional[ProcessGroup], async_op: bool = False,
                   category: Optional[str] = None):
    """Sum ``full`` over the group and scatter equal 1-D shards into ``shard``; ``category``: record it under this
    accounting category instead of the one the rules give.

    Returns a work handle when ``async_op`` and a collective was issued, else ``None``.

    Raises:
        ValueError: ``category`` is not None or one of ``accounting.CATEGORIES``.
    """
    _check_category(category)
    if group_size(group) == 1:
        shard.copy_(full)
        return None
    gloo = backend(group) == "gloo"
    size = group_size(group)
    # on gloo the record carries the all-to-all's split, so that its bytes across nodes are the exact ones
    record = _record("reduce_scatter", group, full, [full.numel() // size] * size if gloo else None,
                     category=category)
    if _gloo_pair(group):
        return _issue(record, _gloo_reduce_scatter_pair, shard, full, group=group, async_op=async_op)
    if gloo:
        # gloo runs a reduce-scatter as an all-reduce of the whole input plus copies (twice the ring volume); an
        # all-to-all of the shards and a local sum moves the ring volume, (G-1)/G of the input, and measured about
        # twice as fast on CPU.
        received = torch.empty_like(full)  # (G*S,): [source rank, shard]
        work = _issue(record, dist.all_to_all_single, received, full, group=group, async_op=async_op)
        # the G received pieces of this rank's shard summed in source-rank order, once the all-to-all is done
        return _finish(_AllWorks([work] if work is not None else [],
                                 lambda: torch.sum(received.view(size, -1), dim=0, out=shard)), async_op)
    return _issue(record, _reduce_scatter_base, shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def reduce_scatter_exchange(received: torch.Tensor, send: torch.Tensor, group: ProcessGroup,
                            async_op: bool = False):
    """The all-to-all of a reduce-scatter that sums its pieces itself, after they travelled in another format (the
    quantized gradient reduce-scatter, ``_runtime/grad_wire.py``): ``send`` and ``received`` are 1-D tensors of one
    dtype and length ``G*k``; chunk ``i`` of ``send`` goes to group rank ``i``, chunk ``i`` of ``received`` is what
    group rank ``i`` sent. Recorded as the ``"reduce_scatter"`` it stands for (its category on ``group``), of
    ``send`` (``numel``: its elements, bytes for int8) with the all-to-all's split, as gloo's reduce-scatter is
    (:func:`reduce_scatter`): ``wire_bytes`` ``(G-1) * k * element_size``, and the bytes across nodes exact. Returns
    the work handle when ``async_op`` (a group of more than one rank is required).

    Raises:
        ValueError: the tensors are not 1-D of one dtype and one length divisible by the group size.
    """
    size = group_size(group)
    _check_equal_split("reduce_scatter_exchange", ("send", send), ("received", received), size)
    record = _record("reduce_scatter", group, send, [send.numel() // size] * size)
    return _issue(record, dist.all_to_all_single, received, send, group=group, async_op=async_op)


# [Note: gloo collectives as sends and receives]
# On a CPU node every byte a collective moves is copied by the host, so copies the algorithm does not need cost as
# much as the transfer. gloo's all-gather into one tensor receives into a flat buffer of its own and then copies
# it into the output (one extra pass over the whole gathered buffer, on gloo's worker thread); its all-to-all (our
# reduce-scatter, below) copies this rank's own piece into a receive buffer as large as the input. So over a pair
# of ranks on a real gloo group (HSDP's inner groups of two) the all-gather runs as one send of the shard and one
# receive straight into the peer's slice of the output (the own slice copied in), and the reduce-scatter as one
# send and one receive of half the input, received straight into the output and the own half added in place (no
# receive buffer; two passes over the shard where a separate buffer took three). For a pair that is the ring itself:
# the same bytes on the wire and across nodes, the same results (a gather moves values; a sum of two is the same in
# either order), less CPU. The `comm` step under `after_backward` spends 0.97 x its CPU
# (benchmarks/results/paired-gloo-sends.md, paired with the tree before). A larger group whose ranks lie in one node
# (``Topology`` marks its groups, ``mark_within_node``) runs its all-gathers the same way: each rank's shard sent to
# every peer and received straight into place, (G-1) S per rank on the wire as the ring, none across nodes, no copy of
# the gathered buffer (FSDP over 4 ranks of one node, `after_backward`: 0.96 x the step time, paired,
# benchmarks/results/paired-direct-gather.md). A group across nodes keeps gloo's all-gather: sending a shard to every
# peer directly would put more bytes across nodes than the ring (2 S instead of 1.5 S per rank for 4 ranks on 2
# nodes). Reduce-scatters over more than two keep the all-to-all: their sum has an order, the all-to-all's rows. Each
# call's sends and receives carry their own tag (``_next_tag``), so calls in flight on one group never match each
# other's. Each rank posts its sends before its receives. gloo writes a send whose receive the peer has already
# posted at once, on the calling thread, holding the pair's lock; a send posted before that is queued, and the loop
# thread of the pair writes it when the peer's receive-ready message arrives. With receives first, a peer's
# receive-ready message was usually there by the time of the send, so the training thread wrote while the loop
# thread, woken by the peer's data on the same socket, spun against the lock ([Note: gloo loop threads as batch work]
# in ``_runtime/gloo_device.py``); with sends first, the sends usually go out from the loop thread, which also reads
# that socket. Measured together with the loop threads' scheduling: benchmarks/results/paired-gloo-batch.md. A dry
# run's fake groups (``is_fake``) issue the collectives themselves: they move nothing either way.


def _gloo_pair(group: Optional[ProcessGroup]) -> bool:
    """Whether the all-gathers and reduce-scatters of ``group`` run as sends and receives ([Note: gloo collectives
    as sends and receives]): a real (not fake) gloo group of exactly two ranks. Decided once per group (a group's
    size and backend never change)."""
    if group is None:
        return False
    pair = _pairs.get(group)
    if pair is None:
        pair = _pairs[group] = dist.get_world_size(group) == 2 and str(dist.get_backend(group)) == "gloo"
    return pair


def mark_within_node(group: Optional[ProcessGroup], ranks_per_node: int) -> None:
    """Record whether the ranks of ``group`` lie in one node of ``ranks_per_node`` consecutive global ranks (a
    ``Topology`` marks each group it makes): a real gloo group within one node runs its all-gathers as sends and
    receives ([Note: gloo collectives as sends and receives]); an unmarked group only when it is a pair."""
    if group is None or is_fake(group):
        return
    nodes = {r // ranks_per_node for r in dist.get_process_group_ranks(group)}
    _within_node[group] = len(nodes) == 1 and str(dist.get_backend(group)) == "gloo"


def _gloo_within_node(group: Optional[ProcessGroup]) -> bool:
    """Whether ``group`` is a real gloo group marked as lying within one node (:func:`mark_within_node`)."""
    return group is not None and _within_node.get(group, False)


_within_node: dict[ProcessGroup, bool] = {}  # group -> a gloo group within one node (mark_within_node)
_pairs: dict[ProcessGroup, bool] = {}  # group -> whether it is a gloo pair (_gloo_pair)
_p2p_tags: dict[ProcessGroup, int] = {}  # group -> the last tag its sends used (_next_tag)
_parts = threading.local()  # .current: the collective whose sends this thread issues (collective_of_parts)
_part_calls = itertools.count()


def collective_of_parts() -> Optional[tuple[int, str, torch.Tensor]]:
    """The collective whose sends and receives the calling thread is issuing now (the gloo all-gather or
    reduce-scatter below), as ``(call id, op, full tensor)``: ``op`` ``"all_gather"`` or ``"reduce_scatter"``, the
    full tensor the gathered output or the reduce-scatter's input (``(G*S,)``), the id distinct per call; else
    None. A recorder of c10d ops (the dry run's pipeline sends, a benchmark's library-neutral count) reads its sends
    as that one collective, not as point-to-point traffic."""
    return getattr(_parts, "current", None)


def sends_are_parts() -> bool:
    """Whether the calling thread is issuing the sends and receives of a collective (:func:`collective_of_parts`)."""
    return collective_of_parts() is not None


def _exchange(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]], group: ProcessGroup,
              tag: int, op: str, full: torch.Tensor) -> list:
    """Post the sends ``(tensor, destination group rank)``, then the receives ``(tensor, source group rank)``, all
    with ``tag``, as the parts of collective ``op`` of ``full``; their work handles. Sends first, so that gloo's loop
    thread usually writes them ([Note: gloo collectives as sends and receives])."""
    _parts.current = (next(_part_calls), op, full)
    try:
        works = [dist.isend(t, group=group, group_dst=dst, tag=tag) for t, dst in sends]
        return works + [dist.irecv(t, group=group, group_src=src, tag=tag) for t, src in receives]
    finally:
        _parts.current = None


def _next_tag(group: ProcessGroup) -> int:
    """A tag for this call's sends and receives on ``group``: the same on every rank (each rank issues a group's
    collectives in one order), different from the calls still in flight (a counter; gloo matches a receive by
    source and tag, so two gathers in flight never take each other's pieces)."""
    tag = _p2p_tags[group] = (_p2p_tags.get(group, 0) + 1) % (1 << 24)
    return tag


class _AllWorks:
    """The work handles of one collective run as several (sends and receives, or an all-to-all) and its local step:
    ``wait()`` waits for each, then runs ``then`` (once); ``is_completed()`` when every one has."""

    def __init__(self, works: list, then: Optional[Callable[[], None]] = None) -> None:
        self.works, self.then = works, then

    def wait(self, *args, **kwargs) -> bool:
        """Wait for every send and receive, then run the local step. Returns True."""
        works, self.works = self.works, []
        for w in works:
            w.wait(*args, **kwargs)
        then, self.then = self.then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        """Whether every send and receive has completed (the local step runs in :meth:`wait`)."""
        return all(w.is_completed() for w in self.works)


def _finish(work: _AllWorks, async_op: bool) -> Optional[_AllWorks]:
    if async_op:
        return work
    work.wait()
    return None


def _gloo_all_gather(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """All-gather as sends and receives on gloo: this rank's shard to each peer, each peer's straight into its
    slice of ``full``, this rank's own copied in (used for pairs and for groups within one node)."""
    me, size, n, tag = dist.get_rank(group), dist.get_world_size(group), shard.numel(), _next_tag(group)
    peers = [i for i in range(size) if i != me]
    works = _exchange([(shard, i) for i in peers], [(full[i * n:(i + 1) * n], i) for i in peers], group, tag,
                      "all_gather", full)
    full[me * n:(me + 1) * n].copy_(shard)
    return _finish(_AllWorks(works), async_op)


def _gloo_reduce_scatter_pair(shard: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """Reduce-scatter over a pair of gloo ranks as a send and a receive: the peer's half of ``full`` goes to it,
    its half of this rank's comes back and is added to this rank's own (``a + b == b + a`` exactly: the same sum
    as the all-to-all's in rank order)."""
    me, n, tag = dist.get_rank(group), shard.numel(), _next_tag(group)
    peer = 1 - me
    own = full[me * n:(me + 1) * n]
    # the peer's half lands straight in the output and the own half is added in place (no buffer of its own, two
    # passes over the shard instead of three), unless the output overlaps the input: the own half must be read first
    received = torch.empty_like(shard) if _overlap(shard, full) else shard  # (S,)
    works = _exchange([(full[peer * n:(peer + 1) * n], peer)], [(received, peer)], group, tag, "reduce_scatter", full)
    return _finish(_AllWorks(works, lambda: torch.add(own, received, out=shard)), async_op)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` (contiguous, on one device) may overlap."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


_gloo_all_gather.op_name = "all_gather"
_gloo_reduce_scatter_pair.op_name = "reduce_scatter"


def all_reduce(tensor: torch.Tensor, group: Optional[ProcessGroup], op=dist.ReduceOp.SUM, async_op: bool = False,
               category: Optional[str] = None):
    """All-reduce ``tensor`` in place over ``group``; nothing is issued for a group of one. ``category``: as in
    :func:`all_gather`."""
    _check_category(category)
    if group_size(group) == 1:
        return None
    return _issue(_record("all_reduce", group, tensor, category=category), dist.all_reduce, tensor, op=op,
                  group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, group: Optional[ProcessGroup], group_src: int = 0,
              what: Optional[str] = None) -> None:
    """Broadcast ``tensor`` in place from the group's rank ``group_src``; nothing is issued for a group of one.
    ``what``: what a timeout error names (default: the op and the group)."""
    if group_size(group) == 1:
        return
    _issue(_record("broadcast", group, tensor), dist.broadcast, tensor, group=group, group_src=group_src,
           what=what)


def broadcast_coalesced(tensors: list[torch.Tensor], group: Optional[ProcessGroup], group_src: int = 0,
                        what: str = "broadcast of the module buffers") -> None:
    """Broadcast ``tensors`` in place from the group's rank ``group_src``: one collective per (dtype, device).

    Used for module buffers (DDP's ``broadcast_buffers`` idea: replicas keep identical BatchNorm statistics), at
    every training forward and the first forward after training ones (an evaluation): a forward run on some ranks
    only times out here, with ``what`` and the likely cause (:func:`timeout_error`).
    """
    if group_size(group) == 1:
        return
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            broadcast(flat, group, group_src,
                      what=f"{what} ({len(same)} {flat.dtype} tensors, over ranks "
                           f"{dist.get_process_group_ranks(group)})")
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def _check_splits(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                  size: int) -> None:
    if input.dim() < 1:
        raise ValueError(f"all_to_all_single: input must have at least 1 dim (split along dim 0), got {input.shape=}")
    for name, splits in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
        if len(splits) != size or any(int(s) < 0 for s in splits):
            raise ValueError(f"all_to_all_single: {name}={list(splits)} must have one non-negative entry per group "
                             f"rank (group size {size})")
    if sum(input_split_sizes) != input.shape[0]:
        raise ValueError(f"all_to_all_single: sum(input_split_sizes={list(input_split_sizes)}) = "
                         f"{sum(input_split_sizes)} != input.shape[0] = {input.shape[0]}")


def _all_to_all(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                group: ProcessGroup) -> torch.Tensor:
    """The issued collective (group size > 1): a new ``(sum(output_split_sizes), *rest)`` tensor."""
    input = input.contiguous()
    output = input.new_empty((sum(output_split_sizes), *input.shape[1:]))
    _issue(_record("all_to_all", group, input, list(input_split_sizes)), dist.all_to_all_single, output, input,
           list(output_split_sizes), list(input_split_sizes), group=group)
    return output


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the all-to-all of the gradient with the split lists swapped,
    itself issued through this function (so it is recorded, and differentiable once more)."""

    @staticmethod
    def forward(ctx, input, output_split_sizes, input_split_sizes, group):
        """(N_in, *rest) -> (sum(output_split_sizes), *rest), see :func:`all_to_all_single`."""
        ctx.splits = (list(output_split_sizes), list(input_split_sizes))
        ctx.group = group
        return _all_to_all(input, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad_output):
        """The gradient's all-to-all with the split lists swapped: (N_out, *rest) -> (N_in, *rest)."""
        output_split_sizes, input_split_sizes = ctx.splits
        grad_input = _AllToAll.apply(grad_output, input_split_sizes, output_split_sizes, ctx.group)
        return grad_input, None, None, None


def all_to_all_single(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                      group: Optional[ProcessGroup]) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 with uneven (and zero) splits.

    ``input`` is ``(N_in, *rest)``, any dtype the backend supports; its rows ``input_split_sizes[i]`` (in group-rank
    order) go to group rank ``i``. Returns a new ``(sum(output_split_sizes), *rest)`` tensor of the same dtype and
    device, whose ``output_split_sizes[i]`` rows came from group rank ``i``. The split lists must agree across ranks
    (what rank ``i`` sends to rank ``j`` is what ``j`` expects from ``i``); the sizes themselves are usually exchanged
    first with :func:`all_to_all_counts`. The backward is the all-to-all of the gradient with the lists swapped.
    Every rank of the group must call it, even with nothing to send or receive. A group of one (or ``None``) issues
    nothing and returns ``input`` itself (an identity). Each issued all-to-all, forward or backward, is recorded as
    ``"all_to_all"`` with ``numel = input.numel()``.

    Raises:
        ValueError: ``input`` has no dims; a split list has not one non-negative entry per group rank;
            ``sum(input_split_sizes) != input.shape[0]``; in a group of one, the two lists differ.
    """
    size = group_size(group)
    _check_splits(input, output_split_sizes, input_split_sizes, size)
    if size == 1:
        if list(output_split_sizes) != list(input_split_sizes):
            raise ValueError(f"all_to_all_single: a group of one receives what it sends, got {output_split_sizes=} "
                             f"and {input_split_sizes=}")
        return input
    return _AllToAll.apply(input, list(output_split_sizes), list(input_split_sizes), group)


def all_to_all_counts(counts: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Exchange equal chunks of integer counts (not differentiable): the usual first step of a dropless all-to-all.

    ``counts`` is ``(G*k,)`` int64 (``G`` = group size), chunk ``i`` (``counts[i*k:(i+1)*k]``) meant for group rank
    ``i``. Returns a new ``(G*k,)`` int64 tensor whose chunk ``i`` is what group rank ``i`` sent to this rank. A group
    of one (or ``None``) issues nothing and returns ``counts`` itself. Recorded as ``"all_to_all"``.

    Raises:
        ValueError: ``counts`` is not 1-D int64 or its length is not a multiple of the group size.
    """
    size = group_size(group)
    if counts.dim() != 1 or counts.dtype != torch.int64 or counts.numel() % size:
        raise ValueError(f"all_to_all_counts: counts must be 1-D int64 with a length divisible by the group size "
                         f"({size}), got {counts.shape=}, {counts.dtype=}")
    if size == 1:
        return counts
    splits = [counts.numel() // size] * size
    with torch.no_grad():
        return _all_to_all(counts, splits, splits, group)


def call_on_rank0(action: Callable[[], Any], what: str) -> Any:
    """Run ``action()`` on rank 0 of the default group while the other ranks wait; return its value on every rank,
    or raise its error on every rank. Collective: one :func:`broadcast_object` (not recorded by a CommCounter: a
    host object, not a tensor collective of the step), which is also the barrier. For work only rank 0 does (file
    system updates, reading a pointer file) before a collective that every rank enters: a failure on rank 0 alone
    must not leave the others waiting in it. The value must be picklable.

    Raises:
        ValueError: on every rank: ``"<what>: <rank 0's error type>: <message>"``.
    """
    value, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            value = action()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{what}: {type(e).__name__}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        value, error = broadcast_object((value, error), None, f"rank 0's result ({what})")
    if error is not None:
        raise ValueError(error)
    return value


# [Note: host objects without numpy]
# torch's object collectives (all_gather_object, broadcast_object_list, gather_object, ...) read the received bytes
# back with ``tensor.numpy()``, so they fail with "Numpy is not available" where numpy is not installed, which torch
# does not require (nor does shardfusion: the library runs with torch alone). Ours pickle the object into a uint8
# tensor and send it with plain tensor collectives (the lengths first, then the bytes padded to the longest), and
# read it back with ctypes, from the standard library. They are not recorded by a CommCounter (host objects, not
# tensors of the step). On a NCCL group the bytes travel through the current CUDA device, as torch's own do.


def _object_device(group: Optional[ProcessGroup]) -> torch.device:
    """Where a host object's bytes travel: the current CUDA device for a NCCL group, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend(group) else torch.device("cpu")


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    """``obj`` pickled: a (n,) uint8 tensor on ``device``."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _unpickled(data: torch.Tensor, length: int) -> Any:
    """The object pickled in the first ``length`` bytes of the 1-D uint8 tensor ``data`` (any device)."""
    data = data[:length].cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), length))


def all_gather_object(obj: Any, group: Optional[ProcessGroup], what: str, capacity: int = 0) -> list:
    """``obj`` of every rank of ``group`` (None: the default group), in group-rank order. Two all-gathers of the
    default or given group, the bytes' lengths ((G,) int64) then the bytes padded to the longest ((G * longest,)
    uint8), without numpy ([Note: host objects without numpy]); not recorded by a CommCounter. A timeout names
    ``what`` and the likely cause (:func:`timeout_error`). ``obj`` must be picklable.

    ``capacity`` > 0 (bytes, the same on every rank): one all-gather instead of two when every rank's bytes fit,
    each rank sending its length and its bytes in ``8 + capacity`` bytes ((G * (8 + capacity),) uint8); a rank
    whose bytes do not fit sends its length only, and then, every rank seeing it, the bytes go in a second
    all-gather padded to the longest. For calls whose every collective round counts (a save in the step loop)."""
    size = dist.get_world_size(group)
    device = _object_device(group)
    mine = _pickled(obj, device)  # (n,)
    if capacity > 0:
        slot = torch.zeros(8 + capacity, dtype=torch.uint8, device=device)  # (8 + capacity,): length, bytes
        slot[:8] = torch.tensor([mine.numel()], dtype=torch.int64, device=device).view(torch.uint8)
        if mine.numel() <= capacity:
            slot[8:8 + mine.numel()] = mine
        every = torch.empty(size * (8 + capacity), dtype=torch.uint8, device=device)  # [group rank, slot byte]
        _issue(None, _all_gather_base, every, slot, group=group, what=f"all-gather of {what}")
        slots = every.view(size, 8 + capacity)
        counts = slots[:, :8].contiguous().view(torch.int64).view(-1).tolist()
        if max(counts) <= capacity:
            return [_unpickled(slots[i, 8:], n) for i, n in enumerate(counts)]
    else:
        lengths = torch.empty(size, dtype=torch.int64, device=device)  # (G,)
        _issue(None, _all_gather_base, lengths, torch.tensor([mine.numel()], dtype=torch.int64, device=device),
               group=group, what=f"all-gather of the sizes of {what}")
        counts = lengths.tolist()
    longest = max(counts)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)  # (longest,)
    padded[:mine.numel()] = mine
    every = torch.empty(size * longest, dtype=torch.uint8, device=device)  # (G * longest,): [group rank, byte]
    _issue(None, _all_gather_base, every, padded, group=group, what=f"all-gather of {what}")
    return [_unpickled(every[i * longest:(i + 1) * longest], n) for i, n in enumerate(counts)]


def broadcast_object(obj: Any, group: Optional[ProcessGroup], what: str, group_src: int = 0) -> Any:
    """Group rank ``group_src``'s ``obj`` (ignored on the other ranks), on every rank of ``group`` (None: the
    default group). Two broadcasts, the length then the bytes, without numpy ([Note: host objects without numpy]);
    not recorded by a CommCounter. A timeout names ``what`` and the likely cause (:func:`timeout_error`)."""
    device = _object_device(group)
    source = dist.get_rank(group) == group_src
    data = _pickled(obj, device) if source else None
    length = torch.tensor([data.numel() if source else 0], dtype=torch.int64, device=device)
    _issue(None, dist.broadcast, length, group=group, group_src=group_src, what=f"broadcast of the size of {what}")
    if not source:
        data = torch.empty(int(length), dtype=torch.uint8, device=device)
    _issue(None, dist.broadcast, data, group=group, group_src=group_src, what=f"broadcast of {what}")
    return obj if source else _unpickled(data, int(length))


def _tensor_to_object(tensor: torch.Tensor, tensor_size, group=None) -> Any:
    """torch's ``distributed_c10d._tensor_to_object`` without numpy (the same arguments): while
    :func:`torch_object_collectives_without_numpy` is active, torch's own object collectives read bytes with it."""
    return _unpickled(tensor.reshape(-1), int(tensor_size))


_numpy_free = {"depth": 0, "original": None}  # torch_object_collectives_without_numpy: blocks open, torch's function
_numpy_free_lock = threading.Lock()


@contextlib.contextmanager
def torch_object_collectives_without_numpy():
    """Inside the block, torch's object collectives (those ``torch.distributed.checkpoint`` issues in ``dcp.save``
    and ``dcp.load``, which shardfusion cannot replace) read their bytes back without numpy: torch's
    ``distributed_c10d._tensor_to_object``, whose ``tensor.numpy()`` is their only use of numpy, is replaced by
    :func:`_tensor_to_object` while at least one block is open, then put back. Blocks may overlap across threads and
    be left on another thread than the one that entered them (an asynchronous checkpoint save holds one from its
    start to the end of its background write): the first to open replaces the function, the last to close puts it
    back. A torch without that private function (another release) is left as it is."""
    c10d = dist.distributed_c10d
    if getattr(c10d, "_tensor_to_object", None) is None:
        yield
        return
    with _numpy_free_lock:
        if _numpy_free["depth"] == 0:
            _numpy_free["original"] = c10d._tensor_to_object
            c10d._tensor_to_object = _tensor_to_object
        _numpy_free["depth"] += 1
    try:
        yield
    finally:
        with _numpy_free_lock:
            _numpy_free["depth"] -= 1
            if _numpy_free["depth"] == 0:
                c10d._tensor_to_object = _numpy_free["original"]
