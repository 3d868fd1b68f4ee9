"""Where a stored result comes from: the code's commit and the machine's load while it ran.

Every result file under ``benchmarks/results/`` that the README or docs quote carries an ``env`` record made here
(docs/benchmarks.md, "Quoted figures"):

    with RunRecord() as env:       # starts sampling the load average
        ... run the benchmark ...
    raw["env"] = env.as_dict()     # commit, dirty files, load before / during / after, wall seconds

``commit`` is ``git rev-parse HEAD`` of the repository the benchmark ran from, ``dirty`` the tracked files that
differed from it (a result made from uncommitted code says so). The load is ``os.getloadavg()``: the 1-minute
average is sampled every ``every`` seconds by a daemon thread, and the record keeps its min, median and max, so a
time figure can be read against the load it ran under (on a machine shared with other jobs, absolute times move
with the load; ratios of variants interleaved in one run much less).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPO) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": [tracked paths that differ from it]}`` of ``repo`` (None outside git)."""
    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") or ""
    return {"commit": sha.strip() if sha else None,
            "dirty": sorted(line[3:] for line in status.splitlines() if line.strip())}


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


class RunRecord:
    """A context manager that records the commit, the machine and the load around a benchmark run.

    Args:
        every: seconds between samples of the 1-minute load average during the run (> 0).
    """

    def __init__(self, every: float = 5.0) -> None:
        if every <= 0:
            raise ValueError(f"every must be > 0 seconds, got {every}")
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.record: dict[str, Any] = {}

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(round(os.getloadavg()[0], 2))

    def __enter__(self) -> "RunRecord":
        import torch  # the benchmarks all run on torch; imported here so that this module stays cheap to import

        self.record = {**git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "torch": torch.__version__, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                       "machine": platform.machine(), "load_before": load_average()}
        self._t0 = time.time()
        self.samples = [self.record["load_before"][0]]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        self.record["wall_s"] = time.time() - self._t0
        self.record["load_after"] = load_average()
        self.samples.append(self.record["load_after"][0])
        self.record["load_during"] = {"min": min(self.samples), "median": statistics.median(self.samples),
                                      "max": max(self.samples), "samples": len(self.samples)}

    def as_dict(self) -> dict[str, Any]:
        """The record (valid after the ``with`` block)."""
        return dict(self.record)


def describe(env: dict[str, Any]) -> str:
    """One line for a report's header: commit, date and the load the run had (``env`` from :class:`RunRecord`)."""
    commit = (env.get("commit") or "unknown")[:10] + (" (with uncommitted changes)" if env.get("dirty") else "")
    load = env.get("load_during")
    during = (f"load average (1 min) {load['min']:.1f}-{load['max']:.1f}, median {load['median']:.1f} over "
              f"{env.get('cpu_count')} CPUs" if load else f"load average before {env.get('load_before')}, after "
              f"{env.get('load_after')}")
    return f"Commit {commit}, {env.get('date', 'date unknown')}; {during}; wall {env.get('wall_s', 0):.0f} s."


def write_result(folder: Path, name: str, result: dict[str, Any], text: str, indent: int = 1) -> None:
    """Store a benchmark's result as ``folder/name.json`` (the figures, with their provenance) and ``folder/name.md``
    (the report ``text``, also printed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=indent) + "\n")
    (folder / f"{name}.md").write_text(text)
    print(text)
