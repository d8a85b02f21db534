"""The device tier: an in-process LRU of fetched versions, bounded in bytes, on one torch device.

On a GPU worker the cached tensors live in GPU memory, so a rollout engine swapping back to a version it
saw before pays a device-to-device copy instead of a read from disk. That memory is part of the worker's
one GPU budget (`pivotrl.engines.gpu_budget`: vLLM's share is computed with the tier's capacity kept out),
and a version the tier would refuse is never copied to its device (`admits`). Entries being persisted by
write-behind are held (never evicted) until the persistent tier has them, because they are the only copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

Key = tuple[str, int]


@dataclass
class _Entry:
    tensors: dict[str, torch.Tensor]
    names: list[str] | None  # every name of the version in manifest order, once known
    held: bool = False
    nbytes: int = field(default=0)


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class DeviceTier:
    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu") -> None:
        self.capacity = int(capacity_bytes)
        self.device = torch.device(device)
        self._lru: OrderedDict[Key, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._lru.values())

    def cached(self) -> list[Key]:
        with self._lock:
            return list(self._lru)

    def admits(self, nbytes: int, key: Key | None = None) -> bool:
        """Would `nbytes` more under `key` stay cached? Asked *before* copying a version to the tier's device:
        on a GPU a version copied there and then refused is a second copy of it in GPU memory, outside
        every engine's budget, until the allocator frees it."""
        with self._lock:
            held = sum(e.nbytes for k, e in self._lru.items() if e.held and k != key)
            mine = self._lru[key].nbytes if key in self._lru else 0
        return nbytes > 0 and mine + nbytes + held <= self.capacity

    def get(self, key: Key, names: list[str] | None) -> dict[str, torch.Tensor] | None:
        """The cached tensors (shared, not copied) when all requested names are cached, else None."""
        with self._lock:
            e = self._lru.get(key)
            wanted = names if names is not None else (e.names if e is not None else None)
            if e is None or wanted is None or any(n not in e.tensors for n in wanted):
                self.misses += 1
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            return {n: e.tensors[n] for n in wanted}

    def put(
        self, key: Key, tensors: dict[str, torch.Tensor], all_names: list[str] | None, *, held: bool = False
    ) -> bool:
        """Add (or merge into) an entry; evicts least-recently used unheld entries to stay within capacity."""
        size = nbytes_of(tensors)
        with self._lock:
            e = self._lru.get(key)
            if e is None:
                if size > self.capacity and not held:
                    return False
                e = self._lru[key] = _Entry({}, None)
            e.tensors.update(tensors)
            if all_names is not None:
                e.names = list(all_names)
            e.held = e.held or held
            e.nbytes = nbytes_of(e.tensors)
            self._lru.move_to_end(key)
            self._evict()
            return key in self._lru

    def release(self, key: Key) -> None:
        with self._lock:
            e = self._lru.get(key)
            if e is not None:
                e.held = False
                self._evict()

    def drop(self, key: Key) -> None:
        with self._lock:
            self._lru.pop(key, None)

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self._lru.values())
        for k in list(self._lru):
            if total <= self.capacity:
                break
            e = self._lru[k]
            if not e.held:
                total -= e.nbytes
                del self._lru[k]
