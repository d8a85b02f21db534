"""Facts about the machine this process runs on, read from the OS."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one), at least 1.

    Why not `os.cpu_count()`: a container or `taskset` may give the process fewer cores than the machine
    has, and workers or compile jobs sized by the machine's count would then share cores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
