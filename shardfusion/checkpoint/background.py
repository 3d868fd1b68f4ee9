"""Asynchronous checkpoint saves: ``save_checkpoint(..., async_save=True)`` starts copying this rank's part off the
model and optimizer, starts the write behind the step loop and returns an :class:`AsyncSave` handle.

[Note: asynchronous saves]
What a save holds, per rank:

- the *staging copy*: a copy of every tensor this rank writes (its primary fragments of the parameters, their
  optimizer state, the persistent buffers and its ``rank_state``), so that the step loop may go on and change the
  originals. Host memory: pinned for tensors on a CUDA device (copies at the link's speed), plain for CPU tensors;
  the same bytes as the rank's data file (``shardfusion.checkpoint.staging_bytes`` counts them, the dry run reports
  them). It is kept after the write and reused by the next save (a copy into memory already faulted in is about
  3 x faster on the CPU than into new memory), so it stays allocated from the first asynchronous save to the end of
  the process. Non-tensor values (``meta``, the caller's ``extra``) are deep-copied.
- *where the copy is made*: the tensors that only an optimizer step changes (``save_load._copied_behind``: in host
  memory, of the parameters the optimizers given to the save update: their fragments and their optimizer state)
  are copied on a staging thread while the step loop goes on, the rest (buffers, which a forward may change;
  ``rank_state``; tensors on a CUDA device, whose copy would queue on the step's stream anyway; everything when no
  optimizer is given) on the calling thread before ``save_checkpoint`` returns. A forward and a backward only read
  the parameters and the optimizer state, so the copy may run beside them; whatever writes them waits for it
  (``AsyncSave.wait_staged``): each optimizer given to an asynchronous save gets a step pre-hook (installed once,
  kept; it returns at once when no copy is being made), and the next ``save_checkpoint``, ``wait()``,
  ``sf.checkpoint.load`` and ``load_full_state`` wait too. The contract for user code: until ``wait_staged()``
  returns, the parameters and the optimizer state may be read (forward, backward, clipping the gradients, reading
  ``param_groups``) but not written other than by those calls: an update by hand (``p.add_(...)`` under
  ``no_grad``, ``model.load_state_dict``, ``optimizer.load_state_dict``, a step of an optimizer not given to the
  save) must call ``handle.wait_staged()`` first, else the checkpoint may hold some of the new values.
  ``param_groups`` (the hyperparameters) are in ``meta``, copied before the call returns: a scheduler may change them.
- the *write*: ``torch.distributed.checkpoint.async_save`` runs DCP's save of the staging copy on one background
  thread (after the staging thread's copy: the stager hands DCP a future), with its collectives (the plan's gather
  and scatter, the commit's gather) on a process group of its own (gloo, every rank of the default group, created by
  the first asynchronous save), so that they never interleave with the step's collectives on the default group.
  Rank 0 prepares ``tmp-step-<n>`` in DCP's global plan (after every rank's local plan, before any rank writes a
  file), and publishes the checkpoint on that thread once DCP's save has returned there, i.e. after DCP's commit
  gathered every rank's write results and wrote ``.metadata``: a checkpoint is published (``step-<n>`` renamed,
  ``latest`` replaced, older ones pruned, as :func:`shardfusion.checkpoint.folder.publish`) only when every rank's
  files are complete. A process killed before that leaves a ``tmp-step-<n>`` folder, which
  :func:`shardfusion.checkpoint.latest_checkpoint` never returns. A staging copy that fails (on either thread) is
  raised in DCP's local plan, which DCP gathers from every rank, so no rank's write waits for it.
- the *agreement*: at :meth:`AsyncSave.wait` (an arrival check, one ``all_gather_object``), and at the start of the
  next ``save_checkpoint`` (inside the gather of its arguments' check: no collective more), each rank waits for its
  own part of the save in flight, then the ranks exchange their outcomes, so that a write that failed on any rank,
  or a publish that failed on rank 0, raises the same ``ValueError`` on every rank and no rank is left waiting in a
  collective. One save is in flight at a time per process.

The stall of the step loop is therefore what any save begins with (the arrival check, then one gather that carries
the arguments' check, the outcome of the previous save, after waiting for it if its write has not ended, and what
every rank holds, for ``meta``), the staging copy made on the calling thread (small, unless tensors are on a GPU or
no optimizer is given), the start of DCP's thread, and the optimizer step's wait for the staging copy when the
forward and backward after the save took less time than the copy; the folder, the write and the publish run behind.
On a CPU the copy behind, like the write, takes CPU time from the steps beside it: it is hidden where there are
spare cores. ``SHARDFUSION_TEST_SAVE_DELAY_S`` (tests only) delays each background write by that many seconds
before its first byte, so that a test can kill a job while a write is in flight.

The design follows torch's own (a staging copy, then ``dcp.save`` on a thread, ``async_save``'s documentation asks
for a CPU-capable group of its own; its ``DefaultStager`` with ``use_async_staging`` stages on a thread too, and
leaves the wait to the caller); the publish after the commit, the agreement on failures and the optimizer's wait for
the copy are ours.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager

from shardfusion import arrival, comm
from shardfusion.checkpoint.folder import prepare, publish
from shardfusion.checkpoint.inventory import by_ranks
from shardfusion.checkpoint.planners import FragmentSavePlanner
from shardfusion.checkpoint.read import failure_text

DELAY_ENV = "SHARDFUSION_TEST_SAVE_DELAY_S"
"""Environment variable (tests only): seconds each background write waits before it writes its first byte."""

_in_flight: list[Optional["AsyncSave"]] = [None]  # the save not yet agreed on (one per process)
_group: dict[str, Any] = {"world": None, "group": None}  # the write's process group, per default group
_staged: dict[str, torch.Tensor] = {}  # the last staging copy, by key: reused by the next save
_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose step waits (_before_step)
_WHOLE = "shardfusion/whole"  # the one key under which start() hands the state dict to dcp.async_save


class AsyncSave:
    """The handle of one asynchronous :func:`shardfusion.checkpoint.save_checkpoint` (see [Note: asynchronous
    saves]).

    Attributes:
        path: the folder the checkpoint is published as, ``root/step-<step>``.
        step: the step it was saved at.
    """

    def __init__(self, root: str, step: int, keep: int, deadline: Optional[float] = None) -> None:
        self.path, self.step = os.path.join(root, f"step-{step}"), step
        self._root, self._keep, self._deadline = root, keep, deadline
        self._finished = threading.Event()
        self._copied = threading.Event()  # the staging copy is made (or failed)
        self._error: Optional[str] = None  # this rank's failure, set by the background thread
        self._outcome: Optional[tuple[Optional[str]]] = None  # after the agreement: (every rank's failure or None,)
        self._release = lambda: None  # the end of the numpy-free block of the write (start), once

    def wait_staged(self) -> None:
        """Wait until this rank's staging copy is made (or has failed: the failure is raised by ``wait()`` or the
        next save, on every rank). Local: no collective. Afterwards the parameters and the optimizer state may
        change: the checkpoint holds the values they had at the ``save_checkpoint`` call. Needed only before
        changing them in place other than by a step of the optimizers given to the save (see [Note: asynchronous
        saves]: those steps, the next save and ``sf.checkpoint.load`` wait by themselves)."""
        self._copied.wait()

    def done(self) -> bool:
        """Whether this rank's part (its write, and on rank 0 the publish) has ended, well or not. Local: no
        collective, never blocks."""
        return self._finished.is_set()

    def wait(self) -> str:
        """Wait until the checkpoint is written by every rank and published; return its folder (``path``).

        Collective over the default process group (an arrival check, then one ``all_gather_object``): every rank
        calls it; unless the ranks have agreed on this save already (an earlier ``wait()``, or the next
        ``save_checkpoint``, which agrees on the save in flight): then it returns at once, or raises the same error
        again, with no collective.

        Raises:
            RuntimeError: on the ranks that called it, within the arrival deadline: some rank did not.
            ValueError: on every rank: a rank could not stage or write its part, or rank 0 could not prepare the
                folder (``asynchronous save of <path> failed: ranks 0-3: checkpoint <tmp> cannot be written: rank
                r: ...``), or rank 0 could not publish it (``... failed: rank 0: cannot publish ...``); the
                checkpoint is then not published (the previous one stays the latest).
        """
        if self._outcome is None:
            arrival.check("sf.checkpoint.AsyncSave.wait", None, self._deadline)
        return self._agree()

    def _agree(self) -> str:
        """:meth:`wait` without the arrival check: this rank's outcome, every rank's gathered, then :meth:`settle`."""
        if self._outcome is not None:
            return self.settle([])
        mine = self.local_outcome()
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = comm.all_gather_object(mine, None, f"the outcome of the asynchronous save of {self.path}")
        return self.settle(every)

    def local_outcome(self) -> Optional[str]:
        """Wait for this rank's part of the save (no collective); its failure, or None."""
        self._finished.wait()
        return self._error

    def settle(self, outcomes: list[Optional[str]]) -> str:
        """Agree on the save from every rank's :meth:`local_outcome` (in rank order; ignored once agreed): it is no
        longer in flight; returns ``path``.

        Raises:
            ValueError: a rank's outcome is a failure (every rank raises it: each has the same outcomes).
        """
        if self._outcome is None:
            found = by_ranks([[error] if error else [] for error in outcomes])
            self._outcome = (f"asynchronous save of {self.path} failed: " + "; ".join(found) if found else None,)
            if _in_flight[0] is self:
                _in_flight[0] = None
        if self._outcome[0] is not None:
            raise ValueError(self._outcome[0])
        return self.path

    def _written(self, future) -> None:
        """Runs on the background thread when DCP's save ends: record a failure, or on rank 0 publish."""
        tmp = os.path.join(self._root, f"tmp-step-{self.step}")
        try:
            future.result()
            if not dist.is_initialized() or dist.get_rank() == 0:
                try:
                    publish(self._root, self.step, self._keep)
                except Exception as error:  # noqa: BLE001 - agreed on every rank at wait()
                    self._error = f"cannot publish {tmp!r} as {self.path!r}: {type(error).__name__}: {error}"
        except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._error = f"checkpoint {tmp!r} cannot be written: {failure_text(error, with_ranks=True)}"
        finally:
            self._release()
            self._copied.set()  # (set already, unless the write never began)
            self._finished.set()


def in_flight() -> Optional[AsyncSave]:
    """The asynchronous save of this process not yet agreed on (its write may have ended), or None."""
    return _in_flight[0]


def wait_staged() -> None:
    """Wait for the staging copy of the asynchronous save in flight, if any (:meth:`AsyncSave.wait_staged`).
    Local: no collective; returns at once when no copy is being made."""
    handle = _in_flight[0]
    if handle is not None:
        handle.wait_staged()


def _before_step(optimizer, args, kwargs) -> None:
    """The step pre-hook of every optimizer given to an asynchronous save: the step waits for the staging copy."""
    wait_staged()


def _hook(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Make each step of ``optimizers`` wait for the staging copy in flight (a pre-hook, installed once per
    optimizer and kept: it returns at once when no copy is being made)."""
    for optimizer in optimizers:
        if optimizer not in _hooked:
            optimizer.register_step_pre_hook(_before_step)
            _hooked.add(optimizer)


def staged(value: Any, into: Optional[torch.Tensor] = None) -> Any:
    """A copy of ``value`` that later changes of the original do not reach: a tensor copied to host memory (pinned
    when it is on a CUDA device), into ``into`` when that is a tensor of the same shape, strides, dtype and pinning
    (the previous save's copy: no new memory to allocate and fault in), else into new memory; anything else
    deep-copied. (The state dict of a save holds plain tensors only: a tensor-parallel parameter's fragment is a
    plain tensor too.)"""
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    pinned = value.is_cuda
    if not (torch.is_tensor(into) and into.shape == value.shape and into.stride() == value.stride()
            and into.dtype == value.dtype and into.is_pinned() == pinned):
        into = torch.empty_like(value, device="cpu", pin_memory=pinned)
    return into.copy_(value.detach())


class _Stager(AsyncStager):
    """Makes the staging copy (``staged``) into the previous save's copies where they fit (``_staged``: the staging
    copy is kept from one save to the next, the previous write having ended before the next save stages): the keys
    ``behind`` on a thread of its own, which DCP's write thread waits for (``stage`` returns a future), the others on
    the calling thread. A failure is kept for the writer to raise (see :class:`_Writer`), so that DCP reports it on
    every rank instead of leaving the other ranks' writes waiting for this one; ``handle``'s ``wait_staged`` returns
    once the copy is made or has failed."""

    _synchronize_after_execute = False

    def __init__(self, handle: AsyncSave, behind: frozenset[str]) -> None:
        self.error: Optional[BaseException] = None
        self._handle, self._behind = handle, behind
        self._thread: Optional[threading.Thread] = None

    def stage(self, state_dict: dict[str, Any]) -> Any:
        """The staging copy of ``state_dict[_WHOLE]`` (see :func:`start`), as the flat state dict DCP writes, or a
        future of it when keys are copied behind."""
        whole = state_dict[_WHOLE]
        copies: dict[str, Any] = {}
        if not self._copy(copies, [(key, value) for key, value in whole.items() if key not in self._behind]):
            return self._finish(whole, copies)
        later = [(key, value) for key, value in whole.items() if key in self._behind]
        if not later:
            return self._finish(whole, copies)
        future: Future = Future()
        self._thread = threading.Thread(target=self._behind_loop, args=(future, whole, copies, later),
                                        name="shardfusion-staging", daemon=True)
        self._thread.start()
        return future

    def _behind_loop(self, future: Future, whole: dict, copies: dict, later: list) -> None:
        """The staging thread: copy ``later``, then hand DCP's write thread the state dict (always: it waits)."""
        result: dict[str, Any] = {}
        try:
            result = self._finish(whole, copies, later)
        except BaseException as error:  # noqa: BLE001 - raised in this rank's write, gathered by DCP's commit
            self.error = self.error or error
        future.set_result(result)

    def _copy(self, copies: dict[str, Any], items: list) -> bool:
        """Copy ``items`` into ``copies``; False (the error kept) when one fails."""
        try:
            copies.update((key, staged(value, _staged.get(key))) for key, value in items)
            return True
        except Exception as error:  # noqa: BLE001 - raised in this rank's write, gathered by DCP's commit
            self.error = error
            return False

    def _finish(self, whole: dict, copies: dict, later: Optional[list] = None) -> dict[str, Any]:
        """Copy ``later``, keep the copy for the next save, and say the copy is made; the flat state dict (empty
        after a failure). Never raises (on the staging thread, DCP's write thread waits for its result)."""
        try:
            if later and self.error is None:
                self._copy(copies, later)
            _staged.clear()
            if self.error is not None:
                return {}
            _staged.update((key, copy) for key, copy in copies.items() if torch.is_tensor(copy))
            return {key: copies[key] for key in whole}  # the state dict's order
        finally:
            self._handle._copied.set()

    def join(self) -> None:
        """Wait for the staging thread, if one was started."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """DCP's stager interface: nothing to release (the copy is kept for the next save)."""


class _Writer(FileSystemWriter):
    """DCP's file system writer of ``root/tmp-step-<step>``, which raises this rank's staging failure in its local
    plan (DCP gathers the local planning errors of every rank and raises them on every rank, before anything is
    written), on the coordinator (rank 0) prepares the folder in the global plan (``folder.prepare``: what a crashed
    save of this step left is removed; every rank has made its local plan then, and none has written yet), and waits
    ``delay`` seconds before writing (``SHARDFUSION_TEST_SAVE_DELAY_S``)."""

    def __init__(self, root: str, step: int, stager: _Stager, delay: float) -> None:
        super().__init__(os.path.join(root, f"tmp-step-{step}"))
        self._root, self._step, self._stager, self._delay = root, step, stager, delay

    def prepare_local_plan(self, plan):
        """DCP's local plan, after raising this rank's staging failure (DCP gathers it from every rank)."""
        if self._stager.error is not None:
            raise self._stager.error
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        """On the coordinator: prepare ``tmp-step-<step>`` (every rank has planned, none has written), then DCP's."""
        prepare(self._root, self._step)
        self.fs.mkdir(self.path)
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        """DCP's write, after the test-only delay (``SHARDFUSION_TEST_SAVE_DELAY_S``)."""
        if self._delay > 0:
            time.sleep(self._delay)
        return super().write_data(plan, planner)


def write_delay() -> float:
    """Seconds of ``SHARDFUSION_TEST_SAVE_DELAY_S`` (0 when unset or empty).

    Raises:
        ValueError: a value that is not a number >= 0, naming the variable.
    """
    text = os.environ.get(DELAY_ENV, "").strip()
    try:
        seconds = float(text) if text else 0.0
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{DELAY_ENV} must be a number of seconds >= 0, got {text!r}")
    return seconds


def _once(action):
    """``action`` made callable any number of times, running it the first time only."""
    lock, done = threading.Lock(), []

    def run() -> None:
        with lock:
            if not done:
                done.append(True)
                action()
    return run


def _checkpoint_group(timeout) -> Optional[dist.ProcessGroup]:
    """The background writes' gloo group of every rank (created once per default group; collective the first
    time), or None without a process group."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _group["world"] is not world:
        _group["group"] = dist.new_group(backend="gloo", timeout=timeout)
        _group["world"] = world
    return _group["group"]


def start(sd: dict[str, Any], fragments: dict, root: str, step: int, keep: int, topology=None,
          optimizers: Iterable[torch.optim.Optimizer] = (), behind: frozenset[str] = frozenset()) -> AsyncSave:
    """Stage ``sd`` (the state dict of ``save_load._state_dict``, written to ``root/tmp-step-<step>``) and start its
    write behind; returns the handle, which is also the save in flight. Every rank
    calls it; a failure to start on this rank is agreed on at the next agreement. ``topology``: the model's
    (``shardfusion.Topology``): its ``timeout`` for the writes' process group (created at the first call; None:
    torch's default) and its arrival deadline for ``wait()``. ``behind``: the keys copied on the staging thread
    (``save_load._copied_behind``: tensors that only a step of ``optimizers`` changes), while the step loop goes
    on; each step of ``optimizers`` waits for that copy (a step pre-hook)."""
    handle = AsyncSave(root, step, keep, arrival.deadline(topology))
    _in_flight[0] = handle
    stager = _Stager(handle, behind)
    try:
        delay, group = write_delay(), _checkpoint_group(getattr(topology, "timeout", None))
        _hook(optimizers)
        numpy_free = comm.torch_object_collectives_without_numpy()  # DCP's object collectives on the thread
        numpy_free.__enter__()
        handle._release = _once(lambda: numpy_free.__exit__(None, None, None))
        # under one key: async_save wraps each top-level entry in a logged call on the calling thread (about 0.1 ms
        # per entry, hundreds of entries); the stager unwraps it, and DCP's save on the thread sees the flat dict
        # a staging future makes DCP answer with both futures: the write's is upload_completion
        response = dcp.async_save({_WHOLE: sd}, storage_writer=_Writer(root, step, stager, delay),
                                  planner=FragmentSavePlanner(fragments), process_group=group, async_stager=stager,
                                  no_dist=not dist.is_initialized())
        getattr(response, "upload_completion", response).add_done_callback(handle._written)
    except Exception as error:  # noqa: BLE001 - agreed on every rank at the next save or wait()
        handle._error = f"cannot start the asynchronous save of {handle.path!r}: {type(error).__name__}: {error}"
        stager.join()  # the copy into _staged ends before the next save may reuse it
        handle._release()
        handle._copied.set()
        handle._finished.set()
    return handle
