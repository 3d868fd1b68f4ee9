"""Fault-tolerant replica groups under failure: one replica group killed with SIGKILL mid-run, restarted later.

    python -m benchmarks.ft                         # on this machine's loopback: 2 replica groups x 2 ranks
    python -m benchmarks.ft --nodes 3 --rate 1gbit  # on an emulated cluster (benchmarks/netcluster.py, root)

Each replica group is one `python -m shardfusion.train --ft-lighthouse ...` job (on its own emulated node with
--nodes; the lighthouse runs on node 0). The scenario (`run_scenario`): all groups start; when the victim (the last
group) is inside step `kill_at` (after its backward, before the gradients are averaged: job_ft.PAUSE_ENV), its
whole process group is killed (SIGKILL: the process dies, as on a lost
node); the survivors discard the step in flight and go on; once they have committed `restart_after` more steps the
victim is started again with the same command: it resumes from the run's shared checkpoint and copies the live
state from a peer at the next quorum. The run ends at --steps.

Measured, from the jobs' own records (metrics.jsonl, summary.json): the survivors' step times around the failure
(median step, the failed step's time to the next commit: the gap, and the gap less a median step, which is the
detection and re-forming time the lighthouse's --heartbeat_timeout_ms bounds), the discarded steps, the recovery
(bytes, seconds, step), whether every group rank's state digest is the same in all groups at the end (bitwise
equal parameters and optimizer state), and the final losses. The benchmark adds the same run without a failure at
two seeds: the failure run's final loss against the seed-to-seed difference (the noise). Results:
benchmarks/results/ft-<where>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from shardfusion.train.ft_config import REPLICA_FOLDER  # noqa: E402
from shardfusion.train.job_ft import PAUSE_ENV, PAUSED_FILE  # noqa: E402

from benchmarks.provenance import RunRecord, describe, write_result  # noqa: E402
RESULTS = REPO / "benchmarks" / "results"
HEARTBEAT_MS = 2000
"""The lighthouse's --heartbeat_timeout_ms here: how long a dead replica group stays in the quorum's view."""
JOIN_MS = 1000
SAVE_EVERY = 20
"""--save-every of the failure run (the restarted group resumes from the last one, then heals)."""

TRAIN = ["--preset", "tiny", "--experts", "0", "--batch-size", "4", "--seq-len", "64", "--data-bytes", "300000",
         "--eval-batches", "4", "--warmup", "5", "--sample-tokens", "0", "--no-progress", "--ft-timeout", "5"]
"""The replica groups' flags (a tiny dense GPT; --steps, --save-every and the ft flags are added)."""


def lighthouse_bin() -> str:
    """The torchft_lighthouse executable beside this Python (installed with torchft)."""
    return str(Path(sys.executable).parent / "torchft_lighthouse")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lighthouse_argv(bind: str, heartbeat_ms: int = HEARTBEAT_MS, join_ms: int = JOIN_MS,
                    min_replicas: int = 1) -> list[str]:
    """A lighthouse at ``bind`` (host:port) that forms a quorum of any one replica group (min_replicas 1: the job's
    --ft-min-replicas decides when a step may commit; more makes a lone group's quorum time out)."""
    return [lighthouse_bin(), "--min_replicas", str(min_replicas), "--bind", bind, "--join_timeout_ms", str(join_ms),
            "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", str(heartbeat_ms)]


class Replicas:
    """The lighthouse and the replica group jobs of one run, on loopback or on an `EmulatedCluster` (group g on
    node g, the lighthouse on node 0). Every process is killed on leaving the ``with`` block."""

    def __init__(self, out: Path, train: Sequence[str], *, replicas: int = 2, nproc: int = 2, cluster: Any = None,
                 heartbeat_ms: int = HEARTBEAT_MS, lighthouse_min: int = 1, join_ms: int = JOIN_MS) -> None:
        self.out, self.train, self.replicas, self.nproc, self.cluster = Path(out), list(train), replicas, nproc, cluster
        shutil.rmtree(self.out, ignore_errors=True)  # a fresh run: no checkpoint of an earlier one to resume
        self.host = [cluster.addr(g) if cluster else "127.0.0.1" for g in range(replicas)]
        port = free_port() if cluster is None else 29650
        self.lighthouse = f"http://{self.host[0]}:{port}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._start("lighthouse", 0, lighthouse_argv(f"{self.host[0]}:{port}", heartbeat_ms, join_ms,
                                                     min_replicas=lighthouse_min))
        time.sleep(0.5)

    def _start(self, name: str, node: int, argv: list[str], env: Optional[dict] = None) -> subprocess.Popen:
        log = self.out / f"{name}.log"
        if self.cluster is not None:
            proc = self.cluster.popen(node, argv, env, cwd=REPO, log=log)
        else:
            with open(log, "w") as handle:
                proc = subprocess.Popen(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                        start_new_session=True,
                                        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                             **(env or {})})
        self.procs[name] = proc
        return proc

    def argv(self, group: int, extra: Sequence[str] = ()) -> list[str]:
        return [sys.executable, "-m", "shardfusion.train", *self.train, "--nproc", str(self.nproc),
                "--ft-lighthouse", self.lighthouse, "--ft-replicas", str(self.replicas), "--ft-replica-id",
                str(group), "--ft-host", self.host[group], "--out", str(self.out), *extra]

    def start(self, group: int, tag: str = "", extra: Sequence[str] = (), env: Optional[dict] = None
              ) -> subprocess.Popen:
        """Start replica group ``group``'s job (log: OUT/replica<group><tag>.log), with ``env`` added."""
        return self._start(f"replica{group}{tag}", group, self.argv(group, extra), env)

    def log(self, name: str) -> str:
        path = self.out / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def committed(self, group: int) -> int:
        """The last step in OUT/replica-<group>/metrics.jsonl (0 before the first)."""
        path = self.out / f"replica-{group}" / "metrics.jsonl"
        if not path.exists():
            return 0
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]
        return max(steps, default=0)

    def kill(self, name: str) -> None:
        """SIGKILL every process of the job (its session): its launcher and all its workers at once."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def hang(self, name: str, hung: bool = True) -> None:
        """SIGSTOP every process of the job (its session): it hangs without dying (its sockets stay open, its
        heartbeats stop); ``hung`` False: SIGCONT, it goes on."""
        os.killpg(self.procs[name].pid, signal.SIGSTOP if hung else signal.SIGCONT)

    def wait(self, names: Sequence[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def until(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s")
            time.sleep(0.05)

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def read_run(out: Path, group: int) -> dict[str, Any]:
    """Replica group ``group``'s train records, val records and summary."""
    train, val = [], []
    for line in (out / f"replica-{group}" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        (val if "val_loss" in record else train).append(record)
    summary = json.loads((out / f"replica-{group}" / "summary.json").read_text())
    return {"train": train, "val": val, "summary": summary}


def step_times(train: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, seconds since the previous record) of consecutive train records (elapsed_s differences)."""
    return [(b["step"], b["elapsed_s"] - a["elapsed_s"]) for a, b in zip(train, train[1:])
            if b["step"] == a["step"] + 1]


def run_scenario(out: Path, *, steps: int, kill_at: int, restart_after: int, replicas: int = 2, nproc: int = 2,
                 cluster: Any = None, seed: int = 42, heartbeat_ms: int = HEARTBEAT_MS, timeout: float = 300,
                 train: Sequence[str] = TRAIN, save_every: int = SAVE_EVERY, hang_at: Optional[int] = None,
                 hang_steps: int = 10, hold_at: Optional[int] = None) -> dict[str, Any]:
    """One run with a failure (module docstring); returns the measured record. ``restart_after`` None: never
    restarted. ``hang_at`` (below ``kill_at``): first another failure, a hang: the victim is stopped (SIGSTOP,
    `Replicas.hang`) inside step ``hang_at``, after its backward, while the survivors wait in the average; it is
    continued (SIGCONT) once they have committed ``hang_steps`` more steps without it, then killed inside the first
    step from ``kill_at`` on that it trains. ``hold_at`` (above ``kill_at``, with a restart): the survivors pause
    inside step ``hold_at`` until the restarted victim has resumed from its checkpoint, so that they cannot end the
    run before it joins, however slow its start-up (a test's guard on a loaded machine). Raises RuntimeError with
    the logs' ends when a job fails."""
    victim = replicas - 1
    flags = [*train, "--steps", str(steps), "--save-every", str(save_every), "--eval-every", str(steps),
             "--seed", str(seed)]
    t0 = time.monotonic()
    with Replicas(out, flags, replicas=replicas, nproc=nproc, cluster=cluster, heartbeat_ms=heartbeat_ms) as run:
        for g in range(replicas - 1):
            run.start(g, env={PAUSE_ENV: str(hold_at)} if hold_at is not None else None)
        # the victim stops inside step kill_at, after its backward (job_ft.PAUSE_ENV): the kill lands mid-step
        pauses = [kill_at] if hang_at is None else [hang_at, kill_at]
        run.start(victim, env={PAUSE_ENV: ",".join(map(str, pauses))})
        marker = out / REPLICA_FOLDER.format(victim) / PAUSED_FILE
        hang = None
        if hang_at is not None:  # it hangs there, and goes on later
            run.until(marker.exists, timeout, f"replica group {victim} inside step {hang_at}")
            run.hang(f"replica{victim}")
            hang = {"step": int(marker.read_text()), "stopped_at_step": run.committed(0)}
            run.until(lambda: run.committed(0) >= hang["stopped_at_step"] + hang_steps, timeout,
                      f"the survivors {hang_steps} steps on without the hung group")
            hang["continued_at_step"] = run.committed(0)
            marker.unlink()  # its ranks go on with the step once continued (job_ft.PAUSE_ENV)
            run.hang(f"replica{victim}", False)
        run.until(marker.exists, timeout, f"replica group {victim} inside step {kill_at}")
        killed_in_step = int(marker.read_text())
        run.kill(f"replica{victim}")
        killed_at, t_kill = run.committed(0), time.monotonic() - t0
        restarted_at = None
        if restart_after is not None:
            run.until(lambda: run.committed(0) >= killed_at + restart_after, timeout,
                      f"the survivors at step {killed_at + restart_after}")
            restarted_at = run.committed(0)
            run.start(victim, "b")
            if hold_at is not None:  # the survivors wait inside step hold_at until the victim has resumed
                held = [out / REPLICA_FOLDER.format(g) / PAUSED_FILE for g in range(replicas - 1)]
                run.until(lambda: all(m.exists() for m in held) and "resuming at step" in run.log(f"replica{victim}b"),
                          timeout, f"the survivors inside step {hold_at} and replica group {victim} resumed")
                for m in held:
                    m.unlink()
        names = [f"replica{g}" for g in range(replicas - 1)] + ([f"replica{victim}b"] if restart_after is not None
                                                               else [])
        codes = run.wait(names, timeout)
        if any(c != 0 for c in codes.values()):
            tails = "\n".join(f"---- {n} (exit {c}):\n{run.log(n)[-3000:]}" for n, c in codes.items())
            raise RuntimeError(f"a replica group failed: {codes}\n{tails}")
        logs = {n: run.log(n) for n in names}
    if restart_after is not None and not (out / REPLICA_FOLDER.format(victim) / "summary.json").exists():
        raise RuntimeError(f"the restarted replica group {victim} started after the survivors had finished all "
                           f"{steps} steps (a slow start-up on a loaded machine): run more --steps\n"
                           f"{logs[f'replica{victim}b'][-1500:]}")
    runs = {g: read_run(out, g) for g in range(replicas)}
    survivor = runs[0]
    times = step_times(survivor["train"])
    median = statistics.median(t for _, t in times)
    ft = {g: r["summary"]["fault_tolerance"] for g, r in runs.items()}
    discarded = ft[0]["discarded"]

    def gap_after(failed: dict[str, Any]) -> Optional[float]:  # from the last commit before it to its retry's
        return max((t for s, t in times if s == failed["step"] + 1), default=None)

    killed = next((d for d in discarded if d["step"] == killed_in_step), None)  # the step in flight at the kill
    gap = gap_after(killed) if killed else None
    if hang is not None:
        hang["discarded"] = next((d for d in discarded if d["step"] == hang["step"]), None)
        hang["survivor_gap_s"] = gap_after(hang["discarded"]) if hang["discarded"] else None
    return {
        "steps": steps, "replicas": replicas, "nproc": nproc, "seed": seed, "heartbeat_ms": heartbeat_ms,
        "where": "emulated cluster" if cluster is not None else "loopback",
        "killed_at_step": killed_at, "killed_in_step": killed_in_step, "killed_at_s": round(t_kill, 2),
        "restarted_at_step": restarted_at,
        "survivor_median_step_s": median, "survivor_gap_s": gap,
        "detection_s": None if gap is None else gap - median,
        "survivor_steps_around_failure": [(s, round(t, 4)) for s, t in times
                                          if killed and abs(s - killed["step"] - 1) <= 3],
        "discarded": discarded, "recoveries": ft[victim]["recoveries"], "hang": hang,
        "digests_equal": all(ft[g]["state_digests"] == ft[0]["state_digests"] for g in ft),
        "final_loss": {str(g): r["train"][-1]["loss"] for g, r in runs.items()},
        "final_val_loss": {str(g): r["val"][-1]["val_loss"] for g, r in runs.items()},
        "ft": {str(g): record for g, record in ft.items()}, "logs_tail": {n: text[-1500:] for n, text in logs.items()},
    }


def run_clean(out: Path, *, steps: int, replicas: int = 2, nproc: int = 2, cluster: Any = None, seed: int = 42,
              timeout: float = 300, train: Sequence[str] = TRAIN) -> dict[str, Any]:
    """The same run without a failure: the final losses of replica group 0."""
    flags = [*train, "--steps", str(steps), "--eval-every", str(steps), "--seed", str(seed)]
    with Replicas(out, flags, replicas=replicas, nproc=nproc, cluster=cluster) as run:
        for g in range(replicas):
            run.start(g)
        codes = run.wait([f"replica{g}" for g in range(replicas)], timeout)
        if any(c != 0 for c in codes.values()):
            raise RuntimeError(f"a replica group failed: {codes}\n{run.log('replica0')[-3000:]}")
    r = read_run(out, 0)
    return {"seed": seed, "final_loss": r["train"][-1]["loss"], "final_val_loss": r["val"][-1]["val_loss"],
            "median_step_s": statistics.median(t for _, t in step_times(r["train"]))}


def run_hsdp(out: Path, *, steps: int, replicas: int = 2, nproc: int = 2, train: Sequence[str] = TRAIN,
             timeout: float = 600, seed: int = 42) -> dict[str, Any]:
    """The peer without fault tolerance: HSDP replicas x nproc in one job of the same flags (loopback), whose
    failure would restart every rank from the last checkpoint. Returns its median step time and start-up time."""
    at = list(train).index("--ft-timeout") if "--ft-timeout" in train else len(train)
    flags = list(train[:at]) + list(train[at + 2:])
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "shardfusion.train", *flags, "--steps", str(steps), "--eval-every",
                             str(steps), "--seed", str(seed), "--nproc", str(replicas * nproc), "--fsdp-outer-degree",
                             str(replicas),
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"the HSDP run failed:\n{result.stderr[-3000:]}")
    wall = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    train_records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"seed": seed, "median_step_s": statistics.median(t for _, t in step_times(train_records)),
            "startup_s": wall - summary["train_s"]}


def paired_cost(clean: list[dict[str, Any]], hsdp: list[dict[str, Any]]) -> dict[str, Any]:
    """The cost of fault tolerance when nothing fails: each seed's run with fault tolerance against the HSDP run of
    the same seed started right after it (a pair shares the machine's load); the median over pairs, and each."""
    ratios = [c["median_step_s"] / h["median_step_s"] for c, h in zip(clean, hsdp)]
    return {"ratios": ratios, "median": statistics.median(ratios),
            "ft_step_s": [c["median_step_s"] for c in clean], "hsdp_step_s": [h["median_step_s"] for h in hsdp]}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the report and the docs quote, from a result of :func:`main`: the survivors' median step, gap
    and detection time (and its ratio to the heartbeat timeout), the failure run's final validation loss against
    the run of the same seed without a failure and the two seeds' difference (the noise), the cost of fault
    tolerance when nothing fails (paired; see :func:`paired_cost`) in ratio and ms per step, and what the elastic
    path would have lost (steps since the last checkpoint and a start-up)."""
    f, c = result["failure"], result["clean"]
    hsdp = result["hsdp"] if isinstance(result["hsdp"], list) else [result["hsdp"]]
    cost = result.get("cost") or paired_cost(c[:len(hsdp)], hsdp)
    since = f["killed_at_step"] % result["save_every"]
    lost = since * hsdp[0]["median_step_s"] + hsdp[0]["startup_s"]
    return {"median_step_ms": f["survivor_median_step_s"] * 1000, "gap_s": f["survivor_gap_s"],
            "detection_s": f["detection_s"], "detection_vs_heartbeat": f["detection_s"] * 1000 / f["heartbeat_ms"],
            "discarded_steps": [d["step"] for d in f["discarded"]],
            "final_val_loss": f["final_val_loss"]["0"],
            "loss_vs_same_seed": abs(f["final_val_loss"]["0"] - c[0]["final_val_loss"]),
            "noise": abs(c[0]["final_val_loss"] - c[1]["final_val_loss"]),
            "cost": cost["median"], "cost_ratios": cost["ratios"],
            "cost_ms": statistics.median((a - b) * 1000 for a, b in zip(cost["ft_step_s"], cost["hsdp_step_s"])),
            "ft_step_ms": cost["ft_step_s"][0] * 1000, "hsdp_step_ms": hsdp[0]["median_step_s"] * 1000,
            "elastic_steps_since_checkpoint": since, "elastic_startup_s": hsdp[0]["startup_s"],
            "elastic_lost_s": lost}


def report(result: dict[str, Any]) -> str:
    f, c, s = result["failure"], result["clean"], summarize(result)
    lines = [f"# Fault-tolerant replica groups: one killed and restarted ({f['where']})", "",
             f"`{result['command']}`", "", *([describe(result["env"]), ""] if "env" in result else []),
             f"{f['replicas']} replica groups x {f['nproc']} ranks, {f['steps']} steps of a tiny GPT; the lighthouse's "
             f"heartbeat timeout {f['heartbeat_ms']} ms. Group {f['replicas'] - 1} killed (SIGKILL) at step "
             f"{f['killed_at_step']}, restarted at step {f['restarted_at_step']}.", "",
             "| measure | value |", "|---|---|",
             f"| survivors' median step | {s['median_step_ms']:.0f} ms |",
             f"| survivors' failed step to the next commit (gap) | {s['gap_s']:.2f} s |",
             f"| gap - median step (detection and new quorum) | {s['detection_s']:.2f} s "
             f"(heartbeat timeout {f['heartbeat_ms'] / 1000:.1f} s: ratio {s['detection_vs_heartbeat']:.2f}) |",
             f"| discarded steps | {s['discarded_steps']} |"]
    for r in f["recoveries"]:
        lines.append(f"| recovery | step {r['step']}: {r['bytes'] / 2**20:.2f} MiB in {r['seconds']:.2f} s |")
    lines += [f"| state digests equal in every group at the end | {f['digests_equal']} |",
              f"| final val loss, failure run | {s['final_val_loss']:.4f} |",
              f"| final val loss, no failure, seeds {c[0]['seed']} / {c[1]['seed']} | {c[0]['final_val_loss']:.4f} / "
              f"{c[1]['final_val_loss']:.4f} (noise {s['noise']:.4f}) |", ""]
    paired = (f"; paired: the median of {', '.join(f'{r:.2f}' for r in s['cost_ratios'])}, each seed's run "
              f"against the HSDP run of the same seed right after it" if len(s["cost_ratios"]) > 1 else "")
    lines += [f"Against HSDP {f['replicas']} x {f['nproc']} in one job (no fault tolerance): median step "
              f"{s['hsdp_step_ms']:.0f} ms; with fault tolerance and no failure {s['ft_step_ms']:.0f} ms "
              f"({s['cost']:.2f} x, {s['cost_ms']:.0f} ms per step: the quorum and the vote each step{paired}). "
              f"A failure there restarts every rank from the last checkpoint: here "
              f"{s['elastic_steps_since_checkpoint']} steps since it (--save-every {result['save_every']}; "
              f"{result['save_every'] / 2:.0f} on average) and a start-up of {s['elastic_startup_s']:.1f} s: "
              f"{s['elastic_lost_s']:.1f} s lost on every node, against the survivors' {s['gap_s']:.2f} s here.", ""]
    lines.append(f"The failure run's final val loss is {s['loss_vs_same_seed']:.4f} from the run of the same seed "
                 f"without a failure; the two seeds differ by {s['noise']:.4f}.")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--kill-at", type=int, default=210)
    parser.add_argument("--restart-after", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=0, help="emulated nodes (0: loopback); one replica group each")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--out", default="/tmp/shardfusion-ft-bench")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.ft " + " ".join(argv if argv is not None else sys.argv[1:])
    cluster = None
    if args.nodes:
        from benchmarks.netcluster import EmulatedCluster
        cluster = EmulatedCluster(nodes=args.nodes, rate=args.rate).__enter__()
        args.replicas = args.nodes
    record = RunRecord().__enter__()
    try:
        base = Path(args.out)
        failure = run_scenario(base / "failure", steps=args.steps, kill_at=args.kill_at,
                               restart_after=args.restart_after, replicas=args.replicas, nproc=args.nproc,
                               cluster=cluster, timeout=1200)
        clean, hsdp = [], []
        for seed in (42, 43):  # pairs: each clean run, then HSDP of the same seed right after it (paired_cost)
            clean.append(run_clean(base / f"clean-{seed}", steps=args.steps, replicas=args.replicas,
                                   nproc=args.nproc, cluster=cluster, seed=seed, timeout=1200))
            hsdp.append(run_hsdp(base / f"hsdp-{seed}", steps=args.steps, replicas=args.replicas, nproc=args.nproc,
                                 seed=seed, timeout=1200))
    finally:
        record.__exit__(None, None, None)
        if cluster is not None:
            cluster.close()
    result = {"command": command, "env": record.as_dict(), "failure": failure, "clean": clean, "hsdp": hsdp,
              "cost": paired_cost(clean, hsdp), "save_every": SAVE_EVERY}
    result["summary"] = summarize(result)
    where = f"cluster{args.nodes}" if args.nodes else "loopback"
    write_result(RESULTS, f"ft-{where}", result, report(result), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
