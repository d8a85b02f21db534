"""The handover of flushed gradient sums: every sum reaches its reader exactly once — from memory (its rank
took it) or from the store (written before anyone in another process needs it) — and no version is reused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.runtime import handover


class FakeStore:
    """The two calls the handover makes: `versions` and a synchronous `publish`."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, int], object] = {}

    def versions(self, name: str) -> list[int]:
        got = [v for (n, v) in self.data if n == name]
        if not got:
            raise LookupError(name)
        return got

    def publish(self, name: str, version: int, grads: object, write_behind: bool | None = None) -> None:
        assert write_behind is False  # persisted in the calling thread, from the sum's own tensors
        assert (name, version) not in self.data, "a version was written twice"
        self.data[(name, version)] = grads


@pytest.fixture(autouse=True)
def _clean():
    yield
    with handover._LOCK:
        handover._HANDED.clear()
        handover._LAST.clear()


OPS = st.lists(st.tuples(st.sampled_from(["flush", "flush_driver", "take", "persist", "drop"]),
                         st.sampled_from(["grad-a", "grad-b"]), st.integers(0, 3)), max_size=40)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(OPS)
def test_every_flushed_sum_is_taken_or_stored_exactly_once(ops):
    store = FakeStore()
    flushed: dict[tuple[str, int], object] = {}
    taken: dict[tuple[str, int], object] = {}
    for op, name, back in ops:
        if op in ("flush", "flush_driver"):
            gs = SimpleNamespace(grads=object())
            v = handover.flush_sum(store, name, gs, hand_over=op == "flush")
            assert (name, v) not in flushed, "a version was handed out twice"
            flushed[(name, v)] = gs.grads
            if op == "flush_driver":
                assert store.data[(name, v)] is gs.grads  # persisted before flush returns
            continue
        mine = sorted(v for (n, v) in flushed if n == name)
        if not mine:
            continue
        v = mine[-1 - min(back, len(mine) - 1)]
        if op == "take":
            got = handover.take(name, v)
            if got is not None:
                assert (name, v) not in taken and (name, v) not in store.data
                taken[(name, v)] = got.grads
        elif op == "persist":
            handover.persist(name, v)
        else:
            handover.drop(name)
    for name in ("grad-a", "grad-b"):
        handover.drop(name)  # every train context is offloaded in the end
    for key, grads in flushed.items():
        where = [store.data.get(key), taken.get(key)]
        assert sum(x is not None for x in where) == 1, key
        assert grads in where


def test_a_persisted_sum_is_no_longer_handed_over():
    store = FakeStore()
    gs = SimpleNamespace(grads=object())
    v = handover.flush_sum(store, "grad-a", gs, hand_over=True)
    assert store.data == {}
    assert handover.persist("grad-a", v) and store.data[("grad-a", v)] is gs.grads
    assert handover.take("grad-a", v) is None and not handover.persist("grad-a", v)
