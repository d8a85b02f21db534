"""One RL iteration as a state machine over its samples: stages, streaming, the train slices.

Why a state machine rather than a loop: with bounded staleness (`run.max_staleness` k > 0) the driver keeps
up to k+1 iterations in flight on one session — iteration i+1's rollouts run on devices iteration i's tail
leaves idle — so every iteration's progress must be advanced by the results the session hands back,
whichever iteration they belong to. `Pipeline.run_iteration` drives a single one to completion (on-policy);
`pivotrl.pipeline.run_iterations` drives a window of them.

An iteration trains only when the driver allows it (`may_train`): optimizer steps are applied in iteration
order, so a gradient is always taken at the version it is applied to, and a sample's staleness is the
number of policy versions between the one that generated it and the one it trains.
"""

from __future__ import annotations

import time
from typing import Any

from pivotrl import faults
from pivotrl.runtime.messages import Collected, GradResult, ItemResult, WorkRequest

# The pipeline's `Pipeline`, `Sample` and `Stage` (not imported: pipeline imports this module).
Pipeline = Sample = Stage = Any


class IterationRun:
    """The samples of iteration `iteration` moving through `pipeline.stages`.

    The driver calls `start()`, then repeatedly hands it the session's output (`on_results`, `on_grads`),
    calls `advance()`, and sends `take_requests()` and, when `take_flush()` says so, a flush for this
    iteration. `done` once every slice of the iteration has stepped."""

    def __init__(self, pipeline: Pipeline, iteration: int, samples: list[Sample], *, may_train: bool = True):
        self.pipeline = pipeline
        self.ctx = pipeline.ctx
        self.stages = pipeline.stages
        self.iteration = iteration
        self.samples = samples
        self.may_train = may_train
        self.t0 = time.monotonic()
        self.by_uid = {s.uid: s for s in samples}
        self.at: dict[str, int] = {}  # sample → index of the stage it is in
        self.groups: dict[str, list[Sample]] = {}
        for s in samples:
            self.groups.setdefault(s.group, []).append(s)
        self.waiting_group: dict[int, dict[str, set[str]]] = {}
        self.stage_last: dict[str, float] = {}
        self.grads: list[GradResult] = []
        self._submit: list[WorkRequest] = []
        self.train_idx = len(self.stages) - 1
        self.train_stage = self.stages[self.train_idx]
        # the optimizer steps of the iteration: slice k's train items go out once slice k-1 is applied
        self.slices = pipeline.updater.slices(len(samples))
        self.slice_of = {samples[j].uid: k for k, r in enumerate(self.slices) for j in r}
        self.arrived: list[list[Sample]] = [[] for _ in self.slices]  # samples at the train stage, per slice
        self.pending: set[str] = set()  # train item ids of the current slice not yet in a flushed sum
        self.slice_grads: list[GradResult] = []
        self.trained: set[str] = set()
        self.current, self.closed, self.flush_due = 0, False, False
        self.steps: list[dict[str, Any]] = []
        self.apply_s = 0.0  # seconds the driver spent in the optimizer owner's steps (reduce, step, publish)
        # the first device stage before train (rollout): the next iteration may start once all samples left it
        self.first = next(
            (i for i, st in enumerate(self.stages[: self.train_idx]) if st.role is not None), None
        )
        self.seconds = 0.0

    # -- driver interface -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.current >= len(self.slices)

    @property
    def rollouts_done(self) -> bool:
        """Every sample has left the first device stage (its result came back, or it skipped it)."""
        return self.first is None or all(self.at.get(s.uid, -1) > self.first for s in self.samples)

    def start(self) -> None:
        for s in self.samples:
            self._enter(s, 0)
        self.advance()

    def take_requests(self) -> list[WorkRequest]:
        out, self._submit = self._submit, []
        return out

    def take_flush(self) -> bool:
        """True once: every train item of the current slice is submitted, so the sums may be handed in."""
        due, self.flush_due = self.flush_due, False
        return due

    def allow_training(self) -> None:
        """The iterations before this one have stepped: release what has arrived at the train stage."""
        if self.may_train:
            return
        self.may_train = True
        if not self.done:
            for sample in self.arrived[self.current]:
                self._release(sample)
        self.advance()

    def on_grads(self, grads: list[GradResult]) -> None:
        for g in grads:
            uids = set(g.items)
            if uids - self.pending:
                dup = uids & self.trained
                raise RuntimeError(
                    f"gradient sum over items not awaited: {sorted(uids - self.pending)[:5]}"
                    + (f" (trained twice: {sorted(dup)[:5]})" if dup else "")
                )
            self.pending.difference_update(uids)
            self.trained.update(uids)
            self.grads.append(g)
            self.slice_grads.append(g)

    def on_result(self, res: ItemResult) -> None:
        uid, _, stage_name = res.id.rpartition("/")
        sample = self.by_uid[uid]
        idx = self.at[uid]
        stage = self.stages[idx]
        if stage.name != stage_name:
            raise RuntimeError(f"result of stage {stage_name} for {uid}, which is at {stage.name}")
        stage.complete(sample, res, self.ctx)
        self.stage_last[stage.name] = time.monotonic() - self.t0
        self._enter(sample, idx + 1)

    def owns(self, item_id: str) -> bool:
        return item_id.rpartition("/")[0] in self.by_uid

    def advance(self) -> None:
        """Once every sample of the current slice is at the train stage (each was released as it arrived),
        ask for the sums; once all its train items are in flushed sums, step, and release what has arrived
        of the next slice; repeat (a slice with nothing to learn steps at once)."""
        if not self.may_train:
            return
        while self.current < len(self.slices):
            if not self.closed:
                if len(self.arrived[self.current]) < len(self.slices[self.current]):
                    return
                self.closed, self.flush_due = True, bool(self.pending)
            if self.pending:
                return
            t_apply = time.monotonic()
            version = self.pipeline.updater.apply(self.slice_grads, self.iteration)
            self.steps.append(dict(getattr(self.pipeline.updater, "last_stats", {}) or {}))
            self.apply_s += time.monotonic() - t_apply
            self.stage_last["train"] = time.monotonic() - self.t0
            if version != self.ctx.policy_version:
                self.ctx.policy_version = version
                self.pipeline.session.set_version("train", version)  # a device taking up train loads it
            self.current, self.closed, self.slice_grads = self.current + 1, False, []
            if self.current < len(self.slices):
                for sample in self.arrived[self.current]:
                    self._release(sample)
        self.seconds = time.monotonic() - self.t0

    def staleness(self) -> list[int]:
        """Per trained sample: policy versions between the one that generated it and the one it trained at."""
        return [
            s.train_version - s.rollout_version
            for s in self.samples
            if s.train_version is not None and s.rollout_version is not None
        ]

    # -- internals ----------------------------------------------------------------------------------------
    def _request(self, sample: Sample, stage: Stage, req: dict[str, Any]) -> None:
        if stage.role == "rollout" and sample.rollout_version is None:
            sample.rollout_version = int(req.get("payload", {}).get("version", self.ctx.policy_version))
        self._submit.append(
            WorkRequest(
                id=f"{sample.uid}/{stage.name}",
                role=str(stage.role),
                iteration=self.iteration,
                group_id=sample.group,
                **req,
            )
        )

    def _enter(self, sample: Sample, idx: int) -> None:
        while idx < len(self.stages):
            stage = self.stages[idx]
            self.at[sample.uid] = idx
            if idx == self.train_idx:
                k = self.slice_of[sample.uid]
                self.arrived[k].append(sample)
                if k == self.current and self.may_train:  # its slice trains at the current version now
                    self._release(sample)
                return
            if stage.role is not None:
                req = stage.request(sample, self.ctx)
                if req is None:  # this sample skips the stage
                    idx += 1
                    continue
                self._request(sample, stage, req)
                return
            if stage.per_group:
                waiting = self.waiting_group.setdefault(idx, {}).setdefault(sample.group, set())
                waiting.add(sample.uid)
                members = self.groups[sample.group]
                if len(waiting) < len(members):
                    return
                stage.run(members, self.ctx)
                self.stage_last[stage.name] = time.monotonic() - self.t0
                for m in members:
                    if m is not sample:
                        self._enter(m, idx + 1)
                idx += 1
                continue
            stage.run([sample], self.ctx)
            self.stage_last[stage.name] = time.monotonic() - self.t0
            idx += 1

    def _release(self, sample: Sample) -> None:
        req = self.train_stage.request(sample, self.ctx)  # requested now: at the version it trains on
        if req is not None:
            sample.train_version = int(self.ctx.policy_version)
            self._request(sample, self.train_stage, req)
            self.pending.add(f"{sample.uid}/{self.train_stage.name}")


def drive(session: Any, runs: list[IterationRun], poll_s: float, on_poll=None) -> Collected:
    """One round: submit what the runs want, flush where due, collect once and route the output to the run
    each result belongs to. The session holds the collect up to `poll_s` while nothing has finished, so the
    round returns as soon as output arrives (or after `poll_s`, for the caller's own checks)."""
    buf = [r for run in runs for r in run.take_requests()]
    if buf:
        session.submit(buf)
    for run in runs:
        if run.take_flush():
            session.flush(run.iteration)
    out = session.collect(wait_s=poll_s)
    if out.results or out.grads:
        faults.point("collect")  # inside an iteration: some of its work has come back
    for g in out.grads:
        if g.items:
            owner = next((run for run in runs if run.owns(g.items[0])), None)
        else:  # an empty sum: the iteration training now
            owner = next((run for run in runs if run.may_train and not run.done), None)
        if owner is None:
            raise RuntimeError(f"gradient sum over items no iteration awaits: {list(g.items)[:5]}")
        owner.on_grads([g])
    for res in out.results:
        owner = next((run for run in runs if run.owns(res.id)), None)
        if owner is None:
            raise RuntimeError(f"result {res.id} belongs to no iteration in flight")
        owner.on_result(res)
    for run in runs:
        run.advance()
    if on_poll is not None:
        on_poll(out)
    return out
