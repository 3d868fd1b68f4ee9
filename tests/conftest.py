"""Shared pytest set-up: make the helper modules in tests/ (harness, models, reference) importable by name, in the
test process and in the spawned workers (which inherit sys.path).

The tests live in tests/unit (one process, no process group), tests/distributed (gloo ranks through
`harness.run_distributed`) and tests/integration (whole commands: the training job, export, the benchmark). The
folders have no __init__.py: pytest puts each test file's folder on sys.path and imports the file by its basename,
and a spawned worker, which inherits sys.path, imports a test module's worker function by that same name. So test
file basenames must be unique across the folders.
"""

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
