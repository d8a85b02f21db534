"""Deployment paradigms behind one interface, so the runtime and the simulator compare them side by side.

A policy looks at the state and returns a `ShiftPlan` (replicas to dissolve, replicas to form) or None; the
controller executes it (Abort/Dispatch migration, bookkeeping, decision log). Policies never dispatch.

- `colocated`: every device serves one role at a time — rollout, then reward, then train — and the whole
  cluster switches only when the current stage has no work left (nor any coming from upstream).
- `disaggregated`: a static split (given, or `best_static_split` over an analytic bottleneck model);
  stages stream into each other; devices never change role (a lost device's partners re-join their role).
- `shiftable` (`core/shiftable.py`): per iteration the plan with the lowest predicted makespan — a held
  static split, colocated, or the five-step planner (`planner.plan`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from pivotrl.core.decision import PlanReasoning
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.tail_migration import Residual
from pivotrl.core.types import PIPELINE, ReplicaState, Role


@dataclass(frozen=True)
class ShiftPlan:
    """Dissolve `dissolve` (replica ids, after aborting their work), then form one replica per entry of
    `form` (role, devices) from the devices freed plus free ones."""

    dissolve: tuple[str, ...]
    form: tuple[tuple[Role, tuple[str, ...]], ...]
    stimulus: str
    reasoning: PlanReasoning | None = None


class Policy:
    """Base: `initial_split` (devices per role) is used to place free devices before any work exists."""

    name = "policy"

    def __init__(self, initial_split: Mapping[Role | str, int] | None = None) -> None:
        self.initial_split = (None if initial_split is None
                              else {Role(k): int(v) for k, v in initial_split.items()})

    def plan(self, state: ClusterState, costs: ShiftCostModel, now: float) -> ShiftPlan | None:
        raise NotImplementedError

    def on_iteration(self, state: ClusterState, costs: ShiftCostModel, last: object | None,
                     now: float) -> None:
        """A new iteration begins (`state.plan` is set); `last` is the `iteration.IterationProfile` core
        measured of the previous one (None for the first). Only a policy that plans whole iterations
        (`Shiftable`) uses it."""

    def tail_residuals(self) -> Mapping[Role, Residual | None] | None:
        """Whether this policy moves a generation role's long-running sequences onto its idle replicas
        (`pivotrl.core.tail_migration`), and the length profile per role that prices the moves; None: it
        does not. Only `Shiftable` does: the static and colocated baselines place work as a static system
        does.
        """
        return None

    def iteration_mode(self) -> tuple[str, float]:
        """(plan this iteration runs, its predicted makespan in seconds; 0 when the policy predicts none),
        recorded in the iteration's measured profile."""
        return self.name, 0.0

    # -- shared helpers --------------------------------------------------------------------------------
    def _fill_split(self, state: ClusterState, split: Mapping[Role, int], stimulus: str) -> ShiftPlan | None:
        """Form replicas from free devices until each role holds its share of devices (in pipeline order)."""
        free = sorted(state.free_devices())
        form: list[tuple[Role, tuple[str, ...]]] = []
        for role in state.roles:
            g = state.config.devices_per_replica(role)
            have = sum(len(r.devices) for r in state.by_role[role].values())
            want = split.get(role, 0)
            while have + g <= want and len(free) >= g:
                form.append((role, tuple(free[:g])))
                free = free[g:]
                have += g
        return ShiftPlan((), tuple(form), stimulus) if form else None


def unsubmitted_rollouts(state: ClusterState, role: Role) -> bool:
    """Is `role` the rollout stage with rollouts the iteration plan announced but the driver has not
    submitted yet? (Any other stage's future work needs its upstream stages to run first.)"""
    return role is PIPELINE[0] and state.rollouts_unsubmitted()


class Colocated(Policy):
    name = "colocated"

    def plan(self, state: ClusterState, costs: ShiftCostModel, now: float) -> ShiftPlan | None:
        if any(r.state is ReplicaState.SHIFTING for r in state.replicas.values()):
            return None  # the whole cluster is switching; wait for it
        current = next((r for r in state.roles if state.by_role[r]), None)
        if current is not None and (state.has_work(current) or unsubmitted_rollouts(state, current)):
            # Stay; free devices (new or orphaned by a lost partner) join the current stage.
            return self._fill_split(state, {current: len(state.device_role)}, "colocated:join")
        start = 0 if current is None else (state.roles.index(current) + 1)
        order = [state.roles[(start + i) % len(state.roles)] for i in range(len(state.roles))]
        target = next((r for r in order if state.has_work(r)), None)
        if target is None:
            if current is None and state.free_devices():
                # Nothing to do yet: warm the first stage (or the given split) so work starts at once.
                split = self.initial_split or {state.roles[0]: len(state.device_role)}
                return self._fill_split(state, split, "initial")
            return None
        if target is current:
            return None
        dissolve = tuple(r for role in state.roles for r in state.by_role[role])
        devices = sorted(state.free_devices() + [d for rid in dissolve for d in state.replicas[rid].devices])
        g = state.config.devices_per_replica(target)
        form = tuple((target, tuple(devices[i:i + g])) for i in range(0, len(devices) - g + 1, g))
        return ShiftPlan(dissolve, form, f"colocated:{current}->{target}")


class Disaggregated(Policy):
    name = "disaggregated"

    def __init__(self, split: Mapping[Role | str, int] | None = None) -> None:
        super().__init__(split)
        self._default: tuple[tuple, dict[Role, int]] | None = None

    def plan(self, state: ClusterState, costs: ShiftCostModel, now: float) -> ShiftPlan | None:
        if not state.free_devices():
            return None
        split = self.initial_split
        if split is None:  # searched once per (cluster size, iteration plan), not every tick
            key = (len(state.device_role), state.plan)
            if self._default is None or self._default[0] != key:
                self._default = (key, default_split(state))
            split = self._default[1]
        return self._fill_split(state, split, "disaggregated:place")


class Grouped(Policy):
    """A static *grouping*: each group of devices serves a fixed set of roles, time-shared colocated-style
    inside the group (one role at a time, switching when its role has no work left), while groups stream
    into each other. The static baseline when there are fewer devices than one replica per role (2 CPU
    workers and 3 roles: e.g. rollout+train on one device, reward on the other); a group of one role is a
    plain disaggregated share. `groups` = [(roles, devices)]; devices are taken from the sorted device list
    in group order, the last group takes the rest. Every role must be in exactly one group."""

    name = "grouped"

    def __init__(self, groups: list[tuple[tuple[Role | str, ...], int]]) -> None:
        super().__init__(None)
        self.groups = [(tuple(Role(r) for r in roles), int(n)) for roles, n in groups]
        seen = [r for roles, _ in self.groups for r in roles]
        if len(seen) != len(set(seen)):
            raise ValueError("grouped: a role appears in more than one group")
        if set(seen) != set(PIPELINE):
            missing = sorted(str(r) for r in set(PIPELINE) - set(seen))
            raise ValueError(f"grouped: no group serves {missing}")
        self._devices: list[tuple[str, ...]] | None = None

    def _assign(self, state: ClusterState) -> list[tuple[str, ...]]:
        devices = sorted(state.device_role)
        if self._devices is None or sorted(d for g in self._devices for d in g) != devices:
            out, i = [], 0
            for k, (_, n) in enumerate(self.groups):
                n = len(devices) - i if k == len(self.groups) - 1 else n
                out.append(tuple(devices[i:i + n]))
                i += n
            self._devices = out
        return self._devices

    def plan(self, state: ClusterState, costs: ShiftCostModel, now: float) -> ShiftPlan | None:
        dissolve: list[str] = []
        form: list[tuple[Role, tuple[str, ...]]] = []
        for (roles, _), devs in zip(self.groups, self._assign(state)):
            rids = sorted({state.device_replica[d] for d in devs if state.device_replica.get(d)})
            reps = [state.replicas[r] for r in rids]
            if any(r.state is ReplicaState.SHIFTING for r in reps):
                continue
            current = reps[0].role if reps else None
            if current is not None and current not in roles:  # the device set changed under a replica
                current = None
            free = [d for d in devs if state.device_replica.get(d) is None]
            busy = current is not None and (state.has_work(current)
                                            or unsubmitted_rollouts(state, current))
            if busy:
                target = current
            else:
                start = 0 if current is None else roles.index(current) + 1
                order = [roles[(start + i) % len(roles)] for i in range(len(roles))]
                target = next((r for r in order if state.has_work(r) or unsubmitted_rollouts(state, r)),
                              None)
                if target is None:
                    target = roles[0] if current is None else current
            if target is not current or any(r.role is not target for r in reps):
                dissolve.extend(rids)
                free = sorted(free + [d for r in reps for d in r.devices])
            g = state.config.devices_per_replica(target)
            form.extend((target, tuple(free[i:i + g])) for i in range(0, len(free) - g + 1, g))
        if not dissolve and not form:
            return None
        return ShiftPlan(tuple(dissolve), tuple(form), "grouped")


class Manual(Policy):
    """No shift of its own: the k-th device to join is placed on `initial_roles[k % len]` and keeps that role
    until an operator (or a test) asks for a shift through `Controller.request_shift`. The baseline for
    mechanism tests that must steer shifts explicitly, and for a fixed hand-made allocation."""

    name = "manual"

    def __init__(self, initial_roles: list[Role | str] | tuple[Role | str, ...] = (Role.ROLLOUT,)) -> None:
        super().__init__(None)
        self.initial_roles = tuple(Role(r) for r in initial_roles)
        self._placed: set[str] = set()

    def plan(self, state: ClusterState, costs: ShiftCostModel, now: float) -> ShiftPlan | None:
        if not self.initial_roles:
            return None
        form: list[tuple[Role, tuple[str, ...]]] = []
        pending: dict[Role, list[str]] = {}
        for device in state.free_devices():  # join order: the state keeps devices in insertion order
            if device in self._placed:
                continue  # freed on request: stays free until asked again
            role = self.initial_roles[len(self._placed) % len(self.initial_roles)]
            self._placed.add(device)
            pending.setdefault(role, []).append(device)
            g = state.config.devices_per_replica(role)
            if len(pending[role]) == g:
                form.append((role, tuple(pending.pop(role))))
        for devices in pending.values():  # not enough devices yet for a whole replica: placed later
            self._placed.difference_update(devices)
        return ShiftPlan((), tuple(form), "manual:initial") if form else None


# ------------------------------------------------------------------------------------------------------
# Static splits
# ------------------------------------------------------------------------------------------------------


def static_splits(n_devices: int, devices_per_replica: Mapping[Role, int],
                  roles: tuple[Role, ...] = PIPELINE) -> Iterator[dict[Role, int]]:
    """Every split of `n_devices` giving each role ≥ 1 whole replica (devices, multiples of g_r)."""
    gs = [max(int(devices_per_replica.get(r, 1)), 1) for r in roles]
    ranges = [range(1, n_devices // g + 1) for g in gs]
    for counts in itertools.product(*ranges):
        used = sum(c * g for c, g in zip(counts, gs))
        if used <= n_devices:
            yield {r: c * g for r, c, g in zip(roles, counts, gs)}


def bottleneck_cost(work_tokens: Mapping[Role, float],
                    replica_rate: Mapping[Role, float],
                    devices_per_replica: Mapping[Role, int]) -> Callable[[Mapping[Role, int]], float]:
    """Streaming-pipeline time of one iteration under a split: the slowest stage,
    W_r / (replicas_r · rate_r)."""

    def cost(split: Mapping[Role, int]) -> float:
        worst = 0.0
        for r, w in work_tokens.items():
            if w <= 0:
                continue
            reps = split.get(r, 0) // max(int(devices_per_replica.get(r, 1)), 1)
            rate = replica_rate.get(r, 0.0)
            if reps <= 0 or rate <= 0:
                return math.inf
            worst = max(worst, w / (reps * rate))
        return worst

    return cost


def best_static_split(n_devices: int, devices_per_replica: Mapping[Role, int],
                      cost: Callable[[Mapping[Role, int]], float],
                      roles: tuple[Role, ...] = PIPELINE) -> dict[Role, int]:
    """The split (devices per role) with the lowest `cost` (e.g. `bottleneck_cost`, or a simulator run).

    Exhaustive over every split while there are at most `EXHAUSTIVE_SPLITS` of them (ties: prefer more
    devices in use, then earlier roles). Beyond that (hundreds of devices) it searches splits where the last
    role takes every device left: a coarse grid, then every split within one grid step of the best.
    Raises ValueError if no role mix fits.
    """
    gs = [max(int(devices_per_replica.get(r, 1)), 1) for r in roles]
    n_splits = math.prod(max(n_devices // g, 0) for g in gs)
    best: tuple[float, int, tuple[int, ...]] | None = None
    best_split: dict[Role, int] | None = None

    def consider(split: dict[Role, int]) -> None:
        nonlocal best, best_split
        key = (cost(split), -sum(split.values()), tuple(-split[r] for r in roles))
        if best is None or key < best:
            best, best_split = key, split

    if n_splits <= EXHAUSTIVE_SPLITS:
        for split in static_splits(n_devices, devices_per_replica, roles):
            consider(split)
    else:
        def fill(counts: tuple[int, ...]) -> dict[Role, int] | None:
            used = sum(c * g for c, g in zip(counts, gs))
            last = (n_devices - used) // gs[-1]
            if any(c < 1 for c in counts) or last < 1:
                return None
            return {**{r: c * g for r, c, g in zip(roles, counts, gs)}, roles[-1]: last * gs[-1]}

        steps = [max(1, (n_devices // g) // 40) for g in gs[:-1]]
        for counts in itertools.product(*[range(1, n_devices // g + 1, s) for g, s in zip(gs, steps)]):
            split = fill(counts)
            if split is not None:
                consider(split)
        if best_split is not None:
            center = [best_split[r] // g for r, g in zip(roles[:-1], gs)]
            ranges = [range(max(1, c - s), c + s + 1) for c, s in zip(center, steps)]
            for counts in itertools.product(*ranges):
                split = fill(counts)
                if split is not None:
                    consider(split)
    if best_split is None:
        raise ValueError(f"{n_devices} device(s) cannot hold one replica of each role "
                         f"(devices per replica {dict(devices_per_replica)})")
    return best_split


#: Above this many candidate splits, `best_static_split` searches a grid and refines instead.
EXHAUSTIVE_SPLITS = 50_000


def default_split(state: ClusterState) -> dict[Role, int]:
    """A static split from what the controller knows: the iteration plan's work and the role priors."""
    n = len(state.device_role)
    gs = {r: state.config.devices_per_replica(r) for r in state.roles}
    plan = state.plan
    if plan is not None:
        work = {Role.ROLLOUT: plan.rollout_seqs * plan.rollout_tokens_per_seq,
                Role.REWARD: plan.rollout_seqs * plan.reward_tokens_per_rollout,
                Role.TRAIN: plan.rollout_seqs / max(plan.group_size, 1) * plan.train_tokens_per_group}
    else:
        work = {r: 1.0 for r in state.roles}
    rates = {r: state.role_models[r].rate(state.config.spec(r).max_seqs) for r in state.roles}
    try:
        return best_static_split(n, gs, bottleneck_cost(work, rates, gs), state.roles)
    except ValueError:
        # Too few devices for one replica per role: give them to the earliest roles that fit.
        out: dict[Role, int] = dict.fromkeys(state.roles, 0)
        left = n
        for r in state.roles:
            if gs[r] <= left:
                out[r] = gs[r]
                left -= gs[r]
        return out
