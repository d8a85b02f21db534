from __future__ import annotations

import itertools
import random

import pytest

from pivotrl.core import (
    Controller,
    IterationPlan,
    Role,
    best_static_split,
    bottleneck_cost,
    make_policy,
    static_splits,
)
from pivotrl.core.types import SeqState

from .helpers import config, ready, seq


def _roles_present(ctl: Controller) -> set[Role]:
    return {r.role for r in ctl.replicas()}


def _drain(ctl: Controller, role: Role, now: float, on_done=None) -> None:
    """Dispatch and finish every sequence of `role` (feeding the next stage through `on_done`)."""
    while ctl.has_work(role):
        ctl.dispatch(now)
        running = [s for s in ctl.state.seqs.values() if s.role is role and s.state is SeqState.RUNNING]
        assert running, f"{role} has work but nothing runs"
        for s in running:
            done = ctl.on_finished(s.seq_id, now)
            if on_done:
                on_done(done)
        if ctl.has_work(role):
            assert ctl.tick(now) is None  # never leaves a stage that still has work


def test_colocated_runs_one_stage_at_a_time() -> None:
    ctl = Controller("colocated", devices=[f"d{i}" for i in range(4)], config=config(reward_g=2))
    dec = ctl.tick(0.0)  # warms the first stage before work exists
    assert dec is not None and _roles_present(ctl) == {Role.ROLLOUT}
    ready(ctl, 1.0)
    for it in range(2):
        ctl.begin_iteration(IterationPlan(it, rollout_seqs=8, group_size=4), 1.0)
        ctl.submit([seq(f"i{it}r{i}", Role.ROLLOUT) for i in range(8)], 1.0)
        if it == 1:  # after train, the cluster goes back to rollout
            assert ctl.tick(1.0).stimulus == "colocated:train->rollout"
            ready(ctl, 1.5)
        assert ctl.tick(1.0) is None
        judged: list[str] = []

        def to_reward(s):
            ctl.submit([seq(f"j-{s.seq_id}", Role.REWARD)], 2.0)

        # Rollout stage: reward work piles up but the cluster stays on rollout until rollouts are done.
        _drain(ctl, Role.ROLLOUT, 2.0, to_reward)
        assert ctl.has_work(Role.REWARD)
        dec = ctl.tick(3.0)
        assert dec.stimulus == "colocated:rollout->reward"
        assert _roles_present(ctl) == {Role.REWARD} and len(ctl.replicas(Role.REWARD)) == 2
        assert ctl.dispatch(3.0) == []  # shifting
        ready(ctl, 4.0)

        def to_train(s, judged=judged):
            judged.append(s.seq_id)
            if len(judged) % 4 == 0:
                ctl.submit([seq(f"t-{s.seq_id}", Role.TRAIN, prompt=0, max_new=400)], 5.0)

        _drain(ctl, Role.REWARD, 5.0, to_train)
        assert ctl.tick(6.0).stimulus == "colocated:reward->train"
        assert _roles_present(ctl) == {Role.TRAIN} and len(ctl.replicas(Role.TRAIN)) == 4
        ready(ctl, 7.0)
        _drain(ctl, Role.TRAIN, 8.0)
        assert ctl.tick(9.0) is None  # iteration over: nothing to switch to yet
        ctl.check_invariants()


def test_colocated_waits_for_upstream_work_announced_by_the_plan() -> None:
    ctl = Controller("colocated", devices=["a", "b"], config=config())
    ctl.tick(0.0)
    ready(ctl, 0.0)
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=4), 0.0)
    ctl.submit([seq(i) for i in range(2)], 0.0)  # half of the rollouts submitted so far
    ctl.dispatch(0.0)
    for i in range(2):
        ctl.on_finished(f"s{i}", 1.0)
    ctl.submit([seq("j0", Role.REWARD)], 1.0)
    assert ctl.tick(1.0) is None  # 2 rollouts are still to come
    ctl.submit([seq(i) for i in range(2, 4)], 2.0)
    ctl.dispatch(2.0)
    for i in range(2, 4):
        ctl.on_finished(f"s{i}", 3.0)
    assert ctl.tick(3.0).stimulus == "colocated:rollout->reward"


def test_disaggregated_places_its_split_and_never_shifts() -> None:
    rng = random.Random(0)
    ctl = Controller(make_policy("disaggregated", static_split={"rollout": 3, "reward": 2, "train": 1}),
                     devices=[f"d{i}" for i in range(6)], config=config(cooldown_s=0.0))
    ctl.tick(0.0)
    ready(ctl, 0.0)
    layout = {d: ctl.role_of(d) for d in ctl.state.device_role}
    assert sorted(map(str, layout.values())) == ["reward", "reward", "rollout", "rollout", "rollout", "train"]
    for step in range(200):
        now = 1.0 + step
        if rng.random() < 0.5:
            role = rng.choice([Role.ROLLOUT, Role.REWARD])
            ctl.submit([seq(f"x{step}", role, max_new=rng.randint(1, 400))], now)
        ctl.dispatch(now)
        live = [s for s in ctl.state.seqs.values() if s.state is SeqState.RUNNING]
        if live and rng.random() < 0.4:
            ctl.on_finished(rng.choice(live).seq_id, now)
        assert ctl.tick(now) is None
        assert {d: ctl.role_of(d) for d in ctl.state.device_role} == layout
    ctl.check_invariants()


def test_disaggregated_refills_its_split_after_a_device_loss() -> None:
    ctl = Controller(make_policy("disaggregated", static_split={"rollout": 2, "reward": 2, "train": 1}),
                     devices=[f"d{i}" for i in range(5)], devices_per_replica={"reward": 2}, config=config())
    ctl.tick(0.0)
    ready(ctl, 0.0)
    reward_devs = ctl.replicas(Role.REWARD)[0].devices
    ctl.on_device_lost(reward_devs[0], 1.0)
    assert ctl.role_of(reward_devs[1]) is None
    assert ctl.tick(2.0) is None  # one free device cannot form a 2-device reward replica
    ctl.add_device("spare", 3.0)
    dec = ctl.tick(3.0)
    want = [(Role.REWARD, sorted([reward_devs[1], "spare"]))]
    assert [(s.to_role, sorted(s.devices)) for s in dec.shifts] == want


def test_disaggregated_default_split_from_the_iteration_plan() -> None:
    ctl = Controller("disaggregated", devices=[f"d{i}" for i in range(8)], config=config())
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=64, group_size=4, rollout_tokens_per_seq=600,
                                      reward_tokens_per_rollout=200, train_tokens_per_group=400), 0.0)
    ctl.tick(0.0)
    per = {r: sum(len(x.devices) for x in ctl.replicas(r)) for r in Role}
    assert sum(per.values()) == 8 and min(per.values()) >= 1
    assert per[Role.ROLLOUT] > per[Role.REWARD] >= per[Role.TRAIN]


def test_best_static_split_is_the_exhaustive_minimum() -> None:
    gs = {Role.ROLLOUT: 1, Role.REWARD: 2, Role.TRAIN: 1}
    work = {Role.ROLLOUT: 1000.0, Role.REWARD: 700.0, Role.TRAIN: 100.0}
    rate = {Role.ROLLOUT: 10.0, Role.REWARD: 12.0, Role.TRAIN: 50.0}
    cost = bottleneck_cost(work, rate, gs)
    for n in range(4, 13):
        best = best_static_split(n, gs, cost)
        brute = min(cost(s) for s in static_splits(n, gs))
        assert cost(best) == brute
        assert sum(best.values()) <= n and best[Role.REWARD] % 2 == 0
        for s in itertools.islice(static_splits(n, gs), 50):
            assert all(s[r] >= gs[r] for r in gs)
    with pytest.raises(ValueError):
        best_static_split(3, gs, cost)


def test_best_static_split_accepts_any_cost_callable() -> None:
    gs = {Role.ROLLOUT: 1, Role.REWARD: 1, Role.TRAIN: 1}
    best = best_static_split(6, gs, lambda s: abs(s[Role.ROLLOUT] - 4) + abs(s[Role.REWARD] - 1))
    assert best == {Role.ROLLOUT: 4, Role.REWARD: 1, Role.TRAIN: 1}


def test_make_policy_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown scheduler mode"):
        make_policy("round-robin")
    assert make_policy("shiftable").name == "shiftable"


def test_best_static_split_scales_to_hundreds_of_devices() -> None:
    """Past the exhaustive limit it searches a grid and refines; on the bottleneck cost it still finds
    the optimum among splits that use every device."""
    import time as clock  # tests may read the clock; core may not

    gs = {Role.ROLLOUT: 1, Role.REWARD: 2, Role.TRAIN: 1}
    work = {Role.ROLLOUT: 9000.0, Role.REWARD: 7000.0, Role.TRAIN: 1500.0}
    rate = {Role.ROLLOUT: 10.0, Role.REWARD: 12.0, Role.TRAIN: 50.0}
    cost = bottleneck_cost(work, rate, gs)
    n = 200
    t0 = clock.perf_counter()
    best = best_static_split(n, gs, cost)
    assert clock.perf_counter() - t0 < 5.0
    brute = min(cost({Role.ROLLOUT: a, Role.REWARD: 2 * b, Role.TRAIN: n - a - 2 * b})
                for a in range(1, n) for b in range(1, n // 2) if n - a - 2 * b >= 1)
    assert cost(best) == pytest.approx(brute)
    assert sum(best.values()) == n
