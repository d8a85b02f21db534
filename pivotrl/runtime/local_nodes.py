"""A "multi-node" Dask cluster on one machine: worker processes tagged with node names (PIVOTRL_NODE), each
node with its own GPS persistent and host-tier directories (no path in common), all on 127.0.0.1.

For tests, benchmarks and trying node-local tiers without a second machine; a real multi-node cluster starts
`dask worker` per node with PIVOTRL_NODE set (or nothing: the host name is the node)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pivotrl.runtime.gps_plugin import GPSRegistryPlugin, GPSWorkerPlugin


def node_dirs(root: Path) -> dict[str, str]:
    """The GPS options every worker gets; `{node}` makes each node's directories its own."""
    return {"root": str(root / "{node}" / "nvme" / "gps"), "host_tier": str(root / "{node}" / "shm" / "gps")}


@contextlib.contextmanager
def nodes_cluster(nodes: dict[str, int], threads: int = 1, extra_env: dict[str, str] | None = None
                  ) -> Iterator[Any]:
    """A SpecCluster with `nodes[name]` worker processes per node name (nanny-managed, so a killed worker
    process is restarted under a new address); yields the cluster."""
    from distributed import Nanny, Scheduler, SpecCluster

    env = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "TORCH_EXTENSIONS_DIR")}
    env.update(extra_env or {})
    workers = {
        f"{node}{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": threads, "host": "127.0.0.1", "memory_limit": 0, "resources": {"device": 1},
                "env": {**env, "PIVOTRL_NODE": node, "OMP_NUM_THREADS": "1"},
            },
        }
        for node, n in nodes.items()
        for i in range(n)
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}}
    cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40)
    try:
        yield cluster
    finally:
        cluster.close()


def install_gps(client: Any, root: Path, **gps: Any) -> None:
    client.register_plugin(GPSRegistryPlugin())
    client.register_plugin(GPSWorkerPlugin(gps={**node_dirs(root), "device_tier_bytes": 0, **gps}))


def workers_by_node(client: Any) -> dict[str, list[str]]:
    state = client.sync(client.scheduler.pivotrl_gps_state)
    out: dict[str, list[str]] = {}
    for w, n in sorted(state["nodes"].items()):
        out.setdefault(n, []).append(w)
    return out
