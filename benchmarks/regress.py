"""The speed regression guard: today's step against an earlier commit's, and a stored `compare.py` result against a
fresh run of the same configuration.

    python -m benchmarks.regress --against-commit d677f4a          # paired: that commit's step against this tree's
    python -m benchmarks.regress                                   # fresh run of the baseline's config, compare
    python -m benchmarks.regress --fresh benchmarks/results/X.json # compare an existing run instead
    python -m benchmarks.regress --baseline benchmarks/results/cpu-fp32-comm-after_backward.json

``--against-commit REV`` is the sensitive one: `benchmarks/paired_commits.py` checks REV out into a temporary git
worktree and times the same shardfusion step of both trees in interleaved rounds of fresh processes (comm regime,
HSDP 2 x 2, fp32, 4 gloo ranks by default); it flags ``slower`` when the median of the per-round ratios (this tree /
REV) of the step's CPU time exceeds ``1 + --tolerance`` (default 3 %; ``--judge wall`` for the wall time). The
stored-baseline comparison below sets ratios against the peers of two runs made at different times, which move with
the load by more than the slowdowns it should catch (issue 36: +0.8 % where a 4-round paired measurement had seen
+5.4 %; docs/benchmarks.md, "Regression guard").

Run it after every change of the step path (the runtime, the scheduler, the collectives, the flat buffers) and put
its table in docs/benchmarks.md, "Regression guard". It is not a test: times move with the machine's load, so it
asserts nothing and always exits 0 unless ``--strict``; without ``--against-commit`` it flags what a reviewer should
look at:

- ``slower``: a variant's paired ratio against a peer rose by more than ``--time-tolerance`` (default 10 %). The paired
  ratio (each repeat's median against the peer's, in the same interleaved round) is compared, not the absolute time:
  both runs share the peers, so a loaded machine moves it far less;
- ``changed``: a collective's count or bytes, a persistent or transient memory figure, or a loss differ. These are
  deterministic on a given model and seed: a change means the step does something else (it may be intended: say
  why next to the table).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = REPO / "benchmarks" / "results" / "cpu-fp32-fresh.json"
"""The newest accepted run of the default configuration (docs/benchmarks.md, "Regression guard")."""
RATIOS = ("vs_fsdp2_paired", "vs_ddp_paired")
MEMORY = (("persistent_bytes", "total"), ("transient", "full_param_bytes"))
TIMING_DEPENDENT = (("transient", "full_grad_bytes"),)
"""Shown, never flagged: a unit's full gradient buffer is freed once its reduce-scatter is seen complete, which
depends on timing (docs/dry-run.md)."""
CONFIG_KEYS = ("regimes", "repeats", "warmup", "steps", "device", "outer", "param_dtype", "reshard", "seed",
               "prefetch_depth", "world_size", "threads")
LOSS_TOLERANCE = 1e-5


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def compare(baseline: dict, fresh: dict, *, time_tolerance: float = 0.10) -> list[dict]:
    """One row per (regime, variant, figure) present in both results: ``baseline``, ``fresh``, ``change`` (relative;
    None where the baseline is 0) and ``flag`` (``""``, ``"slower"``, ``"faster"`` or ``"changed"``)."""
    rows = []
    for regime, base in baseline.get("summary", {}).items():
        new = fresh.get("summary", {}).get(regime)
        if new is None:
            continue
        for variant, b in base["variants"].items():
            f = new["variants"].get(variant)
            if f is None or b.get("skipped") or f.get("skipped"):
                continue

            def row(figure, old, now, kind):
                if old is None or now is None:
                    return
                change = (now - old) / old if old else None
                flag = ""
                if kind == "time" and change is not None:
                    flag = "slower" if change > time_tolerance else "faster" if change < -time_tolerance else ""
                elif kind == "exact" and old != now:
                    flag = "changed"
                elif kind == "loss" and abs(now - old) > LOSS_TOLERANCE:
                    flag = "changed"
                rows.append({"regime": regime, "variant": variant, "figure": figure, "baseline": old, "fresh": now,
                             "change": change, "flag": flag})

            row("median step s", b.get("median_step_s"), f.get("median_step_s"), "info")
            for r in RATIOS:
                row(r.replace("_paired", " (paired)"), b.get(r), f.get(r), "time")
            for name, c in (b.get("collectives") or {}).items():
                fc = (f.get("collectives") or {}).get(name, {})
                row(f"{name} count", c.get("count"), fc.get("count"), "exact")
                row(f"{name} wire bytes", c.get("wire_bytes"), fc.get("wire_bytes"), "exact")
            for keys in MEMORY:
                row(".".join(keys), _get(b, *keys), _get(f, *keys), "exact")
            for keys in TIMING_DEPENDENT:
                row(".".join(keys), _get(b, *keys), _get(f, *keys), "info")
            old_loss, new_loss = b.get("loss_first_last") or [None, None], f.get("loss_first_last") or [None, None]
            for i, which in enumerate(("first", "last")):
                row(f"loss {which}", old_loss[i], new_loss[i], "loss")
    return rows


def markdown(rows: list[dict], baseline: dict, fresh: dict, baseline_path: str, fresh_path: str,
             show_all: bool = False) -> str:
    def env(d):
        e = d.get("env", {})
        return f"torch {e.get('torch')}, load {e.get('load_before')} -> {e.get('load_after')}, wall {e.get('wall_s', 0):.0f} s"

    flagged = [r for r in rows if r["flag"]]
    differ = config_differences(baseline, fresh)
    lines = [f"# Regression guard: `{Path(fresh_path).name}` against `{Path(baseline_path).name}`", "",
             f"- baseline: {env(baseline)}", f"- fresh: {env(fresh)}",
             "- configurations: " + ("the same" if not differ else
                                     "**differ** (" + "; ".join(differ) + "): losses and times are not comparable"),
             f"- {len(rows)} figures compared, {len(flagged)} flagged "
             f"({', '.join(sorted({r['flag'] for r in flagged})) or 'none'})", "",
             "| regime | variant | figure | baseline | fresh | change | flag |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        show = show_all or r["flag"] or r["figure"].startswith(("median", "vs_"))
        if not show:
            continue
        change = "" if r["change"] is None else f"{r['change']:+.1%}"
        lines.append(f"| {r['regime']} | {r['variant']} | {r['figure']} | {_fmt(r['baseline'])} | {_fmt(r['fresh'])} | "
                     f"{change} | {r['flag']} |")
    if not show_all:
        lines += ["", "Rows shown: the step times and paired ratios, and every flagged figure; the unflagged counts, "
                  "bytes, memory and losses are equal (`--all` lists them)."]
    return "\n".join(lines)


def config_differences(baseline: dict, fresh: dict) -> list[str]:
    """``key: baseline -> fresh`` for the settings of ``CONFIG_KEYS`` that differ."""
    b, f = baseline.get("config", {}), fresh.get("config", {})
    return [f"{k}: {b.get(k)} -> {f.get(k)}" for k in CONFIG_KEYS if b.get(k) != f.get(k)]


def _fmt(v) -> str:
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4g}"
    return f"{v:,.0f}" if isinstance(v, (int, float)) else str(v)


def _fresh_run(baseline: dict, name: str) -> Path:
    """Run compare.py with the baseline's configuration; returns the new JSON's path."""
    cfg = baseline["config"]
    flags = ["--regimes", ",".join(cfg["regimes"]), "--variants", ",".join(cfg["variants"]),
             "--repeats", str(cfg["repeats"]), "--warmup", str(cfg["warmup"]), "--steps", str(cfg["steps"]),
             "--device", cfg["device"], "--outer", str(cfg["outer"]), "--param-dtype", cfg["param_dtype"],
             "--reshard", cfg["reshard"], "--seed", str(cfg["seed"]), "--name", name]
    if cfg.get("prefetch_depth") is not None:
        flags += ["--prefetch", str(cfg["prefetch_depth"])]
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare.py"), *flags], check=True, cwd=REPO)
    return REPO / "benchmarks" / "results" / f"{name}.json"


def _against_commit(args, argv: list[str]) -> int:
    """``--against-commit``: the paired run of `benchmarks/paired_commits.py`, stored as results/<name>."""
    from benchmarks import paired_commits

    try:
        opts = paired_commits.opts_of(args)
    except ValueError as e:
        raise SystemExit(f"regress.py: {e}") from None
    name = args.name or f"regress-vs-{args.against_commit.replace('/', '_')}"
    result = paired_commits.run({"baseline": args.against_commit, "candidate": None}, opts, args.rounds,
                                args.tolerance, name, REPO / "benchmarks" / "results", argv,
                                command="python -m benchmarks.regress")
    return 1 if args.strict and result["summary"]["flag"] == "slower" else 0


def main(argv=None) -> int:
    from benchmarks import paired_commits

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against-commit", default=None, metavar="REV",
                   help="paired mode: this tree's step against REV's (benchmarks/paired_commits.py)")
    paired_commits.add_run_flags(p)
    p.add_argument("--baseline", default=str(DEFAULT_BASELINE), help="a stored compare.py result (.json)")
    p.add_argument("--fresh", default=None, help="a compare.py result to check (default: run one now)")
    p.add_argument("--name", default=None, help="name of the fresh run (default: <baseline>-fresh; paired: "
                                                "regress-vs-<REV>)")
    p.add_argument("--time-tolerance", type=float, default=0.10, help="paired-ratio rise flagged as slower")
    p.add_argument("--out", default=None, help="write the markdown here (default: results/<fresh>-regress.md)")
    p.add_argument("--strict", action="store_true", help="exit 1 when anything is flagged (paired: slower)")
    p.add_argument("--all", action="store_true", help="list every figure compared, not only the flagged ones")
    args = p.parse_args(argv)
    if args.against_commit:
        return _against_commit(args, argv)
    baseline_path = Path(args.baseline)
    baseline = json.loads(baseline_path.read_text())
    fresh_path = Path(args.fresh) if args.fresh else _fresh_run(baseline, args.name or f"{baseline_path.stem}-fresh")
    fresh = json.loads(fresh_path.read_text())
    rows = compare(baseline, fresh, time_tolerance=args.time_tolerance)
    md = markdown(rows, baseline, fresh, str(baseline_path), str(fresh_path), show_all=args.all)
    out = Path(args.out) if args.out else fresh_path.with_name(f"{fresh_path.stem}-regress.md")
    out.write_text(md + "\n")
    print(md)
    print(f"wrote {out}")
    return 1 if args.strict and any(r["flag"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
