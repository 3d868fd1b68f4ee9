"""The benchmark's workers: local processes started through torch's elastic launcher API, or those torchrun started.

A worker that returned ends its process with ``os._exit`` once the launcher has its result: with torch 2.13 and gloo
a normal interpreter exit may abort in a process-group destructor after a successful run.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import uuid
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardfusion.cpu_memory import keep_freed_memory


def under_torchrun() -> bool:
    """Whether torchrun (or another elastic agent) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def run_workers(fn: Callable[..., Any], args: tuple, nproc: int) -> Optional[dict[int, Any]]:
    """``fn(*args)`` in ``nproc`` spawned local processes (``fn`` importable by module name); ``{rank: result}``, or
    ``None`` when a worker failed (its error is printed)."""
    with socket.socket() as sock:  # a port on localhost for the c10d rendezvous, free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"bench-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    try:
        return elastic_launch(config, _worker_entry)(fn, *args)
    except ChildFailedError as error:
        print(f"benchmark: a worker failed:\n{error.format_msg()}", flush=True)
        return None


def _worker_entry(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    atexit.register(end_process)  # after the launcher has taken the result
    return result


def end_process(code: int = 0) -> None:
    """Flush the output streams and end this process at once (see the module doc)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def join(device: str) -> torch.device:
    """Join the default process group (gloo on CPU, NCCL on CUDA); returns this worker's device. On CPU the process
    keeps freed memory for reuse first (:func:`shardfusion.cpu_memory.keep_freed_memory`), whatever the variant."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if device != "cuda":
        keep_freed_memory()  # every variant alike: freed buffers reused, not page-faulted in again (cpu_memory.py)
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=local)
    return local
