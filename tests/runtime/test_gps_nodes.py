"""Node-local GPS tiers on a two-"node" LocalCluster-like cluster (worker processes tagged a and b): the
registry knows who holds what, a worker lacking a version pulls it from a peer over Dask's comms (each
node once), a holder killed mid-transfer is replaced by another, and a torn transfer never becomes visible."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from pivotrl.gps.peer import PEER_WINDOW
from pivotrl.runtime.local_nodes import install_gps, nodes_cluster, workers_by_node
from tests.gps._util import check_versioned, versioned_state_dict

WIDTH = 256


def _store():
    from distributed import get_worker

    return get_worker().plugins["pivotrl-gps"].store


def _publish(model: str, version: int) -> str:
    store = _store()
    store.publish(model, version, versioned_state_dict(version, width=WIDTH))
    store.flush()
    return store.persistent.root


def _fetch(model: str, version: int) -> dict:
    store = _store()
    check_versioned(version, store.fetch(model, version), width=WIDTH)
    store.flush()  # the node's persistent tier is filled behind the fetch
    return {"persistent": store.persistent.root, "host": store.host.root, "versions": store.versions(model)}


def _flush() -> None:
    _store().flush()


def _versions(model: str) -> list[int]:
    return _store().versions(model)


def _roots() -> tuple[str, str]:
    s = _store()
    return s.persistent.root, s.host.root


def _small_ranges(dask_worker=None) -> None:
    from pivotrl.gps import peer

    peer.PEER_RANGE_BYTES = 4096  # ~100 ranges per version: a holder can die between them


def _kill_after(after: int, dask_worker=None) -> None:
    """The holder's process dies (os._exit) on its `after`+1-th range request: killed mid-transfer."""
    orig = dask_worker.handlers["pivotrl_gps_read"]
    count = [0]

    async def read(req):
        count[0] += 1
        if count[0] > after:
            os._exit(1)
        return await orig(req=req)

    dask_worker.handlers["pivotrl_gps_read"] = read


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from distributed import Client

    root = tmp_path_factory.mktemp("nodes")
    with nodes_cluster({"a": 2, "b": 2}) as cl, Client(cl) as client:
        client.wait_for_workers(4, timeout=120)
        install_gps(client, root)
        client.run(_small_ranges)
        yield client, root


def _on(client, worker, fn, *args):
    fut = client.submit(fn, *args, workers=[worker], allow_other_workers=False, pure=False)
    return fut.result(timeout=120)


def _state(client):
    return client.sync(client.scheduler.pivotrl_gps_state)


def test_each_node_has_its_own_tiers(cluster) -> None:
    client, root = cluster
    nodes = workers_by_node(client)
    assert sorted(nodes) == ["a", "b"] and all(len(ws) == 2 for ws in nodes.values())
    roots = {n: {_on(client, w, _roots) for w in ws} for n, ws in nodes.items()}
    assert all(len(r) == 1 for r in roots.values())  # the workers of a node share its directories
    (a_p, a_h), (b_p, b_h) = roots["a"].pop(), roots["b"].pop()
    assert len({a_p, a_h, b_p, b_h}) == 4 and "/a/" in a_p and "/b/" in b_h
    for x in (a_p, a_h):
        for y in (b_p, b_h):
            assert os.path.commonpath([x, y]) == str(root)  # nothing below the test's root is shared


def test_peer_fetch_across_nodes_once_per_node(cluster) -> None:
    client, _ = cluster
    nodes = workers_by_node(client)
    _on(client, nodes["a"][0], _publish, "policy", 1)
    st = _state(client)
    assert {"node": "a", "worker": "", "tier": "host"} in st["copies"]["policy@1"]  # announced on publish
    with concurrent.futures.ThreadPoolExecutor(2) as ex:  # both workers of node b want it at once
        got = list(ex.map(lambda w: _on(client, w, _fetch, "policy", 1), nodes["b"]))
    for w in nodes["b"]:
        _on(client, w, _flush)
    assert all(_on(client, w, _versions, "policy") == [1] for w in nodes["b"])
    assert len(got) == 2
    pulls = [p for p in _state(client)["pulls"] if p["model"] == "policy" and p["version"] == 1]
    assert len(pulls) == 1 and pulls[0]["ok"] and pulls[0]["node"] == "b"  # node b pulled it once
    assert set(pulls[0]["served_by"]) <= set(nodes["a"]) and pulls[0]["fetch_tier"] == "peer_remote"
    from pivotrl.core.locality import PRIOR_BPS, FetchTier

    assert _state(client)["fetch_bps"]["peer_remote"] != PRIOR_BPS[FetchTier.PEER_REMOTE]  # measured
    assert {"node": "b", "worker": "", "tier": "host"} in _state(client)["copies"]["policy@1"]
    for w in nodes["b"]:
        _on(client, w, _flush)  # the persistent tier is filled behind the fetch, from the host copy
    assert {"node": "b", "worker": "", "tier": "persistent"} in _state(client)["copies"]["policy@1"]


def _fetch_read_only(model: str, version: int) -> dict:
    """A read-only fetch (`copy=False`): the pull returns before its bytes are in the node's tier."""
    store = _store()
    check_versioned(version, store.fetch(model, version, copy=False), width=WIDTH)
    store.flush()  # the landing behind the fetch, then the slower tier
    return {"versions": store.versions(model), "host": sorted(os.listdir(store.host.root))}


def _landing_fails(fail: bool) -> None:
    from pivotrl.gps import peer

    if fail:
        peer.PullResult._land = peer.PullResult.land

        def land(self, backend):
            raise OSError("no space left on device (injected)")

        peer.PullResult.land = land
    elif hasattr(peer.PullResult, "_land"):
        peer.PullResult.land = peer.PullResult._land


def test_a_read_only_fetch_lands_behind_once_per_node(cluster) -> None:
    client, _ = cluster
    nodes = workers_by_node(client)
    _on(client, nodes["a"][0], _publish, "ro", 1)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:  # the second waits for the first's landing
        list(ex.map(lambda w: _on(client, w, _fetch_read_only, "ro", 1), nodes["b"]))
    for w in nodes["b"]:
        _on(client, w, _flush)  # the one that pulled fills the persistent tier behind its landing
    assert all(_on(client, w, _versions, "ro") == [1] for w in nodes["b"])
    pulls = [p for p in _state(client)["pulls"] if p["model"] == "ro"]
    assert len(pulls) == 1 and pulls[0]["ok"] and pulls[0]["node"] == "b"
    copies = _state(client)["copies"]["ro@1"]
    assert {"node": "b", "worker": "", "tier": "host"} in copies
    assert {"node": "b", "worker": "", "tier": "persistent"} in copies


def test_a_landing_that_fails_behind_the_fetch_costs_only_the_copy(cluster) -> None:
    client, _ = cluster
    nodes = workers_by_node(client)
    b = nodes["b"][0]
    _on(client, nodes["a"][0], _publish, "rofail", 1)
    client.run(_landing_fails, True, workers=[b])
    try:
        got = _on(client, b, _fetch_read_only, "rofail", 1)  # the data are right; flush() raises nothing
    finally:
        client.run(_landing_fails, False, workers=[b])
    assert got["versions"] == [] and not any(n.startswith("rofail") for n in got["host"])
    assert not [c for c in _state(client)["copies"]["rofail@1"] if c["node"] == "b"]
    assert _on(client, b, _fetch, "rofail", 1)["versions"] == [1]  # the next reader pulls it again
    pulls = [p for p in _state(client)["pulls"] if p["model"] == "rofail"]
    assert [p["ok"] for p in pulls] == [True, True]


def test_a_stale_record_of_the_own_node_is_corrected(cluster) -> None:
    """The registry says node b holds a version its tiers no longer have (deleted behind its back)."""
    client, _ = cluster
    nodes = workers_by_node(client)
    _on(client, nodes["a"][0], _publish, "stale", 1)
    _on(client, nodes["b"][0], _fetch, "stale", 1)

    def delete_silently() -> None:
        store = _store()
        peers, store.peers = store.peers, None
        try:
            store._delete_versions("stale", [1])
        finally:
            store.peers = peers

    _on(client, nodes["b"][0], delete_silently)
    assert {"node": "b", "worker": "", "tier": "host"} in _state(client)["copies"]["stale@1"]
    assert _on(client, nodes["b"][1], _fetch, "stale", 1)["versions"] == [1]
    pulls = [p for p in _state(client)["pulls"] if p["model"] == "stale"]
    assert [p["node"] for p in pulls] == ["b", "b"] and all(p["ok"] for p in pulls)


def test_unannounced_version_is_found_by_probing(cluster) -> None:
    """A version written into node a's tiers by a process that told no one (a driver without peers)."""
    client, _ = cluster
    nodes = workers_by_node(client)

    def write_silently() -> None:
        store = _store()
        peers, store.peers = store.peers, None
        try:
            store.publish("genrm", 0, versioned_state_dict(0, width=WIDTH))
            store.flush()
        finally:
            store.peers = peers

    _on(client, nodes["a"][1], write_silently)
    assert "genrm@0" not in _state(client)["copies"]
    assert _on(client, nodes["b"][0], _fetch, "genrm", 0)["versions"] == [0]


def test_gc_on_one_node_reaches_the_others(cluster) -> None:
    client, _ = cluster
    nodes = workers_by_node(client)
    for v in (10, 11):
        _on(client, nodes["a"][0], _publish, "gcm", v)
        _on(client, nodes["b"][0], _fetch, "gcm", v)

    def gc() -> list[int]:
        return _store().gc("gcm", keep_last=1)

    assert _on(client, nodes["a"][0], gc) == [10]
    assert _on(client, nodes["b"][1], _versions, "gcm") == [11]
    assert "gcm@10" not in _state(client)["copies"]


def test_holder_killed_mid_transfer_falls_back(cluster) -> None:
    client, _ = cluster
    nodes = workers_by_node(client)
    _on(client, nodes["a"][0], _publish, "policy", 2)
    first = min(nodes["a"])  # nearest_holders orders same-tier holders by address: this one goes first
    # The puller keeps PEER_WINDOW ranges in flight, each I/O thread asking for its next range only once
    # its last one arrived. So when request `after` + 1 reaches the holder, at least `after` + 1 -
    # PEER_WINDOW of its replies have been received: the holder dies having served some bytes, not
    # only having been asked for them.
    after = PEER_WINDOW + 2
    client.run(_kill_after, after, workers=[first])
    got = _on(client, nodes["b"][0], _fetch, "policy", 2)
    assert 2 in got["versions"]
    pull = [p for p in _state(client)["pulls"] if p["model"] == "policy" and p["version"] == 2][-1]
    served = pull["served_by"].get(first, 0)
    assert pull["ok"] and first in pull["lost"]
    assert 0 < served <= after * 4096, served  # ranges are at most 4096 bytes (the last of an array less)
    assert sum(pull["served_by"].values()) == pull["nbytes"]
    client.wait_for_workers(4, timeout=120)  # the nanny restarts the killed one


def test_torn_transfer_never_becomes_visible(cluster) -> None:
    client, _ = cluster
    client.wait_for_workers(4, timeout=120)
    nodes = workers_by_node(client)
    while len(nodes.get("a", [])) < 2:
        nodes = workers_by_node(client)
    _on(client, nodes["a"][0], _publish, "policy", 3)
    for w in nodes["a"]:
        client.run(_kill_after, 2, workers=[w])
    fut = client.submit(_fetch, "policy", 3, workers=[nodes["b"][0]], allow_other_workers=False, pure=False)
    with pytest.raises(Exception, match="lost mid-transfer|no peer holds"):
        fut.result(timeout=120)
    assert 3 not in _on(client, nodes["b"][0], _versions, "policy")
    assert 3 not in _on(client, nodes["b"][1], _versions, "policy")
    pulls = [p for p in _state(client)["pulls"] if p["model"] == "policy" and p["version"] == 3]
    assert pulls and not pulls[-1]["ok"]
