"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), loadable into any layout.

The package, one module per concern:

- :mod:`~shardfusion.checkpoint.save_load`: the distributed :func:`save` / :func:`load` of one checkpoint folder,
  :func:`save_checkpoint` (numbered, atomically published, the last K kept) and :func:`load_full_state`, each
  given one sharded model or the list of this rank's pipeline stages; its docstring has the format (keys, shapes,
  who writes what).
- :mod:`~shardfusion.checkpoint.background`: the asynchronous saves of :func:`save_checkpoint` (``async_save=True``):
  the staging copy, the write on a background thread, the publish after every rank's write, the :class:`AsyncSave`
  handle and the agreement on failures.
- :mod:`~shardfusion.checkpoint.inventory`: what a sharded model holds in the format's terms (fragments, optimizer
  state kinds, gathered over the ranks) and how it matches a checkpoint.
- :mod:`~shardfusion.checkpoint.planners`: the DCP save and load planners that write and read fragments.
- :mod:`~shardfusion.checkpoint.folder`: the folder of numbered checkpoints: prepare, publish, prune,
  :func:`latest_checkpoint`, :func:`checkpoint_bytes`.
- :mod:`~shardfusion.checkpoint.read`: single-process readers, no process group: :func:`read_meta`,
  :func:`read_all`, :func:`load_full`.
- :mod:`~shardfusion.checkpoint.streaming`: :func:`load_safetensors`, pretrained weights from safetensors files
  (Hugging Face's sharded layout too) into a sharded model, each rank reading only its fragments' rows (needs the
  ``safetensors`` package, imported when called).
- :mod:`~shardfusion.checkpoint.export`: ``python -m shardfusion.export``, a checkpoint as safetensors (needs the
  ``safetensors`` package, not imported here); :mod:`~shardfusion.checkpoint.export_tokenizer`: the tokenizer it
  writes beside the weights, as the checkpoint's ``extra`` names it (the program that saved it fills the record).

See ``docs/checkpoints.md``.

``torch.distributed.checkpoint`` (DCP) is imported with the first name that needs it (:func:`save`, :func:`load`,
:func:`read_meta`, :class:`AsyncSave`, ...: the modules ``save_load``, ``background``, ``read`` and ``planners``),
not with the package: DCP and the DTensor it imports cost about 0.6 s of CPU, which ``import shardfusion`` paid in
every process, also in those that never save or load (the training job's launcher). ``folder`` and ``streaming``
need no DCP and are imported with the package.
"""

from importlib import import_module as _import_module

from shardfusion.checkpoint.folder import checkpoint_bytes, latest_checkpoint
from shardfusion.checkpoint.streaming import LoadResult, load_safetensors

_NEEDS_DCP = {"AsyncSave": "background", "load_full": "read", "read_all": "read", "read_meta": "read",
              "FORMAT_VERSION": "save_load", "load": "save_load", "load_full_state": "save_load",
              "save": "save_load", "save_checkpoint": "save_load", "staging_bytes": "save_load"}
"""The names of this package that come from a module importing DCP: name -> module, imported at first use."""


def __getattr__(name: str):
    """The public names of the modules that import DCP, imported at their first use (PEP 562)."""
    module = _NEEDS_DCP.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEEDS_DCP))


__all__ = ["AsyncSave", "FORMAT_VERSION", "LoadResult", "checkpoint_bytes", "latest_checkpoint", "load", "load_full",
           "load_full_state", "load_safetensors", "read_all", "read_meta", "save", "save_checkpoint", "staging_bytes"]
