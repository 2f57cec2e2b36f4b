"""glibc's allocator tuned for long CPU training runs (opt-in: ``MEGAHASH_MALLOC_TUNING=1``)."""

from __future__ import annotations

import os

from megahash.accelerator.policy import has_gpu

_MALLOC_TUNED: bool | None = None


def tune_host_allocator() -> bool:
    """Opt-in for long CPU training runs (``MEGAHASH_MALLOC_TUNING=1``): glibc keeps freed memory
    for reuse instead of handing it back to the kernel (called by the trainer and the profiling
    harness before they build anything).

    glibc serves allocations at or above its mmap threshold (dynamic, at most 32 MiB) with fresh
    mappings and trims the top of its heap once enough of it is free, so a training step's large
    activations and gradients are page-faulted in again, zero-filled by the kernel, at every step:
    25,000-57,000 minor faults per step at h512, seq 512, batch 4 (2-core AMD EPYC), varying with
    the allocation history. With chunk mmaps off (``M_MMAP_MAX`` 0) and the heap trimmed only above
    1 GiB free (``M_TRIM_THRESHOLD``) a step takes none after the first two, the resident set
    stays at its peak (2.3 GB against 2.2 GB). In a process of its own, the megahash step measured
    no faster for it (3,388 against 3,293 ms at h512, alternating A/B; benchmarks/results/
    2026-11-23_cpu_vs_transformers_onednn.md). Off by default: without chunk
    mmaps a freed block is reused only by a request that fits it with its alignment padding, so
    the heap grows until it settles (tests/training/test_host_allocator.py), and for short runs that costs
    more than it saves: the test suite, hundreds of runs of a few steps, took 24% more CPU time
    (1,905 s against 1,542 s, kernel time 337 s against 253 s). Applies to the whole process
    from the call on; never on GPU hosts or with a C library other than glibc. Returns whether it
    was applied (idempotent)."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED is not None:
        return _MALLOC_TUNED
    _MALLOC_TUNED = False
    if has_gpu() or os.environ.get("MEGAHASH_MALLOC_TUNING", "0") != "1":
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    _MALLOC_TUNED = bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 1 << 30))
    return _MALLOC_TUNED
