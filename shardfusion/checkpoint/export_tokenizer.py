"""The tokenizer that :mod:`shardfusion.checkpoint.export` writes beside the weights, and how a checkpoint names it.

A checkpoint names its tokenizer in its ``extra`` (``save_checkpoint(..., extra=...)``) under ``"tokenizer"``, a
record that the program which saved it fills (:func:`record`; ``shardfusion.train`` does, for every checkpoint)::

    {"folder": "../../tokenizer",   # a tokenizer folder, relative to the checkpoint folder, or None
     "bytes": False}                # whether the model was trained on bytes (token id = byte value)

The export copies the files of ``folder`` when it exists; else, for a Hugging Face model (``extra`` holds
``hf_config``) trained on bytes, it writes :func:`hf_byte_tokenizer`, so that ``AutoTokenizer.from_pretrained``
gives the ids the model was trained on. The library itself knows no training run's folder or settings: the record is
all it reads, except for checkpoints saved before the record existed (:func:`saved_record`).

:func:`hf_byte_tokenizer` needs the ``tokenizers`` and ``transformers`` packages, imported when it is called.
"""

from __future__ import annotations

import os
from typing import Any, Optional

EXTRA_KEY = "tokenizer"
"""The key of the record in a checkpoint's ``extra``."""

INSTALL_HINT = "pip install 'shardfusion[hf]'"


def record(folder: Optional[str], byte_level: bool) -> dict[str, Any]:
    """The record a checkpoint's ``extra`` holds under :data:`EXTRA_KEY`. ``folder``: the tokenizer folder relative
    to the checkpoint folder (a relative path, so that a moved run keeps it), or None; ``byte_level``: the model's
    token ids are byte values."""
    return {"folder": folder, "bytes": bool(byte_level)}


def saved_record(extra: object) -> dict[str, Any]:
    """The record of a checkpoint whose ``extra`` is ``extra``: its own, or for a checkpoint saved before records
    existed (by ``shardfusion.train``, the only program that wrote tokenizer settings then) the one that the job's
    layout and settings of that time imply: ``../../tokenizer`` (the run folder's copy, beside its ``checkpoints/``)
    and bytes when its saved settings name no tokenizer but bytes and none trained. Neither, for anything else."""
    if isinstance(extra, dict) and isinstance(extra.get(EXTRA_KEY), dict):
        return record(extra[EXTRA_KEY].get("folder"), bool(extra[EXTRA_KEY].get("bytes")))
    settings = extra.get("config") if isinstance(extra, dict) else None
    if not isinstance(settings, dict):  # not a checkpoint of the training job: no tokenizer known
        return record(None, False)
    # frozen: the layout and settings keys of checkpoints written before records (tests/fixtures/run-before-trainer)
    byte_level = settings.get("tokenizer") in (None, "bytes") and not settings.get("train_tokenizer")
    return record(os.path.join("..", "..", "tokenizer"), byte_level)


def tokenizer_folder(checkpoint: str, saved: dict[str, Any]) -> Optional[str]:
    """The tokenizer folder that the record ``saved`` names for the checkpoint folder ``checkpoint``, when it
    exists; else None."""
    if not saved.get("folder"):
        return None
    folder = os.path.normpath(os.path.join(os.path.abspath(checkpoint), saved["folder"]))
    return folder if os.path.isdir(folder) else None


def byte_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's, which `tokenizers.pre_tokenizers.ByteLevel` uses): byte value -> the
    printable character that stands for it. Printable Latin-1 bytes stand for themselves; the other 68 are mapped,
    in byte order, to the code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def hf_byte_tokenizer() -> Any:
    """A ``transformers`` fast tokenizer whose ids are the byte values (a byte-level BPE with the 256 bytes and no
    merges): what an export of a byte-level run writes, so ``AutoTokenizer.from_pretrained`` gives the ids the model
    was trained on.

    Raises:
        ValueError: ``tokenizers`` or ``transformers`` is not installed (names the package and the extra).
    """
    try:  # optional packages, imported when an export writes the byte tokenizer (the hf extra)
        import tokenizers
        import transformers
    except ImportError as error:
        raise ValueError(f"writing the byte tokenizer needs the {error.name} package ({INSTALL_HINT}): {error}") from None
    alphabet = byte_alphabet()
    model = tokenizers.models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[])
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=int(1e30))
