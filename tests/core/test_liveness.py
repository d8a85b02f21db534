"""Liveness: a role with work and no replica always gets one once some device is idle, however long the
shift and its way back would take (on-policy, the iteration cannot end without it). A single device whose
first load took 90 s (a kernel compile) was never moved to reward: every candidate's B was negative."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import Controller, IterationPlan, Role, ShiftTimings

from .helpers import config, ready, seq


def _one_device_after_rollout(load_s: float, horizon_s: float) -> tuple[Controller, float]:
    ctl = Controller("shiftable", devices=["a"], config=config(horizon_s=horizon_s, cooldown_s=1.0,
                                                               hysteresis=0.0, shift_prior_s=1.0))
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=4, group_size=4, rollout_tokens_per_seq=10,
                                      reward_tokens_per_rollout=10, train_tokens_per_group=80), 0.0)
    ctl.submit([seq(f"r{i}", Role.ROLLOUT, max_new=16, expected_new_tokens=10) for i in range(4)], 0.0)
    dec = ctl.tick(0.0)
    assert dec is not None and [str(s.to_role) for s in dec.shifts] == ["rollout"]
    now = load_s
    ready(ctl, now, ShiftTimings(load=load_s))  # the first load: slow (e.g. a native kernel compile)
    ctl.dispatch(now)
    for i in range(4):
        ctl.on_finished(f"r{i}", now + 1.0, generated=10)
        ctl.submit([seq(f"j{i}", Role.REWARD, prompt=20, max_new=16, expected_new_tokens=10)], now + 1.0)
    return ctl, now + 1.0


def test_the_only_device_moves_to_the_starving_role_after_a_slow_first_load():
    ctl, now = _one_device_after_rollout(load_s=90.0, horizon_s=10.0)
    dec = ctl.tick(now + 2.0)  # past the cooldown
    assert dec is not None and [str(s.to_role) for s in dec.shifts] == ["reward"], ctl.last_reasoning


@settings(max_examples=60, derandomize=True, deadline=None)
@given(load_s=st.floats(0.001, 600.0), horizon_s=st.floats(0.5, 60.0))
def test_a_starving_role_is_served_whatever_the_shift_costs(load_s, horizon_s):
    ctl, now = _one_device_after_rollout(load_s, horizon_s)
    dec = ctl.tick(now + 2.0)
    assert dec is not None and [str(s.to_role) for s in dec.shifts] == ["reward"]
