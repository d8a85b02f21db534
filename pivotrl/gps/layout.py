"""One published version on disk: a Zarr v3 group of packed per-dtype arrays, and its manifest.

Layout under a tier's root (every node is valid Zarr v3, so `zarr.open(root)` can browse it)::

    zarr.json                                   root group
    <model>/zarr.json                           model group
    <model>/v000000000042/zarr.json             version group; attributes["pivotrl_gps"] = manifest
                                                (its creation is the commit point of the publish)
    <model>/v000000000042/<data_id>/zarr.json   group holding the data of this writer
    <model>/v000000000042/<data_id>/bfloat16/   int16 1-D array, every bf16 tensor packed end to end
    <model>/v000000000042/<data_id>/float32/    float32 1-D array ...   (chunks at .../c/0, .../c/1, ...)

Why packed flat arrays: Zarr's performance guide asks for few large uncompressed chunks; packing ~200
tensors of one dtype into one 1-D array gives one or a few big chunks instead of 200 tiny arrays.
Chunks are up to 256 MiB (DEFAULT_CHUNK_BYTES): writing 257 MB as 4 files took ~35% longer than as one file
on the development box, and large chunks cost nothing on reads, because a fetch of a subset (or a parallel
fetch) reads byte ranges of a chunk (`preadv` at an offset, or a ranged GET via fsspec), never whole chunks.

Why the chunk files are read and written here rather than through `zarr.Array.__getitem__`: zarr decodes each
chunk into a temporary buffer and copies it into the output (two passes over memory, plus its event loop),
which `benchmarks.gps` measures at well below a raw file read. With the `bytes` codec and no compression a
chunk file *is* the raw little-endian bytes, so reading it with `preadv` straight into a fresh buffer is
exactly what zarr would produce, at raw-read speed. The metadata written here is what zarr itself writes
(checked by `tests/gps`: `zarr.open` reads every array back bit-exactly).

Edge chunks: zarr pads the last chunk of a regular grid to full size. To waste nothing, the chunk length is
chosen as ceil(n / k) for k = ceil(bytes / chunk_bytes) chunks, so the padding is < k elements.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, zip_longest

import numpy as np
import torch
import xxhash

from pivotrl.gps.backend import Backend
from pivotrl.gps.manifest import DTYPES, ArrayEntry, Manifest, TensorEntry, dtype_name, version_dir

ATTR_KEY = "pivotrl_gps"
DEFAULT_CHUNK_BYTES = 256 << 20
READ_SLICE_BYTES = 2 << 20  # fits in L2/L3, so hashing right after the read hits the cache
READ_GROUP_BYTES = 16 << 20  # unit of work shared out over the I/O threads
_HOST_KEY = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]


def new_data_id() -> str:
    """A writer-unique data prefix that also says which host/process wrote it (to sweep crashed writers)."""
    return f"d-{_HOST_KEY}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def parse_data_id(name: str) -> tuple[str, int] | None:
    parts = name.split("-")
    if len(parts) == 4 and parts[0] == "d" and parts[2].isdigit():
        return parts[1], int(parts[2])
    return None


def writer_is_alive(name: str, now: float, mtime: float | None, stale_after_s: float) -> bool:
    """Whether a data prefix may still be written by a live process (never sweep those)."""
    owner = parse_data_id(name)
    if owner is not None and owner[0] == _HOST_KEY:
        try:
            os.kill(owner[1], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        # The pid is alive (or reused): only very old leftovers are swept.
    return mtime is not None and now - mtime < stale_after_s


def group_json(attributes: dict | None = None) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}).encode()


def array_json(zarr_dtype: str, itemsize: int, n_elems: int, chunk_elems: int) -> bytes:
    codec: dict = {"name": "bytes"}
    if itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [n_elems],
        "data_type": zarr_dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_elems]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if zarr_dtype == "bool" else 0,
        "codecs": [codec],
        "attributes": {},
        "storage_transformers": [],
    }
    return json.dumps(meta).encode()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is a contiguous CPU tensor (a view keeps it alive)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


@dataclass
class _Packed:
    entry: ArrayEntry
    chunk_elems: int
    members: list[tuple[str, memoryview]]


def _plan(state_dict: Mapping[str, torch.Tensor], chunk_bytes: int) -> tuple[list, dict[str, _Packed]]:
    rows: list[tuple[str, str, tuple[int, ...], str, int, int, memoryview]] = []
    packed: dict[str, _Packed] = {}
    sizes: dict[str, int] = {}
    for name, t in state_dict.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state dict keys must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict value {name!r} is a {type(t).__name__}, not a torch.Tensor")
        dname = dtype_name(t.dtype)
        mv = tensor_bytes(t)
        off = sizes.get(dname, 0)
        sizes[dname] = off + mv.nbytes
        rows.append((name, dname, tuple(t.shape), dname, off, mv.nbytes, mv))
        packed.setdefault(dname, _Packed(None, 0, []))  # type: ignore[arg-type]
        packed[dname].members.append((name, mv))
    for dname, nbytes in sizes.items():
        tdtype, zdtype = DTYPES[dname]
        itemsize = torch.empty((), dtype=tdtype).element_size()
        n = nbytes // itemsize
        k = max(1, math.ceil(nbytes / chunk_bytes)) if n else 0
        chunk_elems = math.ceil(n / k) if k else 1
        packed[dname].entry = ArrayEntry(dname, zdtype, itemsize, nbytes, chunk_elems * itemsize, k)
        packed[dname].chunk_elems = chunk_elems
    return rows, packed


def _chunk_buffers(members: list[tuple[str, memoryview]], chunk_bytes: int, nchunks: int) -> list[list]:
    """Split the concatenation of `members` into `nchunks` lists of memoryviews of `chunk_bytes` each."""
    chunks: list[list[memoryview]] = [[] for _ in range(nchunks)]
    ci, room = 0, chunk_bytes
    for _, mv in members:
        pos = 0
        while pos < mv.nbytes:
            take = min(room, mv.nbytes - pos)
            chunks[ci].append(mv[pos : pos + take])
            pos += take
            room -= take
            if room == 0 and ci + 1 < nchunks:
                ci, room = ci + 1, chunk_bytes
    if nchunks and room:
        chunks[ci].append(memoryview(bytes(room)))  # zero padding of the last chunk (< nchunks elements)
    return chunks


HASH_BATCH_BYTES = 32 << 20


def _batches(items: list[tuple[str, memoryview]]) -> list[list[tuple[str, memoryview]]]:
    """Group (name, bytes) into batches of about HASH_BATCH_BYTES: few jobs, yet enough to share out."""
    out: list[list[tuple[str, memoryview]]] = [[]]
    size = 0
    for item in items:
        if size >= HASH_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].nbytes
    return out if out[0] else []


def _hash_into(out: dict[str, str], batch: list[tuple[str, memoryview]]) -> None:
    for name, mv in batch:
        out[name] = xxhash.xxh3_64_hexdigest(mv)


class IOPool(ThreadPoolExecutor):
    """The store's I/O threads; `helpers` of them join the calling thread in `run_jobs` (0: caller only)."""

    def __init__(self, parallelism: int) -> None:
        super().__init__(max(1, parallelism - 1), thread_name_prefix="gps-io")
        self.helpers = max(0, parallelism - 1)


def run_jobs(pool: Executor, jobs: list[Callable[[], None]]) -> None:
    """Run jobs on the pool's threads *and* the calling thread, which would otherwise sit idle waiting.

    Workers pull jobs from a shared iterator, so big and small jobs balance out. Every job runs (or is
    skipped after a failure) before this returns; the first exception is re-raised.
    """
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    it = iter(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def drain() -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None or errors:
                return
            try:
                job()
            except BaseException as exc:
                errors.append(exc)
                return

    workers = min(len(jobs) - 1, getattr(pool, "helpers", getattr(pool, "_max_workers", 1)))
    futures = [pool.submit(drain) for _ in range(workers)]
    drain()
    for f in futures:
        f.result()
    if errors:
        raise errors[0]


def write_version(
    backend: Backend,
    model: str,
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    pool: Executor,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    data_id: str | None = None,
    hashes: dict[str, str] | None = None,
    created: float | None = None,
) -> tuple[Manifest | None, Manifest]:
    """Write all data under a fresh prefix, then commit the manifest exclusively.

    Returns (winner, ours): `winner` is None when our commit won, else the manifest already committed by the
    other writer (our data is deleted again). `hashes` skips re-hashing when the caller already has them.
    """
    data_id = data_id or new_data_id()
    vpath = backend.join(model, version_dir(version))
    dpath = _jp(vpath, data_id)
    _ensure_groups(backend, model)
    rows, packed = _plan(state_dict, chunk_bytes)
    jobs: list[Callable[[], None]] = []
    computed: dict[str, str] = {}
    backend.makedirs(dpath)
    for dname, p in packed.items():
        apath = _jp(dpath, dname)
        backend.makedirs(_jp(apath, "c"))
        chunks = _chunk_buffers(p.members, p.entry.chunk_bytes, p.entry.nchunks)
        for i, bufs in enumerate(chunks):
            jobs.append(partial(backend.write_file, _jp(apath, "c", str(i)), bufs))
        n_elems = p.entry.nchunks * p.chunk_elems
        meta = array_json(p.entry.zarr_dtype, p.entry.itemsize, n_elems, p.chunk_elems)
        jobs.append(partial(backend.write_small, _jp(apath, "zarr.json"), meta))
    if hashes is None:
        # Hash in batches of ~HASH_BATCH_BYTES interleaved with the chunk writes, so both proceed at once
        # (xxhash and writev both release the GIL).
        hash_jobs = [partial(_hash_into, computed, batch) for batch in _batches([(r[0], r[6]) for r in rows])]
        jobs = [j for pair in zip_longest(jobs, hash_jobs) for j in pair if j is not None]
    run_jobs(pool, jobs)
    hashes = hashes if hashes is not None else computed
    backend.write_small(_jp(dpath, "zarr.json"), group_json())
    manifest = Manifest(
        model=model,
        version=version,
        data_id=data_id,
        tensors=tuple(TensorEntry(n, d, s, a, o, nb, hashes[n]) for n, d, s, a, o, nb, _ in rows),
        arrays=tuple(p.entry for p in packed.values()),
        created=time.time() if created is None else created,
    )
    for dname in packed:
        getattr(backend, "sync_dir", lambda _p: None)(_jp(dpath, dname, "c"))
    commit = _jp(vpath, "zarr.json")
    if backend.create_exclusive(commit, group_json({ATTR_KEY: manifest.to_json()})):
        return None, manifest
    backend.remove_tree(dpath)
    return read_manifest(backend, model, version), manifest


def _jp(base: str, *parts: str) -> str:
    """Join store paths; both back ends use '/' (POSIX paths and URLs alike)."""
    return "/".join([base, *parts])


def _ensure_groups(backend: Backend, model: str) -> None:
    """Create the root and model groups once (exclusive create: racing writers are harmless)."""
    for parts in ((), (model,)):
        path = backend.join(*parts, "zarr.json")
        if not backend.exists(path):
            backend.makedirs(backend.join(*parts) if parts else backend.root)
            backend.create_exclusive(path, group_json())


def read_manifest(backend: Backend, model: str, version: int) -> Manifest:
    """The committed manifest; FileNotFoundError when the version is not committed in this tier."""
    raw = backend.read_small(backend.join(model, version_dir(version), "zarr.json"))
    return Manifest.from_json(json.loads(raw)["attributes"][ATTR_KEY])


def read_tensors(
    backend: Backend,
    manifest: Manifest,
    names: Iterable[str] | None,
    pool: Executor,
    *,
    verify: bool = True,
    slice_bytes: int = READ_SLICE_BYTES,
    group_bytes: int = READ_GROUP_BYTES,
    alloc: Callable[[int], np.ndarray] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Read the named tensors (all when None) into memory no one else references; returns (tensors,
    names failing checksum).

    One numpy buffer (`alloc(nbytes)`, e.g. a store's `ReadArena.take`; default a fresh one: numpy asks the
    kernel for huge pages, which makes first-touch of a fresh 256 MB buffer several times cheaper than
    torch.empty), one aligned region per dtype; tensors are views into it.

    Tensors adjacent on disk form groups of ~`group_bytes` (one job each, shared out over the threads);
    a job reads its group in `slice_bytes` slices and feeds each slice to streaming xxh3 hashers right
    after its `preadv`, while the bytes are still in the CPU cache, so verification costs no second pass
    over memory. Raises EOFError / FileNotFoundError when a chunk file is short or missing.
    """
    tmap = manifest.tensor_map()
    amap = manifest.array_map()
    wanted = list(tmap.values()) if names is None else [tmap[n] for n in dict.fromkeys(names)]
    vpath = backend.join(manifest.model, version_dir(manifest.version))
    by_array: dict[str, list[TensorEntry]] = {}
    for e in wanted:
        by_array.setdefault(e.array, []).append(e)
    jobs: list[tuple[int, Callable[[], None]]] = []
    placed: list[tuple[TensorEntry, np.ndarray, int]] = []
    bad: list[str] = []
    # One fresh allocation for everything (each dtype's region 64-byte aligned), like a raw read of one file.
    bases, size = {}, 0
    for aname, entries in by_array.items():
        bases[aname] = size
        size += -(-sum(e.nbytes for e in entries) // 64) * 64
    whole = alloc(size) if alloc is not None else np.empty(size, dtype=np.uint8)
    for aname, entries in by_array.items():
        entries.sort(key=lambda e: e.offset)
        total = sum(e.nbytes for e in entries)
        buf = whole[bases[aname] : bases[aname] + total]
        mv = memoryview(buf)
        arr = amap[aname]
        apath = _jp(vpath, manifest.data_id, aname, "c")
        groups: list[tuple[int, list[TensorEntry]]] = []  # (start in buf, tensors contiguous on disk)
        dst, gbytes = 0, 0
        for e in entries:
            prev = groups[-1][1][-1] if groups else None
            if prev is None or prev.offset + prev.nbytes != e.offset or gbytes >= group_bytes:
                groups.append((dst, []))
                gbytes = 0
            groups[-1][1].append(e)
            gbytes += e.nbytes
            placed.append((e, buf, dst))
            dst += e.nbytes
        for start, g in groups:
            check = bad if verify else None
            job = partial(_read_group, backend, apath, arr.chunk_bytes, mv, g, start, slice_bytes, check)
            jobs.append((sum(e.nbytes for e in g), job))
    jobs.sort(key=lambda j: -j[0])  # biggest first: the threads finish together
    run_jobs(pool, [j for _, j in jobs])
    out: dict[str, torch.Tensor] = {}
    flats = {id(buf): torch.from_numpy(buf) for _, buf, _ in placed}
    for e, buf, d in placed:
        tdtype = DTYPES[e.dtype][0]
        out[e.name] = flats[id(buf)][d : d + e.nbytes].view(tdtype).view(e.shape)
    order = manifest.names if names is None else list(names)
    return {n: out[n] for n in order}, bad


def _read_group(
    backend: Backend,
    apath: str,
    chunk_bytes: int,
    out: memoryview,
    group: list[TensorEntry],
    dst: int,
    slice_bytes: int,
    bad: list[str] | None,
) -> None:
    """Read tensors that are contiguous on disk (and in `out` from `dst`), hashing each slice as it lands."""
    base = group[0].offset
    total = sum(e.nbytes for e in group)
    hashers = [xxhash.xxh3_64() for _ in group] if bad is not None else None
    ends = list(accumulate(e.nbytes for e in group))  # group-relative end of each tensor
    ti = 0
    done = 0
    while done < total:
        ci, coff = divmod(base + done, chunk_bytes)
        take = min(total - done, chunk_bytes - coff, slice_bytes)
        backend.read_into(_jp(apath, str(ci)), coff, out[dst + done : dst + done + take])
        if hashers is not None:
            a, b = done, done + take
            j = ti
            while j < len(group):
                start = ends[j] - group[j].nbytes
                if start >= b:
                    break
                lo, hi = max(a, start), min(b, ends[j])
                if hi > lo:
                    hashers[j].update(out[dst + lo : dst + hi])
                if ends[j] <= b:
                    ti = j + 1
                j += 1
        done += take
    if hashers is not None:
        for e, h in zip(group, hashers):
            if h.hexdigest() != e.xxh3:
                bad.append(e.name)  # list.append is atomic: groups run on several threads


def copy_version(src: Backend, dst: Backend, manifest: Manifest, pool: Executor) -> bool:
    """Replicate a committed version file by file into another tier (same format, so bytes copy as-is).

    Used to fill the host tier behind a persistent-tier read; the checksums in the manifest still guard
    every later read of the copy. Returns False when `dst` already had the version committed.
    """
    data_id = new_data_id()
    model, version = manifest.model, manifest.version
    svpath = src.join(model, version_dir(version))
    dvpath = dst.join(model, version_dir(version))
    _ensure_groups(dst, model)
    ddpath = _jp(dvpath, data_id)
    futures = []
    for a in manifest.arrays:
        dc = _jp(ddpath, a.name, "c")
        dst.makedirs(dc)
        sa = _jp(svpath, manifest.data_id, a.name)
        futures.append(
            pool.submit(_copy_file, src, dst, _jp(sa, "zarr.json"), _jp(ddpath, a.name, "zarr.json"))
        )
        for i in range(a.nchunks):
            futures.append(pool.submit(_copy_file, src, dst, _jp(sa, "c", str(i)), _jp(dc, str(i))))
    for f in futures:
        f.result()
    dst.write_small(_jp(ddpath, "zarr.json"), group_json())
    moved = Manifest(
        model=model,
        version=version,
        data_id=data_id,
        tensors=manifest.tensors,
        arrays=manifest.arrays,
        created=manifest.created,
    )
    if dst.create_exclusive(_jp(dvpath, "zarr.json"), group_json({ATTR_KEY: moved.to_json()})):
        return True
    dst.remove_tree(ddpath)
    return False


def _copy_file(src: Backend, dst: Backend, sp: str, dp: str) -> None:
    from pivotrl.gps.backend import LocalBackend

    if isinstance(src, LocalBackend) and isinstance(dst, LocalBackend):
        import shutil

        shutil.copyfile(sp, dp)
        return
    dst.write_file(dp, [memoryview(src.read_small(sp))])


def now() -> float:
    return time.time()
