"""The role host of one device: a `WorkerPlugin` running the current role's engine loop in a thread.

Why a thread: generation and training steps are long, blocking torch calls; run on the worker's event loop
they would stall heartbeats and comms. The thread talks to the scheduler extension through the worker's own
RPC pool (`worker.scheduler.pivotrl_sync`), scheduled onto the worker's event loop.

One loop iteration: sync (push finished/aborted items, progress, step samples; pull commands) → apply
commands (shift, abort, flush, new items) → one engine step. A shift is the same code path for every pair
of roles:  abort → offload → fetch (from the Global Parameter Storage) → load → ready, each phase timed and
reported with `shift_done` (those timings feed the planner's shift-cost model, φ).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import threading
import time
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from pivotrl.runtime.messages import WorkItem

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


class WorkerEnv:
    """What a role context may use on this device: the device name, the parameter store, torch threads."""

    def __init__(self, device: str, gps_options: dict[str, Any] | None, storage_root: str) -> None:
        self.device = device
        self.gps_options = dict(gps_options or {})
        self.storage_root = storage_root
        self._gps: Any = None
        self.name = ""

    @property
    def gps(self) -> Any:
        if self._gps is None:
            from pivotrl.gps import ParameterStore

            opts = dict(self.gps_options)
            root = opts.pop("root", None) or os.path.join(self.storage_root, "gps")
            self._gps = ParameterStore(root, device=self.device, **opts)
        return self._gps


class PivotWorkerPlugin(WorkerPlugin):
    """Register with `client.register_plugin(PivotWorkerPlugin(...))` after the scheduler plugin."""

    name = "pivotrl"

    def __init__(
        self,
        *,
        torch_threads: int = 1,
        pin_cores: bool = True,
        device: str = "cpu",
        gps: dict[str, Any] | None = None,
        storage_root: str = "storage",
        idle_poll_s: float = 0.02,
        progress_every_s: float = 0.5,
        sync_every_s: float = 0.01,
        contexts: dict[str, str] | None = None,
        session: str = "",
        park_contexts: bool | None = None,
    ) -> None:
        self.session = session
        self.torch_threads = torch_threads
        self.pin_cores = pin_cores
        self.device = device
        self.gps_options = gps
        self.storage_root = storage_root
        self.idle_poll_s = idle_poll_s
        self.progress_every_s = progress_every_s
        # While the engine streams, sync at most this often (a command or a finished item waits at most
        # this long); shift/flush/abort results and an idle engine sync at once. Measured on the debug
        # models: a round trip costs ~0.5-1 ms of the device's CPU (serialising, the comm, the reply), so
        # syncing after every 3 ms step took ~10 % of the device.
        self.sync_every_s = sync_every_s
        self.contexts = {**DEFAULT_CONTEXTS, **(contexts or {})}
        # Keep the built context of a role the device leaves ("parked", like vLLM's sleep mode) so shifting
        # back skips building the model and engine: default on CPU, where device memory is host memory.
        self.park_contexts = park_contexts

    # -- lifecycle ------------------------------------------------------------------------------------
    def setup(self, worker: Any) -> None:
        from pivotrl.malloc import keep_freed_memory

        self.worker = worker
        keep_freed_memory()  # before the first engine step: see pivotrl/malloc.py
        self.pinned = False
        if self.pin_cores:
            try:
                core = int(worker.name)
            except (TypeError, ValueError):
                core = abs(hash(str(worker.name)))
            self.pinned = pin_process_to_core(core)
        device = self.device
        if device == "cuda":  # dask-cuda sets CUDA_VISIBLE_DEVICES so that this worker sees one GPU first
            device = "cuda:0"
        self.env = WorkerEnv(device, self.gps_options, self.storage_root)
        self.env.name = str(worker.name)
        self.ctx: Any = None
        self.role: str | None = None
        self._stop = threading.Event()
        self._out: dict[str, Any] = self._empty_out()
        self._reported: dict[str, int] = {}
        self._pending: list[dict[str, Any]] = []
        self._last_progress = 0.0
        self._last_sync = 0.0
        self._sync_s = 0.0  # wall time this loop spent blocked on `pivotrl_sync` (reported, cumulative)
        self.shift_log: list[dict[str, Any]] = []
        self._parked: dict[str, Any] = {}  # role → context kept resident while serving another role
        self._park = self.park_contexts if self.park_contexts is not None else device == "cpu"
        self._thread = threading.Thread(target=self._run, name="pivotrl-role-host", daemon=True)
        self._thread.start()

    async def teardown(self, worker: Any) -> None:
        # the loop thread may be waiting on this event loop (a sync): join it without blocking the loop
        self._stop.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30)
        for ctx in [self.ctx, *self._parked.values()]:
            if ctx is not None:
                with contextlib.suppress(Exception):
                    ctx.offload()
        self.ctx = None
        self._parked.clear()

    @staticmethod
    def _empty_out() -> dict[str, Any]:
        return {
            "finished": [],
            "aborted": [],
            "progress": {},
            "steps": [],
            "flushed": None,
            "shift_done": None,
        }

    # -- talking to the scheduler ---------------------------------------------------------------------
    def _send_sync(self) -> tuple[Any, dict[str, Any], float]:
        """Start one `pivotrl_sync` round trip on the worker's event loop; returns (future, what it
        carries, start time). The caller steps the engine while the reply is on its way."""
        out, self._out = self._out, self._empty_out()
        free = 0
        if self.ctx is not None:
            free = max(0, int(self.ctx.free_slots()) - len(self._pending))
        t0 = self._last_sync = time.perf_counter()
        coro = self.worker.scheduler.pivotrl_sync(
            worker=self.worker.address, free=free, session=self.session, sync_s=self._sync_s, **out
        )
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop), out, t0

    def _await_sync(self, fut: Any, out: dict[str, Any], t0: float) -> dict[str, Any]:
        """The reply of a sync started by `_send_sync`; the time spent blocked on it is accounted."""
        t_wait = time.perf_counter()
        try:
            return fut.result(timeout=60)
        except Exception:
            # scheduler unreachable or closing: keep what we had so nothing is lost, report it next time
            for key in ("finished", "aborted", "steps"):
                self._out[key] = out[key] + self._out[key]
            self._out["progress"] = {**out["progress"], **self._out["progress"]}
            self._out["flushed"] = self._out["flushed"] or out["flushed"]
            self._out["shift_done"] = self._out["shift_done"] or out["shift_done"]
            raise
        finally:
            self._sync_s += time.perf_counter() - t_wait

    def _sync(self) -> dict[str, Any]:
        """One blocking round trip (used where nothing can overlap it)."""
        return self._await_sync(*self._send_sync())

    # -- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.torch_threads)
        if self.pin_cores and self.pinned:
            with contextlib.suppress(Exception):
                pin_process_to_core(int(self.worker.name))
        for path in set(self.contexts.values()):  # import role code now, so shift timings measure shifting
            with contextlib.suppress(Exception):
                resolve(path)
        with contextlib.suppress(Exception):
            import pivotrl.engines.generation
            import pivotrl.engines.trainer
            import pivotrl.gps  # noqa: F401
        while not self._stop.is_set():
            if not self._sync_due():
                try:
                    self._step()
                    continue
                except Exception:
                    logger.exception("pivotrl role host failed stepping its %s context", self.role)
            # Overlap the round trip with compute: the engine steps on the work it already holds while the
            # sync (carrying the previous steps' results) is in flight, and the reply's commands apply
            # after that step (one step of command latency, as before; the wait no longer idles the device).
            try:
                fut, out, t0 = self._send_sync()
            except Exception:
                logger.info("pivotrl sync could not start; retrying", exc_info=True)
                self._stop.wait(0.2)
                continue
            stepped = False
            try:
                stepped = self._step()
            except Exception:
                logger.exception("pivotrl role host failed stepping its %s context", self.role)
            try:
                reply = self._await_sync(fut, out, t0)
            except Exception:
                if self._stop.is_set():
                    break
                logger.info("pivotrl sync failed; retrying", exc_info=True)
                time.sleep(0.2)
                continue
            try:
                busy = self._apply(reply)
            except Exception:
                logger.exception(
                    "pivotrl role host failed applying %s", {k: v for k, v in reply.items() if k != "assign"}
                )
                busy = False
            if not (busy or stepped):
                self._stop.wait(self.idle_poll_s)

    def _sync_due(self) -> bool:
        """Sync now? Always when the engine has nothing to step or a shift, flush or abort result waits;
        otherwise once `sync_every_s` has passed since the last one."""
        out = self._out
        if self.ctx is None or not self.ctx.has_work():
            return True
        if out["shift_done"] is not None or out["flushed"] is not None or out["aborted"]:
            return True
        return time.perf_counter() - self._last_sync >= self.sync_every_s

    def _apply(self, reply: dict[str, Any]) -> bool:
        if reply.get("unknown"):
            return False
        if reply.get("shift"):
            self._shift(reply["shift"])
            return True
        if reply.get("abort") and self.ctx is not None:
            self._abort(reply["abort"])
        if reply.get("flush") and self.ctx is not None:
            self._flush()
        self._pending.extend(reply.get("assign") or ())
        if self.ctx is None:
            return False
        self._admit()
        return bool(self.ctx.has_work() or self._pending)

    def _step(self) -> bool:
        """One engine step of the current context, if it has work; its results go out with the next sync."""
        if self.ctx is None or not self.ctx.has_work():
            return False
        finished, sample = self.ctx.step()
        if sample is not None:
            self._out["steps"].append([sample.concurrency, sample.step_time_s, sample.tokens])
        for res in finished:
            self._reported.pop(res.id, None)
            w = res.to_wire()  # role/iteration/worker are the scheduler's to fill in: not sent
            self._out["finished"].append({k: w[k] for k in ("id", "generated", "logprobs", "finish_reason")})
        if time.perf_counter() - self._last_progress >= self.progress_every_s:
            self._report_progress()
        return True

    def _offload_or_park(self, ctx: Any, role: str | None, keep: bool) -> None:
        """Free the context, or keep it resident for a later shift back (one per role)."""
        parkable = getattr(ctx, "parkable", None)
        if self._park and keep and role is not None and parkable is not None and parkable():
            old = self._parked.pop(role, None)
            if old is not None and old is not ctx:
                old.offload()
            self._parked[role] = ctx
        else:
            ctx.offload()

    def _unpark(self, role: str, spec: dict[str, Any]) -> Any:
        """The parked context of `role` if it serves the same model with the same options, else None."""
        ctx = self._parked.pop(role, None)
        if ctx is None:
            return None
        same = {k: v for k, v in ctx.spec.items() if k != "version"} == {
            k: v for k, v in spec.items() if k != "version"
        }
        if same:
            return ctx
        ctx.offload()
        return None

    def _flush(self) -> None:
        """Publish the context's local gradient sum (train), timed: device time the scheduler counts."""
        t0 = time.perf_counter()
        flushed = self.ctx.flush()
        if flushed is not None:
            ref = {"model": flushed.model, "version": flushed.version}  # the scheduler reads "ref"
            self._out["flushed"] = {**flushed.to_wire(), "ref": ref, "seconds": time.perf_counter() - t0}

    def _admit(self) -> None:
        """Hand pending items to the context; an item that needs another weights version waits until the
        context drains, then the context moves to that version (rollout replicas following the policy)."""
        keep: list[dict[str, Any]] = []
        for item in self._pending:
            want = item["payload"].get("version")
            if want is not None and want != self.ctx.version:
                if self.ctx.has_work():
                    keep.append(item)
                    continue
                t0 = time.perf_counter()
                self.ctx.set_version(self.env, int(want))
                self.shift_log.append(
                    {
                        "kind": "version",
                        "role": self.role,
                        "version": int(want),
                        "seconds": time.perf_counter() - t0,
                    }
                )
            self.ctx.add(WorkItem.from_wire(item))
            self._reported[item["id"]] = len(item.get("generated", ()))
        self._pending = keep

    def _report_progress(self) -> None:
        self._last_progress = time.perf_counter()
        for item_id, (toks, lps) in self.ctx.progress().items():
            start = self._reported.get(item_id)
            if start is None or len(toks) <= start:
                continue
            self._out["progress"][item_id] = [start, list(toks[start:]), list(lps[start:])]
            self._reported[item_id] = len(toks)

    def _abort(self, ids: list[str] | None) -> None:
        pending_ids = {p["id"] for p in self._pending}
        wanted = None if ids is None else set(ids)
        back = [p for p in self._pending if wanted is None or p["id"] in wanted]
        self._pending = [p for p in self._pending if p not in back]
        parts = self.ctx.abort(None if ids is None else [i for i in ids if i not in pending_ids])
        parts = [p.to_wire() for p in parts]
        for res in back:
            self._out["aborted"].append(
                {"id": res["id"], "generated": res.get("generated", []), "logprobs": res.get("logprobs", [])}
            )
        for res in parts:
            self._reported.pop(res["id"], None)
            self._out["aborted"].append(res)

    def _shift(self, cmd: dict[str, Any]) -> None:
        """abort → offload → fetch → load → ready; every phase timed."""
        timings: dict[str, float] = {}
        t_start = time.perf_counter()
        t = t_start
        if self.ctx is not None:
            self._flush()  # a train replica hands in its partial gradient sum first
            self._abort(None)
        else:
            self._pending.clear()
        timings["abort"] = time.perf_counter() - t
        self._sync()  # hand the aborted sequences back now, so other replicas resume them during our load
        t = time.perf_counter()
        if self.ctx is not None:
            self._offload_or_park(self.ctx, self.role, keep=cmd["role"] is not None)
            self.ctx = None
        if cmd["role"] is None:  # going idle frees everything, parked contexts included
            for parked in self._parked.values():
                parked.offload()
            self._parked.clear()
        timings["offload"] = time.perf_counter() - t
        spec = cmd["spec"]
        ctx = None
        timings["fetch"] = timings["load"] = 0.0
        if cmd["role"] is not None:  # role None: the device only goes idle (its weights freed)
            ctx = self._unpark(cmd["role"], spec)
            timings["warm"] = 0.0 if ctx is None else 1.0
            want = spec.get("version")
            if ctx is None or want is None or ctx.version != int(want):
                if ctx is None:
                    cls = resolve(spec.get("context") or self.contexts[cmd["role"]])
                    ctx = cls(cmd["role"], spec)
                t = time.perf_counter()
                state = ctx.fetch(self.env, want)
                timings["fetch"] = time.perf_counter() - t
                t = time.perf_counter()
                if timings["warm"]:
                    ctx.reload(self.env, state)  # the resident engine takes the new version's weights
                else:
                    ctx.load(self.env, state)
                del state
                timings["load"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t_start
        self.ctx, self.role = ctx, cmd["role"]
        self._reported.clear()
        record = {"id": cmd["id"], "role": cmd["role"], "from": cmd.get("from"), "timings": timings}
        self.shift_log.append(record)
        self._out["shift_done"] = record
