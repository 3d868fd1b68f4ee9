"""keep_freed_memory: freed CPU buffers are reused without page faults (glibc), bad thresholds are refused.

The fault counts run in fresh interpreters: the setting is process-wide and lasts, and the pytest process's heap
has a history that would blur the counts.
"""

import os
import subprocess
import sys

import pytest

from shardfusion.cpu_memory import keep_freed_memory

# A sharded step's allocation pattern in miniature: nine 3 MB "full parameter" buffers gathered and nine "gradient"
# buffers zeroed, all freed at the step's end; the faults of 20 steps after 3 warm-up steps.
_STEPS = """
import resource, sys, torch
from shardfusion.cpu_memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
n = 750_000
def step():
    params = [torch.empty(n) for _ in range(9)]
    for p in params:
        p.fill_(1.0)
    grads = [torch.zeros(n) for _ in range(9)]
    del params, grads
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


# glibc's defaults: no MALLOC_* tunable inherited from the caller
_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))} | {"OMP_NUM_THREADS": "1"}


def _faults_per_step(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120,
                         env=_ENV, check=True).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_freed_buffers_are_reused_without_page_faults():
    took, kept = _faults_per_step("keep")
    _, default = _faults_per_step("default")
    pages = 18 * 750_000 * 4 / 4096  # 4 KiB pages written per step
    assert took == "True"
    assert kept < 0.01 * pages, (kept, default, pages)
    assert default > 10 * max(kept, 1.0), (kept, default)  # glibc's defaults give the blocks back every step


@pytest.mark.parametrize("kwargs,name", [({"mmap_threshold_bytes": 0}, "mmap_threshold_bytes"),
                                         ({"trim_threshold_bytes": 1 << 31}, "trim_threshold_bytes"),
                                         ({"mmap_threshold_bytes": 1.5}, "mmap_threshold_bytes"),
                                         ({"trim_threshold_bytes": True}, "trim_threshold_bytes")])
def test_bad_thresholds_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        keep_freed_memory(**kwargs)
