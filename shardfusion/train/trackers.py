"""Experiment trackers of the training job (``--log tensorboard,wandb,trackio``): each record `MetricsLog` appends
to metrics.jsonl (which stays the record of truth) also goes, as scalars at its step, to every tracker enabled.

Where each writes, in the run's outputs folder OUT (OUT/replica-<id> under fault tolerance, as metrics.jsonl):

- ``tensorboard``: event files in OUT/tensorboard (`torch.utils.tensorboard.SummaryWriter`); a resumed run writes
  to the same folder with ``purge_step`` one past its checkpoint's step, so TensorBoard hides what the interrupted
  run logged after the checkpoint and shows the steps the resumed run trains again in its place;
- ``wandb``: an offline W&B run in OUT/wandb (unless WANDB_MODE says otherwise), to upload later with
  ``wandb sync OUT/wandb/offline-run-*``; a resumed run takes the same run id (``resume="allow"``), kept in
  OUT/trackers.json;
- ``trackio``: a local trackio project in OUT/trackio (TRACKIO_DIR: trackio reads it once, when first imported, so
  a process that imported trackio before, or a TRACKIO_DIR set by the user, keeps that folder); a resumed run
  continues the same run name.

W&B and trackio only append: the steps an interrupted run logged after its checkpoint stay, and the resumed run
logs them again (the same values, for an exact resume). A tracker that joins a run at a resume (``--log`` added
then) first receives the records metrics.jsonl kept, so every tracker holds the whole run.

Scalars are named by their metrics.jsonl keys (`scalars`): ``loss``, ``val_loss``, ``grad_norm``, nested figures
joined with ``/`` (``comm/inner_all_gather/wire_bytes``), a list's items by index (``tokens_per_expert/3``), and
``outer_synced`` as the number of fragments synced at that step. The run's config.json is the trackers'
hyperparameters (TensorBoard: its HParams plugin and a ``config`` text), and the loss plot is an image
(``loss_plot``) at the last step. Trackers are the job's only optional outputs; the library imports none of them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from shardfusion.train import run_folder

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
"""Each tracker ``--log`` takes and the package (and the shardfusion extra, of the same name) it needs."""
PLOT_TAG = "loss_plot"
"""The name of the loss plot's image in every tracker."""
COUNTED = ("outer_synced",)
"""Record keys holding a list whose length is the scalar (the DiLoCo fragments synced at that step)."""
PROJECT = "shardfusion"
"""The W&B project (unless WANDB_PROJECT is set) and the trackio project."""


def parse_log(text: str) -> tuple[str, ...]:
    """The trackers of a ``--log`` value: comma-separated names of `PACKAGES`, each once ("" for none).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PACKAGES]
    if unknown:
        raise ValueError(f"--log {text!r}: unknown tracker {', '.join(map(repr, unknown))}; choose any of "
                         f"{', '.join(PACKAGES)}, comma-separated")
    return tuple(dict.fromkeys(names))


def check_installed(names: Iterable[str]) -> None:
    """Raises ValueError (one line naming the extra to install) if a tracker's package is not installed; imports
    nothing."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ValueError(f"--log {name} needs the {PACKAGES[name]} package, which is not installed: pip install "
                             f"'shardfusion[{name}]'")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers as flat scalars, named as the module docstring says (``step`` left out;
    strings and None too). An evaluation record's other keys take a ``val_`` prefix (``val_elapsed_s``), so no
    name is written twice at a step that also has a training record."""
    out: dict[str, float] = {}
    evaluation = "val_loss" in record

    def visit(name: str, value: Any) -> None:
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{name}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{name}/{i}", item)

    for key, value in record.items():
        if key == "step":
            continue
        if evaluation and not key.startswith("val_"):
            key = f"val_{key}"
        if key in COUNTED and isinstance(value, (list, tuple)):
            out[key] = float(len(value))
        else:
            visit(key, value)
    return out


def read_state(out: Path) -> dict[str, Any]:
    """OUT/trackers.json: what each tracker needs to continue its run on a resume ({} if absent)."""
    path = out / run_folder.TRACKERS
    return json.loads(path.read_text()) if path.exists() else {}


def _write_state(out: Path, name: str, entry: dict[str, Any]) -> None:
    path = out / run_folder.TRACKERS
    state = {**read_state(out), name: entry}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def run_names(out: Path, config: dict[str, Any]) -> tuple[str, Optional[str]]:
    """(run name, group): the name of --out's folder; under fault tolerance (``out`` is OUT/replica-<id>) the name
    adds the replica folder and the group is --out's folder, so the replica groups' runs show together."""
    base = Path(config.get("out") or out)
    if base.resolve() == out.resolve():
        return out.resolve().name, None
    return f"{base.resolve().name}-{out.name}", base.resolve().name


class Tracker:
    """One tracker's writer (the subclasses). ``fresh``: it holds nothing of this run yet (a new run, or a resumed
    one it did not follow before), so `MetricsLog` first gives it the records metrics.jsonl kept."""

    fresh = True

    def log(self, values: dict[str, float], step: int) -> None:
        """Write ``values`` (`scalars` of one record) at optimizer step ``step``."""
        raise NotImplementedError

    def image(self, path: Path, step: int) -> None:
        """Write the PNG at ``path`` as the image `PLOT_TAG` at ``step``."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and close: everything written is on disk."""
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in OUT/tensorboard through `torch.utils.tensorboard.SummaryWriter`, flushed after every record
    (a crash loses nothing metrics.jsonl kept)."""

    def __init__(self, out: Path, config: dict[str, Any], resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = out / run_folder.TENSORBOARD
        earlier = folder.exists() and any(folder.iterdir())
        self.fresh = not (earlier and resume_step is not None)
        # a new log hides every earlier event (purge at 0); a resume those after its checkpoint's step
        purge = None if not earlier else (0 if resume_step is None else resume_step + 1)
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        values = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in config.items()}
        for summary in hparams(values, {"loss": math.nan, "val_loss": math.nan}):  # no values: names the tags
            self.writer.file_writer.add_summary(summary)
        text = json.dumps(config, indent=2, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()),
                             global_step=resume_step or 0)
        self.writer.flush()
        _write_state(out, "tensorboard", {"dir": run_folder.TENSORBOARD})

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def image(self, path: Path, step: int) -> None:
        import matplotlib.image

        pixels = matplotlib.image.imread(path)  # (H, W, 4) float32 in [0, 1]
        self.writer.add_image(PLOT_TAG, pixels[..., :3], global_step=step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run in OUT/wandb, offline unless WANDB_MODE is set; its id in OUT/trackers.json, so a resumed run
    continues it (``resume="allow"``)."""

    def __init__(self, out: Path, config: dict[str, Any], resume_step: Optional[int]) -> None:
        import wandb

        state = read_state(out).get("wandb") if resume_step is not None else None
        self.fresh = state is None
        run_id = state["id"] if state else uuid.uuid4().hex[:8]  # W&B ids: lower-case letters and digits
        name, group = run_names(out, config)
        mode = None if os.environ.get("WANDB_MODE") else "offline"
        self.run = wandb.init(dir=str(out), project=os.environ.get("WANDB_PROJECT") or PROJECT, id=run_id,
                              name=name, group=group, resume="allow", mode=mode, config=config,
                              settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True, save_code=False))
        _write_state(out, "wandb", {"id": run_id, "project": self.run.project})

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def image(self, path: Path, step: int) -> None:
        import wandb

        self.run.log({PLOT_TAG: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # stop W&B's service process: the worker then ends with os._exit


class TrackioTracker(Tracker):
    """A local trackio run, project `PROJECT`, in OUT/trackio (see the module docstring for TRACKIO_DIR); its name in
    OUT/trackers.json, so a resumed run continues it."""

    def __init__(self, out: Path, config: dict[str, Any], resume_step: Optional[int]) -> None:
        import sys

        if "trackio" not in sys.modules:  # trackio fixes its folder when first imported
            os.environ.setdefault("TRACKIO_DIR", str((out / run_folder.TRACKIO).resolve()))
        import trackio

        state = read_state(out).get("trackio") if resume_step is not None else None
        self.fresh = state is None
        name, group = run_names(out, config)
        name = state["name"] if state else name
        self.trackio = trackio
        self.folder = str(trackio.utils.TRACKIO_DIR)
        with contextlib.redirect_stdout(io.StringIO()):  # its dashboard hints; the job prints where it went
            self.run = trackio.init(project=PROJECT, name=name, group=group, config=config,
                                    resume="allow" if state else "never", embed=False, auto_log_gpu=False,
                                    auto_log_cpu=False)
        _write_state(out, "trackio", {"project": PROJECT, "name": self.run.name, "dir": self.folder})
        print(f"shardfusion: trackio run {self.run.name!r} in {self.folder}; to view it: TRACKIO_DIR={self.folder} "
              f"trackio show --project {PROJECT}", flush=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def image(self, path: Path, step: int) -> None:
        self.run.log({PLOT_TAG: self.trackio.Image(str(path))}, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()


CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


def open_trackers(names: Iterable[str], out: Path, config: dict[str, Any], resume_step: Optional[int]
                  ) -> list[Tracker]:
    """The trackers ``names`` (`parse_log`'s) writing the run in ``out``, its hyperparameters ``config`` (the run's
    config.json); ``resume_step``: the checkpoint's step a resumed run continues from (None: a new run)."""
    return [CLASSES[name](out, config, resume_step) for name in names]
