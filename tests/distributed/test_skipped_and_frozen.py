"""A unit that runs on some ranks only (LayerDrop, early exit) desynchronizes the collectives: the ranks wait until
the process-group timeout, and the backend's timeout error is turned into one that names the collective, the unit and
the likely cause.

One W=4 job whose topology has a 3-second process-group timeout; rank 0 skips the second of three Linear units.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from harness import run_distributed

WORLD = 4
PG_TIMEOUT_S = 3.0
JOB_TIMEOUT_S = 90


class LayerDropNet(nn.Module):
    """Three Linear units; ``skip`` names one that this rank does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, skip=None):  # x: (B, 8)
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x


def layerdrop_job() -> tuple:
    import torch.distributed as dist
    import shardfusion as sf

    topo = sf.Topology(sharding=WORLD, timeout=PG_TIMEOUT_S)
    torch.manual_seed(0)
    model = sf.fully_shard(LayerDropNet(), topo, units=(nn.Linear,))
    rank = dist.get_rank()
    try:
        model(torch.randn(4, 8), skip=1 if rank == 0 else None).sum().backward()
        error = (None, None)
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
        error = (type(e).__name__, str(e))
    time.sleep(PG_TIMEOUT_S + 2)  # every rank reaches its own timeout before any tears the groups down
    return error


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_unit_skipped_on_some_ranks_times_out_with_its_likely_cause():
    results = run_distributed(layerdrop_job, WORLD, timeout=JOB_TIMEOUT_S)
    timed_out = [r for r, (kind, _) in enumerate(results) if kind is not None]
    assert timed_out, f"no rank raised: {results}"
    for rank in timed_out:
        kind, msg = results[rank]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {msg}"
        for words in ("timed out", "ran different units", "LayerDrop", "same units in the same order",
                      "zero its contribution", "of unit 'blocks."):
            assert words in msg, f"rank {rank}: the message should say {words!r}: {msg}"
    assert set(timed_out) >= {1, 2, 3}, f"ranks that ran every unit wait for rank 0 and time out: {results}"
