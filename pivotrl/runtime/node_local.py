"""Node-local GPS tiers for a pipeline run (`gps.node_local: true`): where each node's tiers are, and the
driver's part in peer fetch.

Why the driver takes part: it publishes every policy version into its own node's tiers and reads the
gradient sums that train workers publish into theirs, so its store needs peers too (through the client's
comms); it serves nothing, its node's workers serve what it wrote (their directories are the same), so the
driver must run on a node with a device worker (or the persistent tier must be a shared object store).

Tier locations are templates: `{node}` is replaced by each process's node name (`PIVOTRL_NODE`, default the
host name). A configured root or host tier without `{node}` gets `/{node}` appended, except an object-store
URL (`s3://...`), which stays one shared persistent tier; then only the host tiers are per node.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from pivotrl.core.locality import Tier
from pivotrl.runtime.gps_peers import DaskPeers
from pivotrl.runtime.gps_plugin import node_name, node_path


def _template(path: str | None) -> str | None:
    if path is None or "{node}" in path or "://" in path:
        return path
    return os.path.join(os.path.abspath(path), "{node}")


def node_local_templates(cfg: Any, gps_root: str, host: str | None) -> dict[str, str | None]:
    """The workers' `root` / `host_tier` options: per-node templates."""
    return {"root": _template(gps_root), "host_tier": _template(host)}


@contextlib.contextmanager
def node_local_tiers(cfg: Any, gps_root: str, host: str | None) -> Iterator[tuple[str, str | None]]:
    """The driver's own (root, host tier): its node's instance of the templates (unchanged without
    `node_local`). A context manager so it sits in the run's `with` beside the host tier's lease."""
    if not cfg.gps.node_local:
        yield gps_root, host
        return
    me = node_name()
    root = node_path(_template(gps_root), me)
    assert root is not None
    yield root, node_path(_template(host), me)


@contextlib.contextmanager
def driver_peers(store: Any, client: Any) -> Iterator[None]:
    """Give the driver's store peers for the life of the cluster; detached before the client closes, so a
    late write-behind announcement never waits on a closed connection."""
    tier = Tier.HOST if store.host is not None else Tier.PERSISTENT
    store.flush()
    peers = DaskPeers.for_client(client, node_name(), tier)
    for model in store.models():  # what it wrote before the cluster was up (version 0, a restore)
        for v in store.versions(model):
            peers.announce(model, v, store.manifest(model, v).nbytes)
    store.peers = peers
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            store.flush()
        store.peers = None
