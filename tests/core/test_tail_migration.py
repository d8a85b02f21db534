"""Tail migration (`pivotrl.core.tail_migration`): an idle replica of a generation role takes a long-running
sequence from a replica running several, where the move is expected to pay; only `Shiftable` does it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from pivotrl.core import Controller, IterationPlan, Role, RoleSpec
from pivotrl.core.stage import TAIL_FRACTIONS
from pivotrl.core.state import ClusterState
from pivotrl.core.tail_migration import Residual, best_from, step_s, tail_moves
from pivotrl.core.throughput import ThroughputModel
from pivotrl.core.types import ControllerConfig, ReplicaState, SeqState

from ._hyp import CI
from .helpers import active_state, config, ready, seq


def _profile(samples: np.ndarray) -> Residual:
    """The residual of `samples` as core's profile holds them: lengths at the tail fractions that hold at
    least one item, then the longest."""
    n = len(samples)
    fs = [f for f in TAIL_FRACTIONS if f * n > 1.0]
    ls = list(np.quantile(samples, [1.0 - f for f in fs]))
    return Residual.from_points(np.asarray([*fs, 1.0 / n]), np.asarray([*ls, samples.max()]))


@settings(CI, max_examples=40)
@given(mu=hst.floats(3.0, 8.0), sigma=hst.floats(0.1, 1.6), seed=hst.integers(0, 2**16))
def test_expected_left_is_the_mean_residual_of_lognormal_lengths(mu: float, sigma: float, seed: int) -> None:
    x = np.random.default_rng(seed).lognormal(mu, sigma, 20_000)
    r = _profile(x)
    for q in (0.0, 0.5, 0.9):
        g = float(np.quantile(x, q)) if q else 0.0
        empirical = float((x[x > g] - g).mean())
        est = r.expected_left(g)
        assert est is not None
        assert abs(est - empirical) <= 0.15 * empirical + 1.0, (q, est, empirical)


@settings(CI, max_examples=60)
@given(ls=hst.lists(hst.floats(1.0, 1e5), min_size=1, max_size=12), n=hst.integers(2, 10**6),
       f=hst.floats(0.0, 1.0))
def test_survival_inverts_length_at_and_ends_at_the_longest(ls: list[float], n: int, f: float) -> None:
    fracs = [t for t in TAIL_FRACTIONS[: len(ls)] if t * n > 1.0]
    r = Residual.from_points(np.asarray([*fracs, 1.0 / n]), np.asarray([*sorted(ls)[: len(fracs)], max(ls)]))
    longest = r.ls[-1]
    assert r.survival(longest) == 0.0 and r.expected_left(longest) is None
    assert r.survival(0.0) == 1.0 or r.ls[0] > 0.0
    f = max(f, r.fs[-1])
    length = float(r.length_at(np.asarray(f)))
    if length < longest and np.count_nonzero(np.asarray(r.ls) == length) == 1:
        assert abs(r.survival(length) - f) <= 1e-6 * max(f, 1e-12) + 1e-9
    for g in (0.0, longest * 0.5, longest * 0.99):
        left = r.expected_left(g)
        assert left is None or 1.0 <= left <= max(longest - g, 1.0) + 1e-6


def _heavy() -> Residual:
    """Most items short, a few very long: an item that has lived 1,000 tokens has ~9,000 to go."""
    return Residual.from_points(np.asarray([0.5, 0.1, 0.01, 1e-3]),
                                np.asarray([100.0, 1_000.0, 5_000.0, 20_000.0]))


def _tail_state(rows: int, idle: int, generated: int = 1_000, context_s: float = 1e-7) -> ClusterState:
    """One rollout replica running `rows` sequences that have generated `generated` tokens each, and
    `idle` idle rollout replicas; nothing queued. Steps slow with rows and context."""
    spec = RoleSpec(max_seqs=16, kv_tokens=10**7, prior_step_a_s=0.007, prior_step_b_s=0.0004,
                    step_context_s=context_s, prefill_tokens_per_s=20_000.0)
    st = active_state(config(roles={Role.ROLLOUT: spec}), {Role.ROLLOUT: 1 + idle})
    for rep in st.replicas.values():
        rep.model = ThroughputModel(0.007, 0.0004, context_s=context_s)
    busy = sorted(st.replicas.values(), key=lambda r: r.replica_id)[0]
    for i in range(rows):
        s = seq(i, Role.ROLLOUT, max_new=30_000)
        st.admit(s, 0.0)
        st.start(st.queues[Role.ROLLOUT].pop(), busy)
        st.update_progress(s, generated)
    return st


def test_idle_replicas_take_the_long_sequences_of_a_crowded_one() -> None:
    st = _tail_state(rows=3, idle=2)
    moves = tail_moves(st, Role.ROLLOUT, _heavy())
    assert len(moves) == 2
    assert len({m.taker for m in moves}) == 2 and len({m.donor for m in moves}) == 1
    assert sorted(r.n for r in st.replicas.values()) == [1, 1, 1]
    assert all(m.gain_s > 0 for m in moves)
    st.check()


def test_nothing_moves_while_work_waits_or_for_a_short_remainder() -> None:
    st = _tail_state(rows=3, idle=2)
    st.admit(seq("queued", Role.ROLLOUT, max_new=30_000), 0.0)
    assert tail_moves(st, Role.ROLLOUT, _heavy()) == []
    # items near the end of a light tail: ~10 tokens left do not pay for a 1,010-token prefill
    light = Residual.from_points(np.asarray([0.5, 1e-3]), np.asarray([1_000.0, 1_020.0]))
    st = _tail_state(rows=3, idle=2)
    assert tail_moves(st, Role.ROLLOUT, light) == []
    # a sequence alone is never moved
    st = _tail_state(rows=1, idle=2)
    assert tail_moves(st, Role.ROLLOUT, _heavy()) == []


def test_a_whole_batch_role_is_never_migrated() -> None:
    spec = RoleSpec(max_seqs=4, kv_tokens=10**6, tokens_per_seq_step=100, whole_batches=True)
    st = active_state(config(roles={Role.TRAIN: spec}), {Role.TRAIN: 2})
    busy = sorted(st.replicas.values(), key=lambda r: r.replica_id)[0]
    for i in range(3):
        st.admit(seq(i, Role.TRAIN), 0.0)
        st.start(st.queues[Role.TRAIN].pop(), busy)
    assert tail_moves(st, Role.TRAIN, None) == []


@settings(CI, max_examples=80)
@given(rows=hst.lists(hst.integers(0, 6), min_size=1, max_size=6),
       generated=hst.lists(hst.integers(0, 25_000), min_size=36, max_size=36),
       context_s=hst.sampled_from([0.0, 1e-7, 1e-6]), known=hst.booleans())
def test_every_move_pays_lands_on_an_idle_replica_and_none_that_pays_is_left(
        rows: list[int], generated: list[int], context_s: float, known: bool) -> None:
    spec = RoleSpec(max_seqs=8, kv_tokens=10**7, step_context_s=context_s)
    st = active_state(config(roles={Role.ROLLOUT: spec}), {Role.ROLLOUT: len(rows)})
    reps = sorted(st.replicas.values(), key=lambda r: r.replica_id)
    k = 0
    for rep, n in zip(reps, rows, strict=True):
        rep.model = ThroughputModel(0.007, 0.0004, context_s=context_s)
        for _ in range(n):
            s = seq(k, Role.ROLLOUT, max_new=30_000)
            st.admit(s, 0.0)
            st.start(st.queues[Role.ROLLOUT].pop(), rep)
            st.update_progress(s, generated[k])
            k += 1
    residual = _heavy() if known else None
    idle_before = {r.replica_id for r in reps if r.n == 0}
    before = {sid: s.replica_id for sid, s in st.seqs.items()}
    rows_at = {r.replica_id: r.n for r in reps}
    moves = tail_moves(st, Role.ROLLOUT, residual)
    takers = [m.taker for m in moves]
    assert len(takers) == len(set(takers)) and set(takers) <= idle_before
    for m in moves:
        assert before[m.seq_id] == m.donor and st.seqs[m.seq_id].replica_id == m.taker
        assert rows_at[m.donor] >= 2 and m.gain_s > 0.0
        rows_at[m.donor] -= 1
    assert all(s.state is SeqState.RUNNING for s in st.seqs.values()) and len(st.seqs) == k
    st.check()
    if any(r.n == 0 for r in reps):  # an idle replica is left: then no paying move is
        assert all(best_from(r, residual, spec.prefill_tokens_per_s) is None for r in reps)


def test_a_moved_sequence_steps_faster_than_where_it_was() -> None:
    st = _tail_state(rows=4, idle=1, context_s=1e-6)
    crowded = max(st.replicas.values(), key=lambda r: r.n)
    before = step_s(crowded, crowded.n, crowded.context)
    (m,) = tail_moves(st, Role.ROLLOUT, _heavy())
    taker = st.replicas[m.taker]
    assert step_s(taker, taker.n, taker.context) < before


def test_only_shiftable_migrates_the_tail() -> None:
    cfg = ControllerConfig(roles={
        Role.ROLLOUT: RoleSpec(max_seqs=8, kv_tokens=10**6, prior_step_a_s=0.007, prior_step_b_s=0.0004),
        Role.REWARD: RoleSpec(max_seqs=8, kv_tokens=10**6),
        Role.TRAIN: RoleSpec(max_seqs=4, kv_tokens=10**6, tokens_per_seq_step=100),
    })
    for mode, expect in (("shiftable", True), ("colocated", False)):
        ctl = Controller(mode, devices=[f"d{i}" for i in range(5)], config=cfg)
        ctl.policy.initial_split = {Role.ROLLOUT: 3, Role.REWARD: 1, Role.TRAIN: 1}
        ctl.tick(0.0)
        ready(ctl, 0.0)
        rollout = sorted((r for r in ctl.state.replicas.values() if r.role is Role.ROLLOUT
                          and r.state is ReplicaState.ACTIVE), key=lambda r: r.replica_id)
        assert len(rollout) >= 3, mode
        crowded = rollout[0]
        for i in range(3):
            s = seq(i, Role.ROLLOUT, max_new=30_000)
            ctl.state.admit(s, 0.0)
            ctl.state.start(ctl.state.queues[Role.ROLLOUT].pop(), crowded)
            ctl.state.update_progress(s, 2_000)
        dec = ctl.tick(100.0)
        migrated = dec is not None and dec.kind == "migrate"
        assert migrated is expect, (mode, dec)
        if migrated:
            assert set(dec.aborts) == {crowded.replica_id} and len(dec.dispatch) == 2
            assert {a.replica_id for a in dec.dispatch} <= {r.replica_id for r in rollout[1:]}
            assert crowded.n == 1
        ctl.check_invariants()


def test_a_role_migrates_only_once_nothing_more_is_coming_to_it() -> None:
    """Judge replicas idle while rollouts still run are waiting for work on its way: nothing moves until
    the last rollout has finished (and the plan has no rollout left to submit)."""
    spec = RoleSpec(max_seqs=16, kv_tokens=10**7, prior_step_a_s=0.007, prior_step_b_s=0.0004)
    st = active_state(config(roles={Role.ROLLOUT: spec, Role.REWARD: spec}),
                      {Role.ROLLOUT: 1, Role.REWARD: 3})
    judges = sorted(st.by_role[Role.REWARD].values(), key=lambda r: r.replica_id)
    for i in range(3):
        s = seq(f"j{i}", Role.REWARD, max_new=30_000)
        st.admit(s, 0.0)
        st.start(st.queues[Role.REWARD].pop(), judges[0])
        st.update_progress(s, 1_000)
    rollout = seq("r0", Role.ROLLOUT, max_new=30_000)
    st.admit(rollout, 0.0)
    st.start(st.queues[Role.ROLLOUT].pop(), next(iter(st.by_role[Role.ROLLOUT].values())))
    assert tail_moves(st, Role.REWARD, _heavy()) == []
    st.plan = IterationPlan(iteration=0, rollout_seqs=2)  # one rollout announced and not submitted yet
    st.submitted[Role.ROLLOUT] = 1
    st.finish(rollout, 1.0)
    assert tail_moves(st, Role.REWARD, _heavy()) == []
    st.submitted[Role.ROLLOUT] = 2  # the last one was submitted and has finished too
    assert len(tail_moves(st, Role.REWARD, _heavy())) == 2
    st.check()
