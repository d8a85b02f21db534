"""`ParameterStore`: any process fetches any model's weights, at any version, from its fastest tier.

Tiers, one format (see `pivotrl.gps.layout`):

1. device tier: in-process LRU bounded in bytes, on `device` (GPU memory on a GPU worker);
2. host tier (optional): a node-local directory such as /dev/shm/pivotrl-gps, filled behind reads;
3. persistent tier: a Zarr v3 store on local disk or at any fsspec URL; the source of truth.

`publish` lands a snapshot in the device tier and returns; a background thread persists it (write-behind).
`flush()` waits for it, and a failed background write is raised by `flush()` or by the next call, never
dropped. Versions are immutable and appear atomically (see `layout.write_version`); exactly one of two
writers of the same (model, version) wins. `fetch` verifies xxh3 checksums and, when a tier holds a corrupt
copy, falls back to the next tier and repairs the host tier from the good copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Literal

import torch

from pivotrl.gps import layout
from pivotrl.gps.arena import ReadArena
from pivotrl.gps.backend import Backend, make_backend
from pivotrl.gps.device_tier import DeviceTier, nbytes_of
from pivotrl.gps.errors import IntegrityError, NotFoundError, VersionExistsError, WriteBehindError
from pivotrl.gps.manifest import (
    Manifest,
    TensorEntry,
    dtype_name,
    parse_version_dir,
    validate_model_name,
    validate_version,
    version_dir,
)
from pivotrl.gps.packed import move_packed, packed_clone
from pivotrl.gps.retention import retire_version, sweep_model

if TYPE_CHECKING:
    from pivotrl.config import GPSConfig
    from pivotrl.gps.peer import PeerSource

VersionSpec = int | Literal["latest"]


PINS_DIR = ".pins"


def _short(items: list, limit: int = 12) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"


class ParameterStore:
    """Global Parameter Storage client; one per process (thread-safe)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        host_tier: str | os.PathLike[str] | None = None,
        device_tier_bytes: int = 2 << 30,
        device: str | torch.device = "cpu",
        write_behind: bool = True,
        chunk_bytes: int = layout.DEFAULT_CHUNK_BYTES,
        io_threads: int | None = None,
        fsync: bool = False,
        stale_after_s: float = 3600.0,
        read_buffers: int = 2,
    ) -> None:
        self.persistent: Backend = make_backend(root, fsync=fsync)
        self.host: Backend | None = make_backend(host_tier) if host_tier is not None else None
        self.device_tier = DeviceTier(device_tier_bytes, device)
        self.write_behind = write_behind
        self.chunk_bytes = chunk_bytes
        self.stale_after_s = stale_after_s
        # Threads (the calling one included) sharing a fetch's/publish's preadv, writev and xxh3 jobs: half
        # the cores, at least 2, at most 8: parallel page-cache copies and first-touch page faults add
        # bandwidth (on the 2-core dev box, caller + 1 helper beat the caller alone by ~1.4x in medians).
        self.io_threads = io_threads or max(2, min(8, (os.cpu_count() or 2) // 2))
        self._io = layout.IOPool(self.io_threads)
        # Fetches land in buffers earlier fetches used once nothing references those any more: a device
        # re-fetching each new version skips page-faulting a fresh allocation in (see pivotrl.gps.arena).
        self._arena = ReadArena(read_buffers)
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="gps-write-behind")
        self._bg_futures: list[Future] = []
        self._errors: list[BaseException] = []
        self._pending: dict[tuple[str, int], tuple[dict[str, torch.Tensor], Manifest]] = {}
        self._lock = threading.Lock()
        self.stats = {"fallbacks": 0, "repairs": 0, "host_fills": 0}
        # Set by the runtime (pivotrl.runtime.gps_plugin) where tiers are node-local: a version no tier
        # here holds is pulled from a peer; publishes and gc are announced (see pivotrl.gps.peer).
        self.peers: PeerSource | None = None

    @classmethod
    def from_config(
        cls, cfg: GPSConfig, storage_root: str | os.PathLike[str] = "storage", **kw
    ) -> ParameterStore:
        """Build from the pipeline config's `gps` section (root defaults to <storage_root>/gps)."""
        root = cfg.root if cfg.root is not None else os.path.join(os.fspath(storage_root), "gps")
        return cls(root, host_tier=cfg.host_tier, device_tier_bytes=cfg.device_tier_bytes, **kw)

    def __repr__(self) -> str:
        return f"ParameterStore({self.persistent!r}, host={self.host!r}, device={self.device_tier.device})"

    # ------------------------------------------------------------------ tiers
    def _tiers(self) -> list[tuple[str, Backend]]:
        tiers: list[tuple[str, Backend]] = []
        if self.host is not None:
            tiers.append(("host", self.host))
        tiers.append(("persistent", self.persistent))
        return tiers

    def _raise_background_error(self) -> None:
        with self._lock:
            if not self._errors:
                return
            errors, self._errors = self._errors, []
        first = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise WriteBehindError(f"{first}{more}") from first

    # ------------------------------------------------------------------ listing
    def models(self) -> list[str]:
        names = [
            n
            for n in self.persistent.list_dir(self.persistent.root)
            if not n.startswith(".") and n != "zarr.json"
        ]
        with self._lock:
            names += [m for m, _ in self._pending]
        return sorted(set(names))

    def _committed(self, backend: Backend, model: str) -> list[int]:
        out = []
        for name in backend.list_dir(backend.join(model)):
            v = parse_version_dir(name)
            if v is not None and backend.exists(backend.join(model, name, "zarr.json")):
                out.append(v)
        return out

    def versions(self, model: str) -> list[int]:
        """Committed versions of `model` (plus this process's not yet persisted ones), ascending."""
        validate_model_name(model)
        vs = set(self._committed(self.persistent, model))
        with self._lock:
            vs |= {v for m, v in self._pending if m == model}
        return sorted(vs)

    def latest(self, model: str) -> int:
        vs = self.versions(model)
        if not vs:
            raise NotFoundError(
                f"model {model!r} has no published version; models in "
                f"{self.persistent.root}: {_short(self.models())}"
            )
        return vs[-1]

    def _resolve(self, model: str, version: VersionSpec) -> int:
        validate_model_name(model)
        if version == "latest":
            return self.latest(model)
        return validate_version(version)

    def manifest(self, model: str, version: VersionSpec = "latest") -> Manifest:
        """The committed manifest (names, shapes, dtypes, byte counts, checksums) of a version."""
        v = self._resolve(model, version)
        with self._lock:
            pending = self._pending.get((model, v))
        if pending is not None:
            return pending[1]
        for _, backend in self._tiers():
            with contextlib.suppress(FileNotFoundError):
                return layout.read_manifest(backend, model, v)
        raise self._missing(model, v)

    def _missing(self, model: str, version: int) -> NotFoundError:
        vs = self.versions(model)
        if not vs:
            return NotFoundError(
                f"no model {model!r} in {self.persistent.root}; models: {_short(self.models())}"
            )
        return NotFoundError(f"model {model!r} has no version {version}; versions: {_short(vs)}")

    # ------------------------------------------------------------------ publish
    def publish(self, model: str, version: int, state_dict: Mapping[str, torch.Tensor], *,
                write_behind: bool | None = None) -> Manifest:
        """Publish an immutable version; returns its manifest.

        With write-behind (the store's default unless `write_behind` says otherwise) the state dict is
        snapshotted (so the caller may keep training in place) into the device tier and persisted in the
        background; `flush()` waits for it. Without, it is persisted in the calling thread, from the
        caller's tensors (no copy). A version that another writer already committed raises
        `VersionExistsError` here, or from `flush()` when the race was lost in the background.
        """
        validate_model_name(model)
        validate_version(version)
        self._raise_background_error()
        key = (model, version)
        with self._lock:
            if key in self._pending:
                raise VersionExistsError(
                    f"{model!r} version {version} is already being published by this store"
                )
        if self.persistent.exists(self.persistent.join(model, version_dir(version), "zarr.json")):
            raise VersionExistsError(
                f"{model!r} version {version} already exists (versions are immutable); latest is "
                f"{self.latest(model)}"
            )
        if not (self.write_behind if write_behind is None else write_behind):
            return self._persist(model, version, state_dict, hashes=None, data_id=None)
        for n, t in state_dict.items():
            if not isinstance(n, str) or not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"state dict items must be str -> torch.Tensor, got {n!r}: {type(t).__name__}"
                )
            dtype_name(t.dtype)
        snapshot = packed_clone({n: t.detach().cpu() for n, t in state_dict.items()})
        manifest = self._snapshot_manifest(model, version, snapshot)
        with self._lock:
            self._pending[key] = (snapshot, manifest)
        tier = self.device_tier  # held even over capacity, but never copied to a device it overflows
        if tier.capacity > 0 and (tier.device.type == "cpu" or nbytes_of(snapshot) <= tier.capacity):
            self.device_tier.put(key, self._to_tier_device(snapshot), manifest.names, held=True)
        hashes = {t.name: t.xxh3 for t in manifest.tensors}
        fut = self._bg.submit(self._persist_behind, model, version, snapshot, hashes, manifest)
        self._track(fut)
        return manifest

    def _snapshot_manifest(self, model: str, version: int, snap: dict[str, torch.Tensor]) -> Manifest:
        """The manifest that the background write will commit (same data_id, offsets and checksums)."""
        rows, packed = layout._plan(snap, self.chunk_bytes)
        hashes: dict[str, str] = {}
        batches = layout._batches([(r[0], r[6]) for r in rows])
        layout.run_jobs(self._io, [partial(layout._hash_into, hashes, b) for b in batches])
        tensors = tuple(TensorEntry(n, d, s, a, o, nb, hashes[n]) for n, d, s, a, o, nb, _ in rows)
        return Manifest(
            model=model,
            version=version,
            data_id=layout.new_data_id(),
            tensors=tensors,
            arrays=tuple(p.entry for p in packed.values()),
        )

    def _persist_behind(
        self,
        model: str,
        version: int,
        snapshot: dict[str, torch.Tensor],
        hashes: dict[str, str],
        manifest: Manifest,
    ) -> None:
        key = (model, version)
        try:
            self._persist(
                model, version, snapshot, hashes=hashes, data_id=manifest.data_id, created=manifest.created
            )
        except BaseException as exc:
            self.device_tier.drop(key)
            with self._lock:
                self._errors.append(
                    WriteBehindError(
                        f"write-behind publish of {model!r} version {version} "
                        f"failed: {type(exc).__name__}: {exc}"
                    )
                )
                self._errors[-1].__cause__ = exc
        else:
            self.device_tier.release(key)
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _persist(
        self,
        model: str,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        hashes: dict[str, str] | None,
        data_id: str | None,
        created: float | None = None,
    ) -> Manifest:
        winner, ours = layout.write_version(
            self.persistent,
            model,
            version,
            state_dict,
            self._io,
            chunk_bytes=self.chunk_bytes,
            data_id=data_id,
            hashes=hashes,
            created=created,
        )
        if winner is not None:
            raise VersionExistsError(
                f"{model!r} version {version} was committed by another writer first (versions are immutable)"
            )
        if self.host is not None:
            with contextlib.suppress(OSError):
                layout.write_version(
                    self.host,
                    model,
                    version,
                    state_dict,
                    self._io,
                    chunk_bytes=self.chunk_bytes,
                    data_id=ours.data_id,
                    hashes={t.name: t.xxh3 for t in ours.tensors},
                    created=ours.created,
                )
        if self.peers is not None:
            self.peers.announce(model, version, ours.nbytes)
        return ours

    def _track(self, fut: Future) -> None:
        """Remember a background job for `flush()`; finished ones are dropped (their errors are recorded)."""
        with self._lock:
            self._bg_futures = [f for f in self._bg_futures if not f.done()]
            self._bg_futures.append(fut)

    def flush(self) -> None:
        """Wait until every write-behind publish is persisted; raise the first failure."""
        with self._lock:
            futs, self._bg_futures = self._bg_futures, []
        for f in futs:
            f.result()
        self._raise_background_error()

    # ------------------------------------------------------------------ fetch
    def fetch(
        self,
        model: str,
        version: VersionSpec = "latest",
        device: str | torch.device = "cpu",
        names: Iterable[str] | None = None,
        *,
        copy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The tensors of one version (all, or the subset `names`) on `device`.

        The caller owns what it gets (`copy=True`): tensors sit in memory that depends on no file and that
        nothing else references (a read may reuse a buffer an earlier fetch's tensors no longer hold).
        `copy=False` may return the device tier's own tensors (no copy): for read-only consumers
        such as `load_state_dict`, which copies anyway; never modify them in place.
        """
        v = self._resolve(model, version)
        self._raise_background_error()
        key = (model, v)
        wanted = list(names) if names is not None else None
        device = torch.device(device)
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            snap, man = pending
            self._check_names(man, wanted)
            got = {n: snap[n] for n in (wanted if wanted is not None else man.names)}
            return self._deliver(got, device, copy=True)
        hit = self.device_tier.get(key, wanted)
        if hit is not None:
            return self._deliver(hit, device, copy)
        tensors, man = self._read_through(model, v, wanted, shared=not copy)
        if self.device_tier.capacity > 0 and self.device_tier.admits(nbytes_of(tensors), key):
            cached = self._to_tier_device(tensors)
            if copy and cached is tensors:
                cached = packed_clone(tensors)
            self.device_tier.put(key, cached, man.names)
            if not copy:
                tensors = cached
        return self._deliver(tensors, device, copy=False)

    def _check_names(self, man: Manifest, wanted: list[str] | None) -> None:
        if wanted is None:
            return
        tmap = man.tensor_map()
        unknown = [n for n in wanted if n not in tmap]
        if unknown:
            raise NotFoundError(
                f"{man.model!r} version {man.version} has no tensor(s) {_short(unknown, 5)}; "
                f"it has {_short(man.names, 8)}"
            )

    def _to_tier_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dev = self.device_tier.device
        if all(t.device == dev for t in tensors.values()):
            return tensors
        return move_packed(tensors, dev)

    @staticmethod
    def _deliver(
        tensors: dict[str, torch.Tensor], device: torch.device, copy: bool
    ) -> dict[str, torch.Tensor]:
        if copy and device.type == "cpu" and all(t.device == device for t in tensors.values()):
            return packed_clone(tensors)
        if any(t.device != device for t in tensors.values()):
            return move_packed(tensors, device)
        return {n: t.clone() if copy else t for n, t in tensors.items()}

    def _read_through(
        self, model: str, version: int, wanted: list[str] | None, ask_peers: bool = True,
        shared: bool = False,
    ) -> tuple[dict[str, torch.Tensor], Manifest]:
        """Try host then persistent tier; verify checksums; fall back on corruption; fill/repair the host;
        then (node-local tiers) the nearest peer. `shared`: the caller never writes to what it gets (a
        peer fill may then return the memory it lands in the node's tier behind the fetch; else a copy)."""
        problems: list[str] = []
        missed: list[tuple[str, Backend]] = []
        corrupt: list[tuple[str, Backend]] = []
        for tier, backend in self._tiers():
            try:
                man = layout.read_manifest(backend, model, version)
            except FileNotFoundError:
                missed.append((tier, backend))
                continue
            except (ValueError, KeyError, json.JSONDecodeError) as exc:
                problems.append(f"{tier} tier: unreadable manifest ({exc})")
                corrupt.append((tier, backend))
                continue
            self._check_names(man, wanted)
            try:
                tensors, bad = layout.read_tensors(backend, man, wanted, self._io, alloc=self._arena.take)
            except (FileNotFoundError, EOFError) as exc:
                if not backend.exists(backend.join(model, version_dir(version), "zarr.json")):
                    raise NotFoundError(
                        f"{model!r} version {version} was garbage-collected while being "
                        f"read; versions now: {_short(self.versions(model))}"
                    ) from None
                problems.append(f"{tier} tier: missing or truncated data ({exc})")
                corrupt.append((tier, backend))
                continue
            if bad:
                problems.append(
                    f"{tier} tier ({backend.root}): checksum mismatch in tensor(s) {_short(bad, 5)}"
                )
                corrupt.append((tier, backend))
                continue
            if corrupt or missed:
                self.stats["fallbacks"] += bool(corrupt)
                self._repair_faster_tiers(man, backend, corrupt, missed)
            return tensors, man
        if problems:
            raise IntegrityError(
                f"{model!r} version {version} is corrupt in every tier: " + "; ".join(problems)
            )
        if ask_peers and self.peers is not None:
            return self.peers.fill(self, model, version, wanted, shared=shared)
        raise self._missing(model, version)

    def _repair_faster_tiers(self, man: Manifest, good: Backend, corrupt: list, missed: list) -> None:
        """Fill tiers that missed the version and replace corrupt host copies, in the background.

        The persistent tier is never rewritten from here: it is the shared source of truth; a corrupt
        persistent copy is reported by the fallback (stats["fallbacks"]) and by fetches without a host copy.
        """
        for tier, backend in [*corrupt, *missed]:
            if tier != "host" or backend is good:
                continue
            was_corrupt = any(b is backend for _, b in corrupt)
            self._track(self._bg.submit(self._refill_host, backend, good, man, was_corrupt))

    def _refill_host(self, host: Backend, good: Backend, man: Manifest, was_corrupt: bool) -> None:
        with contextlib.suppress(OSError, FileNotFoundError):
            if was_corrupt:
                self._retire(host, man.model, man.version)
                self.stats["repairs"] += 1
            if layout.copy_version(good, host, man, self._io):
                self.stats["host_fills"] += 1

    # ------------------------------------------------------------------ pins, gc, sweep
    def pin(self, model: str, version: int) -> None:
        """Protect a version from `gc` (pins are shared by every process using this persistent root)."""
        validate_version(version)
        self.flush()
        if version not in self.versions(model):
            raise self._missing(model, version)
        d = self.persistent.join(model, PINS_DIR)
        self.persistent.makedirs(d)
        self.persistent.write_small(f"{d}/{version}", b"")

    def unpin(self, model: str, version: int) -> None:
        validate_model_name(model)
        self.persistent.remove_file(self.persistent.join(model, PINS_DIR, str(validate_version(version))))

    def pinned(self, model: str) -> list[int]:
        validate_model_name(model)
        names = self.persistent.list_dir(self.persistent.join(model, PINS_DIR))
        return sorted(int(n) for n in names if n.isdigit())

    def gc(self, model: str, keep_last: int = 3) -> list[int]:
        """Delete old versions in every tier, keeping the last `keep_last`, every pinned one and the latest.

        Returns the versions deleted. Also sweeps leftovers of crashed writers.
        """
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.flush()
        vs = self.versions(model)
        keep = set(vs[-keep_last:]) | set(self.pinned(model))
        return self._delete_versions(model, [v for v in vs if v not in keep])

    def discard_newer(self, model: str, version: int) -> list[int]:
        """Delete every version of `model` newer than `version` in every tier; returns those deleted.

        For a resumed run: versions its dead driver published after its last checkpoint are referenced by
        nothing, and the resumed run publishes those numbers again (versions are immutable)."""
        validate_model_name(model)
        self.flush()
        return self._delete_versions(model, [v for v in self.versions(model) if v > version])

    def _delete_versions(self, model: str, doomed: list[int]) -> list[int]:
        """Retire `doomed` in every tier (the persistent one first), then sweep the leftovers; returns it."""
        for v in doomed:
            self.device_tier.drop((model, v))
            for _, backend in reversed(self._tiers()):
                self._retire(backend, model, v)
        self.sweep(model)
        if doomed and self.peers is not None:
            self.peers.forget(model, doomed)
        return doomed

    def _retire(self, backend: Backend, model: str, version: int) -> None:
        retire_version(backend, model, version)

    def sweep(self, model: str) -> int:
        """Remove leftovers of crashed writers and interrupted gc runs in every tier; returns how many were
        removed (`pivotrl.gps.retention.sweep_model`)."""
        validate_model_name(model)
        now = time.time()
        return sum(sweep_model(backend, model, now, self.stale_after_s) for _, backend in self._tiers())

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._bg.shutdown(wait=True)
            self._io.shutdown(wait=True)
            self._arena.clear()

    def __enter__(self) -> ParameterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
