"""Benchmark of the Global Parameter Storage against raw file I/O and safetensors, side by side.

    python -m benchmarks.gps --quick --json OUT.json

A ~256 MB state dict with transformer shapes (bf16 matrices, fp32 embeddings/norms/biases, ~200 tensors)
is written and read by every contender in the same run, repeats interleaved round-robin so that machine
noise hits all of them alike; medians are reported. Ratios are ours ÷ theirs in bandwidth (> 1: we are
faster). No side fsyncs. `publish` is a synchronous publish into the persistent tier (write_behind=False:
data, metadata, checksums, exclusive commit), i.e. what a write-behind publish costs until `flush()`;
the time a write-behind `publish` takes to return is reported as an extra. `fetch` is a persistent-tier
fetch with the device tier off (checksums verified); `device_hit` is a device-tier hit that returns
caller-owned copies (the default), `device_hit_shared` one that returns the cached tensors (copy=False).
Reads are from page cache ("warm"); a cold variant drops the files from the page cache with
posix_fadvise(DONTNEED) (after fsync, outside the timing) and checks with `fincore` that the pages really
left the cache (on a VM the hypervisor may still cache the disk, so "cold" is a lower bound).

The raw-read baseline is the faster (by median) of `numpy.fromfile` and one `preadv` of the whole file into
one numpy buffer reused by every raw read, as a store's fetch lands in the buffer of its earlier fetch
(`pivotrl.gps.arena`): like for like, neither pays the first touch of fresh memory. Writes and reads run
in separate phases, in an order rotated every round, with an untimed `os.sync()` before every timed call,
so that background writeback of one contender never lands in another's timing.
One warm-up round is excluded from the medians.

`peer_fetch_vs_raw_read` (a fetch by a worker of one "node" that pulls the version from another node's
worker over Dask's loopback TCP comms, verified and committed into its node's tier, vs a raw read of the
same bytes) and `s3_fetch_vs_raw_read` (a fetch from a persistent tier on a local moto S3 server) come from
`benchmarks.gps_nodes`, which says how each is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.state_dicts import transformer_state_dict


def _drop_from_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of these files in the page cache, via util-linux `fincore`; None when it is unavailable."""
    import subprocess

    if not shutil.which("fincore") or not paths:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return sum(int(x) for x in out.stdout.split())


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def run(quick: bool, tmp_root: str | None) -> dict:
    import safetensors.torch as st

    from pivotrl.gps import ParameterStore
    from pivotrl.gps.layout import DEFAULT_CHUNK_BYTES

    torch.set_num_threads(1)
    repeats = 15 if quick else 31
    sd = transformer_state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    raw = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in sd.values()])
    tmp = Path(tempfile.mkdtemp(prefix="gps-bench-", dir=tmp_root))
    times: dict[str, list[float]] = {}
    try:
        raw_path, st_path = tmp / "raw.bin", tmp / "model.safetensors"
        writer = ParameterStore(tmp / "gps", write_behind=False, device_tier_bytes=0)
        reader = ParameterStore(tmp / "gps", device_tier_bytes=0)
        cached = ParameterStore(tmp / "gps", device_tier_bytes=4 * nbytes)
        behind = ParameterStore(tmp / "gps-wb", device_tier_bytes=2 * nbytes)
        version = iter(range(10**6))
        current = {"v": -1}

        def publish() -> None:
            current["v"] = next(version)
            writer.publish("bench", current["v"], sd)

        def publish_write_behind_return() -> None:
            behind.publish("bench", next(version), sd)

        def fetch() -> None:
            out = reader.fetch("bench", current["v"])
            assert len(out) == len(sd)

        def zarr_api_read() -> None:
            import zarr

            man = reader.manifest("bench", current["v"])
            g = zarr.open_group(str(tmp / "gps"), mode="r")[f"bench/v{current['v']:012d}/{man.data_id}"]
            for a in man.arrays:
                g[a.name][:]

        raw_buf: list[np.ndarray] = []  # one buffer for every raw read, as the store's read arena reuses its

        def raw_read() -> None:
            if not raw_buf or raw_buf[0].nbytes != raw_path.stat().st_size:
                raw_buf[:] = [np.empty(raw_path.stat().st_size, dtype=np.uint8)]
            buf = raw_buf[0]
            fd = os.open(raw_path, os.O_RDONLY)
            try:
                assert os.preadv(fd, [buf], 0) == buf.nbytes
            finally:
                os.close(fd)

        def alloc_touch() -> None:
            """Not a contender: first touch of fresh memory alone, to show how noisy this machine is."""
            np.empty(nbytes, dtype=np.uint8)[::4096] = 1

        def raw_fromfile() -> None:
            np.fromfile(raw_path, dtype=np.uint8)

        def st_load() -> None:
            {k: v.clone() for k, v in st.load_file(st_path).items()}

        hit_state: dict = {}

        def device_hit() -> None:
            cached.fetch("bench", hit_state["v"])

        def device_hit_shared() -> None:
            cached.fetch("bench", hit_state["v"], copy=False)

        write_ops: list[tuple[str, Callable[[], None]]] = [
            ("raw_write", lambda: (raw_path.unlink(missing_ok=True), raw.tofile(raw_path))),
            ("safetensors_save", lambda: (st_path.unlink(missing_ok=True), st.save_file(sd, st_path))),
            ("publish", publish),
        ]
        read_ops: list[tuple[str, Callable[[], None]]] = [
            ("raw_read", raw_read),
            ("raw_fromfile", raw_fromfile),
            ("safetensors_load", st_load),
            ("fetch", fetch),
            ("alloc_touch", alloc_touch),
        ]
        for r in range(repeats + 1):
            for ops in (write_ops, read_ops):
                # Rotate the order every round so no contender is always first or last.
                for name, fn in ops[r % len(ops) :] + ops[: r % len(ops)]:
                    # Untimed: write back every dirty page first, so that one contender's writeback (or
                    # dirty-page throttling) never lands in another's timing; every call starts alike.
                    os.sync()
                    t0 = time.perf_counter()
                    fn()
                    if r:  # round 0 is the warm-up
                        times.setdefault(name, []).append(time.perf_counter() - t0)
            # keep disk use bounded: only the newest version is needed (outside the timing)
            writer.gc("bench", keep_last=1)
        # zarr's own read path (an extra, not a contender of the ratios) runs after the main loop: its
        # thread pool and event loop measurably slowed every later fresh allocation in this process.
        for _ in range(3):
            os.sync()
            t0 = time.perf_counter()
            zarr_api_read()
            times.setdefault("zarr_api_read", []).append(time.perf_counter() - t0)
        hit_state["v"] = current["v"]
        cached.fetch("bench", hit_state["v"])
        for name, fn in [("device_hit", device_hit), ("device_hit_shared", device_hit_shared)]:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.setdefault(name, []).append(time.perf_counter() - t0)
        for _ in range(repeats):
            os.sync()
            t0 = time.perf_counter()
            publish_write_behind_return()
            times.setdefault("publish_write_behind_return", []).append(time.perf_counter() - t0)
            behind.flush()
            behind.gc("bench", keep_last=1)

        # Cold reads: drop each side's files from the page cache (outside the timing), then read.
        cold_ops = [
            ("raw_read_cold", [raw_path], raw_read),
            ("safetensors_load_cold", [st_path], st_load),
            ("fetch_cold", _files(tmp / "gps" / "bench"), fetch),
        ]
        resident_after_drop: list[int | None] = []
        for _ in range(3 if quick else 5):
            for name, paths, fn in cold_ops:
                _drop_from_cache(paths)
                resident_after_drop.append(_resident_bytes(paths))
                t0 = time.perf_counter()
                fn()
                times.setdefault(name, []).append(time.perf_counter() - t0)
        for s in (writer, reader, cached, behind):
            s.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    q1 = {k: statistics.quantiles(v, n=4)[0] for k, v in times.items() if len(v) >= 4}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    known = [r for r in resident_after_drop if r is not None]
    cold_effective = (max(known) == 0) if known else None
    raw_read_s = min(med["raw_read"], med["raw_fromfile"])  # the faster raw baseline: the stricter test
    ratios = {
        "fetch_vs_raw_read": raw_read_s / med["fetch"],
        "fetch_vs_safetensors": med["safetensors_load"] / med["fetch"],
        "publish_vs_raw_write": med["raw_write"] / med["publish"],
        "publish_vs_safetensors": med["safetensors_save"] / med["publish"],
        "device_hit_speedup": med["fetch"] / med["device_hit"],
    }
    # Node-local tiers and the object store (benchmarks/gps_nodes.py): their own clusters/servers, after the
    # main loop so they cannot disturb it.
    from benchmarks import gps_nodes

    peer = gps_nodes.peer_fetch(nbytes, 9 if quick else 15, tmp_root)
    s3 = gps_nodes.s3_fetch(transformer_state_dict(layers=2), 3 if quick else 7, tmp_root)
    ratios["peer_fetch_vs_raw_read"] = peer["ratio"]
    ratios["s3_fetch_vs_raw_read"] = s3["ratio"]
    return {
        "bytes": nbytes,
        "tensors": len(sd),
        "peer_fetch": peer,
        "s3_fetch": s3,
        "repeats": repeats,
        "chunk_bytes": DEFAULT_CHUNK_BYTES,
        "fsync": False,
        "median_s": med,
        "gbps": gbps,
        "all_s": times,
        "cold": {
            "method": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file, checked with fincore",
            "effective": cold_effective,
            "resident_bytes_after_drop": resident_after_drop,
            "fetch_vs_raw_read_cold": med["raw_read_cold"] / med["fetch_cold"],
            "fetch_vs_safetensors_cold": med["safetensors_load_cold"] / med["fetch_cold"],
        },
        "extra": {
            "device_hit_speedup_shared": med["fetch"] / med["device_hit_shared"],
            "fetch_vs_numpy_fromfile": med["raw_fromfile"] / med["fetch"],
            "zarr_api_read_vs_fetch": med["fetch"] / med["zarr_api_read"],
            "publish_write_behind_return_vs_publish": med["publish"] / med["publish_write_behind_return"],
            "peer_fetch_vs_raw_read_best": peer["ratio_best"],
            "peer_fetch_owned_vs_raw_read": peer["ratio_owned"],
            # Lower-quartile times: the ratios with this machine's random stalls (see alloc_touch) cut off.
            "fetch_vs_raw_read_q1": min(q1["raw_read"], q1["raw_fromfile"]) / q1["fetch"],
            "fetch_vs_safetensors_q1": q1["safetensors_load"] / q1["fetch"],
            "publish_vs_raw_write_q1": q1["raw_write"] / q1["publish"],
            "publish_vs_safetensors_q1": q1["safetensors_save"] / q1["publish"],
        },
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="15 repeats instead of 31 (under two minutes)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tmp", default=None, help="directory for the temporary files (default: system tmp)")
    args = ap.parse_args(argv)
    res = run(args.quick, args.tmp)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    print(f"state dict: {res['bytes'] / 1e6:.0f} MB in {res['tensors']} tensors, medians of {res['repeats']}")
    for k in sorted(res["gbps"]):
        print(f"  {k:32s} {res['median_s'][k] * 1e3:9.1f} ms  {res['gbps'][k]:7.2f} GB/s")
    cold = res["cold"]
    print(
        f"cold (page cache dropped: {cold['effective']}): fetch_vs_raw_read_cold="
        f"{cold['fetch_vs_raw_read_cold']:.2f} "
        f"fetch_vs_safetensors_cold={cold['fetch_vs_safetensors_cold']:.2f}"
    )
    for k, v in res["extra"].items():
        print(f"  {k} = {v:.2f}")
    print("ratios (ours / theirs in bandwidth; higher is better):")
    for k, v in res["ratios"].items():
        print(f"  {k} = {v:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
