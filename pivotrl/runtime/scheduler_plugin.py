"""The pivotrl scheduler extension: work items, the role of every device, shift orchestration.

Mirrors distributed's P2P-shuffle extension: a `SchedulerPlugin` that adds prefixed handlers
(`scheduler.handlers["pivotrl_*"]`) called by the paired worker plugin and by the pipeline driver.

Why pull-based: workers call `pivotrl_sync` after every engine step (and every few ms when idle) carrying
finished work, partial progress, step samples and free slots; the reply carries the worker's commands
(items to run, items to abort, a shift, a gradient flush). So the scheduler never needs a connection to
the worker, commands reach it within one engine step, and a lost worker simply stops syncing.

Decisions (dispatch, shifts, aborts) come from a `Control` (pivotrl.core through `CoreControl`, or the
manual one); this module only applies them, keeps the item state machine consistent and records metrics.
Every decision is logged with `scheduler.log_event("pivotrl", ...)`.

Item state machine (per work item):
    waiting → assigned (in a worker's outbox) → running (delivered) → done
                                               ↘ accumulated (train: in a local gradient sum) → done (flushed)
    running/assigned/accumulated → waiting again on abort, shift-down or worker loss (generated tokens kept
    where reported), so each item is finished — for train, flushed into exactly one gradient sum — once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from pivotrl.runtime.control import Control, Decision, ManualControl

logger = logging.getLogger(__name__)

PLUGIN_NAME = "pivotrl"
EVENT_TICK_GAP_S = 0.01


@dataclass
class Item:
    """One unit of role work: a sequence to generate (rollout/reward) or to train on."""

    id: str
    role: str
    payload: dict[str, Any]
    iteration: int = 0
    est_tokens: int = 0  # expected new tokens (or, for train, tokens to process)
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    group_id: str | None = None
    state: str = "waiting"
    worker: str | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attempts: int = 0
    next_worker: str | None = None  # dispatched elsewhere while its abort is still in flight

    def wire(self) -> dict[str, Any]:
        """What the worker receives: plain lists and dicts only (never tensors)."""
        return {
            "id": self.id,
            "role": self.role,
            "iteration": self.iteration,
            "payload": self.payload,
            "generated": list(self.generated),
            "logprobs": list(self.logprobs),
        }


@dataclass
class WorkerInfo:
    addr: str
    name: str
    role: str | None = None  # the role whose context is loaded (None while joining/shifting)
    status: str = "joining"  # joining | shifting | ready
    free: int = 0
    outbox: list[str] = field(default_factory=list)  # item ids assigned, not yet delivered
    aborts: list[str] = field(default_factory=list)
    shift: dict[str, Any] | None = None
    flush: bool = False
    last_sync: float = 0.0
    tokens_per_s: float = 0.0
    # device-time accounting (seconds): engine steps per role, gradient flushes, shifts (scheduler-side,
    # from the decision to `shift_done`, so command latency counts); the rest of the wall time is idle
    busy: dict[str, float] = field(default_factory=dict)
    shifting_s: float = 0.0
    shift_since: float | None = None
    sync_s: float = 0.0  # worker-measured wall time blocked on `pivotrl_sync` round trips (cumulative)


class PivotSchedulerPlugin(SchedulerPlugin):
    """Hosts the controller; see the module docstring. Construct on the client, register with
    `client.register_plugin(plugin)`; the instance is pickled and started on the scheduler."""

    name = PLUGIN_NAME

    def __init__(
        self,
        control: Control | None = None,
        role_specs: dict[str, dict[str, Any]] | None = None,
        tick_s: float = 0.25,
        sample_s: float = 0.5,
        session: str = "",
    ) -> None:
        self.session = session  # role hosts of another session (a replaced plugin) are ignored
        self.control: Control = control if control is not None else ManualControl()
        # role → what a device of that role loads: {"model": name, "version": int, ...engine options}
        self.role_specs: dict[str, dict[str, Any]] = dict(role_specs or {})
        self.tick_s = tick_s
        self.sample_s = sample_s
        self._reset_state()

    def _reset_state(self) -> None:
        self.items: dict[str, Item] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.results: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.flush_upto: int = -1
        self._events_sent = 0
        self._shift_ids = itertools.count()
        self._t0 = time.monotonic()
        self._last_sample = -1e9
        self._last_tick = -1e9
        self._event_tick_pending = False
        self.plan_s = 0.0
        self.plans = 0
        self._tokens: dict[str, int] = {}  # role → tokens produced since start
        self._task: asyncio.Task | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("scheduler", None)
        state.pop("_task", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._task = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        old = scheduler.plugins.get(PLUGIN_NAME)
        if old is not None and old is not self:  # re-registration replaces the extension: stop the old one
            await old.close()
        self._t0 = time.monotonic()
        handlers = {
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
        }
        scheduler.handlers.update(handlers)
        for addr, ws in scheduler.workers.items():
            self._join(addr, str(ws.name))
        self._task = asyncio.create_task(self._ticker())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
            except Exception:  # a bug here must not kill the scheduler; it is logged loudly
                logger.exception("pivotrl tick failed")

    def now(self) -> float:
        return time.monotonic() - self._t0

    def log(self, kind: str, **msg: Any) -> None:
        record = {"kind": kind, "t": round(self.now(), 4), **msg}
        self.events.append(record)
        self.scheduler.log_event(PLUGIN_NAME, record)

    # -- workers --------------------------------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        self._join(worker, str(ws.name) if ws is not None else worker)

    def _join(self, addr: str, name: str) -> None:
        if addr in self.workers:
            return
        self.workers[addr] = WorkerInfo(addr=addr, name=name, last_sync=self.now())
        role = self.control.add_device(addr, self.now())
        self.log("join", worker=addr, name=name, role=role)
        if role is not None:
            self._start_shift(addr, role, decision="join")

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str = "", **kwargs: Any) -> None:
        info = self.workers.pop(worker, None)
        if info is None:
            return
        now = self.now()
        requeued = []
        self.control.remove_device(worker, now)
        for item in self.items.values():
            if item.next_worker == worker:
                item.next_worker = None
            if item.worker == worker and item.state in ("assigned", "running", "accumulated"):
                self._requeue(item, now)
                requeued.append(item.id)
        self.log(
            "worker_lost",
            worker=worker,
            name=info.name,
            role=info.role,
            requeued=len(requeued),
            kept_tokens=sum(len(self.items[i].generated) for i in requeued),
        )
        self._dispatch()

    def _requeue(self, item: Item, now: float) -> None:
        accumulated = item.state == "accumulated"
        item.state, item.worker = "waiting", None
        item.attempts += 1
        if accumulated:  # its gradient was never flushed: to the controller it is new work again
            self.control.submit(item, now)
        else:
            self.control.requeue(item.id, len(item.generated), now)
        target, item.next_worker = item.next_worker, None
        if target is not None:
            self._assign(item, target)

    def _assign(self, item: Item, dev: str) -> None:
        """Put `item` in `dev`'s outbox; if it is still running elsewhere (an abort in flight), remember the
        target and assign it when the partial comes back."""
        info = self.workers.get(dev)
        if info is None:
            return
        if item.state in ("running", "assigned") and item.worker != dev:
            item.next_worker = dev
            return
        if item.state != "waiting":
            return
        item.state, item.worker = "assigned", dev
        info.outbox.append(item.id)

    # -- shifting -------------------------------------------------------------------------------------
    def _start_shift(self, addr: str, role: str | None, decision: str) -> None:
        info = self.workers[addr]
        spec = self.role_specs.get(role) if role is not None else {}
        if spec is None:
            raise KeyError(f"no role spec for {role!r}; known: {sorted(self.role_specs)}")
        now = self.now()
        # undelivered assignments go straight back; delivered ones are aborted by the worker itself
        for item_id in info.outbox:
            item = self.items.get(item_id)
            if item is not None and item.state == "assigned":
                self._requeue(item, now)
        info.outbox.clear()
        info.aborts.clear()
        shift_id = f"s{next(self._shift_ids)}"
        info.shift = {"id": shift_id, "role": role, "spec": spec, "from": info.role, "decision": decision}
        info.status = "shifting"
        if info.shift_since is None:
            info.shift_since = now
        self.control.on_shift_started(addr, role, now)
        self.log(
            "shift_start",
            worker=addr,
            name=info.name,
            shift=shift_id,
            src=info.role,
            dst=role,
            decision=decision,
        )

    def apply(self, decision: Decision) -> None:
        now = self.now()
        self.log(
            "decision",
            id=decision.id,
            aborts=len(decision.aborts),
            dispatch=len(decision.dispatch),
            shifts=[[self.workers[d].name if d in self.workers else d, r] for d, r in decision.shifts],
            reasoning=decision.reasoning,
        )
        for item_id in decision.aborts:
            item = self.items.get(item_id)
            if item is None or item.worker is None:
                continue
            if item.state == "assigned":
                self.workers[item.worker].outbox.remove(item_id)
                self._requeue(item, now)
            elif item.state == "running":
                self.workers[item.worker].aborts.append(item_id)
        for dev, role in decision.shifts:
            if dev in self.workers:
                self._start_shift(dev, role, decision=decision.id)
        for item_id, dev in decision.dispatch:
            item = self.items.get(item_id)
            if item is not None:
                self._assign(item, dev)

    # -- ticking and dispatch -------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.now()
        self._last_tick = now
        t0 = time.perf_counter()
        decision = self.control.tick(now)
        self.plan_s += time.perf_counter() - t0  # the controller's CPU cost, reported in the state
        self.plans += 1
        if decision is not None and (decision.shifts or decision.aborts or decision.dispatch):
            self.apply(decision)
        self._maybe_flush()
        self._dispatch()
        if now - self._last_sample >= self.sample_s:
            self._sample(now)

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

    def _role_drained(self, roles: set[str]) -> bool:
        """Has one of `roles` no item left waiting, assigned or running?"""
        busy = {i.role for i in self.items.values() if i.state in ("waiting", "assigned", "running")}
        return bool(roles - busy)

    def _dispatch(self) -> None:
        free = {a: max(0, w.free - len(w.outbox)) for a, w in self.workers.items() if w.status == "ready"}
        for item_id, dev in self.control.dispatch(self.now(), free):
            item = self.items.get(item_id)
            if item is not None:
                self._assign(item, dev)

    def _maybe_flush(self) -> None:
        """Ask train workers to publish their gradient sums once every train item of the flushed
        iterations is in some local sum (none waiting or running)."""
        if self.flush_upto < 0:
            return
        open_items = [
            i
            for i in self.items.values()
            if i.role == "train"
            and i.iteration <= self.flush_upto
            and i.state in ("waiting", "assigned", "running")
        ]
        if open_items:
            return
        holders = {
            i.worker
            for i in self.items.values()
            if i.state == "accumulated" and i.worker and i.iteration <= self.flush_upto
        }
        for addr in holders:
            if addr in self.workers and not self.workers[addr].flush:
                self.workers[addr].flush = True
                self.log("flush", worker=addr, name=self.workers[addr].name)

    def _sample(self, now: float) -> None:
        self._last_sample = now
        depth: dict[str, int] = {}
        running: dict[str, int] = {}
        for item in self.items.values():
            if item.state == "waiting":
                depth[item.role] = depth.get(item.role, 0) + 1
            elif item.state in ("assigned", "running"):
                running[item.role] = running.get(item.role, 0) + 1
        self.timeline.append(
            {
                "t": round(now, 4),
                "roles": {
                    w.name: (w.role if w.status == "ready" else "shifting") for w in self.workers.values()
                },
                "queue_depth": depth,
                "running": running,
                "tokens": dict(self._tokens),
                "tokens_per_s": {w.name: round(w.tokens_per_s, 2) for w in self.workers.values()},
            }
        )

    # -- handlers: worker side ------------------------------------------------------------------------
    def handle_sync(
        self,
        worker: str,
        finished: list[dict[str, Any]] | None = None,
        aborted: list[dict[str, Any]] | None = None,
        progress: dict[str, list[Any]] | None = None,
        steps: list[list[float]] | None = None,
        flushed: dict[str, Any] | None = None,
        shift_done: dict[str, Any] | None = None,
        free: int = 0,
        session: str = "",
        sync_s: float = 0.0,
    ) -> dict[str, Any]:
        info = self.workers.get(worker)
        if info is None or session != self.session:  # lost, not yet joined, or another session: stand by
            return {"assign": [], "abort": [], "shift": None, "flush": False, "unknown": True}
        now = self.now()
        info.last_sync = now
        info.free = int(free)
        info.sync_s = float(sync_s)
        for item_id, (off, toks, lps) in (progress or {}).items():
            item = self.items.get(item_id)
            if item is not None and item.worker == worker and item.state == "running":
                item.generated[off:] = toks
                item.logprobs[off:] = lps
                self.control.on_progress(item_id, len(item.generated), now)
        for res in aborted or ():
            item = self.items.get(res["id"])
            if item is None or item.worker != worker or item.state not in ("running", "assigned"):
                continue
            item.generated = list(res.get("generated", item.generated))
            item.logprobs = list(res.get("logprobs", item.logprobs))
            self._requeue(item, now)
        finished_roles = {self.items[r["id"]].role for r in finished or () if r["id"] in self.items}
        for res in finished or ():
            self._finish(worker, res, now)
        for concurrency, step_time, tokens in steps or ():
            role = info.role or "?"
            self._tokens[role] = self._tokens.get(role, 0) + int(tokens)
            info.busy[role] = info.busy.get(role, 0.0) + float(step_time)
            if step_time > 0:
                info.tokens_per_s = 0.7 * info.tokens_per_s + 0.3 * tokens / step_time
            self.control.on_step(worker, int(concurrency), float(step_time), int(tokens), now)
        if flushed is not None:
            info.busy["flush"] = info.busy.get("flush", 0.0) + float(flushed.get("seconds", 0.0))
            self._flushed(worker, flushed, now)
        if shift_done is not None and info.shift is not None and shift_done.get("id") == info.shift["id"]:
            role = info.shift["role"]
            info.role, info.status, info.shift = role, "ready", None
            if info.shift_since is not None:
                info.shifting_s += now - info.shift_since
                info.shift_since = None
            timings = {k: float(v) for k, v in shift_done.get("timings", {}).items()}
            self.log(
                "shift_done",
                worker=worker,
                name=info.name,
                shift=shift_done["id"],
                role=role,
                src=shift_done.get("from"),
                timings=timings,
            )
            follow = self.control.on_shift_done(worker, role, timings, now)
            if follow is not None:
                self.apply(follow)
        if finished_roles and self._role_drained(finished_roles):
            self._tick_on_event()
        if info.status == "ready":
            self._dispatch()
        reply = {
            "assign": [self._deliver(i) for i in info.outbox],
            "abort": list(info.aborts),
            "shift": info.shift if info.status == "shifting" else None,
            "flush": info.flush,
        }
        info.outbox.clear()
        info.aborts.clear()
        return reply

    def _deliver(self, item_id: str) -> dict[str, Any]:
        item = self.items[item_id]
        item.state = "running"
        return item.wire()

    def _finish(self, worker: str, res: dict[str, Any], now: float) -> None:
        item = self.items.get(res["id"])
        if item is None or item.worker != worker or item.state not in ("running", "assigned"):
            return  # a late duplicate (e.g. finished on a worker we already gave up on)
        self.control.on_finished(item.id, len(res.get("generated", ())) or item.est_tokens, now)
        if item.role == "train":
            item.state = "accumulated"
            return
        item.state = "done"
        out = {"id": item.id, "role": item.role, "iteration": item.iteration, "worker": worker, **res}
        self.results.append(out)
        del self.items[item.id]

    def _flushed(self, worker: str, flushed: dict[str, Any], now: float) -> None:
        ids = [
            i
            for i in flushed.get("items", ())
            if i in self.items and self.items[i].worker == worker and self.items[i].state == "accumulated"
        ]
        for item_id in ids:
            del self.items[item_id]
        if worker in self.workers:
            self.workers[worker].flush = False
        if ids:
            self.results.append(
                {
                    "id": f"grad:{flushed.get('ref')}",
                    "role": "train",
                    "kind": "grad",
                    "worker": worker,
                    "ref": flushed.get("ref"),
                    "items": ids,
                    "stats": flushed.get("stats", {}),
                }
            )
            self.log(
                "flushed",
                worker=worker,
                name=self.workers[worker].name if worker in self.workers else worker,
                items=len(ids),
                ref=flushed.get("ref"),
            )

    # -- handlers: driver side ------------------------------------------------------------------------
    def handle_submit(self, items: list[dict[str, Any]]) -> int:
        now = self.now()
        for d in items:
            item = Item(
                id=d["id"],
                role=d["role"],
                payload=d["payload"],
                iteration=int(d.get("iteration", 0)),
                est_tokens=int(d.get("est_tokens", 0)),
                prompt_tokens=int(d.get("prompt_tokens", 0)),
                max_new_tokens=int(d.get("max_new_tokens", 0)),
                group_id=d.get("group_id"),
                generated=list(d.get("generated", ())),
                logprobs=list(d.get("logprobs", ())),
            )
            if item.id in self.items:
                raise ValueError(f"duplicate item id {item.id!r}")
            self.items[item.id] = item
            self.control.submit(item, now)
        self._tick_on_event()
        self._dispatch()
        return len(items)

    def handle_begin_iteration(self, plan: dict[str, Any]) -> None:
        self.control.begin_iteration(dict(plan), self.now())
        self.log("iteration", **{k: v for k, v in plan.items() if isinstance(v, (int, float, str))})

    def handle_collect(self) -> dict[str, Any]:
        results, self.results = self.results, []
        events = self.events[self._events_sent :]
        self._events_sent = len(self.events)
        return {"results": results, "events": events, "state": self.handle_state()}

    def handle_set_version(self, role: str, version: int) -> None:
        self.role_specs[role] = {**self.role_specs[role], "version": int(version)}
        self.log("version", role=role, version=int(version))

    def handle_flush(self, iteration: int) -> None:
        self.flush_upto = max(self.flush_upto, int(iteration))
        self._maybe_flush()

    def handle_shift(self, worker: str, role: str) -> str:
        """Manual shift (tests, operators). Goes through the control so its bookkeeping stays right."""
        if worker not in self.workers:
            by_name = {w.name: a for a, w in self.workers.items()}
            worker = by_name.get(worker, worker)
        if worker not in self.workers:
            raise KeyError(f"unknown worker {worker!r}")
        request = getattr(self.control, "request_shift", None)
        if request is not None:
            request(worker, role)
            self.tick()
        else:
            self._start_shift(worker, role, decision="manual")
        return self.workers[worker].shift["id"] if self.workers[worker].shift else ""

    def handle_abort(self, items: list[str]) -> int:
        self.apply(Decision(id="manual-abort", aborts=list(items), reasoning={"stimulus": "request"}))
        return len(items)

    def handle_state(self) -> dict[str, Any]:
        now = self.now()
        counts: dict[str, dict[str, int]] = {}
        for item in self.items.values():
            c = counts.setdefault(item.role, {})
            c[item.state] = c.get(item.state, 0) + 1
        return {
            "t": now,
            "workers": {
                a: {
                    "name": w.name,
                    "role": w.role,
                    "status": w.status,
                    "free": w.free,
                    "tokens_per_s": w.tokens_per_s,
                    "busy": dict(w.busy),
                    "sync_s": w.sync_s,
                    "shifting_s": w.shifting_s + (now - w.shift_since if w.shift_since is not None else 0.0),
                }
                for a, w in self.workers.items()
            },
            "items": counts,
            "tokens": dict(self._tokens),
            "plan_s": self.plan_s,
            "plans": self.plans,
            "control": self.control.snapshot(),
        }

    def handle_items(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """Where some items are (tests, debugging): state, worker, tokens generated so far."""
        return {
            i: {
                "state": it.state,
                "worker": it.worker,
                "generated": len(it.generated),
                "attempts": it.attempts,
            }
            for i in ids
            if (it := self.items.get(i)) is not None
        }

    def handle_metrics(self) -> dict[str, Any]:
        return {"timeline": list(self.timeline), "events": list(self.events)}
