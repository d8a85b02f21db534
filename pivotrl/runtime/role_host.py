"""The role host of one device, free of Dask: what a role context is, what it may use, and (below) the loop
that runs it between syncs with the scheduler.

A *role context* is one role's work on one device (generation for rollout and reward, gradient sums for
train): `pivotrl.runtime.roles` holds the real ones, `tests/runtime/fakes.py` small ones. A shift is the
same code path for every pair of roles: abort → offload → fetch (from the Global Parameter Storage) →
load, each phase timed into a `ShiftTimings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from pivotrl.core.types import ShiftTimings
from pivotrl.runtime.messages import (
    GradResult,
    ItemResult,
    Partial,
    Progress,
    ShiftCommand,
    ShiftDone,
    StepSample,
    SyncReply,
    SyncReport,
    WorkItem,
)

logger = logging.getLogger(__name__)

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


@runtime_checkable
class Resident(Protocol):
    """Optional hooks of a context resident at a fraction of its memory (vLLM's sleep mode): `park` as the
    device leaves the role; `unpark` before it serves it again (True if it woke something up)."""

    def park(self) -> None: ...

    def unpark(self, env: WorkerEnv) -> bool: ...


SendSync = Callable[[SyncReport], "Future[SyncReply]"]


class RoleHost:
    """Runs the current role's context on one device between syncs with the scheduler.

    One loop iteration: start a sync (carrying finished and aborted items, progress, step samples, a
    flushed gradient sum, a finished shift) → step the engine while the reply is on its way (at least once,
    and on until the reply is here or the work runs out) → apply the reply's commands (shift, abort,
    flush, new items). `send_sync` starts one round trip and returns a future of the reply: the Dask worker
    plugin sends it through the worker's scheduler RPC, tests through a function that calls an in-process
    `Orchestrator`.

    Why overlap: the engine steps on the work it already holds while the sync is in flight, so the round
    trip does not idle the device; commands then apply as many steps later as the round trip lasted (an
    aborted item comes back with the tokens of those steps too).
    """

    def __init__(self, env: WorkerEnv, send_sync: SendSync, *, worker: str, session: str = "",
                 contexts: Mapping[str, str] | None = None, park: bool = True, idle_poll_s: float = 0.02,
                 progress_every_s: float = 0.5, sync_every_s: float = 0.01,
                 sync_timeout_s: float = 60.0, idle_hold_s: float = 0.0) -> None:
        self.env = env
        self.send_sync = send_sync
        self.worker = worker
        self.session = session
        self.contexts = {**DEFAULT_CONTEXTS, **(contexts or {})}
        self.park = park  # keep a left role's context resident (like vLLM's sleep mode) for a shift back
        self.idle_poll_s = idle_poll_s
        self.progress_every_s = progress_every_s
        # While the engine streams, sync at most this often; shift, flush and abort results and an idle
        # engine sync at once. A round trip costs the device CPU time
        # (see docs/decisions.md#a-streaming-worker-syncs-at-most-every-sync_every_s).
        self.sync_every_s = sync_every_s
        self.sync_timeout_s = sync_timeout_s
        # With no work, ask the scheduler to hold an empty reply this long (`SyncReport.hold_s`) instead of
        # polling every `idle_poll_s`: work then arrives when it exists. 0: poll (a scheduler without holds).
        self.idle_hold_s = idle_hold_s
        self.ctx: RoleContext | None = None
        self.role: str | None = None
        self.stop = threading.Event()
        self._acked = 0  # `seq` of the last reply received (`SyncReport.acked`)
        self._out = self._new_report()
        self._reported: dict[str, int] = {}  # item → tokens already reported as progress
        self._pending: list[WorkItem] = []  # delivered, waiting for a slot or for their weights version
        self._parked: dict[str, RoleContext] = {}  # role → context kept resident while serving another
        self._last_progress = 0.0
        self._last_sync = 0.0
        self._sync_s = 0.0
        # when the last step ended with work still waiting in the same context: the next step's `host_s`
        # runs from here (None: the gap that follows is waiting for work, a command, or a shift)
        self._stepped_at: float | None = None

    def _new_report(self) -> SyncReport:
        return SyncReport(worker=self.worker, session=self.session, acked=self._acked)

    # -- talking to the scheduler ---------------------------------------------------------------------
    def _send(self, hold_s: float = 0.0) -> tuple[Future[SyncReply], SyncReport]:
        out, self._out = self._out, self._new_report()
        out.free = max(0, int(self.ctx.free_slots()) - len(self._pending)) if self.ctx is not None else 0
        out.sync_s = self._sync_s
        out.hold_s = hold_s
        self._last_sync = time.perf_counter()
        return self.send_sync(out), out

    def _wait(self, fut: Future[SyncReply], out: SyncReport) -> SyncReply:
        t0 = time.perf_counter()
        held = 0.0  # the part of the wait the scheduler held the reply for want of work: idle, not blocked
        try:
            reply = fut.result(timeout=self.sync_timeout_s)
            held = reply.held_s
            if reply.seq:
                self._acked = self._out.acked = reply.seq  # the report filled now goes out next
            return reply
        except Exception:
            out.merge_back(self._out)  # keep what we had so nothing is lost; it goes with the next sync
            raise
        finally:
            self._sync_s += max(0.0, time.perf_counter() - t0 - held)

    def sync_now(self) -> SyncReply:
        """One blocking round trip (where nothing can overlap it)."""
        return self._wait(*self._send())

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        """Loop until `stop` is set."""
        while not self.stop.is_set():
            self.run_once()

    def run_once(self) -> bool:
        """One sync-step-apply round (or just a step while no sync is due); True if anything happened."""
        if not self._sync_due():
            try:
                return self.step()
            except Exception:
                logger.exception("pivotrl role host failed stepping its %s context", self.role)
        idle = self.ctx is None or not (self.ctx.has_work() or self._pending)
        sent = time.perf_counter()
        try:
            fut, out = self._send(self.idle_hold_s if idle else 0.0)
        except Exception:
            logger.info("pivotrl sync could not start; retrying", exc_info=True)
            self.stop.wait(0.2)
            return False
        stepped = False
        try:
            stepped = self.step()
            while stepped and not fut.done() and not self.stop.is_set() and self.step():
                pass  # the device keeps stepping the work it holds until the reply is here
        except Exception:
            logger.exception("pivotrl role host failed stepping its %s context", self.role)
        try:
            reply = self._wait(fut, out)
        except Exception:
            if not self.stop.is_set():
                logger.info("pivotrl sync failed; retrying", exc_info=True)
                self.stop.wait(0.2)
            return False
        try:
            busy = self.apply(reply)
        except Exception:
            logger.exception("pivotrl role host failed applying a reply (shift %s)", reply.shift)
            busy = False
        if not (busy or stepped):  # a poll at most every idle_poll_s: a held sync has waited already
            self.stop.wait(max(0.0, self.idle_poll_s - (time.perf_counter() - sent)))
        return busy or stepped

    def _sync_due(self) -> bool:
        out = self._out
        if self.ctx is None or not self.ctx.has_work():
            return True
        if out.shift_done is not None or out.flushed is not None or out.aborted:
            return True
        return time.perf_counter() - self._last_sync >= self.sync_every_s

    def apply(self, reply: SyncReply) -> bool:
        if reply.unknown:
            return False
        if reply.shift is not None or reply.abort or reply.flush:
            self._stepped_at = None  # a command's own time is not a step's
        if reply.shift is not None:
            # The orchestrator sends no items with a shift; any that came would be handed back by the
            # shift's abort, with their tokens, rather than dropped (the ledger holds them as running here).
            self._pending.extend(reply.assign)
            self.shift(reply.shift)
            return True
        if reply.abort and self.ctx is not None:
            self.abort(reply.abort)
        if reply.flush and self.ctx is not None:
            self.flush()
        self._pending.extend(reply.assign)
        if self.ctx is None:
            return False
        self._admit()
        return bool(self.ctx.has_work() or self._pending)

    def step(self) -> bool:
        """One engine step of the current context, if it has work; its results go out with the next sync."""
        if self.ctx is None or not self.ctx.has_work():
            self._stepped_at = None
            return False
        start = time.perf_counter()
        finished, sample = self.ctx.step()
        if sample is not None:
            if self._stepped_at is not None:
                sample = dataclasses.replace(sample, host_s=start - self._stepped_at)
            self._out.steps.append(sample)
        self._stepped_at = time.perf_counter() if self.ctx.has_work() else None
        for res in finished:
            self._reported.pop(res.id, None)
            self._out.finished.append(res)
        if time.perf_counter() - self._last_progress >= self.progress_every_s:
            self._report_progress()
        return True

    # -- commands -------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish the context's local gradient sum (train), timed: device time the scheduler counts."""
        assert self.ctx is not None
        t0 = time.perf_counter()
        grad = self.ctx.flush()
        if grad is not None:
            grad.worker, grad.seconds = self.worker, time.perf_counter() - t0
            self._out.flushed = grad

    def _admit(self) -> None:
        """Hand pending items to the context; an item that needs another weights version waits until the
        context drains, then the context moves to that version (rollout replicas following the policy)."""
        assert self.ctx is not None
        keep: list[WorkItem] = []
        for item in self._pending:
            want = item.payload.get("version")
            if want is not None and want != self.ctx.version:
                if self.ctx.has_work():
                    keep.append(item)
                    continue
                self.ctx.set_version(self.env, int(want))
            self.ctx.add(item)
            self._reported[item.id] = len(item.generated)
        self._pending = keep

    def _report_progress(self) -> None:
        assert self.ctx is not None
        self._last_progress = time.perf_counter()
        for item_id, (toks, lps) in self.ctx.progress().items():
            start = self._reported.get(item_id)
            if start is None or len(toks) <= start:
                continue
            self._out.progress.append(Progress(item_id, start, list(toks[start:]), list(lps[start:])))
            self._reported[item_id] = len(toks)

    def abort(self, ids: list[str] | None) -> None:
        """Stop these items (None: every one) and hand each back with its tokens."""
        wanted = None if ids is None else set(ids)
        back = [p for p in self._pending if wanted is None or p.id in wanted]
        self._pending = [p for p in self._pending if p not in back]
        held = {p.id for p in back}
        parts = [] if self.ctx is None else self.ctx.abort(
            None if ids is None else [i for i in ids if i not in held])
        for item in back:
            self._out.aborted.append(Partial(item.id, list(item.generated), list(item.logprobs)))
        for part in parts:
            self._reported.pop(part.id, None)
            self._out.aborted.append(part)

    def _offload_or_park(self, ctx: RoleContext, role: str | None, keep: bool) -> None:
        if self.park and keep and role is not None and ctx.parkable():
            old = self._parked.pop(role, None)
            if old is not None and old is not ctx:
                old.offload()
            if isinstance(ctx, Resident):
                ctx.park()
            self._parked[role] = ctx
        else:
            ctx.offload()

    def _unpark(self, role: str, spec: Mapping[str, Any]) -> RoleContext | None:
        """The parked context of `role` if it serves the same model with the same options, else None."""
        ctx = self._parked.pop(role, None)
        if ctx is None:
            return None
        if {k: v for k, v in ctx.spec.items() if k != "version"} == {
                k: v for k, v in spec.items() if k != "version"}:
            return ctx
        ctx.offload()
        return None

    def shift(self, cmd: ShiftCommand) -> None:
        """abort → offload → fetch → load → ready; every phase timed."""
        t = time.perf_counter()
        if self.ctx is not None:
            self.flush()  # a train replica hands in its partial gradient sum first
        self.abort(None)  # with no context, what waits in `_pending` goes back all the same
        abort_s = time.perf_counter() - t
        self.sync_now()  # hand the aborted items back now, so other replicas resume them during our load
        t = time.perf_counter()
        if self.ctx is not None:
            self._offload_or_park(self.ctx, self.role, keep=cmd.role is not None)
            self.ctx = None
        if cmd.role is None:  # going idle frees everything, parked contexts included
            for parked in self._parked.values():
                parked.offload()
            self._parked.clear()
        offload_s = time.perf_counter() - t
        fetch_s = load_s = 0.0
        ctx, warm = None, False
        if cmd.role is not None:
            ctx = self._unpark(cmd.role, cmd.spec)
            warm = ctx is not None
            t = time.perf_counter()
            if isinstance(ctx, Resident) and ctx.unpark(self.env):  # a wake-up: this shift's load
                load_s = time.perf_counter() - t
            want = cmd.spec.get("version")
            if ctx is None or want is None or ctx.version != int(want):
                if ctx is None:
                    ctx = resolve(cmd.spec.get("context") or self.contexts[cmd.role])(cmd.role, cmd.spec)
                t = time.perf_counter()
                state = ctx.fetch(self.env, want)
                fetch_s = time.perf_counter() - t
                t = time.perf_counter()
                if warm:
                    ctx.reload(self.env, state)  # the resident engine takes the new version's weights
                else:
                    ctx.load(self.env, state)
                del state
                load_s += time.perf_counter() - t
        self.ctx, self.role = ctx, cmd.role
        self._reported.clear()
        timings = ShiftTimings(abort=abort_s, offload=offload_s, fetch=fetch_s, load=load_s, warm=warm)
        self._out.shift_done = ShiftDone(cmd.id, cmd.role, cmd.from_role, timings)

    def close(self) -> None:
        """Free every context (the host is being torn down)."""
        for ctx in [self.ctx, *self._parked.values()]:
            if ctx is not None:
                with contextlib.suppress(Exception):
                    ctx.offload()
        self.ctx = None
        self._parked.clear()
