"""Keep freed heap memory in the process: glibc malloc settings for device workers and the driver.

Why: an engine step frees and re-allocates the same large activation, logit and gradient buffers every few
milliseconds. With glibc's defaults (allocations above 128 KiB mmap'd, the heap top trimmed), and with the
64 KiB trim threshold Dask's nanny sets for its workers so that idle workers hand memory back, every step
page-faults those buffers in again. Measured on the paradigms workload (debug models, 2 CPU workers):
~85,000 minor page faults per second per worker and ~40 % of each worker's CPU time in the kernel; with the
settings below ~2,000/s (and, in one back-to-back pair of colocated runs on a shared box, ~1,870 -> ~2,440
tokens/s per device). Engines manage their own memory (KV caches are
preallocated), so holding on to freed memory is what a device process wants.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

KEEP = {M_TRIM_THRESHOLD: 1 << 30, M_MMAP_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}
_done = False


def keep_freed_memory() -> bool:
    """Apply the settings to this process (idempotent). False where libc is not glibc (macOS, musl)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in KEEP.items())
    if not ok:
        logger.info("mallopt refused the pivotrl settings; keeping the allocator's defaults")
    _done = ok
    return ok


# madvise(2) advice values (Linux)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux >= 6.1: collapse the range into huge pages now, synchronously
HUGE_PAGE = 1 << 21
MIN_HUGE_BYTES = 4 << 20  # below this the TLB covers the buffers anyway; skip the copy


@functools.cache
def _madvise():
    """libc's madvise, looked up once (`find_library` runs a subprocess); None where there is none."""
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def huge_pages(ranges: list[tuple[int, int]]) -> int:
    """Back the memory of `ranges` ((address, nbytes) pairs) with 2 MiB transparent huge pages; returns how
    many huge pages the kernel collapsed (0 where it cannot: not Linux, THP off, kernel before 6.1).

    Why: a decode step reads every packed weight once, tens of MB scattered over 4 KiB pages, more than
    the TLB maps; with huge pages the page walks go away (measured: packed bf16 matmuls 2-5 % faster).
    The packed weights are collapsed once per weight version; the KV cache, allocated per engine and at
    every growth, is not: there the kernel compacted fragmented memory first (docs/decisions.md, "The KV
    cache stays on ordinary pages"). The 2 MiB chunks the ranges touch are collapsed whole, so
    neighbouring heap memory in those chunks moves to huge pages too (the contents are unchanged).
    Buffers totalling under 4 MiB are left alone.
    """
    if sum(n for _, n in ranges) < MIN_HUGE_BYTES:
        return 0
    chunks = sorted(
        {c for a, n in ranges if n > 0 for c in range(a // HUGE_PAGE, (a + n - 1) // HUGE_PAGE + 1)}
    )
    madvise = _madvise()
    if madvise is None:
        return 0
    collapsed = 0
    for chunk in chunks:  # one call each: a chunk that is not wholly mapped fails alone
        madvise(chunk * HUGE_PAGE, HUGE_PAGE, MADV_HUGEPAGE)  # later faults in it get a huge page too
        collapsed += madvise(chunk * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) == 0
    return collapsed
