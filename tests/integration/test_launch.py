"""The job's local launcher (shardfusion.train.launch): workers forked from a preloaded forkserver return their
results, and the forkserver does not outlive the launch (it would hold the job's output open while it tears down)."""

import os
from multiprocessing import forkserver

from shardfusion.train.launch import launch


def _rank_times(factor: int) -> int:
    return int(os.environ["RANK"]) * factor


def test_launch_returns_every_rank_and_stops_its_forkserver():
    results = launch(_rank_times, (3,), nproc=2, threads_per_worker=1)
    assert results == {0: 0, 1: 3}
    server = forkserver._forkserver
    assert server._forkserver_pid is None and server._forkserver_alive_fd is None
    # the next launch starts a server again
    assert launch(_rank_times, (5,), nproc=2, threads_per_worker=1) == {0: 0, 1: 5}
    assert server._forkserver_pid is None
