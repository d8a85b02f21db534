"""Manual placement, operator shifts and aborts, the static grouping on few devices, ShiftTimings."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import Controller, Grouped, Manual, Role, ShiftTimings, make_policy
from pivotrl.core.types import ReplicaState, SeqState
from tests.core.helpers import config, ready, seq


def test_manual_places_devices_in_join_order_and_never_shifts_by_itself() -> None:
    ctl = Controller(Manual(["rollout", "reward"]), devices=["a", "b", "c"], config=config())
    dec = ctl.tick(0.0)
    assert dec is not None and {s.devices: s.to_role for s in dec.shifts} == {
        ("a",): Role.ROLLOUT, ("b",): Role.REWARD, ("c",): Role.ROLLOUT}
    ready(ctl, 1.0)
    ctl.submit([seq(i, Role.REWARD) for i in range(20)], 1.0)  # reward is swamped: manual stays put
    assert ctl.tick(2.0) is None
    assert ctl.role_of("a") is Role.ROLLOUT


def test_request_shift_migrates_the_work_and_frees_the_device() -> None:
    ctl = Controller(Manual(["rollout", "rollout"]), devices=["a", "b"], config=config())
    ctl.tick(0.0)
    ready(ctl, 0.5)
    ctl.submit([seq(i) for i in range(4)], 1.0)
    placed = ctl.dispatch(1.0)
    on_a = [x.seq_id for x in placed if ctl.state.replicas[x.replica_id].devices == ("a",)]
    dec = ctl.request_shift("a", "reward", 2.0)
    assert sorted(sid for ids in dec.aborts.values() for sid in ids) == sorted(on_a)
    assert [(s.devices, s.to_role) for s in dec.shifts] == [(("a",), Role.REWARD)]
    assert {ctl.sequence(x.seq_id).replica_id for x in dec.dispatch} <= set(ctl.state.replicas)
    dec = ctl.request_shift("b", None, 3.0)
    assert ctl.state.device_replica["b"] is None and not dec.shifts
    assert all(s.state is SeqState.WAITING for s in ctl.state.seqs.values() if s.role is Role.ROLLOUT)
    with pytest.raises(ValueError, match="unknown device"):
        ctl.request_shift("zz", "train", 4.0)
    ctl.check_invariants()


def test_request_shift_forms_a_multi_device_replica_from_free_devices() -> None:
    ctl = Controller(Manual([]), devices=["a", "b", "c"], config=config(reward_g=2))
    dec = ctl.request_shift("a", "reward", 0.0)
    assert [s.devices for s in dec.shifts] == [("a", "b")]
    with pytest.raises(ValueError, match="needs 2 devices"):
        ctl.request_shift("c", "reward", 1.0)
    ctl.check_invariants()


def test_abort_sends_running_work_back_keeping_tokens() -> None:
    ctl = Controller(Manual(["rollout"]), devices=["a"], config=config())
    ctl.tick(0.0)
    ready(ctl, 0.1)
    ctl.submit([seq(0), seq(1)], 0.2)
    ctl.dispatch(0.2)
    ctl.on_progress("s0", 7, 0.3)
    dec = ctl.abort(["s0", "nope"], 0.4)
    assert [sid for ids in dec.aborts.values() for sid in ids] == ["s0"]
    s0 = ctl.sequence("s0")
    assert s0.state is SeqState.WAITING and s0.generated == 7
    assert ctl.waiting(Role.ROLLOUT)[0] == "s0"
    ctl.check_invariants()


def test_disaggregated_on_fewer_devices_than_roles_is_the_default_grouping() -> None:
    p = make_policy("disaggregated", n_devices=2)
    assert isinstance(p, Grouped) and p.groups == [((Role.ROLLOUT,), 1), ((Role.REWARD, Role.TRAIN), 1)]
    assert not isinstance(make_policy("disaggregated", n_devices=3), Grouped)
    assert not isinstance(make_policy("disaggregated", n_devices=2, static_split={"rollout": 1}), Grouped)
    with pytest.raises(ValueError, match="no group serves"):
        Grouped([(("rollout",), 1), (("reward",), 1)])


def test_grouped_time_shares_a_group_one_role_at_a_time() -> None:
    ctl = Controller(make_policy("disaggregated", n_devices=2), devices=["d0", "d1"], config=config())
    dec = ctl.tick(0.0)
    assert {s.devices: s.to_role for s in dec.shifts} == {("d0",): Role.ROLLOUT, ("d1",): Role.REWARD}
    ready(ctl, 0.1)
    ctl.submit([seq("t", Role.TRAIN, prompt=0, max_new=50)], 0.2)  # train work, reward idle: switch
    dec = ctl.tick(0.3)
    assert dec is not None and [(s.devices, s.to_role) for s in dec.shifts] == [(("d1",), Role.TRAIN)]
    ready(ctl, 0.4)
    ctl.submit([seq("j", Role.REWARD)], 0.5)  # reward waits while train still has work: no switch
    assert ctl.tick(0.6) is None
    ctl.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans()),
                min_size=5, max_size=5), st.booleans())
def test_shift_timings_accept_only_finite_nonnegative_phases(values, warm) -> None:
    phases = dict(zip(ShiftTimings.PHASES, values, strict=True))
    ok = all(not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)
    if ok:
        t = ShiftTimings(**phases, warm=warm)
        assert t.total == pytest.approx(sum(values)) and t.warm is warm
        assert set(t.phases()) == set(ShiftTimings.PHASES)
    else:
        with pytest.raises(ValueError, match="shift phase"):
            ShiftTimings(**phases, warm=warm)


def test_on_shift_done_without_timings_learns_the_elapsed_time() -> None:
    ctl = Controller(Manual(["rollout"]), devices=["a"], config=config())
    ctl.tick(1.0)
    rep = next(iter(ctl.state.replicas.values()))
    assert rep.state is ReplicaState.SHIFTING
    ctl.on_shift_done(rep.replica_id, 3.5)
    assert ctl.shift_costs.duration(None, Role.ROLLOUT) == pytest.approx(2.5)
