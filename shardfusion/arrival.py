"""Arrival checks: a collective call made on some ranks only is named, with the ranks that did not make it, within a
deadline, whatever the process groups' timeouts.

[Note: arrival checks]
The library's rare collective calls (``model.state_dict()``, ``optimizer.state_dict()``, their ``load_state_dict``,
``sf.full_state_dict``, ``sf.checkpoint``'s saves and loads, and a forward in a new mode: the first forward, or the
first after ``model.train()`` / ``model.eval()`` or a change of grad mode) start with :func:`check`, before any
collective of theirs. Each rank sets one key of the default group's store (the c10d store every rank already
reaches), ``shardfusion/arrival/<ranks>/<n>/<rank>`` for its n-th check among these ranks, holding the call's name
and a value (the forward's mode), and adds one to the check's counter; the rank that brings the counter to the
number of ranks reads every key and writes a verdict (the same call and value everywhere, or which ranks came with
what); the others wait for the verdict, at most the arrival deadline (:func:`deadline`:
``Topology(arrival_timeout=...)``, else ``SHARDFUSION_ARRIVAL_TIMEOUT`` seconds, else 60 s; not the Topology
timeout, which stays the hard limit of the collectives themselves). A rank that came and waits past the deadline
raises a ``RuntimeError`` naming the call and the ranks whose key is missing (``ranks [1, 2, 3] of 4``), before any
data collective: a rank that came alone gets that error, never a backend's raw timeout or a ``SIGABRT`` of
mismatched collectives. Ranks that came from different calls raise at once, naming each call with its ranks. The
last rank to read the verdict removes the keys. The idea is torch's ``monitored_barrier`` (which names the ranks
that did not reach it), made through the store so that no collective of any group changes order, with a payload
that the ranks compare, and O(1) store operations per rank.

The training step pays nothing: a forward in the mode of the previous forward, a backward and an optimizer step make
no check and touch no store; the per-unit collectives are watched by the :func:`watchdog` instead, a daemon thread
(started by the first check) that looks every quarter deadline at the collectives this process waits in
(``comm.waiting``, a dict entry set around each blocking wait) and, when one has waited past the deadline, prints
once to stderr what it waits in and which ranks came to a check that this rank has not made (e.g. rank 0 in ``a
forward in a new mode (eval mode, grad disabled)``: an evaluation under ``if rank == 0:``), read from the store.
It does not end the wait: the hard timeout stays the process group's.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import threading
import time
from typing import Optional, Sequence

import torch.distributed as dist

from shardfusion import comm

DEFAULT_DEADLINE_S = 60.0
"""Seconds a rank waits at an arrival check for the others, unless set (:func:`deadline`)."""

DEADLINE_ENV = "SHARDFUSION_ARRIVAL_TIMEOUT"
"""Environment variable that sets the arrival deadline in seconds (a ``Topology(arrival_timeout=...)`` wins)."""

_PREFIX = "shardfusion/arrival"
_counts: dict[str, int] = {}  # checks made by this process, per set of ranks (key: _tag), in the process group:
_ranks: dict[str, list[int]] = {}  # the ranks of each tag
_world: list = [None]  # the default group they count in (a new one, after destroy / init, starts from zero)
_watch = {"thread": None, "deadline": DEFAULT_DEADLINE_S}
reports: list[str] = []
"""What the :func:`watchdog` printed in this process, in order (for tests and logs)."""


def deadline(topology=None) -> float:
    """The arrival deadline in seconds: ``topology.arrival_timeout`` when set, else the environment variable
    ``SHARDFUSION_ARRIVAL_TIMEOUT``, else 60.

    Raises:
        ValueError: the environment variable is not a positive number (named with its value).
    """
    set_by_topology = getattr(topology, "arrival_timeout", None)
    if set_by_topology is not None:
        return float(set_by_topology)
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return DEFAULT_DEADLINE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{DEADLINE_ENV}={text!r}: the arrival deadline must be a positive number of seconds")
    return seconds


def _tag(ranks: list[int]) -> str:
    return "world" if ranks == list(range(dist.get_world_size())) else \
        hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]


def _store():
    return dist.distributed_c10d._get_default_store()


def check(what: str, ranks: Optional[Sequence[int]] = None, seconds: Optional[float] = None,
          value: str = "") -> Optional[str]:
    """Wait until every rank of ``ranks`` (global ranks, ascending; default: the world) has come to its check of the
    same number among these ranks, at most ``seconds`` (default :func:`deadline`), through the default group's store
    ([Note: arrival checks]). ``what`` names the call, e.g. ``"model.state_dict()"``, and ``value`` is compared too
    (e.g. the mode of a forward). Returns None when every rank came with the same ``value``, else the values with
    their ranks (``"ranks [0]: a; ranks [1, 2, 3]: b"``) for the caller's error. Nothing to do (None) without a
    process group, on a dry run's fake one, or for one rank. Starts the :func:`watchdog` of this process.

    Store operations: each rank sets its key, adds to a counter, reads a verdict and adds to a second counter; the
    last rank to come reads every key and writes the verdict, the last to read the verdict removes the keys (O(1)
    per rank, O(ranks) for those two).

    Raises:
        RuntimeError: on a rank that came: some ranks did not come within the deadline (naming ``what``, them and
            the deadline), or the ranks came from different calls (each call named with its ranks).
    """
    if not dist.is_initialized() or comm.is_fake():
        return None
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if len(ranks) == 1:
        return None
    seconds = deadline() if seconds is None else seconds
    watchdog(seconds)
    if _world[0] is not dist.group.WORLD:
        _world[0] = dist.group.WORLD
        _counts.clear()
        _ranks.clear()
    rank, tag = dist.get_rank(), _tag(ranks)
    n = _counts[tag] = _counts.get(tag, 0) + 1
    _ranks[tag] = ranks
    store = _store()
    base = f"{_PREFIX}/{tag}/{n}"
    keys = [f"{base}/{r}" for r in ranks]
    store.set(keys[ranks.index(rank)], f"{what}\n{value}")
    if store.add(f"{base}/came", 1) == len(ranks):  # the last to come: every key is set
        store.set(f"{base}/verdict", _verdict(ranks, [v.decode() for v in store.multi_get(keys)]))
    try:
        store.wait([f"{base}/verdict"], datetime.timedelta(seconds=seconds))
    except RuntimeError as e:  # DistStoreError: the deadline passed
        absent = [r for r, key in zip(ranks, keys) if not store.check([key])]
        if absent:  # (none: every rank came just as the wait gave up)
            mode = f" ({value})" if value else ""
            raise RuntimeError(
                f"{what}{mode} on rank {rank}: ranks {absent} of {len(ranks)} have not called it after {seconds:g} s "
                f"(the arrival deadline: Topology(arrival_timeout=...) or {DEADLINE_ENV}, default "
                f"{DEFAULT_DEADLINE_S:g} s): it is collective, every rank must call it, not only some (e.g. under "
                "`if rank == 0:`). The ranks that did not call it wait in their next collective until a peer's exit "
                "closes it or the process group's timeout ends it.") from e
        try:  # every rank came just as the wait gave up: the last one writes the verdict now
            store.wait([f"{base}/verdict"], datetime.timedelta(seconds=seconds))
        except RuntimeError:
            raise RuntimeError(f"{what} on rank {rank}: every rank came but none wrote the verdict of the check: the "
                               f"store holds keys of an earlier process group under {base}") from e
    kind, _, text = store.get(f"{base}/verdict").decode().partition("\n")
    if store.add(f"{base}/read", 1) == len(ranks):  # the last to read the verdict removes the keys
        for key in (*keys, f"{base}/came", f"{base}/verdict", f"{base}/read"):
            store.delete_key(key)
    if kind == "calls":
        raise RuntimeError(f"{what} on rank {rank}: the ranks came from different collective calls, {text}: every "
                           "rank must make the same calls in the same order (not some under `if rank == 0:`)")
    return text if kind == "values" else None


def _verdict(ranks: list[int], came: list[str]) -> str:
    """``"same"``, or ``"calls\n<ranks and calls>"``, or ``"values\n<ranks and values>"``, from every rank's
    ``"<what>\n<value>"``."""
    for kind, index in (("calls", 0), ("values", 1)):
        by: dict[str, list[int]] = {}
        for r, text in zip(ranks, came):
            by.setdefault(text.split("\n", 1)[index], []).append(r)
        if len(by) > 1:
            return f"{kind}\n" + "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())
    return "same"


def enter(what: str, topology, ranks: Optional[Sequence[int]] = None) -> None:
    """The arrival check at the start of the collective call ``what`` of a model sharded with ``topology``: over
    ``ranks``, by default ``topology.stage_ranks`` (the ranks of its pipeline stage: the world when pp is 1), with
    ``topology``'s deadline (:func:`deadline`).

    Raises:
        RuntimeError: as :func:`check`.
    """
    check(what, topology.stage_ranks if ranks is None else ranks, deadline(topology))


def watchdog(seconds: float) -> None:
    """Start this process's watchdog thread (once; later calls only set its deadline to ``seconds``): a daemon that
    every ``seconds / 4`` (0.25 s to 15 s) looks at the blocking collectives this process waits in
    (``comm.waiting``) and reports, once per wait, one that has waited ``seconds`` or more: to stderr and to
    :data:`reports`, with the ranks that came to an arrival check this rank has not made ([Note: arrival checks])."""
    _watch["deadline"] = seconds
    if _watch["thread"] is None:
        _watch["thread"] = threading.Thread(target=_watch_loop, name="shardfusion-watchdog", daemon=True)
        _watch["thread"].start()


def _watch_loop() -> None:
    reported: set[tuple[int, float]] = set()
    while True:
        time.sleep(min(15.0, max(0.25, _watch["deadline"] / 4)))
        now = time.monotonic()
        for ident, (what, since) in list(comm.waiting.items()):
            if now - since >= _watch["deadline"] and (ident, since) not in reported:
                reported.add((ident, since))
                try:
                    text = _report(comm.describe_wait(what), now - since)
                except Exception as e:  # noqa: BLE001 - the process group may be gone: say so, never raise here
                    text = f"shardfusion watchdog: waiting {now - since:.0f} s in a collective ({e})"
                reports.append(text)
                print(text, file=sys.stderr, flush=True)


def _report(what: str, waited: float) -> str:
    """The watchdog's line for a collective ``what`` that has waited ``waited`` seconds."""
    rank = dist.get_rank()
    ahead = _ahead()
    head = f"shardfusion watchdog, rank {rank}: waiting for {waited:.0f} s in {what}"
    if ahead:
        return (f"{head}; " + "; ".join(f"ranks {rs} came to {call}, which rank {rank} has not called"
                                        for call, rs in ahead.items())
                + ": a collective call made on some ranks only (e.g. an evaluation or a state dict under `if rank == "
                  "0:`); every rank must make it. This rank waits on until the process group's timeout.")
    return (f"{head}, and no rank waits in one of shardfusion's collective calls that this rank has not made. Unless "
            f"a rank is only slow (a long save or data loading), {comm.LIKELY_CAUSES}. This rank waits on until the "
            "process group's timeout.")


def _ahead() -> dict[str, list[int]]:
    """The ranks whose next arrival check this rank has not made, by call: ``{call: ranks}`` (read from the
    store, one ``check`` per rank of each set of ranks)."""
    store = _store()
    ahead: dict[str, list[int]] = {}
    for tag, ranks in list(_ranks.items()):
        n = _counts.get(tag, 0) + 1
        for r in ranks:
            key = f"{_PREFIX}/{tag}/{n}/{r}"
            if store.check([key]):
                call, value = store.get(key).decode().split("\n", 1)
                ahead.setdefault(f"{call} ({value})" if value else call, []).append(r)
    return ahead
