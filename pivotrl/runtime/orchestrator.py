"""The scheduler side of the runtime without Dask: core decides, this executes.

`Orchestrator` holds pivotrl.core's `Controller` (the only place a decision is made: placement, shifts,
aborts), the item ledger (`items.py`) and what it knows of each worker. It turns what role hosts report
(`SyncReport`) into core events, and core's decisions into worker commands (`SyncReply`). Which device
serves which replica is core's own map (`Controller.state`): after every decision each worker is
reconciled with it — a device whose replica changed is told to shift to that replica's role, a device core
freed is told to go idle — so multi-device replicas need nothing more here: each of their devices loads
the role, the first one runs the replica's items, and the replica is ready when all of them are.

The Dask scheduler plugin (`scheduler_plugin.py`) only wires handlers and a ticker to this object; tests
drive it directly. Time is passed in, as in core.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pivotrl.core import Controller, Decision, IterationPlan, ShiftTimings
from pivotrl.runtime.items import ItemLedger, sequence_of
from pivotrl.runtime.messages import (
    Collected,
    ItemState,
    ShiftCommand,
    SyncReply,
    SyncReport,
    WorkRequest,
)
from pivotrl.runtime.records import DecisionRecord, IterationEdges, IterationMark


class WorkerStatus:
    JOINING = "joining"
    SHIFTING = "shifting"
    READY = "ready"


@dataclass
class WorkerInfo:
    addr: str
    name: str
    role: str | None = None  # the role whose context is loaded (None while joining, idle or shifting)
    replica: str | None = None  # core's replica this device serves (or is loading)
    status: str = WorkerStatus.JOINING
    free: int = 0
    shift: ShiftCommand | None = None
    shift_timings: ShiftTimings | None = None  # this device's part of a multi-device replica's shift
    flush: bool = False
    last_sync: float = 0.0
    tokens_per_s: float = 0.0
    # device-time accounting (seconds): engine steps per role, gradient flushes, shifts (from the decision
    # to `shift_done`, so command latency counts); the rest of the wall time is idle
    busy: dict[str, float] = field(default_factory=dict)
    shifting_s: float = 0.0
    shift_since: float | None = None
    sync_s: float = 0.0
    # replies sent and not yet acknowledged: seq → (item ids delivered, abort ids) in that reply
    unacked: dict[int, tuple[list[str], list[str]]] = field(default_factory=dict)


def slowest(timings: list[ShiftTimings]) -> ShiftTimings:
    """A multi-device replica is ready when its slowest device is: each phase's longest time."""
    return ShiftTimings(**{p: max(getattr(t, p) for t in timings) for p in ShiftTimings.PHASES},
                        warm=all(t.warm for t in timings))


class Orchestrator:
    def __init__(self, controller: Controller, role_specs: dict[str, dict[str, Any]],
                 log: Callable[..., None] | None = None, sample_s: float = 0.5) -> None:
        self.ctl = controller
        # role → what a device of that role loads: {"model": name, "version": int, ...engine options}
        self.role_specs = {r: dict(s) for r, s in role_specs.items()}
        self.ledger = ItemLedger()
        self.workers: dict[str, WorkerInfo] = {}
        self.flush_upto = -1
        self.events: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.decisions: list[DecisionRecord] = []  # the page's shift decisions, B/G/φ from core's reasoning
        self.iterations: list[IterationMark] = []
        self.edges: dict[int, IterationEdges] = {}  # the newest few iterations' first submit, last train item
        self.tokens: dict[str, int] = {}  # role → tokens produced since start
        self.sample_s = sample_s
        self._last_sample = -1e9
        self._events_sent = 0
        self._shift_ids = itertools.count()
        # reply numbers, one sequence for all workers: a worker that joins again (a new `WorkerInfo`, the
        # same host) never sees a number it acknowledged before
        self._reply_ids = itertools.count(1)
        self._log_sink = log
        self.now = 0.0

    def log(self, kind: str, **msg: Any) -> None:
        record = {"kind": kind, "t": round(self.now, 4), **msg}
        self.events.append(record)
        if self._log_sink is not None:
            self._log_sink(record)

    # ==================================================================================================
    # Workers
    # ==================================================================================================
    def join(self, addr: str, name: str, now: float) -> None:
        self.now = now
        if addr in self.workers:
            return
        self.workers[addr] = WorkerInfo(addr=addr, name=name, last_sync=now)
        self.ctl.add_device(addr, now)
        self.log("join", worker=addr, name=name, stimulus=f"join:{addr}")

    def lose(self, addr: str, now: float, stimulus: str = "") -> None:
        self.now = now
        info = self.workers.pop(addr, None)
        if info is None:
            return
        requeued_core = self.ctl.on_device_lost(addr, now)
        back = self.ledger.worker_lost(addr)
        for item, accumulated in back:
            if accumulated:  # finished in core long ago; its gradient is lost with the device
                self.ctl.submit([sequence_of(item.request, len(item.generated))], now)
            else:
                self.ctl.on_progress(item.id, len(item.generated), now)
        lost_ids = {item.id for item, _ in back}
        for seq in requeued_core:  # items of a dissolved multi-device replica, on its surviving lead
            if seq.seq_id not in lost_ids:
                self.ledger.request_abort(seq.seq_id)
        self.log("worker_lost", worker=addr, name=info.name, role=info.role, requeued=len(back),
                 kept_tokens=sum(len(i.generated) for i, _ in back), stimulus=stimulus or f"lost:{addr}")
        self.reconcile("worker_lost")
        self.dispatch()

    # ==================================================================================================
    # Executing core's decisions
    # ==================================================================================================
    def execute(self, dec: Decision | None) -> None:
        if dec is None:
            return
        aborts = [sid for ids in dec.aborts.values() for sid in ids]
        if dec.shifts or dec.dissolved or aborts:
            self.log("decision", id=f"core-{dec.decision_id}", stimulus=dec.stimulus, kind_=dec.kind,
                     aborts=len(aborts), dispatch=len(dec.dispatch),
                     shifts=[[self._name(d), str(s.to_role)] for s in dec.shifts for d in s.devices],
                     reasoning=None if dec.reasoning is None else dec.reasoning.as_dict())
        if dec.shifts or dec.dissolved:
            self.decisions.append(DecisionRecord.of(dec, self._name))
        for seq_id in aborts:
            item = self.ledger.request_abort(seq_id)
            if item is not None:  # never delivered: core already re-queued it; only its tokens are news
                self.ctl.on_progress(seq_id, len(item.generated), self.now)
        self.reconcile(f"core-{dec.decision_id}")
        self._assign(dec.dispatch)

    def _assign(self, assignments: Any) -> None:
        st = self.ctl.state
        for a in assignments:
            rep = st.replicas.get(a.replica_id)
            if rep is not None and rep.devices[0] in self.workers:
                self.ledger.assign(a.seq_id, rep.devices[0])

    def reconcile(self, decision: str) -> None:
        """Make every worker serve the replica core has it in: shift where they differ."""
        st = self.ctl.state
        for addr, info in self.workers.items():
            rid = st.device_replica.get(addr)
            if rid == info.replica and (info.status != WorkerStatus.JOINING or rid is None):
                continue
            if rid is None and info.status == WorkerStatus.JOINING:
                continue  # never loaded anything: nothing to free
            role = None if rid is None else str(st.replicas[rid].role)
            self._start_shift(info, rid, role, decision)

    def _start_shift(self, info: WorkerInfo, rid: str | None, role: str | None, decision: str) -> None:
        spec = self.role_specs.get(role) if role is not None else {}
        if spec is None:
            raise KeyError(f"no role spec for {role!r}; known: {sorted(self.role_specs)}")
        for item in self.ledger.undeliver(info.addr):  # delivered ones are aborted by the worker itself
            self.ctl.on_progress(item.id, len(item.generated), self.now)
        shift = ShiftCommand(f"s{next(self._shift_ids)}", role, dict(spec), info.role, decision)
        info.shift, info.replica, info.status, info.shift_timings = shift, rid, WorkerStatus.SHIFTING, None
        if info.shift_since is None:
            info.shift_since = self.now
        self.log("shift_start", worker=info.addr, name=info.name, shift=shift.id, src=info.role, dst=role,
                 replica=rid, decision=decision, stimulus=decision)

    def _shift_done(self, info: WorkerInfo, timings: ShiftTimings, shift_id: str) -> None:
        shift = info.shift
        assert shift is not None
        src = info.role
        info.role, info.shift, info.shift_timings = shift.role, None, timings
        info.status = WorkerStatus.READY if shift.role is not None else WorkerStatus.JOINING
        if info.shift_since is not None:
            info.shifting_s += self.now - info.shift_since
            info.shift_since = None
        self.log("shift_done", worker=info.addr, name=info.name, shift=shift_id, role=shift.role, src=src,
                 replica=info.replica, timings=timings.phases(), total=timings.total, warm=timings.warm,
                 stimulus=f"shift_done:{shift_id}")
        rid = info.replica
        if rid is None:
            return
        rep = self.ctl.state.replicas.get(rid)
        if rep is None:
            return  # dissolved before it was ready: reconcile already sent the device elsewhere
        parts = [self.workers[d] for d in rep.devices if d in self.workers]
        if len(parts) < len(rep.devices) or any(
                p.replica != rid or p.status != WorkerStatus.READY or p.shift_timings is None for p in parts):
            return  # the replica's other devices are still loading
        with contextlib.suppress(KeyError):  # superseded by a later decision
            self.execute(self.ctl.on_shift_done(rid, self.now, slowest([p.shift_timings for p in parts])))

    # ==================================================================================================
    # Ticks and dispatch
    # ==================================================================================================
    def tick(self, now: float) -> None:
        self.now = now
        self.execute(self.ctl.tick(now))
        self._maybe_flush()
        self.dispatch()
        if now - self._last_sample >= self.sample_s:
            self._sample(now)

    def dispatch(self) -> None:
        self._assign(self.ctl.dispatch(self.now))

    def request_shift(self, worker: str, role: str | None, now: float) -> str:
        """An operator's shift (tests, the CLI): core executes it like any decision. Returns the shift id
        the worker was sent ("" when core asked for none)."""
        self.now = now
        if worker not in self.workers:
            by_name = {w.name: a for a, w in self.workers.items()}
            worker = by_name.get(worker, worker)
        if worker not in self.workers:
            raise KeyError(f"unknown worker {worker!r}")
        self.execute(self.ctl.request_shift(worker, role, now))
        shift = self.workers[worker].shift
        return shift.id if shift is not None else ""

    def abort(self, ids: list[str], now: float) -> int:
        """Abort items where they run (tests, operators): they wait again and resume from their tokens."""
        self.now = now
        dec = self.ctl.abort(ids, now)
        self.execute(dec)
        return sum(len(v) for v in dec.aborts.values())

    def _maybe_flush(self) -> None:
        """Ask train workers to publish their gradient sums once every train item of the flushed
        iterations is in some local sum (none waiting or running)."""
        if self.flush_upto < 0:
            return
        for addr in self.ledger.flush_holders(self.flush_upto):
            info = self.workers.get(addr)
            if info is not None and not info.flush:
                info.flush = True
                self.log("flush", worker=addr, name=info.name)

    def _sample(self, now: float) -> None:
        self._last_sample = now
        depth: dict[str, int] = {}
        running: dict[str, int] = {}
        for item in self.ledger.items.values():
            if item.state is ItemState.WAITING:
                depth[item.role] = depth.get(item.role, 0) + 1
            elif item.state in (ItemState.ASSIGNED, ItemState.RUNNING):
                running[item.role] = running.get(item.role, 0) + 1
        self.timeline.append({
            "t": round(now, 4),
            "roles": {w.name: (w.role if w.status == WorkerStatus.READY else "shifting")
                      for w in self.workers.values()},
            "queue_depth": depth,
            "running": running,
            "tokens": dict(self.tokens),
            "tokens_per_s": {w.name: round(w.tokens_per_s, 2) for w in self.workers.values()},
        })

    # ==================================================================================================
    # A role host's sync
    # ==================================================================================================
    def sync(self, report: SyncReport, now: float) -> tuple[SyncReply, bool]:
        """Apply a role host's report and answer with its commands. The flag says a role may just have
        drained (a moment a stage transition can start), so the caller should tick soon."""
        self.now = now
        info = self.workers.get(report.worker)
        if info is None:
            return SyncReply(unknown=True), False
        worker = info.addr
        info.last_sync, info.free, info.sync_s = now, int(report.free), float(report.sync_s)
        self._acknowledge(info, int(report.acked))
        for prog in report.progress:
            item = self.ledger.progress(worker, prog)
            if item is not None:
                self.ctl.on_progress(item.id, len(item.generated), now)
        for partial in report.aborted:
            item = self.ledger.aborted(worker, partial)
            if item is not None:
                self.ctl.on_progress(item.id, len(item.generated), now)
        finished_roles = set()
        for res in report.finished:
            n = len(res.generated)
            item = self.ledger.finished(worker, res)
            if item is None:
                continue  # a late duplicate (e.g. finished on a worker we already gave up on)
            finished_roles.add(item.role)
            if item.role == "train":
                self._edges(item.iteration).last_train_done = now
            with contextlib.suppress(KeyError):  # core finished it already (a late duplicate)
                self.ctl.on_finished(item.id, now, generated=n or item.request.est_tokens)
        rid = self.ctl.state.device_replica.get(worker)
        for s in report.steps:
            role = info.role or "?"
            self.tokens[role] = self.tokens.get(role, 0) + int(s.tokens)
            info.busy[role] = info.busy.get(role, 0.0) + float(s.step_time_s)
            if s.step_time_s > 0:
                info.tokens_per_s = 0.7 * info.tokens_per_s + 0.3 * s.tokens / s.step_time_s
            if rid is not None:  # core fits what a step costs the device: the engine's time and the host's
                self.ctl.on_step(rid, s.concurrency, s.step_time_s + s.host_s, now, tokens=s.tokens,
                                 prefill_tokens=s.prefill_tokens)
        if report.flushed is not None:
            info.busy["flush"] = info.busy.get("flush", 0.0) + float(report.flushed.seconds)
            ids = self.ledger.flushed(worker, report.flushed)
            info.flush = False
            if ids:
                self.log("flushed", worker=worker, name=info.name, items=len(ids),
                         ref=[report.flushed.model, report.flushed.version])
        done = report.shift_done
        if done is not None and info.shift is not None and done.shift_id == info.shift.id:
            self._shift_done(info, done.timings, done.shift_id)
        drained = bool(finished_roles) and self.ledger.drained(finished_roles)
        if "train" in finished_roles:  # the sum may be due now: ask in this reply, not after the next tick
            self._maybe_flush()
        if info.status == WorkerStatus.READY:
            self.dispatch()
        # A shifting worker is handed no items: it would have to run them in the context it is leaving
        # (they stay in its outbox until it is ready, or go back to waiting if core moves them).
        shifting = info.status == WorkerStatus.SHIFTING
        seq = next(self._reply_ids)
        reply = SyncReply(
            assign=[] if shifting else self.ledger.deliver(worker),
            abort=self.ledger.take_aborts(worker),
            shift=info.shift if shifting else None,
            flush=info.flush,
            seq=seq,
        )
        if reply.assign or reply.abort:
            info.unacked[seq] = ([i.id for i in reply.assign], list(reply.abort))
        return reply, drained

    def has_commands(self, worker: str) -> bool:
        """Whether a sync from `worker` now would carry anything (items, aborts, a shift, a flush); an
        unknown worker's stand-by counts. Read-only: a held idle sync polls it (`handle_sync`)."""
        info = self.workers.get(worker)
        if info is None:
            return True
        if info.status == WorkerStatus.SHIFTING:
            return info.shift is not None or info.flush or bool(self.ledger.aborts.get(worker))
        return bool(self.ledger.outbox.get(worker) or self.ledger.aborts.get(worker) or info.flush)

    def _acknowledge(self, info: WorkerInfo, acked: int) -> None:
        """A host syncs once its last reply arrived or its wait for it failed, so the replies after the one
        it acknowledges never reached it: their items go out again, their aborts are asked again (a shift
        or a flush is re-sent anyway while it is pending). Without this, an item in a reply lost in transit
        stayed 'running' on a worker that never got it, and the run waited for it for ever."""
        for seq in sorted(info.unacked):
            ids, aborts = info.unacked.pop(seq)
            if seq <= acked:
                continue
            back = self.ledger.redeliver(info.addr, ids)
            self.ledger.reabort(info.addr, aborts)
            if back:
                self.log("redeliver", worker=info.addr, name=info.name, items=len(back), reply=seq,
                         stimulus=f"lost-reply:{info.addr}:{seq}")

    # ==================================================================================================
    # The driver's side
    # ==================================================================================================
    def submit(self, requests: list[WorkRequest], now: float) -> int:
        self.now = now
        for req in requests:  # core admits each first (it checks budgets), so both ledgers agree on failure
            if req.role not in self.role_specs:
                raise ValueError(f"item {req.id}: no role {req.role!r}; known: {sorted(self.role_specs)}")
            if req.id in self.ledger.items:
                raise ValueError(f"duplicate item id {req.id!r}")
            self.ctl.submit([sequence_of(req, len(req.generated))], now)
            self.ledger.add(req)
            edges = self._edges(req.iteration)
            if edges.first_submit is None:
                edges.first_submit = now
        self.dispatch()
        return len(requests)

    #: iterations whose edges `state` carries (the meter reads the newest two)
    EDGES_KEPT = 4

    def _edges(self, iteration: int) -> IterationEdges:
        edges = self.edges.get(iteration)
        if edges is None:
            edges = self.edges[iteration] = IterationEdges(iteration)
            for old in sorted(self.edges)[: -self.EDGES_KEPT]:
                del self.edges[old]
        return edges

    def begin_iteration(self, plan: IterationPlan, now: float) -> None:
        self.now = now
        self.ctl.begin_iteration(plan, now)
        self.iterations.append(IterationMark(int(plan.iteration), round(now, 4)))
        self.log("iteration", **{k: v for k, v in plan.__dict__.items()})

    def set_version(self, role: str, version: int) -> None:
        self.role_specs[role] = {**self.role_specs[role], "version": int(version)}
        self.log("version", role=role, version=int(version))

    def flush(self, iteration: int) -> None:
        self.flush_upto = max(self.flush_upto, int(iteration))
        self._maybe_flush()

    def collect(self, now: float, plan_s: float = 0.0, plans: int = 0) -> Collected:
        self.now = now
        results, grads = self.ledger.take_results()
        events = self.events[self._events_sent:]
        self._events_sent = len(self.events)
        return Collected(results, grads, events, self.state(now, plan_s, plans))

    def state(self, now: float, plan_s: float = 0.0, plans: int = 0) -> dict[str, Any]:
        """Plain data for logs and the dashboard."""
        snap = self.ctl.snapshot()
        r = self.ctl.last_reasoning
        if r is not None:
            snap["tau"] = dict(r.tau)
            snap["shift_up_role"] = r.shift_up_role
        return {
            "t": now,
            "workers": {
                a: {"name": w.name, "role": w.role, "replica": w.replica, "status": w.status, "free": w.free,
                    "tokens_per_s": w.tokens_per_s, "busy": dict(w.busy), "sync_s": w.sync_s,
                    "shifting_s": w.shifting_s + (now - w.shift_since if w.shift_since is not None else 0.0)}
                for a, w in self.workers.items()
            },
            "items": self.ledger.counts(),
            "iteration_edges": {str(i): e.to_wire() for i, e in self.edges.items()},
            "tokens": dict(self.tokens),
            "plan_s": plan_s,
            "plans": plans,
            "control": snap,
        }

    def items(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """Where some items are (tests, debugging)."""
        return {i: {"state": str(it.state), "worker": it.worker, "generated": len(it.generated),
                    "attempts": it.attempts}
                for i in ids if (it := self.ledger.items.get(i)) is not None}

    def _name(self, addr: str) -> str:
        info = self.workers.get(addr)
        return info.name if info is not None else addr
