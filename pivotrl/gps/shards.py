"""A version written by several processes: each writes its shard, one commits the manifest.

Why a separate module: `ParameterStore.publish` takes a whole state dict in one process; a sharded train
group must never gather the model into one process. Here shard `i` of `(model, version)` is written by
its owner as packed per-dtype arrays named `<dtype>.s<i>` under one data prefix that all writers share,
plus a small part record (`part-<i>.json`: its tensor and array entries). `commit_shards` builds the
manifest from every part record and commits it with the store's exclusive create: the version appears
whole or not at all, and a reader (`ParameterStore.fetch`, any subset of names) cannot tell it from a
version published by one process. A missing part raises `IncompleteShards` and commits nothing; leftovers
of an uncommitted prefix are what `ParameterStore.sweep` already removes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from pivotrl.gps import layout
from pivotrl.gps.errors import GPSError, VersionExistsError
from pivotrl.gps.manifest import ArrayEntry, Manifest, TensorEntry, validate_model_name, version_dir


class IncompleteShards(GPSError):
    """A sharded version cannot be committed: some shard's part record is missing."""


@dataclass(frozen=True)
class ShardTarget:
    """Where the shards of one version go: every writer of the version gets the same target."""

    model: str
    version: int
    data_id: str
    nshards: int


def new_target(model: str, version: int, nshards: int) -> ShardTarget:
    """A fresh target (made by one rank and sent to the others): the prefix names its writer process, so
    a crash's leftovers are swept like any other writer's."""
    validate_model_name(model)
    return ShardTarget(model, int(version), layout.new_data_id(), int(nshards))


def _dpath(store: Any, t: ShardTarget) -> str:
    return layout._jp(store.persistent.join(t.model, version_dir(t.version)), t.data_id)


def write_shard(store: Any, target: ShardTarget, shard: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write shard `shard` (its tensors, whole) durably, then its part record (the shard's commit point)."""
    jobs, finish = plan_shard(store, target, shard, tensors)
    layout.run_jobs(store._io, jobs)
    finish()


def plan_shard(store: Any, target: ShardTarget, shard: int, tensors: Mapping[str, torch.Tensor]
               ) -> tuple[list[Callable[[], None]], Callable[[], None]]:
    """`write_shard` in two parts: the jobs that write and hash the data (independent: any threads may run
    them, in any order), and `finish`, to call once every job ran, which writes the part record.

    Why split: a write behind the barrier runs its jobs on a low-priority thread, and whoever needs the
    write done (the next step) takes the jobs still left at its own priority instead of waiting."""
    if not 0 <= shard < target.nshards:
        raise ValueError(f"shard {shard} of {target.nshards}")
    backend = store.persistent
    layout._ensure_groups(backend, target.model)
    dpath = _dpath(store, target)
    backend.makedirs(dpath)
    cpu = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    rows, packed = layout._plan(cpu, store.chunk_bytes)
    jobs: list[Callable[[], None]] = []
    arrays: list[ArrayEntry] = []
    for dname, p in packed.items():
        aname = f"{dname}.s{shard}"
        apath = layout._jp(dpath, aname)
        backend.makedirs(layout._jp(apath, "c"))
        for i, bufs in enumerate(layout._chunk_buffers(p.members, p.entry.chunk_bytes, p.entry.nchunks)):
            jobs.append(partial(backend.write_file, layout._jp(apath, "c", str(i)), bufs))
        meta = layout.array_json(p.entry.zarr_dtype, p.entry.itemsize, p.entry.nchunks * p.chunk_elems,
                                 p.chunk_elems)
        jobs.append(partial(backend.write_small, layout._jp(apath, "zarr.json"), meta))
        e = p.entry
        arrays.append(ArrayEntry(aname, e.zarr_dtype, e.itemsize, e.nbytes, e.chunk_bytes, e.nchunks))
    hashes: dict[str, str] = {}
    jobs += [partial(layout._hash_into, hashes, b) for b in layout._batches([(r[0], r[6]) for r in rows])]

    def finish() -> None:
        for a in arrays:
            getattr(backend, "sync_dir", lambda _p: None)(layout._jp(dpath, a.name, "c"))
        record = {
            "tensors": [[n, d, list(s), f"{a}.s{shard}", o, nb, hashes[n]] for n, d, s, a, o, nb, _ in rows],
            "arrays": [a.__dict__ for a in arrays],
        }
        # The record appears whole or not at all (committers poll for it from other processes): a plain
        # write exposed an empty file to `wait_parts`, and the committer read it mid-write.
        part, data = layout._jp(dpath, f"part-{shard}.json"), json.dumps(record).encode()
        if not backend.create_exclusive(part, data):  # left by an earlier attempt at this version: replace
            backend.remove_file(part)
            if not backend.create_exclusive(part, data):
                raise RuntimeError(f"{part}: another writer wrote this shard's record at the same time")

    return jobs, finish


def wait_parts(store: Any, target: ShardTarget, timeout_s: float) -> None:
    """Wait until every shard's part record exists (writers in other processes), at most `timeout_s`;
    `IncompleteShards` names the missing ones."""
    deadline = time.monotonic() + timeout_s
    dpath = _dpath(store, target)
    pending = set(range(target.nshards))
    while True:
        pending = {i for i in pending if not store.persistent.exists(layout._jp(dpath, f"part-{i}.json"))}
        if not pending:
            return
        if time.monotonic() > deadline:
            raise IncompleteShards(f"{target.model!r} version {target.version}: shard(s) {sorted(pending)} "
                                   f"not written within {timeout_s:g}s; nothing committed")
        threading.Event().wait(0.01)  # other processes' writes: nothing to wait on but the files


def commit_shards(store: Any, target: ShardTarget, order: Sequence[str] | None = None) -> Manifest:
    """Commit the version from every shard's part record (tensors in `order`, else shard order).

    Raises `IncompleteShards` (nothing committed) when a part is missing, `VersionExistsError` when
    another writer committed the version first."""
    backend = store.persistent
    dpath = _dpath(store, target)
    tensors: dict[str, TensorEntry] = {}
    arrays: list[ArrayEntry] = []
    missing = []
    for i in range(target.nshards):
        try:
            rec = json.loads(backend.read_small(layout._jp(dpath, f"part-{i}.json")))
        except FileNotFoundError:
            missing.append(i)
            continue
        for n, d, s, a, o, nb, h in rec["tensors"]:
            tensors[n] = TensorEntry(n, d, tuple(s), a, o, nb, h)
        arrays += [ArrayEntry(**a) for a in rec["arrays"]]
    if missing:
        raise IncompleteShards(
            f"{target.model!r} version {target.version}: shard(s) {missing} of {target.nshards} were never "
            "written; nothing committed")
    names = list(order) if order is not None else list(tensors)
    if sorted(names) != sorted(tensors):
        raise IncompleteShards(f"{target.model!r} version {target.version}: shards hold "
                               f"{len(tensors)} tensors, the order names {len(names)}; nothing committed")
    manifest = Manifest(model=target.model, version=target.version, data_id=target.data_id,
                        tensors=tuple(tensors[n] for n in names), arrays=tuple(arrays))
    backend.write_small(layout._jp(dpath, "zarr.json"), layout.group_json())
    commit = backend.join(target.model, version_dir(target.version), "zarr.json")
    if not backend.create_exclusive(commit, layout.group_json({layout.ATTR_KEY: manifest.to_json()})):
        raise VersionExistsError(f"{target.model!r} version {target.version} was committed by another writer")
    return manifest
