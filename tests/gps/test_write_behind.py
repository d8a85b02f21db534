"""Write-behind: publish snapshots and returns; `flush()` persists; nothing is lost or shared by mistake."""

from __future__ import annotations

import threading

import torch

from pivotrl.gps import ParameterStore, WriteBehindError
from pivotrl.gps.manifest import version_dir
from tests.gps._util import check_versioned, versioned_state_dict


def test_publish_returns_before_persisting_and_flush_persists(tmp_path):
    gate = threading.Event()
    with ParameterStore(tmp_path, device_tier_bytes=1 << 20) as store:
        store._bg.submit(gate.wait)
        try:
            man = store.publish("m", 1, versioned_state_dict(1))
            assert man.version == 1 and len(man.tensors) == 10
            assert not (tmp_path / "m" / version_dir(1) / "zarr.json").exists()
            check_versioned(1, store.fetch("m", 1))  # served from the in-process snapshot
        finally:
            gate.set()
        store.flush()
        assert (tmp_path / "m" / version_dir(1) / "zarr.json").exists()
    with ParameterStore(tmp_path, device_tier_bytes=0) as other:
        check_versioned(1, other.fetch("m", 1))
        assert other.manifest("m", 1) == man


def test_caller_may_modify_its_tensors_right_after_publish(tmp_path):
    sd = versioned_state_dict(4)
    with ParameterStore(tmp_path) as store:
        store.publish("m", 4, sd)
        for t in sd.values():
            t.zero_()  # the trainer keeps training in place
        store.flush()
    with ParameterStore(tmp_path, device_tier_bytes=0) as other:
        check_versioned(4, other.fetch("m", 4))


def test_background_failure_is_raised_by_the_next_call(tmp_path):
    gate = threading.Event()
    with ParameterStore(tmp_path) as store:
        store._bg.submit(gate.wait)
        try:
            store.publish("m", 1, versioned_state_dict(1))
            (tmp_path / "m").write_text("not a directory")  # the background write will fail
        finally:
            gate.set()
        store._bg.submit(lambda: None).result()
        try:
            store.fetch("m", 1)
        except WriteBehindError as exc:
            assert "'m' version 1" in str(exc)
        else:
            raise AssertionError("a failed background write must not be silently lost")
        (tmp_path / "m").unlink()


def test_device_tier_holds_unpersisted_versions_even_over_budget(tmp_path):
    gate = threading.Event()
    with ParameterStore(tmp_path, device_tier_bytes=10) as store:
        store._bg.submit(gate.wait)
        try:
            store.publish("m", 1, {"w": torch.ones(1000)})
            assert ("m", 1) in store.device_tier.cached()
        finally:
            gate.set()
        store.flush()
        assert ("m", 1) not in store.device_tier.cached()  # released, then evicted: over budget
        assert torch.equal(store.fetch("m", 1)["w"], torch.ones(1000))
