"""A run whose devices stop sending anything back says so, with what the scheduler holds and where.

Why: a driver waits on its devices in `collect`. If work is lost between the scheduler and a worker (a
mechanism bug, a worker wedged in a kernel), the run would wait in silence with a frozen progress bar. The
watch turns that into a line every `run.stall_warn_s` that says how long nothing came back, which items the
scheduler holds in which state, and what each worker serves (see docs/decisions.md, "A shifting worker is
handed no items").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class StallWatch:
    """Counts the time since the devices last sent output. Only the driver's waiting rounds count:
    `restart` after work of the driver's own (an evaluation, a checkpoint) that is nobody's stall."""

    warn_after_s: float | None  # None: never warn
    log: Callable[[str], None]
    describe: Callable[[], str]
    since: float
    warned_at: float | None = None

    def round(self, now: float, output: bool) -> bool:
        """One driver round at `now`, which did or did not bring output; True when it warned."""
        if output:
            self.restart(now)
            return False
        if self.warn_after_s is None:
            return False
        last = self.since if self.warned_at is None else self.warned_at
        if now - last < self.warn_after_s:
            return False
        self.warned_at = now
        self.log(f"no output from the devices for {now - self.since:.0f} s (run.stall_warn_s="
                 f"{self.warn_after_s:g}); {self.describe()}")
        return True

    def restart(self, now: float) -> None:
        self.since, self.warned_at = now, None


def describe_state(state: Mapping[str, Any]) -> str:
    """The scheduler's items per role and state, and each worker's role and status, in one line."""
    items = state.get("items") or {}
    held = "; ".join(f"{role}: " + ", ".join(f"{n} {st}" for st, n in sorted(counts.items()))
                     for role, counts in sorted(items.items())) or "none"
    workers = ", ".join(f"{w.get('name', addr)} {w.get('role') or 'idle'} {w.get('status', '?')}"
                        for addr, w in sorted((state.get("workers") or {}).items()))
    return f"scheduler holds {held}; workers: {workers or 'none'}"


def session_describer(session: Any) -> Callable[[], str]:
    """`describe` for a session that can report its scheduler's state (a session without one says so)."""

    def describe() -> str:
        state = getattr(session, "state", None)
        if state is None:
            return "this session reports no scheduler state"
        try:
            return describe_state(state())
        except Exception as e:  # the warning must not end a run that may still recover
            return f"scheduler state unavailable ({type(e).__name__}: {e})"

    return describe
