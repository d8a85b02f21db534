"""gps.pieces: a peer pull's requests cover every wanted tensor exactly once, each request inside one chunk
file and at most the range size, and a piece of several tensors is one contiguous request."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.manifest import ArrayEntry, Manifest, TensorEntry
from pivotrl.gps.pieces import plan_pieces

ITEMSIZE = {"float32": 4, "bfloat16": 2, "int8": 1}


@st.composite
def manifests(draw) -> tuple[Manifest, int]:
    tensors: list[TensorEntry] = []
    arrays: list[ArrayEntry] = []
    for dtype in draw(st.lists(st.sampled_from(sorted(ITEMSIZE)), min_size=1, max_size=3, unique=True)):
        item = ITEMSIZE[dtype]
        chunk_bytes = item * draw(st.integers(1, 64))
        offset = 0
        for i in range(draw(st.integers(1, 12))):
            offset += item * draw(st.sampled_from([0, 0, 0, 1, 5]))  # mostly packed, sometimes a gap
            n = item * draw(st.integers(0, 100))
            tensors.append(TensorEntry(f"{dtype}.{i}", dtype, (n // item,), f"{dtype}.a", offset, n, "0"))
            offset += n
        nchunks = max(1, -(-offset // chunk_bytes))
        arrays.append(ArrayEntry(f"{dtype}.a", dtype, item, offset, chunk_bytes, nchunks))
    max_bytes = draw(st.integers(1, 300))
    return Manifest("m", 1, "d-x", tuple(tensors), tuple(arrays), created=0.0), max_bytes


@settings(max_examples=300, deadline=None)
@given(manifests(), st.data())
def test_pieces_cover_each_tensor_once_within_chunks_and_the_range_size(case, data) -> None:
    man, max_bytes = case
    names = data.draw(st.none() | st.lists(st.sampled_from(man.names), unique=True, min_size=1))
    pieces = plan_pieces(man, max_bytes, names)
    got = [e.name for p in pieces for e in p.entries]
    assert sorted(got) == sorted(man.names if names is None else names)
    chunk = {a.name: a.chunk_bytes for a in man.arrays}
    for p in pieces:
        cb = chunk[p.array]
        first, last = p.entries[0], p.entries[-1]
        assert p.start == first.offset and p.nbytes == last.offset + last.nbytes - first.offset
        for a, b in zip(p.entries, p.entries[1:]):
            assert a.offset + a.nbytes == b.offset  # one contiguous run of the packed array
        assert sum(s.nbytes for s in p.segments) == p.nbytes
        done = 0
        for s in p.segments:
            assert s.dst == done and 0 < s.nbytes <= max_bytes
            assert s.chunk * cb + s.offset == p.start + done and s.offset + s.nbytes <= cb  # one chunk file
            done += s.nbytes
        if len(p.entries) > 1:  # several tensors: always one request, their buffer is their memory
            assert p.direct and p.nbytes <= max_bytes


def test_a_tensor_over_the_range_size_or_across_chunks_is_cut_into_segments() -> None:
    tensors = (
        TensorEntry("big", "int8", (250,), "a", 0, 250, "0"),
        TensorEntry("across", "int8", (20,), "a", 250, 20, "0"),
        TensorEntry("small", "int8", (10,), "a", 270, 10, "0"),
    )
    man = Manifest("m", 1, "d", tensors, (ArrayEntry("a", "int8", 1, 280, 260, 2),), created=0.0)
    pieces = plan_pieces(man, 100)
    assert [[e.name for e in p.entries] for p in pieces] == [["big"], ["across"], ["small"]]
    assert [(s.chunk, s.offset, s.nbytes) for s in pieces[0].segments] == [(0, 0, 100), (0, 100, 100),
                                                                         (0, 200, 50)]
    assert [(s.chunk, s.offset, s.nbytes) for s in pieces[1].segments] == [(0, 250, 10), (1, 0, 10)]
    assert pieces[2].direct
    with pytest.raises(ValueError):
        plan_pieces(man, 0)
