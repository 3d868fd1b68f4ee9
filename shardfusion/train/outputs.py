"""The files a run of `shardfusion.train` keeps in its output folder across resumes: config.json, and the outputs of
an earlier run that left no checkpoint. Nothing a user's earlier runs wrote is deleted or silently replaced:
whatever a new run would overwrite is moved aside first, and the move is reported."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from shardfusion.train import run_folder
from shardfusion.train.metrics import MetricsLog
from shardfusion.train.trackers import parse_log

RUN_CONTROL = frozenset({"stop_after", "max_restarts", "progress", "resumed", "out", "log"})
"""config.json fields that only control one run (not how its steps are trained): `write_config` ignores them."""

RUN_FILES = run_folder.RUN_FILES
"""Files of a run in its output folder (besides checkpoints/ and config.step-*.json); tokenizer/ is a folder (the
run's copy of its tokenizer, `shardfusion.train.data_config.save_run_tokenizer`)."""


def open_outputs(out: Path, config: dict[str, Any], resumed: Optional[dict[str, Any]],
                 opened: list[MetricsLog]) -> Optional[str]:
    """On rank 0, before the first step: create `out`, write config.json (`write_config`) and append the run's
    `MetricsLog` to `opened` (resuming the file at `resumed["step"]`; writing also to the trackers of
    ``config["log"]``, `shardfusion.train.trackers`, with ``config`` as their hyperparameters). A run that does not
    resume, in a folder that holds the files of an earlier run (one that stopped before its first checkpoint),
    first moves them to out/earlier-<n>/ (`archive_run`). Returns that folder, or None."""
    out.mkdir(parents=True, exist_ok=True)
    archived = archive_run(out) if resumed is None else None
    write_config(out, config, resumed)
    opened.append(MetricsLog(out, resume_step=resumed["step"] if resumed else None,
                             log=parse_log(config.get("log") or ""), config=config))
    return archived


def archive_run(out: Path) -> Optional[str]:
    """Move the `RUN_FILES` and config.step-*.json files of `out` into the first free out/earlier-<n>/ (n = 1, 2,
    ...); returns its path, or None when there was nothing to move."""
    files = [out / name for name in RUN_FILES if (out / name).exists()] + sorted(out.glob("config.step-*.json"))
    if not files:
        return None
    n = 1
    while (out / f"earlier-{n}").exists():
        n += 1
    folder = out / f"earlier-{n}"
    folder.mkdir()
    for file in files:
        file.replace(folder / file.name)
    return str(folder)


def write_config(out: Path, config: dict[str, Any], resumed: Optional[dict[str, Any]]) -> None:
    """Write out/config.json (to a temporary file, then renamed: a crash leaves the old or the new one); a resumed
    run adds `resumed` ({checkpoint, step, notes}).

    The config.json of the run it resumed is kept as config.step-N.json (config.step-N.2.json, ... if that exists)
    when its settings differ from this run's (`RUN_CONTROL` fields aside) or it cannot be read, so no record of how
    earlier steps were trained is lost."""
    path = out / run_folder.CONFIG
    if resumed is not None and path.exists():
        try:
            before = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            before = None  # unreadable: keep it as it is
        now = json.loads(json.dumps(config))
        if before is None or any(before.get(k) != now.get(k) for k in set(before) | set(now)
                                 if k not in RUN_CONTROL):
            kept, n = out / f"config.step-{resumed['step']}.json", 1
            while kept.exists():  # resumed at this step before, with other settings again: keep both
                n += 1
                kept = out / f"config.step-{resumed['step']}.{n}.json"
            path.replace(kept)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**config, **({"resumed": resumed} if resumed else {})}, indent=2) + "\n")
    os.replace(tmp, path)
