"""Fault-tolerant replica groups (--ft-lighthouse), as whole runs of the training job: each replica group is a job
of its own (2 gloo ranks), joined by a torchft lighthouse (benchmarks/ft.py starts both).

- Every group alive (the GPT-MoE at --ep 2 inside each group): the run equals HSDP 2 x 2 of the same flags in one
  job (the reference): the same losses and gradient norms, and bitwise the same parameters (experts included) and
  optimizer state in the step-8 checkpoint. The first group, started alone with --ft-min-replicas 2, waits and says
  so until the second joins. The same parity, 4 steps, with a mode inside each group (the dense GPT): --mp 2, and
  --init-from a Hugging Face folder (whose first loss is also a single-process transformers forward). The HSDP
  reference runs beside the groups (its start-up overlaps theirs on two cores), with a longer lighthouse heartbeat
  timeout, as no group dies there.
- One group hung without dying (SIGSTOP inside step 10), then killed with SIGKILL inside step 60 and restarted at
  once, in one run (on two emulated nodes when network namespaces are available, else on loopback). The hang: the
  survivor's average runs into --ft-timeout, it discards that step and goes on alone; continued (SIGCONT), the hung
  group is healed from the survivor and trains beside it again. The kill: the survivor discards the step in
  flight, goes on alone after about the lighthouse's heartbeat timeout (not a restart); the restarted group resumes
  from the shared checkpoint, copies the live state from the survivor at a quorum and ends bitwise equal to it
  (state digests of both group ranks).
- A group of other shapes (--nproc 1) stops at the recovery that precedes the check, and the other goes on waiting,
  saying so; then, in the same run, groups started with different settings, and in another a quorum that cannot
  form within --ft-quorum-timeout, stop with one line (exit 1) instead of a traceback or a silent divergence.
- Bad fault-tolerance flags and an unreachable lighthouse are one-line usage errors before any worker starts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

pytest.importorskip("torchft")

from harness import REPO, TRAIN_TIMEOUT_S, start_train, train_usage_error  # noqa: E402

sys.path.insert(0, str(REPO))
from benchmarks.ft import TRAIN, Replicas, free_port, read_run, run_scenario  # noqa: E402
from shardfusion.train.job_ft import PAUSE_ENV, PAUSED_FILE  # noqa: E402
from benchmarks.netcluster import EmulatedCluster, netns_available  # noqa: E402
from shardfusion.checkpoint import read_all  # noqa: E402

STEPS = 8
FLAGS = [*TRAIN, "--steps", str(STEPS), "--save-every", str(STEPS), "--eval-every", "4"]
HEARTBEAT_S, FT_TIMEOUT_S = 4.0, 5.0
"""The failure run's lighthouse heartbeat timeout (above benchmarks.ft's 2 s: a group's heartbeats starved for 2 s
on a loaded machine made the other group go on without it) and --ft-timeout, above it, so that a hang's detection
tells which one caught it."""
PARITY_HEARTBEAT_MS = 10000
"""The lighthouse's heartbeat timeout in the runs where every group stays alive: their HSDP reference runs beside
them (`harness.start_train`), so a group's heartbeats may be starved longer than benchmarks.ft's 2 s; no group dies
there, so nothing waits on this timeout."""
CONSOLE_LINES = 40
"""At most this many console lines of a group's 8-step run: the job's own (the evaluations, the waits, the summary),
not torchft's (about 9 per step at its default level: OUT/replica-<id>/torchft.log holds its Python side)."""


def _model_state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_all(str(path)).items() if not k.startswith("rank/")}  # not the RNG states


def _assert_equals_reference(out: Path, ref: Path, steps: int) -> None:
    """Both replica groups of the run in ``out`` against the synchronous run in ``ref`` (one job, HSDP): bitwise the
    same parameters and AdamW state in the last step's checkpoint (written by the quorum's first group), the same
    gradient norms and learning rates every step, the losses to 1e-6 (the mean is taken in another order); every
    step committed by both groups together, and the groups' state digests equal rank for rank."""
    ours = _model_state(out / "checkpoints" / f"step-{steps}")
    theirs = _model_state(ref / "checkpoints" / f"step-{steps}")
    assert ours.keys() == theirs.keys() and any(k.endswith("/exp_avg_sq") for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    ref_train = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(ref_train) == steps
    digests = []
    for group in (0, 1):
        run_ = read_run(out, group)
        assert [r["step"] for r in run_["train"]] == list(range(1, steps + 1))
        assert all(r["ft_participants"] == 2 for r in run_["train"])
        for mine, theirs_ in zip(run_["train"], ref_train):
            assert mine["grad_norm"] == theirs_["grad_norm"] and mine["lr"] == theirs_["lr"], mine["step"]
            assert mine["loss"] == pytest.approx(theirs_["loss"], rel=1e-6)
        ft = run_["summary"]["fault_tolerance"]
        assert ft["committed_steps"] == steps and ft["discarded"] == [] and ft["replicas"] == 2
        digests.append(ft["state_digests"])
    assert digests[0] == digests[1] and len(set(digests[0])) == len(digests[0]), digests  # each rank its own shard


MOE = ["--experts", "4", "--top-k", "2", "--ep", "2"]
"""The all-alive run's model: the GPT-MoE at ep 2 inside each group, each group rank holding 2 of the 4 experts, the
same 2 as the same rank of the other group (so torchft's average of the expert buffers' gradients over the group
ranks is HSDP's replicate all-reduce of them). The other runs train the dense GPT."""


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_all_alive_equals_hsdp_and_waits_for_min_replicas(tmp_path: Path) -> None:
    ref = tmp_path / "hsdp"
    out = tmp_path / "ft"
    with start_train([*FLAGS, *MOE, "--nproc", "4", "--fsdp-outer-degree", "2", "--out", str(ref)]) as reference, \
            Replicas(out, [*FLAGS, *MOE], heartbeat_ms=PARITY_HEARTBEAT_MS) as run:
        run.start(0, extra=["--ft-min-replicas", "2"])
        run.until(lambda: "waiting at step 0" in run.log("replica0"), TRAIN_TIMEOUT_S, "replica group 0 waiting")
        time.sleep(2.0)
        assert run.committed(0) == 0 and run.procs["replica0"].poll() is None  # waiting, not training or gone
        assert "--ft-min-replicas 2" in run.log("replica0")
        run.start(1, extra=["--ft-min-replicas", "2"])
        codes = run.wait(["replica0", "replica1"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 0, "replica1": 0}, run.log("replica0")[-3000:] + run.log("replica1")[-3000:]
        assert "; ep2" in run.log("replica0"), run.log("replica0")[-3000:]
        result = reference.finish()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "; ep2" in result.stdout, result.stdout[-3000:]
    _assert_equals_reference(out, ref, STEPS)
    for group in (0, 1):
        console = run.log(f"replica{group}").splitlines()
        foreign = [line for line in console if ("torchft" in line and "torchft's own log" not in line)
                   or "Traceback" in line or "Warning" in line]
        assert not foreign and len(console) <= CONSOLE_LINES, "\n".join(console)
        assert "reconfiguring for quorum" in (out / f"replica-{group}" / "torchft.log").read_text()
    waits = read_run(out, 0)["summary"]["fault_tolerance"]["waits"]
    assert len(waits) == 1 and waits[0]["step"] == 0 and waits[0]["seconds"] >= 2.0, waits
    assert (out / "replica-0" / "config.json").is_file() and not (out / "metrics.jsonl").exists()


PARITY_STEPS = 4


def _groups_equal_hsdp(tmp_path: Path, extra: list[str], shows: str, train: list[str] = TRAIN,
                       groups_only: tuple[str, ...] = (), groups_show: str = "") -> None:
    """2 replica groups x 2 ranks with the flags ``train`` + ``extra`` against HSDP outer 2 in one job of 4 ranks
    with the same flags (the same global batch; it runs beside the groups), `_assert_equals_reference` after
    `PARITY_STEPS` steps; ``shows``:
    a piece of the console's layout line both runs must print (the mode is on); ``groups_only``: flags of the
    groups alone, which must print ``groups_show``."""
    flags = [*train, "--steps", str(PARITY_STEPS), "--warmup", "2", "--save-every", str(PARITY_STEPS),
             "--eval-every", str(PARITY_STEPS), *extra]
    ref = tmp_path / "hsdp"
    out = tmp_path / "ft"
    with start_train([*flags, "--nproc", "4", "--fsdp-outer-degree", "2", "--out", str(ref)]) as reference, \
            Replicas(out, flags, heartbeat_ms=PARITY_HEARTBEAT_MS) as run:
        for group in (0, 1):
            run.start(group, extra=["--ft-min-replicas", "2", *groups_only])
        codes = run.wait(["replica0", "replica1"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 0, "replica1": 0}, run.log("replica0")[-3000:] + run.log("replica1")[-3000:]
        assert shows in run.log("replica0") and groups_show in run.log("replica0"), run.log("replica0")[-3000:]
        result = reference.finish()
    assert result.returncode == 0, result.stderr[-3000:]
    assert shows in result.stdout, result.stdout[-3000:]
    _assert_equals_reference(out, ref, PARITY_STEPS)


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_tensor_parallel_groups_equal_hsdp_with_mp(tmp_path: Path) -> None:
    """--mp 2 inside each replica group: 2 groups x 2 ranks (tensor parallel over the group's 2 ranks, FSDP degree
    1) against HSDP outer 2 x mp 2 in one job of 4 ranks, the same global batch: the mp ranks of a group read the
    same samples, torchft averages each mp rank's pieces with the same mp rank of the other group, the clipping norm
    counts every element once; so the same losses and norms and bitwise the same checkpoint."""
    _groups_equal_hsdp(tmp_path, ["--mp", "2"], "x mp2;")


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_groups_from_a_pretrained_folder_equal_hsdp(tmp_path: Path) -> None:
    """--init-from a Hugging Face folder (a tiny Llama written by save_pretrained: a Hugging Face model) in each
    replica group against HSDP outer 2 x inner 2 from the same folder in one job: both start from the folder's
    weights (the HSDP run's first loss is a single-process transformers forward of them on the 4 ranks' batches),
    and the groups end with the same losses and norms and bitwise the same checkpoint. The groups keep the decoder
    layers gathered from forward to backward by --reshard-policy auto (a budget that fits them all; the HSDP job
    frees them after forward): the policy moves no value."""
    pytest.importorskip("transformers")
    from pretrained import first_loss, save_tiny_llama

    folder = tmp_path / "pretrained"
    save_tiny_llama(folder)
    at = TRAIN.index("--experts")
    train = TRAIN[:at] + TRAIN[at + 2:]  # the folder decides the model
    _groups_equal_hsdp(tmp_path, ["--init-from", str(folder)], f"LlamaForCausalLM (from {folder})", train=train,
                       groups_only=("--reshard-policy", "auto", "--max-memory-per-rank", "64GB"),
                       groups_show="reshard policy auto: ")
    first = json.loads((tmp_path / "hsdp" / "metrics.jsonl").read_text().splitlines()[1])
    batch, seq_len, data_bytes = (int(train[train.index(flag) + 1])
                                  for flag in ("--batch-size", "--seq-len", "--data-bytes"))
    reference = first_loss(folder, world=4, batch_size=batch, seq_len=seq_len, data_bytes=data_bytes)
    assert first["step"] == 1 and first["loss"] == pytest.approx(reference, rel=1e-5)
    assert json.loads((tmp_path / "ft" / "replica-0" / "config.json").read_text())["model"]["hidden_size"] == 48


@pytest.mark.timeout(300)
def test_a_hung_then_killed_replica_group_is_survived_and_recovers(tmp_path: Path) -> None:
    ok, _ = netns_available()
    steps, hang_at, kill_at = 160, 10, 60
    train = [*TRAIN[:TRAIN.index("--ft-timeout")], "--ft-timeout", str(FT_TIMEOUT_S)]
    # hold_at: the survivor cannot end the run before the restarted group has started, however loaded the machine
    # (so the run needs no more steps than the hold's 80 and as many together after it)
    scenario = dict(steps=steps, hang_at=hang_at, kill_at=kill_at, restart_after=0, hold_at=steps // 2, train=train,
                    heartbeat_ms=int(HEARTBEAT_S * 1000), timeout=240)
    if ok:
        with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
            r = run_scenario(tmp_path, cluster=cluster, **scenario)
    else:  # the same scenario on loopback: the engine is the same, the link is not emulated
        r = run_scenario(tmp_path, **scenario)
    # the survivor: two steps discarded, the ones in flight at the hang and at the kill, then on alone each time
    hang = r["hang"]
    assert hang["step"] == hang_at and r["killed_in_step"] >= kill_at, (hang, r["killed_in_step"])
    discarded = [d["step"] for d in r["discarded"]]  # (+ one at the hold, if the restarted group was in it late)
    assert discarded[:2] == [hang["step"], r["killed_in_step"]] and discarded[2:] in ([], [steps // 2]), discarded
    # the hang: the hung group's sockets stay open, so the survivor's average waits until --ft-timeout fails it
    # (not less: no earlier signal; not much more: not the quorum timeout, 120 s, nor the pause's 300 s)
    assert FT_TIMEOUT_S <= hang["survivor_gap_s"] <= FT_TIMEOUT_S + 5.0, hang
    # the kill: found at once (the dead group's sockets close), then the quorum forms after its heartbeats stop
    bound = max(HEARTBEAT_S, FT_TIMEOUT_S) + 2.0
    assert 0.5 * HEARTBEAT_S <= r["survivor_gap_s"] <= bound, r["survivor_steps_around_failure"]
    assert r["survivor_median_step_s"] < 0.5
    survivor = read_run(tmp_path, 0)
    assert [x["step"] for x in survivor["train"]] == list(range(1, steps + 1))  # every step, no restart
    alone = {x["step"] for x in survivor["train"] if x["ft_participants"] == 1}
    assert {hang["step"] + 1, hang["continued_at_step"], r["killed_in_step"] + 1} <= alone, sorted(alone)[:20]
    # the hung group, continued, was healed from the survivor (no restart) and trained beside it until the kill
    healed = [int(line.split("recovered step ")[1].split()[0]) for line in
              (tmp_path / "replica1.log").read_text().splitlines() if "ft replica 1: recovered step" in line]
    healed = [step for step in healed if step > hang["step"]]  # not step 0's (torchft's first sync)
    assert len(healed) == 1 and hang["continued_at_step"] <= healed[0] <= r["killed_in_step"], healed
    ft = survivor["summary"]["fault_tolerance"]
    changes = [(c["step"], c["participants"], c["was"]) for c in ft["quorum_changes"]]
    assert (healed[0], 2, 1) in changes, changes
    together = {x["step"] for x in survivor["train"] if healed[0] < x["step"] <= r["killed_in_step"]}
    assert not together & alone and len(together) == r["killed_in_step"] - healed[0], sorted(alone)[:20]
    # the killed group restarted: resumed from the shared checkpoint, then the live state from the survivor
    victim_log = r["logs_tail"]["replica1b"]
    assert "resuming at step" in (tmp_path / "replica1b.log").read_text()
    assert len(r["recoveries"]) == 1 and r["recoveries"][0]["step"] > r["killed_in_step"], r["recoveries"]
    assert r["recoveries"][0]["bytes"] > 0, victim_log
    victim = read_run(tmp_path, 1)
    after = [x for x in victim["train"] if x["step"] > r["recoveries"][0]["step"]]
    assert after and after[-1]["step"] == steps and all(x["ft_participants"] == 2 for x in after)
    # bitwise in step from then on
    assert r["digests_equal"], r["ft"]
    assert r["final_loss"]["0"] == r["final_loss"]["1"] and r["final_val_loss"]["0"] == r["final_val_loss"]["1"]
    assert ft["quorum_changes"][-1]["participants"] == 2


def _error_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("shardfusion: error: ")]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S)
def test_groups_of_other_shapes_or_settings_stop_in_one_line(tmp_path: Path) -> None:
    """One run, group 0 waiting for --ft-min-replicas 2 throughout:

    - group 1 with --nproc 1 (shards twice as long) is healed from group 0 at the first quorum, before the
      agreement check: it stops with one line (exit 1) on all its ranks; group 0 goes on waiting for
      --ft-min-replicas 2 and says so (no silent hang);
    - then group 1 again with another --lr: both groups find it at their first quorum, before any gradient is
      averaged, and exit 1 with the same line (not a traceback, not a silent divergence)."""
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
        run.nproc = 2
        run.start(1, "b", extra=["--ft-min-replicas", "2", "--lr", "1e-3"])
        codes = run.wait(["replica0", "replica1b"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 1, "replica1b": 1}, codes
        lines = {_error_line(run.log(name)) for name in ("replica0", "replica1b")}
    assert len(lines) == 1 and "started with different settings" in lines.pop()
    assert run.committed(0) == run.committed(1) == 0 and not (tmp_path / "checkpoints").exists()


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
def test_usage_errors_before_launch(tmp_path: Path, extra: list[str], words: str,
                                    capsys: pytest.CaptureFixture) -> None:
    """In this process (`harness.train_usage_error`): exit status 2 and one line before any worker starts."""
    lighthouse = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    extra = [lighthouse if a == "LH" else a for a in extra]
    line = train_usage_error([*FLAGS, "--nproc", "2", "--out", str(tmp_path / "run"), *extra], capsys)
    assert words in line and not (tmp_path / "run").exists()


# ---- DiLoCo across replica groups (--outer-sync diloco with --ft-lighthouse: shardfusion.train.job_outer_ft) ----

DILOCO_STEPS, DILOCO_H = 12, 2
DILOCO = [*TRAIN, "--steps", str(DILOCO_STEPS), "--save-every", str(DILOCO_H), "--keep", "20", "--eval-every",
          str(DILOCO_STEPS), "--outer-sync", "diloco", "--outer-every", str(DILOCO_H), "--outer-lr", "0.7",
          "--outer-momentum", "0.9"]
"""The paper's outer optimizer (momentum: the outer state a group must not lose), an outer step every 2 steps, a
checkpoint at each."""
DILOCO_JOIN_MS = 10000
"""The lighthouse's join timeout for DiLoCo: a group waits this long in a quorum for a live group still in its inner
steps (above the skew of two groups' arrival at an outer step on a loaded machine; docs/fault-tolerance.md)."""


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def diloco_hsdp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """The synchronous-layout reference: one job, HSDP 2 x 2, --outer-sync diloco with the same flags. Started when
    the first test asks for it, it runs beside that test's replica groups: call the fixture for its folder, once
    the groups are done (it waits for the job)."""
    ref = tmp_path_factory.mktemp("diloco-hsdp")
    job = start_train([*DILOCO, "--nproc", "4", "--fsdp-outer-degree", "2", "--out", str(ref)])

    def finished() -> Path:
        result = job.finish()
        assert result.returncode == 0, result.stderr[-3000:]
        return ref

    yield finished
    job.stop()


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_diloco_across_replica_groups_equals_diloco_on_hsdp(tmp_path: Path,
                                                            diloco_hsdp: Callable[[], Path]) -> None:
    """Two replica groups, each of 2 ranks, DiLoCo between them through torchft, against HSDP 2 x 2 with DiLoCo
    between its replicas: the same outer-step schedule, replica 0's losses and gradient norms step by step, and
    after the last outer step bitwise the same parameters (every group's) and outer state."""
    out = tmp_path / "ft"
    with Replicas(out, DILOCO, join_ms=DILOCO_JOIN_MS, heartbeat_ms=PARITY_HEARTBEAT_MS) as run:
        for group in (0, 1):
            run.start(group, extra=["--ft-min-replicas", "2"])
        codes = run.wait(["replica0", "replica1"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 0, "replica1": 0}, run.log("replica0")[-3000:] + run.log("replica1")[-3000:]
    hsdp = diloco_hsdp()
    ref = _records(hsdp)
    assert [r["step"] for r in ref if r["outer_synced"]] == list(range(DILOCO_H, DILOCO_STEPS + 1, DILOCO_H))
    runs = [read_run(out, group) for group in (0, 1)]
    for run_ in runs:
        assert [r["step"] for r in run_["train"]] == list(range(1, DILOCO_STEPS + 1))
        assert [r["outer_synced"] for r in run_["train"]] == [r["outer_synced"] for r in ref]
        assert all(r["ft_participants"] == 2 for r in run_["train"])
        assert run_["summary"]["outer_sync"]["outer_steps"] == [DILOCO_STEPS // DILOCO_H]
        assert run_["summary"]["fault_tolerance"]["discarded"] == []
    for mine, theirs in zip(runs[0]["train"], ref):  # group 0 is HSDP's replica 0 (the one the reference logs)
        assert mine["grad_norm"] == theirs["grad_norm"] and mine["lr"] == theirs["lr"], mine["step"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert [r["loss"] for r in runs[1]["train"]] != [r["loss"] for r in runs[0]["train"]]  # its own data slices
    ft = [run_["summary"]["fault_tolerance"] for run_ in runs]
    assert ft[0]["shard_digests"] == ft[1]["shard_digests"]  # one model after the last outer step
    ours = read_all(str(out / "checkpoints" / f"step-{DILOCO_STEPS}"))
    theirs = read_all(str(hsdp / "checkpoints" / f"step-{DILOCO_STEPS}"))
    model = [k for k in theirs if not k.startswith("rank/")]
    assert model and all(torch.equal(ours[k], theirs[k]) for k in model), [k for k in model
                                                                          if not torch.equal(ours[k], theirs[k])]
    outer = [k for k in theirs if k.startswith(("rank/0/diloco/snapshot/", "rank/0/diloco/momentum/"))]
    assert outer and all(torch.equal(ours[k], theirs[k]) for k in outer)


def _copy_checkpoint(src: Path, dst: Path, step: int) -> None:
    import shutil
    shutil.copytree(src / "checkpoints" / f"step-{step}", dst / "checkpoints" / f"step-{step}")


@pytest.mark.timeout(400)
def test_diloco_a_group_killed_between_outer_steps(tmp_path: Path, diloco_hsdp: Callable[[], Path]) -> None:
    """Group 1 killed inside step 6 (between the outer steps after steps 4 and 6) and restarted at once; group 0
    holds inside step 8 until the restarted group has resumed and joins the quorum, where it waits (alone it is
    not a majority of the live groups), so that they meet at the outer step after step 8.

    - the survivor trains every step without a restart; up to the kill its losses are HSDP's replica 0's (nothing
      of the committed state lost); its outer step after step 6 is a quorum of one, and equals that of group 0
      resumed alone from the step-4 checkpoint (a reference run: what the live quorum computes from the committed
      state), bitwise;
    - the restarted group resumes from the checkpoint, is healed from the survivor at the outer step after step 8
      (taking part without a pseudo-gradient of its own), trains beside it from then on, and both end with bitwise
      the same parameters."""
    hsdp = diloco_hsdp()  # done before the failure run starts: no job beside it
    out = tmp_path / "ft"
    kill_in, hold_in = 5, 7  # 0-based loop steps: inside steps 6 and 8 (job_ft.PAUSE_ENV)
    train = [*DILOCO[:DILOCO.index("--ft-timeout")], "--ft-timeout", str(FT_TIMEOUT_S), *DILOCO[DILOCO.index(
        "--ft-timeout") + 2:]]
    with Replicas(out, train, heartbeat_ms=int(HEARTBEAT_S * 1000), join_ms=DILOCO_JOIN_MS) as run:
        run.start(0, env={PAUSE_ENV: str(hold_in)})
        run.start(1, env={PAUSE_ENV: str(kill_in)})
        victim, survivor = out / "replica-1" / PAUSED_FILE, out / "replica-0" / PAUSED_FILE
        run.until(victim.exists, TRAIN_TIMEOUT_S, "replica group 1 inside step 6")
        run.kill("replica1")
        run.start(1, "b")
        # its manager up (heartbeats: the survivor alone is no longer a majority of the live groups), it joins
        run.until(lambda: survivor.exists() and "torchft's own log" in run.log("replica1b"), TRAIN_TIMEOUT_S,
                  "the survivor inside step 8 and the restarted group joining")
        survivor.unlink()
        codes = run.wait(["replica0", "replica1b"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 0, "replica1b": 0}, run.log("replica0")[-3000:] + run.log("replica1b")[-3000:]
    ref = _records(hsdp)
    alive, back = read_run(out, 0), read_run(out, 1)
    steps = alive["train"]
    assert [r["step"] for r in steps] == list(range(1, DILOCO_STEPS + 1))  # every step, no restart
    assert [r["outer_synced"] for r in steps] == [r["outer_synced"] for r in ref]
    for mine, theirs in zip(steps[:kill_in], ref):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6) and mine["grad_norm"] == theirs["grad_norm"]
    assert steps[kill_in]["ft_participants"] == 1  # the outer step after step 6: the survivor alone
    assert all(r["ft_participants"] == 2 for r in steps[hold_in:])  # with the restarted group from step 8 on
    # the restarted group: resumed from the run's checkpoint, healed at the outer step after step 8, then trained on
    resumed = int(run.log("replica1b").split("resuming at step ")[1].split()[0])
    healed = [int(line.split("recovered step ")[1].split()[0]) for line in run.log("replica1b").splitlines()
              if "ft replica 1: recovered step" in line]
    assert resumed in (4, 6) and healed == [hold_in + 1], (resumed, healed)
    assert [r["step"] for r in back["train"] if r["step"] > healed[0]] == list(range(healed[0] + 1,
                                                                                    DILOCO_STEPS + 1))
    ft = [alive["summary"]["fault_tolerance"], back["summary"]["fault_tolerance"]]
    assert ft[0]["shard_digests"] == ft[1]["shard_digests"]
    assert alive["summary"]["outer_sync"]["outer_steps"] == back["summary"]["outer_sync"]["outer_steps"]
    # the survivor's lone outer step is what a quorum of group 0 alone computes from the committed step-4 state
    lone = tmp_path / "lone"
    with Replicas(lone, train, join_ms=1000) as run:
        _copy_checkpoint(out, lone, 4)
        run.start(0, extra=["--ft-join-wait", "0", "--stop-after", "6"])
        codes = run.wait(["replica0"], TRAIN_TIMEOUT_S)
        assert codes == {"replica0": 0}, run.log("replica0")[-3000:]
    assert "resuming at step 4" in run.log("replica0")
    ours, theirs = (read_all(str(path / "checkpoints" / "step-6")) for path in (out, lone))
    keys = [k for k in theirs if not k.startswith("rank/") or "/diloco/" in k]
    assert keys and all(torch.equal(ours[k], theirs[k]) for k in keys), [k for k in keys
                                                                         if not torch.equal(ours[k], theirs[k])]
