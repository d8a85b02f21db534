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
