"""Fault-tolerant replica groups (--ft-lighthouse), as whole runs of the training job: each replica group is a job
of its own (2 gloo ranks), joined by a torchft lighthouse (benchmarks/ft.py starts both).

- Every group alive: the run equals HSDP 2 x 2 of the same flags in one job (the reference): the same losses and
  gradient norms, and bitwise the same parameters and optimizer state in the step-8 checkpoint. The first group,
  started alone with --ft-min-replicas 2, waits and says so until the second joins.
- One group killed with SIGKILL at step 10 and restarted at once (on two emulated nodes when network namespaces
  are available, else on loopback): the survivor discards the step in flight, goes on alone after about the
  lighthouse's heartbeat timeout (not a restart), the restarted group resumes from the shared checkpoint, copies the
  live state from the survivor at a quorum and ends bitwise equal to it (state digests of both group ranks).
- Groups started with different settings, and a quorum that cannot form within --ft-quorum-timeout, stop with one
  line (exit 1) instead of a traceback or a silent divergence; a group of other shapes (--nproc 1) stops at the
  recovery that precedes the check, and the other goes on waiting, saying so.
- Bad fault-tolerance flags and an unreachable lighthouse are one-line usage errors before any worker starts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from harness import REPO, TRAIN_TIMEOUT_S, run_train, usage_error_line  # noqa: E402

sys.path.insert(0, str(REPO))
from benchmarks.ft import HEARTBEAT_MS, TRAIN, Replicas, free_port, read_run, run_scenario  # noqa: E402
from benchmarks.netcluster import EmulatedCluster, netns_available  # noqa: E402
from shardfusion.checkpoint import read_all  # noqa: E402

STEPS = 8
FLAGS = [*TRAIN, "--steps", str(STEPS), "--save-every", str(STEPS), "--eval-every", "4"]
FT_TIMEOUT_S = 5.0  # TRAIN's --ft-timeout
CONSOLE_LINES = 40
"""At most this many console lines of a group's 8-step run: the job's own (the evaluations, the waits, the summary),
not torchft's (about 9 per step at its default level: OUT/replica-<id>/torchft.log holds its Python side)."""


def _model_state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_all(str(path)).items() if not k.startswith("rank/")}  # not the RNG states


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_all_alive_equals_hsdp_and_waits_for_min_replicas(tmp_path: Path) -> None:
    ref = tmp_path / "hsdp"
    result = run_train([*FLAGS, "--nproc", "4", "--fsdp-outer-degree", "2", "--out", str(ref)])
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "ft"
    with Replicas(out, FLAGS) as run:
        run.start(0, extra=["--ft-min-replicas", "2"])
        run.until(lambda: "waiting at step 0" in run.log("replica0"), TRAIN_TIMEOUT_S, "replica group 0 waiting")
        time.sleep(2.0)
        assert run.committed(0) == 0 and run.procs["replica0"].poll() is None  # waiting, not training or gone
        assert "--ft-min-replicas 2" in run.log("replica0")
        run.start(1, extra=["--ft-min-replicas", "2"])
        codes = run.wait(["replica0", "replica1"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 0, "replica1": 0}, run.log("replica0")[-3000:] + run.log("replica1")[-3000:]
    ours = _model_state(out / "checkpoints" / f"step-{STEPS}")  # written by the quorum's first group
    theirs = _model_state(ref / "checkpoints" / f"step-{STEPS}")
    assert ours.keys() == theirs.keys() and any(k.endswith("/exp_avg_sq") for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    ref_train = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    for group in (0, 1):
        run_ = read_run(out, group)
        assert [r["step"] for r in run_["train"]] == list(range(1, STEPS + 1))
        assert all(r["ft_participants"] == 2 for r in run_["train"])
        for mine, theirs_ in zip(run_["train"], ref_train):
            assert mine["grad_norm"] == theirs_["grad_norm"] and mine["lr"] == theirs_["lr"], mine["step"]
            assert mine["loss"] == pytest.approx(theirs_["loss"], rel=1e-6)  # the mean taken in another order
        ft = run_["summary"]["fault_tolerance"]
        assert ft["committed_steps"] == STEPS and ft["discarded"] == [] and ft["replicas"] == 2
        console = run.log(f"replica{group}").splitlines()
        foreign = [line for line in console if ("torchft" in line and "torchft's own log" not in line)
                   or "Traceback" in line or "Warning" in line]
        assert not foreign and len(console) <= CONSOLE_LINES, "\n".join(console)
        assert "reconfiguring for quorum" in (out / f"replica-{group}" / "torchft.log").read_text()
    waits = read_run(out, 0)["summary"]["fault_tolerance"]["waits"]
    assert len(waits) == 1 and waits[0]["step"] == 0 and waits[0]["seconds"] >= 2.0, waits
    assert (out / "replica-0" / "config.json").is_file() and not (out / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_a_killed_replica_group_is_survived_and_recovers(tmp_path: Path) -> None:
    ok, _ = netns_available()
    steps, kill_at = 600, 10
    if ok:
        with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
            r = run_scenario(tmp_path, steps=steps, kill_at=kill_at, restart_after=0, cluster=cluster, timeout=240)
    else:  # the same scenario on loopback: the engine is the same, the link is not emulated
        r = run_scenario(tmp_path, steps=steps, kill_at=kill_at, restart_after=0, timeout=240)
    # the survivor: one step discarded, the one in flight at the kill, then on alone, after the detection time
    assert len(r["discarded"]) == 1 and kill_at <= r["discarded"][0]["step"] <= kill_at + 2, r["discarded"]
    bound = max(HEARTBEAT_MS / 1000, FT_TIMEOUT_S) + 2.0
    assert 0.5 * HEARTBEAT_MS / 1000 <= r["survivor_gap_s"] <= bound, r["survivor_steps_around_failure"]
    assert r["survivor_median_step_s"] < 0.5
    survivor = read_run(tmp_path, 0)
    assert [x["step"] for x in survivor["train"]] == list(range(1, steps + 1))  # every step, no restart
    alone = [x["step"] for x in survivor["train"] if x["ft_participants"] == 1]
    assert alone and alone[0] == r["discarded"][0]["step"] + 1, alone[:3]
    # the victim: resumed from the shared checkpoint, then the live state from the survivor
    victim_log = r["logs_tail"]["replica1b"]
    assert "resuming at step" in (tmp_path / "replica1b.log").read_text()
    assert len(r["recoveries"]) == 1 and r["recoveries"][0]["step"] > kill_at, r["recoveries"]
    assert r["recoveries"][0]["bytes"] > 0, victim_log
    victim = read_run(tmp_path, 1)
    after = [x for x in victim["train"] if x["step"] > r["recoveries"][0]["step"]]
    assert after and after[-1]["step"] == steps and all(x["ft_participants"] == 2 for x in after)
    # bitwise in step from then on
    assert r["digests_equal"], r["ft"]
    assert r["final_loss"]["0"] == r["final_loss"]["1"] and r["final_val_loss"]["0"] == r["final_val_loss"]["1"]
    assert survivor["summary"]["fault_tolerance"]["quorum_changes"][-1]["participants"] == 2


def _error_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("shardfusion: error: ")]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_groups_started_with_different_settings_stop_in_one_line(tmp_path: Path) -> None:
    """Another --lr in one group: both groups find it at their first quorum, before any gradient is averaged,
    and exit 1 with the same line (not a traceback, not a silent divergence)."""
    with Replicas(tmp_path, FLAGS) as run:
        run.start(0, extra=["--lr", "1e-3"])
        run.start(1)
        codes = run.wait(["replica0", "replica1"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 1, "replica1": 1}, codes
        lines = {_error_line(run.log(f"replica{g}")) for g in (0, 1)}
    assert len(lines) == 1 and "started with different settings" in lines.pop()
    assert run.committed(0) == run.committed(1) == 0 and not (tmp_path / "checkpoints").exists()


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_a_group_of_other_shapes_stops_at_its_recovery_and_the_other_waits(tmp_path: Path) -> None:
    """Group 1 with --nproc 1 (shards twice as long) is healed from group 0 at the first quorum, before the
    agreement check: it stops with one line (exit 1) on all its ranks; group 0 goes on waiting for
    --ft-min-replicas 2 and says so (no silent hang)."""
    with Replicas(tmp_path, FLAGS) as run:
        run.start(0, extra=["--ft-min-replicas", "2"])
        run.until(lambda: "waiting at step 0" in run.log("replica0"), TRAIN_TIMEOUT_S, "replica group 0 waiting")
        run.nproc = 1
        run.start(1, extra=["--ft-min-replicas", "2"])
        codes = run.wait(["replica1"], TRAIN_TIMEOUT_S)
        line = _error_line(run.log("replica1"))
        assert codes == {"replica1": 1}, run.log("replica1")[-3000:]
        assert run.procs["replica0"].poll() is None  # still there, waiting
        assert run.committed(0) == 0
    assert "recovery: flat buffer 0 of the peer has 10304 elements on this group rank, this model's 20608" in line


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_a_quorum_that_cannot_form_stops_after_the_quorum_timeout(tmp_path: Path) -> None:
    """A lighthouse that needs two groups and one group alone (as with a peer that heartbeats but hangs): after
    --ft-quorum-timeout the group exits 1 with one line naming the flag."""
    with Replicas(tmp_path, FLAGS, lighthouse_min=2) as run:
        started = time.monotonic()
        run.start(0, extra=["--ft-quorum-timeout", "3"])
        codes = run.wait(["replica0"], TRAIN_TIMEOUT_S)
        took = time.monotonic() - started
        line = _error_line(run.log("replica0"))
    assert codes == {"replica0": 1} and took >= 3.0
    assert line.startswith("shardfusion: error: no quorum within --ft-quorum-timeout 3 s (lighthouse http://"), line
    assert "Timeout expired" in line


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
@pytest.mark.parametrize("extra, words", [
    (["--ft-replica-id", "0"], "--ft-replica-id needs --ft-lighthouse"),
    (["--ft-lighthouse", "LH", "--ft-replicas", "2", "--ft-replica-id", "2"], "--ft-replica-id 2 must be in 0 .. 1"),
    (["--ft-lighthouse", "LH", "--ft-replicas", "2", "--ft-replica-id", "0", "--pp", "2"],
     "--pp 2 with --ft-lighthouse"),
    (["--ft-lighthouse", "LH", "--ft-replicas", "2", "--ft-replica-id", "0", "--ft-min-replicas", "3"],
     "--ft-min-replicas 3 must be in 1 .. --ft-replicas 2"),
    (["--ft-lighthouse", "LH", "--ft-replicas", "2", "--ft-replica-id", "0"], "no lighthouse answers there"),
    (["--ft-lighthouse", "http://10.9.8.7:29510", "--ft-replicas", "2", "--ft-replica-id", "0", "--ft-host",
      "127.0.0.1"], "--ft-host 127.0.0.1 is this machine's loopback, but the lighthouse is at 10.9.8.7"),
])
def test_usage_errors_before_launch(tmp_path: Path, extra: list[str], words: str) -> None:
    lighthouse = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    extra = [lighthouse if a == "LH" else a for a in extra]
    result = run_train([*FLAGS, "--nproc", "2", "--out", str(tmp_path / "run"), *extra])
    assert words in usage_error_line(result) and not (tmp_path / "run").exists()
