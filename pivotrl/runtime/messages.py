"""The typed messages of the runtime's seams: driver ↔ scheduler extension ↔ role host.

Dask's comms carry msgpack, so every message crosses as plain data (`to_wire()`, a dict of lists and
numbers) and is rebuilt on the other side (`from_wire`, driven by the dataclass's own type hints), where a
missing, unknown or mistyped field fails loudly at the seam instead of deep inside. Payloads
(`WorkRequest.payload`) stay opaque mappings: their shape belongs to the role that reads them, as a
`Sequence.payload` belongs to its driver in core.

Who sends what:
- driver → scheduler: `WorkRequest` (new work), and gets `Collected` back (`ItemResult`, `GradResult`);
- role host → scheduler: `SyncReport` (finished items, partials of aborted ones, progress, engine steps, a
  flushed gradient sum, a finished shift with its `ShiftTimings`);
- scheduler → role host: `SyncReply` (`WorkItem`s to run, ids to abort, a `ShiftCommand`, flush or not).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any, Self, Union, get_args, get_origin, get_type_hints

from pivotrl.core.types import ShiftTimings


class ItemState(StrEnum):
    """Where a work item is. Train items pass through ACCUMULATED (in some device's local gradient sum)
    and are DONE only once that sum is flushed, so each lands in exactly one sum."""

    WAITING = "waiting"  # in core's shared queue of its role
    ASSIGNED = "assigned"  # in a worker's outbox, not yet delivered
    RUNNING = "running"  # delivered to a worker
    ACCUMULATED = "accumulated"  # train: in a worker's unflushed gradient sum
    DONE = "done"


_PLAIN = (int, float, str, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)


class WireMapping(dict):
    """An opaque mapping (a payload) as it came off the wire: plain data already, so `encode` passes it on
    as it is. Why: the scheduler hands every request's payload on to a worker; re-encoding it value by
    value cost it more than the rest of the item."""


@functools.cache
def _field_names(kind: type) -> tuple[str, ...] | None:
    return tuple(f.name for f in fields(kind)) if is_dataclass(kind) else None


def encode(value: Any) -> Any:
    """A message (or any value inside one) as msgpack-safe plain data."""
    kind = type(value)
    if kind in _PLAIN or kind is WireMapping:
        return value
    names = _field_names(kind)
    if names is not None:
        return {n: encode(getattr(value, n)) for n in names}
    if isinstance(value, (list, tuple)):
        if _PLAIN_TYPES.issuperset(map(type, value)):  # token ids, log-probs: one C-level pass
            return list(value)
        return [v if type(v) in _PLAIN else encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(hint: Any, value: Any) -> Any:
    """Plain data back into the type `hint` names (dataclasses, lists, tuples, optionals, scalars)."""
    return _decoder(hint)(value)


def _scalar(kind: type, accepted: tuple[type, ...]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, accepted):
            raise TypeError(f"expected {kind.__name__}, got {value!r}")
        return kind(value)

    return check


_SCALARS = {int: _scalar(int, (int,)), float: _scalar(float, (int, float)), str: _scalar(str, (str,)),
            bool: _scalar(bool, (bool,))}
_EXACT = {int: frozenset({int}), float: frozenset({float}), str: frozenset({str})}  # what a scalar list holds


@functools.cache
def _decoder(hint: Any) -> Callable[[Any], Any]:
    """The function that decodes a value of type `hint`, built once per type: a sync carries hundreds of
    tokens, so the type is not re-read per value."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return lambda value: value
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        inner_decode = _decoder(inner)
        return lambda value: None if value is None else inner_decode(value)
    if is_dataclass(hint):
        return lambda value: from_wire(hint, value)
    if origin in (list, tuple) and args[0] in _EXACT:  # token ids, log-probs, ids: check, do not rebuild
        exact, item, make = _EXACT[args[0]], _decoder(args[0]), origin
        return lambda value: (make(value) if exact.issuperset(map(type, value))
                              else make(item(v) for v in value))
    if origin in (list, tuple):
        item = _decoder(args[0])
        if origin is tuple:
            return lambda value: tuple(item(v) for v in value)
        return lambda value: [item(v) for v in value]
    if origin is Mapping:  # an opaque payload: its shape belongs to the role that reads it
        return WireMapping
    if origin is dict or hint is dict:
        return dict
    if hint in _SCALARS:
        return _SCALARS[hint]
    return lambda value: value


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Callable[[Any], Any]], frozenset[str]]:
    """A message class's field decoders and names, resolved once (resolving type hints costs more than
    decoding a message)."""
    hints = get_type_hints(cls)
    names = frozenset(f.name for f in fields(cls) if f.init)
    return {name: _decoder(hints[name]) for name in names}, names


def from_wire(cls: type, data: Mapping[str, Any]) -> Any:
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    decoders, known = _fields_of(cls)
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    try:
        return cls(**{k: decoders[k](v) for k, v in data.items()})
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{cls.__name__}: {exc}") from None


class Wire:
    """`to_wire()` / `from_wire()` for a message dataclass."""

    def to_wire(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Self:
        return from_wire(cls, data)


# ----------------------------------------------------------------------------------------------------
# Driver ↔ scheduler
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkRequest(Wire):
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


@dataclass
class ItemResult(Wire):
    """A finished rollout/reward item (or a finished train micro-batch item, whose result is empty):
    what the role context produced. `role`, `iteration` and `worker` are filled in by the scheduler."""

    id: str
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    role: str = ""
    iteration: int = 0
    worker: str = ""


@dataclass(frozen=True)
class GradStats(Wire):
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

    @classmethod
    def of(cls, grad_sum: Any) -> GradStats:
        """The scalars of a trainer's `GradSum` (the same field names), as plain numbers."""
        hints = get_type_hints(cls)
        return cls(**{f.name: hints[f.name](getattr(grad_sum, f.name)) for f in fields(cls)})

    def as_kwargs(self) -> dict[str, Any]:
        """The fields, for building a `GradSum` back: `GradSum(grads=..., **stats.as_kwargs())`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class GradResult(Wire):
    """A flushed local gradient sum: where it is stored (`model`, `version` in the parameter store), the
    train items it covers, its stats, and how long the flush took on the device."""

    model: str
    version: int
    items: list[str]
    stats: GradStats
    worker: str = ""
    seconds: float = 0.0


@dataclass
class Collected(Wire):
    """What the driver collects: finished items, flushed gradient sums, new log events, a state snapshot
    (events and state are for logs and dashboards: plain data)."""

    results: list[ItemResult] = field(default_factory=list)
    grads: list[GradResult] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IterationReport(Wire):
    """What the driver tells the scheduler after each iteration, for the `/metrics` exporter and the
    `/pivotrl` page's learning curve. `heldout_accuracy` (percent) is None for an iteration the driver did
    not evaluate."""

    iteration: int
    seconds: float
    reward_mean: float
    policy_version: int
    judged: int = 0
    unparseable: int = 0
    heldout_accuracy: float | None = None


# ----------------------------------------------------------------------------------------------------
# Role host ↔ scheduler
# ----------------------------------------------------------------------------------------------------


@dataclass
class WorkItem(Wire):
    """An item as a role context receives it: the request's payload and the tokens it already has.
    `attempt` counts how often it was handed out before (aborts, lost workers)."""

    id: str
    role: str
    payload: Mapping[str, Any]
    iteration: int = 0
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attempt: int = 0


@dataclass
class Partial(Wire):
    """An aborted item handed back with the tokens it had generated (it resumes from them elsewhere)."""

    id: str
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Progress(Wire):
    """Tokens `tokens` (with `logprobs`) generated from position `offset` of a running item."""

    id: str
    offset: int
    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class StepSample(Wire):
    """One engine step: `concurrency` items, `step_time_s` seconds, `tokens` of work done, of which
    `prefill_tokens` prompt tokens of sequences admitted in it. `host_s`: the role host's seconds between
    the previous step and this one while the context had work waiting (the sync round trip's stall,
    building reports, admitting items). The device pays it for every step, so core's step-time fit counts
    it; device busy time is the engine's alone."""

    concurrency: int
    step_time_s: float
    tokens: int
    prefill_tokens: int = 0
    host_s: float = 0.0


@dataclass(frozen=True)
class ShiftCommand(Wire):
    """Take up `role` (None: go idle, freeing every weight) loading `spec`; `decision` names the core
    decision that asked for it, `from_role` what the scheduler believes the device serves now."""

    id: str
    role: str | None
    spec: Mapping[str, Any]
    from_role: str | None = None
    decision: str = ""


@dataclass(frozen=True)
class ShiftDone(Wire):
    """Shift `shift_id` finished: the device now serves `role`; `timings` is what each phase took."""

    shift_id: str
    role: str | None
    from_role: str | None
    timings: ShiftTimings


@dataclass
class SyncReport(Wire):
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
    acked: int = 0  # `seq` of the last reply this host received: the ones after it were lost in transit
    # The host has no work: the scheduler may hold a reply that would carry nothing up to this long, and
    # answer as soon as there is a command (an idle host then needs no poll timer to find work)
    hold_s: float = 0.0

    def merge_back(self, later: SyncReport) -> None:
        """Put this (unsent) report's contents in front of `later`'s: nothing is lost when a sync fails."""
        later.finished[:0] = self.finished
        later.aborted[:0] = self.aborted
        later.progress[:0] = self.progress
        later.steps[:0] = self.steps
        later.flushed = later.flushed or self.flushed
        later.shift_done = later.shift_done or self.shift_done


@dataclass
class SyncReply(Wire):
    """The scheduler's commands for one role host. `unknown`: the scheduler does not know this worker (not
    joined yet, lost, or of another session): it should stand by and sync again."""

    assign: list[WorkItem] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    shift: ShiftCommand | None = None
    flush: bool = False
    unknown: bool = False
    seq: int = 0  # the reply's number (one sequence for all workers), acknowledged by `SyncReport.acked`
    held_s: float = 0.0  # how long the scheduler held it for an idle host: waiting for work, not blocked

    def empty(self) -> bool:
        """Nothing for the host to do: no items, aborts, shift, flush, and not a stand-by."""
        return not (self.assign or self.abort or self.shift is not None or self.flush or self.unknown)


