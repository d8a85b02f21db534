"""Node-local GPS tiers on Dask: a holder registry on the scheduler, peer serving on every worker.

Each node keeps its own tiers (persistent tier on its NVMe, host tier in its /dev/shm: `gps.root` and
`gps.host_tier` may contain `{node}`), so no path is shared between nodes. A worker's node is `PIVOTRL_NODE`
(default: the host name). The paired plugins, in the shape of distributed's shuffle extension:

- `GPSRegistryPlugin` (scheduler): `pivotrl_gps_*` handlers keeping `core.locality.Holdings` (which node
  and worker holds which (model, version) in which tier), updated on publish (`register`), peer fill
  (`fill_done`), gc (`forget`) and worker loss; it answers `holders` with the nearest holders first
  (`core.locality.nearest_holders`), probing other nodes when nothing is registered (a version written by
  a process that never announced it). Fills are deduplicated per node: while one worker of a node pulls
  a version, another worker of that node asking for it waits, then reads its node's tiers, so each node
  pulls a version across the network once. It shares its holdings and fetch-time model with core's
  shift-cost model (φ) when the pivotrl scheduler plugin runs.
- `GPSWorkerPlugin` (worker): builds this worker's `ParameterStore` on its node's tiers, sets `DaskPeers` as
  its `peers`, and serves `pivotrl_gps_manifest` / `pivotrl_gps_read` (byte ranges of committed chunk
  files, off the event loop) / `pivotrl_gps_has` / `pivotrl_gps_drop`.

Transport: worker-to-worker RPC on Dask's comms; each range goes out-of-band (`to_serialize` of a numpy
buffer), so over TCP it is streamed in frames without a pickle copy. With UCX comms (dask-cuda / ucxx) the
same handlers run over UCX, but ranges are host buffers read from the host/persistent tier: device-memory
transfers over NVLink/InfiniBand (serving straight from a device tier) are not implemented or tested here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.protocol import to_serialize

from pivotrl.core.locality import FetchTier, FetchTimeModel, Holder, Holdings, Tier, nearest_holders
from pivotrl.gps.peer import (
    RangeRequest,
    serve_manifest,
    serve_range,
)
from pivotrl.runtime.gps_peers import DaskPeers

logger = logging.getLogger(__name__)

PLUGIN_NAME = "pivotrl-gps"
_LEAD = np.zeros(1, dtype=np.uint8)
NODE_ENV = "PIVOTRL_NODE"


def node_name(explicit: str | None = None) -> str:
    """This process's node: `explicit`, else $PIVOTRL_NODE, else the host name."""
    return explicit or os.environ.get(NODE_ENV) or socket.gethostname()


def node_path(path: str | os.PathLike[str] | None, node: str) -> str | None:
    """A tier location with `{node}` replaced by the node's name (per-node directories)."""
    return None if path is None else os.fspath(path).replace("{node}", node)


# =================================================================================== scheduler side
class GPSRegistryPlugin(SchedulerPlugin):
    """Register with `client.register_plugin(GPSRegistryPlugin())` before the workers' `GPSWorkerPlugin`."""

    name = PLUGIN_NAME

    def __init__(self, fill_wait_s: float = 300.0) -> None:
        self.fill_wait_s = fill_wait_s
        self.holdings = Holdings()
        self.fetch = FetchTimeModel()
        self.pulls: list[dict[str, Any]] = []  # one record per peer fill, for tests and the log
        self._fills: dict[tuple[str, int, str], tuple[str, asyncio.Event]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("scheduler", None)
        state["_fills"] = {}
        return state

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "pivotrl_gps_join": self.handle_join,
            "pivotrl_gps_register": self.handle_register,
            "pivotrl_gps_holders": self.handle_holders,
            "pivotrl_gps_fill_done": self.handle_fill_done,
            "pivotrl_gps_forget": self.handle_forget,
            "pivotrl_gps_state": self.handle_state,
        })
        attach_locality(scheduler)

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str = "", **kwargs: Any) -> None:
        self.holdings.lose(worker)
        for key, (filler, event) in list(self._fills.items()):
            if filler == worker:  # its waiters go on: they find no local copy and pull themselves
                event.set()
                del self._fills[key]

    def _log(self, **record: Any) -> None:
        with contextlib.suppress(Exception):
            self.scheduler.log_event(PLUGIN_NAME, record)

    # -- handlers -------------------------------------------------------------------------------------
    def handle_join(self, worker: str, node: str) -> None:
        self.holdings.join(worker, node)

    def handle_register(self, model: str, version: int, node: str, tier: str, nbytes: int | None = None,
                        worker: str = "") -> None:
        self.holdings.add(model, int(version), Holder(node, worker, Tier(tier)), nbytes)
        self._log(action="gps-register", model=model, version=version, node=node, tier=tier)

    async def handle_holders(self, model: str, version: int, node: str, worker: str = "",
                             stale_local: bool = False) -> dict[str, Any]:
        """Holders for `worker` on `node` to pull from, best first; `local` when its node got the version
        while it waited (another worker of the node pulled it). `stale_local`: the worker found no copy
        where the registry said its node had one; that record is dropped."""
        version = int(version)
        key = (model, version, node)
        if stale_local:
            self.holdings.drop(model, [version], node=node)
        fill = self._fills.get(key)
        if fill is not None and fill[0] != worker:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fill[1].wait(), self.fill_wait_s)
        if any(h.node == node and not h.worker for h in self.holdings.holders(model, version)):
            return {"local": True, "holders": []}
        order = nearest_holders(self.holdings.sources(model, version), node, exclude=[worker])
        if not order:
            await self._probe(model, version, exclude=worker)
            order = nearest_holders(self.holdings.sources(model, version), node, exclude=[worker])
        if order and key not in self._fills:
            self._fills[key] = (worker, asyncio.Event())
        return {"local": False, "holders": [h.to_wire() for h in order]}

    async def _probe(self, model: str, version: int, exclude: str) -> None:
        """Ask one worker per node whether its node's tiers hold the version (nobody announced it)."""
        per_node: dict[str, str] = {}
        for w, n in sorted(self.holdings.nodes.items()):
            if w != exclude:
                per_node.setdefault(n, w)
        if not per_node:
            return
        replies = await self.scheduler.broadcast(
            msg={"op": "pivotrl_gps_has", "model": model, "version": version},
            workers=list(per_node.values()), on_error="return",
        )
        for w, got in replies.items():
            if isinstance(got, dict) and w in self.holdings.nodes:
                node = self.holdings.nodes[w]
                self.holdings.add(model, version, Holder(node, "", Tier(got["tier"])), got.get("nbytes"))

    def handle_fill_done(self, model: str, version: int, node: str, worker: str, ok: bool,
                         tiers: list[str] | None = None, nbytes: int = 0, seconds: float = 0.0,
                         fetch_tier: str | None = None, served_by: dict[str, int] | None = None,
                         lost: list[str] | None = None) -> None:
        version = int(version)
        for tier in tiers or []:
            self.holdings.add(model, version, Holder(node, "", Tier(tier)), nbytes or None)
        if ok and fetch_tier is not None:
            self.fetch.observe(FetchTier(fetch_tier), nbytes, seconds)
        record = dict(model=model, version=version, node=node, worker=worker, ok=ok, nbytes=nbytes,
                      seconds=seconds, fetch_tier=fetch_tier, served_by=served_by or {}, lost=lost or [])
        self.pulls.append(record)
        self._log(action="gps-fill", **record)
        fill = self._fills.pop((model, version, node), None)
        if fill is not None:
            fill[1].set()

    async def handle_forget(self, model: str, versions: list[int], node: str) -> None:
        """`node` deleted `versions` (gc): every other node deletes its copies too (one worker per node
        does it for the node's directories)."""
        versions = [int(v) for v in versions]
        self.holdings.drop(model, versions)
        per_node: dict[str, str] = {}
        for w, n in sorted(self.holdings.nodes.items()):
            if n != node:
                per_node.setdefault(n, w)
        if per_node:
            await self.scheduler.broadcast(
                msg={"op": "pivotrl_gps_drop", "model": model, "versions": versions},
                workers=list(per_node.values()), on_error="return",
            )

    def handle_state(self) -> dict[str, Any]:
        return {
            "nodes": dict(self.holdings.nodes),
            "copies": {f"{m}@{v}": [h.to_wire() for h in sorted(hs)]
                       for (m, v), hs in self.holdings.copies.items()},
            "pulls": list(self.pulls),
            "fetch_bps": {t.value: b for t, b in self.fetch.bps.items()},
        }


def attach_locality(scheduler: Any) -> None:
    """Share the registry's holdings and fetch-time model with core's shift-cost model (φ), when both
    the pivotrl scheduler plugin and this one run (called by whichever of the two starts last)."""
    gps = scheduler.plugins.get(PLUGIN_NAME)
    main = scheduler.plugins.get("pivotrl")
    if gps is None or main is None:
        return
    from pivotrl.core.locality import Locality
    from pivotrl.core.types import Role

    orch = main.orch
    role_models = {
        Role(r): str(spec["model"])
        for r, spec in orch.role_specs.items()
        if r in Role._value2member_map_ and spec.get("model")
    }
    orch.ctl.shift_costs.locality = Locality(holdings=gps.holdings, fetch=gps.fetch, role_models=role_models)


# =================================================================================== worker side
class GPSWorkerPlugin(WorkerPlugin):
    """This worker's parameter store on its node's tiers, and the handlers that serve it to peers."""

    name = PLUGIN_NAME

    def __init__(self, gps: dict[str, Any] | None = None, storage_root: str = "storage",
                 node: str | None = None, device: str = "cpu") -> None:
        self.gps_options = dict(gps or {})
        self.storage_root = storage_root
        self.node_option = node
        self.device = "cuda:0" if device == "cuda" else device

    async def setup(self, worker: Any) -> None:
        from pivotrl.gps import ParameterStore

        self.worker = worker
        self.node = node_name(self.node_option)
        opts = dict(self.gps_options)
        default_root = os.path.join(self.storage_root, "{node}", "gps")
        root = node_path(opts.pop("root", None) or default_root, self.node)
        host = node_path(opts.pop("host_tier", None), self.node)
        self.store = ParameterStore(root, host_tier=host, device=self.device, **opts)
        tier = Tier.HOST if host is not None else Tier.PERSISTENT
        self.peers = DaskPeers(worker.rpc, worker.scheduler, worker.loop.asyncio_loop, self.node,
                               worker.address, tier)
        self.store.peers = self.peers
        worker.handlers.update({
            "pivotrl_gps_manifest": self.handle_manifest,
            "pivotrl_gps_read": self.handle_read,
            "pivotrl_gps_has": self.handle_has,
            "pivotrl_gps_drop": self.handle_drop,
        })
        await worker.scheduler.pivotrl_gps_join(worker=worker.address, node=self.node)

    async def teardown(self, worker: Any) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            await asyncio.to_thread(store.close)

    async def handle_manifest(self, model: str, version: int) -> dict[str, Any] | None:
        return await asyncio.to_thread(serve_manifest, self.store, model, int(version))

    async def handle_read(self, req: dict[str, Any]) -> Any:
        """A byte range, sent after a one-byte lead buffer. Why the lead: Dask's TCP comm reads the message
        header together with the first buffer into one allocation (the range would start at an odd
        offset there); a second buffer gets an allocation of its own, aligned, which the reader keeps as
        the tensors' memory instead of copying it (`gps.peer`, which copies whatever is misaligned)."""
        data = await asyncio.to_thread(serve_range, self.store, RangeRequest.from_wire(req))
        return None if data is None else to_serialize((_LEAD, data))

    async def handle_has(self, model: str, version: int) -> dict[str, Any] | None:
        def has() -> dict[str, Any] | None:
            for tier, backend in self.store._tiers():
                with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                    from pivotrl.gps import layout

                    man = layout.read_manifest(backend, model, int(version))
                    return {"tier": tier, "nbytes": man.nbytes}
            return None

        return await asyncio.to_thread(has)

    async def handle_drop(self, model: str, versions: list[int]) -> list[int]:
        return await asyncio.to_thread(self.peers.drop, self.store, model, list(versions))
