"""The iteration as a whole: a measured profile of the last iteration and a makespan model per plan.

Why (issue #14): the tick planner maximises work over a short horizon, so it can lose to a plan that never
moves a device. On-policy, what counts is the iteration's makespan, which ends with the longest chain
(the longest rollout, its judgement, its group's training). This module measures the last iteration
(`IterationMeter`), turns it and the priors into the iteration's stages (`stages`; each stage's timing is
`pivotrl.core.stage`), and predicts the makespan (`pivotrl.core.makespan`), from core's own throughput
fits and shift-cost model, for three whole-iteration plans:

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
from dataclasses import dataclass, field, replace

import numpy as np

from pivotrl.core.makespan import (
    best_static,
    colocated_makespan,
    dynamic_makespan,
    lent_split,
    loaned_makespan,
    moved_makespan,
    static_makespans,
    work_arrives,
)
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.stage import TAIL_FRACTIONS, Stage, tail_lengths
from pivotrl.core.state import ClusterState
from pivotrl.core.throughput import ThroughputModel
from pivotrl.core.types import PIPELINE, Role

#: Before any iteration is measured, the longest response is assumed this many times the mean (long-tailed
#: RL lengths: p99 ≈ 10× median, DESIGN §1). After one iteration the measured longest replaces it.
PRIOR_LONGEST_OVER_MEAN = 4.0

MODES = ("static", "dynamic", "colocated")

#: How much faster the tick planner's measured record must predict an iteration than the predicted split
#: for the iteration to open on the planner rather than on that split (`split_beats_planner`). The two
#: predictions come from different models (the stage model unscaled; a fluid bound scaled by the one
#: iteration the planner last ran), and an iteration's end moves with its longest item: the spread of
#: the judge's end (`Stage.end_spread`, its standard deviation) is a median 4.5 % of the predicted makespan
#: on the 15 random draws whose opening this margin decides, and the model of iteration 1 was 18 % off its
#: run on draws 2 (over) and 124 (under). A planner predicted faster by less than the margin is a tie, and
#: ties go to the split that stays still (docs/decisions.md, "a planner within the noise is a tie").
PLANNER_MARGIN = 0.05

#: How much faster than the current placement a searched split must be predicted, its moves paid, for an
#: iteration to move to it. A move costs its shifts for certain, and its gain is a difference of two
#: predictions: from the last iteration's profile the model's iteration time was off by 11-12 % (mean
#: absolute error, random seeds 0-51 and 200-251 at the best static split), so a move predicted to gain
#: 1 % is a coin flip that always pays its shifts (random draw 36: one judge device moved to train for a
#: predicted 1.3 %, and the split ran 1.6 % slower; docs/decisions.md, "Where the split beats the
#: planner, downstream roles keep their share from the first stage; a move must be predicted to pay by a
#: margin").
HOLD_MARGIN = 0.01


@dataclass(frozen=True)
class RoleProfile:
    """One role's measured work in one iteration: finished items, their mean and longest length (tokens),
    the lengths at `TAIL_FRACTIONS` (empty when not measured) and the mean prompt tokens an item prefilled."""

    count: int
    mean_tokens: float
    max_tokens: float
    tail: tuple[float, ...] = ()
    prompt_mean: float = 0.0


@dataclass(frozen=True)
class SyncSample:
    """The synchronisation measured after the last train item of an iteration (to the next iteration's
    begin: on-policy, the gradient reduction, optimizer step and publish) and the train replicas then."""

    seconds: float
    replicas: int


@dataclass(frozen=True)
class IterationProfile:
    """What core measured of one iteration: its makespan (begin to the next begin), the plan it ran, the
    work per role, the shift durations learned so far (per target role) and the train sync."""

    iteration: int
    makespan_s: float
    mode: str
    predicted_s: float
    roles: dict[Role, RoleProfile]
    shift_in_s: dict[Role, float] = field(default_factory=dict)
    sync: SyncSample | None = None


class IterationMeter:
    """Accumulates finished lengths per role for the iteration in progress (O(1) per finished item; the
    tail quantiles are taken once, when the profile is read)."""

    def __init__(self) -> None:
        self._acc: dict[Role, list[float]] = {}
        self._lengths: dict[Role, list[float]] = {}
        self.started_at: float | None = None
        self.iteration = -1
        self._trained: tuple[float, int] | None = None  # (when, train replicas) of the last train item

    def begin(self, iteration: int, now: float) -> None:
        self._acc = {}
        self._lengths = {}
        self.started_at = now
        self.iteration = iteration
        self._trained = None

    def observe(
        self, role: Role, tokens: float, prompt_tokens: float = 0.0, now: float | None = None,
        replicas: int = 0,
    ) -> None:
        """One finished item of `role`; `now` and the role's `replicas` then (train: the sync's sample)."""
        if role is Role.TRAIN and now is not None:
            self._trained = (now, replicas)
        acc = self._acc.setdefault(role, [0.0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += tokens
        acc[2] = max(acc[2], tokens)
        acc[3] += prompt_tokens
        self._lengths.setdefault(role, []).append(tokens)

    def profile(
        self, now: float, mode: str, predicted_s: float, costs: ShiftCostModel
    ) -> IterationProfile | None:
        """The profile of the iteration that ends `now` (None before the first one began)."""
        if self.started_at is None:
            return None
        roles = {
            r: RoleProfile(
                int(a[0]), a[1] / a[0], a[2], tail_lengths(np.asarray(self._lengths.get(r, ()), dtype=float)),
                a[3] / a[0],
            )
            for r, a in self._acc.items()
            if a[0] > 0
        }
        shift = {r: shift_in(costs, r) for r in PIPELINE}
        sync = None
        if self._trained is not None and self._trained[1] > 0:
            sync = SyncSample(max(0.0, now - self._trained[0]), self._trained[1])
        return IterationProfile(self.iteration, now - self.started_at, mode, predicted_s, roles, shift, sync)


def shift_in(costs: ShiftCostModel, role: Role) -> float:
    """Mean seconds for a device of another role to take up `role` (free placements are not shifts)."""
    others = [d for d in PIPELINE if d is not role]
    return sum(costs.duration(d, role) for d in others) / len(others)


def stages(
    state: ClusterState, costs: ShiftCostModel, last: IterationProfile | None
) -> dict[Role, Stage] | None:
    """The iteration's work per role: from the `IterationPlan` and the priors, or — once an iteration was
    measured — its measured lengths (mean, tail and longest) per role. None without a plan."""
    plan = state.plan
    if plan is None or not all(r in state.roles for r in PIPELINE):
        return None
    n = float(plan.rollout_seqs)
    item = plan.train_tokens_per_item
    means = {
        Role.ROLLOUT: plan.rollout_tokens_per_seq,
        Role.REWARD: plan.reward_tokens_per_rollout,
        Role.TRAIN: item,
    }
    longest = {r: v * (PRIOR_LONGEST_OVER_MEAN if r is not Role.TRAIN else 1.0) for r, v in means.items()}
    if plan.rollout_tokens_longest > 0:
        longest[Role.ROLLOUT] = plan.rollout_tokens_longest
    if plan.reward_tokens_longest > 0:
        longest[Role.REWARD] = plan.reward_tokens_longest
    tails: dict[Role, tuple[float, ...]] = {
        Role.ROLLOUT: plan.rollout_tokens_tail,
        Role.REWARD: plan.reward_tokens_tail,
        Role.TRAIN: (),
    }
    prompts = {
        Role.ROLLOUT: plan.rollout_prompt_tokens,
        Role.REWARD: plan.reward_prompt_tokens,
        Role.TRAIN: 0.0,
    }
    if last is not None:
        for r, p in last.roles.items():
            if p.count > 0:
                means[r], longest[r] = p.mean_tokens, p.max_tokens
                if r is not Role.TRAIN:
                    tails[r] = p.tail
                    if p.prompt_mean > 0:
                        prompts[r] = p.prompt_mean
    ctx = {
        Role.ROLLOUT: prompts[Role.ROLLOUT] + means[Role.ROLLOUT],
        Role.REWARD: max(prompts[Role.REWARD], means[Role.ROLLOUT]) + means[Role.REWARD],
        Role.TRAIN: 0.0,
    }
    out = {}
    for r in PIPELINE:
        spec = state.config.spec(r)
        fixed, shared = spec.sync_fixed_s, spec.sync_shared_s
        if r is Role.TRAIN and last is not None and last.sync is not None:
            fixed, shared = learned_sync(fixed, shared, last.sync)
        model = state.role_models[r]
        cap = float(spec.max_seqs)
        if ctx[r] > 0:
            cap = max(1.0, min(cap, math.floor(spec.kv_tokens / ctx[r])))
        rate = spec.prefill_tokens_per_s
        pre = prompts[r] / rate if r is not Role.TRAIN and rate > 0 else 0.0
        out[r] = Stage(
            r,
            spec.devices_per_replica,
            n,
            max(means[r], 1.0),
            max(longest[r], 1.0),
            model.a,
            model.b,
            model.tokens_per_seq_step if r is not Role.TRAIN else max(means[r], 1.0),
            cap,
            shift_in(costs, r),
            r is not Role.TRAIN,
            pre,
            tails[r] if len(tails[r]) == len(TAIL_FRACTIONS) else (),
            max(int(plan.group_size), 1),
            fixed,
            shared,
            spec.dp_efficiency_per_doubling,
            dp_ref(state, r),
        )
        if spec.step_context_s > 0.0 and out[r].decode:
            out[r] = at_context(out[r], model, prompts[r])
    return out


def at_context(stage: Stage, model: ThroughputModel, prompt_tokens: float) -> Stage:
    """`stage` with its step line (`model`'s, at its reference context per row) moved to the context its
    own lengths give (`ThroughputModel.b_at`): the prompt plus the mean position of a decoded token
    (`Stage.mean_position`). Where lengths vary, a decoded token's context is its item's prompt plus far
    more than half the mean length (long items decode most of the tokens), so a line held at half the
    mean prices a long-tailed rollout stage fast: random draw 36 (lognormal, σ 0.91) ended its rollouts at
    70 s in the model against 79 s in the simulator, and the model ranked the splits the other way."""
    return replace(stage, b=model.b_at(prompt_tokens + stage.mean_position()))


def dp_ref(state: ClusterState, role: Role) -> float:
    """The replica count `role`'s step-time line holds at: one replica for the prior, else the replicas
    the role has now, those that measured the line's latest (most weighted) samples."""
    if state.role_models[role].samples == 0:
        return 1.0
    return float(max(len(state.by_role[role]), 1))


def learned_sync(fixed: float, shared: float, sample: SyncSample) -> tuple[float, float]:
    """The sync prior (fixed + shared / m) rescaled to pass through the measured sample; with no prior,
    the sample as a fixed cost (one measurement cannot tell the shared part from the fixed one)."""
    prior = fixed + shared / max(sample.replicas, 1)
    if prior <= 1e-12:
        return sample.seconds, 0.0
    k = sample.seconds / prior
    return fixed * k, shared * k


@dataclass(frozen=True)
class IterationChoice:
    """The plan chosen for an iteration, with every plan's prediction (seconds) for the log."""

    mode: str
    predicted_s: dict[str, float]
    static_split: dict[Role, int] | None
    scale: float
    first_stage_alone_s: float = 0.0  # predicted end of the first stage with every device on it
    handoff_s: float = 0.0  # mean seconds for a device to take up a downstream role
    first_work_s: dict[Role, float] = field(default_factory=dict)  # a role's first item, on the split
    half_work_s: dict[Role, float] = field(default_factory=dict)  # half of a role's items, on the split
    loan_pays: bool = True  # the split opened with its idle downstream devices lent is predicted faster

    def split_beats_planner(self) -> bool:
        """The static split's own prediction is below the tick planner's once the planner's measured record
        is applied to it: `scale` is what the last iteration took over what its plan was predicted (the
        planner's, as it ran), and the dynamic prediction is a fluid bound the planner reached only
        1/1.17–1/2.7 of on the random draws, while the static model picks a split within a few percent
        of the best one simulated. One shared scale hides that difference. Within `PLANNER_MARGIN` the
        split wins: it moves nothing."""
        return (self.predicted_s["static"] / max(self.scale, 1e-12)
                < self.predicted_s["dynamic"] * (1.0 + PLANNER_MARGIN))

    def opens_colocated(self) -> bool:
        """Is colocated predicted faster than the best static split? Then the iteration opens with every
        device on the first stage, as colocated does. Both predictions come from the same stage model and
        share the scale, so their ranking is the model's most reliable one; the dynamic prediction, a
        fluid bound, takes no part."""
        return self.predicted_s["colocated"] < self.predicted_s["static"]

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
    state: ClusterState, costs: ShiftCostModel, last: IterationProfile | None,
    st: dict[Role, Stage] | None = None,
) -> IterationChoice | None:
    """Predict every plan for the coming iteration and pick the fastest. Ties go to `static` (stay still),
    then `dynamic`. Moving to the static split from the current allocation costs its moved devices' shift
    time, spread over the cluster. The scale is the last iteration's measured/predicted makespan. `st`: the
    iteration's `stages`, where the caller has built them already."""
    if st is None:
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
        t_static = moved_makespan(st, split, placed, t_static)
        if all(placed[r] >= st[r].g for r in PIPELINE):
            # "stay as you are" is a static split too, and it costs no shift: held unless the predicted
            # split beats it with its moves paid, by `HOLD_MARGIN`: a cold move into a short first stage
            # arrives after most of that stage is done (docs/decisions.md, "A first placement is no shift")
            held = {r: np.asarray([float(placed[r] // st[r].g)]) for r in PIPELINE}
            t_held = float(static_makespans(st, held)[0])
            if t_held * (1.0 - HOLD_MARGIN) <= t_static:
                split, t_static = {r: placed[r] // st[r].g * st[r].g for r in PIPELINE}, t_held
    pred = {
        "static": t_static,
        "dynamic": dynamic_makespan(st, n, split, placed=sum(placed.values()) > 0),
        "colocated": colocated_makespan(st, n),
    }
    scale = 1.0
    if last is not None and last.predicted_s > 0 and last.makespan_s > 0:
        scale = last.makespan_s / last.predicted_s
    mode = min(MODES, key=lambda m: (pred[m], MODES.index(m)))
    first = st[PIPELINE[0]]
    _, alone = first.timing(np.asarray(float(max(n // first.g, 1))))
    handoff = sum(st[r].shift_s for r in PIPELINE[1:]) / (len(PIPELINE) - 1)
    first_work = work_arrives(st, split)
    opening = lent_split(split, first_work, state.config.cooldown_s + handoff, {r: st[r].g for r in PIPELINE})
    loan_pays = loaned_makespan(st, split, opening, first_work, t_static) < t_static
    return IterationChoice(mode, {m: v * scale for m, v in pred.items()}, split, scale, float(alone), handoff,
                           first_work, work_arrives(st, split, 0.5), loan_pays)


