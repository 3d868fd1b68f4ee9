"""keep_freed_memory: freed CPU buffers are reused without page faults (glibc), bad thresholds are refused.

The fault counts run in fresh interpreters: the setting is process-wide and lasts, and the pytest process's heap
has a history that would blur the counts.
"""

import os
import subprocess
import sys

import pytest

from shardfusion.cpu_memory import keep_freed_memory

# A sharded step's allocation pattern: "full parameter" buffers gathered and "gradient" buffers zeroed, all freed at
# the step's end; the page faults per step of 5 steps after 2 warm-up steps. Buffers of 40 MB: above glibc's largest
# adaptive mmap threshold (32 MiB), so with glibc's defaults each is mapped on its own and unmapped when freed,
# whatever the heap's history (smaller blocks may or may not be given back, depending on how the heap lies).
_STEPS = """
import resource, sys, torch
from shardfusion.cpu_memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
n = 10_000_000
def step():
    params = [torch.empty(n) for _ in range(2)]
    for p in params:
        p.fill_(1.0)
    grads = [torch.zeros(n) for _ in range(2)]
    del params, grads
for _ in range(2):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
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
    pages = 4 * 10_000_000 * 4 / 4096  # 4 KiB pages written per step
    assert took == "True"
    # kept: none in most runs; up to a fifth of one buffer in some (where the heap's blocks fall shifts), never more
    assert kept < 0.1 * pages, (kept, default, pages)
    # glibc's defaults unmap every block when freed: at least a fault per 2 MiB (huge) page written, each step
    assert default >= pages / 512 and default > 10 * max(kept, 1.0), (kept, default)


@pytest.mark.parametrize("kwargs,name", [({"mmap_threshold_bytes": 0}, "mmap_threshold_bytes"),
                                         ({"trim_threshold_bytes": 1 << 31}, "trim_threshold_bytes"),
                                         ({"mmap_threshold_bytes": 1.5}, "mmap_threshold_bytes"),
                                         ({"trim_threshold_bytes": True}, "trim_threshold_bytes")])
def test_bad_thresholds_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        keep_freed_memory(**kwargs)
