"""The pivotrl scheduler extension: Dask wiring around the `Orchestrator` (orchestrator.py).

Mirrors distributed's P2P-shuffle extension: a `SchedulerPlugin` that adds prefixed handlers
(`scheduler.handlers["pivotrl_*"]`) called by the paired worker plugin and by the pipeline driver. Every
message crosses as plain data and is rebuilt into the typed messages of `messages.py` here; every decision
comes from pivotrl.core's `Controller` inside the orchestrator and is logged with
`scheduler.log_event("pivotrl", ...)`.

Why pull-based: workers call `pivotrl_sync` after engine steps carrying finished work, partial progress,
step samples and free slots; the reply carries the worker's commands (an idle worker's sync is held until
it has one, or a fraction of a second passes). So
the scheduler never needs a connection to the worker, commands reach it within one engine step, and a lost
worker simply stops syncing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from pivotrl.core import Controller, IterationPlan
from pivotrl.runtime.messages import IterationReport, SyncReply, SyncReport, WorkRequest
from pivotrl.runtime.orchestrator import Orchestrator

logger = logging.getLogger(__name__)

PLUGIN_NAME = "pivotrl"
#: At most one extra (event-driven) tick per this many seconds, besides the periodic one.
EVENT_TICK_GAP_S = 0.01
#: The longest a driver's `pivotrl_collect` is held waiting for output (it asks for less).
MAX_COLLECT_WAIT_S = 1.0
#: The longest an idle host's sync is held for a command (`SyncReport.hold_s` asks for at most this).
MAX_SYNC_HOLD_S = 0.5


class PivotSchedulerPlugin(SchedulerPlugin):
    """Construct on the client with the controller and the role specs, register with
    `client.register_plugin(plugin)`; the instance is pickled and started on the scheduler."""

    name = PLUGIN_NAME

    def __init__(self, controller: Controller, role_specs: dict[str, dict[str, Any]], tick_s: float = 0.25,
                 sample_s: float = 0.5, session: str = "") -> None:
        self.session = session  # role hosts of another session (a replaced plugin) are ignored
        self.orch = Orchestrator(controller, role_specs, sample_s=sample_s)
        self.tick_s = tick_s
        self.plan_s = 0.0
        self.plans = 0
        self._task: asyncio.Task | None = None
        self._t0 = time.monotonic()
        self._last_tick = -1e9
        self._event_tick_pending = False
        self._exporter: Any = None
        self.reports: list[IterationReport] = []  # the driver's, one per iteration: the page's learning curve
        self._output: asyncio.Event | None = None  # set when results or sums wait for the driver
        self._held_syncs: dict[str, asyncio.Event] = {}  # worker → its idle sync, held for a command

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("scheduler", None)
        state.pop("_task", None)
        state.pop("_exporter", None)
        state.pop("_output", None)
        state.pop("_held_syncs", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._task = None
        self._exporter = None
        self._output = None
        self._held_syncs = {}

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        old = scheduler.plugins.get(PLUGIN_NAME)
        if old is not None and old is not self:  # re-registration replaces the extension: stop the old one
            await old.close()
        self._t0 = time.monotonic()
        self.orch._log_sink = lambda record: scheduler.log_event(PLUGIN_NAME, record)
        scheduler.handlers.update({
            "pivotrl_sync": self.handle_sync,
            "pivotrl_submit": self.handle_submit,
            "pivotrl_collect": self.handle_collect,
            "pivotrl_begin_iteration": self.handle_begin_iteration,
            "pivotrl_set_version": self.handle_set_version,
            "pivotrl_flush": self.handle_flush,
            "pivotrl_shift": self.handle_shift,
            "pivotrl_abort": self.handle_abort,
            "pivotrl_state": self.handle_state,
            "pivotrl_metrics": self.handle_metrics,
            "pivotrl_items": self.handle_items,
            "pivotrl_report": self.handle_report,
            "pivotrl_learned": self.handle_learned,
        })
        from pivotrl.runtime import prometheus

        self._exporter = prometheus.register(self.orch)  # pivotrl_* on the dashboard's /metrics
        for addr, ws in scheduler.workers.items():
            self.orch.join(addr, str(ws.name), self.now())
        from pivotrl.runtime.gps_plugin import attach_locality

        attach_locality(scheduler)  # node-local GPS tiers (when that plugin runs): φ sees where weights are
        self.tick()
        self._task = asyncio.create_task(self._ticker())

    async def close(self) -> None:
        from pivotrl.runtime import prometheus

        prometheus.unregister(self._exporter, self.orch)
        self._exporter = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._wake_held(everyone=True)  # held syncs see the plugin closed and answer now

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
            except Exception:  # a bug here must not kill the scheduler; it is logged loudly
                logger.exception("pivotrl tick failed")

    def now(self) -> float:
        return time.monotonic() - self._t0

    def tick(self) -> None:
        now = self.now()
        self._last_tick = now
        t0 = time.perf_counter()
        self.orch.tick(now)
        self.plan_s += time.perf_counter() - t0  # the controller's CPU cost, reported in the state
        self.plans += 1
        self._wake_held()

    def _tick_on_event(self) -> None:
        """Plan now rather than at the next periodic tick: new work arrived or a role ran dry, the two
        moments a stage transition can start. At most one extra tick per `EVENT_TICK_GAP_S`: an event inside
        the gap is planned for at its end, not dropped: dropped, it waits for the periodic tick
        (see docs/decisions.md#an-event-tick-inside-the-gap-is-deferred-not-dropped)."""
        wait = EVENT_TICK_GAP_S - (self.now() - self._last_tick)
        if wait > 0:
            with contextlib.suppress(RuntimeError):  # no running loop (a unit test calling a handler): drop
                if not self._event_tick_pending:
                    asyncio.get_running_loop().call_later(wait, self._deferred_tick)
                    self._event_tick_pending = True
            return
        try:
            self.tick()
        except Exception:
            logger.exception("pivotrl event tick failed")

    def _deferred_tick(self) -> None:
        self._event_tick_pending = False
        if self._task is not None and not self._task.done():  # not after `close`
            self._tick_on_event()

    # -- workers --------------------------------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        self.orch.join(worker, str(ws.name) if ws is not None else worker, self.now())
        self._tick_on_event()

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str = "", **kwargs: Any) -> None:
        self.orch.lose(worker, self.now(), stimulus=stimulus_id)

    # -- handlers: worker side ------------------------------------------------------------------------
    async def handle_sync(self, report: dict[str, Any]) -> dict[str, Any]:
        """Apply a host's report and answer with its commands. A host with no work asks for a hold
        (`SyncReport.hold_s`): a reply that would carry nothing is then held until the host has a command
        or the hold ends. Why: an idle host polled every 20 ms, so new work waited half a poll and a
        round trip on average, at every stage change, and the polls cost the scheduler CPU."""
        rep = SyncReport.from_wire(report)
        if rep.session != self.session:
            return SyncReply(unknown=True).to_wire()
        reply, drained = self.orch.sync(rep, self.now())
        if drained:
            self._tick_on_event()
        urgent = rep.flushed is not None or drained  # what an iteration's next step waits on
        if self._output is not None and urgent and self.orch.ledger.has_output():
            self._output.set()
        self._wake_held()  # the report may have freed or queued work for a held host
        hold = min(float(rep.hold_s), MAX_SYNC_HOLD_S)
        if hold > 0 and reply.empty():
            t0 = time.monotonic()
            if await self._held(rep.worker, hold):
                again = SyncReport(worker=rep.worker, session=rep.session, free=rep.free, sync_s=rep.sync_s,
                                   acked=rep.acked)
                reply, _ = self.orch.sync(again, self.now())  # the empty reply was never sent: no ack lost
            reply.held_s = time.monotonic() - t0
        return reply.to_wire()

    async def _held(self, worker: str, hold: float) -> bool:
        """Wait until `worker` has a command (True) or `hold` seconds pass (False)."""
        deadline = time.monotonic() + hold
        wake = asyncio.Event()
        self._held_syncs[worker] = wake  # a host has one sync in flight: a newer one replaces it
        try:
            while not self.orch.has_commands(worker):
                left = deadline - time.monotonic()
                if left <= 0 or self._task is None or self._task.done():
                    return False
                wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), left)
            return True
        finally:
            if self._held_syncs.get(worker) is wake:
                del self._held_syncs[worker]

    def _wake_held(self, everyone: bool = False) -> None:
        """Something changed: answer each held sync whose host now has a command (`everyone`: all of
        them, to see the plugin closed). Only those: with many idle hosts, waking all at every event
        would cost a task switch per host per sync."""
        for worker, wake in self._held_syncs.items():
            if everyone or self.orch.has_commands(worker):
                wake.set()

    # -- handlers: driver side ------------------------------------------------------------------------
    def handle_submit(self, items: list[dict[str, Any]]) -> int:
        n = self.orch.submit([WorkRequest.from_wire(d) for d in items], self.now())
        self._tick_on_event()
        self._wake_held()
        return n

    def handle_begin_iteration(self, plan: dict[str, Any]) -> None:
        self.orch.begin_iteration(IterationPlan(**plan), self.now())

    async def handle_collect(self, wait_s: float = 0.0) -> dict[str, Any]:
        """Hand the driver what finished. With nothing waiting, hold the call up to `wait_s` (at most
        `MAX_COLLECT_WAIT_S`), and return early when a gradient sum arrives or a role drains: a driver
        polling on a timer leaves those, which the iteration waits on, half its period on average. Other
        results keep the driver's rhythm: answering each at once made it collect hundreds of times a second,
        and that CPU slowed the devices (see docs/decisions.md)."""
        if wait_s > 0 and not self.orch.ledger.has_output():
            if self._output is None:
                self._output = asyncio.Event()
            self._output.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._output.wait(), min(float(wait_s), MAX_COLLECT_WAIT_S))
        return self.orch.collect(self.now(), self.plan_s, self.plans).to_wire()

    def handle_set_version(self, role: str, version: int) -> None:
        self.orch.set_version(role, version)

    def handle_flush(self, iteration: int) -> None:
        self.orch.flush(iteration)
        self._wake_held()

    def handle_shift(self, worker: str, role: str | None) -> str:
        """An operator's shift (tests, operators); core executes it."""
        shift_id = self.orch.request_shift(worker, role, self.now())
        self._wake_held()
        return shift_id

    def handle_abort(self, items: list[str]) -> int:
        n = self.orch.abort(list(items), self.now())
        self._wake_held()
        return n

    def handle_state(self) -> dict[str, Any]:
        return self.orch.state(self.now(), self.plan_s, self.plans)

    def handle_items(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        return self.orch.items(list(ids))

    def handle_report(self, report: dict[str, Any]) -> None:
        rep = IterationReport.from_wire(report)
        self.reports.append(rep)
        if self._exporter is not None:
            self._exporter.report = rep

    def handle_learned(self) -> dict[str, Any]:
        """What core's controller has learned, for the driver's run checkpoint."""
        from pivotrl.core.learned import learned_state

        return learned_state(self.orch.ctl).to_json()

    def handle_metrics(self) -> dict[str, Any]:
        return {"timeline": list(self.orch.timeline), "events": list(self.orch.events)}
