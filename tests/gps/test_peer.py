"""gps.peer without Dask: pulls from in-process holders, verified, with fallback; torn pulls stay hidden."""

from __future__ import annotations

import pytest
import torch

from pivotrl.gps import IntegrityError, NotFoundError, ParameterStore
from pivotrl.gps import peer as peer_mod
from pivotrl.gps.manifest import Manifest
from pivotrl.gps.peer import (
    PeerLost,
    RangeRequest,
    commit_local,
    pull,
    replicate,
    serve_manifest,
    serve_range,
)
from tests.gps._util import check_versioned, versioned_state_dict


class StoreSource:
    """Holders are in-process stores; `die_after[h]` = reads after which holder h is 'killed'."""

    def __init__(self, stores: dict[str, ParameterStore], die_after: dict[str, int] | None = None) -> None:
        self.stores = stores
        self.die_after = dict(die_after or {})
        self.reads: dict[str, int] = {}
        self.corrupt: set[str] = set()

    def manifest(self, holder: str, model: str, version: int) -> Manifest:
        got = serve_manifest(self.stores[holder], model, version)
        if got is None or self.die_after.get(holder) == 0:
            raise PeerLost(holder)
        return Manifest.from_json(got)

    def read(self, holder: str, req: RangeRequest):
        n = self.reads[holder] = self.reads.get(holder, 0) + 1
        if holder in self.die_after and n > self.die_after[holder]:
            raise PeerLost(f"{holder} died")
        data = serve_range(self.stores[holder], req)
        if data is None:
            raise PeerLost(f"{holder} does not hold it")
        if holder in self.corrupt:
            data = data.copy()
            data[0] ^= 0xFF
        return data


@pytest.fixture
def small_ranges(monkeypatch):
    """Many ranges per version, so a holder can die between them."""
    monkeypatch.setattr(peer_mod, "PEER_RANGE_BYTES", 4096)


def _holder(tmp_path, name: str, versions=(1,)) -> ParameterStore:
    s = ParameterStore(tmp_path / name / "gps", host_tier=tmp_path / name / "shm", write_behind=False,
                       device_tier_bytes=0)
    for v in versions:
        s.publish("policy", v, versioned_state_dict(v, width=96))
    return s


def test_pull_verifies_and_commits_into_the_node_tiers(tmp_path, small_ranges) -> None:
    a = _holder(tmp_path, "a")
    b = ParameterStore(tmp_path / "b" / "gps", host_tier=tmp_path / "b" / "shm", write_behind=False)
    res = pull(b, "policy", 1, ["a"], StoreSource({"a": a}))
    check_versioned(1, res.tensors, width=96)
    assert res.served_by["a"] == res.manifest.nbytes and res.lost == []
    assert b.versions("policy") == []  # pulled, not yet visible
    done = commit_local(b, res)
    assert done.tier == "host" and [t for t, _ in done.rest] == ["persistent"]
    assert b.versions("policy") == []  # the persistent tier is filled behind, from the host copy
    check_versioned(1, b.fetch("policy", 1), width=96)  # (from the host tier)
    assert replicate(b, done) == ["persistent"]
    assert b.versions("policy") == [1]
    check_versioned(1, b.fetch("policy", 1), width=96)


def test_holder_lost_mid_transfer_falls_back_to_the_next(tmp_path, small_ranges) -> None:
    a1, a2 = _holder(tmp_path, "a1"), _holder(tmp_path, "a2")
    b = ParameterStore(tmp_path / "b", write_behind=False)
    src = StoreSource({"a1": a1, "a2": a2}, die_after={"a1": 3})
    res = pull(b, "policy", 1, ["a1", "a2"], src)
    check_versioned(1, res.tensors, width=96)
    assert res.lost == ["a1"] and res.served_by["a1"] > 0 and res.served_by["a2"] > 0


def test_every_holder_lost_leaves_no_visible_version(tmp_path, small_ranges) -> None:
    a1, a2 = _holder(tmp_path, "a1"), _holder(tmp_path, "a2")
    b = ParameterStore(tmp_path / "b", write_behind=False)
    src = StoreSource({"a1": a1, "a2": a2}, die_after={"a1": 2, "a2": 2})
    with pytest.raises(PeerLost, match="lost mid-transfer"):
        pull(b, "policy", 1, ["a1", "a2"], src)
    assert b.versions("policy") == []


def test_corrupt_holder_is_skipped(tmp_path, small_ranges) -> None:
    a1, a2 = _holder(tmp_path, "a1"), _holder(tmp_path, "a2")
    b = ParameterStore(tmp_path / "b", write_behind=False)
    src = StoreSource({"a1": a1, "a2": a2})
    src.corrupt.add("a1")
    res = pull(b, "policy", 1, ["a1", "a2"], src)
    check_versioned(1, res.tensors, width=96)
    src.corrupt.add("a2")
    with pytest.raises(IntegrityError, match="no holder sent a good copy"):
        pull(b, "policy", 1, ["a1", "a2"], src)


def test_no_holder_has_it(tmp_path) -> None:
    a = _holder(tmp_path, "a", versions=())
    b = ParameterStore(tmp_path / "b", write_behind=False)
    with pytest.raises((NotFoundError, PeerLost)):
        pull(b, "policy", 7, ["a"], StoreSource({"a": a}))


def test_holder_refuses_a_different_chunking(tmp_path) -> None:
    a = _holder(tmp_path, "a")
    man = a.manifest("policy", 1)
    arr = man.arrays[0]
    bad = RangeRequest("policy", 1, arr.name, 0, 0, 16, arr.chunk_bytes + 1)
    assert serve_range(a, bad) is None
    good = RangeRequest("policy", 1, arr.name, 0, 0, 16, arr.chunk_bytes)
    assert serve_range(a, good) is not None


class FakePeers:
    """A PeerSource over in-process holders: what the store's hooks call."""

    def __init__(self, stores: dict[str, ParameterStore]) -> None:
        self.src = StoreSource(stores)
        self.announced: list[tuple[str, int]] = []
        self.forgotten: list[tuple[str, list[int]]] = []

    def fill(self, store, model, version, wanted, shared=False):
        res = pull(store, model, version, list(self.src.stores), self.src)
        replicate(store, commit_local(store, res))
        got = res.tensors if wanted is None else {n: res.tensors[n] for n in wanted}
        return got, res.manifest

    def announce(self, model, version, nbytes):
        self.announced.append((model, version))

    def forget(self, model, versions):
        self.forgotten.append((model, list(versions)))


def test_store_hooks_fill_announce_forget(tmp_path) -> None:
    a = _holder(tmp_path, "a", versions=(1, 2))
    b = ParameterStore(tmp_path / "b", write_behind=False)
    b.peers = FakePeers({"a": a})
    got = b.fetch("policy", 2, names=["layers.0.w"])
    assert torch.equal(got["layers.0.w"], versioned_state_dict(2, width=96)["layers.0.w"])
    assert b.versions("policy") == [2]  # filled once: the next fetch is local
    b.peers.src.stores.clear()
    check_versioned(2, b.fetch("policy", 2), width=96)
    b.publish("policy", 3, versioned_state_dict(3, width=96))
    assert b.peers.announced == [("policy", 3)]
    b.gc("policy", keep_last=1)
    assert b.peers.forgotten == [("policy", [2])]


def _data_prefixes(root) -> list[str]:
    return [p.name for p in root.rglob("d-*") if p.is_dir()]


def test_landing_writes_as_it_arrives_and_commits_once_verified(tmp_path, small_ranges) -> None:
    import zarr

    a = _holder(tmp_path, "a")
    b = ParameterStore(tmp_path / "b" / "gps", host_tier=tmp_path / "b" / "shm", write_behind=False)
    res = pull(b, "policy", 1, ["a"], StoreSource({"a": a}), land=b.host)
    check_versioned(1, res.tensors, width=96)
    assert res.landed is not None and res.landed.data_id != res.manifest.data_id
    peer_mod.replicate(b, peer_mod.landed(b, res, "host"))
    host_only = ParameterStore(tmp_path / "elsewhere", host_tier=tmp_path / "b" / "shm")
    check_versioned(1, host_only.fetch("policy", 1), width=96)  # read from the landed host copy
    check_versioned(1, b.fetch("policy", 1), width=96)
    assert b.versions("policy") == [1]  # the persistent copy, replicated from the landed one
    g = zarr.open_group(str(tmp_path / "b" / "shm"), mode="r")[f"policy/v000000000001/{res.landed.data_id}"]
    for arr in res.landed.arrays:  # the landed files are valid zarr, zero padding included
        assert g[arr.name].shape[0] * arr.itemsize == arr.nchunks * arr.chunk_bytes


def test_landing_of_a_torn_or_corrupt_pull_leaves_nothing(tmp_path, small_ranges) -> None:
    a1, a2 = _holder(tmp_path, "a1"), _holder(tmp_path, "a2")
    b = ParameterStore(tmp_path / "b", write_behind=False)
    src = StoreSource({"a1": a1, "a2": a2}, die_after={"a1": 2, "a2": 2})
    with pytest.raises(PeerLost):
        pull(b, "policy", 1, ["a1", "a2"], src, land=b.persistent)
    src = StoreSource({"a1": a1})
    src.corrupt.add("a1")
    with pytest.raises(IntegrityError):
        pull(b, "policy", 1, ["a1"], src, land=b.persistent)
    assert b.versions("policy") == [] and _data_prefixes(tmp_path / "b") == []


class CommLikeSource(StoreSource):
    """Ranges arrive as a comm delivers them: fresh, writable, 16-byte-aligned buffers, flagged read-only
    (the sender's were), or at an odd address (a buffer sharing its allocation with a header)."""

    def __init__(self, stores, odd: bool = False) -> None:
        super().__init__(stores)
        self.odd = odd
        self.buffers: list = []

    def read(self, holder, req):
        import numpy as np

        data = super().read(holder, req)
        raw = np.empty(data.nbytes + 1, dtype=np.uint8)
        buf = raw[1:] if self.odd else raw[: data.nbytes]
        buf[:] = data
        buf.flags.writeable = False
        self.buffers.append(buf)
        return buf


@pytest.mark.parametrize("odd", [False, True])
def test_arriving_buffers_become_the_tensors_memory_when_aligned(tmp_path, odd) -> None:
    a = _holder(tmp_path, "a")
    b = ParameterStore(tmp_path / "b", write_behind=False)
    src = CommLikeSource({"a": a}, odd=odd)
    res = pull(b, "policy", 1, ["a"], src)
    check_versioned(1, res.tensors, width=96)
    spans = [(x.ctypes.data, x.ctypes.data + x.nbytes) for x in src.buffers]

    def shared(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in spans)

    assert all(t.data_ptr() % t.element_size() == 0 for t in res.tensors.values())
    if odd:  # misaligned for the dtype: copied into aligned memory
        assert not any(shared(t) for t in res.tensors.values())
    else:
        assert all(shared(t) for t in res.tensors.values())  # no copy
    for t in res.tensors.values():
        t.add_(1)  # the caller's memory, writable


def test_landing_behind_commits_the_pulled_bytes_later(tmp_path) -> None:
    a = _holder(tmp_path, "a")
    b = ParameterStore(tmp_path / "b" / "gps", host_tier=tmp_path / "b" / "shm", write_behind=False)
    res = pull(b, "policy", 1, ["a"], CommLikeSource({"a": a}), land=b.host, land_behind=True)
    assert res.landed is None and b.versions("policy") == []  # nothing written yet
    assert res.land(b.host) == res.landed is not None
    host_only = ParameterStore(tmp_path / "elsewhere", host_tier=tmp_path / "b" / "shm")
    check_versioned(1, host_only.fetch("policy", 1), width=96)
