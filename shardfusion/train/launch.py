"""Process start-up for `shardfusion.train`: launch local workers, or join the ones torchrun started.

Outside torchrun, `launch` starts `nproc` workers on this machine through torch's elastic launcher (the engine
behind torchrun) with a c10d rendezvous on a free local port. Under torchrun (single or multi-node) the current
process is already a worker and `init_worker` just joins the process group.

On CPU the workers are forked from a multiprocessing forkserver that has imported torch and the job once
(`PRELOAD`): a freshly spawned worker spends about 3.5 s of CPU importing them, which for 4 workers on 2 cores is
most of a short run's start-up. The forkserver starts inside `launch`, with this process's environment at that
moment (OMP_NUM_THREADS set), and never touches a GPU. CUDA workers are spawned (`start_method`): a GPU job's
start-up is not dominated by imports, and spawned processes are the path CUDA documents.

A worker that finished cleanly ends with `exit_now` (os._exit) instead of a normal interpreter exit: with torch 2.13
and gloo, a process-group worker thread may still be releasing the tensors of the last collective when the
interpreter finalizes; the GIL it needs for that then ends the thread in the middle of a C++ destructor, which
aborts the process ("terminate called without an active exception", SIGABRT) after a successful run.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardfusion.cpu_memory import keep_freed_memory


UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1 in the elastic agent's environment, it gives the workers of each restart a new rendezvous store."""


def restart_problem(*, out_given: bool, saves: bool) -> str | None:
    """Why restarts of this torchrun worker could not resume, or None (also when torchrun allows no restarts).

    A restarted worker resumes from the latest checkpoint in --out, so it needs an --out fixed in advance
    (`out_given`) and checkpoints (`saves`). And torch 2.13's agent shares one rendezvous TCPStore across restarts
    unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is in its environment: restarted workers then find the addresses
    that the dead attempt's process group published under the same keys and fail to connect ("Gloo
    connectFullMesh failed ... Connection refused"). A per-attempt key prefix does not help on several nodes: only
    the node whose worker failed counts the restart (TORCHELASTIC_RESTART_COUNT), so the nodes would disagree on
    the prefix. `launch` sets the variable itself."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return (f"torchrun --max-restarts needs {UNSHARED_STORE}=1 in torchrun's environment (with torch 2.13 a "
                f"restarted worker cannot join the process group otherwise): run "
                f"`{UNSHARED_STORE}=1 torchrun ...`")
    if not (out_given and saves):
        return ("torchrun --max-restarts needs --out and --save-every: restarted workers resume from the latest "
                "checkpoint in --out (without --out each attempt would write to a new folder)")
    return None


def under_torchrun() -> bool:
    """True when this process was started by torchrun / the elastic launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def pick_device(requested: str) -> str:
    """"cuda" or "cpu" from "auto", "cuda" or "cpu"; raises if cuda is asked for and absent."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch.cuda.is_available() is False; use --device cpu")
    return requested


def default_nproc(device: str) -> int:
    """Workers per node when --nproc is not given: one per GPU, or 4 on CPU."""
    return max(1, torch.cuda.device_count()) if device == "cuda" else 4


WORKERS_PER_CORE = 2
"""Local CPU workers per core above which `nproc_warning` warns (the default 4 workers on a 2-core machine are 2)."""


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def nproc_warning(nproc: int, device: str, cores: int, flag: str = "--nproc") -> str | None:
    """A warning when `nproc` local CPU workers are more than `WORKERS_PER_CORE` per core of the `cores`, else None
    (and on CUDA, where a worker per GPU is checked elsewhere). `flag` names where nproc comes from."""
    if device != "cpu" or nproc <= WORKERS_PER_CORE * cores:
        return None
    return (f"{flag} {nproc} starts {nproc} CPU workers on {cores} cores ({nproc / cores:.0f} per core): each gets "
            f"a sliver of a core, start-up and every collective wait for the slowest, and memory holds {nproc} "
            f"copies of torch; the run is slower than with {WORKERS_PER_CORE * cores} or fewer "
            f"({flag} {WORKERS_PER_CORE * cores})")


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "shardfusion.train.job"]
"""Modules the forkserver imports once before it forks CPU workers (`start_method`), in this order. Every worker
needs ``torch._dynamo``: imported before shardfusion, the scheduler's hooks get ``torch.compiler.disable`` at once
(`shardfusion._runtime.compile_disable`), instead of importing Dynamo in each worker at its first forward. The
launching process imports neither Dynamo nor the modules that only some runs need (`launch`'s ``preload``)."""


def start_method(device: str) -> str:
    """How `launch` starts workers on ``device`` ("cpu" or "cuda"): "forkserver" on CPU (forked from a server that
    imported `PRELOAD`: no import per worker), "spawn" on CUDA (see the module doc)."""
    return "spawn" if device == "cuda" else "forkserver"


def launch(worker: Callable[..., Any], args: tuple, nproc: int, threads_per_worker: int,
           max_restarts: int = 0, device: str = "cpu", preload: Sequence[str] = ()) -> dict[int, Any] | None:
    """Run worker(*args) in nproc local processes; returns {rank: return value}, or None if a worker failed and the
    `max_restarts` restarts of all workers (torchrun's --max-restarts) did not end in success.

    worker must be a module-level function (it is pickled into the workers; a worker re-imports its module, so
    the caller's changes to it do not carry over). OMP_NUM_THREADS is set for the children (unless already set) so
    that workers sharing a few cores do not oversubscribe them. ``device``: the workers' ("cpu" or "cuda"), which
    picks `start_method`. ``preload``: modules this run's workers import beyond `PRELOAD` (e.g. the checkpoint
    modules of a run that saves), imported once by the forkserver after it; a forkserver this process already runs
    (started by other code: it would not import them) is stopped first. A worker that returns ends its process
    with `exit_now(0)` once its return value has been handed back (see the module doc); one that raises exits as
    usual, non-zero.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker))
    method = start_method(device)
    if method == "forkserver":  # before the server starts (at the first worker), with the environment above
        stop_forkserver()  # one this process already runs (started by other code) would ignore this run's preload
        multiprocessing.set_forkserver_preload([*PRELOAD, *preload])
    if max_restarts:
        os.environ[UNSHARED_STORE] = "1"  # a store of its own per restart (see `restart_problem`)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardfusion-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=method,
    )
    try:
        return elastic_launch(config, _exit_now_after)(worker, *args)
    except ChildFailedError as error:
        print(f"shardfusion: a worker failed:\n{error.format_msg()}", flush=True)
        return None
    finally:
        if method == "forkserver":
            stop_forkserver()


def stop_forkserver() -> None:
    """End this process's multiprocessing forkserver at once (SIGKILL), once no worker is left to fork.

    Left alone it notices that its parent is gone only when the parent exits, and then tears down its interpreter
    (torch and the job imported: about a second on 2 cores) while still holding the parent's stdout and stderr
    open, so a caller reading the job's output waits for it (measured: the job's command ended 1.2 s after its own
    process). It holds nothing worth a clean exit: its children, the workers, have ended. Uses
    ``multiprocessing.forkserver``'s own stop (private; absent in some Python: then nothing is done), which also
    removes its socket; the next ``launch`` starts a new server.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    stop = getattr(server, "_stop", None)
    if pid is None or stop is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    stop()  # closes its "alive" pipe, reaps it, removes its socket


def exit_now(code: int = 0) -> NoReturn:
    """Flush stdout and stderr, then end this process at once with `code` (os._exit), skipping the interpreter's
    finalization and the process-group destructors: the clean way out of a worker after its last collective (see the
    module doc for the abort that a normal exit risks). Files must already be closed."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_now_after(worker: Callable[..., Any], *args: Any) -> Any:
    """The entry point of a spawned worker: worker(*args); if it returns, the process ends with `exit_now(0)` as its
    interpreter begins to exit (after the elastic launcher has taken the return value)."""
    result = worker(*args)
    atexit.register(exit_now, 0)
    return result


def init_worker(device: str) -> torch.device:
    """Join the default process group (gloo on CPU, NCCL on CUDA) and limit CPU threads; on CPU, keep freed memory in
    the process for reuse (:func:`shardfusion.cpu_memory.keep_freed_memory`). Returns this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    else:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    keep_freed_memory()  # the CPU counterpart of CUDA's caching allocator: shardfusion/cpu_memory.py
    dist.init_process_group("gloo")
    return torch.device("cpu")


def threads_per_worker(nproc: int) -> int:
    """CPU threads each of nproc local workers may use: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // nproc)
