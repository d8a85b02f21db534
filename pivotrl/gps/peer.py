"""Peer fetch: pull a committed version from another process's tiers, verify it, commit it into ours.

Why: with node-local tiers (each node's persistent tier on its own NVMe, its host tier in its own /dev/shm)
there is no shared file system, so a worker that lacks a version gets it from a worker that has it: the
nearest first (`pivotrl.core.locality.nearest_holders`). Transport-agnostic here (`RangeSource`: byte
ranges of a holder's chunk files; `pivotrl.runtime.gps_plugin` carries them over Dask's comms).

- The pull goes through `layout.read_tensors` over a `PeerBackend`, a read-only `Backend` whose chunk
  reads are remote byte ranges (`PEER_RANGE_BYTES` each, several in flight on the store's I/O threads), so
  every tensor's xxh3 checksum is verified as its bytes arrive, exactly as for a local read.
- A holder lost mid-transfer (`PeerLost`) is dropped and the same range is asked of the next holder; the
  pull fails only when every holder is gone.
- Nothing becomes visible until the whole version is here and verified: the node's tiers are then written
  with `layout.write_version` (data under a fresh prefix, the manifest committed last, exclusively), so a
  torn transfer leaves at most an uncommitted prefix that `sweep` removes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pivotrl.gps import layout
from pivotrl.gps.backend import Backend, LocalBackend
from pivotrl.gps.errors import IntegrityError, NotFoundError
from pivotrl.gps.landing import Landing
from pivotrl.gps.manifest import Manifest, version_dir

#: Bytes per remote range request (the guidance range is 8-64 MiB): on loopback TCP, 64 MiB pulled 257 MB
#: in 0.41-0.70 s where 16 MiB took 0.53-1.7 s and 4 MiB 1.2-2.2 s (2-core box, loaded; benchmarks.gps_nodes).
#: Smaller ranges would make a lost holder cheaper to re-ask; a lost range is re-asked whole.
PEER_RANGE_BYTES = 64 << 20
PEER_ROOT = "peer:"


class StoreLike(Protocol):
    """What peer fetch uses of a `ParameterStore` (named structurally: the store imports this module)."""

    host: Backend | None
    persistent: Backend
    chunk_bytes: int
    _io: Executor

    def _tiers(self) -> list[tuple[str, Backend]]: ...


class PeerLost(ConnectionError):
    """A holder went away or refused (it no longer has the version) during a transfer."""


@dataclass(frozen=True)
class RangeRequest:
    """Bytes [offset, offset + nbytes) of chunk `chunk` of packed array `array` of (model, version), as laid
    out with `chunk_bytes` per chunk (a holder whose copy is chunked differently refuses)."""

    model: str
    version: int
    array: str
    chunk: int
    offset: int
    nbytes: int
    chunk_bytes: int

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RangeRequest:
        return cls(**d)


class RangeSource(Protocol):
    """How bytes move from a holder (a worker address); raises `PeerLost` when the holder cannot serve."""

    def manifest(self, holder: str, model: str, version: int) -> Manifest: ...

    def read(self, holder: str, req: RangeRequest) -> Any: ...  # a buffer of exactly req.nbytes bytes


class PeerSource(Protocol):
    """What a `ParameterStore` with `peers` set calls (see `pivotrl.runtime.gps_plugin.DaskPeers`)."""

    def fill(
        self, store: StoreLike, model: str, version: int, wanted: list[str] | None
    ) -> tuple[dict[str, torch.Tensor], Manifest]:
        """A version no local tier holds: pull it from the nearest holder, fill the node's tiers, return
        it (all tensors, or `wanted`); raises `NotFoundError` when no one holds it."""
        ...

    def announce(self, model: str, version: int, nbytes: int) -> None:
        """This store committed (model, version) in its node's tiers (a publish)."""
        ...

    def forget(self, model: str, versions: list[int]) -> None:
        """This store deleted these versions (gc): other nodes' copies go too."""
        ...


# ---------------------------------------------------------------------------------------------- serving
def local_copy(store: StoreLike, model: str, version: int) -> tuple[Any, Manifest] | None:
    """The fastest of this store's own tiers holding the committed version, with its manifest."""
    for _, backend in store._tiers():
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            return backend, layout.read_manifest(backend, model, version)
    return None


def serve_manifest(store: StoreLike, model: str, version: int) -> dict[str, Any] | None:
    got = local_copy(store, model, version)
    return None if got is None else got[1].to_json()


def serve_range(store: StoreLike, req: RangeRequest) -> np.ndarray | None:
    """The requested bytes from a local tier, or None when this store does not hold a matching copy."""
    got = local_copy(store, req.model, req.version)
    if got is None:
        return None
    backend, man = got
    arr = man.array_map().get(req.array)
    if arr is None or arr.chunk_bytes != req.chunk_bytes or not 0 <= req.chunk < arr.nchunks:
        return None
    path = backend.join(req.model, version_dir(req.version), man.data_id, req.array, "c", str(req.chunk))
    try:
        if isinstance(backend, LocalBackend):
            return _mapped_range(path, req.offset, req.nbytes)
        out = np.empty(req.nbytes, dtype=np.uint8)
        backend.read_into(path, req.offset, memoryview(out))
        return out
    except (FileNotFoundError, EOFError, ValueError):
        return None  # garbage-collected under us: the reader asks the next holder


def _mapped_range(path: str, offset: int, nbytes: int) -> np.ndarray:
    """The range as a read-only view of the file's pages (no copy: the comm sends straight from the page
    cache). Safe because chunk files are immutable: never truncated or rewritten, only unlinked, and
    an unlinked file's pages stay valid while mapped."""
    size = os.path.getsize(path)
    if offset + nbytes > size:
        raise EOFError(f"{path}: {size} bytes, range ends at {offset + nbytes}")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), nbytes + offset - start, access=mmap.ACCESS_READ, offset=start)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset - start)


# ---------------------------------------------------------------------------------------------- pulling
class PeerBackend:
    """A read-only `Backend` over remote holders (best first), falling back holder by holder."""

    root = PEER_ROOT

    def __init__(self, source: RangeSource, holders: Sequence[str], manifest: Manifest,
                 landing: Landing | None = None) -> None:
        if not holders:
            raise ValueError("PeerBackend needs at least one holder")
        self.landing = landing  # where each range is also written as it arrives
        self.source = source
        self.holders = list(holders)
        self.manifest = manifest
        self.dead: list[str] = []
        self.bytes_by_holder: dict[str, int] = {}
        self._lock = threading.Lock()

    def join(self, *parts: str) -> str:
        return "/".join([PEER_ROOT, *parts])

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        parts = path.split("/")  # peer: / model / vdir / data_id / array / c / i
        req = RangeRequest(
            self.manifest.model, self.manifest.version, parts[-3], int(parts[-1]), offset, out.nbytes,
            self.manifest.array_map()[parts[-3]].chunk_bytes,
        )
        while True:
            with self._lock:
                live = [h for h in self.holders if h not in self.dead]
            if not live:
                raise PeerLost(
                    f"{req.model!r} version {req.version}: every holder was lost mid-transfer ({self.dead})"
                )
            holder = live[0]
            try:
                data = self.source.read(holder, req)
            except PeerLost:
                with self._lock:
                    if holder not in self.dead:
                        self.dead.append(holder)
                continue
            view = memoryview(data).cast("B")
            if view.nbytes != out.nbytes:
                with self._lock:
                    self.dead.append(holder)
                continue
            out[:] = view
            if self.landing is not None:
                self.landing.write(req.array, req.chunk, req.offset, out)
            with self._lock:
                self.bytes_by_holder[holder] = self.bytes_by_holder.get(holder, 0) + out.nbytes
            return


@dataclass
class PullResult:
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    served_by: dict[str, int]  # holder -> bytes it sent
    lost: list[str]  # holders that failed during the pull
    landed: Manifest | None = None  # the manifest committed in `land`, when pulled with one


def pull(
    store: StoreLike, model: str, version: int, holders: Sequence[str], source: RangeSource,
    land: LocalBackend | None = None,
) -> PullResult:
    """Pull (model, version) from `holders` (best first), verified; raises `PeerLost` / `IntegrityError` /
    `NotFoundError` when no holder could deliver a good copy. With `land`, every range is also written
    into that local tier as it arrives and the version is committed there once verified (`Landing`);
    without, nothing is written."""
    lost: list[str] = []
    problems: list[str] = []
    remaining = list(holders)
    while remaining:
        man: Manifest | None = None
        while remaining and man is None:
            try:
                man = source.manifest(remaining[0], model, version)
            except PeerLost:
                lost.append(remaining.pop(0))
        if man is None:
            break
        landing = Landing(land, man) if land is not None else None
        peer = PeerBackend(source, remaining, man, landing)
        try:
            tensors, bad = layout.read_tensors(
                peer, man, None, store._io, slice_bytes=PEER_RANGE_BYTES, group_bytes=PEER_RANGE_BYTES
            )
        except BaseException:
            if landing is not None:
                landing.abandon()
            raise
        lost += peer.dead
        if not bad:
            landed = landing.commit() if landing is not None else None
            return PullResult(tensors, man, peer.bytes_by_holder, lost, landed)
        if landing is not None:
            landing.abandon()
        # Which holder sent the bad bytes is not tracked per tensor: retry without the one that sent most.
        worst = max(peer.bytes_by_holder, key=peer.bytes_by_holder.__getitem__)
        problems.append(f"{worst}: checksum mismatch in {bad[:5]}")
        remaining = [h for h in remaining if h != worst and h not in peer.dead]
    if problems:
        raise IntegrityError(
            f"{model!r} version {version}: no holder sent a good copy: " + "; ".join(problems)
        )
    if lost:
        raise PeerLost(f"{model!r} version {version}: every holder was lost mid-transfer ({lost})")
    raise NotFoundError(f"{model!r} version {version}: no peer holds it")


@dataclass
class Committed:
    """Where a pulled version landed first: `tier` (None: no node tier could take it), as `manifest` (this
    tier's copy: its own data prefix), and the slower node tiers `rest` still to fill (`replicate`)."""

    tier: str | None
    manifest: Manifest
    backend: Backend | None = None
    rest: list[tuple[str, Backend]] = field(default_factory=list)


def landing_tier(store: StoreLike) -> tuple[str, LocalBackend] | None:
    """The node tier a pull lands in as it arrives: the fastest local-directory tier."""
    for tier, backend in store._tiers():
        if isinstance(backend, LocalBackend):
            return tier, backend
    return None


def landed(store: StoreLike, result: PullResult, tier: str) -> Committed:
    """`Committed` for a pull that landed in `tier`: the node's other local tiers are still to fill."""
    tiers = [(t, b) for t, b in store._tiers() if isinstance(b, LocalBackend)]
    backend = dict(tiers)[tier]
    assert result.landed is not None
    return Committed(tier, result.landed, backend, [(t, b) for t, b in tiers if t != tier])


def commit_local(store: StoreLike, result: PullResult) -> Committed:
    """Write a pulled version into this node's fastest tier (the host tier, else a node-local persistent
    tier), atomically (`write_version`). The slower tiers are left to `replicate`, which copies the
    committed files, so the caller may own the pulled tensors at once: nothing reads them after this."""
    man = result.manifest
    hashes = {t.name: t.xxh3 for t in man.tensors}
    targets: list[tuple[str, Backend]] = []
    if store.host is not None:
        targets.append(("host", store.host))
    if isinstance(store.persistent, LocalBackend):
        targets.append(("persistent", store.persistent))
    for i, (tier, backend) in enumerate(targets):
        try:
            winner, ours = layout.write_version(
                backend, man.model, man.version, result.tensors, store._io, chunk_bytes=store.chunk_bytes,
                hashes=hashes, created=man.created,
            )  # a winner that is not us (another worker of this node) committed the same bytes: fine too
        except OSError:
            continue
        return Committed(tier, winner or ours, backend, targets[i + 1 :])
    return Committed(None, man)


def replicate(store: StoreLike, done: Committed) -> list[str]:
    """Copy a committed version into the node's other tiers; returns those that now have it."""
    out: list[str] = []
    if done.backend is None:
        return out
    for tier, backend in done.rest:
        with contextlib.suppress(OSError, FileNotFoundError):
            layout.copy_version(done.backend, backend, done.manifest, store._io)
            out.append(tier)
    return out
