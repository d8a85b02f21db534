"""Client-side handle on the pivotrl scheduler extension: install the plugins, then call `pivotrl_*`.

The pipeline driver, the CLI, the benchmarks and the tests all go through this one class, so the handler
names and payload shapes live in two places only (here and scheduler_plugin.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pivotrl.core import Controller, IterationPlan
from pivotrl.runtime.messages import Collected, IterationReport, WorkRequest
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
        controller: Controller,
        role_specs: dict[str, dict[str, Any]],
        worker_options: dict[str, Any] | None = None,
        tick_s: float = 0.25,
        sample_s: float = 0.5,
        node_local_gps: bool = False,
    ) -> RuntimeSession:
        """Register the scheduler extension (hosting core's `controller`) and the role host on every
        worker; with `node_local_gps`, first the GPS holder registry and each worker's node-local store
        with peer fetch (`pivotrl.runtime.gps_plugin`), which the role hosts then use."""
        session = uuid.uuid4().hex[:12]
        opts = dict(worker_options or {})
        if node_local_gps:
            from pivotrl.runtime.gps_plugin import GPSRegistryPlugin, GPSWorkerPlugin

            client.register_plugin(GPSRegistryPlugin())
            client.register_plugin(GPSWorkerPlugin(
                gps=opts.get("gps"), storage_root=opts.get("storage_root", "storage"),
                device=opts.get("device", "cpu"),
            ))
        client.register_plugin(
            PivotSchedulerPlugin(controller, role_specs, tick_s=tick_s, sample_s=sample_s, session=session)
        )
        client.register_plugin(PivotWorkerPlugin(**opts, session=session))
        return cls(client)

    def _call(self, name: str, **kwargs: Any) -> Any:
        handler = getattr(self.client.scheduler, name)
        return self.client.sync(handler, **kwargs)

    def submit(self, requests: list[WorkRequest]) -> int:
        return self._call("pivotrl_submit", items=[r.to_wire() for r in requests]) if requests else 0

    def collect(self, wait_s: float = 0.0) -> Collected:
        """What finished since the last call; with nothing yet, the scheduler holds the call up to
        `wait_s` for the first of it."""
        return Collected.from_wire(self._call("pivotrl_collect", wait_s=wait_s))

    def state(self) -> dict[str, Any]:
        return self._call("pivotrl_state")

    def items(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        return self._call("pivotrl_items", ids=ids)

    def metrics(self) -> dict[str, Any]:
        return self._call("pivotrl_metrics")

    def learned(self) -> dict[str, Any]:
        """Core's learned state (`pivotrl.core.learned.LearnedState.to_json`), for a run checkpoint."""
        return self._call("pivotrl_learned")

    def gps_state(self) -> dict[str, Any]:
        """The GPS holder registry (node-local tiers): nodes, copies, peer pulls, fetch bandwidths."""
        return self._call("pivotrl_gps_state")

    def shift(self, worker: str, role: str | None) -> str:
        return self._call("pivotrl_shift", worker=worker, role=role)

    def abort(self, items: list[str]) -> int:
        return self._call("pivotrl_abort", items=items)

    def begin_iteration(self, plan: IterationPlan) -> None:
        self._call("pivotrl_begin_iteration", plan=dict(plan.__dict__))

    def flush(self, iteration: int) -> None:
        self._call("pivotrl_flush", iteration=iteration)

    def set_version(self, role: str, version: int) -> None:
        self._call("pivotrl_set_version", role=role, version=version)

    def report(self, report: IterationReport) -> None:
        """The driver's view of an iteration, for the scheduler's `/metrics` exporter."""
        self._call("pivotrl_report", report=report.to_wire())

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
