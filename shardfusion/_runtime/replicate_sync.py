"""The replicate all-reduces overlapped with a step's last backward, issued in one fixed order on every rank.

[Note: overlapped replicate all-reduce]
Under HSDP each flat buffer's sharded gradient is all-reduced over its replicate (outer) group once per optimizer
step. Overlapped with the step's last backward, the all-reduce of a unit can start only once its reduce-scatter
has completed (it reduces that reduce-scatter's output). When that is tested by polling (``is_completed()``), the
point where a rank issues the all-reduce depends on timing, so ranks interleave the replicate group's collectives
with the shard groups' all-gathers and reduce-scatters differently. Collectives on different groups are independent
in the backends, but anything that blocks the issuing thread until the whole group has joined turns a different
interleaving into a deadlock: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks each collective's fingerprint that way, and
a blocking wait would as well. So the hand-off point is fixed by the program, not by timing: a unit's all-reduce is
handed off right after its reduce-scatter is issued (``FlatBuffer.hand_off_sync``), in the reduce order, and then

- for CPU tensors (gloo, whose waits block the host) one worker thread per model runs the hand-offs in that order:
  wait for the reduce-scatter, add its output into the step's gradient, issue the all-reduce (asynchronously, so the
  next unit's can follow it onto the link at once; a compressed one, a sequence of collectives, runs to its end).
  The backward's thread waits for a job's reduce-scatter part only (``wait_reduced``, at the fixed points of
  [Note: gradient reductions in flight] in ``scheduler.py``), never for its all-reduce; only the worker issues
  collectives on the replicate group until ``join`` (the step boundary), and the all-reduces are waited for where
  their buffer takes the result back;
- for device tensors (NCCL) the same runs inline at the hand-off: waits there only order streams, the host goes on;
  so it does in a dry run (``shardfusion.dry_run``: fake groups and tensors, one thread).

The replicate group is a group of its own (``Topology``'s ``replicate`` twin), so the worker's all-reduces never
share a group with the backward's all-gathers and reduce-scatters. Buffers whose replicate group is shared with other
collectives (kept-whole buffers: the data-parallel group; experts under the ``shard`` policy: the dp group) are not
handed off; they are all-reduced at the step boundary.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Optional, Protocol

import torch

from shardfusion import comm


def add_reduced(target: torch.Tensor, out: torch.Tensor, divisor: float, predivided: bool, fresh: bool) -> None:
    """Add a reduce-scatter's output into a step's gradient: ``target += out / divisor`` (``out`` as it is when
    ``predivided``). ``fresh``: ``target`` holds nothing yet (allocated or taken for this step without being
    zeroed) and is overwritten, ``target = out / divisor``: one pass over the shard instead of three (zero-fill,
    divide, add), with the same values (``0 + x == x``).

    ``target`` and ``out`` are ``(S,)``: ``target`` in the shard's dtype, ``out`` in the gradient's communication
    dtype (upcast on the way in); ``out`` may be modified.
    """
    if fresh:
        if predivided:
            target.copy_(out)
        else:
            torch.div(out, divisor, out=target)
        return
    if not predivided:
        out.div_(divisor)
    target.add_(out)  # upcast into the shard's dtype


class SyncedBuffer(Protocol):
    """What :class:`OverlappedSync` reads of its buffer, a ``flat_buffer.FlatBuffer`` (declared here, not imported:
    ``flat_buffer`` imports this module)."""

    grad_divisor: float
    """What the reduced gradient is divided by (the data-parallel size)."""

    @property
    def _predivide(self) -> bool:
        """Whether the gradient was divided before the reduce-scatter (else its output is divided here)."""
        ...

    def _collective(self, op: str) -> str:
        """``op`` and whose buffer it moves, for error messages."""
        ...

    def start_all_reduce_replicas(self, grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Issue the all-reduce of ``grad`` ((S,)) over the replicate group: ``(result, work or None)``."""
        ...


class OverlappedSync:
    """One buffer's handed-off step: finish its reduce-scatter (if still running) and all-reduce the step's gradient.

    Args:
        buffer: the :class:`SyncedBuffer` (a ``FlatBuffer``; read for its groups, divisor and dtypes; not
            modified).
        target: ``(S,)`` the step's gradient accumulator in the shard's dtype; the reduce-scatter output is added into
            it before the all-reduce.
        reduce_work: the reduce-scatter's work handle, or None (already waited for).
        reduce_out: ``(S,)`` the reduce-scatter's output in ``grad_comm_dtype``, or None (already added).
        fresh: ``target`` was taken for this step without being zeroed: the output is written into it, not added
            (:func:`add_reduced`); requires ``reduce_out``.
    """

    def __init__(self, buffer: SyncedBuffer, target: torch.Tensor, reduce_work: Any,
                 reduce_out: Optional[torch.Tensor], fresh: bool = False) -> None:
        if fresh and reduce_out is None:
            raise ValueError("OverlappedSync: fresh=True needs reduce_out (an unwritten target would be all-reduced)")
        self.buffer, self.target, self._fresh = buffer, target, fresh
        self._reduce_work, self._reduce_out = reduce_work, reduce_out
        self._done = threading.Event()
        self._reduced = threading.Event()  # the reduce-scatter is complete and its buffers released
        self._result: Optional[torch.Tensor] = None
        self._work: Any = None  # the all-reduce in flight (None: completed, or a compressed one, run to its end)
        self._error: Optional[BaseException] = None

    def run(self) -> None:
        """Wait for the reduce-scatter, add its output, issue the all-reduce over the replicate group."""
        b = self.buffer
        try:
            with torch.no_grad():
                if self._reduce_work is not None:
                    comm.wait(self._reduce_work, b._collective("reduce_scatter"))
                if self._reduce_out is not None:
                    add_reduced(self.target, self._reduce_out, b.grad_divisor, b._predivide, self._fresh)
                self._reduce_work = self._reduce_out = None
                self._reduced.set()
                self._result, self._work = b.start_all_reduce_replicas(self.target)
        except BaseException as e:  # re-raised on the thread that waits for the result
            self._error = e
        finally:
            self._reduced.set()
            self._done.set()

    def wait_reduced(self) -> None:
        """Wait until :meth:`run` has completed the reduce-scatter and released its buffers (the all-reduce may
        still run; an error is raised by :meth:`result`)."""
        self._reduced.wait()

    def result(self) -> torch.Tensor:
        """Wait for :meth:`run`; the all-reduced gradient, ``(S,)`` (``target`` itself or a copy in the
        communication dtype). Raises what ``run`` raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._work is not None:
            work, self._work = self._work, None
            comm.wait(work, self.buffer._collective("all_reduce"))
        return self._result


class ReplicateSyncQueue:
    """Runs handed-off all-reduces in the order they are submitted: on one worker thread (daemon, started on first
    use) for CPU tensors, inline for device tensors (see the note above)."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Optional[OverlappedSync]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._pending: list[OverlappedSync] = []

    def submit(self, job: OverlappedSync) -> None:
        """Run ``job`` after every job submitted before it: now, for a device tensor; on the worker thread, for a CPU
        one. Never blocks the caller on CPU; errors are kept in the job (raised by ``OverlappedSync.result``)."""
        self._pending.append(job)
        # a dry run's fake tensors (shardfusion.dry_run) are not for two threads at once: inline, as on a device
        if job.target.device.type != "cpu" or comm.is_fake():
            job.run()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="shardfusion-replicate-sync", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.run()

    def join(self) -> None:
        """Wait until every submitted all-reduce has completed (errors are raised by ``OverlappedSync.result``,
        when their buffer takes the result back)."""
        pending, self._pending = self._pending, []
        for job in pending:
            job._done.wait()
