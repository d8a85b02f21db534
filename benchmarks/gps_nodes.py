"""The node-local and object-store halves of `benchmarks.gps`: peer fetch and S3 fetch vs a raw local read.

- `peer_fetch_vs_raw_read`: two "nodes" on this machine (one worker process each, own directories, Dask's
  TCP comms over loopback). Node a publishes a version; the worker of node b fetches it (it misses its own
  tiers, pulls every byte range from node a's worker, verifies checksums) and, in the same task, reads a
  file of the same size with one `preadv` (the raw read, from page cache). The fetch is read-only
  (`copy=False`, as a role shift's weight load): its landing in node b's host tier runs behind it. Owning
  fetches (`copy=True`: the landing on the fetch's path) alternate with them and are reported beside
  (`ratio_owned`). Repeats alternate which goes first; background work (the landing and the copy into node
  b's persistent tier behind the fetch, dirty pages) is finished, untimed, before each timed call. Ratio =
  raw-read / peer-fetch time (medians).
- `s3_fetch_vs_raw_read`: a persistent tier at an s3:// URL on a local moto server (a Python HTTP server,
  so this is a lower bound for a real object store's per-request cost, not its bandwidth); ratio of a
  raw read of the same bytes to a `fetch` (device tier off, checksums verified). Reported, no target.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _raw_read(path: str) -> float:
    t0 = time.perf_counter()
    buf = np.empty(os.path.getsize(path), dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [buf], 0) == buf.nbytes
    finally:
        os.close(fd)
    took = time.perf_counter() - t0
    del buf
    return took


def _worker_store() -> Any:
    from distributed import get_worker

    return get_worker().plugins["pivotrl-gps"].store


_SD: dict[str, torch.Tensor] = {}


def _publish(version: int) -> int:
    """On node a's worker: publish the benchmark state dict (built there once: bf16 tensors cannot travel as
    Dask data, and need not: GPS moves them)."""
    if not _SD:
        from benchmarks.state_dicts import transformer_state_dict

        _SD.update(transformer_state_dict())
    store = _worker_store()
    store.publish("bench", version, _SD)
    store.flush()
    return sum(t.numel() * t.element_size() for t in _SD.values())


def _fetch_and_raw(version: int, raw_path: str, copy: bool = False) -> tuple[float, float, int]:
    """On node b's worker: one peer fetch of `version` and one raw read, in alternating order. `copy=False`
    is the read-only fetch a role shift makes (its node-tier landing runs behind it); `copy=True` gets the
    caller its own memory, so the landing is on the fetch's path."""
    torch.set_num_threads(1)
    store = _worker_store()

    def quiesce() -> None:
        """Untimed: the copy into the node's slower tier that runs behind a fetch, and every dirty page,
        are done before the next timed call, so neither lands in the other contender's timing."""
        store.flush()
        os.sync()

    raw_first = version % 2 == 0
    quiesce()
    raw = _raw_read(raw_path) if raw_first else 0.0
    quiesce()
    t0 = time.perf_counter()
    out = store.fetch("bench", version, copy=copy)
    peer = time.perf_counter() - t0
    got = sum(t.numel() * t.element_size() for t in out.values())
    del out  # freed before the raw read, as the raw read's buffer is before the fetch: same memory state
    quiesce()
    if not raw_first:
        raw = _raw_read(raw_path)
    return peer, raw, got


def _gc(keep: int) -> None:
    _worker_store().gc("bench", keep_last=keep)


def peer_fetch(nbytes: int, repeats: int, tmp_root: str | None) -> dict[str, Any]:
    from distributed import Client

    from pivotrl.runtime.local_nodes import install_gps, nodes_cluster, workers_by_node

    tmp = Path(tempfile.mkdtemp(prefix="gps-nodes-bench-", dir=tmp_root))
    raw_path = tmp / "raw.bin"
    np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tofile(raw_path)
    peer_s: list[float] = []
    owned_s: list[float] = []
    raw_s: list[float] = []
    with nodes_cluster({"a": 1, "b": 1}) as cl, Client(cl) as client:
        client.wait_for_workers(2, timeout=120)
        install_gps(client, tmp)
        nodes = workers_by_node(client)
        a, b = nodes["a"][0], nodes["b"][0]
        for v in range(2 * (repeats + 1)):
            copy = v % 4 in (1, 2)  # read-only and owning fetches alternate, each raw read first or second
            assert client.submit(_publish, v, workers=[a], pure=False).result() == nbytes
            p, r, got = client.submit(_fetch_and_raw, v, str(raw_path), copy, workers=[b],
                                      pure=False).result()
            assert got == nbytes
            if v >= 2:  # round 0 warms up both sides (imports, connections, page cache of the raw file)
                (owned_s if copy else peer_s).append(p)
                raw_s.append(r)
            client.submit(_gc, 1, workers=[a], pure=False).result()
        pulls = client.sync(client.scheduler.pivotrl_gps_state)["pulls"]
    shutil.rmtree(tmp, ignore_errors=True)
    assert all(p["ok"] and p["fetch_tier"] == "peer_remote" for p in pulls), pulls
    med_p, med_o, med_r = statistics.median(peer_s), statistics.median(owned_s), statistics.median(raw_s)
    return {
        "bytes": nbytes,
        "repeats": repeats,
        "fetch": "read-only (copy=False, as a role shift fetches): the node-tier landing runs behind it",
        "median_s": {"peer_fetch": med_p, "peer_fetch_owned": med_o, "raw_read": med_r},
        "gbps": {"peer_fetch": nbytes / med_p / 1e9, "peer_fetch_owned": nbytes / med_o / 1e9,
                 "raw_read": nbytes / med_r / 1e9},
        "all_s": {"peer_fetch": peer_s, "peer_fetch_owned": owned_s, "raw_read": raw_s},
        "ratio": med_r / med_p,
        "ratio_owned": med_r / med_o,  # copy=True: the landing in the node's host tier on the fetch's path
        # Best against best: on a loaded box the raw read's medians swing 10x (page faults, other jobs);
        # the fastest of each is the closest to what the two cost on a quiet machine.
        "ratio_best": min(raw_s) / min(peer_s),
    }


def s3_fetch(sd: dict[str, torch.Tensor], repeats: int, tmp_root: str | None) -> dict[str, Any]:
    import uuid

    import s3fs
    from moto.server import ThreadedMotoServer

    from pivotrl.gps import ParameterStore

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    tmp = Path(tempfile.mkdtemp(prefix="gps-s3-bench-", dir=tmp_root))
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        raw_path = tmp / "raw.bin"
        np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tofile(raw_path)
        fetch_s: list[float] = []
        raw_s: list[float] = []
        with ParameterStore(f"s3://{bucket}/gps", write_behind=False, device_tier_bytes=0) as store:
            store.publish("bench", 0, sd)
            for r in range(repeats + 1):
                raw = _raw_read(str(raw_path))
                t0 = time.perf_counter()
                store.fetch("bench", 0)
                took = time.perf_counter() - t0
                if r:
                    fetch_s.append(took)
                    raw_s.append(raw)
        med_f, med_r = statistics.median(fetch_s), statistics.median(raw_s)
        return {
            "bytes": nbytes,
            "repeats": repeats,
            "server": "moto (ThreadedMotoServer, 127.0.0.1)",
            "median_s": {"s3_fetch": med_f, "raw_read": med_r},
            "gbps": {"s3_fetch": nbytes / med_f / 1e9, "raw_read": nbytes / med_r / 1e9},
            "ratio": med_r / med_f,
        }
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
