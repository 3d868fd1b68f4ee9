"""The job's local launcher (shardfusion.train.launch): workers forked from a preloaded forkserver return their
results, and the forkserver does not outlive the launch (it would hold the job's output open while it tears down).
The forkserver imports `PRELOAD` (Dynamo included) and what the run asks for (`launch`'s ``preload``, from
`job.worker_preload`), and nothing else: the checkpoint and pipeline modules only for the runs that use them. The
launching process itself imports none of torch's heavy modules that the job's library imports at first use."""

import os
import subprocess
import sys
from multiprocessing import forkserver

import pytest

from shardfusion.train.config import JobConfig, resolve
from shardfusion.train.job import worker_preload
from shardfusion.train.launch import launch

from harness import REPO, clean_env

_WATCHED = ("torch._dynamo", "shardfusion.checkpoint.save_load", "torch.distributed.checkpoint",
            "shardfusion.train.job_pipeline", "torch.distributed.pipelining")


def _rank_times(factor: int) -> tuple[int, dict[str, bool]]:
    """RANK x factor, and which of `_WATCHED` the worker holds as it starts (imported by its forkserver)."""
    return int(os.environ["RANK"]) * factor, {m: m in sys.modules for m in _WATCHED}


def test_launch_returns_every_rank_and_stops_its_forkserver():
    results = launch(_rank_times, (3,), nproc=2, threads_per_worker=1)
    assert {r: v[0] for r, v in results.items()} == {0: 0, 1: 3}
    for _, held in results.values():  # PRELOAD only: Dynamo, not the checkpoint or pipeline modules
        assert held == {m: m == "torch._dynamo" for m in _WATCHED}
    server = forkserver._forkserver
    assert server._forkserver_pid is None and server._forkserver_alive_fd is None
    # the next launch starts a server again, with the next launch's preload
    results = launch(_rank_times, (5,), nproc=2, threads_per_worker=1, preload=["shardfusion.checkpoint.save_load"])
    assert {r: v[0] for r, v in results.items()} == {0: 0, 1: 5}
    for _, held in results.values():
        assert held == {m: m in _WATCHED[:3] for m in _WATCHED}  # Dynamo, the checkpoint modules and DCP
    assert server._forkserver_pid is None


@pytest.mark.parametrize("flags, resumes, modules", [
    ({}, False, []),
    ({"save_every": 2}, False, ["shardfusion.checkpoint.save_load"]),
    ({}, True, ["shardfusion.checkpoint.save_load"]),
    ({"pp": 2, "tie_embeddings": False}, False, ["shardfusion.train.job_pipeline"]),
])
def test_the_forkserver_preloads_what_the_run_uses(tmp_path, flags: dict, resumes: bool, modules: list) -> None:
    """`job.worker_preload`: the checkpoint modules for a run that saves or resumes (a checkpoint is published in
    --out), the pipeline stages' for --pp > 1, nothing more for a plain run."""
    if resumes:
        (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
        (tmp_path / "checkpoints" / "step-2" / ".metadata").write_bytes(b"")
        (tmp_path / "checkpoints" / "latest").write_text("step-2")
    config = resolve(JobConfig.from_flat(preset="tiny", out=str(tmp_path), **flags), device="cpu", world_size=2,
                     nproc=2)
    assert worker_preload(config) == modules


def test_the_launching_process_imports_none_of_the_heavy_modules() -> None:
    """`python -m shardfusion.train` imports the job (and with it shardfusion) without Dynamo, DCP, DTensor or
    torch's pipelining (about 1.2 s of CPU together): its workers' forkserver imports what they need."""
    heavy = ["torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor",
             "torch.distributed.pipelining"]
    code = f"import sys, shardfusion.train.job; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_launch_replaces_a_forkserver_started_by_other_code():
    """A forkserver this process already runs (here one preloading the checkpoint modules, as the test harness's
    does) would fork the workers with its own modules and without this run's preload: launch starts its own."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["shardfusion.checkpoint.save_load"])
    forkserver.ensure_running()
    assert forkserver._forkserver._forkserver_pid is not None
    results = launch(_rank_times, (2,), nproc=2, threads_per_worker=1)
    assert {r: v[0] for r, v in results.items()} == {0: 0, 1: 2}
    for _, held in results.values():
        assert held == {m: m == "torch._dynamo" for m in _WATCHED}
