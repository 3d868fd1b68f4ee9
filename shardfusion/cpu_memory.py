"""Keep freed CPU memory in the process for reuse: the CPU counterpart of CUDA's caching allocator.

A sharded step frees and allocates the same large buffers over and over: each unit's full parameters (all-gathered
before use, freed after) and its full gradient buffer (allocated at its first gradient, freed once reduce-scattered).
On CUDA, PyTorch's caching allocator hands a freed block to the next request of its size. On CPU, PyTorch allocates
from the C library's ``malloc``, and glibc's defaults give large blocks back to the kernel: a block above the mmap
threshold is unmapped when freed, and free memory at the top of the heap above the trim threshold is released. The
next allocation of that size then takes one page fault per 4 KiB page as it is first written (the kernel zeroes
each page). Measured on the benchmark's machine (2 cores): 18 allocations of 3 MB per step took 1,400 to 6,700
page faults per step with the defaults (the adaptive thresholds make it depend on the heap's history); four of
40 MB (above any adaptive threshold) 39,064, every page, and none in most runs with the thresholds raised
(``tests/unit/test_cpu_memory.py`` counts them). DDP, which keeps its gradient buckets for the whole run, never
pays this; a sharded step pays it for every gathered and every reduced byte.

:func:`keep_freed_memory` raises both thresholds (``mallopt``), so that freed blocks stay in the process heap and are
reused by later allocations. The cost is the same as CUDA's caching allocator's: the process's resident memory stays
at its peak instead of falling back between steps (live tensor bytes, what the memory reports count, are unchanged).
It is process-wide and lasts until the process ends, so the library never calls it by itself: the training job calls
it in each CPU worker, and the benchmarks call it in every variant's workers alike (so ratios stay fair). Other
allocators (jemalloc, tcmalloc through ``LD_PRELOAD``) cache freed blocks by themselves and need none of this.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 1 << 30
"""Blocks below this many bytes come from the heap (glibc's default starts at 128 KiB and adapts up to 32 MiB)."""
TRIM_THRESHOLD_BYTES = (1 << 31) - 1
"""Free bytes at the top of the heap kept before any is given back (``mallopt`` takes a C int: at most 2 GiB - 1)."""


def keep_freed_memory(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
                      trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Make this process's ``malloc`` keep freed memory for reuse (glibc only; see the module doc).

    Args:
        mmap_threshold_bytes: allocations of at least this many bytes are mapped on their own (and unmapped when
            freed); smaller ones come from the heap.
        trim_threshold_bytes: free bytes at the top of the heap kept before the rest is released.

    Returns:
        True when both settings took effect; False where the C library has no ``mallopt`` (not glibc: macOS, musl)
        or refused a value; nothing changes then.

    Raises:
        ValueError: a threshold that is not a positive int of at most ``2**31 - 1`` bytes (named, with its value).
    """
    for name, value in (("mmap_threshold_bytes", mmap_threshold_bytes), ("trim_threshold_bytes", trim_threshold_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < (1 << 31):
            raise ValueError(f"keep_freed_memory: {name} must be an int in [1, 2**31 - 1] bytes, got {value!r}")
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # The trim threshold first: setting either one turns off glibc's adaptive thresholds.
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)) and bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes))


def _mallopt():
    """glibc's ``int mallopt(int param, int value)``, or None where the C library does not have it."""
    try:
        fn = ctypes.CDLL(None).mallopt  # the symbols this process already has: the C library's among them
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn
