"""The whole-iteration model (core/iteration.py) and the measured profile the controller hands the policy."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import Controller, IterationPlan, Role, RoleSpec
from pivotrl.core.iteration import (
    IterationMeter,
    IterationProfile,
    RoleProfile,
    Stage,
    best_static,
    choose,
    stages,
    static_makespans,
)
from pivotrl.core.shiftable import Shiftable, toward_split
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.types import PIPELINE, ControllerConfig, ReplicaState

from .helpers import config, ready, seq

FEW = settings(max_examples=200, derandomize=True, deadline=None)


def stage_strategy(role: Role) -> st.SearchStrategy[Stage]:
    decode = role is not Role.TRAIN
    return st.builds(
        Stage, st.just(role), st.integers(1, 3), st.floats(1, 5000), st.floats(1, 3000), st.floats(1, 20000),
        st.floats(1e-4, 0.05), st.floats(1e-7, 1e-3), st.just(1.0) if decode else st.floats(50, 3000),
        st.floats(1, 256), st.floats(0, 30), st.just(decode))


stages_strategy = st.fixed_dictionaries({r: stage_strategy(r) for r in PIPELINE})


@FEW
@given(stg=stages_strategy, n=st.integers(3, 40))
def test_best_static_is_the_exhaustive_minimum(stg: dict[Role, Stage], n: int) -> None:
    """The vectorised search returns the minimum over every split into whole replicas (brute force)."""
    found = best_static(stg, n)
    gs = [stg[r].g for r in PIPELINE]
    brute = None
    for counts in itertools.product(*[range(1, n // g + 1) for g in gs]):
        if sum(c * g for c, g in zip(counts, gs)) > n:
            continue
        t = float(static_makespans(stg, {r: np.asarray(c) for r, c in zip(PIPELINE, counts)}))
        brute = t if brute is None else min(brute, t)
    if brute is None:
        assert found is None
        return
    assert found is not None
    split, t_best = found
    assert sum(split.values()) <= n
    assert all(split[r] % stg[r].g == 0 and split[r] >= stg[r].g for r in PIPELINE)
    # the search lets train take every device left; a split leaving devices idle is never strictly better
    assert t_best <= brute * (1 + 1e-9) + 1e-12


@FEW
@given(stg=stages_strategy, base=st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(1, 20)),
       role=st.sampled_from(PIPELINE))
def test_one_more_replica_never_slows_a_static_split(stg: dict[Role, Stage], base: tuple[int, int, int],
                                                     role: Role) -> None:
    reps = {r: np.asarray(float(c)) for r, c in zip(PIPELINE, base)}
    more = dict(reps)
    more[role] = reps[role] + 1
    assert float(static_makespans(stg, more)) <= float(static_makespans(stg, reps)) * (1 + 1e-9)


@FEW
@given(lengths=st.lists(st.tuples(st.sampled_from(PIPELINE), st.integers(1, 10_000)), max_size=200))
def test_meter_profile_is_count_mean_and_longest_per_role(lengths: list[tuple[Role, int]]) -> None:
    meter = IterationMeter()
    meter.begin(3, 10.0)
    for role, n in lengths:
        meter.observe(role, float(n))
    prof = meter.profile(25.0, "dynamic", 12.0, ShiftCostModel())
    assert prof is not None and prof.iteration == 3 and prof.makespan_s == 15.0 and prof.predicted_s == 12.0
    for role in PIPELINE:
        mine = [n for r, n in lengths if r is role]
        if not mine:
            assert role not in prof.roles
            continue
        got = prof.roles[role]
        assert got.count == len(mine) and got.max_tokens == max(mine)
        assert abs(got.mean_tokens - sum(mine) / len(mine)) <= 1e-9 * max(mine)


def _state(n_devices: int = 8) -> ClusterState:
    stt = ClusterState(config())
    for i in range(n_devices):
        stt.add_device(f"d{i}", 0.0)
    stt.plan = IterationPlan(0, rollout_seqs=64, group_size=4, rollout_tokens_per_seq=200,
                             reward_tokens_per_rollout=80, train_tokens_per_group=1200)
    return stt


def test_stages_take_the_measured_profile_over_the_priors() -> None:
    stt = _state()
    costs = ShiftCostModel(prior_s=2.0)
    prior = stages(stt, costs, None)
    assert prior is not None and prior[Role.ROLLOUT].mean == 200.0
    prof = IterationProfile(0, 30.0, "dynamic", 20.0, {Role.ROLLOUT: RoleProfile(64, 350.0, 3000.0)})
    measured = stages(stt, costs, prof)
    assert measured is not None
    assert measured[Role.ROLLOUT].mean == 350.0 and measured[Role.ROLLOUT].longest == 3000.0
    assert measured[Role.REWARD].mean == prior[Role.REWARD].mean   # unmeasured roles keep the plan's
    choice = choose(stt, costs, prof)
    assert choice is not None and choice.scale == 30.0 / 20.0
    assert choice.mode in ("static", "dynamic", "colocated")
    assert choice.predicted_s[choice.mode] == min(choice.predicted_s.values())


@FEW
@given(split=st.tuples(st.integers(0, 8), st.integers(0, 8)), placed=st.lists(
    st.sampled_from((*PIPELINE, None)), min_size=8, max_size=8))
def test_toward_split_never_exceeds_a_share_and_fills_from_free_devices(
        split: tuple[int, int], placed: list[Role | None]) -> None:
    stt = ClusterState(config())
    for i, role in enumerate(placed):
        stt.add_device(f"d{i}", 0.0)
        if role is not None:
            stt.new_replica(role, (f"d{i}",), 0.0, ReplicaState.ACTIVE)
    a, b = sorted(split)
    target = {Role.ROLLOUT: a, Role.REWARD: b - a, Role.TRAIN: 8 - b}
    plan = toward_split(stt, target)
    held = {r: sum(len(x.devices) for x in stt.by_role[r].values()) for r in PIPELINE}
    if plan is None:
        assert held == target
        return
    for rid in plan.dissolve:
        held[stt.replicas[rid].role] -= len(stt.replicas[rid].devices)
    for role, devs in plan.form:
        held[role] += len(devs)
    assert held == target   # one device per replica here: every split is reachable in one step


def test_controller_hands_the_policy_the_last_iterations_profile() -> None:
    policy = Shiftable()
    ctl = Controller(policy, devices=[f"d{i}" for i in range(4)], config=config(cooldown_s=0.0))
    plan0 = IterationPlan(0, rollout_seqs=4, group_size=4, rollout_tokens_per_seq=20,
                          reward_tokens_per_rollout=10, train_tokens_per_group=200)
    ctl.begin_iteration(plan0, 0.0)
    assert ctl.profiles == [] and policy.choice is not None
    ctl.submit([seq(i, max_new=40) for i in range(4)], 0.0)
    ctl.tick(0.0)
    ready(ctl, 0.5)
    ctl.dispatch(0.5)
    for i, n in enumerate((5, 9, 30, 12)):
        ctl.on_finished(f"s{i}", 1.0, generated=n)
    ctl.begin_iteration(IterationPlan(1, rollout_seqs=4, group_size=4), 7.0)
    prof = ctl.profiles[-1]
    assert prof.iteration == 0 and prof.makespan_s == 7.0 and prof.mode == "dynamic"
    assert prof.roles[Role.ROLLOUT] == RoleProfile(4, 14.0, 30.0)
    assert ctl.log[-1]["iteration_choice"]["mode"] in ("static", "dynamic", "colocated")
    assert policy.history[-1].scale == prof.makespan_s / prof.predicted_s


def test_a_held_static_plan_places_the_predicted_split() -> None:
    cfg = ControllerConfig(roles={r: RoleSpec(max_seqs=8, kv_tokens=10**6) for r in PIPELINE})
    policy = Shiftable(choose_plan=True)
    ctl = Controller(policy, devices=[f"d{i}" for i in range(6)], config=cfg)
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=48, group_size=4), 0.0)
    assert policy.choice is not None and policy.choice.static_split is not None
    policy.choice = dataclasses.replace(policy.choice, mode="static")   # whatever the model predicted
    dec = ctl.tick(0.0)
    assert dec is not None and policy.mode == "static"
    placed = {r: sum(len(s.devices) for s in dec.shifts if s.to_role is r) for r in PIPELINE}
    assert placed == policy.choice.static_split
    ready(ctl, 1.0)
    assert ctl.tick(1.0) is None   # held: nothing moves while the split stands
