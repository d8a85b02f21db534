"""The planner sees the iteration barrier: when one role is all that is left of an on-policy iteration, every
device waits on it, so ending it sooner is worth the whole cluster's time (`planner.drain_value`), not just
the little extra *work* one more replica does within H. (The perfect-static sanity check of the simulator
failed on exactly this: an idle reward replica sat out the train drain of every iteration.)"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import IterationPlan, Role
from pivotrl.core.dispatcher import dispatch_all
from pivotrl.core.planner import drain_value, plan, role_views
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState

from .helpers import active_state, config, seq
from .test_planner import brute_force_best

NOW = 100.0


def _drain_state(cooldown_s: float = 2.0, plan_known: bool = True,
                 all_submitted: bool = True, multiple: float = 3.0) -> ClusterState:
    """Iteration end: rollout (2 replicas) and reward (1) idle and done, train (4 replicas) holds the last
    96,000 tokens (~6 s at its saturated 16,000 tokens/s, well inside H = 20 s)."""
    cfg = config(horizon_s=20.0, hysteresis=0.05, cooldown_s=cooldown_s, cooldown_shift_multiple=multiple)
    stt = active_state(cfg, {Role.ROLLOUT: 2, Role.REWARD: 1, Role.TRAIN: 4})
    for i in range(240):
        stt.admit(seq(f"t{i}", Role.TRAIN, prompt=0, max_new=400, expected_new_tokens=400), 0.0)
    dispatch_all(stt)
    if plan_known:
        stt.plan = IterationPlan(0, rollout_seqs=8, group_size=4, rollout_tokens_per_seq=100,
                                 reward_tokens_per_rollout=50, train_tokens_per_group=1600)
        stt.submitted[Role.ROLLOUT] = 8 if all_submitted else 4
    return stt


def test_idle_done_replicas_join_the_last_stage_to_end_the_iteration_sooner() -> None:
    stt = _drain_state()
    views = role_views(stt, 20.0, NOW)
    assert views[Role.ROLLOUT].done and views[Role.REWARD].done and not views[Role.TRAIN].done
    # The old pricing alone (work over H, softly capped) cannot clear the margin: train finishes its work
    # within H either way, so one more replica adds ~0.5 device-s of work against a margin of 1 per device.
    tr = views[Role.TRAIN]
    assert tr.processed(5) - tr.processed(4) < stt.config.hysteresis * stt.config.horizon_s
    res = plan(stt, ShiftCostModel(prior_s=1.0), NOW)
    assert res.to_role is Role.TRAIN and res.chosen is not None
    assert {d.role for d in res.donors} <= {Role.ROLLOUT, Role.REWARD}
    # All three idle replicas go: each shortens the drain the whole cluster (7 devices) waits on.
    assert res.chosen.devices == 3
    assert res.chosen.benefit > res.reasoning.threshold * res.chosen.devices


@pytest.mark.parametrize("kw", [{"plan_known": False}, {"all_submitted": False}])
def test_no_barrier_pricing_while_more_work_can_come(kw: dict) -> None:
    """Without an IterationPlan, or with rollouts still to be submitted, no role is done: the idle replicas
    may get work any moment, and the usual margin applies (no shift here)."""
    stt = _drain_state(**kw)
    views = role_views(stt, 20.0, NOW)
    assert not any(v.done for v in views.values())
    res = plan(stt, ShiftCostModel(prior_s=1.0), NOW)
    assert res.chosen is None


def test_a_cooldown_that_outlasts_the_drain_is_charged() -> None:
    """A device moved now may not move again for cooldown_s after it lands (every shift locked for the full
    cooldown: multiple 0); if that lock outlasts the drain it holds the device back from the next
    iteration's first stage, which costs more than the drain saves."""
    stt = _drain_state(cooldown_s=60.0, multiple=0.0)
    res = plan(stt, ShiftCostModel(prior_s=1.0), NOW)
    assert res.chosen is None


def test_a_short_shift_earns_a_short_lock_and_the_drain_move_pays() -> None:
    """The same 60 s cooldown, but a 1 s shift locks its device for 3 × 1 s only: the lock ends with the
    drain, so moving the done roles' idle devices to train is worth it."""
    stt = _drain_state(cooldown_s=60.0, multiple=3.0)
    res = plan(stt, ShiftCostModel(prior_s=1.0), NOW)
    assert res.chosen is not None and res.to_role is Role.TRAIN


def test_drain_value_closed_form() -> None:
    stt = _drain_state()
    tr = role_views(stt, 20.0, NOW)[Role.TRAIN]
    tau0 = (tr.work + tr.arriving_work) / tr.throughput(tr.replicas)
    ks = np.array([0, 1, 2])
    v = drain_value(tr, ks, n_devices=7, shift_s=1.0, lock_s=2.0)
    after = 1.0 + (tr.work - tr.throughput(4) * 1.0) / np.array([tr.throughput(4 + k) for k in ks])
    assert v == pytest.approx(7 * np.maximum(tau0 - after, 0.0))
    assert v[0] == pytest.approx(0.0) and v[2] > v[1] > 0
    # nothing to gain when the drain ends before a shift could land
    assert not drain_value(tr, ks, 7, shift_s=tau0 + 1.0, lock_s=2.0).any()


def _random_drain_state(seed: int) -> tuple[ClusterState, ShiftCostModel, float]:
    """Iteration end with random sizes: idle done donors (rollout, reward, maybe a free device, some in
    cooldown), train holding the last work."""
    rng = random.Random(seed)
    now = 50.0
    cfg = config(horizon_s=rng.uniform(2.0, 40.0), hysteresis=rng.choice([0.0, 0.05, 0.2]),
                 cooldown_s=rng.uniform(0.0, 6.0), reward_g=rng.choice([1, 2]))
    stt = active_state(cfg, {Role.ROLLOUT: rng.randint(0, 3), Role.REWARD: rng.randint(0, 3),
                             Role.TRAIN: rng.randint(1, 4)})
    for d in list(stt.device_role):
        stt.device_shifted_at[d] = rng.choice([-math.inf, now - 1.0])
    for i in range(rng.randint(0, 1)):
        stt.add_device(f"free{i}", 0.0)
    for i in range(rng.randint(1, 200)):
        stt.admit(seq(f"t{i}", Role.TRAIN, prompt=0, max_new=rng.choice([100, 400, 1600]),
                      expected_new_tokens=rng.choice([None, 90.0, 400.0])), 0.0)
    dispatch_all(stt)
    n = rng.randint(0, 8)
    stt.plan = IterationPlan(0, rollout_seqs=n, group_size=4, rollout_tokens_per_seq=100,
                             reward_tokens_per_rollout=50, train_tokens_per_group=1600)
    stt.submitted[Role.ROLLOUT] = n
    costs = ShiftCostModel(prior_s=rng.uniform(0.0, 3.0))
    return stt, costs, now


@settings(max_examples=300, derandomize=True, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_drain_candidates_match_brute_force(seed: int) -> None:
    """The DP with the barrier value still finds the best subset of donors (brute force over every subset,
    gain = max(work over H, drain value)), and what it picks clears the margin."""
    stt, costs, now = _random_drain_state(seed)
    views = role_views(stt, stt.config.horizon_s, now)
    assert all(views[r].done for r in (Role.ROLLOUT, Role.REWARD))
    res = plan(stt, costs, now)
    assert res.to_role in (None, Role.TRAIN)
    if res.reasoning.candidates and res.to_role is Role.TRAIN:
        best = max(c.benefit for c in res.reasoning.candidates)
        assert best == pytest.approx(brute_force_best(stt, costs, now, Role.TRAIN), rel=1e-9, abs=1e-9)
    if res.chosen is not None:
        assert res.chosen.benefit > res.reasoning.threshold * res.chosen.devices
        clearing = brute_force_best(stt, costs, now, Role.TRAIN, clearing=True)
        assert res.chosen.benefit == pytest.approx(clearing, rel=1e-9, abs=1e-9)
    elif res.to_role is Role.TRAIN or not res.reasoning.candidates:
        assert brute_force_best(stt, costs, now, Role.TRAIN, clearing=True) is None
