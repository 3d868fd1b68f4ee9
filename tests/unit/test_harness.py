"""The multi-process test harness (tests/harness.py): a rank whose function returned first keeps its process
groups until every rank's function has returned, so that it cannot close a connection a peer is still making."""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from harness import _wait_for_peers


def test_a_rank_that_returns_first_waits_for_the_others(tmp_path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 2)
    returned_at = {}

    def first() -> None:
        _wait_for_peers(store, 2, timeout_s=30)
        returned_at["first"] = time.monotonic()

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), "the first rank went on before its peer had returned"
    arrived = time.monotonic()
    _wait_for_peers(dist.FileStore(str(tmp_path / "store"), 2), 2, timeout_s=30)
    thread.join(timeout=10)
    assert not thread.is_alive() and returned_at["first"] >= arrived


def test_the_wait_ends_after_its_timeout_when_a_peer_never_returns(tmp_path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 2)
    start = time.monotonic()
    _wait_for_peers(store, 2, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 10
