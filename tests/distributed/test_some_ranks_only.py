"""Calls made on some ranks only (issue 22, item 6): an evaluation under ``if rank == 0:`` and a checkpoint saved by
rank 0 alone. Within ``Topology(timeout=...)`` every rank raises an error that names the call it was in and the
likely cause; nothing hangs past it.

Each case is a W=4 job of its own (a desynchronized job cannot go on), with a 5-second Topology timeout; the
default group keeps the harness's longer one, so an error that comes within the Topology timeout (plus a margin for
two busy cores) is the Topology's. Every rank sleeps past the timeout before leaving, so no rank's teardown breaks
another's collective first.

* eval on rank 0 of a model with a buffer (a RoPE-like cache, broadcast at every training forward and at the first
  evaluation after training), or of one without buffers (whose evaluation all-gathers paired silently with the other
  ranks' training forward, then mismatched and aborted gloo), the other ranks going on to their next training step,
  or to ``sf.full_state_dict``: every rank raises the explained error (rank 0 in the agreement on the forward mode
  that starts a forward of another mode, ``Topology.check_forward_mode``; the others in an all-gather).
* ``sf.checkpoint.save_checkpoint`` on rank 0 only: rank 0 raises, naming the call and the absent ranks, before it
  touches the folder; the other ranks, gone on to a training step, raise the explained error there.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

WORLD = 4
TOPOLOGY_TIMEOUT_S = 5.0
MARGIN_S = 15.0  # start-up of the collectives and compute on two shared cores
JOB_TIMEOUT_S = 120  # the harness gives the default group half of it: 60 s, far past the Topology timeout

CAUSE_WORDS = (" on rank ", "some ranks only", "if rank == 0:", "evaluation", "same calls")


class PlainNet(nn.Module):
    """Three Linear units and no buffer: nothing but all-gathers in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):  # x: (T, 8)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class RopeNet(nn.Module):
    """Three Linear units and a non-persistent cache buffer, as rotary embeddings keep their cos/sin tables."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("cos", torch.linspace(-1, 1, 32 * 8).view(32, 8), persistent=False)  # (T, C)

    def forward(self, x):  # x: (T, 8)
        for b in self.blocks:
            x = torch.tanh(b(x) + self.cos[: x.shape[0]])
        return x


def _setup(net: str = "rope"):
    import shardfusion as sf

    topo = sf.Topology(sharding=WORLD, timeout=TOPOLOGY_TIMEOUT_S)
    torch.manual_seed(0)
    model = sf.fully_shard(RopeNet() if net == "rope" else PlainNet(), topo, units=(nn.Linear,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step():
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, train_step


def some_ranks_only_job(case: str, root: str) -> tuple:
    """(error type, message, seconds from the call made on some ranks to the error) on this rank."""
    import torch.distributed as dist
    import shardfusion as sf

    model, train_step = _setup("plain" if case.endswith("_plain") else "rope")
    rank = dist.get_rank()
    train_step()  # every rank: the buffers have been trained, so the evaluation broadcasts them
    dist.barrier()
    t0 = time.monotonic()
    try:
        if case.startswith("eval"):
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(4, 8))
                model.train()
            if case.startswith("eval_then_step"):
                train_step()
            else:
                sf.full_state_dict(model)
        else:
            if rank == 0:
                sf.checkpoint.save_checkpoint(model, None, root, step=1)
            train_step()
        error = (None, None, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
        error = (type(e).__name__, str(e), time.monotonic() - t0)
    time.sleep(TOPOLOGY_TIMEOUT_S + 3)  # every rank reaches its own timeout before any tears the groups down
    return error


def _check_explained(results, rank: int) -> None:
    kind, msg, seconds = results[rank]
    assert kind == "RuntimeError", f"rank {rank}: {kind}: {msg}"
    for words in CAUSE_WORDS:
        assert words in msg, f"rank {rank}: the message should say {words!r}: {msg}"
    assert seconds < TOPOLOGY_TIMEOUT_S + MARGIN_S, f"rank {rank}: raised after {seconds:.1f} s: {msg}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", ["eval_then_step", "eval_then_full_state_dict", "eval_then_step_plain"])
def test_eval_on_rank0_raises_on_every_rank_within_the_timeout(case, tmp_path):
    results = run_distributed(some_ranks_only_job, WORLD, case, str(tmp_path), timeout=JOB_TIMEOUT_S)
    for rank in range(WORLD):
        _check_explained(results, rank)
    kind, msg, _ = results[0]
    assert "agreement on the forward mode (eval mode, grad disabled)" in msg, (
        f"rank 0 waits in the agreement that starts a forward of another mode: {msg}")
    for rank in range(1, WORLD):  # the first collective of their next call, which rank 0 never joins
        first = "all_gather of unit 'blocks." if case != "eval_then_step" else "broadcast of the module buffers"
        assert first in results[rank][1], f"rank {rank}: {results[rank][1]}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_save_checkpoint_on_rank0_only_raises_within_the_timeout(tmp_path):
    results = run_distributed(some_ranks_only_job, WORLD, "save_on_rank0", str(tmp_path), timeout=JOB_TIMEOUT_S)
    kind, msg, seconds = results[0]
    assert kind == "RuntimeError", f"rank 0: {kind}: {msg}"
    for words in ("sf.checkpoint.save_checkpoint", "ranks [1, 2, 3] of 4 did not call it", "if rank == 0:"):
        assert words in msg, f"rank 0: the message should say {words!r}: {msg}"
    assert seconds < TOPOLOGY_TIMEOUT_S + MARGIN_S, f"rank 0: raised after {seconds:.1f} s: {msg}"
    assert not os.listdir(tmp_path), "rank 0 raises before it touches the checkpoint folder"
    for rank in range(1, WORLD):  # their next collective: the training step's all-gather, which rank 0 never joins
        _check_explained(results, rank)
