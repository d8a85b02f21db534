"""ReadArena: a buffer is handed out again only once nothing else references it."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.arena import ReadArena

MB = 1 << 20


def _span(a: np.ndarray) -> tuple[int, int]:
    p = a.__array_interface__["data"][0]
    return p, p + a.nbytes


def test_reuses_a_buffer_once_its_views_are_gone():
    arena = ReadArena(max_buffers=2, min_bytes=MB)
    a = arena.take(4 * MB)
    start = _span(a)[0]
    t = torch.from_numpy(a)[16:32].view(torch.float32)  # a derived view keeps the buffer busy
    del a
    b = arena.take(4 * MB)
    assert _span(b)[0] != start
    del b
    c = arena.take(4 * MB)  # t still holds the first buffer; the second is free again
    assert _span(c)[0] != start
    reused = arena.stats["reused"]
    del c, t
    arena.take(3 * MB)  # both pooled buffers are free now: one of them serves it
    assert arena.stats["reused"] == reused + 1


def test_busy_buffers_are_never_handed_out_and_small_ones_are_not_pooled():
    arena = ReadArena(max_buffers=1, min_bytes=MB)
    small = arena.take(1000)
    assert arena.stats == {"reused": 0, "allocated": 0} and small.nbytes == 1000
    a = arena.take(2 * MB)
    b = arena.take(2 * MB)
    assert not np.shares_memory(a, b)
    del a, b
    c = arena.take(2 * MB)
    assert arena.stats["reused"] == 1
    d = arena.take(MB // 4 * 3)  # under half of the free buffer's size: not served from it
    assert not np.shares_memory(c, d)


def test_a_store_fetch_reuses_its_read_buffer(tmp_path):
    from pivotrl.gps import ParameterStore

    sd = {f"w{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MB: above the pooling floor
    with ParameterStore(tmp_path, device_tier_bytes=0, write_behind=False) as store:
        store.publish("m", 0, sd)
        store.publish("m", 1, {k: v + 1 for k, v in sd.items()})
        got0 = store.fetch("m", 0, copy=False)
        p0 = got0["w0"].data_ptr()
        got1 = store.fetch("m", 1)  # v0's buffer is still held: a second one
        assert got1["w0"].data_ptr() != p0 and torch.equal(got0["w0"], sd["w0"])
        del got0
        again = store.fetch("m", 1, copy=False)
        assert again["w0"].data_ptr() == p0  # the buffer v0's tensors left
        assert store._arena.stats["reused"] == 1
        assert all(torch.equal(again[k], sd[k] + 1) and torch.equal(got1[k], sd[k] + 1) for k in sd)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["take", "drop", "view"]), st.integers(1, 6), st.integers(0, 7)),
                min_size=1, max_size=40),
       st.integers(0, 3))
def test_live_leases_never_overlap_and_keep_their_bytes(ops, max_buffers):
    """Random take / drop / derive-a-view sequences: every buffer anyone still holds keeps the pattern
    written into it, and no two held buffers share memory."""
    arena = ReadArena(max_buffers=max_buffers, min_bytes=MB)
    held: list[tuple[object, int, int]] = []  # (array or derived tensor, pattern, nbytes)
    for n, (op, size, pick) in enumerate(ops):
        if op == "take":
            a = arena.take(size * MB)
            assert a.nbytes == size * MB
            a[:] = n % 251
            held.append((a, n % 251, a.nbytes))
        elif held:
            i = pick % len(held)
            obj, pat, nb = held.pop(i)
            if op == "view":  # keep only a derived torch view of it
                t = torch.from_numpy(obj)[: nb // 2] if isinstance(obj, np.ndarray) else obj
                held.append((t, pat, t.numel()))
        for obj, pat, _ in held:
            arr = obj if isinstance(obj, np.ndarray) else obj.numpy()
            assert arr.min() == pat == arr.max()
    arrays = [o if isinstance(o, np.ndarray) else o.numpy() for o, _, _ in held]
    for i in range(len(arrays)):
        for j in range(i + 1, len(arrays)):
            assert not np.shares_memory(arrays[i], arrays[j])
