"""Making a write survive a crash of the whole machine, not only of the process: the one helper the
parameter store's local backend and the run checkpoints share."""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that names created or renamed in it (a commit point) are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
