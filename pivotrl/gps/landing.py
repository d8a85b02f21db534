"""Landing a pulled version in a local tier as its bytes arrive, visible only once all of it is verified.

Why: a peer pull that first assembles the version in memory and then writes it (`write_version`) passes
over every byte twice on the critical path; writing each range into its chunk file as it lands (`pwrite`
from the buffer it was just copied into, on the same I/O thread, while other ranges are in flight) folds
the write into the transfer. The commit rule is the store's: the data go under a fresh writer-unique
prefix, the manifest is created exclusively last, and a pull that fails (lost holders, bad checksums)
removes its prefix; a process killed mid-pull leaves an uncommitted prefix that `sweep` removes.
"""

from __future__ import annotations

import contextlib
import os

from pivotrl.gps import layout
from pivotrl.gps.backend import LocalBackend
from pivotrl.gps.manifest import Manifest, version_dir


class Landing:
    """The chunk files of one version in `backend`, written range by range (chunk files are pre-sized to
    their full length, so a zarr reader sees the same zero padding `write_version` writes)."""

    def __init__(self, backend: LocalBackend, manifest: Manifest) -> None:
        self.backend = backend
        self.manifest = manifest
        self.data_id = layout.new_data_id()
        self.vpath = backend.join(manifest.model, version_dir(manifest.version))
        self.dpath = os.path.join(self.vpath, self.data_id)
        layout._ensure_groups(backend, manifest.model)
        for a in manifest.arrays:
            cdir = os.path.join(self.dpath, a.name, "c")
            os.makedirs(cdir, exist_ok=True)
            chunk_elems = a.chunk_bytes // a.itemsize
            meta = layout.array_json(a.zarr_dtype, a.itemsize, a.nchunks * chunk_elems, chunk_elems)
            backend.write_small(os.path.join(self.dpath, a.name, "zarr.json"), meta)
            for i in range(a.nchunks):
                with open(os.path.join(cdir, str(i)), "wb") as f:
                    f.truncate(a.chunk_bytes)

    def write(self, array: str, chunk: int, offset: int, data: memoryview) -> None:
        fd = os.open(os.path.join(self.dpath, array, "c", str(chunk)), os.O_WRONLY)
        try:
            done = 0
            while done < data.nbytes:
                done += os.pwrite(fd, data[done:], offset + done)
        finally:
            os.close(fd)

    def commit(self) -> Manifest:
        """Make the version visible; returns the committed manifest (another writer's if it won)."""
        self.backend.write_small(os.path.join(self.dpath, "zarr.json"), layout.group_json())
        m = self.manifest
        ours = Manifest(model=m.model, version=m.version, data_id=self.data_id, tensors=m.tensors,
                        arrays=m.arrays, created=m.created)
        commit = os.path.join(self.vpath, "zarr.json")
        if self.backend.create_exclusive(commit, layout.group_json({layout.ATTR_KEY: ours.to_json()})):
            return ours
        self.abandon()
        return layout.read_manifest(self.backend, m.model, m.version)

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            self.backend.remove_tree(self.dpath)
