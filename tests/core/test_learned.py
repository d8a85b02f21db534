"""What a controller learned survives a checkpoint: shift costs, step-time fits and the last profile
round-trip through JSON into a fresh controller, which then plans from them; malformed records are refused
cleanly."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import Controller, IterationPlan, Role, ShiftTimings
from pivotrl.core.learned import LearnedState, learned_state, restore_learned

from .helpers import config

ROLES = [Role.ROLLOUT, Role.REWARD, Role.TRAIN]
PLAN = IterationPlan(0, rollout_seqs=8, group_size=2, rollout_tokens_per_seq=10.0,
                     reward_tokens_per_rollout=10.0, train_tokens_per_group=40.0)

shift_obs = st.tuples(st.sampled_from([None, *ROLES]), st.sampled_from(ROLES),
                      st.floats(0.0, 50.0), st.floats(0.0, 50.0))
step_obs = st.tuples(st.sampled_from(ROLES), st.integers(1, 64), st.floats(1e-4, 2.0), st.integers(0, 2048))


def _trained(shifts: list, steps: list) -> Controller:
    ctl = Controller("shiftable", devices=["a", "b"], config=config(cooldown_s=0.0))
    for f, t, fetch, load in shifts:
        ctl.shift_costs.observe(f, t, ShiftTimings(fetch=fetch, load=load))
    for role, n, dt, prompt in steps:
        m = ctl.state.role_models[role]
        if prompt:
            m.observe_prefill(n, dt, prompt)
        else:
            m.observe(n, dt)
    ctl.begin_iteration(PLAN, 0.0)
    ctl.meter.observe(Role.ROLLOUT, 12.0)
    ctl.meter.observe(Role.ROLLOUT, 30.0)
    ctl.begin_iteration(IterationPlan(**{**PLAN.__dict__, "iteration": 1}), 7.5)
    return ctl


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shifts=st.lists(shift_obs, max_size=12), steps=st.lists(step_obs, max_size=40))
def test_learned_state_round_trips_through_json_into_a_fresh_controller(shifts: list, steps: list) -> None:
    ctl = _trained(shifts, steps)
    data = json.loads(json.dumps(learned_state(ctl).to_json()))
    fresh = Controller("shiftable", devices=["a", "b"], config=config(cooldown_s=0.0))
    restore_learned(fresh, LearnedState.from_json(data))
    assert learned_state(fresh) == learned_state(ctl)
    for f in [None, *ROLES]:
        for t in ROLES:
            assert fresh.shift_costs.duration(f, t) == pytest.approx(ctl.shift_costs.duration(f, t))
    for r in ROLES:
        a, b = fresh.state.role_models[r], ctl.state.role_models[r]
        assert (a.a, a.b, a.samples) == pytest.approx((b.a, b.b, b.samples))
        assert a.prefill_tokens_per_s == b.prefill_tokens_per_s
        # replicas created after the restore start from the restored fit
        assert fresh.state.role_models[r].spawn().step_time(8) == pytest.approx(b.step_time(8))


def test_the_first_iteration_after_a_resume_gets_the_last_profile() -> None:
    ctl = _trained([], [])
    seen = []
    fresh = Controller("shiftable", devices=["a", "b"], config=config(cooldown_s=0.0))
    fresh.policy.on_iteration = lambda state, costs, last, now: seen.append(last)
    restore_learned(fresh, LearnedState.from_json(learned_state(ctl).to_json()))
    fresh.begin_iteration(IterationPlan(**{**PLAN.__dict__, "iteration": 2}), 100.0)
    fresh.begin_iteration(IterationPlan(**{**PLAN.__dict__, "iteration": 3}), 110.0)
    assert seen[0] == ctl.profiles[-1]
    assert seen[0].roles[Role.ROLLOUT].max_tokens == 30.0
    assert seen[1].iteration == 2 and seen[1].makespan_s == pytest.approx(10.0)  # then its own


def test_a_fresh_controller_has_nothing_learned_but_still_serialises() -> None:
    ctl = Controller("colocated", devices=["a"], config=config())
    s = learned_state(ctl)
    assert s.shift_pairs == () and s.last_profile is None
    assert LearnedState.from_json(json.loads(json.dumps(s.to_json()))) == s


leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5)
junk = st.recursive(leaf,
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(key=st.sampled_from(["format", "shift_pairs", "shift_to", "fits", "last_profile"]), value=junk)
def test_a_malformed_record_is_a_value_error_never_anything_else(key: str, value: object) -> None:
    steps = [(Role.TRAIN, 4, 0.5, 0), (Role.REWARD, 8, 0.5, 300)]
    good = learned_state(_trained([(Role.ROLLOUT, Role.REWARD, 1.0, 2.0)], steps)).to_json()
    bad = {**good, key: value}
    try:
        LearnedState.from_json(bad)
    except ValueError as e:
        assert "learned controller state" in str(e)


def test_a_checkpoint_without_the_prefill_estimate_loads_and_a_malformed_one_is_refused() -> None:
    good = learned_state(_trained([], [(Role.REWARD, 8, 0.5, 300)])).to_json()
    older = {**good, "fits": [[r, {k: v for k, v in f.items() if k != "pf"}] for r, f in good["fits"]]}
    fresh = Controller("shiftable", devices=["a", "b"], config=config(cooldown_s=0.0))
    restore_learned(fresh, LearnedState.from_json(older))
    assert fresh.state.role_models[Role.REWARD].prefill_tokens_per_s is None  # relearned, not invented
    bad = {**good, "fits": [[r, {**f, "pf": [1.0]}] for r, f in good["fits"]]}
    with pytest.raises(ValueError, match="learned controller state: malformed"):
        LearnedState.from_json(bad)
