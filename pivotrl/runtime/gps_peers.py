"""`DaskPeers`: the `PeerSource` of a parameter store on a Dask worker or on the driver.

It asks the scheduler's GPS registry (`pivotrl.runtime.gps_plugin`) for the nearest holders, pulls byte
ranges from them with worker-to-worker RPC (`pivotrl_gps_manifest`, `pivotrl_gps_read`), and lands the
version in the node's fastest tier behind the fetch (`pull(..., land_behind=True)`, then `PullResult.land`
on the store's write-behind thread; a caller that may write to its tensors gets a copy, which costs less
than writing the tier on its path). Once landed it reports the pull (`fill_done`, which releases the
node's other workers waiting for the same version) and copies into the node's slower tier. Called from
threads (role hosts, the driver), never on the event loop it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

from pivotrl.core.locality import FetchTier, Holder, Tier
from pivotrl.gps.errors import NotFoundError
from pivotrl.gps.manifest import Manifest
from pivotrl.gps.packed import packed_clone
from pivotrl.gps.peer import (
    Committed,
    PeerLost,
    PullResult,
    RangeRequest,
    commit_local,
    landed,
    landing_tier,
    pull,
    replicate,
)

logger = logging.getLogger(__name__)

_PEER_ERRORS = (OSError, asyncio.TimeoutError, EOFError)


class DaskPeers:
    """The `PeerSource` of a store on a Dask worker (or on the driver, with the client's comms)."""

    def __init__(self, rpc: Any, scheduler: Any, loop: asyncio.AbstractEventLoop, node: str, address: str,
                 tier: Tier, timeout_s: float = 60.0) -> None:
        self.rpc = rpc
        self.scheduler = scheduler
        self.loop = loop
        self.node = node
        self.address = address
        self.tier = tier
        self.timeout_s = timeout_s
        self._dropping = threading.local()

    @classmethod
    def for_client(cls, client: Any, node: str, tier: Tier) -> DaskPeers:
        """The driver's: it pulls like a worker and announces its publishes, but serves nothing."""
        return cls(client.rpc, client.scheduler, client.loop.asyncio_loop, node, "", tier)

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self.loop:
                coro.close()
                raise RuntimeError("DaskPeers is called from threads, never on its event loop")
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(coro, timeout or self.timeout_s), self.loop
        )
        return fut.result()

    # -- RangeSource ----------------------------------------------------------------------------------
    def manifest(self, holder: str, model: str, version: int) -> Manifest:
        try:
            got = self._run(self.rpc(holder).pivotrl_gps_manifest(model=model, version=version))
        except _PEER_ERRORS as exc:
            raise PeerLost(f"{holder}: {type(exc).__name__}: {exc}") from None
        if got is None:
            raise PeerLost(f"{holder} does not hold {model!r} version {version}")
        return Manifest.from_json(got)

    def read(self, holder: str, req: RangeRequest) -> Any:
        try:
            got = self._run(self.rpc(holder).pivotrl_gps_read(req=req.to_wire()))
        except _PEER_ERRORS as exc:
            raise PeerLost(f"{holder}: {type(exc).__name__}: {exc}") from None
        if got is None:
            raise PeerLost(f"{holder} no longer holds {req.model!r} version {req.version}")
        return got[1] if isinstance(got, tuple) else got  # (lead, range): see GPSWorkerPlugin.handle_read

    # -- PeerSource -----------------------------------------------------------------------------------
    def fill(self, store: Any, model: str, version: int, wanted: list[str] | None, *,
             shared: bool = False) -> Any:
        t0 = time.perf_counter()
        ask = dict(model=model, version=version, node=self.node, worker=self.address)
        reply = self._run(self.scheduler.pivotrl_gps_holders(**ask), timeout=self.timeout_s * 10)
        if reply["local"]:
            try:
                return store._read_through(model, version, wanted, ask_peers=False)
            except NotFoundError:  # the registry's record of this node is stale: correct it, pull
                reply = self._run(self.scheduler.pivotrl_gps_holders(**ask, stale_local=True))
        holders = [Holder.from_wire(h) for h in reply["holders"]]
        if not holders:
            raise NotFoundError(f"{model!r} version {version}: not in this node's tiers and no peer holds it")
        done = dict(model=model, version=version, node=self.node, worker=self.address)
        land = landing_tier(store)
        behind = land is not None  # the node's tier is written behind the return, from the pulled memory
        try:
            res = pull(store, model, version, [h.worker for h in holders], self,
                       land=land[1] if land is not None else None, land_behind=behind)
        except BaseException:
            with contextlib.suppress(Exception):
                self._run(self.scheduler.pivotrl_gps_fill_done(**done, ok=False))
            raise
        nodes = {h.worker: h.node for h in holders}
        main = max(res.served_by, key=res.served_by.__getitem__)
        ftier = FetchTier.PEER_NODE if nodes.get(main) == self.node else FetchTier.PEER_REMOTE
        report = dict(done, nbytes=res.manifest.nbytes, seconds=time.perf_counter() - t0,
                      fetch_tier=ftier.value, served_by=res.served_by, lost=res.lost)
        tensors = res.tensors if wanted is None else {n: res.tensors[n] for n in wanted}
        if behind and not shared:  # the caller may write to what it gets: its own copy, not the landing's
            tensors = packed_clone(tensors)  # (before the landing starts: both would fault in fresh pages)
        if behind:
            assert land is not None
            store._track(store._bg.submit(self._land_behind, store, res, land, report))
        else:
            done_at = landed(store, res, land[0]) if land is not None else commit_local(store, res)
            self._report(done_at, report)
            if done_at.rest:  # the slower node tiers behind the fetch, from the committed copy
                store._track(store._bg.submit(self._replicate, store, done_at))
        return tensors, res.manifest

    def _report(self, done_at: Committed, report: dict[str, Any]) -> None:
        """`fill_done`: the registry learns the node's new copy and releases its workers waiting for it."""
        with contextlib.suppress(Exception):
            self._run(self.scheduler.pivotrl_gps_fill_done(
                **report, ok=True, tiers=[done_at.tier] if done_at.tier else []))

    def _land_behind(
        self, store: Any, res: PullResult, land: tuple[str, Any], report: dict[str, Any]
    ) -> None:
        """On the store's write-behind thread: land a verified pull, report it, fill the slower tiers. A
        failure costs only the node's copy (logged; the node's next reader pulls again), never the store."""
        man = res.manifest
        try:
            res.land(land[1])
        except Exception:
            logger.warning("pivotrl-gps: landing %s v%s in the %s tier failed", man.model, man.version,
                           land[0], exc_info=True)
            self._report(Committed(None, man), report)
            return
        done_at = landed(store, res, land[0])
        res.pieces = []  # the landed copy is the source from here on
        self._report(done_at, report)
        with contextlib.suppress(Exception):
            self._replicate(store, done_at)

    def _replicate(self, store: Any, done: Any) -> None:
        man = done.manifest
        for tier in replicate(store, done):
            self.announce_tier(man.model, man.version, man.nbytes, Tier(tier))

    def announce(self, model: str, version: int, nbytes: int) -> None:
        self.announce_tier(model, version, nbytes, self.tier)

    def announce_tier(self, model: str, version: int, nbytes: int, tier: Tier) -> None:
        try:
            self._run(self.scheduler.pivotrl_gps_register(
                model=model, version=version, node=self.node, tier=tier.value, nbytes=nbytes
            ))
        except Exception:  # a lost announcement only costs a probe later
            logger.warning("pivotrl-gps: announcing %s v%s failed", model, version, exc_info=True)

    def forget(self, model: str, versions: list[int]) -> None:
        if getattr(self._dropping, "active", False):
            return  # deleting on another node's request: that node already told the registry
        try:
            self._run(self.scheduler.pivotrl_gps_forget(model=model, versions=list(versions), node=self.node))
        except Exception:
            logger.warning("pivotrl-gps: gc of %s %s not propagated", model, versions, exc_info=True)

    def drop(self, store: Any, model: str, versions: list[int]) -> list[int]:
        """Delete versions from this node's tiers on another node's gc (not announced again)."""
        self._dropping.active = True
        try:
            have = set(store.versions(model))
            return store._delete_versions(model, [int(v) for v in versions if int(v) in have])
        finally:
            self._dropping.active = False
