"""The names in a training run's output folder (``--out``), each defined here once.

``OUT/config.json`` (the run's settings), ``OUT/metrics.jsonl`` (one record per step and evaluation; records a
resume drops go to ``OUT/metrics.dropped.jsonl``), ``OUT/summary.json``, ``OUT/loss.png``, ``OUT/tokenizer/`` (the
run's copy of a tokenizer other than bytes), the experiment trackers' ``OUT/tensorboard/``, ``OUT/wandb/``,
``OUT/trackio/`` and ``OUT/trackers.json`` (``--log``), and ``OUT/checkpoints/`` (``step-<n>`` folders and the
``latest`` pointer of `shardfusion.checkpoint.save_checkpoint`). A checkpoint names its run's tokenizer folder to
the export through its ``extra`` (`tokenizer_extra`); the library knows none of these names.
"""

from __future__ import annotations

import os
from typing import Any

from shardfusion.checkpoint import export_tokenizer
from shardfusion.train import tokenizer as tok

CONFIG = "config.json"
METRICS = "metrics.jsonl"
METRICS_DROPPED = "metrics.dropped.jsonl"
SUMMARY = "summary.json"
PLOT = "loss.png"
TOKENIZER = "tokenizer"
"""OUT/tokenizer: the run's copy of its tokenizer (not for bytes), which an export writes beside the weights."""
TRACKERS = "trackers.json"
"""OUT/trackers.json: each experiment tracker's run identity (`shardfusion.train.trackers`), for a resume."""
TENSORBOARD = "tensorboard"
WANDB = "wandb"
TRACKIO = "trackio"
"""OUT/tensorboard, OUT/wandb, OUT/trackio: the folders of the experiment trackers of ``--log``."""
CHECKPOINTS = "checkpoints"
"""OUT/checkpoints: the run's checkpoints (`step-<n>`, `latest`)."""

RUN_FILES = (CONFIG, METRICS, METRICS_DROPPED, SUMMARY, PLOT, TOKENIZER, TRACKERS, TENSORBOARD, WANDB, TRACKIO)
"""Files of a run in its output folder (besides checkpoints/ and config.step-*.json); tokenizer/ and the trackers'
folders are folders."""


def tokenizer_extra(tokenizer: str | None) -> dict[str, Any]:
    """What a checkpoint in OUT/checkpoints/step-<n> adds to its ``extra`` for the export: the tokenizer record
    (`shardfusion.checkpoint.export_tokenizer.record`) of a run whose resolved ``--tokenizer`` is ``tokenizer``
    (bytes, or a path: then the run keeps a copy in OUT/tokenizer, ``../../tokenizer`` from the checkpoint)."""
    byte_level = (tokenizer or tok.BYTES) == tok.BYTES
    folder = None if byte_level else os.path.join("..", "..", TOKENIZER)
    return {export_tokenizer.EXTRA_KEY: export_tokenizer.record(folder, byte_level)}
