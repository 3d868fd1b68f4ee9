"""benchmarks/zeropp.py (ZeRO++'s ideas across the emulated link) and its theory, benchmarks/zeropp_theory.py.

The theory is checked against values computed by hand here. A variant whose job flags the job rejects is skipped
with a ``flag not available`` line that carries the job's own message. The smoke run (needs root for the network
namespaces, skipped otherwise with `netns_available()`'s reason): a tiny GPT, one round of 1 warm-up + 2 timed
steps at 1 Gbit/s, fp32 FSDP, qwZ and FSDP2; its references are the accounting (`sf.comm.CommCounter`, for the
shardfusion variants) and the theory: the veth carries at least the accounting's bytes and at most 15 % more (the
tiny model's tensors are small, so headers, ACKs and barriers weigh more than in benchmarks/link.py's 3 %), and the
accounting is the theory's within 3 % (the theory leaves out the padding of the shards and the clipping scalar).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO))
from benchmarks import zeropp  # noqa: E402
from benchmarks.netcluster import netns_available  # noqa: E402
from benchmarks.zeropp_theory import Q, link_bytes  # noqa: E402

AVAILABLE, WHY = netns_available()
TINY = '{"batch": 1, "seq": 16, "n_layer": 2, "d_model": 64, "n_head": 2}'


def test_theory_by_hand() -> None:
    root, blocks, tied = 100, 800, 40  # P = 900 elements, P_b = 800
    assert Q == 1 + 4 / 256
    fsdp = link_bytes("sf-fsdp", root, blocks, tied)
    assert fsdp == {"fwd_all_gather": 0.75 * 4 * 900, "bwd_all_gather": 0.75 * 4 * 800, "reduce_scatter": 4 * 900,
                    "total": 3 * 900 + 3 * 800 + 4 * 900}
    assert link_bytes("sf-qwz", root, blocks, tied)["total"] == pytest.approx(0.75 * Q * 1700 + 3600)
    assert link_bytes("sf-hpz", root, blocks, tied)["bwd_all_gather"] == 0
    assert link_bytes("sf-qgz", root, blocks, tied)["reduce_scatter"] == pytest.approx(Q * 900)
    assert link_bytes("sf-zeropp", root, blocks, tied)["total"] == pytest.approx(0.75 * Q * 900 + Q * 900)
    assert link_bytes("fsdp2", root, blocks, tied)["reduce_scatter"] == 1.5 * 4 * 900  # gloo: a ring all-reduce
    assert link_bytes("ds-zero3", root, blocks, tied)["total"] == 2 * 0.75 * 4 * 940 + 1.5 * 4 * 900
    assert link_bytes("ds-hpz", root, blocks, tied)["total"] == 0.75 * 4 * 900 + 1.5 * 4 * 900
    assert link_bytes("ddp", root, blocks, tied) is None


def test_rejected_flags_are_skipped_with_the_jobs_message(monkeypatch: pytest.MonkeyPatch) -> None:
    assert zeropp.flag_problem(zeropp.QWZ) is None  # --all-gather-dtype int8 exists
    assert zeropp.flag_problem(["--no-such-flag"]) == "unrecognized arguments: --no-such-flag"
    monkeypatch.setitem(zeropp.VARIANTS, "sf-bogus", ("shardfusion", ("--no-such-flag",), "bogus"))
    runnable, skipped = zeropp.available(["sf-fsdp", "sf-bogus", "fsdp2"])
    assert runnable == ["sf-fsdp", "fsdp2"]
    assert skipped == {"sf-bogus": "flag not available: --no-such-flag (the job says: unrecognized arguments: "
                                   "--no-such-flag)"}


@pytest.mark.skipif(not AVAILABLE, reason=f"no network namespaces here: {WHY}")
@pytest.mark.timeout(300)
def test_zeropp_smoke(tmp_path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.zeropp", "--quick", "--rates", "1gbit", "--shape", TINY,
           "--variants", "sf-fsdp,sf-qwz,fsdp2", "--out-dir", str(tmp_path), "--name", "smoke", "--timeout", "240"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").read_text().startswith("# ZeRO++ across an emulated link: smoke")
    assert result["env"]["commit"] and result["config"]["base_flags"] == list(zeropp.BASE_FLAGS)
    rows = result["summary"]["rates"]["1gbit"]
    assert set(rows) == {"sf-fsdp", "sf-qwz", "fsdp2"}
    for v, row in rows.items():
        assert row["n_steps"] == 2 and row["median_step_s"] > 0
        theory = row["theory"]["total"]
        assert theory <= min(row["link_bytes_per_step"]) and max(row["link_bytes_per_step"]) <= 1.15 * theory, (v, row)
        if v.startswith("sf-"):
            acct = row["accounting_bytes_per_step"]
            assert all(a <= link <= 1.15 * a for a, link in zip(acct, row["link_bytes_per_step"])), (v, row)
            assert all(a == pytest.approx(theory, rel=0.03) for a in acct), (v, acct, theory)
    assert rows["sf-fsdp"]["vs_fsdp_paired"] == 1.0
    assert rows["sf-qwz"]["link_vs_fsdp"] < 0.75  # int8 gathers: 3/4 x q instead of 3/4 x 4 bytes per element
