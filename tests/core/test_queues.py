from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core import Role, Sequence
from pivotrl.core.queues import WaitingQueue

from ._hyp import CI
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


@CI
@given(ops=st.lists(st.tuples(st.sampled_from(["push", "pop", "remove"]), st.integers(0, 7),
                              st.integers(0, 500), st.integers(0, 300)), max_size=60))
def test_context_tokens_is_what_the_waiting_sequences_prefill(ops) -> None:
    """`context_tokens` (the prefill the planner's views charge) equals the sum over waiting sequences of
    prompt + generated, through any mix of push, pop and lazy removal."""
    q = WaitingQueue()
    for n, (op, i, prompt, generated) in enumerate(ops):
        sid = f"s{i}"
        if op == "push" and sid not in q:
            q.push(Sequence(sid, Role.REWARD, prompt, 400, generated=generated, aborts=int(generated > 0)), n)
        elif op == "pop":
            q.pop()
        elif op == "remove":
            q.remove(sid)
        assert q.context_tokens == sum(s.prompt_tokens + s.generated for s in q.values())


@CI
@given(ops=st.lists(st.tuples(st.sampled_from(["push", "pop", "remove", "progress"]), st.integers(0, 7),
                              st.integers(1, 5000), st.one_of(st.none(), st.floats(1, 5000))), max_size=60))
def test_work_is_the_waiting_sequences_expected_work(ops) -> None:
    """`work` (what a whole-batch replica's share is measured against) equals the sum of the waiting
    sequences' `remaining_estimate`, through push, pop, lazy removal and a late progress report."""
    q = WaitingQueue()
    for n, (op, i, size, expected) in enumerate(ops):
        sid = f"s{i}"
        if op == "push" and sid not in q:
            q.push(Sequence(sid, Role.TRAIN, 0, size, expected_new_tokens=expected), n)
        elif op == "pop":
            q.pop()
        elif op == "remove":
            q.remove(sid)
        elif op == "progress" and sid in q:
            s = next(x for x in q.values() if x.seq_id == sid)
            s.generated = min(s.max_new_tokens, s.generated + size // 2)
            q.rework(s)
        want = sum(s.remaining_estimate() for s in q.values())
        assert q.work == pytest.approx(want, rel=1e-9, abs=1e-9)
