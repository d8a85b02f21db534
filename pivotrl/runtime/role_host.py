"""The role host of one device, free of Dask: what a role context is, what it may use, and (below) the loop
that runs it between syncs with the scheduler.

A *role context* is one role's work on one device (generation for rollout and reward, gradient sums for
train): `pivotrl.runtime.roles` holds the real ones, `tests/runtime/fakes.py` small ones. A shift is the
same code path for every pair of roles: abort → offload → fetch (from the Global Parameter Storage) →
load, each phase timed into a `ShiftTimings`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, Protocol

from pivotrl.runtime.messages import GradResult, ItemResult, Partial, StepSample, WorkItem

DEFAULT_CONTEXTS = {
    "rollout": "pivotrl.runtime.roles:GenerationContext",
    "reward": "pivotrl.runtime.roles:GenerationContext",
    "train": "pivotrl.runtime.roles:TrainContext",
}


def resolve(path: str) -> Any:
    """`"package.module:Name"` → the object (role contexts are named by path so users can add roles)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class WorkerEnv:
    """What a role context may use on this device: the device name, the parameter store, its name."""

    def __init__(self, device: str, gps_options: Mapping[str, Any] | None, storage_root: str,
                 name: str = "") -> None:
        self.device = device
        self.gps_options = dict(gps_options or {})
        self.storage_root = storage_root
        self._gps: Any = None
        self.name = name

    @property
    def gps(self) -> Any:
        if self._gps is None:
            from pivotrl.gps import ParameterStore

            opts = dict(self.gps_options)
            root = opts.pop("root", None) or os.path.join(self.storage_root, "gps")
            self._gps = ParameterStore(root, device=self.device, **opts)
        return self._gps


class RoleContext(Protocol):
    """One role's work on one device. Built as `cls(role, spec)`; `spec` is the role's spec (model name,
    weights `version`, engine options); `version` the weights version it serves now."""

    spec: Mapping[str, Any]
    version: int | None

    def fetch(self, env: WorkerEnv, version: int | None) -> Any:
        """The role's state (weights) for `version`, fetched from the parameter store."""

    def load(self, env: WorkerEnv, state: Any) -> None:
        """Build the engine from fetched state."""

    def reload(self, env: WorkerEnv, state: Any) -> None:
        """A resident (parked) engine takes new weights."""

    def set_version(self, env: WorkerEnv, version: int) -> None: ...

    def offload(self) -> None:
        """Free everything the context holds on the device."""

    def parkable(self) -> bool:
        """May it stay resident while the device serves another role (nothing unflushed in it)?"""

    def add(self, item: WorkItem) -> None: ...

    def has_work(self) -> bool: ...

    def free_slots(self) -> int: ...

    def step(self) -> tuple[list[ItemResult], StepSample | None]:
        """One engine step: the items it finished, and the step's sample (None if it did nothing)."""

    def abort(self, ids: list[str] | None) -> list[Partial]:
        """Stop these items (None: all) and hand back what each had generated."""

    def progress(self) -> dict[str, tuple[list[int], list[float]]]:
        """Tokens and log-probs generated so far by each running item."""

    def flush(self) -> GradResult | None:
        """Train: publish the local gradient sum and hand in its reference (None when there is none).
        `worker` and `seconds` are filled in by the host."""
