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

#: Fractions f at which a length profile holds the length exceeded by a fraction f of the items. With the
#: longest item they describe where a stage's tail is: the items that end a stage are the long ones that
#: started late, and those are counted per fraction (`Stage.points`). The two above the median say when
#: the short items end: with every item in one batch, nine tenths are still running until the shortest
#: tenth is decoded, not a tenth of the drain in (`Stage.emitted`).
TAIL_FRACTIONS = (0.9, 0.75, 0.5, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001, 3e-4, 1e-4, 3e-5, 1e-5)
MEDIAN = TAIL_FRACTIONS.index(0.5)

#: Fractions of an iteration's groups still incomplete at which the train stage's backlog is checked.
GROUP_FRACTIONS = (0.99, 0.95, 0.9, 0.75, 0.5, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001)

MODES = ("static", "dynamic", "colocated")

#: Time steps of `Stage.last_end`'s integral (its error is under half a step of the stage's span).
LAST_END_STEPS = 48


@dataclass(frozen=True)
class RoleProfile:
    """One role's measured work in one iteration: finished items, their mean and longest length (tokens),
    the lengths at `TAIL_FRACTIONS` (empty when not measured) and the mean prompt tokens an item prefilled."""

    count: int
    mean_tokens: float
    max_tokens: float
    tail: tuple[float, ...] = ()
    prompt_mean: float = 0.0


def tail_lengths(lengths: np.ndarray) -> tuple[float, ...]:
    """The lengths exceeded by each of `TAIL_FRACTIONS` of `lengths` (empty for no lengths)."""
    if lengths.size == 0:
        return ()
    q = np.quantile(lengths, [1.0 - f for f in TAIL_FRACTIONS])
    return tuple(float(x) for x in q)


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
    prefill_s: float = 0.0  # seconds one replica pauses to prefill one item's prompt
    tail: tuple[float, ...] = ()  # lengths at TAIL_FRACTIONS (empty: only the mean and the longest known)
    group: int = 1  # items per group (the train stage's items arrive by whole groups)
    sync_fixed_s: float = 0.0  # after the stage's last item: sync(m) = fixed + shared / m (`RoleSpec`)
    sync_shared_s: float = 0.0

    def step(self, conc: np.ndarray) -> np.ndarray:
        return self.a + self.b * self.k * conc

    def sync(self, m: np.ndarray) -> np.ndarray:
        """Seconds between the stage's last item and the next iteration with `m` replicas."""
        return self.sync_fixed_s + self.sync_shared_s / np.maximum(np.asarray(m, dtype=float), 1.0)

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(f, length): a fraction f of the items is at least `length` long, for the tail fractions that
        hold at least one item, down to the longest (f = 1 / seqs)."""
        n = max(self.seqs, 1.0)
        known = zip(TAIL_FRACTIONS, self.tail) if self.tail else [(0.5, self.mean)]
        fs, ls = [], []
        for f, x in known:
            if f * n > 1.0:
                fs.append(f)
                ls.append(x)
        fs.append(1.0 / n)
        ls.append(self.longest)
        return np.asarray(fs), np.maximum.accumulate(np.asarray(ls, dtype=float))

    def length_at(self, f: np.ndarray) -> np.ndarray:
        """The length exceeded by a fraction `f` of the items (log-interpolated between the points)."""
        fs, ls = self.points()
        x = np.log(np.clip(f, fs[-1], 1.0))
        return np.interp(-x, -np.log(fs), ls)

    def _batch(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = np.maximum(np.asarray(m, dtype=float), 1e-12)
        per = np.maximum(self.seqs / m, 1.0)  # items per replica
        conc = np.minimum(self.cap, per)
        return per, conc, self.step(conc)

    def timing(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(drain time of all its work, end time of its last item) with `m` replicas, items spread evenly
        and all available at once.

        Drain: every item's tokens at the full batch's rate, plus each item's prompt prefill, which pauses
        its replica (`prefill_s`). The items past the first batch start while the queue drains (the queued
        part of the drain, `q`); of the f·n items at least `length_at(f)` long, the last starts at about
        q·(1 − 1/(f·n + 1)) and then takes one step per token at the full batch's step time, after the
        first batch's prefill. A stage ends with its drain or with the latest of those (for the longest
        item alone: halfway through the queued part, as measured on the paper reconstruction's rollout).
        """
        per, conc, step = self._batch(m)
        m = np.maximum(np.asarray(m, dtype=float), 1e-12)
        rate = np.minimum(m, max(self.seqs, 1.0)) * conc * self.k / step  # work per second
        drain = self.seqs * self.mean / np.maximum(rate, 1e-300)  # tokens over tokens/s
        if not self.decode:
            return drain, drain + step
        drain = drain + per * self.prefill_s
        q = np.maximum(0.0, 1.0 - conc / per) * drain
        first = conc * self.prefill_s
        end = drain
        fs, ls = self.points()
        n = max(self.seqs, 1.0)
        for f, length in zip(fs, ls):
            start = q * (1.0 - 1.0 / (f * n + 1.0))
            end = np.maximum(end, start + self.run_s(start, length, drain, per, conc) + first)
        return drain, end

    def run_s(self, start: np.ndarray, length: float | np.ndarray, drain: np.ndarray, per: np.ndarray,
              conc: np.ndarray) -> np.ndarray:
        """Seconds an item of `length` tokens takes from `start` on a replica that drains its `per` items
        in `drain` seconds. With step = a + b·x, any span of steps takes a·steps + b·(tokens decoded in
        it): the item's `length` steps, and the tokens its batch decodes meanwhile — at most a full batch
        per step, and no more than the replica has left at `start` (a long item that outlives its batch
        runs alone at the short step of a small batch, where a full batch's step would price its tail
        ~25 % slow)."""
        left = per * self.mean * np.maximum(0.0, 1.0 - start / np.maximum(drain, 1e-12))
        return self.run_with(left, length, conc)

    def run_with(self, left: np.ndarray, length: float | np.ndarray, conc: np.ndarray) -> np.ndarray:
        """Seconds an item of `length` tokens takes on a replica with `left` tokens of other work to do
        meanwhile, in batches of at most `conc` (`run_s`)."""
        work = np.minimum(conc * length, np.maximum(length, left))
        return self.a * length + self.b * self.k * work

    def max_length_within(self, seconds: np.ndarray, left: np.ndarray, conc: np.ndarray) -> np.ndarray:
        """The longest item `run_with` finishes within `seconds` (its inverse: the run is piecewise linear
        and increasing in the length)."""
        a, bk = self.a, self.b * self.k
        x = np.maximum(seconds, 0.0)
        batched = x / (a + bk * conc)  # the batch decodes beside it all along
        outlived = (x - bk * left) / a  # the replica's other work ends before it
        alone = x / (a + bk)  # longer than all the other work: the rest of it runs alone
        return np.where(batched * conc <= left, batched, np.where(outlived <= left, outlived, alone))

    def longer_than(self, length: np.ndarray) -> np.ndarray:
        """The fraction of items longer than `length` (`length_at`'s inverse; linear from 1 at length 0
        to the first point, 0 from the longest on)."""
        fs, ls = self.points()
        x = np.asarray(length, dtype=float)
        f = np.exp(np.interp(x, ls, np.log(fs)))
        below = 1.0 - (1.0 - fs[0]) * np.clip(x / max(float(ls[0]), 1e-12), 0.0, 1.0)
        return np.where(x >= ls[-1], 0.0, np.where(x < ls[0], below, f))

    def emitted(self, m: np.ndarray, f: float) -> np.ndarray:
        """When all but a fraction `f` of the items have ended (the f·n last to end are still running): the
        drain's share of them, or, for each point (fp, length) with fp ≥ f, the (f·n)-th latest start
        among the fp·n items at least `length` long (q·(1 − f·n / (fp·n + 1)), starts uniform over the
        queued part q) plus its run (`run_s`). f = 1/n gives `timing`'s end."""
        drain, _ = self.timing(m)
        per, conc, _ = self._batch(m)
        return self._emitted(f, drain, per, conc)

    def emissions(self, m: np.ndarray) -> dict[float, np.ndarray]:
        """`emitted` at each of the stage's length points: the upstream curve `after` takes."""
        drain, _ = self.timing(m)
        per, conc, _ = self._batch(m)
        fs, _ = self.points()
        return {float(f): self._emitted(float(f), drain, per, conc) for f in fs}

    def _emitted(self, f: float, drain: np.ndarray, per: np.ndarray, conc: np.ndarray) -> np.ndarray:
        if f * max(self.seqs, 1.0) <= 1.0 + 1e-9:
            f = 0.0  # the last item: the whole drain
        if not self.decode:
            return drain * (1.0 - f)
        q = np.maximum(0.0, 1.0 - conc / per) * drain
        n = max(self.seqs, 1.0)
        out = drain * (1.0 - f)
        fs, ls = self.points()
        for fp, length in zip(fs, ls):
            if fp * n >= f * n - 1e-9:
                start = q * np.maximum(0.0, 1.0 - max(f * n, 1.0) / (fp * n + 1.0))
                run = self.run_s(start, length, drain, per, conc)
                out = np.maximum(out, start + run + conc * self.prefill_s)
        return out

    def after(self, up_emitted: dict[float, np.ndarray], m: np.ndarray, f: float) -> np.ndarray:
        """When all but a fraction `f` of this stage's items have ended, its items arriving as the upstream
        stage ends them (`up_emitted`: upstream fraction fa -> when all but fa of them have ended): of the
        fa·n last to arrive, a fraction f/fa is at least `length_at(f/fa)` long and runs after its
        prefill, beside the work that arrives with it or later (fa of the replica's, not what the replica
        would have left had all of it been there from the start), and after the prefills of the items
        arriving with it (half of them, on average, go first: a burst of arrivals pauses the replica once
        per prompt). Nor can the fa·n items be done sooner than their share of the drain after their
        arrival begins. Never before its own emission with every item available."""
        drain, _ = self.timing(m)
        per, conc, _ = self._batch(m)
        own = self._emitted(f, drain, per, conc)
        for fa, t in up_emitted.items():
            if fa >= f:
                length = self.length_at(np.asarray(f / fa))
                left = fa * per * self.mean
                prefill = self.prefill_s * (1.0 + 0.5 * fa * per)
                own = np.maximum(own, t + self.run_with(left, length, conc) + prefill)
                own = np.maximum(own, t + (fa - f) * drain)
        return own

    def last_end(self, up_emitted: dict[float, np.ndarray], m: np.ndarray, exact: bool = True) -> np.ndarray:
        """When this stage's last item ends, its items arriving on the upstream curve in an order that has
        nothing to do with their own lengths (a judgement's length does not depend on when its rollout
        ended).

        The stage ends at max_i (arrival_i + run_i). `after` pairs each arrival window with the longest
        item it is expected to hold, as if that item came first in its window; so it hardly sees how late
        the upstream stage runs. Here the expected number of items still running at T (each arrival bin's
        count times the fraction of lengths that would not be done by T) is E(T), the chance that none is
        exp(−E(T)) (Poisson), and the expected end is the integral of 1 − exp(−E) over T. Never before the
        longest item itself, arriving at the mean arrival time: that alone with `exact=False` (cheap, and
        never above the full value)."""
        n = max(self.seqs, 1.0)
        per, conc, _ = self._batch(m)
        fas = sorted(up_emitted, reverse=True)
        bins: list[tuple[float, np.ndarray, float]] = []  # (items, arrival time, fraction still to come)
        prev_f, prev_t = 1.0, np.zeros(np.shape(up_emitted[fas[0]]))
        for fa in fas:
            t = np.asarray(up_emitted[fa], dtype=float)
            bins.append(((prev_f - fa) * n, 0.5 * (prev_t + t), prev_f))
            prev_f, prev_t = fa, t
        bins.append((prev_f * n, prev_t, prev_f))
        longest_run = self.run_with(0.5 * per * self.mean, self.longest, conc)
        arrival = sum(count * t for count, t, _ in bins) / n
        longest_end = arrival + self.prefill_s * (1.0 + 0.25 * per) + longest_run
        if not exact:
            return longest_end
        hi = prev_t + self.prefill_s * (1.0 + 0.5 * per) + self.run_with(per * self.mean, self.longest, conc)
        dt = hi / LAST_END_STEPS
        end = np.zeros(np.shape(hi))
        for k in range(LAST_END_STEPS):
            horizon = (k + 0.5) * dt
            running = np.zeros(np.shape(hi))
            for count, t, fa in bins:
                budget = horizon - t - self.prefill_s * (1.0 + 0.5 * fa * per)
                done_by = self.max_length_within(budget, fa * per * self.mean, conc)
                running = running + count * np.where(budget > 0.0, self.longer_than(done_by), 1.0)
            end = end + (1.0 - np.exp(-running)) * dt
        return np.maximum(end, longest_end)

    def last_item_s(self) -> float:
        """An item started alone after its upstream finished (the tail end of the chain)."""
        one = float(self.step(np.asarray(1.0)))
        return self.mean * one + self.prefill_s if self.decode else one

    def peak_weight(self) -> float:
        """Device-seconds per unit of work at full batch."""
        return self.g * float(self.step(np.asarray(self.cap))) / (self.cap * self.k)

    def work_device_s(self) -> float:
        """Device-seconds of the stage's whole work at full batch, prefill included."""
        return self.seqs * (self.mean * self.peak_weight() + self.g * self.prefill_s)


def stages(
    state: ClusterState, costs: ShiftCostModel, last: IterationProfile | None
) -> dict[Role, Stage] | None:
    """The iteration's work per role: from the `IterationPlan` and the priors, or — once an iteration was
    measured — its measured lengths (mean, tail and longest) per role. None without a plan."""
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
            model.tokens_per_seq_step,
            cap,
            shift_in(costs, r),
            r is not Role.TRAIN,
            pre,
            tails[r] if len(tails[r]) == len(TAIL_FRACTIONS) else (),
            max(int(plan.group_size), 1),
            fixed,
            shared,
        )
    return out


def learned_sync(fixed: float, shared: float, sample: SyncSample) -> tuple[float, float]:
    """The sync prior (fixed + shared / m) rescaled to pass through the measured sample; with no prior,
    the sample as a fixed cost (one measurement cannot tell the shared part from the fixed one)."""
    prior = fixed + shared / max(sample.replicas, 1)
    if prior <= 1e-12:
        return sample.seconds, 0.0
    k = sample.seconds / prior
    return fixed * k, shared * k


def static_makespans(
    st: dict[Role, Stage], reps: dict[Role, np.ndarray], last_end: bool = True
) -> np.ndarray:
    """Predicted makespan of a streaming static split (replicas per role, arrays of equal shape).

    The first stage ends its items by `Stage.emitted`; the second ends each of its tail fractions after the
    matching part of the first (`Stage.after`), and its last item no sooner than `Stage.last_end` says.
    Train items arrive by groups: a group is complete when its slowest member is judged. Two views of when
    a fraction fg of the groups is still incomplete, the later one counts: members submitted together end
    together, `group_lag` after their typical member, i.e. a lag after fg of the judgements remain; or
    members end independently, and a group is complete once all G are, i.e. when only 1 − (1 − fg)^(1/G)
    of the judgements remain (with long-tailed judgements nearly every large group waits for one of the
    last). Train then still has fg of its work to drain. Train ends with the latest of those, its own
    drain, and one step after the last judgement; then it syncs (`Stage.sync`).

    `last_end=False` takes only the cheap part of `Stage.last_end`: never above the full prediction, so
    it bounds a search from below (`best_static`)."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    m_ro, m_rw, m_tr = (np.asarray(reps[r], dtype=float) for r in PIPELINE)
    n = max(ro.seqs, 1.0)
    up = ro.emissions(m_ro)
    t_rw = np.maximum(rw.after(up, m_rw, 1.0 / n), rw.timing(m_rw)[1])
    t_rw = np.maximum(t_rw, rw.last_end(up, m_rw, exact=last_end))
    drain_tr, e_tr = tr.timing(m_tr)
    end = np.maximum(e_tr, t_rw + tr.last_item_s())
    g = max(tr.group, 1)
    groups = max(n / g, 1.0)
    lag = group_lag(ro, rw, m_ro, m_rw, g)
    for fg in GROUP_FRACTIONS:
        if fg * groups < 1.0:
            break
        independent = max(1.0 - (1.0 - fg) ** (1.0 / g), 1.0 / n)
        complete = np.maximum(rw.after(up, m_rw, fg) + lag, rw.after(up, m_rw, independent))
        end = np.maximum(end, complete + fg * drain_tr)
    return end + tr.sync(m_tr)


def group_lag(ro: Stage, rw: Stage, m_ro: np.ndarray, m_rw: np.ndarray, g: int) -> np.ndarray:
    """Seconds by which a group of `g` items completes after its typical (median) member: its members start
    together, so it waits for the longest of g rollouts and of g judgements, about the lengths exceeded by
    1/(g + 1) of the items, each at its stage's step. 0 for single items and for constant lengths, where a
    group ends with its members (a model that lets members end in random order would keep train waiting
    for nearly all judgements: 0.97 of a perfect static split's speed in tests/sim/test_sanity.py)."""
    shape = np.broadcast(np.asarray(m_ro), np.asarray(m_rw)).shape
    if g <= 1:
        return np.zeros(shape)
    q = np.asarray(1.0 / (g + 1.0))
    half = np.asarray(0.5)
    lag = np.zeros(shape)
    for s, m in ((ro, m_ro), (rw, m_rw)):
        _, _, step = s._batch(m)
        lag = lag + np.maximum(s.length_at(q) - s.length_at(half), 0.0) * step
    return lag


def best_static(st: dict[Role, Stage], n_devices: int) -> tuple[dict[Role, int], float] | None:
    """The split (devices per role) with the lowest predicted makespan, exhaustive over every split into
    whole replicas (numpy over the (rollout, reward) grid; train takes what is left). None if none fits.

    Exact but cheap: every split is priced without `Stage.last_end`'s integral (a lower bound), then the full
    prediction is computed for the splits in order of that bound, a batch at a time, until the best full
    prediction is no worse than the next bound."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    a = np.arange(1, n_devices // ro.g + 1)
    b = np.arange(1, n_devices // rw.g + 1)
    aa, bb = np.meshgrid(a, b, indexing="ij")
    left = n_devices - aa * ro.g - bb * rw.g
    cc = left // tr.g
    ok = cc >= 1
    if not ok.any():
        return None
    reps = {Role.ROLLOUT: aa[ok], Role.REWARD: bb[ok], Role.TRAIN: cc[ok]}
    i, t = ranked(st, reps, 1)[0]
    split = {r: int(reps[r][i]) * st[r].g for r in PIPELINE}
    return split, t


def ranked(st: dict[Role, Stage], reps: dict[Role, np.ndarray], k: int,
           batch: int = 512) -> list[tuple[int, float]]:
    """The `k` splits of `reps` (replicas per role, 1-d arrays) with the lowest full `static_makespans`,
    best first, as (index, prediction): the bound-ordered search `best_static` describes."""
    bound = static_makespans(st, reps, last_end=False)
    order = np.argsort(bound, kind="stable")
    found: list[tuple[float, int]] = []
    for lo in range(0, order.size, batch):
        idx = order[lo : lo + batch]
        if len(found) >= k and found[k - 1][0] <= bound[idx[0]]:
            break
        full = static_makespans(st, {r: v[idx] for r, v in reps.items()})
        found = sorted(found + [(float(x), int(j)) for x, j in zip(full, idx)])[:k]
    return [(j, x) for x, j in found]


def colocated_makespan(st: dict[Role, Stage], n_devices: int) -> float:
    """Every stage alone on the whole cluster in turn, one full-cluster shift before each."""
    total = 0.0
    for s in st.values():
        m = np.asarray(float(max(n_devices // s.g, 1)))
        _, end = s.timing(m)
        total += float(end) + s.shift_s + float(s.sync(m))
    return total


def dynamic_makespan(st: dict[Role, Stage], n_devices: int, static_split: dict[Role, int] | None) -> float:
    """The tick planner at its best: the fluid time plus the shifts its devices make (every device outside
    the first stage's best static share goes there and back, once each per iteration), never below the
    chain of the longest rollout at full batch, one judgement and one train step."""
    fluid = sum(s.work_device_s() for s in st.values()) / n_devices
    first = st[PIPELINE[0]]
    share = (static_split or {}).get(PIPELINE[0], n_devices) / n_devices
    mean_shift = sum(s.shift_s for s in st.values()) / len(st)
    moving = 2.0 * mean_shift * (1.0 - share)
    _, l_ro = first.timing(np.asarray(float(max(n_devices // first.g, 1))))
    chain = float(l_ro) + st[Role.REWARD].last_item_s() + st[Role.TRAIN].last_item_s()
    tr = st[Role.TRAIN]
    sync = float(tr.sync(np.asarray(float(max((static_split or {}).get(Role.TRAIN, n_devices) // tr.g, 1)))))
    return max(fluid + moving, chain) + sync


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
        t_static = moved_makespan(st, split, placed, t_static)
        if all(placed[r] >= st[r].g for r in PIPELINE):
            # "stay as you are" is a static split too, and it costs no shift: held unless the predicted
            # split beats it with its moves paid (a cold move into the first stage at an iteration start
            # made its replicas arrive after most of that stage was done: 0.96 of the held split, seed 37)
            held = {r: np.asarray([float(placed[r] // st[r].g)]) for r in PIPELINE}
            t_held = float(static_makespans(st, held)[0])
            if t_held <= t_static:
                split, t_static = {r: placed[r] // st[r].g * st[r].g for r in PIPELINE}, t_held
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
    return IterationChoice(mode, {m: v * scale for m, v in pred.items()}, split, scale, float(alone), handoff,
                           first_work(st, split))


def moved_makespan(st: dict[Role, Stage], split: dict[Role, int], placed: dict[Role, int],
                   t_split: float) -> float:
    """The predicted makespan of `split` (`t_split` when in place) reached from `placed` (devices per
    role): a replica moved into a role works only after its shift, so over the role's predicted span it
    counts as 1 − shift / span of a replica (none when the shift outlasts the span: a cold shift into a
    short first stage arrives after it)."""
    reps = {r: float(split[r] // st[r].g) for r in PIPELINE}
    first = st[PIPELINE[0]]
    spans = {r: t_split for r in PIPELINE}
    spans[PIPELINE[0]] = float(first.timing(np.asarray(reps[PIPELINE[0]]))[1])
    eff = {}
    for r in PIPELINE:
        moved_in = max(split[r] - placed[r], 0) // st[r].g
        late = min(1.0, st[r].shift_s / max(spans[r], 1e-12))
        eff[r] = np.asarray([max(reps[r] - moved_in * late, 1e-3)])
    return max(t_split, float(static_makespans(st, eff)[0]))


def first_work(st: dict[Role, Stage], split: dict[Role, int]) -> dict[Role, float]:
    """When each downstream role gets its first item on `split`: reward with the first finished rollout,
    train with the first complete group (all of its G members judged)."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    m = {r: np.asarray(float(max(split[r] // st[r].g, 1))) for r in PIPELINE}
    n = max(ro.seqs, 1.0)
    up = ro.emissions(m[Role.ROLLOUT])
    first_rollout = 1.0 - 1.0 / n
    groups = max(n / max(tr.group, 1), 1.0)
    # the first group completes a group lag after the first of its members is judged (`static_makespans`)
    lag = group_lag(ro, rw, m[Role.ROLLOUT], m[Role.REWARD], max(tr.group, 1))
    first_group = max(1.0 - 1.0 / groups, 1.0 / n)
    return {
        Role.REWARD: float(ro.emitted(m[Role.ROLLOUT], first_rollout)),
        Role.TRAIN: float(rw.after(up, m[Role.REWARD], first_group) + lag),
    }
