"""Pure layout math for a flat buffer: offsets, alignment, padding and per-rank fragments.

No tensors are allocated here. A :class:`FlatLayout` describes how the parameters of one flat buffer of a unit are
laid out in one 1-D buffer of ``padded_numel`` elements that is split into ``shard_count`` equal contiguous shards::

    | p0 ....... | pad | p1 ... | pad | p2 ......... | tail pad |
    |<-- shard 0 -->|<-- shard 1 -->|<-- shard 2 -->|<-- shard 3 -->|

Every parameter starts at an offset aligned to ``align`` elements (so views are aligned for vectorized kernels) and
is contiguous in the buffer (its full view is a plain view of the all-gathered buffer). A *fragment* is the
intersection of one parameter's range with one shard; it may be empty (0 elements). Zero-element parameters take no
space.

[Note: row-aligned shards]
:func:`build_layout` (element-sharded buffers) cuts shards on *row boundaries*: a row of a parameter of shape
``(d0, d1, ...)`` is ``prod(d1, ...)`` elements (:func:`row_numel`; one element for 1-D and 0-d parameters), and
every shard boundary that falls inside a parameter falls between two of its rows. So a fragment is whole rows,
``(rows_on_this_rank, *shape[1:])`` (:func:`fragment_shape`): ``p.dim()`` and the trailing dimensions are those of
the original parameter (a 0-d parameter: ``(1,)`` where its element is, ``(0,)`` elsewhere). The rules, for a
shard size ``S`` (a multiple of ``align``):

- a parameter that would cross a boundary ``b`` starts at the earliest ``b - k * lcm(row, align)`` (``k >= 0``)
  that is not before the next aligned offset: the padding before it is less than ``lcm(row, align)`` elements (less
  than a row when the row is a multiple of ``align``), once per boundary crossed this way;
- a parameter that crosses two or more boundaries needs ``S`` to be a multiple of its row;
- ``S`` is searched upward from ``ceil(packed / shard_count)`` rounded up to ``align`` (``packed``: the end of the
  parameters laid out with alignment only, the old unpadded layout) until every parameter obeys these rules and the
  parameters end within ``shard_count * S``; it steps by ``align``, or by a quarter of the overflow per shard when
  the parameters end past the buffer, and skips the sizes a parameter rules out wherever it starts (more than
  ``2 S`` elements and ``S % row != 0``; a single row longer than ``S``: rows larger than ``S`` raise ``S``);
- padding before a parameter is first filled with later parameters that fit in it whole (in order);
- two orders are tried, the given one and the largest rows first (a fused expert tensor ``(E, 2F, C)`` has rows of
  ``2F * C`` elements: started mid-shard, it would need up to a row of padding), and the one with the smaller ``S``
  is kept (ties: the given order). ``slots[i]`` is always parameter ``i``; offsets need not increase with ``i``.

With ``shard_count == 1``, or when no boundary falls inside a row, this is the plain aligned layout. When rows of
unrelated lengths would make ``S`` a multiple of their ``lcm`` (a ``(4096, 10928)`` and a ``(10928, 4096)`` matrix
each spanning several shards), :func:`row_groups` splits the parameters of one kind into one flat buffer per row
class, so each buffer pads about a row per shard (one all-gather and reduce-scatter more per class). The owner layout
(:func:`build_owner_layout`) puts every parameter whole in one shard and needs none of this.

The idea of one flat buffer per group of parameters comes from FSDP1's ``FlatParameter`` and Megatron-FSDP's
parameter/gradient buffers; the layout rules here are our own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer.

    Attributes:
        name: fully qualified parameter name (the first name it was registered under).
        shape: original shape of the parameter.
        offset: start offset in the flat buffer, in elements.
        numel: number of elements (0 allowed).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the last element of the parameter in the flat buffer (elements)."""
        return self.offset + self.numel


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter that lies in one shard.

    Attributes:
        slot: the parameter's :class:`ParamSlot`.
        shard_offset: start of the fragment inside the shard (elements).
        param_offset: start of the fragment inside the flattened parameter (elements).
        numel: fragment length in elements (0 when the parameter does not touch this shard).
    """

    slot: ParamSlot
    shard_offset: int
    param_offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Layout of a flat buffer split into ``shard_count`` equal shards.

    Attributes:
        slots: the parameters in the order given to the layout function (``slots[i]`` is parameter ``i``); their
            offsets need not increase with ``i`` (:func:`build_owner_layout`, and :func:`build_layout` when it puts
            the largest rows first).
        padded_numel: total length of the flat buffer in elements, a multiple of ``shard_count``.
        shard_count: number of shards (the inner degree of the group the buffer is sharded over; 1 = kept whole).
    """

    slots: tuple[ParamSlot, ...]
    padded_numel: int
    shard_count: int

    @property
    def shard_numel(self) -> int:
        """Elements per shard: ``padded_numel // shard_count``."""
        return self.padded_numel // self.shard_count

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return sum(s.numel for s in self.slots)

    def fragments(self, shard_index: int) -> list[Fragment]:
        """The fragment of every parameter in shard ``shard_index`` (empty ones included, in flat order).

        Raises:
            ValueError: if ``shard_index`` is not in ``[0, shard_count)``.
        """
        if not 0 <= shard_index < self.shard_count:
            raise ValueError(f"shard_index({shard_index}) must be in [0, shard_count({self.shard_count}))")
        lo = shard_index * self.shard_numel
        hi = lo + self.shard_numel
        out = []
        for s in self.slots:
            start, end = max(s.offset, lo), min(s.end, hi)
            if start >= end:
                out.append(Fragment(s, 0, 0, 0))
            else:
                out.append(Fragment(s, start - lo, start - s.offset, end - start))
        return out


def build_layout(
    names: Sequence[str], shapes: Sequence[Sequence[int]], shard_count: int, align: int = 4
) -> FlatLayout:
    """Lay parameters out, each contiguous and aligned to ``align`` elements, in ``shard_count`` equal shards cut on
    the parameters' row boundaries (see [Note: row-aligned shards]).

    Args:
        names: parameter names, in flat order.
        shapes: their shapes (``torch.Size`` or tuples).
        shard_count: how many equal shards the buffer is split into (>= 1).
        align: alignment of each parameter's start offset and of the shard size, in elements (>= 1).

    Returns:
        The :class:`FlatLayout`: ``padded_numel`` is a multiple of ``shard_count * align``, and each rank's fragment
        of a parameter is whole rows of it; ``slots[i]`` is parameter ``i`` (offsets in the order chosen). An empty
        or all-zero-size list gives ``padded_numel == 0``.

    Raises:
        ValueError: if ``shard_count`` or ``align`` is < 1, ``names`` and ``shapes`` differ in length, or a shape has
            a negative dimension.
    """
    if shard_count < 1:
        raise ValueError(f"shard_count({shard_count}) must be >= 1")
    if align < 1:
        raise ValueError(f"align({align}) must be >= 1")
    if len(names) != len(shapes):
        raise ValueError(f"len(names)({len(names)}) != len(shapes)({len(shapes)})")
    shapes = [tuple(int(d) for d in shape) for shape in shapes]
    for name, shape in zip(names, shapes):
        if any(d < 0 for d in shape):
            raise ValueError(f"shapes: parameter {name!r} has shape {shape} with a negative dimension")
    numels = [math.prod(shape) for shape in shapes]
    rows = [max(row_numel(shape), 1) for shape in shapes]
    packed = _place(numels, rows, align, shard_numel=None)[-1]  # the end with alignment only
    if not packed:
        return FlatLayout(tuple(ParamSlot(n, s, 0, k) for n, s, k in zip(names, shapes, numels)), 0, shard_count)
    best = None
    for order in _orders(rows):
        S, placed = _fit([numels[i] for i in order], [rows[i] for i in order], shard_count, align, packed)
        if best is None or S < best[0]:
            best = S, {i: off for i, off in zip(order, placed)}
    S, offsets = best
    slots = tuple(ParamSlot(name, shape, offsets[i], n)
                  for i, (name, shape, n) in enumerate(zip(names, shapes, numels)))
    return FlatLayout(slots, shard_count * S, shard_count)


def row_groups(shapes: Sequence[Sequence[int]], shard_count: int, align: int = 4) -> list[list[int]]:
    """Which parameters of one kind share a flat buffer: ``[[0, 1, ..., n-1]]`` (one buffer) unless its
    :func:`build_layout` pads more than ``shard_count * max(lcm(row, align))`` elements (about a row per shard) beyond
    the plain aligned layout; then one group per *row class* (see [Note: row-aligned shards]).

    A row class is the parameters with two or more dims whose ``lcm(row, align)`` divides its largest one (a row
    of ``4 * C`` elements and one of ``C`` share a class: any shard size fit for the first fits the second); the
    1-D, 0-d and empty parameters join the class with the most elements. Each group is in the given order, the
    groups in order of their first parameter. One buffer would need ``S`` to be a multiple of the ``lcm`` of the
    rows of every parameter spanning two or more shards (``(10928, 4096)`` and ``(4096, 10928)`` matrices:
    ``lcm(4096, 10928)``, 2.8M elements per shard); one buffer per class needs each class's row only.

    Raises:
        ValueError: as :func:`build_layout`.
    """
    names = [str(i) for i in range(len(shapes))]
    everything = [list(range(len(shapes)))]
    if shard_count == 1 or len(shapes) < 2:
        build_layout(names, shapes, shard_count, align)  # validates
        return everything
    one = build_layout(names, shapes, shard_count, align)
    steps = [math.lcm(max(row_numel(s.shape), 1), align) for s in one.slots]
    packed = _place([s.numel for s in one.slots], [1] * len(steps), align, shard_numel=None)[-1]
    if one.padded_numel - _round_up(packed, shard_count * align) <= shard_count * max(steps):
        return everything
    leaders: list[int] = []  # the largest step of each class
    for step in sorted({st for st, s in zip(steps, one.slots) if len(s.shape) > 1 and s.numel}, reverse=True):
        if not any(lead % step == 0 for lead in leaders):
            leaders.append(step)
    if len(leaders) < 2:
        return everything
    classes: dict[int, list[int]] = {lead: [] for lead in leaders}
    rest = []
    for i, (st, s) in enumerate(zip(steps, one.slots)):
        if len(s.shape) > 1 and s.numel:
            classes[next(lead for lead in leaders if lead % st == 0)].append(i)
        else:
            rest.append(i)
    groups = list(classes.values())
    largest = max(groups, key=lambda g: sum(one.slots[i].numel for i in g))
    largest.extend(rest)
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _orders(rows: list[int]) -> list[list[int]]:
    """The parameter orders :func:`build_layout` tries: the given one, then (if different) the largest rows first
    (stable), which puts the tensors that force large steps where no padding is needed yet."""
    given = list(range(len(rows)))
    by_row = sorted(given, key=lambda i: -rows[i])
    return [given] if by_row == given else [given, by_row]


def _fit(numels: list[int], rows: list[int], shard_count: int, align: int, packed: int) -> tuple[int, list[int]]:
    """The first shard size the search of [Note: row-aligned shards] finds (from ``ceil(packed / shard_count)`` up,
    a multiple of ``align``) at which the parameters, in this order, keep their rows whole and end within
    ``shard_count * S``; and their offsets."""
    S = _round_up(-(-packed // shard_count), align)
    while True:
        S = _first_possible(S, numels, rows, align)
        offsets = _place(numels, rows, align, shard_numel=S)
        if offsets is not None and offsets[-1] <= shard_count * S:
            return S, offsets[:-1]
        over = 0 if offsets is None else offsets[-1] - shard_count * S  # the parameters end past the buffer
        S += max(align, _round_up(over // (4 * shard_count), align))  # a quarter of the overflow per shard


def _place(numels: list[int], rows: list[int], align: int, shard_numel: int | None) -> list[int] | None:
    """Each parameter's offset, then the end of the parameters; ``shard_numel=None``: alignment only. ``None`` if a
    parameter cannot keep its rows whole at this shard size (it crosses two boundaries and ``S % row != 0``).

    In order, each parameter at its earliest start (:func:`_start`); when that leaves a gap (padding to put a
    boundary between two rows), later parameters that fit whole in the gap are put there first, in order."""
    S, out, offset = shard_numel, [None] * len(numels), 0
    for i, n in enumerate(numels):
        if out[i] is not None:
            continue
        if n == 0:
            out[i] = offset
            continue
        start = _start(offset, n, rows[i], align, S)
        if start is None:
            return None
        if start > _round_up(offset, align):  # a gap before parameter i: fill it with later ones that fit
            for j in range(i + 1, len(numels)):
                if out[j] is None and numels[j]:
                    s_j = _start(offset, numels[j], rows[j], align, S)
                    if s_j is not None and s_j + numels[j] <= start:
                        out[j], offset = s_j, s_j + numels[j]
        out[i], offset = start, start + n
    return out + [offset]


def _start(offset: int, n: int, row: int, align: int, S: int | None) -> int | None:
    """The earliest start ``>= offset`` of a parameter of ``n`` elements in rows of ``row`` at shard size ``S``
    (``None``: alignment only) that puts every boundary inside it between two rows, or ``None`` if there is none
    (it would cross two boundaries and ``S % row != 0``)."""
    start = _round_up(offset, align)
    if S is None or row <= 1 or start + n <= (b := (start // S + 1) * S):  # no boundary inside
        return start
    step = math.lcm(row, align)
    start = b - (b - start) // step * step  # the earliest start <= b that puts b between two rows
    first = b if start < b else b + S  # the first boundary inside the parameter
    if first < start + n and ((first - start) % row or (first + S < start + n and S % row)):
        return None
    return start


def _first_possible(S: int, numels: list[int], rows: list[int], align: int) -> int:
    """The smallest shard size ``>= S`` (a multiple of ``align``) that no parameter rules out wherever it starts: a
    parameter of more than ``2 S`` elements crosses two boundaries, so ``S`` must be a multiple of its row; one of a
    single row (``numel == row``) cannot be cut, so ``S >= numel``."""
    changed = True
    while changed:
        changed = False
        for n, row in zip(numels, rows):
            if row <= 1 or n == 0:
                continue
            if n == row and S < n:
                S, changed = _round_up(n, align), True
            elif n > 2 * S and S % row:
                S, changed = min(_round_up(S, math.lcm(row, align)), _round_up(-(-n // 2), align)), True
    return S


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def row_numel(shape: Sequence[int]) -> int:
    """Elements per row of a parameter of ``shape``: ``prod(shape[1:])``; 1 for a 1-D or 0-d parameter (0 when a
    trailing dimension is 0)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def fragment_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """The shape of a fragment of ``numel`` elements (whole rows) of a parameter of ``shape`` in a layout of
    :func:`build_layout`: ``(numel // row_numel(shape), *shape[1:])``, so the parameter's own shape when ``numel`` is
    all of it, and ``(0, *shape[1:])`` for an empty fragment. A 0-d parameter is the exception: ``(1,)`` on the rank
    holding its element, ``(0,)`` elsewhere (a 0-d fragment would make its per-element optimizer state, e.g. Adam's
    ``exp_avg``, indistinguishable from scalar state such as ``step``, which checkpoints store apart).

    Raises:
        ValueError: ``numel`` is negative or not a whole number of rows.
    """
    shape = tuple(shape)
    if not shape:
        if numel not in (0, 1):
            raise ValueError(f"numel({numel}) must be 0 or 1 for a 0-d parameter")
        return (numel,)
    row = row_numel(shape)
    if numel < 0 or (numel and numel % row):
        raise ValueError(f"numel({numel}) is not a whole number of rows of {row} elements of shape {shape}")
    return (numel // row if row else 0, *shape[1:])


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """The work of one Newton-Schulz orthogonalization of a matrix of ``shape`` (m, n), up to a constant factor:
    ``max(m, n) * min(m, n) ** 2`` multiply-adds per iteration (Muon's iteration multiplies by the Gram matrix of
    the shorter side). A tensor of other rank counts its elements."""
    if len(shape) == 2:
        m, n = shape
        return max(m, n) * min(m, n) ** 2
    return math.prod(shape)


def build_owner_layout(
    names: Sequence[str], shapes: Sequence[Sequence[int]], shard_count: int, align: int = 4,
    costs: Sequence[int] | None = None, base_load: Sequence[int] | None = None,
) -> FlatLayout:
    """Lay parameters out so that each lies whole inside one shard, its *owner*, balancing ``costs`` over the shards.

    Owners are chosen greedily, largest cost first, each parameter to the shard with the least cost so far (ties:
    the fewest elements, then the lowest index): the longest-processing-time rule, within 4/3 of the best makespan.
    ``base_load`` is the cost each shard carries already (the owner layouts of earlier units over the same group),
    so the balance holds over a whole model, not per buffer: a block's largest matrices go to other ranks than the
    previous block's.
    Inside a shard parameters keep their given order, each aligned to ``align``. Every shard has the size of the
    fullest one (rounded up to ``align``): the shards stay equal for the all-gather, and the difference is padding
    (:func:`owner_report`). The slots keep the given order, so ``slots[i]`` is parameter ``i``.

    Args:
        names, shapes: the parameters, as for :func:`build_layout`.
        shard_count: number of shards (>= 1).
        align: alignment of each parameter's start, in elements (>= 1).
        costs: per parameter, what its owner pays for it (default :func:`newton_schulz_cost` of its shape).
        base_load: per shard, the cost it carries already (default zeros).

    Raises:
        ValueError: ``shard_count`` or ``align`` < 1, ``names``, ``shapes`` and ``costs`` differ in length, or
            ``base_load`` does not have ``shard_count`` entries.
    """
    if shard_count < 1:
        raise ValueError(f"shard_count({shard_count}) must be >= 1")
    if align < 1:
        raise ValueError(f"align({align}) must be >= 1")
    costs = [newton_schulz_cost(s) for s in shapes] if costs is None else list(costs)
    if not len(names) == len(shapes) == len(costs):
        raise ValueError(f"len(names)({len(names)}), len(shapes)({len(shapes)}) and len(costs)({len(costs)}) differ")
    if base_load is not None and len(base_load) != shard_count:
        raise ValueError(f"len(base_load)({len(base_load)}) != shard_count({shard_count})")
    numels = [math.prod(s) for s in shapes]
    load = list(base_load) if base_load is not None else [0] * shard_count
    used = [0] * shard_count
    owner = [0] * len(names)
    for i in sorted(range(len(names)), key=lambda i: (-costs[i], -numels[i], i)):
        if numels[i] == 0:
            continue
        r = min(range(shard_count), key=lambda r: (load[r], used[r], r))
        owner[i] = r
        load[r] += costs[i]
        used[r] += _round_up(numels[i], align)
    local: list[int] = [0] * len(names)  # offset inside the owner's shard
    fill = [0] * shard_count
    for i in range(len(names)):
        if numels[i]:
            local[i] = fill[owner[i]]
            fill[owner[i]] += _round_up(numels[i], align)
    shard = _round_up(max(fill), align) if any(fill) else 0
    slots = tuple(ParamSlot(name, tuple(shape), owner[i] * shard + local[i], numels[i])
                  for i, (name, shape) in enumerate(zip(names, shapes)))
    return FlatLayout(slots, shard * shard_count, shard_count)


def build_carried_owner_layout(names: Sequence[str], shapes: Sequence[Sequence[int]], shard_count: int, align: int,
                               load: list[int]) -> FlatLayout:
    """:func:`build_owner_layout` with ``base_load=load``, then ``load`` (per shard, the cost owned so far by earlier
    units over the same group) updated in place with this layout's costs: how ``fully_shard`` and ``sf.plan`` lay out
    a model's owner buffers unit after unit."""
    layout = build_owner_layout(names, shapes, shard_count, align, base_load=load)
    for r, c in enumerate(owner_report(layout)["cost"]):
        load[r] += c
    return layout


def owner_report(layout: FlatLayout, costs: Sequence[int] | None = None) -> dict:
    """How an owner layout (:func:`build_owner_layout`) balances its shards: per shard the cost and the elements of
    the parameters it owns, ``cost_imbalance`` (the largest cost / the mean, 1.0 = perfect), and ``padding`` (elements
    of the buffer that hold no parameter, alignment included: what equal shards cost)."""
    costs = [newton_schulz_cost(s.shape) for s in layout.slots] if costs is None else list(costs)
    S = layout.shard_numel
    cost, numel = [0] * layout.shard_count, [0] * layout.shard_count
    for slot, c in zip(layout.slots, costs):
        if slot.numel:
            r = slot.offset // S
            cost[r] += c
            numel[r] += slot.numel
    mean = sum(cost) / layout.shard_count
    return {"cost": cost, "numel": numel, "cost_imbalance": max(cost) / mean if mean else 1.0,
            "padding": layout.padded_numel - layout.numel}


def owned_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """The shape of a rank's fragment of a parameter of ``shape`` in an owner layout: the parameter's own shape on
    its owner (``numel`` is all of it), ``(0, *shape[1:])`` elsewhere (a 0-d parameter: ``()`` on its owner,
    ``(0,)`` elsewhere), so that an optimizer reading shapes (Muon: 2-D only) takes every rank's fragments
    unchanged. :func:`fragment_shape` but for 0-d parameters."""
    if numel:
        return tuple(shape)
    return (0, *tuple(shape)[1:]) if len(shape) else (0,)
