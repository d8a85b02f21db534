"""A train context's flushed gradient sum, handed to the sharded owner's rank in the same process.

Why its own module: the train context (`pivotrl.runtime.roles`) and the rank (`pivotrl.runtime.train_worker`)
both use it, and neither may import the other (the rank builds its model with the roles' builder).

The rank at the barrier runs on the device that computed the sum, so it takes the sum from memory instead
of reading it back from the store — that read was a rank's largest phase after the reduce. The store copy
is still written by the flush: a device that leaves the train role is folded in from it by rank 0, and a
step after a crash reads it. One entry per sum name: a newer flush replaces the older one, and the rank
removes what it takes, so at most one sum per train context is held beyond its flush.
"""

from __future__ import annotations

import threading
from typing import Any

_HANDED: dict[str, tuple[int, Any]] = {}  # sum name → (version, GradSum): flushed here, kept for our rank
_LOCK = threading.Lock()


def hand_over(model: str, version: int, gs: Any) -> None:
    """Keep the gradient sum `gs` just flushed as `(model, version)` for the rank that runs here."""
    with _LOCK:
        _HANDED[model] = (int(version), gs)


def take(model: str, version: int) -> Any | None:
    """The handed-over sum of `(model, version)`, removed from this process; None when it is not here
    (another device's sum, or one this process no longer holds): then it is read from the store."""
    with _LOCK:
        got = _HANDED.get(model)
        if got is None or got[0] != int(version):
            return None
        del _HANDED[model]
        return got[1]


def drop(model: str) -> None:
    """Forget the sum kept under `model` (its train context is offloaded: the device leaves the train
    role, and a departed device's sum is read from the store by rank 0 — memory, on a GPU above all, is
    not held for a rank that will not run here)."""
    with _LOCK:
        _HANDED.pop(model, None)
