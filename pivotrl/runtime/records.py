"""Typed facts the `/pivotrl` page shows beside the timeline: core's shift decisions with the planner's
reasoning, iteration starts, and the driver's per-iteration reports (the learning curve).

Why typed records and not the orchestrator's event log: the event log is free-form plain data for logs;
the page needs a few exact quantities per decision (B, G, φ of the chosen candidate, the devices moved and
where from), and reading them out of nested dicts by name is how a renamed field silently shows as blank.
A record is built once, from core's own `Decision` object, where the types still hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pivotrl.core import Decision
from pivotrl.runtime.messages import IterationReport, Wire


@dataclass(frozen=True)
class MoveRecord(Wire):
    """One device of a decision: `device` (the worker's name) leaves `src` (None: it was free) for `dst`."""

    device: str
    src: str | None
    dst: str


@dataclass(frozen=True)
class DecisionRecord(Wire):
    """A decision core took that moved devices, at `t` (the orchestrator's clock, as the timeline's).

    `gain` (G), `phi` (φ) and `benefit` (B = G − φ) are the chosen candidate's, in device-seconds of work over
    the planner's horizon, and `threshold` the margin B had to clear; all None when no planner weighed the
    decision (a first placement, a static split, an operator's request), so the page can tell "not
    reasoned" from "reasoned to zero"."""

    t: float
    decision: int
    stimulus: str
    moves: tuple[MoveRecord, ...]
    dissolved: int = 0
    role: str | None = None  # the shift-up role the planner chose for
    gain: float | None = None
    phi: float | None = None
    benefit: float | None = None
    threshold: float | None = None
    candidates: int = 0

    @classmethod
    def of(cls, dec: Decision, name: Callable[[str], str] = str) -> DecisionRecord:
        """The record of `dec`; `name` turns core's device ids (worker addresses) into the names the
        timeline shows."""
        moves = tuple(
            MoveRecord(name(m.device), None if m.from_role is None else str(m.from_role), str(m.to_role))
            for s in dec.shifts for m in s.moves
        )
        r = dec.reasoning
        chosen = None if r is None else r.chosen
        return cls(
            t=round(float(dec.now), 4),
            decision=int(dec.decision_id),
            stimulus=dec.stimulus,
            moves=moves,
            dissolved=len(dec.dissolved),
            role=None if r is None else r.shift_up_role,
            gain=None if chosen is None else float(chosen.gain),
            phi=None if chosen is None else float(chosen.penalty),
            benefit=None if chosen is None else float(chosen.benefit),
            threshold=None if r is None else float(r.threshold),
            candidates=0 if r is None else len(r.candidates),
        )


@dataclass(frozen=True)
class IterationMark(Wire):
    """Iteration `iteration` began at `t` (the scheduler's `pivotrl_begin_iteration`)."""

    iteration: int
    t: float


@dataclass
class IterationEdges(Wire):
    """When, on the scheduler's clock, iteration `iteration`'s first request arrived and its last train item
    finished: the next iteration's `first_submit` minus this one's `last_train_done` is the barrier as the
    control plane runs it (flush, gradient hand-in, optimizer step, publish, the driver's bookkeeping),
    which a simulator profile needs as one cost."""

    iteration: int
    first_submit: float | None = None
    last_train_done: float | None = None


@dataclass
class PageData(Wire):
    """Everything the `/pivotrl` page renders, from one scheduler plugin."""

    timeline: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    decisions: list[DecisionRecord] = field(default_factory=list)
    iterations: list[IterationMark] = field(default_factory=list)
    reports: list[IterationReport] = field(default_factory=list)


def learning_curve(reports: list[IterationReport]) -> list[IterationReport]:
    """One report per iteration, the latest kept (a resumed run reports an iteration again), in order."""
    last = {r.iteration: r for r in reports}
    return [last[i] for i in sorted(last)]
