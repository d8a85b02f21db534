"""Client-side handle on the pivotrl scheduler extension: install the plugins, then call `pivotrl_*`.

The pipeline driver, the CLI, the benchmarks and the tests all go through this one class, so the handler
names and payload shapes live in two places only (here and scheduler_plugin.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pivotrl.runtime.control import Control
from pivotrl.runtime.messages import Collected, GradResult, GradStats, ItemResult, WorkRequest
from pivotrl.runtime.scheduler_plugin import PivotSchedulerPlugin
from pivotrl.runtime.worker_plugin import PivotWorkerPlugin


class RuntimeSession:
    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def install(
        cls,
        client: Any,
        *,
        control: Control,
        role_specs: dict[str, dict[str, Any]],
        worker_options: dict[str, Any] | None = None,
        tick_s: float = 0.25,
        sample_s: float = 0.5,
    ) -> RuntimeSession:
        """Register the scheduler extension (hosting `control`) and the role host on every worker."""
        session = uuid.uuid4().hex[:12]
        client.register_plugin(
            PivotSchedulerPlugin(control, role_specs, tick_s=tick_s, sample_s=sample_s, session=session)
        )
        client.register_plugin(PivotWorkerPlugin(**(worker_options or {}), session=session))
        return cls(client)

    def _call(self, name: str, **kwargs: Any) -> Any:
        handler = getattr(self.client.scheduler, name)
        return self.client.sync(handler, **kwargs)

    def submit(self, requests: list[WorkRequest]) -> int:
        return self._call("pivotrl_submit", items=[r.to_wire() for r in requests]) if requests else 0

    def collect(self) -> Collected:
        return collected_from_scheduler(self._call("pivotrl_collect"))

    def state(self) -> dict[str, Any]:
        return self._call("pivotrl_state")

    def items(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        return self._call("pivotrl_items", ids=ids)

    def metrics(self) -> dict[str, Any]:
        return self._call("pivotrl_metrics")

    def shift(self, worker: str, role: str) -> str:
        return self._call("pivotrl_shift", worker=worker, role=role)

    def abort(self, items: list[str]) -> int:
        return self._call("pivotrl_abort", items=items)

    def begin_iteration(self, plan: dict[str, Any]) -> None:
        self._call("pivotrl_begin_iteration", plan=plan)

    def flush(self, iteration: int) -> None:
        self._call("pivotrl_flush", iteration=iteration)

    def set_version(self, role: str, version: int) -> None:
        self._call("pivotrl_set_version", role=role, version=version)

    def wait_ready(
        self, n_workers: int, timeout_s: float = 120.0, roles: dict[str, str] | None = None
    ) -> dict:
        """Block until `n_workers` device workers have loaded a role (optionally: the given roles by name)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            ready = {w["name"]: w["role"] for w in st["workers"].values() if w["status"] == "ready"}
            roles_ok = roles is None or all(ready.get(k) == v for k, v in roles.items())
            if len(ready) >= n_workers and roles_ok:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"devices not ready (want {roles}) after {timeout_s}s: {st['workers']}")
            time.sleep(0.05)


def collected_from_scheduler(out: dict[str, Any]) -> Collected:
    """The scheduler extension's `pivotrl_collect` reply as a `Collected`: finished items are
    `ItemResult`s; its `kind: grad` records (`{"id", "role": "train", "kind": "grad", "worker",
    "ref": {"model", "version"}, "items", "stats"}`) are `GradResult`s. A temporary adapter, isolated
    here, until the extension sends `Collected.to_wire()` itself."""
    results, grads = [], []
    for r in out.get("results") or ():
        if r.get("kind") == "grad":
            ref = r["ref"]
            grads.append(
                GradResult(
                    model=str(ref["model"]),
                    version=int(ref["version"]),
                    items=[str(i) for i in r.get("items") or ()],
                    stats=GradStats.from_wire(r["stats"]),
                    worker=str(r.get("worker") or ""),
                )
            )
        else:
            results.append(ItemResult.from_wire(r))
    return Collected(results, grads, list(out.get("events") or ()), dict(out.get("state") or {}))
