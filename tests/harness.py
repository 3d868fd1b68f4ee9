"""Multi-process test harness: run one function on `world_size` gloo ranks and collect what each rank returns.

    results = run_distributed(fn, world_size, *args, timeout=120, **kwargs)   # results[rank] = fn(*args, **kwargs)

Each rank is a fresh process, so `fn` must be defined at the top level of an importable module and its arguments
and result must pickle (results, tensors included, are pickled by value). Ranks are forked from a multiprocessing
"forkserver" that has imported torch and shardfusion once (a fresh interpreter importing them costs about 3.5 s of
CPU per rank, which over the suite's jobs is minutes on two cores); a job whose `env` must be in place when the
process starts (e.g. `MALLOC_MMAP_THRESHOLD_`, read by glibc at start-up) gets "spawn" instead. Ranks meet
through a FileStore in a private temporary directory (no ports to race for). Every worker runs single-threaded
(OMP_NUM_THREADS=1, torch.set_num_threads(1)): the CI machine has two cores and up to eight ranks share them.

Failure is loud and bounded:
* a rank that raises makes the parent raise `DistributedTestError` with that rank's traceback (the other ranks,
  likely stuck in a collective, are killed);
* a rank that dies without a result (segfault, os._exit) is reported with its exit code;
* a job that runs past `timeout` seconds is killed and reported with the function, the world size and the ranks
  that did not finish. A test never hangs.

Tests pay process start-up (about a second of CPU per rank) once per job, so a grid of configurations runs as
sub-cases of one job: `fn` loops over the cases and returns a result per case (docs/design.md, "Conventions").

The integration tests run whole commands instead (`python -m shardfusion.train`, torchrun, scripts):

    result = run_command([sys.executable, "-m", "shardfusion.train", *flags], timeout=150)   # CompletedProcess
    result = run_train(flags)                                                                  # the same
    ours, reference = run_trains(flags, reference_flags)     # independent runs started together (one core each)
    reference = start_train(reference_flags)   # going on while the test runs others; reference.finish() collects it

in a session of their own (a hung command is killed with its children), with `clean_env()`, from the repository
root `REPO`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
"""The repository root: the working folder of the integration tests' commands."""

# Environment of every worker. Set in the parent around process start so that it is in place before the child
# imports torch (OpenMP reads OMP_NUM_THREADS once, at load).
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
}

# Variables of a job's `env` that a forked worker can still apply after torch was imported (the rest need spawn).
_APPLIED_AFTER_IMPORT = {"TORCH_DISTRIBUTED_DEBUG"}  # re-read by torch.distributed.set_debug_level_from_env()
# What the forkserver imports once for every job's ranks. torch._dynamo before shardfusion: the hooks then get
# torch.compiler.disable at once (shardfusion/_runtime/compile_disable.py) instead of importing Dynamo in each rank at
# its first forward. The checkpoint and pipeline modules are imported by shardfusion when first used, so per rank
# without them here.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "shardfusion", "shardfusion.checkpoint.save_load",
            "shardfusion.pipeline"]

# Seconds the parent waits for the other ranks' reports once one rank has failed (they are usually stuck).
_GRACE_AFTER_FAILURE_S = 3.0
# Characters of traceback shown for each rank that failed after the first one.
_ECHO_CHARS = 1500


class DistributedTestError(AssertionError):
    """A distributed job failed: a rank raised, died, or the job timed out."""


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _worker(rank: int, world_size: int, store_path: str, pg_timeout_s: float, env: dict[str, str],
            result_queue, fn: Callable, args: tuple, kwargs: dict) -> None:
    """Body of one rank: init gloo, run fn, report ("ok", result) or ("error", traceback) through the queue."""
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.set_debug_level_from_env()  # read when torch.distributed was imported, maybe before `env` (forkserver)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        initialized = True
        result = fn(*args, **kwargs)
        _wait_for_peers(store, world_size, pg_timeout_s)
        # The standard pickler copies tensor data into the bytes. (The queue's own pickler would pass tensors as
        # shared-memory handles that die with this process, before the parent has read them.)
        report = (rank, "ok", pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - everything, including SystemExit/KeyboardInterrupt, is reported
        report = (rank, "error", traceback.format_exc())
        # Report before tearing down: tearing down makes the peers fail too, and the first report names the cause.
        result_queue.put(report)
        report = None
    if initialized:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown is best effort; a failed peer must not cause a hang here
            pass
    if report is not None:
        result_queue.put(report)


def _wait_for_peers(store, world_size: int, timeout_s: float) -> None:
    """Return once every rank's ``fn`` has returned (or after ``timeout_s``). A rank that tore its process groups
    down while a peer was still connecting one of them (gloo's connectFullMesh, which completes on one side of a
    pair before the other) made that peer fail with "Connection closed by peer". A store counter, not a collective,
    so that it works whatever state ``fn`` left the default group in; the last rank to return sets the key the
    others wait for."""
    if store.add("harness/returned", 1) >= world_size:
        store.set("harness/all_returned", "1")
        return
    try:
        store.wait(["harness/all_returned"], timedelta(seconds=timeout_s))
    except RuntimeError:  # a peer failed or hangs: the parent reports it and ends this process
        pass


def _context(env: dict[str, str] | None):
    """The multiprocessing context of a job: the preloaded forkserver, or spawn when ``env`` holds a variable that
    must be set before the process starts."""
    if set(env or {}) - _APPLIED_AFTER_IMPORT:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the forkserver (once) with this process's environment plus ``WORKER_ENV`` and nothing of any job's
    ``env``: it keeps the environment it started with, and every worker forked from it inherits that. (Started
    lazily by the first ``Process.start()`` instead, it would keep the env of the first job, e.g. a DETAIL debug
    level, for every later job.)"""
    from multiprocessing import forkserver

    with _environment(WORKER_ENV):
        forkserver.ensure_running()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``os.environ`` updated with ``values`` inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                    env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the list of per-rank results (index = rank).

    `timeout` bounds the whole job (start-up included) in seconds; `env` adds environment variables to every worker
    (e.g. {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}). The names `timeout` and `env` are therefore not passed to `fn`.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    name = _describe(fn)
    ctx = _context(env)
    result_queue = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="sf_dist_")
    store_path = os.path.join(tmpdir, "store")
    worker_env = dict(WORKER_ENV, **(env or {}))
    # The process-group timeout is shorter than the job's, so a stuck collective usually surfaces as an error
    # with a traceback rather than as a kill.
    pg_timeout_s = max(5.0, min(0.5 * timeout, 60.0))

    procs = []
    with _environment(worker_env):
        for rank in range(world_size):
            p = ctx.Process(target=_worker, name=f"rank{rank}",
                            args=(rank, world_size, store_path, pg_timeout_s, worker_env, result_queue, fn, args,
                                  kwargs),
                            daemon=True)
            p.start()
            procs.append(p)

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    failure_deadline = None
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            limit = deadline if failure_deadline is None else min(deadline, failure_deadline)
            if now >= limit:
                break
            try:
                rank, status, payload = result_queue.get(timeout=min(0.2, limit - now))
            except queue.Empty:
                # A rank that died without reporting will never report: stop waiting for it.
                dead = [r for r, p in enumerate(procs)
                        if r not in results and r not in errors and not p.is_alive() and p.exitcode is not None]
                if dead:
                    # Drain reports that may still be in flight from a rank that exited normally.
                    time.sleep(0.2)
                    while True:
                        try:
                            rank, status, payload = result_queue.get_nowait()
                        except queue.Empty:
                            break
                        if status == "ok":
                            results[rank] = pickle.loads(payload)
                        else:
                            errors[rank] = payload
                    for r in dead:
                        if r not in results and r not in errors:
                            errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting a result"
                    if errors and failure_deadline is None:
                        failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                if failure_deadline is None:
                    failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if not errors and len(results) == world_size else 0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        result_queue.close()
        shutil.rmtree(tmpdir, ignore_errors=True)

    if errors:
        first = next(iter(errors))  # the first rank to report an error: usually the cause, the others its echo
        others = sorted(set(errors) - {first})
        unfinished = sorted(set(range(world_size)) - set(results) - set(errors))
        msg = [f"{name} failed on rank {first} (world_size={world_size})."]
        if others:
            msg.append(f"Ranks {others} failed after it (their tracebacks follow rank {first}'s).")
        if unfinished:
            msg.append(f"Ranks {unfinished} did not finish and were killed.")
        msg.append(f"--- rank {first} ---\n{errors[first]}")
        for r in others:  # usually echoes of the first failure: their last lines are enough
            tail = errors[r] if len(errors[r]) <= _ECHO_CHARS else "...\n" + errors[r][-_ECHO_CHARS:]
            msg.append(f"--- rank {r} ---\n{tail}")
        raise DistributedTestError("\n".join(msg))
    if len(results) < world_size:
        unfinished = sorted(set(range(world_size)) - set(results))
        raise DistributedTestError(
            f"{name} timed out after {timeout:.0f}s (world_size={world_size}): ranks {unfinished} did not finish "
            f"and were killed; ranks {sorted(results)} finished. A collective is probably mismatched across ranks.")
    return [results[r] for r in range(world_size)]


# --- whole commands (integration tests) -------------------------------------------------------------------------


def raised(fn: Callable[[], Any]) -> tuple:
    """``(type name, message)`` of the exception ``fn()`` raises, or ``(None, None)``: for a rank to report an
    expected error back to the test, which asserts its type and words."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
        return type(e).__name__, str(e)
    return None, None


def clean_env() -> dict[str, str]:
    """This environment without torchrun's variables, and one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


class Started:
    """A command started by `start_command` and still running: `finish()` waits for it and returns its result,
    `stop()` kills it (and every process it started) if it still runs."""

    def __init__(self, command: list[str], timeout: float, env: dict[str, str] | None) -> None:
        self.command, self.timeout = command, timeout
        self.deadline = time.monotonic() + timeout
        self.process = subprocess.Popen(command, cwd=REPO, env=clean_env() if env is None else env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.result: subprocess.CompletedProcess | None = None

    def finish(self) -> subprocess.CompletedProcess:
        """Its result once it has ended and closed its output (every process it started holds the pipes); past its
        `timeout` seconds from the start it is killed with every process it started, and AssertionError shows the
        end of its output."""
        if self.result is None:
            try:
                stdout, stderr = self.process.communicate(timeout=max(0.1, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                stdout, stderr = self.process.communicate()
                raise AssertionError(f"{self.command} ran over {self.timeout} s:\n{stdout[-3000:]}\n"
                                     f"{stderr[-3000:]}") from None
            self.result = subprocess.CompletedProcess(self.command, self.process.returncode, stdout, stderr)
        return self.result

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "Started":
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving a ``with start_command(...) as job:`` block stops the command if it still runs (a test that
        failed before it called ``finish()``)."""
        self.stop()


def start_command(command: list[str], timeout: float, env: dict[str, str] | None = None) -> Started:
    """Start `command` from `REPO` with `env` (default `clean_env()`) in a session of its own, its output captured
    as text: `Started.finish()` collects it, within `timeout` seconds of now."""
    return Started(command, timeout, env)


def run_command(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `command` from `REPO` with `env` (default `clean_env()`), its output captured as text.

    It runs in a session of its own, so that a command that runs past `timeout` seconds is killed with every process
    it started (workers included), and the test fails with the end of its output."""
    started = start_command(command, timeout, env)
    try:
        return started.finish()
    finally:
        started.stop()


USAGE_ERROR = "shardfusion-train: error: "
"""How the training job's one usage-error line begins."""


def usage_error_line(result: subprocess.CompletedProcess) -> str:
    """The message of a run refused before any worker started: exit status 2, no traceback, no launched worker,
    exactly one `USAGE_ERROR` line on stderr (returned without its prefix)."""
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr and "elastic" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith(USAGE_ERROR)]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0].removeprefix(USAGE_ERROR)


TRAIN_TIMEOUT_S = 150
"""Seconds a whole run of the training job in the integration tests may take (a tiny model, a few steps)."""


def run_train(args: list[str], *, launcher: list[str] | None = None,
              timeout: float = TRAIN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`python -m shardfusion.train ARGS` (or `LAUNCHER shardfusion.train ARGS`, e.g. torchrun ... -m) through
    `run_command`."""
    return run_command((launcher or [sys.executable, "-m"]) + ["shardfusion.train", *args], timeout)


def start_train(args: list[str], *, timeout: float = TRAIN_TIMEOUT_S) -> Started:
    """`python -m shardfusion.train ARGS` through `start_command`: running while the test goes on (e.g. a reference
    run that the test reads only at its end); `Started.finish()` collects it."""
    return start_command([sys.executable, "-m", "shardfusion.train", *args], timeout)


def run_trains(*runs: list[str], timeout: float = TRAIN_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Independent runs of `python -m shardfusion.train`, one per argument list, started together; their results
    in the same order (each within `timeout` seconds of the start).

    A tiny run spends most of its wall time in serial start-up (its launcher and its forkserver each import torch
    and shardfusion, one core busy), so two runs started together take little more wall time than one on two
    cores. Only for runs that do not depend on each other and whose checks do not depend on timing."""
    started = [start_train(args, timeout=timeout) for args in runs]
    try:
        return [job.finish() for job in started]
    finally:
        for job in started:
            job.stop()


def train_usage_error(args: list[str], capsys: Any) -> str:
    """`shardfusion.train`'s ``main(args)`` in this process, for a run refused before any worker starts (no process
    start-up to pay): it must exit with status 2 (SystemExit, not another exception, so no traceback) and print
    exactly one `USAGE_ERROR` line on stderr, whose message is returned without its prefix. ``capsys``: pytest's
    fixture of the calling test."""
    from shardfusion.train.job import main
    capsys.readouterr()  # what came before
    try:
        main(args)
    except SystemExit as exit_info:
        code = exit_info.code
    else:
        code = 0
    out, err = capsys.readouterr()
    assert code == 2, out[-3000:] + err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith(USAGE_ERROR)]
    assert len(errors) == 1, err[-3000:]
    return errors[0].removeprefix(USAGE_ERROR)
