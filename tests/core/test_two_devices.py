"""Two devices, three roles (the CPU runtime's case): the planner moves one device when that pays, and the
static baseline groups roles on devices."""

from __future__ import annotations

from pivotrl.core import Controller, Grouped, IterationPlan, Role, make_policy

from .helpers import config, ready, seq


def _two_device_controller(policy="shiftable") -> Controller:
    ctl = Controller(policy, devices=["a", "b"], config=config(horizon_s=3.0, cooldown_s=0.3, hysteresis=0.0,
                                                                shift_prior_s=0.05))
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=16, group_size=8, rollout_tokens_per_seq=20,
                                      reward_tokens_per_rollout=60, train_tokens_per_group=400), 0.0)
    ctl.submit([seq(f"r{i}", Role.ROLLOUT, max_new=64, expected_new_tokens=20) for i in range(16)], 0.0)
    return ctl


def test_rollout_tail_on_one_device_frees_the_other_for_reward() -> None:
    ctl = _two_device_controller()
    dec = ctl.tick(0.0)
    assert dec is not None and {str(s.to_role) for s in dec.shifts} == {"rollout"}
    assert len(dec.shifts) == 2   # rollout is the only role with work: both devices help it
    ready(ctl, 0.0)
    ctl.dispatch(0.0)
    for rep in ctl.replicas(Role.ROLLOUT):
        for n in (1, 8):
            ctl.on_step(rep.replica_id, n, 0.004 + 0.002 * n, 0.0)
    # short rollouts finish first; 4 long ones are left: they fit on one replica, at twice the step time (no
    # "spare" capacity), but rollout's drain time stays far below reward's
    for i in range(12):
        ctl.on_finished(f"r{i}", 0.1, generated=10)
        ctl.submit([seq(f"j{i}", Role.REWARD, prompt=40, max_new=64, expected_new_tokens=60)], 0.1)
    for i in range(12, 16):
        ctl.on_progress(f"r{i}", 18, 0.1)
    # within the cooldown of the devices' placement at t=0, but every rollout is started and one replica is
    # idle: it cannot get work before the next iteration, so it leaves its cooldown
    dec = ctl.tick(0.15)
    assert dec is not None
    moved = [m for s in dec.shifts for m in s.moves]
    assert len(moved) == 1 and moved[0].from_role is Role.ROLLOUT and moved[0].to_role is Role.REWARD
    assert len(ctl.replicas(Role.ROLLOUT)) == 1   # rollout keeps a device for its tail


def test_grouped_policy_time_shares_roles_inside_a_group() -> None:
    ctl = _two_device_controller(make_policy("grouped", groups=[(("rollout", "train"), 1), (("reward",), 1)]))
    assert isinstance(ctl.policy, Grouped)
    ctl.tick(0.0)
    ready(ctl, 0.0)
    assert sorted(str(r.role) for r in ctl.replicas()) == ["reward", "rollout"]
    ctl.dispatch(0.0)
    for i in range(16):
        ctl.on_finished(f"r{i}", 1.0, generated=10)
        ctl.submit([seq(f"j{i}", Role.REWARD, prompt=40, max_new=64)], 1.0)
    ctl.dispatch(1.0)
    assert ctl.tick(1.0) is None   # rollout has no work, train none yet: the group stays put
    for i in range(8):
        ctl.on_finished(f"j{i}", 2.0, generated=10)
    ctl.submit([seq(f"t{i}", Role.TRAIN, prompt=0, max_new=100) for i in range(8)], 2.0)
    dec = ctl.tick(2.0)   # the rollout+train device switches to train; the reward device never moves
    assert dec is not None and [str(s.to_role) for s in dec.shifts] == ["train"]
    assert all(m.from_role is Role.ROLLOUT for s in dec.shifts for m in s.moves)


def test_grouped_policy_rejects_a_role_in_two_groups() -> None:
    import pytest
    with pytest.raises(ValueError):
        make_policy("grouped", groups=[(("rollout", "train"), 1), (("train",), 1)])
