"""Round trips: every dtype, bf16 bit-exactness, odd shapes, name subsets, the Zarr format, fsspec URLs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from pivotrl.gps import ParameterStore
from pivotrl.gps.manifest import version_dir
from tests.gps._util import bits


def all_dtypes_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "f64": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "f32": torch.randn(17, 9, generator=g),
        "f16": torch.randn(4, 33, generator=g).half(),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (3, 7), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (9,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 2, 5), generator=g, dtype=torch.uint8),
        "bool": torch.rand(19, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "noncontig": torch.randn(8, 6, generator=g).t(),
    }


def bf16_all_bit_patterns() -> torch.Tensor:
    """Every one of the 65536 bf16 bit patterns: NaN payloads, infinities, -0.0, subnormals."""
    return (
        torch.arange(-(2**15), 2**15, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .reshape(256, 256)
    )


@pytest.mark.parametrize("chunk_bytes", [64, 64 << 20])
def test_every_dtype_round_trips_bit_exactly(tmp_path, chunk_bytes):
    sd = {**all_dtypes_state_dict(), "bf16": bf16_all_bit_patterns()}
    with ParameterStore(tmp_path, device_tier_bytes=0, chunk_bytes=chunk_bytes) as store:
        store.publish("m", 0, sd)
        store.flush()
    with ParameterStore(tmp_path, device_tier_bytes=0) as reader:
        got = reader.fetch("m", 0)
    assert list(got) == list(sd)
    for k, t in sd.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(bits(got[k]), bits(t)), k


def test_bf16_is_stored_as_int16_and_zarr_reads_every_array(tmp_path):
    sd = {**all_dtypes_state_dict(), "bf16": bf16_all_bit_patterns()}
    with ParameterStore(tmp_path, write_behind=False, chunk_bytes=1000) as store:
        man = store.publish("policy", 7, sd)
    root = zarr.open_group(str(tmp_path), mode="r")
    vgroup = root[f"policy/{version_dir(7)}"]
    assert vgroup.attrs["pivotrl_gps"]["version"] == 7
    data = vgroup[man.data_id]
    assert data["bfloat16"].dtype == np.int16
    for e in man.tensors:
        arr = data[e.array]
        item = arr.dtype.itemsize
        flat = arr[e.offset // item : (e.offset + e.nbytes) // item]
        want = sd[e.name].contiguous().reshape(-1).view(torch.uint8).numpy()
        assert flat.tobytes() == want.tobytes(), e.name


def test_names_subset_reads_only_those(tmp_path):
    sd = {f"layer.{i}": torch.full((100, 10), float(i)) for i in range(10)}
    with ParameterStore(tmp_path, write_behind=False, chunk_bytes=4096) as store:
        store.publish("m", 1, sd)
    with ParameterStore(tmp_path, device_tier_bytes=0) as reader:
        got = reader.fetch("m", 1, names=["layer.7", "layer.2", "layer.3"])
    assert list(got) == ["layer.7", "layer.2", "layer.3"]
    for k, t in got.items():
        assert torch.equal(t, sd[k])


def test_fetched_tensors_are_fresh_memory(tmp_path):
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    with ParameterStore(tmp_path, write_behind=False) as store:
        store.publish("m", 1, sd)
    with ParameterStore(tmp_path, device_tier_bytes=1 << 20) as reader:
        a = reader.fetch("m", 1)
        # Overwrite the chunk file: what we already fetched must not change.
        for p in tmp_path.rglob("c/0"):
            p.write_bytes(b"\0" * p.stat().st_size)
        assert torch.equal(a["w"], sd["w"])
        a["w"].zero_()  # caller owns its tensors: the device tier copy is unaffected
        assert torch.equal(reader.fetch("m", 1)["w"], sd["w"])


def test_fsspec_file_url_round_trip(tmp_path):
    sd = {**all_dtypes_state_dict(), "bf16": bf16_all_bit_patterns()}
    url = f"file://{tmp_path}/remote"
    with ParameterStore(url, device_tier_bytes=0, chunk_bytes=4096) as store:
        store.publish("m", 3, sd)
        store.flush()
        assert store.versions("m") == [3]
        got = store.fetch("m", "latest")
        for k, t in sd.items():
            assert torch.equal(bits(got[k]), bits(t)), k
    # the same bytes are readable through the local fast path too
    with ParameterStore(tmp_path / "remote", device_tier_bytes=0) as local:
        assert torch.equal(bits(local.fetch("m", 3)["bf16"]), bits(sd["bf16"]))


def test_device_tier_serves_hits_and_stays_within_its_budget(tmp_path):
    one = {"w": torch.zeros(1000)}  # 4000 bytes per version
    with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=10_000) as store:
        for v in range(5):
            store.publish("m", v, {"w": one["w"] + v})
        for v in range(5):
            assert store.fetch("m", v)["w"][0].item() == v
        assert store.device_tier.nbytes <= 10_000
        assert store.device_tier.cached() == [("m", 3), ("m", 4)]
        hits = store.device_tier.hits
        assert store.fetch("m", 4)["w"][0].item() == 4
        assert store.device_tier.hits == hits + 1
        shared = store.fetch("m", 4, copy=False)["w"]
        assert shared.data_ptr() == store.fetch("m", 4, copy=False)["w"].data_ptr()


def test_device_tier_merges_name_subsets(tmp_path):
    sd = {f"t{i}": torch.full((10,), float(i)) for i in range(4)}
    with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=1 << 20) as store:
        store.publish("m", 1, sd)
        store.fetch("m", 1, names=["t0", "t1"])
        misses = store.device_tier.misses
        assert store.fetch("m", 1, names=["t1"])["t1"][0].item() == 1  # hit
        assert store.device_tier.misses == misses
        got = store.fetch("m", 1)  # not all cached yet: a miss that completes the entry
        assert store.device_tier.misses == misses + 1 and list(got) == list(sd)
        assert list(store.fetch("m", 1)) == list(sd)  # now a full hit, in manifest order
        assert store.device_tier.misses == misses + 1


def test_store_from_pipeline_config(tmp_path):
    from pivotrl.config import GPSConfig

    cfg = GPSConfig(host_tier=str(tmp_path / "shm"), device_tier_bytes=1234)
    with ParameterStore.from_config(cfg, storage_root=tmp_path) as store:
        assert store.persistent.root == str(tmp_path / "gps")
        assert store.host is not None and store.host.root == str(tmp_path / "shm")
        assert store.device_tier.capacity == 1234


def test_move_packed_moves_one_buffer_per_dtype_and_never_aliases(tmp_path):
    from pivotrl.gps.packed import _packed_source, move_packed

    sd = {
        "a": torch.randn(3, 4),
        "b": torch.arange(6).reshape(2, 3),
        "c": torch.randn(5).bfloat16(),
        "d": torch.randn(2, 2),
        "s": torch.tensor(2.0),
    }
    with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=0) as store:
        store.publish("m", 1, sd)
        fetched = store.fetch("m", 1)
    f32 = [(n, t) for n, t in fetched.items() if t.dtype == torch.float32]
    assert _packed_source(f32) is not None  # fetched tensors are views of one packed buffer per dtype
    assert _packed_source([("a", sd["a"]), ("d", sd["d"])]) is None  # separate allocations
    for source in (fetched, sd):
        moved = move_packed(source, torch.device("cpu"))
        assert list(moved) == list(sd)
        for k, t in sd.items():
            assert torch.equal(bits(moved[k]), bits(t)) and moved[k].shape == t.shape
            assert moved[k].untyped_storage().data_ptr() != source[k].untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_fetch_to_cuda_and_device_tier_on_gpu(tmp_path):
    sd = {"w": torch.randn(64, 64).bfloat16(), "b": torch.randn(64)}
    with ParameterStore(tmp_path, write_behind=False, device="cuda", device_tier_bytes=1 << 20) as store:
        store.publish("m", 1, sd)
        got = store.fetch("m", 1, device="cuda")
        assert all(t.device.type == "cuda" for t in got.values())
        assert store.device_tier.cached() == [("m", 1)]
        again = store.fetch("m", 1, device="cpu")
        for k, t in sd.items():
            assert torch.equal(bits(again[k]), bits(t))


@pytest.mark.parametrize("parallelism", [1, 3])
def test_run_jobs_runs_every_job_and_reraises_the_first_failure(parallelism):
    from pivotrl.gps.layout import IOPool, run_jobs

    done: list[int] = []
    with IOPool(parallelism) as pool:
        run_jobs(pool, [lambda i=i: done.append(i) for i in range(50)])
        assert sorted(done) == list(range(50))

        def boom() -> None:
            raise OSError("disk on fire")

        with pytest.raises(OSError, match="disk on fire"):
            run_jobs(pool, [boom, *[lambda: None] * 5])
