"""A session executed in this process: one role context per role, stepped round-robin, no Dask.

Why: the single-process run must be the distributed recipe, not a second implementation of it. This
session offers what `pivotrl.runtime.session.RuntimeSession` offers the pipeline (`submit`, `collect`,
`flush`, `begin_iteration`, `set_version`, `state`) over the very role contexts a Dask worker hosts
(`pivotrl.runtime.role_host.DEFAULT_CONTEXTS`, built from the driver's `worker_role_specs`), with a real
`ParameterStore` between the optimizer owner and the contexts. So a `Pipeline` over it computes what a
one-device runtime computes; only the placement and interleaving of work differ.

Like a role host it admits an item only at the weights version the item asks for (moving the context when
it has drained), and like the scheduler extension it hands a train context's gradient sum in (`flush`) once
every train item asked for is in it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pivotrl.core import IterationPlan
from pivotrl.runtime.messages import Collected, GradResult, ItemResult, WorkItem, WorkRequest
from pivotrl.runtime.role_host import DEFAULT_CONTEXTS, WorkerEnv, resolve

WORKER = "local"


class LocalSession:
    def __init__(
        self,
        role_specs: Mapping[str, Mapping[str, Any]],
        env: WorkerEnv,
        contexts: Mapping[str, str] | None = None,
    ) -> None:
        self.role_specs = {role: dict(spec) for role, spec in role_specs.items()}
        self.env = env
        self.paths = {**DEFAULT_CONTEXTS, **(contexts or {})}
        self.ctxs: dict[str, Any] = {}
        self.pending: dict[str, list[WorkItem]] = {role: [] for role in self.role_specs}
        self.results: list[ItemResult] = []
        self.grads: list[GradResult] = []
        self.flush_upto = -1
        self.iteration_of: dict[str, int] = {}  # item id → its iteration (results carry it back)
        self.tokens: dict[str, int] = {}
        self.busy: dict[str, float] = {}
        self.events: list[dict[str, Any]] = []
        self.plans: list[IterationPlan] = []
        self.t0 = time.monotonic()

    # -- the session interface ------------------------------------------------------------------------
    def submit(self, requests: list[WorkRequest]) -> int:
        for r in requests:
            if r.role not in self.pending:
                raise ValueError(f"work request {r.id}: no role {r.role!r} in this session")
            self.pending[r.role].append(
                WorkItem(
                    id=r.id,
                    role=r.role,
                    payload=dict(r.payload),
                    iteration=r.iteration,
                    generated=list(r.generated),
                    logprobs=list(r.logprobs),
                )
            )
            if r.role != "train":
                self.iteration_of[r.id] = r.iteration
        return len(requests)

    def collect(self, wait_s: float = 0.0) -> Collected:
        """Step every role with work, round-robin, until something finished or nothing is left to do (this
        process does the work, so there is nothing to wait for: `wait_s` is the sessions' common form)."""
        while not (self.results or self.grads):
            stepped = False
            for role in self.pending:
                stepped |= self._step(role)
            self._maybe_flush()
            if not stepped:
                break
        out = Collected(self.results, self.grads, self.events, self.state())
        self.results, self.grads, self.events = [], [], []
        return out

    def flush(self, iteration: int) -> None:
        self.flush_upto = max(self.flush_upto, int(iteration))
        self._maybe_flush()

    def begin_iteration(self, plan: IterationPlan) -> None:
        self.plans.append(plan)  # one device serves every role: there is nothing to plan

    def report(self, report: Any) -> None:
        """No scheduler to export metrics from: one process, watched through its own log."""

    def set_version(self, role: str, version: int) -> None:
        """The version a context of `role` is built at; items name the version they need themselves."""
        self.role_specs[role]["version"] = int(version)

    def state(self) -> dict[str, Any]:
        """A scheduler-state-shaped snapshot (one device, `local`, serving every role) for the meter."""
        return {
            "t": time.monotonic() - self.t0,
            "workers": {
                WORKER: {
                    "name": WORKER,
                    "role": "local",
                    "status": "ready",
                    "busy": dict(self.busy),
                    "sync_s": 0.0,
                    "shifting_s": 0.0,
                }
            },
            "tokens": dict(self.tokens),
            "plan_s": 0.0,
            "plans": len(self.plans),
        }

    def metrics(self) -> dict[str, Any]:
        return {"timeline": [], "events": []}

    def close(self) -> None:
        for ctx in self.ctxs.values():
            ctx.offload()
        self.ctxs.clear()

    # -- executing ------------------------------------------------------------------------------------
    def context(self, role: str) -> Any:
        """The role's context, built (fetch → load from the parameter store) on first use."""
        ctx = self.ctxs.get(role)
        if ctx is None:
            spec = self.role_specs[role]
            ctx = resolve(spec.get("context") or self.paths[role])(role, spec)
            ctx.load(self.env, ctx.fetch(self.env, spec.get("version")))
            self.ctxs[role] = ctx
        return ctx

    def _admit(self, role: str, ctx: Any) -> None:
        """Hand pending items to the context in order, as far as it has room; an item at another weights
        version waits until the context drains, then the context moves to that version."""
        queue = self.pending[role]
        while queue and ctx.free_slots() > 0:
            want = queue[0].payload.get("version")
            if want is not None and int(want) != ctx.version:
                if ctx.has_work():
                    return
                ctx.set_version(self.env, int(want))
            ctx.add(queue.pop(0))

    def _step(self, role: str) -> bool:
        if not (self.pending[role] or (role in self.ctxs and self.ctxs[role].has_work())):
            return False
        ctx = self.context(role)
        self._admit(role, ctx)
        if not ctx.has_work():
            return False
        t0 = time.perf_counter()
        finished, sample = ctx.step()
        self.busy[role] = self.busy.get(role, 0.0) + time.perf_counter() - t0
        if sample is not None:
            self.tokens[role] = self.tokens.get(role, 0) + int(sample.tokens)
        if role != "train":  # a train item is done once its gradient sum is handed in
            for res in finished:
                res.role, res.worker = role, WORKER
                res.iteration = self.iteration_of.pop(res.id, 0)
                self.results.append(res)
        return True

    def _maybe_flush(self) -> None:
        """Hand the train context's sum in once every train item of the flushed iterations is in it."""
        if self.flush_upto < 0 or "train" not in self.ctxs:
            return
        ctx = self.ctxs["train"]
        if self.pending["train"] or ctx.has_work():
            return
        t0 = time.perf_counter()
        g = ctx.flush()
        if g is None:
            return
        g.worker, g.seconds = WORKER, time.perf_counter() - t0
        self.busy["flush"] = self.busy.get("flush", 0.0) + g.seconds
        self.grads.append(g)
