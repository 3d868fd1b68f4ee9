"""`python -m shardfusion.export CKPT OUT`: a checkpoint as one safetensors file plus its config.

Reads a checkpoint folder written by :mod:`shardfusion.checkpoint` (any layout) in one process, with no process group,
and writes ``OUT/model.safetensors`` (every parameter and buffer, original names and shapes, the dtypes they were
saved in) and ``OUT/config.json`` (the checkpoint's ``extra``, e.g. the model config the training job stores there, and
the parameter shapes). Loading the export needs only ``safetensors`` and the model class::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("OUT/model.safetensors"), strict=False)   # tied weights appear once

A full state dict like that export loads into a sharded model too: see :func:`shardfusion.checkpoint.load_full_state`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from safetensors.torch import save_file

from shardfusion import checkpoint


def export(ckpt: str, out: str) -> str:
    """Write ``out/model.safetensors`` and ``out/config.json`` from the checkpoint folder ``ckpt`` (or the latest
    checkpoint under a root folder). Returns the safetensors path.

    Raises:
        ValueError: ``ckpt`` is not a readable checkpoint (names the path).
    """
    path = ckpt if os.path.isfile(os.path.join(ckpt, ".metadata")) else (checkpoint.latest_checkpoint(ckpt) or ckpt)
    meta = checkpoint.read_meta(path)
    tensors = {name: t.contiguous() for name, t in checkpoint.load_full(path).items()}
    os.makedirs(out, exist_ok=True)
    target = os.path.join(out, "model.safetensors")
    save_file(tensors, target, metadata={"source": os.path.abspath(path), "format": "shardfusion export v1"})
    config = {"source": os.path.abspath(path), "extra": meta.get("extra"),
              "shapes": {n: list(s) for n, s in meta["shapes"].items()}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, default=str)
    return target


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: ``CKPT OUT``. Returns 0; an unreadable checkpoint is a usage error (exit status 2)."""
    parser = argparse.ArgumentParser(prog="python -m shardfusion.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a checkpoint folder, or a root folder holding step-N checkpoints (the latest)")
    parser.add_argument("out", help="output folder for model.safetensors and config.json")
    args = parser.parse_args(argv)
    try:
        target = export(args.ckpt, args.out)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {target} and {os.path.join(args.out, 'config.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
