"""A simulated replica prefills its admitted prompts one after another; an aborted sequence's prefill not yet
done is not done (as an engine that prefills a waiting request only when it admits it)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim.config import DecodeCost, GenRoleCost
from pivotrl.sim.replicas import GenReplica

RATE = 100.0  # prompt tokens per second: a prompt of 100 tokens pauses its replica 1 s


def replica() -> GenReplica:
    cost = GenRoleCost(decode=DecodeCost(a_s=0.01, b_s=0.0, c_s=0.0), prefill_tokens_per_s=RATE,
                       weights_gb=0.0)
    return GenReplica("r", "rollout", ("d0",), cost)


def test_an_aborted_prefill_is_charged_only_for_what_was_done() -> None:
    rep = replica()
    for sid in "abc":
        rep.admit(0.0, sid, prompt=100, generated=0, target=50)
    assert rep.paused_until == pytest.approx(3.0)
    rep.abort_one(0.5, "c")  # still waiting: its whole second goes
    assert rep.paused_until == pytest.approx(2.0)
    rep.abort_one(1.5, "b")  # half done: the other half goes
    assert rep.paused_until == pytest.approx(1.5)
    rep.abort_one(2.0, "a")  # done long ago: nothing to give back
    assert rep.paused_until == pytest.approx(1.5)
    assert rep.busy_time == pytest.approx(1.5 + 0.5)  # 1.5 s of prefill, then a decoding from 1.5 to 2.0


def test_the_prefills_behind_an_aborted_one_move_up() -> None:
    rep = replica()
    for sid in "abc":
        rep.admit(0.0, sid, prompt=100, generated=0, target=50)
    rep.abort_one(0.0, "a")  # b now prefills over [0, 1), c over [1, 2)
    assert rep.paused_until == pytest.approx(2.0)
    rep.abort_one(0.5, "b")  # half of b done; c over [0.5, 1.5)
    assert rep.paused_until == pytest.approx(1.5)
    rep.abort_one(1.0, "c")  # half of c done
    assert rep.paused_until == pytest.approx(1.0)


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "abort", "pause"]), st.floats(0.0, 2.0), st.integers(1, 400),
              st.integers(0, 1000)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_the_pause_is_the_work_left_of_a_first_in_first_out_prefill_queue(ops: list) -> None:
    """Any interleaving of admissions, aborts and pauses (a weight load) at rising times: the replica is
    paused until now plus the work left of a FIFO queue from which an aborted sequence's work is removed."""
    rep = replica()
    queue: list[list] = []  # [sequence id or None for a pause, seconds left]
    now = 0.0
    live: list[str] = []

    def advance(to: float) -> None:
        dt = to - advance.clock
        while dt > 1e-12 and queue:
            take = min(dt, queue[0][1])
            queue[0][1] -= take
            dt -= take
            if queue[0][1] <= 1e-12:
                queue.pop(0)
        advance.clock = to

    advance.clock = 0.0
    for i, (op, dt, tokens, pick) in enumerate(ops):
        now += dt
        advance(now)
        if op == "admit":
            sid = f"s{i}"
            rep.admit(now, sid, prompt=tokens, generated=0, target=10_000)
            queue.append([sid, tokens / RATE])
            live.append(sid)
        elif op == "abort" and live:
            sid = live.pop(pick % len(live))
            rep.abort_one(now, sid)
            queue[:] = [job for job in queue if job[0] != sid]
        elif op == "pause":
            rep.pause(now, tokens / RATE)
            queue.append([None, tokens / RATE])
        assert max(rep.paused_until, now) == pytest.approx(now + sum(job[1] for job in queue), abs=1e-6)
