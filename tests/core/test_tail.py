"""The last stage's shift-up waits out a longer tail upstream of it (`views.keeps_up`, `views.tail_s`),
and the per-replica cache that prices that tail without walking sequences (`Replica.furthest`)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core import IterationPlan, Role
from pivotrl.core.dispatcher import dispatch_all
from pivotrl.core.planner import plan
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.types import SeqState
from pivotrl.core.views import keeps_up, role_views, tail_s

from ._hyp import CI
from .helpers import active_state, config, seq


def _judge_tail(judged: int, longest: float, train_items: int, train_replicas: int = 1):
    """Every rollout judged but `judged` left on two judge replicas, each running one item that has
    generated 100 tokens; train holds `train_items` items of 100 tokens; three more judge replicas idle.
    The plan expects the iteration's longest judgement at `longest` tokens."""
    cfg = config(horizon_s=10.0, cooldown_s=0.0)
    stt = active_state(cfg, {Role.ROLLOUT: 1, Role.REWARD: 5, Role.TRAIN: train_replicas})
    stt.plan = IterationPlan(0, rollout_seqs=8, group_size=1, rollout_tokens_per_seq=50,
                             reward_tokens_per_rollout=150, train_tokens_per_group=100,
                             reward_tokens_longest=longest)
    stt.submitted[Role.ROLLOUT] = 8
    for i in range(judged):
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=3000, expected_new_tokens=150), 0.0)
    for i in range(train_items):
        stt.admit(seq(f"t{i}", Role.TRAIN, prompt=0, max_new=100), 0.0)
    dispatch_all(stt)
    for s in list(stt.seqs.values()):
        if s.role is Role.REWARD:
            stt.update_progress(s, 100)
    stt.check()
    return stt


def test_a_judge_tail_longer_than_trains_drain_keeps_train_from_taking_devices() -> None:
    """The judge's last items still need ~1,900 tokens (the expected longest, 2,000, less the 100 each has
    generated) while train's backlog and the two groups still to come drain at once: more train devices
    would end nothing sooner, so the idle judge replicas stay. With a short expected longest and a train
    backlog ten times as deep, the backlog outlasts the tail, and train takes them."""
    long_tail = _judge_tail(judged=2, longest=2000.0, train_items=40)
    views = role_views(long_tail, 10.0)
    assert tail_s(long_tail, views[Role.REWARD]) > 0.0
    assert keeps_up(long_tail, views, Role.TRAIN)
    res = plan(long_tail, ShiftCostModel(prior_s=1.0), 1.0)
    assert res.to_role is not Role.TRAIN
    assert "drains before the tail upstream of it ends" in res.reasoning.note

    short_tail = _judge_tail(judged=2, longest=120.0, train_items=400)
    views = role_views(short_tail, 10.0)
    assert not keeps_up(short_tail, views, Role.TRAIN)
    res = plan(short_tail, ShiftCostModel(prior_s=1.0), 1.0)
    assert res.to_role is Role.TRAIN and res.chosen is not None


def test_keeps_up_waits_for_the_first_stage_and_the_upstreams_running_rows() -> None:
    """Not asked while rollouts are still to come, while the first stage has live work, or when the judge
    runs nothing (its tail is unknown)."""
    stt = _judge_tail(judged=2, longest=2000.0, train_items=40)
    stt.submitted[Role.ROLLOUT] = 7
    assert not keeps_up(stt, role_views(stt, 10.0), Role.TRAIN)
    stt = _judge_tail(judged=2, longest=2000.0, train_items=40)
    stt.admit(seq("late", Role.ROLLOUT, max_new=100), 0.0)
    assert not keeps_up(stt, role_views(stt, 10.0), Role.TRAIN)
    stt = _judge_tail(judged=0, longest=2000.0, train_items=40)
    assert tail_s(stt, role_views(stt, 10.0)[Role.REWARD]) == 0.0
    assert not keeps_up(stt, role_views(stt, 10.0), Role.TRAIN)


@CI
@given(judged=st.integers(1, 10), longest=st.floats(1.0, 1e5), items=st.integers(1, 200),
       reps=st.integers(1, 4))
def test_keeps_up_is_the_comparison_of_trains_drain_with_the_judges_tail(
    judged: int, longest: float, items: int, reps: int
) -> None:
    """`keeps_up` says yes exactly when train's work, with a train item for every judgement left, over its
    rate now, ends before the judge's longest item may: the expected longest less what the furthest item
    generated, or that item's own remaining estimate where larger, at the judge's seconds per token of one
    row."""
    stt = _judge_tail(judged, longest, items, train_replicas=reps)
    views = role_views(stt, 10.0)
    rw, tr = views[Role.REWARD], views[Role.TRAIN]
    rows = sum(r.n for r in stt.by_role[Role.REWARD].values())
    lead = next(s for s in stt.seqs.values() if s.role is Role.REWARD)
    tail = max(longest - 100, lead.remaining_estimate(), 1.0) * rows / rw.rate
    got = tail_s(stt, rw)
    assert got == tail or abs(got - tail) <= 1e-9 * tail
    drain = (tr.work + rw.seqs * 100.0) / tr.rate
    assert keeps_up(stt, views, Role.TRAIN) == (drain < got)


@CI
@given(seed=st.integers(0, 2**32 - 1))
def test_a_replicas_furthest_sequence_follows_its_running_sequences(seed: int) -> None:
    """Admissions, dispatch, progress, aborts, moves and finishes in random order: each replica's cached
    furthest sequence is one of its running sequences with the most generated after every step
    (`ClusterState.check` re-derives it too)."""
    rng = random.Random(seed)
    stt = active_state(config(), {Role.ROLLOUT: 3})
    n = 0
    for _ in range(60):
        op = rng.random()
        live = [s for s in stt.seqs.values()]
        running = [s for s in live if s.state is SeqState.RUNNING]
        if op < 0.25 or not live:
            stt.admit(seq(n, Role.ROLLOUT, max_new=rng.randint(1, 300)), 0.0)
            n += 1
            dispatch_all(stt)
        elif op < 0.55 and running:
            s = rng.choice(running)
            stt.update_progress(s, s.generated + rng.randint(0, 80))
        elif op < 0.7 and running:
            stt.abort(rng.choice(running))
            dispatch_all(stt)
        elif op < 0.8 and running:
            s = rng.choice(running)
            dst = [r for r in stt.by_role[Role.ROLLOUT].values()
                   if r.replica_id != s.replica_id and r.fits(stt.kv_need(s))]
            if dst:
                stt.move(s, rng.choice(dst))
        else:
            stt.finish(rng.choice(live), 1.0)
            dispatch_all(stt)
        stt.check()
        for rep in stt.replicas.values():
            far = rep.furthest()
            most = max((s.generated for s in rep.running.values()), default=None)
            assert (far is None) == (most is None)
            assert far is None or (rep.running[far.seq_id] is far and far.generated == most)
