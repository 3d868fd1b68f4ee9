"""A process that sees torch and the standard library alone, as after ``pip install torch`` then
``pip install --no-deps shardfusion``: the library must run there (README, "Install"; issue 33).

    import torch_only; torch_only.block()       # first thing in the process, before torch is imported
    import torch, shardfusion                    # numpy, matplotlib, ... now raise ModuleNotFoundError

:func:`block` wraps every finder of ``sys.meta_path`` so that none finds (``ModuleNotFoundError`` on import, as
for a package that is not installed) a top-level module that is not in the standard library, not torch or one of
the packages torch itself requires (its distribution's requirements without extras, and theirs: sympy, mpmath,
jinja2, ...), not shardfusion, and not one of ``allow``. Installed before torch is imported, torch finds no numpy either, exactly as in an
environment without it: its tensors' ``.numpy()`` raises ``RuntimeError: Numpy is not available`` (checked by
:func:`check_blocked`). Modules imported already stay usable; pass ``allow`` for the test's own helpers.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _distribution_closure(root: str) -> set[str]:
    """``root`` and every distribution it requires, transitively, leaving out requirements under an extra
    (``; extra == ...``) and those that are not installed."""
    names, todo = set(), [root]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in names:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        names.add(key)
        for requirement in requires:
            if re.search(r";.*\bextra\s*==", requirement):
                continue
            match = _REQUIREMENT_NAME.match(requirement)
            if match:
                todo.append(match.group(1))
    return names


def allowed_modules(allow: tuple[str, ...] = ()) -> set[str]:
    """The top-level module names a torch-only environment has: the standard library, the modules of torch's
    distribution closure, shardfusion, and ``allow``."""
    closure = _distribution_closure("torch")
    modules = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    modules |= {"shardfusion", "__main__", "__mp_main__", *allow}
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(re.sub(r"[-_.]+", "-", d).lower() in closure for d in dists):
            modules.add(module)
    return modules


class _TorchOnlyFinder:
    """A ``sys.meta_path`` finder that finds nothing outside ``allowed`` top-level modules and defers to ``finder``
    for the rest (every other attribute is ``finder``'s): with every finder wrapped so, a blocked module is not
    found at all, as in an environment without it (``importlib.util.find_spec`` returns None, ``import`` raises
    ``ModuleNotFoundError``)."""

    def __init__(self, finder, allowed: set[str]) -> None:
        self.finder, self.allowed = finder, allowed

    def find_spec(self, name: str, path=None, target=None):
        top = name.partition(".")[0]
        if top not in self.allowed and not top.startswith("_sysconfigdata_"):  # the interpreter's build settings
            return None
        find_spec = getattr(self.finder, "find_spec", None)
        return find_spec(name, path, target) if find_spec is not None else None

    def __getattr__(self, name: str):
        return getattr(self.finder, name)


def block(allow: tuple[str, ...] = ()) -> None:
    """Wrap every finder of ``sys.meta_path`` (once). Call it before ``import torch`` so that torch, too, finds no
    numpy."""
    if not any(isinstance(f, _TorchOnlyFinder) for f in sys.meta_path):
        allowed = allowed_modules(allow)
        sys.meta_path[:] = [_TorchOnlyFinder(f, allowed) for f in sys.meta_path]


def check_blocked() -> None:
    """Raise ``AssertionError`` unless numpy cannot be imported and torch believes it absent."""
    import torch

    try:
        import numpy  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("numpy is importable: torch_only.block() was not called first")
    try:
        torch.zeros(1).numpy()
    except RuntimeError as error:
        if "Numpy is not available" not in str(error):
            raise
    else:
        raise AssertionError("torch found numpy: torch_only.block() must be called before torch is imported")
