"""Two emulated nodes on this machine (benchmarks/netcluster.py: network namespaces, a veth pair, a tbf on each end):
the training job across them and its exact resume; shardfusion's cross-node accounting against the bytes the veths
really carried; no namespace left behind when a child fails. Needs root (`ip netns`); skipped otherwise, with the
reason `netns_available()` gives.

Reference of the resume test: one uninterrupted run of the job (2 nodes x 2 ranks, HSDP outer 2 across the nodes,
dropout on, 2 micro-batches), 4 steps saving every 2. The same flags with --stop-after 2, then again without it (it
resumes from step 2 by itself): its step-4 checkpoint and its metrics after step 2 must equal the reference bitwise.

Reference of the accounting test: the veth counters (`/sys/class/net/<veth>/statistics/tx_bytes` in each node's
namespace), read by each node's local rank 0 around 3 timed steps of shardfusion HSDP (benchmarks/link.py's worker).
The counters also carry what the accounting leaves out: TCP/IP and Ethernet headers (one per GSO packet of up to
64 KiB, at most one per 9000-byte frame: <= 0.8%), the ACKs a node sends for what it receives, gloo's message
headers, and the two barriers around the timed steps (a few hundred bytes). So: accounting <= veth <= accounting x
(1 + LINK_OVERHEAD).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import REPO

sys.path.insert(0, str(REPO))
from benchmarks.netcluster import ClusterError, EmulatedCluster, netns_available, parse_rate, tbf_params  # noqa: E402

AVAILABLE, WHY = netns_available()
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=f"no network namespaces here: {WHY}")

LINK_OVERHEAD = 0.03
"""Largest share of link bytes above the accounting's cross-node bytes (headers, ACKs, barriers; module doc)."""

TRAIN = ["-m", "shardfusion.train", "--preset", "tiny", "--experts", "0", "--fsdp-outer-degree", "2", "--steps", "4",
         "--save-every", "2", "--warmup", "1", "--eval-every", "4", "--eval-batches", "4", "--batch-size", "2",
         "--seq-len", "32", "--grad-accum", "2", "--dropout", "0.1", "--data-bytes", "100000",
         "--sample-tokens", "0", "--no-progress"]


def _ns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_parse_rate_and_tbf_params():
    assert parse_rate("200mbit") == 200_000_000 and parse_rate("1gbit") == 10**9 and parse_rate(5000) == 5000
    assert parse_rate("12.5mbps") == 100_000_000  # megabytes per second
    assert parse_rate(None) is None and parse_rate("unlimited") is None
    for bad in ("fast", "10 furlongs", 0, -5, True, 1.5):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    # the bucket holds a 64 KiB GSO packet and >= 2 ms of the rate; the queue >= 8 MiB and 50 ms
    assert tbf_params(10**8) == {"burst": 256 * 1024, "limit": 8 * 2**20}
    assert tbf_params(10**10) == {"burst": 2_500_000, "limit": 62_500_000}
    with pytest.raises(ValueError, match="nodes"):
        EmulatedCluster(nodes=1)


def _run(cluster: EmulatedCluster, args: list[str], timeout: float = 150) -> str:
    procs = cluster.torchrun([*TRAIN, *args], nproc_per_node=2, cwd=REPO)
    cluster.wait(procs, timeout)
    return cluster.log(procs[0]).read_text()


@needs_netns
@pytest.mark.timeout(3 * 150 + 30)
def test_train_on_two_nodes_and_exact_resume(tmp_path: Path):
    from shardfusion.checkpoint import read_all
    from shardfusion.train.metrics import read_metrics

    ref, out = tmp_path / "reference", tmp_path / "resumed"
    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        before = cluster.tx_bytes()
        # the reference and the first half run at the same time (two jobs, two rendezvous ports): their start-up,
        # most of a tiny job's time, overlaps
        jobs = [cluster.torchrun([*TRAIN, *args], nproc_per_node=2, cwd=REPO)
                for args in (["--out", str(ref)], ["--stop-after", "2", "--out", str(out)])]
        cluster.wait(jobs[0] + jobs[1], 150)
        crossed = [a - b for a, b in zip(cluster.tx_bytes(), before)]
        first = cluster.log(jobs[1][0]).read_text()
        second = _run(cluster, ["--out", str(out)])
    assert "resuming" not in first
    assert "resuming at step 2 from" in second and "not an exact resume" not in second, second[-3000:]
    comm = json.loads((ref / "summary.json").read_text())["comm"]
    assert comm["ranks_per_node"] == 2 and comm["nodes"] == 2, comm  # torchrun's LOCAL_WORLD_SIZE: 2 nodes of 2
    per_step = comm["cross_node_bytes_per_step"]  # rank 0's; its node-mate sends as much
    assert per_step > 0 and all(c >= 2 * (4 + 2) * per_step for c in crossed), (crossed, per_step)  # 4 + 2 steps
    ours, theirs = read_all(str(out / "checkpoints" / "step-4")), read_all(str(ref / "checkpoints" / "step-4"))
    assert ours.keys() == theirs.keys() and any(k.endswith("/exp_avg_sq") for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    train, _ = read_metrics(out / "metrics.jsonl")
    ref_train, _ = read_metrics(ref / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for mine, theirs_ in zip(train[2:], ref_train[2:]):
        for k in ("loss", "grad_norm", "lr"):
            assert mine[k] == theirs_[k], (mine["step"], k)


@needs_netns
@pytest.mark.timeout(150)
def test_accounting_cross_node_bytes_match_the_veth_counters():
    from benchmarks.link import run_rate

    steps = 3
    opts = {"variants": ["sf-hsdp"], "repeats": 1, "warmup": 1, "steps": steps, "regime": "comm", "seed": 0,
            "shape": {"batch": 1, "seq": 32, "n_layer": 2, "d_model": 128, "n_head": 4}}
    raw = run_rate("1gbit", opts, timeout=120)
    v = raw["variants"]["sf-hsdp"]
    link = v["link_bytes"][0]  # per node, over the timed steps
    acct = [sum(node.values()) for node in v["accounting"][0]]
    by_cat = v["accounting"][0][0]
    params = raw["unit_numel"]["root"] + sum(raw["unit_numel"]["blocks"])
    # what crosses is the replicate all-reduce of each rank's half of every unit (2 ranks per node: the whole model
    # per node, padding aside) and the clipping scalar's world ring
    assert by_cat["replicate_all_reduce"] >= steps * params * 4 and by_cat["inner_all_gather"] == 0
    assert by_cat["replicate_all_reduce"] <= steps * params * 4 * 1.01
    for n in range(2):
        assert acct[n] <= link[n] <= acct[n] * (1 + LINK_OVERHEAD), (n, link, acct)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_netns
@pytest.mark.timeout(90)
def test_namespaces_removed_after_a_failing_child(tmp_path: Path):
    script = tmp_path / "fail.py"
    pid_file = f"os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK'])"
    script.write_text("import os, sys, time\n"
                      f"open({pid_file}, 'w').write(str(os.getpid()))\n"
                      "if os.environ['RANK'] == '1':\n    time.sleep(1); sys.exit(3)\ntime.sleep(120)\n")
    with pytest.raises(ClusterError, match="exited with") as error:
        with EmulatedCluster(nodes=2, rate="100mbit") as cluster:
            names = [cluster.netns(0), cluster.netns(1)]
            assert all(n in _ns_list() for n in names)
            procs = cluster.torchrun([str(script)], nproc_per_node=1)
            cluster.wait(procs, 60)
    assert "exitcode  : 3" in str(error.value)  # the failing node's log tail is in the message
    listed = _ns_list()
    assert not any(n in listed for n in names), listed
    survivor = int((tmp_path / "pid0").read_text())  # rank 0 was sleeping: killed with its node's torchrun
    deadline = time.monotonic() + 5
    while _alive(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(survivor)
    assert os.environ.get("GLOO_SOCKET_IFNAME") != cluster.ifname(0)  # the parent's environment is untouched
