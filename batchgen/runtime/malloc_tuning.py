"""Keep freed memory in the process heap on glibc, so per-step activations do not page-fault every step.

A CPU forward allocates and frees activations of several MB per layer. With glibc's defaults, freed memory at
the top of the heap is given back to the kernel once it exceeds the trim threshold (and allocations over the
dynamic mmap threshold are mmapped and unmapped each time), so the next step faults the same pages in again
and the kernel zeroes them (``clear_page_erms``: 8% of the CPU samples of the decode-heavy throughput
benchmark, BENCHMARKS.md "CPU MFU on a decode-heavy workload"). :func:`keep_freed_memory` raises the trim
threshold and the top pad and fixes the mmap threshold (``mallopt``), trading up to :data:`TRIM_BYTES` of
retained free memory for those faults. No-op off glibc, when ``BATCHGEN_MALLOC_TUNING=0``, or when the user
already set ``GLIBC_TUNABLES``/``MALLOC_*_`` (their choice stands).

:func:`huge_pages` asks Linux to back a large buffer (the CPU KV pool) with transparent huge pages
(``madvise(MADV_HUGEPAGE)``) where the system allows them (``transparent_hugepage/enabled`` = ``madvise`` or
``always``): still allocated lazily, as blocks are first written, but one fault per 2 MiB instead of per 4 KiB
and one TLB entry for 128 KV blocks of a layer. Decode attention reads blocks scattered over the pool: the
decode-heavy throughput benchmark ran ~2% faster with it. No-op off Linux and when
``BATCHGEN_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import os
import platform

TRIM_BYTES = 1 << 30  # free memory kept at the top of the heap before it is returned
MMAP_BYTES = 32 << 20  # allocations at least this large are mmapped (glibc's dynamic maximum)
TOP_PAD_BYTES = 64 << 20  # extra heap grown per brk
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (malloc.h)
_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20
_done = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they were applied."""
    global _done
    if _done:
        return False
    _done = True
    if os.environ.get("BATCHGEN_MALLOC_TUNING", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_TRIM_THRESHOLD, TRIM_BYTES), (_M_MMAP_THRESHOLD, MMAP_BYTES), (_M_TOP_PAD, TOP_PAD_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)


def huge_pages(address: int, nbytes: int) -> bool:
    """Advise transparent huge pages for the 2 MiB-aligned part of ``[address, address + nbytes)`` (memory not
    yet touched is then faulted in as huge pages). True when the kernel accepted the advice."""
    if os.environ.get("BATCHGEN_MALLOC_TUNING", "1") == "0" or platform.system() != "Linux":
        return False
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    length = (address + nbytes - start) & ~(_HUGE_PAGE - 1)
    if length <= 0:
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, length, _MADV_HUGEPAGE) == 0
