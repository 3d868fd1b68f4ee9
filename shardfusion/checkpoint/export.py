"""`python -m shardfusion.export CKPT OUT [--overwrite] [--tokenizer DIR]`: a checkpoint as one safetensors file plus its config.

Reads a checkpoint folder written by :mod:`shardfusion.checkpoint` (any layout) in one process, with no process group,
and writes ``OUT/model.safetensors`` (parameters, persistent buffers; original names and shapes, the dtypes they were
saved in) and ``OUT/config.json`` (``source``: the checkpoint folder; ``extra``: the checkpoint's ``extra`` (for a
checkpoint of shardfusion.train: the model config under 'model', the step, the schedule settings); ``shapes``: the
parameter shapes). Existing files of those names are not replaced unless ``--overwrite`` (``OUT`` may be a run folder
with its own ``config.json``). Loading the export needs only ``safetensors`` and the model class::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("OUT/model.safetensors"), strict=False)   # tied weights appear once

A full state dict like that export loads into a sharded model too: see :func:`shardfusion.checkpoint.load_full_state`.

A checkpoint of a Hugging Face model (its ``extra`` holds ``hf_config``: ``shardfusion.train --hf-model`` or
``--init-from``) exports as a Hugging Face folder instead, which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads: ``OUT/config.json`` is the model's HF config
(``architectures`` included) and ``OUT/model.safetensors`` holds the parameters under their HF names (the names of
the sharded module, which is the HF module itself), a tied weight once, with the metadata ``{"format": "pt"}`` that
HF expects (and ``source``).

The tokenizer goes beside the weights, so ``AutoTokenizer.from_pretrained(OUT)`` loads the one the model was trained
with: the files of the folder given as ``tokenizer``, else those of the tokenizer folder that the checkpoint names in
its ``extra`` (:mod:`shardfusion.checkpoint.export_tokenizer`; ``shardfusion.train`` names its run's copy of every
tokenizer other than bytes). A Hugging Face model trained on bytes gets the byte-level tokenizer whose ids are the
byte values (:func:`shardfusion.checkpoint.export_tokenizer.hf_byte_tokenizer`; needs transformers, which such a
model needs anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Optional

from safetensors.torch import save_file

from shardfusion import checkpoint
from shardfusion.checkpoint import export_tokenizer
from shardfusion.checkpoint.folder import find_checkpoint


def _tokenizer_files(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name)))


def export(ckpt: str, out: str, overwrite: bool = False, tokenizer: Optional[str] = None) -> str:
    """Write ``out/model.safetensors`` and ``out/config.json`` from the checkpoint folder ``ckpt`` (or the latest
    checkpoint under a root folder, or under the one such root inside ``ckpt``, see ``find_checkpoint``). Returns the safetensors path.

    ``config.json`` holds ``source`` (the checkpoint folder), ``extra`` (the checkpoint's ``extra``: for a checkpoint
    of shardfusion.train: the model config under 'model', the step, the schedule settings) and ``shapes`` (the
    parameter shapes); for a checkpoint whose ``extra`` holds ``hf_config`` (a Hugging Face model), it is that HF
    config, and ``model.safetensors`` carries HF's metadata ``{"format": "pt"}``. The tokenizer's files are
    copied beside them (see the module docstring; ``tokenizer``: a tokenizer folder to take instead of the one the
    checkpoint names).
    Without ``overwrite``, nothing is written when any of these files exists already.

    Raises:
        ValueError: ``out/model.safetensors``, ``out/config.json`` or a tokenizer file exists and not ``overwrite``
            (names the file); ``tokenizer`` is not a folder;
            ``ckpt`` is not a readable checkpoint, or a data file of it is truncated, corrupt or missing (one line
            naming the path).
    """
    path = find_checkpoint(ckpt)  # a checkpoint folder, a root of step-N folders, or a training run's --out
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"checkpoint folder {path!r} is not readable: it has no .metadata (not a complete DCP "
                         f"checkpoint), and no published checkpoint (step-<n>) lies under it or under one "
                         f"subfolder: nothing was saved there")
    meta = checkpoint.read_meta(path)  # an unreadable checkpoint first: the more basic error
    target, config_path = os.path.join(out, "model.safetensors"), os.path.join(out, "config.json")
    extra = meta.get("extra")
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise ValueError(f"tokenizer {tokenizer!r} is not a folder")
    saved = export_tokenizer.saved_record(extra)
    source = tokenizer or export_tokenizer.tokenizer_folder(path, saved)
    tokenizer_files = [os.path.join(out, name) for name in _tokenizer_files(source)] if source else []
    if not overwrite:  # before the tensors are read, before anything is written
        for existing in (target, config_path, *tokenizer_files):
            if os.path.lexists(existing):
                raise ValueError(f"{existing!r} exists; export does not replace it unless overwrite=True "
                                 f"(--overwrite)")
    tensors = {name: t.contiguous() for name, t in checkpoint.load_full(path).items()}
    os.makedirs(out, exist_ok=True)
    hf_config = extra.get("hf_config") if isinstance(extra, dict) else None
    if hf_config is not None:  # a Hugging Face model: HF's own folder layout
        save_file(tensors, target, metadata={"format": "pt", "source": os.path.abspath(path)})
        config = dict(hf_config)
    else:
        save_file(tensors, target, metadata={"source": os.path.abspath(path), "format": "shardfusion export v1"})
        config = {"source": os.path.abspath(path), "extra": extra,
                  "shapes": {n: list(s) for n, s in meta["shapes"].items()}}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, default=str)
    if source is not None:
        for name in _tokenizer_files(source):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    elif hf_config is not None and saved["bytes"]:  # transformers: an HF model's export needs it anyway
        export_tokenizer.hf_byte_tokenizer().save_pretrained(out)
    return target


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: ``CKPT OUT [--overwrite]``. Returns 0. An unreadable or damaged checkpoint, or an output
    file that exists without ``--overwrite``, exits with status 2 and a one-line error on stderr (no traceback)."""
    parser = argparse.ArgumentParser(prog="python -m shardfusion.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a checkpoint folder, a root folder holding step-N checkpoints, or a training run's --out "
                        "(the latest checkpoint)")
    parser.add_argument("out", help="output folder for model.safetensors and config.json")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT/model.safetensors, OUT/config.json and the tokenizer files if they exist "
                             "(default: refuse)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder to write beside the weights (default: the one the checkpoint names, "
                             "e.g. a training run's tokenizer/)")
    args = parser.parse_args(argv)
    try:
        target = export(args.ckpt, args.out, overwrite=args.overwrite, tokenizer=args.tokenizer)
    except ValueError as error:
        message = str(error).replace("\n", " ")  # one line, whatever the cause
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    print(f"wrote {target} and {os.path.join(args.out, 'config.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
