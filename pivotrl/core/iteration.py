"""The iteration as a whole: a measured profile of the last iteration and a makespan model per plan.

Why (issue #14): the tick planner maximises work over a short horizon, so it can lose to a plan that never
moves a device. On-policy, what counts is the iteration's makespan, which ends with the longest chain
(the longest rollout, its judgement, its group's training). This module predicts that makespan, from
core's own throughput fits and shift-cost model, for three whole-iteration plans:

* `static`: a fixed split (the best one is searched exhaustively over replica counts, vectorised);
* `colocated`: every device on one stage at a time, a full-cluster shift between stages;
* `dynamic`: the tick planner; at best the fluid time (all work at peak rate over all devices) plus the
  shifts its devices make (each device outside the first stage's static share goes there and back once),
  and never below the critical path at full batch.

The policy (`pivotrl.core.shiftable`) picks the plan with the lowest prediction at each iteration start.
Predictions are scaled by what the last iteration measured against its own prediction (one factor, shared
by all plans, so a model error common to all of them never flips the choice, while the *measured* profile
— lengths per role, the longest sequence, step-time fits, shift costs — replaces the priors).
Pure: numbers in, numbers out; time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.types import PIPELINE, Role

#: Before any iteration is measured, the longest response is assumed this many times the mean (long-tailed
#: RL lengths: p99 ≈ 10× median, DESIGN §1). After one iteration the measured longest replaces it.
PRIOR_LONGEST_OVER_MEAN = 4.0

MODES = ("static", "dynamic", "colocated")


@dataclass(frozen=True)
class RoleProfile:
    """One role's measured work in one iteration: finished items, their mean and longest length (tokens)."""

    count: int
    mean_tokens: float
    max_tokens: float


@dataclass(frozen=True)
class IterationProfile:
    """What core measured of one iteration: its makespan (begin to the next begin), the plan it ran, the
    work per role, and the shift durations learned so far (per target role)."""

    iteration: int
    makespan_s: float
    mode: str
    predicted_s: float
    roles: dict[Role, RoleProfile]
    shift_in_s: dict[Role, float] = field(default_factory=dict)


class IterationMeter:
    """Accumulates finished lengths per role for the iteration in progress (O(1) per finished item)."""

    def __init__(self) -> None:
        self._acc: dict[Role, list[float]] = {}
        self.started_at: float | None = None
        self.iteration = -1

    def begin(self, iteration: int, now: float) -> None:
        self._acc = {}
        self.started_at = now
        self.iteration = iteration

    def observe(self, role: Role, tokens: float) -> None:
        acc = self._acc.setdefault(role, [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += tokens
        acc[2] = max(acc[2], tokens)

    def profile(
        self, now: float, mode: str, predicted_s: float, costs: ShiftCostModel
    ) -> IterationProfile | None:
        """The profile of the iteration that ends `now` (None before the first one began)."""
        if self.started_at is None:
            return None
        roles = {r: RoleProfile(int(a[0]), a[1] / a[0], a[2]) for r, a in self._acc.items() if a[0] > 0}
        shift = {r: shift_in(costs, r) for r in PIPELINE}
        return IterationProfile(self.iteration, now - self.started_at, mode, predicted_s, roles, shift)


def shift_in(costs: ShiftCostModel, role: Role) -> float:
    """Mean seconds for a device of another role to take up `role` (free placements are not shifts)."""
    others = [d for d in PIPELINE if d is not role]
    return sum(costs.duration(d, role) for d in others) / len(others)


@dataclass(frozen=True)
class Stage:
    """One role's iteration work in the model's terms (see `stages`)."""

    role: Role
    g: int
    seqs: float
    mean: float  # tokens per item
    longest: float  # tokens of the longest item
    a: float
    b: float
    k: float  # work per item per step (1 for decode, an item's tokens for train)
    cap: float  # items per replica at once
    shift_s: float  # seconds for a device to take up this role
    decode: bool  # a generation stage: an item takes one step per token

    def step(self, conc: np.ndarray) -> np.ndarray:
        return self.a + self.b * self.k * conc

    def timing(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(drain time of all its work, end time of its longest item) with `m` replicas, items spread evenly.

        The longest item starts, on average, halfway through the part of the drain during which items
        still queue (at once when every item fits), then takes one step per token at the full batch's
        step time: a stage ends with its drain or with that item, whichever is later. (Measured on the paper
        reconstruction's rollout, 6 replicas: drain 190 s, with the longest item 276 s; simulated 266 s.)
        """
        m = np.maximum(np.asarray(m, dtype=float), 1e-12)
        conc = np.minimum(self.cap, np.maximum(self.seqs / m, 1.0))
        step = self.step(conc)
        rate = np.minimum(m, max(self.seqs, 1.0)) * conc * self.k / step  # work per second
        drain = self.seqs * self.mean / np.maximum(rate, 1e-300)  # tokens over tokens/s
        if not self.decode:
            return drain, drain + step
        queued = 0.5 * np.maximum(0.0, 1.0 - self.cap * m / max(self.seqs, 1.0))
        return drain, np.maximum(drain, queued * drain + self.longest * step)

    def last_item_s(self) -> float:
        """An item started alone after its upstream finished (the tail end of the chain)."""
        one = float(self.step(np.asarray(1.0)))
        return self.mean * one if self.decode else one

    def peak_weight(self) -> float:
        """Device-seconds per unit of work at full batch."""
        return self.g * float(self.step(np.asarray(self.cap))) / (self.cap * self.k)


def stages(
    state: ClusterState, costs: ShiftCostModel, last: IterationProfile | None
) -> dict[Role, Stage] | None:
    """The iteration's work per role: from the `IterationPlan` and the priors, or — once an iteration was
    measured — its measured lengths (mean and longest) per role. None without a plan."""
    plan = state.plan
    if plan is None or not all(r in state.roles for r in PIPELINE):
        return None
    n = float(plan.rollout_seqs)
    item = plan.train_tokens_per_group / max(plan.group_size, 1)
    means = {
        Role.ROLLOUT: plan.rollout_tokens_per_seq,
        Role.REWARD: plan.reward_tokens_per_rollout,
        Role.TRAIN: item,
    }
    longest = {r: v * (PRIOR_LONGEST_OVER_MEAN if r is not Role.TRAIN else 1.0) for r, v in means.items()}
    if last is not None:
        for r, p in last.roles.items():
            if p.count > 0:
                means[r], longest[r] = p.mean_tokens, p.max_tokens
    ctx = {
        Role.ROLLOUT: means[Role.ROLLOUT],
        Role.REWARD: means[Role.ROLLOUT] + means[Role.REWARD],
        Role.TRAIN: 0.0,
    }
    out = {}
    for r in PIPELINE:
        spec = state.config.spec(r)
        model = state.role_models[r]
        cap = float(spec.max_seqs)
        if ctx[r] > 0:
            cap = max(1.0, min(cap, math.floor(spec.kv_tokens / ctx[r])))
        out[r] = Stage(
            r,
            spec.devices_per_replica,
            n,
            max(means[r], 1.0),
            max(longest[r], 1.0),
            model.a,
            model.b,
            model.tokens_per_seq_step,
            cap,
            shift_in(costs, r),
            r is not Role.TRAIN,
        )
    return out


def static_makespans(st: dict[Role, Stage], reps: dict[Role, np.ndarray]) -> np.ndarray:
    """Predicted makespan of a streaming static split (replicas per role, arrays of equal shape): the first
    stage ends with its drain or its longest item; each later stage ends with its own drain or, after its
    upstream ended, with one more item alone (the last arrival)."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    _, t_ro = ro.timing(reps[Role.ROLLOUT])
    _, e_rw = rw.timing(reps[Role.REWARD])
    _, e_tr = tr.timing(reps[Role.TRAIN])
    t_rw = np.maximum(e_rw, t_ro + rw.last_item_s())
    return np.maximum(e_tr, t_rw + tr.last_item_s())


def best_static(st: dict[Role, Stage], n_devices: int) -> tuple[dict[Role, int], float] | None:
    """The split (devices per role) with the lowest predicted makespan, exhaustive over every split into
    whole replicas (numpy over the (rollout, reward) grid; train takes what is left). None if none fits."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    a = np.arange(1, n_devices // ro.g + 1)
    b = np.arange(1, n_devices // rw.g + 1)
    aa, bb = np.meshgrid(a, b, indexing="ij")
    left = n_devices - aa * ro.g - bb * rw.g
    cc = left // tr.g
    ok = cc >= 1
    if not ok.any():
        return None
    aa, bb, cc = aa[ok], bb[ok], cc[ok]
    t = static_makespans(st, {Role.ROLLOUT: aa, Role.REWARD: bb, Role.TRAIN: cc})
    i = int(np.argmin(t))
    split = {Role.ROLLOUT: int(aa[i]) * ro.g, Role.REWARD: int(bb[i]) * rw.g, Role.TRAIN: int(cc[i]) * tr.g}
    return split, float(t[i])


def colocated_makespan(st: dict[Role, Stage], n_devices: int) -> float:
    """Every stage alone on the whole cluster in turn, one full-cluster shift before each."""
    total = 0.0
    for s in st.values():
        _, end = s.timing(np.asarray(float(max(n_devices // s.g, 1))))
        total += float(end) + s.shift_s
    return total


def dynamic_makespan(st: dict[Role, Stage], n_devices: int, static_split: dict[Role, int] | None) -> float:
    """The tick planner at its best: the fluid time plus the shifts its devices make (every device outside
    the first stage's best static share goes there and back, once each per iteration), never below the
    chain of the longest rollout at full batch, one judgement and one train step."""
    fluid = sum(s.seqs * s.mean * s.peak_weight() for s in st.values()) / n_devices
    first = st[PIPELINE[0]]
    share = (static_split or {}).get(PIPELINE[0], n_devices) / n_devices
    mean_shift = sum(s.shift_s for s in st.values()) / len(st)
    moving = 2.0 * mean_shift * (1.0 - share)
    _, l_ro = first.timing(np.asarray(float(max(n_devices // first.g, 1))))
    chain = float(l_ro) + st[Role.REWARD].last_item_s() + st[Role.TRAIN].last_item_s()
    return max(fluid + moving, chain)


@dataclass(frozen=True)
class IterationChoice:
    """The plan chosen for an iteration, with every plan's prediction (seconds) for the log."""

    mode: str
    predicted_s: dict[str, float]
    static_split: dict[Role, int] | None
    scale: float
    first_stage_alone_s: float = 0.0  # predicted end of the first stage with every device on it
    handoff_s: float = 0.0  # mean seconds for a device to take up a downstream role

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "predicted_s": dict(self.predicted_s),
            "scale": self.scale,
            "first_stage_alone_s": self.first_stage_alone_s,
            "handoff_s": self.handoff_s,
            "static_split": None
            if self.static_split is None
            else {str(k): v for k, v in self.static_split.items()},
        }


def choose(
    state: ClusterState, costs: ShiftCostModel, last: IterationProfile | None
) -> IterationChoice | None:
    """Predict every plan for the coming iteration and pick the fastest. Ties go to `static` (stay still),
    then `dynamic`. Moving to the static split from the current allocation costs its moved devices' shift
    time, spread over the cluster. The scale is the last iteration's measured/predicted makespan."""
    st = stages(state, costs, last)
    n = len(state.device_role)
    if st is None or n < sum(s.g for s in st.values()):
        return None
    found = best_static(st, n)
    if found is None:
        return None
    split, t_static = found
    placed = {r: sum(len(x.devices) for x in state.by_role[r].values()) for r in PIPELINE}
    if sum(placed.values()):
        moved = sum(max(split[r] - placed[r], 0) for r in PIPELINE)
        t_static += moved * max(s.shift_s for s in st.values()) / n
    pred = {
        "static": t_static,
        "dynamic": dynamic_makespan(st, n, split),
        "colocated": colocated_makespan(st, n),
    }
    scale = 1.0
    if last is not None and last.predicted_s > 0 and last.makespan_s > 0:
        scale = last.makespan_s / last.predicted_s
    mode = min(MODES, key=lambda m: (pred[m], MODES.index(m)))
    first = st[PIPELINE[0]]
    _, alone = first.timing(np.asarray(float(max(n // first.g, 1))))
    handoff = sum(st[r].shift_s for r in PIPELINE[1:]) / (len(PIPELINE) - 1)
    return IterationChoice(mode, {m: v * scale for m, v in pred.items()}, split, scale, float(alone), handoff)
