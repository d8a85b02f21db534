"""Many readers while a writer publishes (threads and processes); two writers of one version: one wins."""

from __future__ import annotations

import multiprocessing as mp
import threading
import traceback

import pytest

from pivotrl.gps import NotFoundError, ParameterStore, VersionExistsError, WriteBehindError
from tests.gps._util import check_versioned, versioned_state_dict

N_VERSIONS = 12


def _reader_loop(root: str, stop: threading.Event | None, n_reads: int, errors: list) -> None:
    try:
        with ParameterStore(root, device_tier_bytes=0, io_threads=2) as store:
            seen = 0
            while (stop is None or not stop.is_set()) and seen < n_reads:
                try:
                    v = store.latest("m")
                except NotFoundError:
                    continue
                check_versioned(v, store.fetch("m", v))
                seen += 1
    except BaseException:
        errors.append(traceback.format_exc())


def _reader_process(root: str, n_reads: int, q) -> None:
    errors: list[str] = []
    _reader_loop(root, None, n_reads, errors)
    q.put(errors)


def test_thread_readers_never_see_a_torn_version(tmp_path):
    root = str(tmp_path)
    errors: list[str] = []
    stop = threading.Event()
    readers = [threading.Thread(target=_reader_loop, args=(root, stop, 10**9, errors)) for _ in range(3)]
    for r in readers:
        r.start()
    with ParameterStore(root, write_behind=False, chunk_bytes=4096) as writer:
        for v in range(N_VERSIONS):
            writer.publish("m", v, versioned_state_dict(v))
    stop.set()
    for r in readers:
        r.join(60)
    assert not errors, errors[0]


def test_process_readers_never_see_a_torn_version(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    root = str(tmp_path)
    with ParameterStore(root, write_behind=False) as writer:
        writer.publish("m", 0, versioned_state_dict(0))
        procs = [ctx.Process(target=_reader_process, args=(root, 40, q)) for _ in range(2)]
        for p in procs:
            p.start()
        for v in range(1, N_VERSIONS):
            writer.publish("m", v, versioned_state_dict(v))
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert not [e for r in results for e in r], results


def test_two_thread_writers_of_one_version_exactly_one_wins(tmp_path):
    barrier = threading.Barrier(4)
    outcomes: list[object] = []

    def write(i: int) -> None:
        with ParameterStore(tmp_path, write_behind=False, device_tier_bytes=0) as s:
            barrier.wait()
            try:
                s.publish("m", 7, versioned_state_dict(100 + i))
                outcomes.append(("won", i))
            except VersionExistsError as exc:
                outcomes.append(("lost", str(exc)))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [o for o in outcomes if o[0] == "won"]
    assert len(winners) == 1 and len(outcomes) == 4, outcomes
    assert all("version 7" in str(o[1]) for o in outcomes if o[0] == "lost")
    with ParameterStore(tmp_path, device_tier_bytes=0) as reader:
        check_versioned(100 + winners[0][1], reader.fetch("m", 7))
        assert reader.sweep("m") == 0  # losers removed their own data


def _racing_writer(root: str, i: int, barrier, q) -> None:
    with ParameterStore(root, write_behind=False, device_tier_bytes=0) as s:
        barrier.wait()
        try:
            s.publish("m", 1, versioned_state_dict(200 + i))
            q.put(("won", i))
        except VersionExistsError:
            q.put(("lost", i))


@pytest.mark.parametrize("rounds", [3])
def test_two_process_writers_of_one_version_exactly_one_wins(tmp_path, rounds):
    ctx = mp.get_context("fork")
    for r in range(rounds):
        root = str(tmp_path / str(r))
        barrier, q = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_racing_writer, args=(root, i, barrier, q)) for i in range(2)]
        for p in procs:
            p.start()
        outcomes = sorted(q.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
        assert [o[0] for o in outcomes] == ["lost", "won"], outcomes
        winner = next(i for kind, i in outcomes if kind == "won")
        with ParameterStore(root, device_tier_bytes=0) as reader:
            check_versioned(200 + winner, reader.fetch("m", 1))


def test_write_behind_loser_surfaces_on_flush(tmp_path):
    gate = threading.Event()
    with ParameterStore(tmp_path, device_tier_bytes=1 << 20) as behind:
        behind._bg.submit(gate.wait)  # hold the background writer so another writer gets there first
        try:
            behind.publish("m", 1, versioned_state_dict(1))
            assert behind.versions("m") == [1]  # visible to its own process at once
            with ParameterStore(tmp_path, write_behind=False) as other:
                other.publish("m", 1, versioned_state_dict(2))
        finally:
            gate.set()
        with pytest.raises(WriteBehindError, match=r"'m' version 1.*another writer"):
            behind.flush()
        behind.flush()  # reported once, then cleared
        check_versioned(2, behind.fetch("m", 1))  # the loser's cached copy was dropped


def test_two_writers_through_fsspec_file_url_exactly_one_wins(tmp_path):
    url = f"file://{tmp_path}/remote"
    barrier = threading.Barrier(3)
    outcomes: list[str] = []

    def write(i: int) -> None:
        with ParameterStore(url, write_behind=False, device_tier_bytes=0) as s:
            barrier.wait()
            try:
                s.publish("m", 2, versioned_state_dict(300 + i))
                outcomes.append("won")
            except VersionExistsError:
                outcomes.append("lost")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["lost", "lost", "won"]
