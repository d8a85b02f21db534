"""Leases that tell a live run from a dead one: an advisory `flock` held for the process's lifetime.

Why a lock and not a pid file: the kernel drops a `flock` when its holder dies however it dies (SIGKILL,
OOM), so "can I take the lock?" is exactly "is the owner gone?", with no pid reuse or clock to trust.

Two uses: a run directory's driver lease (a second driver may not resume a run that is still running), and
a host tier's lease (a node's `/dev/shm/pivotrl-*` tiers left by dead runs are reclaimed by the next run on
the node, so a crash never pins their RAM until reboot).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pivotrl.errors import UserError

LEASE = ".lease"


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on `path` (created if missing), or None if another
    process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def held(directory: Path, what: str) -> Iterator[None]:
    """Hold `directory`'s lease for the block; a live holder elsewhere is a user error naming `what`."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(directory / LEASE)
    if fd is None:
        raise UserError(f"{what} {directory} is in use by a live process (its lease is held)")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def reclaim_dead(parent: Path, prefix: str, keep: str | None = None) -> list[Path]:
    """Remove every `parent/prefix*` directory whose lease no live process holds (and `keep` never);
    returns what was removed. A directory without a lease file is a dead run's too."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for d in sorted(parent.glob(f"{prefix}*")):
        if not d.is_dir() or d.name == keep or d.is_symlink():
            continue
        fd = _try_lock(d / LEASE) if os.access(d, os.W_OK) else None
        if fd is None:
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        finally:
            os.close(fd)
    return removed
