"""A writer SIGKILLed at random points of a publish never exposes a torn version, and blocks nothing."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import time

from pivotrl.gps import ParameterStore, VersionExistsError
from pivotrl.gps.manifest import parse_version_dir
from tests.gps._util import check_versioned, versioned_state_dict

LAYERS, WIDTH = 8, 192  # ~1 MB per version, in many 64 KiB chunks: kills land in every phase of a publish


def _publisher(root: str, start: int, ready) -> None:
    store = ParameterStore(root, write_behind=False, device_tier_bytes=0, chunk_bytes=64 << 10, io_threads=2)
    ready.set()
    v = start
    while True:
        with contextlib.suppress(VersionExistsError):
            store.publish("m", v, versioned_state_dict(v, LAYERS, WIDTH))
        v += 1


def _leftovers(root: str) -> int:
    """Uncommitted data prefixes of (killed) writers: evidence that a kill landed mid-publish."""
    mdir = os.path.join(root, "m")
    count = 0
    for name in os.listdir(mdir) if os.path.isdir(mdir) else []:
        if parse_version_dir(name) is None:
            continue
        vdir = os.path.join(mdir, name)
        committed = os.path.exists(os.path.join(vdir, "zarr.json"))
        data = [d for d in os.listdir(vdir) if d.startswith("d-")]
        count += len(data) - (1 if committed else 0)
    return count


def _kill_loop(root: str, kills: int, seed: int) -> int:
    """SIGKILL `kills` publishing processes at random moments; returns how many died inside a publish."""
    rng = random.Random(seed)
    ctx = mp.get_context("fork")
    mid_publish_kills, before = 0, _leftovers(root)
    checked: set[int] = set()
    for _ in range(kills):
        with ParameterStore(root, device_tier_bytes=0) as probe:
            vs = probe.versions("m")
        start = vs[-1] + 1 if vs else 0  # re-publish right where the killed writer left debris
        ready = ctx.Event()
        proc = ctx.Process(target=_publisher, args=(root, start, ready))
        proc.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0.0, 0.12))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        after = _leftovers(root)
        mid_publish_kills += after > before
        before = after
        # every version any reader can see is complete and exactly what was published (committed versions
        # are immutable, so each is checked when it first appears, and all again at the end)
        with ParameterStore(root, device_tier_bytes=0) as reader:
            for v in sorted(set(reader.versions("m")) - checked):
                check_versioned(v, reader.fetch("m", v), LAYERS, WIDTH)
                checked.add(v)
    print(f"{kills} kills, {mid_publish_kills} of them inside a publish (left uncommitted data behind)")
    return mid_publish_kills


def _after_crashes_everything_works(root: str) -> None:
    with ParameterStore(root, write_behind=False, device_tier_bytes=0) as store:
        nxt = store.latest("m") + 1 if store.versions("m") else 0
        store.publish("m", nxt, versioned_state_dict(nxt, LAYERS, WIDTH))  # no manual clean-up needed
        check_versioned(nxt, store.fetch("m", "latest"), LAYERS, WIDTH)
        store.gc("m", keep_last=2)  # sweeps the dead writers' debris too
        assert _leftovers(root) == 0
        for v in store.versions("m"):
            check_versioned(v, store.fetch("m", v), LAYERS, WIDTH)


def test_sigkill_during_publish_25_times(tmp_path):
    """Forked writers make this fast (~5-15 s), so it runs in the default suite."""
    mid_publish = _kill_loop(str(tmp_path), kills=25, seed=2)
    assert mid_publish >= 5, (
        f"only {mid_publish} kills landed inside a publish; the test exercised too little"
    )
    _after_crashes_everything_works(str(tmp_path))
