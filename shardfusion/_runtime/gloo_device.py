"""The gloo groups a topology makes: one transport device for its groups of one rank (one network loop thread instead
of one per group), and their loop threads scheduled as batch work.

[Note: one gloo device for many groups]
Each ``ProcessGroupGloo`` that torch creates gets a transport device of its own, and each gloo TCP device runs a loop
thread that waits for socket events with a 10 ms timeout: it wakes a hundred times a second, also when its group
never communicates. A :class:`~shardfusion.topology.Topology` makes a group per mesh axis, per flattened axis set
and per twin, groups of one rank included (an axis of degree 1), so each process ran about a dozen such threads.
With fewer cores than busy threads every wake-up can preempt a training thread: DDP's step on 4 gloo ranks of the
2-core machine, with 12 idle one-rank groups per rank beside it, took about 1.05 x its step without them, and as
long as without them when those groups shared one device (``benchmarks/idle_groups.py``, its stored result
``benchmarks/results/idle-groups.md``).

Gloo serves many contexts from one device (its loop watches the sockets of all of them) and ``ProcessGroupGloo``
takes its devices in its options, but ``torch.distributed.new_group`` makes them itself. Inside
:func:`shared_gloo_device`, the ``ProcessGroupGloo`` that ``torch.distributed`` constructs for a group of one rank
is a subclass whose constructor passes one device set shared by the process (made as torch makes a group's own: one
device per interface of ``GLOO_SOCKET_IFNAME``, else the default device; two work threads per device, as torch).
A group of one rank has no peer and never sends, so sharing costs it nothing. Groups of several ranks keep a device
each: one loop for several busy groups serializes their socket reads (a trial that put every group of the
topology on one device made the HSDP 2 x 2 step slower, not faster). Everything else
about the groups is torch's; the default group, made by ``init_process_group``, keeps its own device.

[Note: gloo loop threads as batch work]
A gloo TCP pair has one lock. A thread that sends (the training thread's sends and receives, gloo's work threads in
a collective) holds it while it writes a whole message into the socket; the device's loop thread, woken because the
same socket has bytes to read, only tries the lock, and when it fails it returns to ``epoll_wait``, which reports the
same bytes at once: it polls in a tight loop until the writer lets go (a ``perf`` probe on ``pthread_mutex_trylock``
shows the failed tries, from ``Pair::handleEvents``, outnumbering the successful ones many times over). On a machine
with fewer cores than busy threads the woken loop thread also preempts the writer, which then holds the lock for
longer. Scheduled as ``SCHED_BATCH`` (Linux, ``sched(7)``: fair share as before, but a wake-up never preempts the
running thread), the loop thread waits for its turn instead, and the writer finishes. The loop threads started while
a topology makes its groups (:func:`shared_gloo_device`; also the node groups of ``secondary_shard.py``) are moved to
that policy: HSDP 2 x 2 and FSDP over 4 ranks under `after_backward` in `benchmarks/results/paired-gloo-batch.md`
and `paired-gloo-batch-fsdp4.md`; the exchange alone in `benchmarks/results/gloo-spin.md`. Threads of groups made
elsewhere (the default group, DDP's, torchft's) keep torch's scheduling, unless another thread makes one during that
window. A loop thread is found by the name it gives itself (``gloo_tcp_loop``, torch 2.13's gloo; an older gloo names
none, and then nothing changes); where the policy does not exist (not Linux) nothing changes either. On a node with
idle cores a wake-up finds an idle core and the policy makes no difference.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

import torch.distributed as dist

_lock = threading.RLock()  # a Topology made inside another's creation (same thread) may nest
_devices: list | None = None  # the process's shared device set, made at first use


def _shared_devices(gloo: type) -> list:
    """The devices the one-rank groups made in :func:`shared_gloo_device` use, made once per process as torch makes
    a group's own (``GLOO_SOCKET_IFNAME``: one device per listed interface; else the default device)."""
    global _devices
    if _devices is None:
        names = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if len(names) > 1:
            _devices = [gloo.create_device(interface=name) for name in names.split(",")]
        else:
            _devices = [gloo.create_default_device()]
    return _devices


@contextlib.contextmanager
def shared_gloo_device() -> Iterator[None]:
    """Within this context the gloo groups of one rank that ``torch.distributed`` creates share one transport device
    (see the note above; not on a torch whose gloo group takes no devices in its options); other groups are made as
    torch makes them. On leaving it, the gloo loop threads started within are scheduled as batch work ([Note: gloo
    loop threads as batch work]). One thread at a time patches torch (a lock)."""
    c10d = dist.distributed_c10d
    gloo = getattr(c10d, "ProcessGroupGloo", None)
    options = getattr(gloo, "_Options", None)
    patch = gloo is not None and options is not None and hasattr(options(), "_devices")

    class _SharedDeviceGloo(gloo if patch else object):
        def __init__(self, store, rank, size, timeout=None, **kwargs):
            if size > 1 or kwargs or not hasattr(timeout, "total_seconds"):  # made as torch makes it
                super().__init__(store, rank, size, *([] if timeout is None else [timeout]), **kwargs)
                return
            opts = options()
            opts._devices = devices = _shared_devices(gloo)  # made at the first one-rank group
            opts._threads = 2 * len(devices)
            opts._timeout = timeout
            super().__init__(store, rank, size, opts)

    with _lock:
        before = _thread_names()
        if patch:
            c10d.ProcessGroupGloo = _SharedDeviceGloo
        try:
            yield
        finally:
            if patch:
                c10d.ProcessGroupGloo = gloo
            _schedule_as_batch(_new_loop_threads(before))  # [Note: gloo loop threads as batch work]


def _thread_names() -> dict[int, str]:
    """``{thread id: name}`` of this process's threads, read from Linux ``/proc/self/task``; empty where that does
    not exist."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    names = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
    return names


def loop_threads() -> set[int]:
    """Thread ids of this process's gloo network loop threads (named ``gloo_tcp_loop``; empty where Linux
    ``/proc/self/task`` does not exist)."""
    return {tid for tid, name in _thread_names().items() if name == _LOOP}


def _new_loop_threads(before: dict[int, str], wait_s: float = 0.2) -> set[int]:
    """The loop threads started since ``before`` (:func:`_thread_names`). A thread is named by itself once it runs, so
    a new thread still bearing its creator's name may be a loop thread that has not run yet: waited for (at most
    ``wait_s`` seconds in all)."""
    creator = _thread_names().get(threading.get_native_id(), "")
    deadline = time.monotonic() + wait_s
    while True:
        new = {tid: name for tid, name in _thread_names().items() if tid not in before}
        if not any(name == creator for name in new.values()) or time.monotonic() > deadline:
            return {tid for tid, name in new.items() if name == _LOOP}
        time.sleep(0.001)


_LOOP = "gloo_tcp_loop"  # the name gloo's TCP loop thread gives itself (torch 2.13's gloo; older ones name none)


def _schedule_as_batch(tids: set[int]) -> None:
    """Move threads ``tids`` to ``SCHED_BATCH`` ([Note: gloo loop threads as batch work]); a thread that ended or a
    platform without the policy is left as it is."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            pass
