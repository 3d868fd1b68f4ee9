"""Checkpoints of the training job: exact resume and a killed worker, as whole runs of `python -m shardfusion.train`
(4 gloo workers: GPT-MoE at ep 2, HSDP outer 2; dropout on, 2 micro-batches).

Reference: one uninterrupted run of 30 steps saving every 5. Exact resume: the same flags with --stop-after 15, then
the same command again, which resumes from step 15 by itself; its step-30 checkpoint (parameters, AdamW state) and
its metrics must equal the reference bitwise. Killed worker: the same flags with --max-restarts 2; once the first
checkpoint is published the test SIGKILLs one worker; the elastic launcher restarts all workers, which resume from
the latest checkpoint, and the run must end equal to the reference bitwise. The reference's checkpoint resumed with
--outer-sync diloco starts a new outer period from the loaded parameters (docs/slow-links.md). The checkpoint
flags, the metrics log and config.json of a resumed run are tested in one process in tests/unit/test_train_config.py
and tests/unit/test_train_outputs.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.netcluster import descendants
from harness import REPO, TRAIN_TIMEOUT_S, clean_env, run_train, start_train, train_usage_error
from shardfusion.checkpoint import latest_checkpoint, read_all, read_meta
from shardfusion.checkpoint.export import export
from shardfusion.models.gpt import GPT, GPTConfig
from shardfusion.train.config import JobConfig
from shardfusion.train.metrics import read_metrics

STEPS, SAVE_EVERY, KEEP, EVAL_EVERY = 30, 5, 2, 10
FLAGS = ["--preset", "tiny", "--nproc", "4", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--keep", str(KEEP), "--warmup", "3", "--eval-every", str(EVAL_EVERY), "--eval-batches", "4",
         "--batch-size", "4", "--seq-len", "32", "--grad-accum", "2", "--dropout", "0.1", "--data-bytes", "300000",
         "--sample-tokens", "0", "--no-progress"]
KILL_TIMEOUT_S = 240


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """The uninterrupted run, started when the first test asks for it: it runs beside that test's own runs (its
    start-up overlaps theirs on two cores). Call the fixture for its folder: that waits for the run, which must
    succeed."""
    out = tmp_path_factory.mktemp("reference")
    job = start_train([*FLAGS, "--out", str(out)])

    def finished() -> Path:
        _ok(job.finish())
        return out

    yield finished
    job.stop()


def _assert_same_run(out: Path, reference: Path, from_step: int, stopped_at: int | None = None) -> None:
    """The step-STEPS checkpoints are equal key by key, bitwise; so are the metrics of steps after from_step.
    stopped_at: the step where an earlier run ended by --stop-after."""
    ours, theirs = read_all(str(out / "checkpoints" / f"step-{STEPS}")), read_all(
        str(reference / "checkpoints" / f"step-{STEPS}"))
    assert ours.keys() == theirs.keys()
    assert any(k.endswith("/exp_avg_sq") for k in ours) and any(".experts." in k for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    train, val = read_metrics(out / "metrics.jsonl")
    ref_train, ref_val = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # no step lost or logged twice
    for mine, ref in zip(train[from_step:], ref_train[from_step:]):
        for k in ("loss", "grad_norm", "lr", "aux_loss", "tokens_per_expert"):
            assert mine[k] == ref[k], (mine["step"], k)
    # a run that ended early (--stop-after) also evaluated at its last step
    extra = [] if stopped_at is None or stopped_at % EVAL_EVERY == 0 else [stopped_at]
    assert [r["step"] for r in val] == sorted([r["step"] for r in ref_val] + extra)
    ref_by_step = {r["step"]: r["val_loss"] for r in ref_val}
    assert all(r["val_loss"] == ref_by_step[r["step"]] for r in val if r["step"] in ref_by_step)


@pytest.mark.timeout(3 * 150 + 60)
def test_exact_resume_after_stop(reference: Callable[[], Path], tmp_path: Path) -> None:
    half = STEPS // 2
    first = _ok(run_train([*FLAGS, "--stop-after", str(half), "--out", str(tmp_path)]))
    assert "resuming" not in first
    assert latest_checkpoint(str(tmp_path / "checkpoints")).endswith(f"step-{half}")
    second = _ok(run_train([*FLAGS, "--out", str(tmp_path)]))
    assert f"resuming at step {half} from" in second and "not an exact resume" not in second
    _assert_same_run(tmp_path, reference(), from_step=half, stopped_at=half)
    published = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert published == [f"step-{STEPS - SAVE_EVERY}", f"step-{STEPS}"]  # --keep 2
    # the export of the job's checkpoint carries the model config: a plain GPT is built from it and loads it
    export(str(tmp_path), str(tmp_path / "export"))  # the run's --out: its latest checkpoint
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    plain = GPT(GPTConfig(**config["extra"]["model"]))
    missing, unexpected = plain.load_state_dict(load_file(str(tmp_path / "export" / "model.safetensors")),
                                                strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the token embedding


@pytest.mark.timeout(150 + 150 + 60)
def test_every_step_checkpoint_resumed_with_diloco_starts_a_new_period(reference: Callable[[], Path],
                                                                        tmp_path: Path) -> None:
    """The reference's last checkpoint (step 30, synchronous HSDP: no DiLoCo state) resumed with --outer-sync diloco
    for 4 more steps at H = 4: the run says it starts a new outer period; the first outer step comes at the next
    multiple of H (step 32); and the outer steps start from the loaded parameters: with the paper's outer optimizer
    (lr 0.7, Nesterov 0.9; plain averaging would hide a wrong snapshot) the validation loss goes on as the
    synchronous run left it, while a snapshot left at the initial weights the DiLoCo was built on (no reset after
    the load) ends 0.26 higher."""
    shutil.copytree(reference(), tmp_path, dirs_exist_ok=True)
    flags = [*FLAGS, "--out", str(tmp_path), "--steps", str(STEPS + 4), "--outer-sync", "diloco", "--outer-every", "4",
             "--outer-lr", "0.7", "--outer-momentum", "0.9"]
    stdout = _ok(run_train(flags))
    assert f"resuming at step {STEPS} from" in stdout
    assert ("not an exact resume: the checkpoint has no DiLoCo state (an every-step run): a new outer period "
            "starts here") in stdout, stdout[-3000:]
    train, _ = read_metrics(tmp_path / "metrics.jsonl")
    resumed = [r for r in train if r["step"] > STEPS]
    assert [(r["step"], r["outer_synced"]) for r in resumed] == [(31, []), (32, [0]), (33, []), (34, [0])]
    val = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "metrics.jsonl")[1]}
    # from the loaded parameters: 3.219 at step 30, 3.202 at step 34; from the initial weights: 3.461 at step 34
    assert val[STEPS + 4] < val[STEPS] + 0.1, val


@pytest.mark.timeout(3 * 150 + 60)
def test_resume_with_other_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Changed flags take effect and are named; a model field that keeps every shape is named too; a run that has
    nothing left to train says so and leaves the outputs alone; --stop-after saves without --save-every, and so does
    the end of a resumed run without either (its line without --stop-after: tests/unit/test_train_outputs.py)."""
    flags = [f for f in FLAGS if f not in ("--save-every", str(SAVE_EVERY))]
    assert "--save-every" not in flags
    flags[flags.index("--nproc") + 1] = "2"  # what is checked here does not depend on the layout: fewer workers
    _ok(run_train([*flags, "--stop-after", "2", "--out", str(tmp_path)]))
    assert latest_checkpoint(str(tmp_path / "checkpoints")).endswith("step-2")  # saved by --stop-after alone
    # a model with other shapes is refused before any worker starts, in one line (in this process)
    error = train_usage_error([*flags, "--stop-after", "4", "--d-model", "96", "--out", str(tmp_path)], capsys)
    assert "holds a checkpoint of another model" in error, error
    assert "wte.weight (256, 64) -> (256, 96)" in error and "d_model=64" in error
    again = [*flags, "--stop-after", "4", "--weight-decay", "0", "--n-head", "2", "--out", str(tmp_path)]
    second = _ok(run_train(again))
    assert "--weight-decay was 0.1, now 0.0" in second and "model field n_head was 4, now 2" in second, second
    groups = read_meta(str(tmp_path / "checkpoints" / "step-4"))["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]  # this run's flag, not the saved 0.1
    assert json.loads((tmp_path / "config.step-2.json").read_text())["weight_decay"] == 0.1  # kept
    summary = (tmp_path / "summary.json").read_text()
    third = _ok(run_train(again))
    assert "nothing to train" in third and (tmp_path / "summary.json").read_text() == summary
    assert "to go on, run again with a larger --stop-after, or without it" in third
    # without --stop-after and --save-every, a resumed run still saves at its end: a rerun (as the one above) finds
    # its last step in the checkpoint and has nothing to train
    shorter = [*flags, "--weight-decay", "0", "--n-head", "2", "--out", str(tmp_path)]
    shorter[shorter.index("--steps") + 1] = "6"
    _ok(run_train(shorter))
    assert latest_checkpoint(str(tmp_path / "checkpoints")).endswith("step-6")


TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "2", "-m", "shardfusion.train"]


def _workers(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the training workers below the launcher: processes started by torchrun have RANK in their
    environment; the job's own launcher forks them from its forkserver (multiprocessing; on CPU) in rank order and
    sets RANK only after the start, so their rank is their place in pid order. The forkserver, whose command line
    its children share, is the one with children among them."""
    found, parent = {}, {}
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if b"spawn_main" in cmdline or b"forkserver" in cmdline or b"shardfusion.train" in cmdline:
            found[pid] = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
    found = {pid: rank for pid, rank in found.items() if pid not in {parent.get(p) for p in found}}
    if any(rank is None for rank in found.values()):
        return dict(enumerate(sorted(found)))
    return {rank: pid for pid, rank in found.items()}


@pytest.mark.timeout(KILL_TIMEOUT_S + 150 + 60)
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_killed_worker_restarts_from_latest_checkpoint(reference: Callable[[], Path], tmp_path: Path,
                                                      launcher: str) -> None:
    """SIGKILL rank 2 once the first checkpoint is published: the elastic agent (the job's own launcher with
    --max-restarts, or torchrun's with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) restarts every worker, and they resume."""
    ref = reference()  # done before this run starts: no job beside the kill
    log = tmp_path / "log.txt"
    if launcher == "local":
        command = [sys.executable, "-m", "shardfusion.train", *FLAGS, "--max-restarts", "2"]
        env = clean_env()
    else:
        nproc = FLAGS.index("--nproc")
        command = [*TORCHRUN, *FLAGS[:nproc], *FLAGS[nproc + 2:]]
        env = {**clean_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    command += ["--out", str(tmp_path)]
    with log.open("w") as sink, subprocess.Popen(command, cwd=REPO, env=env, stdout=sink,
                                                 stderr=subprocess.STDOUT, start_new_session=True) as process:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        killed = None
        try:
            while process.poll() is None and time.monotonic() < deadline:
                if killed is None and latest_checkpoint(str(tmp_path / "checkpoints")) is not None:
                    workers = _workers(process.pid)
                    assert sorted(workers) == [0, 1, 2, 3], workers
                    killed = workers[2]
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.05)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                pytest.fail(f"the run did not end within {KILL_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert killed is not None, "no checkpoint was published while the run was going: nothing was killed"
    assert process.returncode == 0, text[-4000:]
    assert "resuming at step" in text, text[-4000:]
    resumed_at = int(text.split("resuming at step ")[1].split()[0])
    assert 0 < resumed_at < STEPS
    _assert_same_run(tmp_path, ref, from_step=resumed_at)


@pytest.mark.timeout(150)
def test_torchrun_restarts_need_an_unshared_store(tmp_path: Path) -> None:
    # without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a restart cannot work (launch.restart_problem): refused up front,
    # by every worker before it joins the process group (one worker shows it as well as four, and one restart as
    # well as two: torchrun starts the refused worker again for each)
    nproc = FLAGS.index("--nproc")
    one_worker = [*TORCHRUN[:-1]]
    one_worker[one_worker.index("--nproc-per-node") + 1] = "1"
    one_worker[one_worker.index("--max-restarts") + 1] = "1"
    result = run_train([*FLAGS[:nproc], *FLAGS[nproc + 2:], "--out", str(tmp_path)], launcher=one_worker)
    assert result.returncode != 0
    assert "torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in result.stdout + result.stderr
    assert not (tmp_path / "checkpoints").exists()


FIXTURE_RUN = REPO / "tests" / "fixtures" / "run-before-trainer"
"""A run folder the job wrote before its settings were split into sections (4 steps of the tiny GPT-MoE on 2 ranks,
saved at step 4; its flags in its config.json)."""


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_a_run_saved_before_the_sections_resumes(tmp_path: Path) -> None:
    """Runs saved before the redesign still resume: a copy of FIXTURE_RUN, resumed with its own flags and --steps 6,
    goes on at step 4 from its checkpoint with no note but the changed --steps (a setting saved in the checkpoint
    read under another name, or a derived value resolved otherwise, would add one), trains steps 5 and 6, and its
    config.json records the same fields as the old one, and flags added since at their defaults (the old one is kept
    as config.step-4.json: --steps differs)."""
    out = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, out)
    before = json.loads((out / "config.json").read_text())
    flags = ["--preset", before["preset"], "--nproc", str(before["nproc"]), "--data-bytes", str(before["data_bytes"]),
             "--eval-every", str(before["eval_every"]), "--save-every", str(before["save_every"]),
             "--keep", str(before["keep"]), "--sample-tokens", "0", "--device", before["device"], "--no-progress"]
    stdout = _ok(run_train([*flags, "--steps", "6", "--out", str(out)]))
    assert f"resuming at step 4 from {out / 'checkpoints' / 'step-4'}" in stdout, stdout[-3000:]
    notes = [line for line in stdout.splitlines() if "not an exact resume" in line]
    assert notes == ["shardfusion: warning: not an exact resume: --steps was 4, now 6"], notes
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")[0]]
    assert steps == [1, 2, 3, 4, 5, 6]
    after = json.loads((out / "config.json").read_text())
    added = set(after) - {"resumed"} - set(before)  # flags added since the fixture was saved: at their defaults
    assert set(before) <= set(after) and after["resumed"]["step"] == 4
    assert {k: after[k] for k in added} == {k: v for k, v in JobConfig().flat().items() if k in added}
    assert json.loads((out / "config.step-4.json").read_text()) == before
    assert latest_checkpoint(str(out / "checkpoints")).endswith("step-6")
