"""The bootstrap's progress display: one line per model (steps, loss, ETA) on stderr.

Why a board in the parent: the two models train in two processes at once, and two processes rewriting
one terminal line each would overwrite each other. Each trainer sends ``(role, done, total, loss)`` to
the parent (a queue across processes, a plain call in one), and only the parent draws. On a terminal the
lines are redrawn in place (cursor up, rewrite); to a file or pipe (CI logs) a line per model is printed
every ``every_s`` seconds and when it finishes, so a log stays short.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass
class ModelProgress:
    """Where one model's SFT stands."""

    role: str
    done: int = 0
    total: int = 0
    loss: float = float("nan")
    started: float = field(default_factory=time.perf_counter)
    first: tuple[float, int] | None = None  # (when, steps done) of its first report: the rate starts there

    def eta_s(self, now: float) -> float | None:
        """Seconds left at the rate since the first report (None until two reports: the first step's
        time includes start-up, not only training)."""
        if self.first is None or self.done <= self.first[1] or self.total <= 0:
            return None
        return (now - self.first[0]) / (self.done - self.first[1]) * (self.total - self.done)

    def line(self, now: float, width: int = 24) -> str:
        frac = self.done / self.total if self.total else 0.0
        bar = "#" * round(frac * width)
        eta = self.eta_s(now)
        tail = "done" if self.total and self.done >= self.total else f"ETA {_clock(eta)}"
        return (
            f"bootstrap {self.role:<6} [{bar:<{width}}] {self.done}/{self.total} steps "
            f"loss {self.loss:.3f} {_clock(now - self.started)} elapsed, {tail}"
        )


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = max(0, round(seconds))
    return f"{s // 60:d}:{s % 60:02d}"


class Board:
    """Draws every model's `ModelProgress` on `stream` (stderr by default); see the module docstring."""

    def __init__(
        self, roles: list[str], stream: TextIO | None = None, tty: bool | None = None, every_s: float = 10.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.every_s = every_s
        self.models = {r: ModelProgress(r) for r in roles}
        self._drawn = 0  # lines drawn last time (TTY)
        self._printed: dict[str, float] = {}  # role -> when its last line was printed (not a TTY)

    def update(self, role: str, done: int, total: int, loss: float) -> None:
        m = self.models.setdefault(role, ModelProgress(role))
        if m.first is None:
            m.first = (time.perf_counter(), done)
        m.done, m.total, m.loss = done, total, loss
        self.draw(role)

    def draw(self, role: str | None = None) -> None:
        now = time.perf_counter()
        if self.tty:
            up = f"\x1b[{self._drawn}F" if self._drawn else ""
            lines = [m.line(now) for m in self.models.values()]
            self.stream.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
            self._drawn = len(lines)
        else:
            for m in self.models.values():
                if role is not None and m.role != role:
                    continue
                finished = m.total and m.done >= m.total
                if finished or now - self._printed.get(m.role, -1e9) >= self.every_s:
                    if self._printed.get(m.role) == float("inf"):
                        continue  # its "done" line is out already
                    self.stream.write(m.line(now) + "\n")
                    self._printed[m.role] = float("inf") if finished else now
        self.stream.flush()


def reporter(send: Callable[[tuple[str, int, int, float]], Any], role: str, every_s: float = 0.25):
    """A `bootstrap.sft` progress callback for `role` that passes at most one update per `every_s` (and
    always the last step) to `send`: a queue's `put` across processes, or a `Board.update` wrapper."""
    last = [-1e9]

    def report(done: int, total: int, loss: float) -> None:
        now = time.perf_counter()
        if done >= total or now - last[0] >= every_s:
            last[0] = now
            send((role, done, total, loss))

    return report
