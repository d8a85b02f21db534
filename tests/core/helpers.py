"""Small builders shared by the core tests."""

from __future__ import annotations

from pivotrl.core import Controller, ControllerConfig, Role, RoleSpec, Sequence, ShiftTimings
from pivotrl.core.state import ClusterState
from pivotrl.core.types import ReplicaState


def config(**kw) -> ControllerConfig:
    roles = kw.pop("roles", None) or {
        Role.ROLLOUT: RoleSpec(devices_per_replica=1, max_seqs=8, kv_tokens=4000),
        Role.REWARD: RoleSpec(devices_per_replica=kw.pop("reward_g", 1), max_seqs=8, kv_tokens=4000),
        Role.TRAIN: RoleSpec(devices_per_replica=1, max_seqs=4, kv_tokens=8000, tokens_per_seq_step=100),
    }
    return ControllerConfig(roles=roles, **kw)


def seq(i: int | str, role: Role = Role.ROLLOUT, prompt: int = 10, max_new: int = 100, **kw) -> Sequence:
    return Sequence(f"s{i}" if isinstance(i, int) else i, role, prompt, max_new, **kw)


def active_state(cfg: ControllerConfig, per_role: dict[Role, int], now: float = 0.0) -> ClusterState:
    """A state with `per_role[r]` active replicas per role (devices named by role and index)."""
    st = ClusterState(cfg)
    for role, k in per_role.items():
        g = cfg.devices_per_replica(role)
        for i in range(k):
            devs = tuple(f"{role}-d{i}-{j}" for j in range(g))
            for d in devs:
                st.add_device(d, now)
            st.new_replica(role, devs, now, ReplicaState.ACTIVE)
    return st


def ready(ctl: Controller, now: float, timings: ShiftTimings | None = None) -> None:
    """Finish every pending shift."""
    for rep in list(ctl.state.replicas.values()):
        if rep.state is ReplicaState.SHIFTING:
            ctl.on_shift_done(rep.replica_id, now, timings or ShiftTimings(load=1.0))


def rollout_tail(cfg: ControllerConfig) -> Controller:
    """5 devices placed 4 rollout + 1 reward at t = 0 and ready; two long rollouts (the stage's tail) and 40
    judgements waiting, dispatched: the end of a rollout stage, where idle rollout replicas should move."""
    ctl = Controller("shiftable", devices=[f"d{i}" for i in range(5)], config=cfg)
    ctl.policy.initial_split = {Role.ROLLOUT: 4, Role.REWARD: 1}
    ctl.tick(0.0)
    ready(ctl, 0.0)
    ctl.submit([seq(f"tail{i}", Role.ROLLOUT, max_new=2000, expected_new_tokens=1500) for i in range(2)], 0.0)
    ctl.submit([seq(f"j{i}", Role.REWARD, max_new=200, expected_new_tokens=150) for i in range(40)], 0.0)
    ctl.dispatch(0.0)
    return ctl
