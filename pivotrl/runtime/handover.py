"""A train context's flushed gradient sum, handed to the sharded owner's rank in the same process.

Why its own module: the train context (`pivotrl.runtime.roles`) and the rank (`pivotrl.runtime.train_worker`)
both use it, and neither may import the other (the rank builds its model with the roles' builder).

The rank at the barrier runs on the device that computed the sum, so it takes the sum from memory, and a
sum a rank takes is never written to the store: nothing else reads it (a failed step commits nothing and a
resumed run recomputes its iteration). Writing it anyway, even behind the barrier at the lowest priority,
cost the barrier ~0.25 s of contention on 2 cores (benchmarks/train_step.py). A sum is written only when
someone else needs it, and then before they read it:
- its train context is offloaded (the device leaves the train role): `drop` writes it;
- a newer flush under the same name replaces it: `flush_sum` writes the older one first;
- the driver folds it into rank 0's share (its device is not a member): `persist`, which the driver asks
  of the holder as the step starts; rank 0 waits for the version to appear (`train_worker`).
"""

from __future__ import annotations

import threading
from typing import Any

_HANDED: dict[str, tuple[int, Any, Any]] = {}  # sum name → (version, GradSum, store): kept for our rank
_LAST: dict[str, int] = {}  # sum name → the last version flushed here (a handed one is not in the store)
_LOCK = threading.Lock()


def next_version(store: Any, name: str) -> int:
    """The version the next flush of `name` from this process takes: after the store's newest and after
    the last one flushed here (a sum handed over is not in the store)."""
    try:
        newest = max(store.versions(name), default=-1)
    except LookupError:
        newest = -1
    with _LOCK:
        return max(newest, _LAST.get(name, -1)) + 1


def _write(store: Any, name: str, version: int, gs: Any) -> None:
    store.publish(name, version, gs.grads, write_behind=False)  # from the sum's own tensors: no copy


def flush_sum(store: Any, name: str, gs: Any, *, hand_over: bool) -> int:
    """Put the gradient sum `gs` where the optimizer owner finds it; returns its version under `name`.

    Without `hand_over` (the driver owns the optimizer, in another process): persisted before this
    returns. With it (a sharded owner's rank runs here): kept in memory for that rank."""
    version = next_version(store, name)
    with _LOCK:
        _LAST[name] = version
        older = _HANDED.pop(name, None) if hand_over else None
        if hand_over:
            _HANDED[name] = (version, gs, store)
    if older is not None:  # never taken: its rank (or rank 0, folding it) will read it from the store
        _write(older[2], name, older[0], older[1])
    if not hand_over:
        _write(store, name, version, gs)
    return version


def hand_over(model: str, version: int, gs: Any, store: Any = None) -> None:
    """Keep the gradient sum `gs` of `(model, version)` for the rank that runs here (`store`: where it is
    written if the rank does not take it; None: it is there already)."""
    with _LOCK:
        _HANDED[model] = (int(version), gs, store)
        _LAST[model] = max(_LAST.get(model, -1), int(version))


def take(model: str, version: int) -> Any | None:
    """The handed-over sum of `(model, version)`, removed from this process; None when it is not here
    (another device's sum, or one this process no longer holds): then it is read from the store."""
    with _LOCK:
        got = _HANDED.get(model)
        if got is None or got[0] != int(version):
            return None
        del _HANDED[model]
        return got[1]


def persist(model: str, version: int) -> bool:
    """Write the handed-over sum `(model, version)` to the store and forget it here (someone in another
    process will fold it in); False when this process does not hold it (written already, or taken)."""
    with _LOCK:
        got = _HANDED.get(model)
        if got is None or got[0] != int(version):
            return False
        del _HANDED[model]
    if got[2] is not None:
        _write(got[2], model, got[0], got[1])
    return True


def drop(model: str) -> None:
    """The train context of `model` is offloaded (its device leaves the train role): a sum no rank took
    here is written to the store, where rank 0 folds it in, and not held in memory (on a GPU above all)."""
    with _LOCK:
        got = _HANDED.pop(model, None)
    if got is not None and got[2] is not None:
        _write(got[2], model, got[0], got[1])
