from __future__ import annotations

import pytest

from pivotrl.core import Role
from pivotrl.core.queues import WaitingQueue

from .helpers import seq


def test_fifo_for_fresh_work() -> None:
    q = WaitingQueue()
    for i in range(5):
        q.push(seq(i), order=i)
    assert [q.pop().seq_id for _ in range(5)] == ["s0", "s1", "s2", "s3", "s4"]
    assert q.pop() is None and len(q) == 0


def test_aborted_work_goes_ahead_of_fresh_oldest_first() -> None:
    q = WaitingQueue()
    fresh = [seq(i) for i in range(3)]
    for i, s in enumerate(fresh):
        q.push(s, order=10 + i)
    late, early = seq("late", aborts=1), seq("early", aborts=2)
    q.push(late, order=5)
    q.push(early, order=1)
    assert q.ids() == ["early", "late", "s0", "s1", "s2"]
    assert q.peek() is early


def test_remove_is_lazy_but_exact() -> None:
    q = WaitingQueue()
    for i in range(4):
        q.push(seq(i), order=i)
    assert q.remove("s0").seq_id == "s0"
    assert q.remove("nope") is None
    assert "s0" not in q and len(q) == 3
    assert q.pop().seq_id == "s1"
    # Re-pushing a removed id works and takes its new place.
    q.push(seq(0, Role.ROLLOUT), order=100)
    assert q.ids() == ["s2", "s3", "s0"]


def test_double_push_rejected() -> None:
    q = WaitingQueue()
    s = seq(1)
    q.push(s, 1)
    with pytest.raises(ValueError):
        q.push(s, 2)
