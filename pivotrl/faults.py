"""Named fault points for crash tests: `PIVOTRL_KILL_AT=NAME:N` SIGKILLs this process the N-th time it
reaches point NAME (1-based).

Why: a resume that is only tested by killing at random wall-clock moments mostly tests the quiet moments.
The points sit where a crash is most likely to tear state — inside the optimizer step, between publishing a
version and making it durable, halfway through writing a checkpoint — so the tests can aim at them, and the
random kills cover the rest. Unset (always, outside tests), a point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "PIVOTRL_KILL_AT"
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """Die here if `PIVOTRL_KILL_AT` names this point and this is its N-th visit."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
