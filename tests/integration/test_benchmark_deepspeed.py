"""The optional DeepSpeed variants of benchmarks/compare.py.

The theory of their bytes (benchmarks/report.py, `deepspeed_theory`) is checked by hand-computed values and needs
nothing but the report module. The smoke run (4 gloo workers, the tiny regime, one timed step of the flat ZeRO-3
and the hpZ variants) needs the bench extra (`pip install -e '.[bench]'`) and is skipped without it. No timing is
asserted: only that the run works, that the measured bytes are the theory's (every module's parameters gathered for
its forward and its backward, the tied embedding per use), and that the first loss is DDP's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO))
from benchmarks.report import deepspeed_theory, persistent_shards, theory  # noqa: E402


def test_deepspeed_theory_bytes():
    P, T, b = 1000, 100, 4  # 1000 elements, a tied weight of 100, fp32
    flat = deepspeed_theory("deepspeed", P, T, inner=2, outer=2, b_p=b, b_g=b)
    assert flat == {"reduce_scatter/world": {"count": None, "wire_bytes": 0.75 * P * b},
                    "all_gather/world": {"count": None, "wire_bytes": 0.75 * 2 * (P + T) * b}}
    kept = deepspeed_theory("deepspeed", P, T, 2, 2, b, b, after_forward=False)
    assert kept["all_gather/world"]["wire_bytes"] == 0.75 * P * b
    hpz = deepspeed_theory("ds-hpz", P, T, 2, 2, b, b)
    assert hpz["all_gather/world"]["wire_bytes"] == 0.75 * P * b  # first forward use, over the world
    assert hpz["all_gather/inner"]["wire_bytes"] == 0.5 * (P + 2 * T) * b  # tied reuse + backward, in the group
    assert hpz["reduce_scatter/world"]["wire_bytes"] == 0.75 * P * b
    mics = deepspeed_theory("ds-mics", P, T, 2, 2, b, b)
    assert mics == {"all_gather/inner": {"count": None, "wire_bytes": 0.5 * 2 * (P + T) * b},
                    "reduce_scatter/inner": {"count": None, "wire_bytes": 0.5 * P * b},
                    "all_reduce/outer": {"count": None, "wire_bytes": 2 * 0.5 * P / 2 * b}}
    # theory() dispatches on the variant; the HSDP variants' theory is unchanged by the tied argument
    assert theory("deepspeed", 200, [400, 400], 2, 2, b, b, 2, T) == flat
    assert theory("fsdp2", 200, [400, 400], 2, 2, b, b, 2, T) == theory("fsdp2", 200, [400, 400], 2, 2, b, b)
    assert [persistent_shards(v, 2, 2) for v in ("ddp", "shardfusion", "fsdp2", "deepspeed", "ds-hpz", "ds-mics")] \
        == [1, 2, 2, 4, 4, 2]


@pytest.mark.timeout(150)
def test_compare_deepspeed_smoke(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--regimes", "tiny", "--repeats", "1",
           "--warmup", "0", "--steps", "1", "--device", "cpu", "--variants", "ddp,deepspeed,ds-hpz",
           "--out-dir", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"compare.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    rows = data["summary"]["tiny"]["variants"]
    for name in ("deepspeed", "ds-hpz"):
        assert f"| {name} |" in md
        row = rows[name]
        assert row["median_step_s"] > 0
        for key in (("all_gather/world", "reduce_scatter/world") if name == "deepspeed" else
                    ("all_gather/world", "all_gather/inner", "reduce_scatter/world")):
            assert row["collectives"][key]["ratio"] == pytest.approx(1.0, abs=1e-9), (name, key, row["collectives"])
        assert row["persistent_ratio"] >= 1.0  # 16 bytes per element over W at least (an fp32 master copy on top)
        assert abs(row["loss_first_last"][0] - rows["ddp"]["loss_first_last"][0]) < 1e-4  # same model, same data
