"""The typed messages of the runtime's seams: driver ↔ scheduler extension ↔ role host.

Dask's comms carry msgpack, so every message crosses as plain data (`to_wire()`, a dict of lists and
numbers) and is rebuilt on the other side (`from_wire`), where a missing or mistyped field fails loudly at
the seam instead of deep inside. Payloads (`WorkRequest.payload`) stay opaque mappings: their shape belongs
to the role that reads them, as a `Sequence.payload` belongs to its driver in core.

Who sends what:
- driver → scheduler: `WorkRequest` (new work), and gets `Collected` back (`ItemResult`, `GradResult`);
- role host → scheduler: `SyncReport` (finished items, partials of aborted ones, progress, engine steps, a
  flushed gradient sum, a finished shift with its `ShiftTimings`);
- scheduler → role host: `SyncReply` (`WorkItem`s to run, ids to abort, a `ShiftCommand`, flush or not).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pivotrl.core.types import ShiftTimings


class ItemState(StrEnum):
    """Where a work item is. Train items pass through ACCUMULATED (in some device's local gradient sum)
    and are DONE only once that sum is flushed, so each lands in exactly one sum."""

    WAITING = "waiting"  # in core's shared queue of its role
    ASSIGNED = "assigned"  # in a worker's outbox, not yet delivered
    RUNNING = "running"  # delivered to a worker
    ACCUMULATED = "accumulated"  # train: in a worker's unflushed gradient sum
    DONE = "done"


def _ints(xs: Any) -> list[int]:
    return [int(x) for x in (xs or ())]


def _floats(xs: Any) -> list[float]:
    return [float(x) for x in (xs or ())]


def _opt_str(x: Any) -> str | None:
    return None if x is None else str(x)


# ----------------------------------------------------------------------------------------------------
# Driver ↔ scheduler
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkRequest:
    """New work for a role. Cost hints for core: `prompt_tokens` (prefill), `max_new_tokens` (budget),
    `est_tokens` (expected new tokens; for train, the tokens to process). `generated`/`logprobs` resume a
    partial (a sequence that already has tokens)."""

    id: str
    role: str
    payload: Mapping[str, Any]
    iteration: int = 0
    group_id: str | None = None
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    est_tokens: int = 0
    generated: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.id or not isinstance(self.id, str):
            raise ValueError(f"work request id must be a non-empty string, got {self.id!r}")
        for name in ("prompt_tokens", "max_new_tokens", "est_tokens"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"work request {self.id}: {name} must be >= 0")

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "role": self.role,
            "payload": dict(self.payload),
            "iteration": self.iteration,
            "group_id": self.group_id,
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "est_tokens": self.est_tokens,
            "generated": list(self.generated),
            "logprobs": list(self.logprobs),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> WorkRequest:
        return cls(
            id=str(d["id"]),
            role=str(d["role"]),
            payload=dict(d["payload"]),
            iteration=int(d.get("iteration", 0)),
            group_id=_opt_str(d.get("group_id")),
            prompt_tokens=int(d.get("prompt_tokens", 0)),
            max_new_tokens=int(d.get("max_new_tokens", 0)),
            est_tokens=int(d.get("est_tokens", 0)),
            generated=tuple(_ints(d.get("generated"))),
            logprobs=tuple(_floats(d.get("logprobs"))),
        )


@dataclass
class ItemResult:
    """A finished rollout/reward item (or a finished train micro-batch item, whose result is empty):
    what the role context produced. `role`, `iteration` and `worker` are filled in by the scheduler."""

    id: str
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    role: str = ""
    iteration: int = 0
    worker: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "generated": list(self.generated),
            "logprobs": list(self.logprobs),
            "finish_reason": self.finish_reason,
            "role": self.role,
            "iteration": self.iteration,
            "worker": self.worker,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ItemResult:
        return cls(
            id=str(d["id"]),
            generated=_ints(d.get("generated")),
            logprobs=_floats(d.get("logprobs")),
            finish_reason=str(d.get("finish_reason") or ""),
            role=str(d.get("role") or ""),
            iteration=int(d.get("iteration", 0)),
            worker=str(d.get("worker") or ""),
        )


@dataclass(frozen=True)
class GradStats:
    """What a local gradient sum holds besides the gradients (the trainer's `GradSum` fields)."""

    tokens: int
    samples: int
    version: int
    loss_sum: float = 0.0
    pg_sum: float = 0.0
    kl_ref_sum: float = 0.0
    kl_old_sum: float = 0.0
    clipped: int = 0
    nonfinite: bool = False

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GradStats:
        return cls(
            tokens=int(d["tokens"]),
            samples=int(d["samples"]),
            version=int(d["version"]),
            loss_sum=float(d.get("loss_sum", 0.0)),
            pg_sum=float(d.get("pg_sum", 0.0)),
            kl_ref_sum=float(d.get("kl_ref_sum", 0.0)),
            kl_old_sum=float(d.get("kl_old_sum", 0.0)),
            clipped=int(d.get("clipped", 0)),
            nonfinite=bool(d.get("nonfinite", False)),
        )


@dataclass
class GradResult:
    """A flushed local gradient sum: where it is stored (`model`, `version` in the parameter store), the
    train items it covers, its stats, and how long the flush took on the device."""

    model: str
    version: int
    items: list[str]
    stats: GradStats
    worker: str = ""
    seconds: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "items": list(self.items),
            "stats": self.stats.to_wire(),
            "worker": self.worker,
            "seconds": self.seconds,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GradResult:
        return cls(
            model=str(d["model"]),
            version=int(d["version"]),
            items=[str(i) for i in d.get("items", ())],
            stats=GradStats.from_wire(d["stats"]),
            worker=str(d.get("worker") or ""),
            seconds=float(d.get("seconds", 0.0)),
        )


@dataclass
class Collected:
    """What the driver collects: finished items, flushed gradient sums, new log events, a state snapshot
    (events and state are for logs and dashboards: plain data)."""

    results: list[ItemResult] = field(default_factory=list)
    grads: list[GradResult] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "results": [r.to_wire() for r in self.results],
            "grads": [g.to_wire() for g in self.grads],
            "events": list(self.events),
            "state": self.state,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Collected:
        return cls(
            results=[ItemResult.from_wire(r) for r in d.get("results", ())],
            grads=[GradResult.from_wire(g) for g in d.get("grads", ())],
            events=list(d.get("events", ())),
            state=dict(d.get("state") or {}),
        )


# ----------------------------------------------------------------------------------------------------
# Role host ↔ scheduler
# ----------------------------------------------------------------------------------------------------


@dataclass
class WorkItem:
    """An item as a role context receives it: the request's payload and the tokens it already has.
    `attempt` counts how often it was handed out before (aborts, lost workers)."""

    id: str
    role: str
    payload: Mapping[str, Any]
    iteration: int = 0
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attempt: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "role": self.role,
            "payload": dict(self.payload),
            "iteration": self.iteration,
            "generated": list(self.generated),
            "logprobs": list(self.logprobs),
            "attempt": self.attempt,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> WorkItem:
        return cls(
            id=str(d["id"]),
            role=str(d["role"]),
            payload=dict(d["payload"]),
            iteration=int(d.get("iteration", 0)),
            generated=_ints(d.get("generated")),
            logprobs=_floats(d.get("logprobs")),
            attempt=int(d.get("attempt", 0)),
        )


@dataclass
class Partial:
    """An aborted item handed back with the tokens it had generated (it resumes from them elsewhere)."""

    id: str
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "generated": list(self.generated), "logprobs": list(self.logprobs)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Partial:
        return cls(str(d["id"]), _ints(d.get("generated")), _floats(d.get("logprobs")))


@dataclass
class Progress:
    """Tokens `tokens` (with `logprobs`) generated from position `offset` of a running item."""

    id: str
    offset: int
    tokens: list[int]
    logprobs: list[float]

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "offset": self.offset, "tokens": list(self.tokens),
                "logprobs": list(self.logprobs)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Progress:
        return cls(str(d["id"]), int(d["offset"]), _ints(d.get("tokens")), _floats(d.get("logprobs")))


@dataclass(frozen=True)
class StepSample:
    """One engine step: `concurrency` items, `step_time_s` seconds, `tokens` of work done."""

    concurrency: int
    step_time_s: float
    tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "step_time_s": self.step_time_s, "tokens": self.tokens}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StepSample:
        return cls(int(d["concurrency"]), float(d["step_time_s"]), int(d["tokens"]))


def timings_to_wire(t: ShiftTimings) -> dict[str, Any]:
    return {**t.phases(), "warm": t.warm}


def timings_from_wire(d: Mapping[str, Any]) -> ShiftTimings:
    unknown = set(d) - {*ShiftTimings.PHASES, "warm"}
    if unknown:
        raise ValueError(f"unknown shift phase(s) {sorted(unknown)}; phases are {ShiftTimings.PHASES}")
    return ShiftTimings(**{k: float(d[k]) for k in ShiftTimings.PHASES if k in d}, warm=bool(d.get("warm")))


@dataclass(frozen=True)
class ShiftCommand:
    """Take up `role` (None: go idle, freeing every weight) loading `spec`; `decision` names the core
    decision that asked for it, `from_role` what the scheduler believes the device serves now."""

    id: str
    role: str | None
    spec: Mapping[str, Any]
    from_role: str | None = None
    decision: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "role": self.role, "spec": dict(self.spec), "from_role": self.from_role,
                "decision": self.decision}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ShiftCommand:
        return cls(str(d["id"]), _opt_str(d.get("role")), dict(d.get("spec") or {}),
                   _opt_str(d.get("from_role")), str(d.get("decision") or ""))


@dataclass(frozen=True)
class ShiftDone:
    """Shift `shift_id` finished: the device now serves `role`; `timings` is what each phase took."""

    shift_id: str
    role: str | None
    from_role: str | None
    timings: ShiftTimings

    def to_wire(self) -> dict[str, Any]:
        return {"shift_id": self.shift_id, "role": self.role, "from_role": self.from_role,
                "timings": timings_to_wire(self.timings)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ShiftDone:
        return cls(str(d["shift_id"]), _opt_str(d.get("role")), _opt_str(d.get("from_role")),
                   timings_from_wire(d.get("timings") or {}))


@dataclass
class SyncReport:
    """Everything a role host has to say since its last sync, and how many more items it can take."""

    worker: str
    session: str = ""
    free: int = 0
    sync_s: float = 0.0  # cumulative wall time the role host spent blocked on syncs
    finished: list[ItemResult] = field(default_factory=list)
    aborted: list[Partial] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    steps: list[StepSample] = field(default_factory=list)
    flushed: GradResult | None = None
    shift_done: ShiftDone | None = None

    def empty(self) -> bool:
        return not (self.finished or self.aborted or self.progress or self.steps or self.flushed
                    or self.shift_done)

    def to_wire(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "session": self.session,
            "free": self.free,
            "sync_s": self.sync_s,
            "finished": [r.to_wire() for r in self.finished],
            "aborted": [p.to_wire() for p in self.aborted],
            "progress": [p.to_wire() for p in self.progress],
            "steps": [s.to_wire() for s in self.steps],
            "flushed": None if self.flushed is None else self.flushed.to_wire(),
            "shift_done": None if self.shift_done is None else self.shift_done.to_wire(),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SyncReport:
        return cls(
            worker=str(d["worker"]),
            session=str(d.get("session") or ""),
            free=int(d.get("free", 0)),
            sync_s=float(d.get("sync_s", 0.0)),
            finished=[ItemResult.from_wire(r) for r in d.get("finished") or ()],
            aborted=[Partial.from_wire(p) for p in d.get("aborted") or ()],
            progress=[Progress.from_wire(p) for p in d.get("progress") or ()],
            steps=[StepSample.from_wire(s) for s in d.get("steps") or ()],
            flushed=None if d.get("flushed") is None else GradResult.from_wire(d["flushed"]),
            shift_done=None if d.get("shift_done") is None else ShiftDone.from_wire(d["shift_done"]),
        )

    def merge_back(self, later: SyncReport) -> None:
        """Put this (unsent) report's contents in front of `later`'s: nothing is lost when a sync fails."""
        later.finished[:0] = self.finished
        later.aborted[:0] = self.aborted
        later.progress[:0] = self.progress
        later.steps[:0] = self.steps
        later.flushed = later.flushed or self.flushed
        later.shift_done = later.shift_done or self.shift_done


@dataclass
class SyncReply:
    """The scheduler's commands for one role host. `unknown`: the scheduler does not know this worker (not
    joined yet, lost, or of another session): it should stand by and sync again."""

    assign: list[WorkItem] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    shift: ShiftCommand | None = None
    flush: bool = False
    unknown: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "assign": [w.to_wire() for w in self.assign],
            "abort": list(self.abort),
            "shift": None if self.shift is None else self.shift.to_wire(),
            "flush": self.flush,
            "unknown": self.unknown,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SyncReply:
        return cls(
            assign=[WorkItem.from_wire(w) for w in d.get("assign") or ()],
            abort=[str(i) for i in d.get("abort") or ()],
            shift=None if d.get("shift") is None else ShiftCommand.from_wire(d["shift"]),
            flush=bool(d.get("flush")),
            unknown=bool(d.get("unknown")),
        )
