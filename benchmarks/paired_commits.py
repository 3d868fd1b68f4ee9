"""The same step of several trees, timed in interleaved rounds: a commit's code against today's, or a bisection.

    python -m benchmarks.paired_commits --against d677f4a                    # the working tree against that commit
    python -m benchmarks.paired_commits --against d677f4a --rounds 8 --name step-regress-X   # stored in results/
    python -m benchmarks.paired_commits --against d677f4a --candidate HEAD --also 418581b fec47b1   # bisect
    python -m benchmarks.paired_commits --against /tmp/old --candidate /tmp/new --cpus 0,1   # folders, 2 CPUs
    python -m benchmarks.paired_commits --against benchmarks/results/X.json   # its markdown again, from the JSON

Each tree is a git revision, checked out into a temporary ``git worktree`` (removed afterwards), or a folder holding
a ``shardfusion`` package (used as it is; for a machine without the repository); the candidate is by default this
working tree as it is (uncommitted changes included, and recorded). Every run starts 4 fresh gloo processes of
`benchmarks/step_worker.py` (the same file for every tree; only ``PYTHONPATH`` differs, so each imports its own
tree's ``shardfusion``): W warm-up steps, then N timed steps, a step's time the slowest rank's. A round runs every
tree once, back to back: baseline, candidate, then the ``--also`` trees; the next round in the reverse order, and so
on, so that a drift of the machine's load hits all alike. ``--cpus`` pins the workers to those CPUs (e.g. ``0,1``:
the 2-core machine the CPU benchmarks are quoted from, emulated on a larger idle one).

Figures (results/<name>.json, rewritten after every round, so an interrupted run keeps its rounds, and .md): per
round and tree, the median step and the ratio to the baseline's median in the same round; overall, per tree, the
median of its per-round ratios (each round's runs share the load of their minutes), the ratio of the medians of all
steps pooled, and the range of the round ratios; the same for the CPU seconds of a step summed over the ranks
(``cpu_*``: the work; with 4 ranks on 2 cores the step is bound by it, and a busy machine moves it far less than the
wall time). ``slower`` is flagged when the candidate's median round ratio of CPU time (``--judge cpu``, default) or
of wall time (``--judge wall``) exceeds ``1 + tolerance`` (default 0.03); `benchmarks/regress.py --against-commit`
runs this. Calibration: ``--candidate-spin 0.05`` makes the candidate's steps 5 % longer in CPU time with a busy
loop (docs/benchmarks.md, "Regression guard"); ``--quiet-wait`` starts each run once the other jobs are idle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.provenance import RunRecord, describe, git_commit, load_average, write_result

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "step_worker.py"
DEFAULT_TOLERANCE = 0.03
"""The candidate's median round ratio above 1 + this is flagged ``slower``: between the median CPU ratio of two
identical trees and that of a 5 % slower one, as measured over 12 rounds (docs/benchmarks.md, "Regression guard")."""


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """``rev`` as a folder: itself when it is a folder holding ``shardfusion/``, else a temporary detached ``git
    worktree`` of the revision (removed, and pruned, on exit).

    Raises:
        ValueError: ``rev`` is neither such a folder nor a commit of this repository.
    """
    if (Path(rev) / "shardfusion").is_dir():
        yield Path(rev).resolve()
        return
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except (subprocess.CalledProcessError, OSError):
        raise ValueError(f"{rev!r} is neither a commit of {REPO} nor a folder holding shardfusion/") from None
    folder = Path(tempfile.mkdtemp(prefix=f"sf-paired-{sha[:8]}-"))
    try:
        _git("worktree", "add", "--detach", str(folder), sha)
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(tree: Path, opts: dict, nproc: int = 4, timeout: float = 600.0, spin: float = 0.0,
             extra_env: Optional[dict] = None) -> dict:
    """One run of `step_worker.py` on ``tree``'s ``shardfusion`` in ``nproc`` fresh processes (pinned to
    ``opts["cpus"]`` when given; each step lengthened by the fraction ``spin`` with a busy loop; ``extra_env`` added
    to their environment); rank 0's record.

    Raises:
        RuntimeError: a worker failed or ran past ``timeout`` seconds (its output is in the message).
    """
    port = _free_port()
    cpus = opts.get("cpus")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r0.json"
        flags = ["--out", str(out), "--variant", opts["variant"], "--regime", opts["regime"], "--outer",
                 str(opts["outer"]), "--reshard", opts["reshard"], "--warmup", str(opts["warmup"]),
                 "--steps", str(opts["steps"]), "--spin", str(spin)]
        procs: list[subprocess.Popen] = []
        failed = []
        try:
            for rank in range(nproc):
                env = {**os.environ, **(extra_env or {}), "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
                       "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}
                pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
                procs.append(subprocess.Popen([sys.executable, str(WORKER), *flags], cwd=tree, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              preexec_fn=pin))
            deadline = time.time() + timeout
            for rank, proc in enumerate(procs):
                try:
                    text, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    failed.append(f"rank {rank} ran past {timeout:.0f} s")
                    break
                if proc.returncode != 0:
                    failed.append(f"rank {rank} exit {proc.returncode}:\n{text[-3000:]}")
        finally:  # a failed, timed-out or interrupted run leaves no worker behind
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failed or not out.exists():
            raise RuntimeError(f"step_worker on {tree} failed:\n" + "\n".join(failed))
        return json.loads(out.read_text())


def runnable() -> int:
    """Threads runnable on the machine now, this one left out (``/proc/loadavg``'s fourth field; -1 where there is
    none)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1
    except (OSError, IndexError, ValueError):
        return -1


def wait_quiet(limit: int, patience: float, samples: int = 6, every: float = 0.5) -> float:
    """Wait until ``samples`` readings of :func:`runnable` in a row, ``every`` seconds apart, are at most ``limit``
    (other jobs are idle), at most ``patience`` seconds; returns the seconds waited (``patience`` if it gave up)."""
    t0, quiet = time.time(), 0
    while time.time() - t0 < patience:
        quiet = quiet + 1 if runnable() <= limit else 0
        if quiet >= samples:
            break
        time.sleep(every)
    return round(time.time() - t0, 1)


def run_round(r: int, trees: dict[str, Path], opts: dict, log=print) -> dict:
    """Round ``r`` over ``trees`` (name -> folder; the first is the baseline), in that order for even ``r`` and
    reversed for odd ones (the other way round with ``opts["reverse_first"]``): per tree its step times, CPU times
    and medians, and ``ratio`` / ``cpu_ratio`` to the baseline's medians of the same round."""
    names = list(trees)
    order = names if (r + bool(opts.get("reverse_first"))) % 2 == 0 else names[::-1]
    row: dict = {"round": r, "order": order, "load_before": load_average()[0], "trees": {}}
    for name in order:
        if opts.get("quiet_wait"):
            row.setdefault("waited_s", []).append(wait_quiet(opts.get("quiet_limit", 1), opts["quiet_wait"]))
        row.setdefault("runnable_before", []).append(runnable())
        candidate = name == names[1]
        rec = run_once(trees[name], opts, spin=opts.get("candidate_spin", 0.0) if candidate else 0.0,
                       extra_env=opts.get("candidate_env") if candidate else None)
        row["trees"][name] = {"step_s": rec["step_s"], "median_s": statistics.median(rec["step_s"]),
                              "cpu_s": rec["cpu_s"], "median_cpu_s": statistics.median(rec["cpu_s"]),
                              "loss_last": rec["loss"][-1]}
    base = row["trees"][names[0]]
    for name, t in row["trees"].items():
        t["ratio"] = t["median_s"] / base["median_s"]
        t["cpu_ratio"] = t["median_cpu_s"] / base["median_cpu_s"]
    log(f"round {r} (load {row['load_before']}): " + ", ".join(
        f"{n} {row['trees'][n]['median_s']:.4f} s ({row['trees'][n]['ratio']:.4f}, cpu "
        f"{row['trees'][n]['cpu_ratio']:.4f})" for n in names))
    return row


def summarize(rows: list[dict], tolerance: float = DEFAULT_TOLERANCE, judge: str = "cpu") -> dict:
    """Per tree (see the module doc): ``median_round_ratio``, ``pooled_ratio``, ``round_ratio_min/max``,
    ``rounds_slower``, the same for CPU time (``cpu_*``), the pooled medians; ``flag`` for the candidate, from its
    median round ratio of CPU time (``judge="cpu"``) or of wall time (``"wall"``)."""
    names = list(rows[0]["trees"])
    out: dict = {"rounds": len(rows), "tolerance": tolerance, "trees": {}}
    for name in names:
        s: dict = {}
        for kind, key, ratio in (("", "step_s", "ratio"), ("cpu_", "cpu_s", "cpu_ratio")):
            ratios = [r["trees"][name][ratio] for r in rows]
            pooled = {n: statistics.median([t for r in rows for t in r["trees"][n][key]]) for n in (names[0], name)}
            s.update({f"{kind}median_round_ratio": statistics.median(ratios),
                      f"{kind}pooled_ratio": pooled[name] / pooled[names[0]],
                      f"{kind}median_s": pooled[name], f"{kind}round_ratio_min": min(ratios),
                      f"{kind}round_ratio_max": max(ratios), f"{kind}rounds_slower": sum(x > 1 for x in ratios)})
        out["trees"][name] = s
    key = "cpu_median_round_ratio" if judge == "cpu" else "median_round_ratio"
    cand = out["trees"][names[1]][key] if len(names) > 1 else 1.0
    out["judge"] = judge
    out["flag"] = "slower" if cand > 1 + tolerance else "faster" if cand < 1 - tolerance else ""
    return out


def markdown(result: dict) -> str:
    s, o, env = result["summary"], result["config"], result["env"]
    names = list(o["trees"])
    lines = [f"# Paired step time: {', '.join(f'`{n}`' for n in names[1:])} against `{names[0]}`", "",
             describe(env), "",
             f"Regime {o['regime']} ({o['variant']}, HSDP outer {o['outer']} x inner {4 // o['outer']}, "
             f"{o['reshard']}), 4 gloo ranks" + (f" pinned to CPUs {o['cpus']}" if o.get("cpus") else "") +
             f", {o['warmup']} warm-up + {o['steps']} timed steps per run, fresh processes per run, {s['rounds']} "
             "rounds, the order reversed every round. Trees: " +
             "; ".join(f"`{n}` = {t['source']} ({(t['commit'] or 'no git')[:10]}"
                       f"{', with uncommitted changes' if t.get('dirty') else ''})" for n, t in o["trees"].items()) +
             "." + (f" The candidate's workers ran with {o['candidate_env']}." if o.get("candidate_env") else "")
             + (f" The candidate's steps were lengthened by a busy loop of {o['candidate_spin']:.0%} of their CPU "
                "time (calibration)." if o.get("candidate_spin") else ""), "",
             f"Command: `{env.get('command', '')}`", "",
             "| round | load | " + " | ".join(f"{n}: s (ratio; CPU ratio)" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for r in result["rounds"]:
        cells = [f"{r['trees'][n]['median_s']:.4f} ({r['trees'][n]['ratio']:.3f}; {r['trees'][n]['cpu_ratio']:.3f})"
                 for n in names]
        lines.append(f"| {r['round']} {'>' if r['order'][0] == names[0] else '<'} | {r['load_before']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| tree | median round ratio | range | rounds slower | pooled ratio | CPU: median round ratio | "
              "CPU range |", "|---|---|---|---|---|---|---|"]
    for n in names[1:]:
        t = s["trees"][n]
        lines.append(f"| {n} | **{t['median_round_ratio']:.4f}** | {t['round_ratio_min']:.3f}-"
                     f"{t['round_ratio_max']:.3f} | {t['rounds_slower']} of {s['rounds']} | {t['pooled_ratio']:.4f} | "
                     f"{t['cpu_median_round_ratio']:.4f} | {t['cpu_round_ratio_min']:.3f}-"
                     f"{t['cpu_round_ratio_max']:.3f} |")
    lines += ["", f"Median steps: " + ", ".join(f"{n} {s['trees'][n]['median_s']:.4f} s" for n in names) + ".",
              f"Flag for `{names[1]}` (its median round ratio of {'CPU' if s['judge'] == 'cpu' else 'wall'} time, "
              f"tolerance {s['tolerance']:.0%}): {s['flag'] or 'none'}.", ""]
    return "\n".join(lines)


def run(trees: dict[str, Optional[str]], opts: dict, rounds: int, tolerance: float, name: Optional[str],
        out_dir: Path, argv: list[str], command: str = "python -m benchmarks.paired_commits") -> dict:
    """Check out ``trees`` (name -> revision or folder; None: this working tree; the first is the baseline), run
    the rounds, store ``out_dir/<name>.{json,md}`` after every round when ``name`` is given; returns the result."""
    with RunRecord() as record, ExitStack() as stack:
        folders = {n: REPO if rev is None else stack.enter_context(checkout(rev)) for n, rev in trees.items()}
        config = {**opts, "trees": {}}
        for n, rev in trees.items():
            state = git_commit(folders[n]) if (folders[n] / ".git").exists() else {"commit": None, "dirty": []}
            config["trees"][n] = {"source": rev or "working tree", "commit": state["commit"], "dirty": state["dirty"]}
        rows: list[dict] = []
        for r in range(rounds):
            rows.append(run_round(r, folders, opts))
            if name:
                env = {**record.record, "load_during": None, "command": f"{command} {' '.join(argv)}"}
                result = {"config": config, "env": env, "rounds": rows,
                          "summary": summarize(rows, tolerance, opts["judge"])}
                (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    env = {**record.as_dict(), "command": f"{command} {' '.join(argv)}"}
    result = {"config": config, "env": env, "rounds": rows, "summary": summarize(rows, tolerance, opts["judge"])}
    text = markdown(result)
    if name:
        write_result(out_dir, name, result, text)
    else:
        print(text)
    return result


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The run's flags, shared with `benchmarks/regress.py --against-commit`."""
    p.add_argument("--rounds", type=int, default=8, help="rounds (each runs every tree, order reversed each round)")
    p.add_argument("--regime", default="comm", choices=("comm", "compute", "tiny"))
    p.add_argument("--variant", default="shardfusion", choices=("shardfusion", "ddp"))
    p.add_argument("--outer", type=int, default=2, choices=(1, 2, 4), help="HSDP replicas of the 4 ranks")
    p.add_argument("--reshard", default="after_forward", choices=("after_forward", "after_backward"))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--cpus", default=None, help="pin the workers to these CPUs, e.g. 0,1 (default: not pinned)")
    p.add_argument("--reverse-first", action="store_true",
                   help="run the first round in the reverse order (for runs side by side on other CPUs)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="the candidate's median round ratio above 1 + this is flagged slower")
    p.add_argument("--judge", default="cpu", choices=("cpu", "wall"),
                   help="the ratio flagged: of the step's CPU seconds (moves least with other jobs' load) or wall")
    p.add_argument("--quiet-wait", type=float, default=0.0, metavar="SECONDS",
                   help="before each run wait, at most this long, until other jobs are idle (at most --quiet-limit "
                        "runnable threads in 3 s); 0: start at once")
    p.add_argument("--quiet-limit", type=int, default=1, help="runnable threads counted as idle (--quiet-wait)")
    p.add_argument("--candidate-env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="environment variables of the candidate's workers only (e.g. an allocator setting)")
    p.add_argument("--candidate-spin", type=float, default=0.0,
                   help="calibration: lengthen each of the candidate's steps by this fraction (a busy loop)")


def opts_of(args: argparse.Namespace) -> dict:
    """The worker's settings from the parsed flags.

    Raises:
        ValueError: a count below its minimum or a bad ``--cpus`` (one line naming the flag and the value).
    """
    for flag, low in (("rounds", 1), ("steps", 1), ("warmup", 0), ("candidate_spin", 0), ("quiet_wait", 0)):
        if getattr(args, flag) < low:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    cpus = None
    if args.cpus:
        try:
            cpus = sorted({int(c) for c in args.cpus.split(",")})
        except ValueError:
            raise ValueError(f"--cpus takes CPU numbers separated by commas, got {args.cpus!r}") from None
        if not set(cpus) <= os.sched_getaffinity(0):
            raise ValueError(f"--cpus {args.cpus}: this process may run on CPUs {sorted(os.sched_getaffinity(0))}")
    bad = [item for item in args.candidate_env if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        raise ValueError(f"--candidate-env takes NAME=VALUE items, got {bad[0]!r}")
    return {**{k: getattr(args, k) for k in ("regime", "variant", "outer", "reshard", "warmup", "steps")},
            "candidate_env": dict(item.split("=", 1) for item in args.candidate_env),
            "cpus": cpus, "reverse_first": args.reverse_first, "candidate_spin": args.candidate_spin,
            "quiet_wait": args.quiet_wait, "quiet_limit": args.quiet_limit, "judge": args.judge}


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups: workers killed, worktrees removed
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the baseline: a git revision or a folder holding shardfusion/")
    p.add_argument("--candidate", default=None, help="the tree judged (revision or folder; default: working tree)")
    p.add_argument("--also", nargs="*", default=[], help="more trees in the same rounds (e.g. to bisect)")
    add_run_flags(p)
    p.add_argument("--name", default=None, help="store results/<name>.{json,md} (default: print only)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.against.endswith(".json"):  # --against RESULT.json: write its markdown again from the stored figures
        result = json.loads(Path(args.against).read_text())
        Path(args.against).with_suffix(".md").write_text(markdown(result))
        return 0
    try:
        opts = opts_of(args)
    except ValueError as e:
        p.error(str(e))
    trees: dict[str, Optional[str]] = {"baseline": args.against, "candidate": args.candidate}
    for rev in args.also:
        trees[Path(rev).name if Path(rev).is_dir() else rev] = rev
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    run(trees, opts, args.rounds, args.tolerance, args.name, Path(args.out_dir), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
