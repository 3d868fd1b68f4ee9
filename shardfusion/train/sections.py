"""What every section of the job's settings shares: reading a field's docstring (its --help text) and its metadata.

A section is a frozen, keyword-only dataclass that one module of `shardfusion.train` owns (`ModelConfig` in
`model_config`, `FTConfig` in `ft_config`, ...). `shardfusion.train.config.JobConfig` composes them; nothing here
imports a section. Field metadata the job reads (each key optional):

- ``"flag": False``  -- set at run time, not on the command line (no --flag is generated);
- ``"parse"``, ``"metavar"`` -- the argparse type and metavar of a field with a parser of its own;
- ``"resume": True`` -- decides the schedule, the data order, the loss or the arithmetic: saved in each checkpoint
  and compared on resume (`shardfusion.train.resume.RESUME_FIELDS`);
- ``"saved": True`` -- saved in each checkpoint beside the resume fields but not compared there (the tokenizer:
  `shardfusion.train.resume.SAVED_TOKENIZER_FIELDS`);
- ``"ft_shared": True`` -- every fault-tolerant replica group must share it (`shardfusion.train.ft_config`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any, Iterable, Mapping


def field_docs(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` (its bases' too) mapped to the string literal written under it in the
    class body, whitespace collapsed to single spaces; fields without one are absent."""
    docs: dict[str, str] = {}
    for owner in reversed(cls.__mro__):
        if dataclasses.is_dataclass(owner):
            docs.update(_own_field_docs(owner))
    return docs


@functools.lru_cache(maxsize=None)
def _own_field_docs(cls: type) -> dict[str, str]:
    """`field_docs` of the fields declared in ``cls``'s own body (read once per class: parsing the source is most of
    what building the parser costs; the caller must not change the dict)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


FT_SHARED_UNLESS_DEFAULT = "unless default"
"""The ``ft_shared`` metadata of a field that enters the fault-tolerance settings digest only away from its default
(--mp: allowed with --ft-lighthouse later than the digest was first kept, so a run's digest at the default stays what
it was: tests/fixtures/ft-settings-before-trainer.json)."""


def fields_marked(classes: Iterable[type], key: str) -> tuple[str, ...]:
    """The names of the fields of ``classes`` (dataclasses, in order, each name once) whose metadata sets ``key``
    true: e.g. ``fields_marked(sections, "resume")``."""
    names: dict[str, None] = {}
    for cls in classes:
        for field in dataclasses.fields(cls):
            if field.metadata.get(key):
                names.setdefault(field.name)
    return tuple(names)


def meta(**keys: Any) -> dict[str, Any]:
    """Field metadata, e.g. ``dataclasses.field(default=0.1, metadata=meta(resume=True, ft_shared=True))``."""
    return dict(keys)


def marked_values(classes: Iterable[type], key: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: values[name]}`` for the fields of ``classes`` whose metadata sets ``key`` (`fields_marked`),
    less those marked `FT_SHARED_UNLESS_DEFAULT` whose value is their default."""
    out: dict[str, Any] = {}
    for cls in classes:
        for field in dataclasses.fields(cls):
            mark = field.metadata.get(key)
            if not mark or field.name in out:
                continue
            value = values[field.name]
            if mark == FT_SHARED_UNLESS_DEFAULT and value == field.default:
                continue
            out[field.name] = value
    return out
