"""Peer fetch: pull a committed version from another process's tiers, verify it, commit it into ours.

Why: with node-local tiers (each node's persistent tier on its own NVMe, its host tier in its own /dev/shm)
there is no shared file system, so a worker that lacks a version gets it from a worker that has it: the
nearest first (`pivotrl.core.locality.nearest_holders`). Transport-agnostic here (`RangeSource`: byte
ranges of a holder's chunk files; `pivotrl.runtime.gps_plugin` carries them over Dask's comms).

- The pull asks for pieces of whole tensors (`pivotrl.gps.pieces`; `PEER_RANGE_BYTES` at most, `PEER_WINDOW`
  in flight), and the buffer each arrives in becomes those tensors' memory: the transfer and one xxh3 pass
  per tensor, no copy into a second buffer.
- A holder lost mid-transfer (`PeerLost`) is dropped and the same range is asked of the next holder; the
  pull fails only when every holder is gone.
- Nothing becomes visible until the whole version is here and verified: the node's tier is then written
  (`Landing`: data under a fresh prefix, the manifest committed last, exclusively), so a torn transfer
  leaves at most an uncommitted prefix that `sweep` removes. The landing may run behind the fetch (the
  caller's choice, for read-only results), so the pull's critical path does not include writing the tier.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from pivotrl.gps import layout
from pivotrl.gps.backend import Backend, LocalBackend
from pivotrl.gps.errors import IntegrityError, NotFoundError
from pivotrl.gps.landing import Landing
from pivotrl.gps.manifest import DTYPES, Manifest, version_dir
from pivotrl.gps.pieces import Piece, Segment, plan_pieces

#: Bytes per remote range request, at most (the guidance range is 8-64 MiB): on loopback TCP a 257 MB pull
#: took a median 0.12-0.17 s with 64 MiB pieces and 0.20 s with 32 MiB ones (quiet 2-core box,
#: benchmarks.gps_nodes). Smaller ranges would make a lost holder cheaper to re-ask (re-asked whole).
PEER_RANGE_BYTES = 64 << 20
#: Pieces in flight at once per pull (each a request to a holder, on its own thread). 2, 3 and 4 measured
#: equal: a process's comms share one event-loop thread, so more in flight adds no stream.
PEER_WINDOW = 4


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
        self, store: StoreLike, model: str, version: int, wanted: list[str] | None, *, shared: bool = False
    ) -> tuple[dict[str, torch.Tensor], Manifest]:
        """A version no local tier holds: pull it from the nearest holder, fill the node's tiers, return
        it (all tensors, or `wanted`); raises `NotFoundError` when no one holds it. `shared`: the caller
        only reads the result, which may then be the memory the node's tiers are filled from."""
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
class _PieceFetcher:
    """Fetches the pieces of one pull from `holders` (best first), falling back holder by holder."""

    def __init__(self, source: RangeSource, holders: Sequence[str], manifest: Manifest) -> None:
        if not holders:
            raise ValueError("a pull needs at least one holder")
        self.source = source
        self.holders = list(holders)
        self.manifest = manifest
        self.chunk_bytes = {a.name: a.chunk_bytes for a in manifest.arrays}
        self.dead: list[str] = []
        self.bytes_by_holder: dict[str, int] = {}
        self._lock = threading.Lock()

    def _segment(self, piece: Piece, seg: Segment) -> np.ndarray:
        m = self.manifest
        req = RangeRequest(m.model, m.version, piece.array, seg.chunk, seg.offset, seg.nbytes,
                           self.chunk_bytes[piece.array])
        while True:
            with self._lock:
                live = [h for h in self.holders if h not in self.dead]
            if not live:
                raise PeerLost(
                    f"{m.model!r} version {m.version}: every holder was lost mid-transfer ({self.dead})"
                )
            holder = live[0]
            try:
                data = self.source.read(holder, req)
            except PeerLost:
                data = None
            arr = None if data is None else _as_bytes(data)
            if arr is None or arr.nbytes != seg.nbytes:
                with self._lock:
                    if holder not in self.dead:
                        self.dead.append(holder)
                continue
            with self._lock:
                self.bytes_by_holder[holder] = self.bytes_by_holder.get(holder, 0) + seg.nbytes
            return arr

    def fetch(self, piece: Piece) -> tuple[np.ndarray, list[str]]:
        """The piece's bytes (its tensors' memory) and the names of its tensors failing their checksum."""
        align = max(_ITEMSIZE.get(e.dtype, 8) for e in piece.entries)
        if piece.direct:
            buf = self._segment(piece, piece.segments[0])
            if not buf.flags.writeable or buf.ctypes.data % align:
                buf = _aligned_copy(buf)  # tensors get writable, naturally aligned memory
        else:
            buf = _aligned_empty(piece.nbytes)
            for seg in piece.segments:
                buf[seg.dst : seg.dst + seg.nbytes] = self._segment(piece, seg)
        mv = memoryview(buf)
        bad = [e.name for e in piece.entries
               if xxhash.xxh3_64_hexdigest(mv[e.offset - piece.start : e.offset - piece.start + e.nbytes])
               != e.xxh3]
        return buf, bad


_ALIGN = 64


def _as_bytes(data: Any) -> np.ndarray:
    """`data` as a flat uint8 array on the same memory, writable where that memory is (an array the sender
    flagged read-only arrives flagged so, in a buffer of the comm's that is ours to keep)."""
    if isinstance(data, np.ndarray) and data.flags.c_contiguous:
        arr = data.reshape(-1).view(np.uint8)
        if not arr.flags.writeable:
            with contextlib.suppress(ValueError):
                arr.flags.writeable = True
        return arr
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
_ITEMSIZE = {name: dt[0].itemsize for name, dt in DTYPES.items()}


def _aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + nbytes]


def _aligned_copy(buf: np.ndarray) -> np.ndarray:
    out = _aligned_empty(buf.nbytes)
    np.copyto(out, buf)
    return out


@dataclass
class PullResult:
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    served_by: dict[str, int]  # holder -> bytes it sent
    lost: list[str]  # holders that failed during the pull
    landed: Manifest | None = None  # the manifest committed in `land`, when pulled with one
    pieces: list[tuple[Piece, np.ndarray]] = field(default_factory=list, repr=False)

    def land(self, backend: LocalBackend) -> Manifest:
        """Write the pulled bytes into `backend` and commit the version there (`Landing`'s rule: visible
        only once all of it is written); returns the committed manifest (another writer's if it won)."""
        landing = Landing(backend, self.manifest)
        try:
            for piece, buf in self.pieces:
                mv = memoryview(buf)
                for seg in piece.segments:
                    landing.write(piece.array, seg.chunk, seg.offset, mv[seg.dst : seg.dst + seg.nbytes])
            self.landed = landing.commit()
        except BaseException:
            landing.abandon()
            raise
        return self.landed


def _tensors(manifest: Manifest, got: list[tuple[Piece, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Every tensor of the version, in the manifest's order, as views of the pieces' buffers."""
    out: dict[str, torch.Tensor] = {}
    for piece, buf in got:
        flat = torch.from_numpy(buf)
        for e in piece.entries:
            d = e.offset - piece.start
            out[e.name] = flat[d : d + e.nbytes].view(DTYPES[e.dtype][0]).view(e.shape)
    return {n: out[n] for n in manifest.names}


def pull(
    store: StoreLike, model: str, version: int, holders: Sequence[str], source: RangeSource,
    land: LocalBackend | None = None, *, land_behind: bool = False,
) -> PullResult:
    """Pull (model, version) from `holders` (best first), verified; raises `PeerLost` / `IntegrityError` /
    `NotFoundError` when no holder could deliver a good copy.

    Pieces (`plan_pieces`) are fetched `PEER_WINDOW` at a time, so the holder's sends, the transfer and this
    side's checksums overlap. With `land` the verified version is committed into that local tier before
    this returns; with `land_behind` as well, it is not: the caller lands it (`PullResult.land`) behind the
    fetch, which it may only do while nothing writes to the returned tensors (they are the landed bytes).
    Without `land`, nothing is written."""
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
        fetcher = _PieceFetcher(source, remaining, man)
        pieces = sorted(plan_pieces(man, PEER_RANGE_BYTES), key=lambda p: -p.nbytes)
        got: list[tuple[Piece, np.ndarray]] = []
        bad: list[str] = []
        with ThreadPoolExecutor(min(PEER_WINDOW, max(1, len(pieces))), thread_name_prefix="gps-peer") as pool:
            futs = [pool.submit(fetcher.fetch, p) for p in pieces]
            try:
                for p, f in zip(pieces, futs):
                    buf, b = f.result()
                    got.append((p, buf))
                    bad += b
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
        lost += fetcher.dead
        if not bad:
            res = PullResult(_tensors(man, got), man, fetcher.bytes_by_holder, lost, pieces=got)
            if land is not None and not land_behind:
                res.land(land)
            return res
        # Which holder sent the bad bytes is not tracked per tensor: retry without the one that sent most.
        worst = max(fetcher.bytes_by_holder, key=fetcher.bytes_by_holder.__getitem__)
        problems.append(f"{worst}: checksum mismatch in {bad[:5]}")
        remaining = [h for h in remaining if h != worst and h not in fetcher.dead]
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
