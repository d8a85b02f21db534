"""The worker half of the pivotrl extension: a `WorkerPlugin` that runs a `RoleHost` (role_host.py) in a
thread and carries its syncs over the worker's own scheduler RPC.

Why a thread: generation and training steps are long, blocking torch calls; run on the worker's event loop
they would stall heartbeats and comms. The thread schedules each `pivotrl_sync` onto the worker's event
loop and waits for the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from pivotrl.runtime.messages import SyncReply, SyncReport
from pivotrl.runtime.role_host import RoleHost, WorkerEnv, resolve

logger = logging.getLogger(__name__)


def pin_process_to_core(core: int) -> bool:
    """Pin every thread of this process to one core (threads created later inherit it). False where the
    OS does not allow it (macOS, restricted containers)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        allowed = sorted(os.sched_getaffinity(0))
        target = {allowed[core % len(allowed)]}
        tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, target)
        return True
    except OSError:
        return False


class PivotWorkerPlugin(WorkerPlugin):
    """Register with `client.register_plugin(PivotWorkerPlugin(...))` after the scheduler plugin."""

    name = "pivotrl"

    def __init__(self, *, torch_threads: int = 1, pin_cores: bool = True, device: str = "cpu",
                 gps: dict[str, Any] | None = None, storage_root: str = "storage", idle_poll_s: float = 0.02,
                 progress_every_s: float = 0.5, sync_every_s: float = 0.01, idle_hold_s: float = 0.25,
                 contexts: dict[str, str] | None = None, session: str = "",
                 park_contexts: bool | None = None) -> None:
        self.session = session
        self.torch_threads = torch_threads
        self.pin_cores = pin_cores
        self.device = device
        self.gps_options = gps
        self.storage_root = storage_root
        self.host_options = {"idle_poll_s": idle_poll_s, "progress_every_s": progress_every_s,
                             "sync_every_s": sync_every_s, "idle_hold_s": idle_hold_s, "contexts": contexts}
        # Parking a left role's context is the default: each context says whether it may (`parkable`):
        # on CPU, where device memory is host memory, and vLLM on a GPU, which sleeps into host memory.
        self.park_contexts = park_contexts

    def setup(self, worker: Any) -> None:
        from pivotrl.malloc import keep_freed_memory

        self.worker = worker
        # vLLM's engine core: spawned, never forked from a process that already holds a CUDA context
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        keep_freed_memory()  # before the first engine step: see pivotrl/malloc.py
        self.pinned = False
        if self.pin_cores:
            try:
                core = int(worker.name)
            except (TypeError, ValueError):
                core = abs(hash(str(worker.name)))
            self.pinned = pin_process_to_core(core)
        device = "cuda:0" if self.device == "cuda" else self.device  # dask-cuda: this worker's GPU is first
        env = WorkerEnv(device, self.gps_options, self.storage_root, name=str(worker.name))
        gps = getattr(worker, "plugins", {}).get("pivotrl-gps")
        if gps is not None:  # node-local tiers with peer fetch (pivotrl.runtime.gps_plugin): share its store
            env._gps = gps.store
        park = self.park_contexts if self.park_contexts is not None else True
        self.host = RoleHost(env, self._send_sync, worker=worker.address, session=self.session, park=park,
                             **self.host_options)
        self._thread = threading.Thread(target=self._run, name="pivotrl-role-host", daemon=True)
        self._thread.start()

    async def teardown(self, worker: Any) -> None:
        # the loop thread may be waiting on this event loop (a sync): join it without blocking the loop
        self.host.stop.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30)
        self.host.close()

    def _send_sync(self, report: SyncReport) -> Future[SyncReply]:
        """Start one `pivotrl_sync` round trip on the worker's event loop (called from the host thread)."""
        async def call() -> SyncReply:
            reply = await self.worker.scheduler.pivotrl_sync(report=report.to_wire())
            return SyncReply.from_wire(reply)

        return asyncio.run_coroutine_threadsafe(call(), self.worker.loop.asyncio_loop)

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.torch_threads)
        if self.pin_cores and self.pinned:
            with contextlib.suppress(Exception):
                pin_process_to_core(int(self.worker.name))
        for path in set(self.host.contexts.values()):  # import role code now: shift timings measure shifting
            with contextlib.suppress(Exception):
                resolve(path)
        with contextlib.suppress(Exception):
            import pivotrl.engines.generation
            import pivotrl.engines.trainer
            import pivotrl.gps  # noqa: F401
        self.host.run()
