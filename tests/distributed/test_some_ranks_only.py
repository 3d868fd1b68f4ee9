"""Calls made on some ranks only (issue 22, item 6; issue 33, item 3): within the arrival deadline, the rank that
made the call alone gets an error naming the call and the ranks that did not make it, never a backend's raw timeout
or a SIGABRT; the ranks that wait in a training step's collective meanwhile get a watchdog report naming the call
the others came to; and the job can go on (no collective was issued by the lone call).

One W=4 job runs the cases in turn, without any Topology timeout (the groups keep torch's, minutes) and a 3-second
arrival deadline (``Topology(arrival_timeout=3)``). In each case rank 0 makes a collective call alone while ranks
1-3 go on to their next training step; rank 0 then joins that step (its forward in the unchanged mode issues no
check), so every rank is in step again for the next case. The arrival counters are set equal on every rank between
cases (rank 0 made one check more: a real job would stop at the error).

* ``torch.save(model.state_dict(), f)``, ``optimizer.state_dict()`` (an AdamW state: gloo aborted the process on a
  size mismatch before), an evaluation forward, ``sf.checkpoint.save_checkpoint`` (the folder stays untouched);
* ranks making different calls at once (``sf.full_state_dict``, ``model.load_state_dict``,
  ``optimizer.load_state_dict``): every rank raises at once, naming each call with its ranks; ranks starting
  forwards of two modes at once: a ``ValueError`` on every rank naming each mode with its ranks.

A second job sets a Topology timeout too (4 s): the evaluation on rank 0 alone raises the arrival error there, the
other ranks the explained timeout of their training step's buffer broadcast.
"""

from __future__ import annotations

import datetime
import io
import os
import threading
import time

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

WORLD = 4
ARRIVAL_S = 3.0
TOPOLOGY_TIMEOUT_S = 4.0
JOB_TIMEOUT_S = 120  # the harness gives the default group half of it: 60 s, far past the deadlines

ONE_SIDED = ("state_dict", "optimizer_state_dict", "eval", "save_checkpoint")
WATCHED = ("state_dict", "eval")  # ranks 1-3 wait for their watchdog's report before rank 0 joins their step
CALLS = {"state_dict": "model.state_dict()", "optimizer_state_dict": "optimizer.state_dict()",
         "eval": "a forward in a new mode", "save_checkpoint": "sf.checkpoint.save_checkpoint"}


class RopeNet(nn.Module):
    """Three Linear units and a non-persistent cache buffer, as rotary embeddings keep their cos/sin tables: its
    training forward starts with a broadcast of the buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("cos", torch.linspace(-1, 1, 32 * 8).view(32, 8), persistent=False)  # (T, C)

    def forward(self, x):  # x: (T, 8)
        for b in self.blocks:
            x = torch.tanh(b(x) + self.cos[: x.shape[0]])
        return x


def _setup(**topology):
    import shardfusion as sf

    topo = sf.Topology(sharding=WORLD, **topology)
    torch.manual_seed(0)
    model = sf.fully_shard(RopeNet(), topo, units=(nn.Linear,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step():
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, train_step


def _call_alone(case: str, model, optimizer, root: str) -> None:
    import shardfusion as sf

    if case == "state_dict":
        torch.save(model.state_dict(), io.BytesIO())
    elif case == "optimizer_state_dict":
        optimizer.state_dict()
    elif case == "eval":
        model.eval()
        try:
            with torch.no_grad():
                model(torch.randn(4, 8))
        finally:
            model.train()
    else:
        sf.checkpoint.save_checkpoint(model, optimizer, root, step=1)


def _named(reports: list[str], case: str) -> list[str]:
    """The watchdog reports that name rank 0's call of ``case``."""
    return [r for r in reports if f"ranks [0] came to {CALLS[case]}" in r]


def _report_when_watched(case: str, store, rank: int, since: int) -> threading.Thread:
    """A thread that sets ``test/<case>/reported/<rank>`` in the store once the watchdog has reported rank 0's call
    (rank 0 joins the step after that)."""
    from shardfusion import arrival

    def poll():
        while not _named(arrival.reports[since:], case):
            time.sleep(0.05)
        store.set(f"test/{case}/reported/{rank}", "1")

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    return thread


def some_ranks_only_job(root: str) -> dict:
    """{case: (error type, message) of rank 0's lone call, or the watchdog's reports on ranks 1-3}, and for the
    mixed calls every rank's error."""
    import torch.distributed as dist
    from shardfusion import arrival

    model, optimizer, train_step = _setup(arrival_timeout=ARRIVAL_S)
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    train_step()  # every rank: AdamW has its states, the buffers have been trained
    full = __import__("shardfusion").full_state_dict(model)
    saved_optimizer = optimizer.state_dict()
    results: dict = {}
    for i, case in enumerate(ONE_SIDED):
        for tag in arrival._counts:  # rank 0 made one check more in the last case
            arrival._counts[tag] = 1000 * (i + 1)
        if rank == 0:
            store.set(f"test/{case}/calling", "1")
            try:
                _call_alone(case, model, optimizer, os.path.join(root, case))
                results[case] = (None, None)
            except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
                results[case] = (type(e).__name__, str(e))
            if case in WATCHED:
                store.wait([f"test/{case}/reported/{r}" for r in range(1, WORLD)], datetime.timedelta(seconds=60))
        else:
            store.wait([f"test/{case}/calling"], datetime.timedelta(seconds=60))
            since = len(arrival.reports)
            if case in WATCHED:
                _report_when_watched(case, store, rank, since)
            results[case] = None
        train_step()  # rank 0 joins the step the others wait in
        if rank != 0:
            results[case] = arrival.reports[since:]
    for tag in arrival._counts:
        arrival._counts[tag] = 1000 * (len(ONE_SIDED) + 1)
    try:
        if rank == 0:
            __import__("shardfusion").full_state_dict(model)
        elif rank == 1:
            model.load_state_dict(full)
        else:
            optimizer.load_state_dict(saved_optimizer)
        results["mixed"] = (None, None)
    except Exception as e:  # noqa: BLE001
        results["mixed"] = (type(e).__name__, str(e))
    try:  # forwards of two modes at once: ranks 0 and 1 evaluate, ranks 2 and 3 run a no-grad training forward
        if rank < 2:
            model.eval()
        with torch.no_grad():
            model(torch.randn(4, 8))
        results["modes"] = (None, None)
    except Exception as e:  # noqa: BLE001
        results["modes"] = (type(e).__name__, str(e))
    finally:
        model.train()
    results["folder"] = sorted(os.listdir(root))
    dist.barrier()
    return results


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_calls_on_some_ranks_name_the_call_and_the_absent_ranks(tmp_path):
    results = run_distributed(some_ranks_only_job, WORLD, str(tmp_path), timeout=JOB_TIMEOUT_S)
    for case in ONE_SIDED:
        kind, msg = results[0][case]
        assert kind == "RuntimeError", f"{case}: rank 0 raised {kind}: {msg}"
        for words in (f"{CALLS[case]}", "on rank 0: ranks [1, 2, 3] of 4 have not called it after 3 s",
                      "if rank == 0:", "SHARDFUSION_ARRIVAL_TIMEOUT"):
            assert words in msg, f"{case}: rank 0's error should say {words!r}: {msg}"
        for rank in range(1, WORLD):
            reports = _named(results[rank][case], case)
            if case not in WATCHED:
                continue
            assert len(reports) == 1, f"{case}: rank {rank}'s watchdog should report once: {results[rank][case]}"
            for words in (f"rank {rank}: waiting for", "broadcast of the module buffers",
                          f"which rank {rank} has not called", "if rank =="):
                assert words in reports[0], f"{case}: rank {rank}'s watchdog should say {words!r}: {reports[0]}"
    assert "(eval mode, grad disabled)" in _named(results[1]["eval"], "eval")[0], "the mode rank 0 came with"
    assert results[0]["folder"] == [], "rank 0 raises before it touches the checkpoint folder"
    for rank in range(WORLD):
        kind, msg = results[rank]["mixed"]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {msg}"
        for words in ("came from different collective calls", "ranks [0]: sf.full_state_dict()",
                      "ranks [1]: model.load_state_dict()", "ranks [2, 3]: optimizer.load_state_dict()"):
            assert words in msg, f"rank {rank}: the error should say {words!r}: {msg}"
        kind, msg = results[rank]["modes"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {msg}"
        assert ("started forwards of different modes (ranks [0, 1]: eval mode, grad disabled; ranks [2, 3]: train "
                "mode, grad disabled)") in msg, f"rank {rank}: {msg}"


def eval_with_topology_timeout_job() -> tuple:
    """(error type, message) on this rank: rank 0 evaluates alone, the others train; the Topology timeout (4 s)
    ends their wait, the arrival deadline (3 s) rank 0's."""
    import torch.distributed as dist

    model, _, train_step = _setup(timeout=TOPOLOGY_TIMEOUT_S, arrival_timeout=ARRIVAL_S)
    train_step()
    try:
        if dist.get_rank() == 0:
            _call_alone("eval", model, None, "")
        else:
            train_step()
        error = (None, None)
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
        error = (type(e).__name__, str(e))
    # every rank reaches its own error before any tears the groups down (the store needs no group)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/done/{dist.get_rank()}", "1")
    store.wait([f"test/done/{r}" for r in range(WORLD)], datetime.timedelta(seconds=60))
    return error


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_eval_on_rank0_with_a_topology_timeout():
    results = run_distributed(eval_with_topology_timeout_job, WORLD, timeout=JOB_TIMEOUT_S)
    kind, msg = results[0]
    assert kind == "RuntimeError", f"rank 0: {kind}: {msg}"
    for words in ("a forward in a new mode", "ranks [1, 2, 3] of 4 have not called it after 3 s"):
        assert words in msg, f"rank 0's error should say {words!r}: {msg}"
    for rank in range(1, WORLD):  # the first collective of their next step, which rank 0 never joins
        kind, msg = results[rank]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {msg}"
        for words in ("broadcast of the module buffers", f"timed out on rank {rank}", "some ranks only",
                      "if rank == 0:"):
            assert words in msg, f"rank {rank}: the message should say {words!r}: {msg}"
