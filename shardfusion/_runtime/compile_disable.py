"""``compile_disable``: ``torch.compiler.disable`` for the hooks, without importing ``torch._dynamo`` before a hook
runs.

``torch.compiler.disable(fn)`` imports ``torch._dynamo`` when it decorates, so decorating the scheduler's hooks with
it at class level made ``import shardfusion`` import Dynamo (measured with ``python -X importtime``: 0.44 s of
the 1.2 s that ``import shardfusion`` took after torch), in every process, also in those that never run a model
(the training job's launcher). Nothing can trace a hook before a hook runs, so ``compile_disable`` defers the
import to the hook's first call, through ``torch._disable_dynamo``: torch's own lazy form of the decorator (its
optimizers use it for the same reason), which imports ``torch._dynamo`` at the first call and from then on calls
``torch._dynamo.disable(fn)``. Where ``torch._dynamo`` is imported already, ``compile_disable`` is
``torch.compiler.disable`` itself (the training job's workers: their forkserver imports Dynamo first,
``shardfusion.train.launch.PRELOAD``).

Tracing sees no difference: Dynamo does not trace into ``torch._disable_dynamo``'s wrapper (``torch._compile`` is
in its skip list), so it breaks the graph at the hook and calls it eagerly, as at a ``torch.compiler.disable``'d
function, and the hook then runs with Dynamo disabled, recursively (``tests/distributed/test_compile.py``, and
``tests/unit/test_compile_disable.py`` for a model sharded before ``torch._dynamo`` was imported).
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compile_disable(fn: F) -> F:
    """``fn`` excluded from ``torch.compile`` tracing, as ``torch.compiler.disable(fn)`` (recursive): Dynamo breaks
    the graph at it and runs it eagerly. Imports ``torch._dynamo`` at ``fn``'s first call, not here (module doc)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    return torch._disable_dynamo(fn)
