"""Keeps freed host memory in the process for the next step (glibc's malloc).

A training step allocates and frees the same activation sizes every micro-batch. With glibc's
defaults a block above its (dynamic) mmap threshold goes back to the kernel when freed, and the
heap's top is trimmed past twice that threshold, so the next step faults the same pages in again
and the kernel zero-fills each one: thousands of page faults and their system time every step
(benchmarks/RESULTS.md). Fixing both thresholds (which also turns off glibc's dynamic
adjustment) keeps blocks up to 32 MiB in the heap and the freed top up to 1 GiB. Peak RSS stays
the step's own peak: the memory is reused, not added to. `K3_KEEP_HOST_MEMORY=0` keeps glibc's
defaults; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses a larger mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit); larger blocks are mapped.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_host_memory() -> str:
    """Sets glibc's mmap and trim thresholds for this process (once is enough; later calls
    set the same values). Returns what it did, for the start-up log."""
    if os.environ.get("K3_KEEP_HOST_MEMORY", "1") == "0":
        return "glibc defaults (K3_KEEP_HOST_MEMORY=0)"
    if platform.libc_ver()[0] != "glibc":
        return "the C library's defaults (not glibc)"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "glibc defaults (mallopt refused the thresholds)"
    return (f"freed blocks up to {MMAP_THRESHOLD >> 20} MiB kept (glibc mmap threshold), "
            f"heap trimmed past {TRIM_THRESHOLD >> 30} GiB")
