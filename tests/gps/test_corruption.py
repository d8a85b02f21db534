"""Checksums: a flipped byte is named (model, version, tensor); another tier's good copy is used instead."""

from __future__ import annotations

import pytest
import torch

from pivotrl.gps import IntegrityError, ParameterStore
from pivotrl.gps.manifest import version_dir
from tests.gps._util import bits


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 32, generator=g),
        "proj": torch.randn(32, 32, generator=g).bfloat16(),
        "norm": torch.ones(32),
    }


def _flip_byte_of(root, model, version, tensor, store) -> None:
    """Flip one byte inside `tensor` in the chunk file of `root` (any tier) that holds it."""
    man = store.manifest(model, version)
    e = man.tensor_map()[tensor]
    arr = man.array_map()[e.array]
    vdir = root / model / version_dir(version)
    data_dir = next(p for p in vdir.iterdir() if p.is_dir())
    chunk, off = divmod(e.offset + e.nbytes // 2, arr.chunk_bytes)
    path = data_dir / e.array / "c" / str(chunk)
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_flipped_byte_raises_error_naming_model_version_tensor(tmp_path):
    with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=0) as store:
        store.publish("policy", 3, _sd())
        _flip_byte_of(tmp_path, "policy", 3, "proj", store)
        with pytest.raises(IntegrityError) as exc:
            store.fetch("policy", 3)
        msg = str(exc.value)
        assert "'policy'" in msg and "version 3" in msg and "proj" in msg and "embed" not in msg
        # the intact tensors are still fetchable by name
        assert torch.equal(store.fetch("policy", 3, names=["embed"])["embed"], _sd()["embed"])


def test_truncated_chunk_is_reported_not_returned(tmp_path):
    with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=0) as store:
        store.publish("policy", 1, _sd())
        for p in (tmp_path / "policy").rglob("float32/c/0"):
            p.write_bytes(p.read_bytes()[:100])
        with pytest.raises(IntegrityError, match="missing or truncated"):
            store.fetch("policy", 1)


def test_corrupt_host_copy_falls_back_to_persistent_and_is_repaired(tmp_path):
    host, persist = tmp_path / "shm", tmp_path / "disk"
    sd = _sd()
    with ParameterStore(persist, host_tier=host, write_behind=False, device_tier_bytes=0) as store:
        store.publish("policy", 5, sd)
        assert (host / "policy" / version_dir(5) / "zarr.json").exists()
        _flip_byte_of(host, "policy", 5, "embed", store)
        got = store.fetch("policy", 5)
        assert all(torch.equal(bits(got[k]), bits(sd[k])) for k in sd)
        store.flush()  # the repair runs in the background
        assert store.stats["fallbacks"] == 1 and store.stats["repairs"] == 1
    # the repaired host copy alone is good now
    with ParameterStore(host, device_tier_bytes=0) as host_only:
        got = host_only.fetch("policy", 5)
        assert all(torch.equal(bits(got[k]), bits(sd[k])) for k in sd)


def test_corrupt_persistent_copy_falls_back_to_host(tmp_path):
    host, persist = tmp_path / "shm", tmp_path / "disk"
    sd = _sd()
    with ParameterStore(persist, host_tier=host, write_behind=False, device_tier_bytes=0) as store:
        store.publish("policy", 2, sd)
        _flip_byte_of(persist, "policy", 2, "norm", store)
        got = store.fetch("policy", 2)
        assert all(torch.equal(bits(got[k]), bits(sd[k])) for k in sd)
    with (
        ParameterStore(persist, device_tier_bytes=0) as disk_only,
        pytest.raises(IntegrityError, match="norm"),
    ):
        disk_only.fetch("policy", 2)


def test_host_tier_is_filled_behind_a_persistent_read(tmp_path):
    host, persist = tmp_path / "shm", tmp_path / "disk"
    with ParameterStore(persist, write_behind=False) as writer:
        writer.publish("genrm", 1, _sd())
    with ParameterStore(persist, host_tier=host, device_tier_bytes=0) as store:
        store.fetch("genrm", 1)
        store.flush()
        assert store.stats["host_fills"] == 1
    with ParameterStore(host, device_tier_bytes=0) as host_only:
        assert torch.equal(host_only.fetch("genrm", 1)["embed"], _sd()["embed"])


def test_corrupt_everywhere_names_every_tier(tmp_path):
    host, persist = tmp_path / "shm", tmp_path / "disk"
    with ParameterStore(persist, host_tier=host, write_behind=False, device_tier_bytes=0) as store:
        store.publish("policy", 1, _sd())
        _flip_byte_of(host, "policy", 1, "proj", store)
        _flip_byte_of(persist, "policy", 1, "proj", store)
        with pytest.raises(IntegrityError, match=r"host tier.*proj.*persistent tier.*proj"):
            store.fetch("policy", 1)


@pytest.mark.parametrize(("slice_bytes", "group_bytes"), [(7, 13), (64, 1 << 20), (2 << 20, 16 << 20)])
def test_streamed_verification_names_exactly_the_bad_tensor(tmp_path, slice_bytes, group_bytes):
    from pivotrl.gps.layout import IOPool, read_tensors

    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(int(n), generator=g) for i, n in enumerate([1, 5, 40, 3, 100, 2, 17])}
    with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=0, chunk_bytes=96) as store:
        man = store.publish("m", 1, sd)
        with IOPool(3) as pool:
            got, bad = read_tensors(
                store.persistent, man, None, pool, slice_bytes=slice_bytes, group_bytes=group_bytes
            )
            assert bad == [] and all(torch.equal(got[k], sd[k]) for k in sd)
            _flip_byte_of(tmp_path, "m", 1, "t4", store)
            got, bad = read_tensors(
                store.persistent,
                man,
                ["t6", "t4", "t0"],
                pool,
                slice_bytes=slice_bytes,
                group_bytes=group_bytes,
            )
            assert bad == ["t4"] and list(got) == ["t6", "t4", "t0"]
            assert torch.equal(got["t6"], sd["t6"]) and torch.equal(got["t0"], sd["t0"])
