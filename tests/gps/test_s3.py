"""The persistent tier at an s3:// URL, against a local S3 server (moto): round trip, gc, the atomic-commit
rule: a reader never sees a torn version, a writer killed mid-publish exposes nothing, one of two writers of
a version wins (S3 conditional writes, If-None-Match)."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from pivotrl.gps import ParameterStore, VersionExistsError
from tests.gps._util import bits, check_versioned, versioned_state_dict
from tests.gps.s3server import new_bucket

LAYERS, WIDTH = 4, 128
CHUNK = 16 << 10  # many small objects per version: a crash or a read lands between them


def _store(url: str, **kw) -> ParameterStore:
    return ParameterStore(url, write_behind=False, device_tier_bytes=0, chunk_bytes=CHUNK, **kw)


def test_s3_round_trip_and_gc() -> None:
    url = new_bucket() + "/gps"
    with _store(url) as s:
        sd = {"w": torch.randn(300, 7).bfloat16(), "b": torch.randn(11), "i": torch.arange(5)}
        s.publish("m", 0, sd)
        s.publish("m", 1, versioned_state_dict(1, LAYERS, WIDTH))
        got = s.fetch("m", 0)
        assert all(torch.equal(bits(got[k]), bits(v)) for k, v in sd.items())
        check_versioned(1, s.fetch("m", 1), LAYERS, WIDTH)
        assert s.gc("m", keep_last=1) == [0]
    with _store(url) as fresh:
        assert fresh.versions("m") == [1]


def test_s3_reader_never_sees_a_torn_version() -> None:
    url = new_bucket() + "/gps"
    writer, reader = _store(url), _store(url)
    done = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def read_loop() -> None:
        try:
            while not done.is_set():
                vs = reader.versions("m")
                if vs:
                    check_versioned(vs[-1], reader.fetch("m", vs[-1]), LAYERS, WIDTH)
                    seen.append(vs[-1])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=read_loop)
    t.start()
    try:
        for v in range(6):
            writer.publish("m", v, versioned_state_dict(v, LAYERS, WIDTH))
    finally:
        done.set()
        t.join(60)
    assert not errors, errors[0]
    assert seen and seen == sorted(seen)  # versions appear in order and each read was whole
    writer.close()
    reader.close()


def _die_mid_publish(url: str, after_chunks: int) -> None:
    """A writer process that dies (os._exit) after `after_chunks` chunk objects of its publish landed."""
    import os

    from pivotrl.gps.backend import FsspecBackend

    orig = FsspecBackend.write_file
    count = [0]

    def write_file(self, path, buffers):
        if "/c/" in path:
            count[0] += 1
            if count[0] > after_chunks:
                os._exit(17)
        orig(self, path, buffers)

    FsspecBackend.write_file = write_file
    s = ParameterStore(url, write_behind=False, device_tier_bytes=0, chunk_bytes=CHUNK, io_threads=2)
    s.publish("m", 1, versioned_state_dict(1, LAYERS, WIDTH))


def test_s3_writer_killed_mid_publish_exposes_nothing() -> None:
    import s3fs

    url = new_bucket() + "/gps"
    with _store(url) as s:
        s.publish("m", 0, versioned_state_dict(0, LAYERS, WIDTH))
    p = mp.get_context("spawn").Process(target=_die_mid_publish, args=(url, 3))
    p.start()
    p.join(120)
    assert p.exitcode == 17  # it died inside the publish, after some chunks were written
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    vdir = url.removeprefix("s3://") + "/m/v000000000001"
    assert fs.ls(vdir)  # its data objects are there ...
    assert not fs.exists(vdir + "/zarr.json")  # ... but no manifest: not a version
    with _store(url) as s:
        assert s.versions("m") == [0]
        check_versioned(0, s.fetch("m", 0), LAYERS, WIDTH)
        s.publish("m", 1, versioned_state_dict(1, LAYERS, WIDTH))  # the torn attempt blocks nothing
        check_versioned(1, s.fetch("m", 1), LAYERS, WIDTH)


def test_s3_two_writers_of_one_version_exactly_one_wins() -> None:
    url = new_bucket() + "/gps"
    a, b = _store(url), _store(url)
    results: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def write(name: str, s: ParameterStore, v: int) -> None:
        barrier.wait()
        try:
            s.publish("m", 5, versioned_state_dict(v, LAYERS, WIDTH))
            results[name] = "won"
        except VersionExistsError:
            results[name] = "lost"

    ts = [threading.Thread(target=write, args=("a", a, 5)), threading.Thread(target=write, args=("b", b, 5))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(results.values()) == ["lost", "won"]
    check_versioned(5, a.fetch("m", 5), LAYERS, WIDTH)
    with pytest.raises(VersionExistsError):
        a.publish("m", 5, versioned_state_dict(5, LAYERS, WIDTH))
    a.close()
    b.close()


def test_s3_reader_in_another_process_sees_new_versions() -> None:
    """A reader with its own S3 client (as on another node) lists versions published after its first
    listing: object-store listing caches must not hide them."""
    import s3fs

    url = new_bucket() + "/gps"
    writer, reader = _store(url), _store(url)
    reader.persistent.fs = s3fs.S3FileSystem(skip_instance_cache=True)  # not the writer's client and cache
    writer.publish("m", 0, versioned_state_dict(0, LAYERS, WIDTH))
    assert reader.versions("m") == [0]
    writer.publish("m", 1, versioned_state_dict(1, LAYERS, WIDTH))
    assert reader.versions("m") == [0, 1]
    check_versioned(1, reader.fetch("m", "latest"), LAYERS, WIDTH)
    writer.close()
    reader.close()
