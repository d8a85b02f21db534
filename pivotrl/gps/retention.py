"""Retiring versions and sweeping what crashed writers and interrupted gc runs left behind, per tier.

A version is retired by renaming it into the model's trash (atomic on local disk, `Backend.retire_dir`), so a
reader sees it either whole or gone; the sweep deletes trash and data prefixes no committed manifest names.
"""

from __future__ import annotations

import contextlib
import os
import uuid

from pivotrl.gps import layout
from pivotrl.gps.backend import Backend, LocalBackend
from pivotrl.gps.manifest import parse_version_dir, version_dir

#: A temporary file older than this is a crashed writer's (a live writer renames it within milliseconds).
STALE_TMP_S = 60.0


def retire_version(backend: Backend, model: str, version: int) -> None:
    """Move `version` of `model` into the trash of `backend` (nothing if it is not there)."""
    path = backend.join(model, version_dir(version))
    if backend.exists(path):
        trash = backend.join(model, f".trash-{version_dir(version)}-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(FileNotFoundError):
            backend.retire_dir(path, trash, f"{path}/zarr.json")


def sweep_model(backend: Backend, model: str, now: float, stale_after_s: float) -> int:
    """Remove the leftovers of `model` in one tier; returns how many were removed.

    Never touches committed data, nor a data prefix whose writer process is still alive on this host
    (or, for another host's writer, younger than `stale_after_s`)."""
    removed = 0
    mdir = backend.join(model)
    for name in backend.list_dir(mdir):
        path = f"{mdir}/{name}"
        if name.startswith(".trash-"):
            backend.remove_tree(path)
            removed += 1
            continue
        v = parse_version_dir(name)
        if v is None:
            continue
        keep = None
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            keep = layout.read_manifest(backend, model, v).data_id
        for child in backend.list_dir(path):
            cpath = f"{path}/{child}"
            if child.startswith("d-") and child != keep:
                if not layout.writer_is_alive(child, now, backend.mtime(cpath), stale_after_s):
                    backend.remove_tree(cpath)
                    removed += 1
            elif ".tmp-" in child:
                mt = backend.mtime(cpath)
                if mt is not None and now - mt > STALE_TMP_S:
                    backend.remove_file(cpath)
                    removed += 1
        if keep is None and isinstance(backend, LocalBackend):
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only succeeds when empty: never races a writer's data
    return removed
