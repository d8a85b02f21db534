"""An in-process runtime without Dask: role hosts in threads syncing straight into an `Orchestrator`.

The same mechanism as a real cluster (core's Controller, the item ledger, the role host's loop, the
shift phases), minus the comms: `send_sync` round-trips the report through its wire form and calls the
orchestrator under a lock. Tests use it to check the mechanism's rules quickly and deterministically.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from pivotrl.core import Controller
from pivotrl.runtime.messages import Collected, SyncReply, SyncReport, WorkRequest
from pivotrl.runtime.orchestrator import Orchestrator
from pivotrl.runtime.role_host import RoleHost, WorkerEnv


class InProcessRuntime:
    def __init__(self, controller: Controller, role_specs: dict[str, dict[str, Any]], n_workers: int,
                 tick_s: float = 0.02, **host_options: Any) -> None:
        self.orch = Orchestrator(controller, role_specs, sample_s=0.05)
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.hosts: list[RoleHost] = []
        self.threads: list[threading.Thread] = []
        self.tick_s = tick_s
        self.stop = threading.Event()
        with self.lock:
            for k in range(n_workers):
                addr = f"w{k}"
                self.orch.join(addr, str(k), self.now())
        for k in range(n_workers):
            host = RoleHost(WorkerEnv("cpu", None, "storage", name=str(k)), self._send, worker=f"w{k}",
                            **host_options)
            self.hosts.append(host)
            self.threads.append(threading.Thread(target=host.run, daemon=True))
        self.threads.append(threading.Thread(target=self._ticker, daemon=True))
        for t in self.threads:
            t.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _send(self, report: SyncReport) -> Future[SyncReply]:
        fut: Future[SyncReply] = Future()
        wire = SyncReport.from_wire(report.to_wire())  # what crosses a real comm
        with self.lock:
            reply, _ = self.orch.sync(wire, self.now())
        fut.set_result(SyncReply.from_wire(reply.to_wire()))
        return fut

    def _ticker(self) -> None:
        while not self.stop.wait(self.tick_s):
            with self.lock:
                self.orch.tick(self.now())

    def call(self, name: str, *args: Any) -> Any:
        with self.lock:
            return getattr(self.orch, name)(*args)

    def submit(self, requests: list[WorkRequest]) -> int:
        with self.lock:
            return self.orch.submit(requests, self.now())

    def collect(self, wait_s: float = 0.0) -> Collected:
        """The scheduler extension's long poll: up to `wait_s` for the first result or sum."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.orch.ledger.has_output():
                    break
            time.sleep(0.001)
        with self.lock:
            return self.orch.collect(self.now())

    def wait_ready(self, roles: dict[str, str | None] | None = None, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                st = self.orch.state(self.now())
            ready = {w["name"]: w["role"] for w in st["workers"].values() if w["status"] == "ready"}
            if (roles is None and len(ready) == len(self.hosts)) or (
                    roles is not None and all(ready.get(k) == v for k, v in roles.items())):
                return
            assert time.monotonic() < deadline, st["workers"]
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for h in self.hosts:
            h.stop.set()
        for t in self.threads:
            t.join(10)
        for h in self.hosts:
            h.close()
