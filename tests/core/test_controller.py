from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import Controller, IterationPlan, Role, RoleSpec, Sequence, ShiftTimings
from pivotrl.core.types import ReplicaState, SeqState

from .helpers import config, ready, rollout_tail, seq


def _rollouts(n: int, max_new: int = 100, exp: float | None = 50.0) -> list[Sequence]:
    return [seq(f"ro{i}", Role.ROLLOUT, max_new=max_new, expected_new_tokens=exp) for i in range(n)]


def test_first_tick_places_free_devices_and_shift_done_gives_them_work() -> None:
    ctl = Controller("shiftable", devices=["a", "b"], config=config(cooldown_s=0.0))
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=12), 0.0)
    ctl.submit(_rollouts(12), 0.0)
    dec = ctl.tick(0.0)
    assert dec is not None and dec.kind == "shift"
    assert dec.device_moves and all(m[1] is None and m[2] is Role.ROLLOUT for m in dec.device_moves)
    assert ctl.dispatch(0.0) == []  # shifting replicas get nothing yet
    first = dec.shifts[0].replica_id
    up = ctl.on_shift_done(first, 1.0, ShiftTimings(fetch=0.4, load=0.6))
    assert up.kind == "shift_up" and {a.replica_id for a in up.dispatch} == {first}
    assert ctl.shift_costs.duration(None, Role.ROLLOUT) == pytest.approx(1.0)
    ctl.check_invariants()


def test_decision_log_carries_ids_and_stimuli_and_is_json() -> None:
    ctl = Controller("shiftable", devices=["a"], config=config())
    ctl.submit(_rollouts(3), 0.0)
    ctl.tick(0.0)
    ready(ctl, 1.0)
    assert [e["decision_id"] for e in ctl.log] == list(range(1, len(ctl.log) + 1))
    assert all(e["stimulus"] for e in ctl.log)
    kinds = [e["kind"] for e in ctl.log]
    assert kinds[:1] == ["device_added"] and "shift" in kinds and "shift_up" in kinds
    json.dumps(ctl.log)


def test_progress_is_kept_across_device_loss_and_resumes_elsewhere() -> None:
    ctl = Controller(make := "disaggregated", devices=["a", "b", "c", "d"],
                     config=config(), )
    assert make == "disaggregated"
    ctl.policy.initial_split = {Role.ROLLOUT: 2, Role.REWARD: 1, Role.TRAIN: 1}
    ctl.tick(0.0)
    ready(ctl, 1.0)
    ctl.submit(_rollouts(4), 1.0)
    placed = ctl.dispatch(1.0)
    assert len(placed) == 4
    victim = placed[0]
    ctl.on_progress(victim.seq_id, 42, 2.0, payload=[1, 2, 3])
    lost_dev = ctl.state.replicas[victim.replica_id].devices[0]
    back = ctl.on_device_lost(lost_dev, 3.0)
    assert victim.seq_id in {s.seq_id for s in back}
    s = ctl.sequence(victim.seq_id)
    assert s.state is SeqState.WAITING and s.generated == 42 and s.aborts == 1 and s.payload == [1, 2, 3]
    again = ctl.dispatch(3.0)
    assert victim.seq_id in {a.seq_id for a in again}
    assert ctl.role_of(lost_dev) is None and lost_dev not in ctl.snapshot()["devices"]
    ctl.check_invariants()


def test_on_step_feeds_replica_and_role_fit_and_new_replicas_inherit() -> None:
    ctl = Controller("shiftable", devices=["a", "b"], config=config(cooldown_s=0.0))
    ctl.policy.initial_split = {Role.ROLLOUT: 1}
    ctl.tick(0.0)
    ready(ctl, 0.0)
    rep = ctl.replicas(Role.ROLLOUT)[0]
    for n in [1, 2, 4, 8] * 10:
        ctl.on_step(rep.replica_id, n, 0.1 + 0.01 * n, 1.0)
    assert rep.model.b == pytest.approx(0.01, rel=1e-3)
    assert ctl.state.role_models[Role.ROLLOUT].b == pytest.approx(0.01, rel=1e-3)
    ctl.on_step("no-such-replica", 4, 0.1, 1.0)  # a late report after a shift: ignored
    new = ctl.state.new_replica(Role.ROLLOUT, ("b",), 2.0)
    assert new.model.b == pytest.approx(0.01, rel=1e-3)
    # a step that prefilled 2,000 prompt tokens in 0.2 s beyond the line feeds the prefill rate, not the line
    samples = rep.model.samples
    ctl.on_step(rep.replica_id, 8, 0.1 + 0.01 * 8 + 0.2, 3.0, prefill_tokens=2000)
    assert rep.model.samples == samples and rep.model.b == pytest.approx(0.01, rel=1e-3)
    for m in (rep.model, ctl.state.role_models[Role.ROLLOUT]):
        assert m.prefill_tokens_per_s == pytest.approx(10_000, rel=1e-2)
    assert ctl.snapshot()["step_fits"]["rollout"]["prefill_tokens_per_s"] == pytest.approx(10_000, rel=1e-2)


@given(a=st.floats(1e-4, 0.05), b=st.floats(1e-6, 1e-3), c=st.floats(1e-9, 1e-6), ref=st.floats(0.0, 8000.0),
       rows=st.lists(st.tuples(st.integers(1, 256), st.floats(1.0, 8000.0)), min_size=8, max_size=40))
@settings(max_examples=40, deadline=None)
def test_a_step_is_moved_to_the_lines_reference_context(a: float, b: float, c: float, ref: float,
                                                        rows: list[tuple[int, float]]) -> None:
    """Steps that cost a + b·rows + c·context, each at its own context per row: the fitted line is
    a + (b + c·ref)·rows, the step at the reference context, whatever context each step held (fitted on
    the raw times, a tail of few long rows would tilt it), and `b_at` moves it to any other context."""
    spec = RoleSpec(max_seqs=256, kv_tokens=1 << 30, prior_step_a_s=0.02, prior_step_b_s=2e-4,
                    step_context_s=c, context_ref_tokens=ref)
    roles = {Role.ROLLOUT: spec, Role.REWARD: RoleSpec(), Role.TRAIN: RoleSpec(tokens_per_seq_step=100)}
    ctl = Controller("shiftable", devices=["a"], config=config(cooldown_s=0.0, roles=roles))
    ctl.policy.initial_split = {Role.ROLLOUT: 1}
    ctl.tick(0.0)
    ready(ctl, 0.0)
    rep = ctl.replicas(Role.ROLLOUT)[0]
    if len({n for n, _ in rows}) < 2:
        rows = [*rows, (rows[0][0] % 256 + 1, rows[0][1])]
    for n, per_row in rows:
        ctl.on_step(rep.replica_id, n, a + b * n + c * n * per_row, 1.0, context_tokens=n * per_row)
    for m in (rep.model, ctl.state.role_models[Role.ROLLOUT]):
        for n in (1, 64, 256):
            assert m.step_time(n) == pytest.approx(a + (b + c * ref) * n, rel=1e-6)
            assert m.a + m.b_at(1234.0) * n == pytest.approx(a + (b + c * 1234.0) * n, rel=1e-6)


def test_a_role_that_prices_no_context_fits_the_raw_step() -> None:
    ctl = Controller("shiftable", devices=["a"], config=config(cooldown_s=0.0))
    ctl.policy.initial_split = {Role.ROLLOUT: 1}
    ctl.tick(0.0)
    ready(ctl, 0.0)
    rep = ctl.replicas(Role.ROLLOUT)[0]
    for n in [1, 2, 4, 8] * 5:
        ctl.on_step(rep.replica_id, n, 0.1 + 0.01 * n, 1.0, context_tokens=1e6)
    assert rep.model.b == pytest.approx(0.01, rel=1e-3) and rep.model.a == pytest.approx(0.1, rel=1e-3)


def test_submit_validation() -> None:
    ctl = Controller("shiftable", config=config())
    ctl.submit([seq(1)], 0.0)
    with pytest.raises(ValueError, match="already submitted"):
        ctl.submit([seq(1)], 0.0)
    with pytest.raises(ValueError, match="KV tokens"):
        ctl.submit([seq(2, prompt=5000)], 0.0)
    with pytest.raises(KeyError):
        ctl.on_finished("nope", 0.0)
    ctl.on_progress("nope", 5, 0.0)  # unknown / already finished: ignored


def test_finish_accepted_while_waiting_after_an_abort_race() -> None:
    ctl = Controller("shiftable", devices=["a"], config=config())
    ctl.policy.initial_split = {Role.ROLLOUT: 1}
    ctl.tick(0.0)
    ready(ctl, 0.0)
    ctl.submit(_rollouts(2), 0.0)
    ctl.dispatch(0.0)
    s = ctl.sequence("ro0")
    ctl.state.abort(s)
    done = ctl.on_finished("ro0", 1.0, generated=77, payload="final")
    assert done.state is SeqState.FINISHED and done.generated == 77 and done.payload == "final"
    assert "ro0" not in ctl.waiting(Role.ROLLOUT)
    ctl.check_invariants()


def test_tail_shift_moves_rollout_devices_to_reward_keeping_the_tail_running() -> None:
    """The end of a rollout stage: idle rollout replicas (and possibly a tail replica, whose sequence is
    resumed on another rollout replica) move to reward."""
    cfg = config(cooldown_s=0.0, horizon_s=10.0, shift_prior_s=1.0)
    ctl = rollout_tail(cfg)
    busy_before = {r.replica_id for r in ctl.replicas(Role.ROLLOUT) if r.n}
    dec = ctl.tick(5.0)
    assert dec is not None and dec.reasoning is not None and dec.reasoning.chosen is not None
    moved = {a.seq_id: a.replica_id for a in dec.dispatch}
    for rid, ids in dec.aborts.items():  # a taken tail replica: its sequence resumes on a rollout survivor
        assert rid in busy_before and rid in dec.dissolved
        for sid in ids:
            assert ctl.state.replicas[moved[sid]].role is Role.ROLLOUT
    assert len(ctl.replicas(Role.ROLLOUT)) >= 1
    assert all(s.state is SeqState.RUNNING for s in ctl.state.seqs.values() if s.role is Role.ROLLOUT)
    assert all(sh.to_role is Role.REWARD for sh in dec.shifts)
    ready(ctl, 6.0)
    assert len(ctl.replicas(Role.REWARD)) == 1 + len(dec.shifts)
    assert all(r.n > 0 for r in ctl.replicas(Role.REWARD))  # newcomers got work (queue, then rebalance)
    ctl.check_invariants()


def test_busy_donor_is_aborted_requeued_and_redispatched_in_one_decision() -> None:
    cfg = config(cooldown_s=0.0, horizon_s=30.0, shift_prior_s=0.0,
                 roles={Role.ROLLOUT: RoleSpec(max_seqs=8, kv_tokens=10**6),
                        Role.REWARD: RoleSpec(max_seqs=64, kv_tokens=10**6),
                        Role.TRAIN: RoleSpec(max_seqs=4, kv_tokens=10**6)})
    ctl = Controller("shiftable", devices=[f"d{i}" for i in range(3)], config=cfg)
    ctl.policy.initial_split = {Role.ROLLOUT: 2, Role.REWARD: 1}
    ctl.tick(0.0)
    ready(ctl, 0.0)
    ctl.submit([seq(f"r{i}", Role.ROLLOUT, max_new=50, expected_new_tokens=40) for i in range(2)], 0.0)
    ctl.submit([seq(f"j{i}", Role.REWARD, max_new=3000, expected_new_tokens=2500) for i in range(400)], 0.0)
    ctl.dispatch(0.0)
    for s in list(ctl.state.seqs.values()):
        if s.role is Role.ROLLOUT:
            ctl.on_progress(s.seq_id, 10, 1.0)
    dec = ctl.tick(1.0)
    assert dec is not None and dec.reasoning.chosen is not None
    aborted = [sid for ids in dec.aborts.values() for sid in ids]
    if aborted:  # the planner took a busy rollout replica: its work went to the other one
        moved = {a.seq_id: a.replica_id for a in dec.dispatch}
        for sid in aborted:
            assert moved[sid] not in dec.dissolved
            assert ctl.sequence(sid).generated == 10
    assert len(ctl.replicas(Role.ROLLOUT)) >= 1  # rollout keeps a replica for its work
    assert all(ctl.sequence(f"r{i}").state is SeqState.RUNNING for i in range(2))
    ctl.check_invariants()


def test_devices_per_replica_override_forms_pairs() -> None:
    ctl = Controller("disaggregated", devices=[f"d{i}" for i in range(5)], devices_per_replica={"reward": 2},
                     config=config())
    ctl.policy.initial_split = {Role.ROLLOUT: 2, Role.REWARD: 2, Role.TRAIN: 1}
    dec = ctl.tick(0.0)
    reward = [s for s in dec.shifts if s.to_role is Role.REWARD]
    assert len(reward) == 1 and len(reward[0].devices) == 2
    with pytest.raises(ValueError):
        Controller("shiftable", devices_per_replica={"reward": 0})


def test_snapshot_shape() -> None:
    ctl = Controller("colocated", devices=["a", "b"], config=config())
    ctl.tick(0.0)
    snap = ctl.snapshot()
    assert snap["roles"]["rollout"]["devices"] == 2
    assert snap["roles"]["rollout"]["active"] == 0  # still shifting
    ready(ctl, 1.0)
    assert ctl.snapshot()["roles"]["rollout"]["active"] == 2
    assert all(r.state is ReplicaState.ACTIVE for r in ctl.replicas())
