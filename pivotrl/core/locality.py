"""Where weights are, and how long a device takes to get them: the pure half of node-local GPS tiers.

Nodes have their own storage (a persistent tier on NVMe, a host tier in /dev/shm), so the time a device needs
to fetch a (model, version) depends on where copies are: its own device memory, its node's tiers, a peer on
its node, a peer on another node, or an object store. This module answers two questions for the runtime and
for the planner, with no I/O and no clock:

- `nearest_holders`: which holders a worker should pull from, best first (same node before other nodes,
  faster tiers first; ties by worker address so every caller agrees), for peer fetch and its fallbacks;
- `FetchTimeModel`: seconds per byte per `FetchTier`, learned from measured fetches (an EWMA of bandwidth,
  with priors), so φ (`ShiftCostModel.fetch_delta`) prefers donors that already hold a role's weights.

`Holdings` is the state behind both: which node (and which worker) holds which (model, version) in which
tier, updated by the scheduler's GPS registry on publish, fill, probe and gc, and by workers leaving.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from pivotrl.core.types import Role


class Tier(StrEnum):
    """Where one holder keeps a version (its own tiers; see `FetchTier` for what a reader pays)."""

    DEVICE = "device"
    HOST = "host"
    PERSISTENT = "persistent"


_TIER_RANK = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.PERSISTENT: 2}


class FetchTier(StrEnum):
    """Where a fetch is served from, seen from the reader: what the fetch-time model is keyed by."""

    DEVICE = "device"  # the reader's own device tier
    HOST = "host"  # its node's host tier (/dev/shm)
    PERSISTENT = "persistent"  # its node's persistent tier (NVMe)
    PEER_NODE = "peer_node"  # a worker on the same node (held only in that worker's device memory)
    PEER_REMOTE = "peer_remote"  # a worker on another node, over the network
    OBJECT_STORE = "object_store"  # a shared persistent tier at a URL (s3://, gs://)


#: Bytes per second before anything is measured: orders of magnitude right, so the order of tiers holds.
PRIOR_BPS: dict[FetchTier, float] = {
    FetchTier.DEVICE: 50e9,
    FetchTier.HOST: 8e9,
    FetchTier.PERSISTENT: 2e9,
    FetchTier.PEER_NODE: 4e9,
    FetchTier.PEER_REMOTE: 1e9,
    FetchTier.OBJECT_STORE: 0.3e9,
}


@dataclass(frozen=True, order=True)
class Holder:
    """One copy of a version: in `tier` on `node`. `worker` is the address of the worker whose device tier
    holds it, or "" for a copy in a node's host or persistent tier (directories every worker of the node
    reads, whoever wrote them: a worker or the driver). `Holdings.sources` expands "" to live workers."""

    node: str
    worker: str
    tier: Tier

    def to_wire(self) -> dict[str, str]:
        return {"node": self.node, "worker": self.worker, "tier": self.tier.value}

    @classmethod
    def from_wire(cls, d: Mapping[str, str]) -> Holder:
        return cls(str(d["node"]), str(d["worker"]), Tier(d["tier"]))


def nearest_holders(holders: Iterable[Holder], node: str, exclude: Iterable[str] = ()) -> list[Holder]:
    """Holders to pull from, best first: same node before other nodes, then by tier, then by address.

    Holders without a worker (see `Holdings.sources`) cannot serve, and `exclude`d workers (the reader
    itself, holders that already failed) are left out. One entry per worker (its best tier).
    """
    skip = set(exclude)
    best: dict[str, Holder] = {}
    for h in holders:
        if not h.worker or h.worker in skip:
            continue
        cur = best.get(h.worker)
        if cur is None or _TIER_RANK[h.tier] < _TIER_RANK[cur.tier]:
            best[h.worker] = h
    return sorted(best.values(), key=lambda h: (h.node != node, _TIER_RANK[h.tier], h.worker))


def fetch_tier(
    worker: str, node: str, holders: Iterable[Holder], object_store: bool = False
) -> FetchTier | None:
    """The tier `worker` on `node` would fetch from given `holders`; None when nothing holds the version.

    A copy in a node's host or persistent tier is shared by every worker of that node (they are
    directories); a copy in a device tier only by its own worker (others pull it as a same-node peer).
    """
    hs = list(holders)
    own = [h.tier for h in hs if h.worker == worker and h.tier is Tier.DEVICE]
    if own:
        return FetchTier.DEVICE
    on_node = [h for h in hs if h.node == node]
    if any(h.tier is Tier.HOST for h in on_node):
        return FetchTier.HOST
    if any(h.tier is Tier.PERSISTENT for h in on_node):
        return FetchTier.PERSISTENT
    if on_node:  # only other workers' device copies are left on this node
        return FetchTier.PEER_NODE
    if object_store:  # the store reads its (shared) persistent tier before it asks peers
        return FetchTier.OBJECT_STORE
    return FetchTier.PEER_REMOTE if hs else None


class FetchTimeModel:
    """Bandwidth per `FetchTier` (EWMA over measured fetches, bytes/s), priors until measured."""

    def __init__(self, alpha: float = 0.3, prior_bps: Mapping[FetchTier, float] | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"fetch-time alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.bps: dict[FetchTier, float] = dict(PRIOR_BPS if prior_bps is None else prior_bps)
        self.samples: dict[FetchTier, int] = {}

    def observe(self, tier: FetchTier, nbytes: int, seconds: float) -> None:
        """One measured fetch of `nbytes` from `tier`; ignored when too small or too fast to say anything."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        rate = nbytes / seconds
        n = self.samples.get(tier, 0)
        self.bps[tier] = rate if n == 0 else (1 - self.alpha) * self.bps[tier] + self.alpha * rate
        self.samples[tier] = n + 1

    def seconds(self, tier: FetchTier, nbytes: int) -> float:
        return max(0, nbytes) / self.bps[tier]


@dataclass
class Holdings:
    """Which node/worker holds which (model, version) in which tier; where each worker is."""

    nodes: dict[str, str] = field(default_factory=dict)  # worker address -> node
    copies: dict[tuple[str, int], set[Holder]] = field(default_factory=dict)
    nbytes: dict[tuple[str, int], int] = field(default_factory=dict)

    def join(self, worker: str, node: str) -> None:
        self.nodes[worker] = node

    def add(self, model: str, version: int, holder: Holder, nbytes: int | None = None) -> None:
        self.copies.setdefault((model, version), set()).add(holder)
        if nbytes is not None:
            self.nbytes[(model, version)] = int(nbytes)

    def holders(self, model: str, version: int) -> list[Holder]:
        return sorted(self.copies.get((model, version), ()))

    def drop(self, model: str, versions: Iterable[int], node: str | None = None) -> None:
        """Forget copies of `versions` (on `node`, or everywhere): they were garbage-collected."""
        for v in versions:
            key = (model, v)
            left = {h for h in self.copies.get(key, ()) if node is not None and h.node != node}
            if left:
                self.copies[key] = left
            else:
                self.copies.pop(key, None)
                self.nbytes.pop(key, None)

    def lose(self, worker: str) -> None:
        """A worker left: its device copies are gone. Its node's tiers are directories that outlive it, so
        they stay recorded (served by the node's other workers, or again once a worker of it rejoins)."""
        self.nodes.pop(worker, None)
        for key in list(self.copies):
            left = {h for h in self.copies[key] if h.worker != worker}
            if left:
                self.copies[key] = left
            else:
                self.copies.pop(key)
                self.nbytes.pop(key, None)

    def sources(self, model: str, version: int) -> list[Holder]:
        """Every (worker, tier) that can serve the version now: a device copy by its worker, a node-tier
        copy by each live worker of that node."""
        by_node: dict[str, list[str]] = {}
        for w, n in self.nodes.items():
            by_node.setdefault(n, []).append(w)
        out: set[Holder] = set()
        for h in self.copies.get((model, version), ()):
            if h.worker:
                if h.worker in self.nodes:
                    out.add(h)
            else:
                out.update(Holder(h.node, w, h.tier) for w in by_node.get(h.node, ()))
        return sorted(out)

    def latest(self, model: str) -> tuple[int, list[Holder]] | None:
        vs = [v for (m, v) in self.copies if m == model]
        if not vs:
            return None
        v = max(vs)
        return v, self.holders(model, v)


@dataclass
class Locality:
    """What φ needs to price a device's fetch of a role's weights: holdings, bandwidths, role → model."""

    holdings: Holdings = field(default_factory=Holdings)
    fetch: FetchTimeModel = field(default_factory=FetchTimeModel)
    role_models: dict[Role, str] = field(default_factory=dict)
    object_store: bool = False

    def fetch_s(self, device: str, role: Role) -> float | None:
        """Predicted seconds for `device` to fetch the newest held version of `role`'s model; None when
        the role has no model, nothing is known to hold it, or its size is unknown."""
        model = self.role_models.get(role)
        got = None if model is None else self.holdings.latest(model)
        if got is None:
            return None
        version, copies = got
        nbytes = self.holdings.nbytes.get((model, version))  # type: ignore[arg-type]
        tier = fetch_tier(device, self.holdings.nodes.get(device, ""), copies, self.object_store)
        if nbytes is None or tier is None:
            return None
        return self.fetch.seconds(tier, nbytes)

    def mean_fetch_s(self, role: Role) -> float | None:
        """The mean prediction over every known device: the baseline a device's own prediction is
        compared with before any shift to the role was measured."""
        preds = [p for d in self.holdings.nodes if (p := self.fetch_s(d, role)) is not None]
        return sum(preds) / len(preds) if preds else None
