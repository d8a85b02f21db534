"""Read buffers that outlive one fetch: a store's fetch of a version lands in memory it used before.

Why: a rollout device fetches each new policy version whole (hundreds of MB to GBs), every iteration, and
drops the previous one. Each fetch into a fresh allocation page-faults every page of it in again, and the
kernel zeroes each page first; on a VM that hands freed guest memory back to its host, that first touch of
250 MB took 0.04-0.95 s here (measured in a device worker, against 0.05 s for the whole read into reused
memory). An arena keeps the last few large buffers and hands one out again once nothing references it.

Safety rests on one fact, not on callers' promises: every tensor a fetch returns is a view whose storage
holds a reference to the numpy array that owns the buffer (`torch.from_numpy` keeps it alive, and so does
every tensor or array derived from it). So a buffer whose only references are the arena's own is garbage
to everyone else — exactly the moment glibc would have freed it — and may be written again. A caller that
keeps any view of a fetched version keeps its buffer busy; the arena then allocates another.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

#: Buffers smaller than this are allocated plainly: the heap reuses them anyway, and their page faults
#: are a small fraction of their read.
MIN_POOLED_BYTES = 16 << 20
#: A free buffer serves a request of at least this fraction of its size (no 2 GB buffer for a 10 MB read).
MIN_FILL = 0.5


class ReadArena:
    """Up to `max_buffers` large uint8 buffers, each handed out again once no one else references it."""

    def __init__(self, max_buffers: int = 2, min_bytes: int = MIN_POOLED_BYTES) -> None:
        if max_buffers < 0:
            raise ValueError(f"max_buffers must be >= 0, got {max_buffers}")
        self.max_buffers = max_buffers
        self.min_bytes = min_bytes
        self._bufs: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()
        self.stats = {"reused": 0, "allocated": 0}

    def _is_free(self, i: int) -> bool:
        # References: the list slot and getrefcount's own argument. Anything more is a live view.
        return sys.getrefcount(self._bufs[i]) <= 2

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of exactly `nbytes`, its start 64-byte aligned (numpy's large allocations are
        page-aligned), owned by no one else until the caller drops every view of it."""
        if nbytes < self.min_bytes or self.max_buffers == 0:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            best, best_size = None, 0
            for i in range(len(self._bufs)):  # by index: a loop variable would be one more reference
                size = self._bufs[i].nbytes
                if size >= nbytes >= MIN_FILL * size and (best is None or size < best_size) \
                        and self._is_free(i):
                    best, best_size = i, size
            if best is not None:
                buf = self._bufs.pop(best)
                self._bufs.append(buf)  # most recently used last: the oldest free one goes first
                self.stats["reused"] += 1
                return buf[:nbytes]
            buf = np.empty(nbytes, dtype=np.uint8)
            self.stats["allocated"] += 1
            self._evict_for_one()
            if len(self._bufs) < self.max_buffers:
                self._bufs.append(buf)
            return buf[:nbytes]

    def _evict_for_one(self) -> None:
        """Make room for one more buffer by dropping the oldest free one (a busy one is never dropped by
        the arena: its holder frees it as usual once the arena forgot it)."""
        if len(self._bufs) < self.max_buffers:
            return
        for i in range(len(self._bufs)):
            if self._is_free(i):
                del self._bufs[i]
                return
        self._bufs.pop(0)  # all busy: forget the oldest; it is freed when its holder drops it

    def held_bytes(self) -> int:
        """Bytes the arena keeps alive that no one else references (its cost in memory)."""
        with self._lock:
            return sum(self._bufs[i].nbytes for i in range(len(self._bufs)) if self._is_free(i))

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
