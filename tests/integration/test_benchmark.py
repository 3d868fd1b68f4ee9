"""benchmarks/compare.py runs end to end (4 gloo workers, the tiny regime, one step per variant) and writes a JSON and
a markdown report with the three variants. No timing is asserted: only that the run works and that what it
measures is self-consistent (the collective counts of the HSDP layout, the same first loss in every variant)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import REPO


@pytest.mark.timeout(120)
def test_compare_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--regimes", "tiny", "--repeats", "1",
           "--warmup", "1", "--steps", "1", "--device", "cpu", "--out-dir", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"compare.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    rows = data["summary"]["tiny"]["variants"]
    assert set(rows) == {"shardfusion", "fsdp2", "ddp"}
    for name in ("shardfusion", "fsdp2", "ddp"):
        assert f"| {name} |" in md
        assert rows[name]["median_step_s"] > 0
    n_blocks = 2
    for name in ("shardfusion", "fsdp2"):  # HSDP 2 x 2: counts per step, and one outer all-reduce per unit
        c = rows[name]["collectives"]
        assert c["all_gather/inner"]["count"] == 2 * n_blocks + 1, c
        assert c["reduce_scatter/inner"]["count"] == n_blocks + 1, c
        assert c["all_reduce/outer"]["count"] == n_blocks + 1, c
    assert data["regimes"]["tiny"]["variants"]["shardfusion"]["cross_check"]["agree"]
    first = {name: rows[name]["loss_first_last"][0] for name in rows}
    assert max(first.values()) - min(first.values()) < 1e-4, first  # same model, same data
