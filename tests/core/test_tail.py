"""The last stage's shift-up waits out a longer tail upstream of it (`views.keeps_up`, `views.tail_s`):
the judge's, or for a device that would arrive after them the rollouts'; and the per-replica cache that
prices that tail without walking sequences (`Replica.furthest`)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core import IterationPlan, Role
from pivotrl.core.dispatcher import dispatch_all
from pivotrl.core.iteration import IterationChoice
from pivotrl.core.planner import plan
from pivotrl.core.shiftable import Shiftable
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


def _rollout_tail(running: int, longest: float, train_items: int, judged: int = 2, waiting: int = 0,
                  max_staleness: int = 0):
    """Every rollout submitted; `running` of them still decoding on one rollout replica (each has generated
    100 tokens; `waiting` more queued behind a full replica when asked), `judged` judgements on the judge's
    two busy replicas (100 tokens each), `train_items` train items of 100 tokens. The plan expects the
    iteration's longest rollout at `longest` tokens; two judge replicas idle."""
    cfg = config(horizon_s=10.0, cooldown_s=0.0, max_staleness=max_staleness)
    stt = active_state(cfg, {Role.ROLLOUT: 1, Role.REWARD: 4, Role.TRAIN: 1})
    stt.plan = IterationPlan(0, rollout_seqs=64, group_size=1, rollout_tokens_per_seq=50,
                             reward_tokens_per_rollout=150, train_tokens_per_group=100,
                             rollout_tokens_longest=longest, reward_tokens_longest=400.0)
    stt.submitted[Role.ROLLOUT] = 64
    for i in range(running + waiting):
        stt.admit(seq(f"r{i}", Role.ROLLOUT, max_new=400, expected_new_tokens=50), 0.0)
    for i in range(judged):
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=3000, expected_new_tokens=150), 0.0)
    for i in range(train_items):
        stt.admit(seq(f"t{i}", Role.TRAIN, prompt=0, max_new=100), 0.0)
    dispatch_all(stt)
    for s in list(stt.seqs.values()):
        if s.role is not Role.TRAIN and s.state is SeqState.RUNNING:
            stt.update_progress(s, 100)
    stt.check()
    return stt


def test_in_the_rollouts_tail_train_takes_no_device_that_would_arrive_after_it() -> None:
    """The last rollouts still need ~1,900 tokens. A device shifted to train in 60 s would arrive after
    them, in the judge's tail, where the rule above would keep train from taking it: so it is not moved now
    either (random draw 36: two idle rollout devices and a judge device moved to train just before the last
    rollouts ended, then back at the next opening). A shift faster than the rollouts' tail, a rollout still
    waiting, or an opening that sends every device to the first stage anyway leaves the choice to the
    planner; so does a train backlog deeper than the tail."""
    stt = _rollout_tail(running=2, longest=2000.0, train_items=10)
    views = role_views(stt, 10.0)
    head = tail_s(stt, views[Role.ROLLOUT])
    assert 0.0 < head < 60.0
    assert keeps_up(stt, views, Role.TRAIN, arrive_s=60.0)
    assert not keeps_up(stt, views, Role.TRAIN, arrive_s=head / 2)
    slow = ShiftCostModel(prior_s=60.0)
    res = plan(stt, slow, 1.0)
    assert res.to_role is not Role.TRAIN
    assert "drains before the tail upstream of it ends" in res.reasoning.note
    assert "drains before" not in plan(stt, slow, 1.0, opens_colocated=True).reasoning.note
    assert "drains before" not in plan(stt, ShiftCostModel(prior_s=head / 2), 1.0).reasoning.note

    queued = _rollout_tail(running=8, waiting=1, longest=2000.0, train_items=10)
    assert len(queued.queues[Role.ROLLOUT]) == 1
    assert not keeps_up(queued, role_views(queued, 10.0), Role.TRAIN, arrive_s=1e9)
    deep = _rollout_tail(running=2, longest=2000.0, train_items=4000)
    assert not keeps_up(deep, role_views(deep, 10.0), Role.TRAIN, arrive_s=1e9)


def test_an_iteration_opening_colocated_asks_only_on_policy() -> None:
    """Where the next iteration opens with every device on the first stage, a device moved to train makes
    no trip back of its own, and the shiftable policy asks only once the rollouts are done; with staleness
    the next rollouts start when these end, on the devices they hold then, so it asks in their tail too."""
    asked = {}
    for k in (0, 1):
        stt = _rollout_tail(running=2, longest=2000.0, train_items=10, max_staleness=k)
        pol = Shiftable()
        pol.choice = IterationChoice("dynamic", {"static": 20.0, "dynamic": 10.0, "colocated": 15.0},
                                     {Role.ROLLOUT: 1, Role.REWARD: 4, Role.TRAIN: 1}, 1.0)
        assert pol.choice.opens_colocated()
        pol.plan(stt, ShiftCostModel(prior_s=60.0), 1.0)
        assert pol.last is not None
        asked[k] = "drains before the tail upstream of it ends" in pol.last.reasoning.note
    assert asked == {0: False, 1: True}


@CI
@given(running=st.integers(1, 8), judged=st.integers(0, 4), longest=st.floats(1.0, 1e5),
       items=st.integers(1, 400), arrive=st.floats(0.0, 1e4))
def test_in_the_rollouts_tail_keeps_up_is_its_definition(
    running: int, judged: int, longest: float, items: int, arrive: float
) -> None:
    """In the rollouts' tail `keeps_up` says yes exactly when a device moved now would arrive after the
    longest rollout may end, and train's work, with a train item for every live rollout and judgement, over
    its rate now, ends before the later of the judge's own tail and that rollout's end plus the longest
    judgement's time on one judge replica."""
    stt = _rollout_tail(running, longest, items, judged=judged)
    views = role_views(stt, 10.0)
    ro, rw, tr = views[Role.ROLLOUT], views[Role.REWARD], views[Role.TRAIN]
    head = tail_s(stt, ro)
    tail = max(tail_s(stt, rw), head + rw.item_s)
    drain = (tr.work + (rw.seqs + ro.seqs) * 100.0) / tr.rate
    want = 0.0 < head <= arrive and drain < tail
    assert keeps_up(stt, views, Role.TRAIN, arrive_s=arrive) == want


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
