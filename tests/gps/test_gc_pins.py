"""gc keeps the last K, every pinned version and the latest; leftovers of crashed writers are swept."""

from __future__ import annotations

import os

import pytest
import torch

from pivotrl.gps import NotFoundError, ParameterStore
from pivotrl.gps.manifest import version_dir


@pytest.fixture
def store(tmp_path):
    with ParameterStore(tmp_path, host_tier=tmp_path / "host", write_behind=False) as s:
        for v in range(1, 9):
            s.publish("m", v, {"w": torch.full((4,), float(v))})
        yield s


def test_gc_keeps_last_k_pinned_and_latest(store, tmp_path):
    store.pin("m", 2)
    store.pin("m", 5)
    assert store.pinned("m") == [2, 5]
    deleted = store.gc("m", keep_last=2)
    assert deleted == [1, 3, 4, 6]
    assert store.versions("m") == [2, 5, 7, 8]
    for tier in (tmp_path, tmp_path / "host"):
        assert sorted(p.name for p in (tier / "m").iterdir() if p.name.startswith("v")) == [
            version_dir(v) for v in (2, 5, 7, 8)
        ]
    with pytest.raises(NotFoundError, match=r"versions: \[2, 5, 7, 8\]"):
        store.fetch("m", 3)
    assert store.fetch("m", 5)["w"][0].item() == 5


def test_gc_with_keep_last_one_keeps_latest_and_unpinned_go(store):
    store.pin("m", 3)
    store.gc("m", keep_last=1)
    assert store.versions("m") == [3, 8]
    store.unpin("m", 3)
    store.gc("m", keep_last=1)
    assert store.versions("m") == [8]
    assert store.latest("m") == 8


def test_pins_are_shared_between_processes_via_the_store(store, tmp_path):
    store.pin("m", 1)
    with ParameterStore(tmp_path, write_behind=False) as other:
        other.gc("m", keep_last=1)
        assert other.versions("m") == [1, 8]


def test_pin_of_missing_version_is_an_error(store):
    with pytest.raises(NotFoundError, match="no version 42"):
        store.pin("m", 42)


def test_sweep_removes_dead_writers_leftovers_only(store, tmp_path):
    mdir = tmp_path / "m"
    dead = mdir / version_dir(9) / "d-00000000-999999999-deadbeef0000"
    (dead / "float32" / "c").mkdir(parents=True)
    (dead / "float32" / "c" / "0").write_bytes(b"x" * 100)
    alive = mdir / version_dir(10) / f"d-{os.uname().nodename}-{os.getpid()}-aaaa"
    from pivotrl.gps.layout import new_data_id

    alive = mdir / version_dir(10) / new_data_id()  # this (live) process as the writer
    alive.mkdir(parents=True)
    (mdir / ".trash-v1-abc").mkdir()
    old = 0.0
    os.utime(dead, (old, old))
    removed = store.sweep("m")
    assert removed >= 2
    assert not dead.exists() and not (mdir / ".trash-v1-abc").exists()
    assert alive.exists()
    assert store.versions("m") == list(range(1, 9))
