"""What the planner reads of each role, and the donor rules (DESIGN §4 steps 1-2).

`RoleView` holds one role's aggregates at planning time and its throughput/processed-work model over a
replica count; `keep_limit` says how many replicas a role may give up. Split from `planner` so each module
has one responsibility: this one *describes* the roles, `planner` *chooses* a shift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pivotrl.core.state import ClusterState
from pivotrl.core.tail_migration import Residual, left_tokens
from pivotrl.core.types import PIPELINE, IterationPlan, Replica, ReplicaState, Role


@dataclass(frozen=True)
class RoleView:
    """Aggregates of one role at planning time (all O(1) reads of the state, plus O(I_r) for rates)."""

    role: Role
    g: int
    replicas: int          # active + shifting (shifting ones will serve soon)
    rate: float            # Σ f_i(n_i) over active replicas, tokens/s
    seqs: float            # live sequences (waiting + running)
    work: float            # expected remaining tokens of live sequences
    arriving_seqs: float   # sequences upstream will hand over within H
    arriving_work: float   # their tokens
    a: float
    b: float
    k: float               # work per sequence per step (1 for decode)
    cap: float             # sequences per replica (slots, and KV at the role's mean footprint)
    weight: float          # device-seconds per token at peak
    horizon: float
    donated: int = 0       # replicas this role gave up in shifts within the last cooldown_s
    done: bool = False     # no live work and none can still reach it this iteration (idle until the next)
    longest_left: float = 0.0  # tokens the iteration's longest item may still need (`_longest_left`)
    item_s: float = 0.0    # seconds the iteration's longest item spends in this role (`_longest_left`)

    def throughput(self, m: float) -> float:
        """Tokens/s of `m` replicas holding this role's sequences, spread evenly (role-shared fit)."""
        n = self.seqs + self.arriving_seqs
        if m <= 0 or n <= 0:
            return 0.0
        busy = min(m, n)
        conc = min(self.cap, n / busy)
        x = conc * self.k
        return busy * x / (self.a + self.b * x)

    def step_many(self, ms: np.ndarray) -> np.ndarray:
        """Engine step time with the role's sequences spread evenly over `ms` replicas."""
        n = self.seqs + self.arriving_seqs
        busy = np.minimum(ms.astype(float), n)
        conc = np.where(busy > 0, np.minimum(self.cap, n / np.maximum(busy, 1e-12)), 0.0)
        return self.a + self.b * conc * self.k

    def throughput_many(self, ms: np.ndarray) -> np.ndarray:
        n = self.seqs + self.arriving_seqs
        ms = ms.astype(float)
        if n <= 0:
            return np.zeros_like(ms)
        busy = np.minimum(ms, n)
        conc = np.minimum(self.cap, n / np.maximum(busy, 1e-12))
        x = conc * self.k
        return np.where(ms > 0, busy * x / (self.a + self.b * x), 0.0)

    def processed(self, m: float) -> float:
        """Device-seconds of work done over H by `m` replicas, softly capped by the work available.

        W·(1 − exp(−T·H/W)) is the expected work done when the sequences' remaining lengths are spread
        (exponentially) around their mean: ≈ T·H while work is plentiful, → W when it is scarce, and never
        flat before W — so finishing a tail sooner (more replicas, shorter steps) still counts, and packing a
        tail onto fewer replicas is never free. Concave in m, which keeps the DP exact and monotone.
        """
        total = self.work + self.arriving_work
        if total <= 0:
            return 0.0
        return total * -math.expm1(-self.throughput(m) * self.horizon / total) * self.weight

    def processed_many(self, ms: np.ndarray) -> np.ndarray:
        thr = self.throughput_many(ms)
        total = self.work + self.arriving_work
        if total <= 0:
            return np.zeros_like(ms)
        return total * -np.expm1(-thr * self.horizon / total) * self.weight


def rate_now(rep: Replica) -> float:
    """Tokens/s of a replica with its running rows, at the context they hold (`ThroughputModel.b_at`)."""
    if rep.n <= 0:
        return 0.0
    m = rep.model
    x = rep.n * m.tokens_per_seq_step
    return x / (m.a + m.b_at(rep.context / rep.n) * x)


def role_views(state: ClusterState, horizon: float, now: float = 0.0) -> dict[Role, RoleView]:
    cfg = state.config
    base: dict[Role, dict] = {}
    for role in state.roles:
        spec = cfg.spec(role)
        model = state.role_models[role]
        reps = state.by_role[role]
        rate = rows = context = 0.0
        for rep in reps.values():
            if rep.state is ReplicaState.ACTIVE and rep.running:
                rate += rate_now(rep)
                rows += rep.n
                context += rep.context
        # the role's line at the context its rows hold now (a stage's tail of long rows steps slower)
        b = model.b if rows <= 0 else model.b_at(context / rows)
        n = state.n_seqs[role]
        mean_kv = state.kv_sum[role] / n if n else 0.0
        cap = float(spec.max_seqs)
        if mean_kv > 0:
            cap = max(1.0, min(cap, math.floor(spec.kv_tokens / mean_kv)))
        peak = model.rate(spec.max_seqs)
        base[role] = dict(role=role, g=spec.devices_per_replica, replicas=len(reps), rate=rate, seqs=float(n),
                          work=max(state.remaining[role], 0.0), a=model.a, b=b,
                          k=model.tokens_per_seq_step, cap=cap,
                          weight=spec.devices_per_replica / peak if peak > 0 else 0.0, horizon=horizon,
                          donated=state.donated_since(role, now - cfg.cooldown_s))
    _longest_left(state, base, now)
    _add_upstream(state, base, horizon)
    _mark_done(state, base)
    return {r: RoleView(**v) for r, v in base.items()}


def expected_longest(plan: IterationPlan) -> dict[Role, float]:
    """Tokens of the iteration's longest item per generating role: the plan's, else 4 × its mean."""
    return {
        Role.ROLLOUT: plan.rollout_tokens_longest or 4.0 * plan.rollout_tokens_per_seq,
        Role.REWARD: plan.reward_tokens_longest or 4.0 * plan.reward_tokens_per_rollout,
    }


def _longest_left(state: ClusterState, base: dict[Role, dict], now: float) -> None:
    """For each generating role with live work: the tokens its longest item of the iteration may still
    need — the plan's expected longest (4 × the mean without one) less the most any item can have decoded
    since the iteration began (one token per step of at least `a` seconds). On-policy the iteration ends
    with that item, so `critical_delay` prices it; the live items' mean left (854 tokens on a drawn
    workload whose longest rollouts ran ~8,000) let the planner slow a rollout still on the critical path.
    Also, for every generating role (live work or not), `item_s`: that longest item's time on a replica
    of the role's own at batch 1, what the critical path spends there after the item arrives."""
    if state.plan is None:
        return
    for role, most in expected_longest(state.plan).items():
        b = base.get(role)
        if b is None or b["a"] <= 0:
            continue
        b["item_s"] = most * (b["a"] + b["b"] * b["k"])
        if b["seqs"] <= 0:
            continue
        decoded_at_most = max(now - state.iteration_started_at, 0.0) / b["a"]
        b["longest_left"] = max(most - decoded_at_most, 0.0)


def tail_s(state: ClusterState, view: RoleView, residual: Residual | None = None) -> float:
    """Seconds until the longest running item of `view`'s role may end, at the role's step time now (its
    running rows over its rate: seconds per token of one row); 0 where that is unknown (no plan, nothing
    running, or a role that does not generate). That item has the iteration's expected longest length
    (4 × the mean without one) less what the furthest running item has generated, or at least what that
    item's own estimate says is left (`Sequence.remaining_estimate`: past its expected length, half its
    length again, within its budget).

    Why not `longest_left`: that one bounds what an item can have decoded by the time since the iteration
    began, right for rollouts, but a judgement starts when its rollout ends. On random draw 22 the judge's
    last 50 items needed ~24 s at t = 28 s, where the role's work over its rate (τ) said 8 s. Read only
    where `keeps_up` asks, not for every view: it is the one reader.

    `residual`: the role's length profile (`tail_migration.Residual`). Given, the furthest item is expected
    to write what an item of its age writes on that profile (`tail_migration.left_tokens`), not the
    iteration's expected longest less its age: that one assumes the item the iteration ends with is still
    to be told apart, and past its expected length `TAIL_RESIDUAL` gives an item half its age again. On
    random draw 2 (a lognormal judge) both said 19 s with 9 s left, and train, 1.4 s behind the last
    judgement, seemed to keep up. Only `behind_tail` passes it (see there)."""
    if state.plan is None or view.rate <= 0:
        return 0.0
    most = expected_longest(state.plan).get(view.role)
    if most is None:
        return 0.0
    reps = [r for r in state.by_role[view.role].values() if r.state is ReplicaState.ACTIVE and r.running]
    far = [s for s in (r.furthest() for r in reps) if s is not None]
    if not far:
        return 0.0
    lead = max(far, key=lambda s: s.generated)
    if residual is not None:
        left = max(left_tokens(lead, residual), 1.0)
    else:
        left = max(most - lead.generated, lead.remaining_estimate(), 1.0)
    return left * sum(r.n for r in reps) / view.rate


def keeps_up(state: ClusterState, views: dict[Role, RoleView], u: Role, arrive_s: float = 0.0,
             held: bool = False, residual: Residual | None = None) -> bool:
    """Would the last stage `u` drain its work, and an item for each one the stages before it still hold,
    before the longest running item upstream ends, with the replicas it has now?

    Asked once the first stage is done (every rollout submitted and ended): the judge is then in its tail
    (`tail_s`), and train's last item is the one that tail releases, whatever train's replicas. On-policy
    the iteration ends with it, so more train devices would do its work sooner but end nothing sooner, and
    a device moved there comes back for the next iteration. Random draw 22: four judge devices moved to
    train in the judge's tail; train ended 0.2 s after the last judgement either way, and the next
    iteration moved five back at 12 s each. The same test for the judge against the rollouts' tail lost a
    little on two random draws.

    Also asked in the rollouts' own tail (every rollout started, none waiting) for a device that would
    arrive in train (`arrive_s`, the soonest a shift into it ends) after the longest rollout may end: it
    would arrive in the judge's tail, where the test above holds it back. The tail upstream is then the
    later of the judge's own and that rollout's end plus the longest judgement's time on one judge replica
    (`RoleView.item_s`). Random draw 36: two idle rollout devices and a judge device moved to train 2-4 s
    before the last rollouts ended, on 11 s shifts, and came back at the next opening. A device that would
    arrive sooner is left to the planner: on draw 40 rollout devices moved to train 13-17 s before the
    rollouts ended were what train's tail needed (docs/decisions.md, "The last stage waits out a longer
    tail upstream of it").

    `held`: train's work also counts the judged items its groups still hold back (`ClusterState.unreleased`);
    `behind_tail` asks so. Counted in every call, it let train take busy judge devices in the judge's tail
    of iterations whose next opening wanted them back, cold (random draws 101 and 145: 0.9955 → 0.9514
    and 0.9973 → 0.9757).

    `residual`: the upstream role's length profile, for its tail once the first stage is done (`tail_s`)."""
    plan = state.plan
    u_last, up, first = PIPELINE[-1], PIPELINE[-2], PIPELINE[0]
    if plan is None or u is not u_last or state.rollouts_unsubmitted():
        return False
    if any(r not in views for r in PIPELINE):
        return False
    vu, vup, vfirst = views[u], views[up], views[first]
    if vfirst.done:
        tail, upstream = tail_s(state, vup, residual), vup.seqs
    elif len(state.queues[first]) == 0 and vfirst.seqs > 0:
        head = tail_s(state, vfirst)
        if head <= 0.0 or head > arrive_s:
            return False
        tail, upstream = max(tail_s(state, vup), head + vup.item_s), vup.seqs + vfirst.seqs
    else:
        return False
    if tail <= 0.0 or vu.rate <= 0.0:
        return False
    per_item = plan.train_tokens_per_item
    if held:
        upstream += state.unreleased_items
    return (vu.work + upstream * per_item) / vu.rate < tail


def behind_tail(state: ClusterState, views: dict[Role, RoleView],
                residual: Residual | None = None) -> float | None:
    """Once the first stage is done: the seconds until the judge's longest running item may end (`tail_s`)
    where the last stage, at work on replicas of its own, would not drain its work by then (`keeps_up`
    with the held items fails), else None. (A last stage with no replica can only start once devices
    reach it, which the planner already gives it; one with no work running has no rate to drain at.)

    The last stage then holds the iteration up above that floor, as `drain_floor` says of a stage whose
    upstream is done: what it has, what the judge still holds for it (each judged item waits for its
    group) and the judgements to come end the iteration at its drain, later than the judge's tail.
    Random draw 8 (64-item groups): with 10 judgements left, train held 627 judged items for their
    groups; it took its devices only when the last judgement released them, and ended 1.4 s after it,
    against 0.7 s on the best static split.

    `residual`: the judge's length profile, which prices its tail as `tail_s` says. Here, and not in
    every `keeps_up`, because the planner then offers train idle devices only, where no next opening
    wants them back: a tail priced short costs a move nothing needed. Priced short everywhere, train took
    busy judge devices in iteration 0's judge tail and they came back cold (random draws 101: 0.9975 →
    0.9513, 130: 1.0007 → 0.9655)."""
    u, up, first = PIPELINE[-1], PIPELINE[-2], PIPELINE[0]
    if any(r not in views for r in PIPELINE) or not views[first].done or views[up].done:
        return None
    if (views[u].replicas <= 0 or views[u].rate <= 0.0
            or keeps_up(state, views, u, held=True, residual=residual)):
        return None
    tail = tail_s(state, views[up], residual)
    return tail if tail > 0.0 else None


def with_held(state: ClusterState, view: RoleView) -> RoleView:
    """The last stage's `view` with the judged items its groups still hold back (`ClusterState.unreleased`)
    as work arriving: the judge's tail releases them all. Only for `behind_tail`'s drain: elsewhere the
    planner counts work over its horizon, and with that work there train took busy judge devices in the
    middle of the judge's stage (random draw 18: 97 of 115, which the next iteration's judge then lacked)."""
    plan = state.plan
    if plan is None or state.unreleased_items <= 0:
        return view
    per_item = plan.train_tokens_per_item
    return replace(view, arriving_seqs=view.arriving_seqs + state.unreleased_items,
                   arriving_work=view.arriving_work + state.unreleased_items * per_item)


def _mark_done(state: ClusterState, base: dict[Role, dict]) -> None:
    """A role is *done* for the iteration when it and every role upstream of it hold no live sequence and
    every rollout the plan announced was submitted: nothing can reach it before the next iteration starts.
    (Without an `IterationPlan` more rollouts may come at any time: no role is done.)"""
    if state.plan is None or not all(r in base for r in PIPELINE):
        return
    if state.rollouts_unsubmitted():
        return
    for role in PIPELINE:
        if state.has_work(role):
            return
        base[role]["done"] = True


def drain_floor(views: dict[Role, RoleView], u: Role) -> float | None:
    """Seconds of `u`'s drain below which finishing it sooner no longer ends the iteration sooner; None
    where `u` does not hold the iteration up.

    On-policy the next iteration starts once the last role drains. Once every role upstream of `u` is
    done, nothing reaches the roles after it but what it releases, so `u` draining sooner ends the
    iteration sooner (the first stage, with nothing upstream, holds it up while it has work). That holds
    unless a role after it, holding replicas, would take longer to drain
    its own work (live, and arriving within H) at those replicas: that drain is the floor. A role after
    it without a replica sets none, since it can only work once `u` releases devices. Traced on the
    2-device cluster: when the rollouts ended, the free device went to train (no replica, one group),
    not to the judge (one replica, the rest of the judgements), and the judge drained alone: 0.14 s
    slower than colocated in that iteration as simulated from the cluster's profile
    (docs/decisions.md#the-drain-value-of-the-first-role-with-work).
    Without the floor the paper reconstruction lost 1.1 %: the judge took devices while train was
    behind anyway."""
    if u not in PIPELINE:
        return 0.0 if all(v.done for r, v in views.items() if r is not u) else None
    i = PIPELINE.index(u)
    if not all(views[r].done for r in PIPELINE[:i] if r in views):
        return None
    floor = 0.0
    for r in PIPELINE[i + 1:]:
        v = views.get(r)
        if v is None or v.replicas <= 0:
            continue
        thr = v.throughput(v.replicas)
        if thr > 0:
            floor = max(floor, (v.work + v.arriving_work) / thr)
    return floor


def drain_value(vu: RoleView, ks: np.ndarray, n_devices: int, shift_s: float,
                lock_s: float, floor_s: float = 0.0) -> np.ndarray:
    """Value (device-seconds) of `ks` more replicas for `vu` when it holds the iteration up
    (`drain_floor`): on-policy, the next iteration starts only when `vu` drains, so every device of the
    cluster waits on it and finishing `saving` seconds sooner is worth n_devices × saving, where neither
    drain counts below `floor_s` (a downstream role that would drain later anyway). The new replicas
    serve after `shift_s`; a moved device may not move again for `lock_s` after it lands, so what of that
    lock outlasts the drain is charged (it holds the device back from the next iteration's first stage).

    The soft-capped work over H (`processed`) misses this: with the whole drain inside H, one more replica
    adds almost no *work* over H, yet it ends the iteration sooner for everyone."""
    total = vu.work + vu.arriving_work
    before = vu.throughput(vu.replicas)
    if total <= 0 or before <= 0 or total / before <= shift_s:
        return np.zeros(ks.shape)
    tau0 = total / before
    after = shift_s + (total - before * shift_s) / np.maximum(vu.throughput_many(vu.replicas + ks), 1e-300)
    saving = np.maximum(np.maximum(tau0, floor_s) - np.maximum(after, floor_s), 0.0)
    lock = np.maximum(shift_s + lock_s - after, 0.0) * ks * vu.g
    return n_devices * saving - lock


def drain_loss(vd: RoleView, ks: np.ndarray, n_devices: int, floor_s: float) -> np.ndarray:
    """Value (device-seconds) lost when `vd`'s role, holding the iteration up (`drain_floor` gave
    `floor_s`), gives up `ks` replicas: its drain lengthens, and on-policy every device of the cluster
    waits on it, above the floor (a later role that drains later anyway). The mirror of `drain_value`.

    The soft-capped work over H (`processed`) prices a replica of a rollout stage holding 200 sequences
    a replica at 1-3 device-seconds, since the other replicas' batches absorb its sequences. On the paper
    reconstruction, train's first group then took 6 of rollout's 10 devices while rollout still had 34 s
    to drain: rollout ended at 166 s, against 157 s with this loss (docs/decisions.md)."""
    total = vd.work + vd.arriving_work
    before = vd.throughput(vd.replicas)
    if total <= 0 or before <= 0:
        return np.zeros(ks.shape)
    tau0 = max(total / before, floor_s)
    after = total / np.maximum(vd.throughput_many(vd.replicas - ks), 1e-300)
    return n_devices * np.maximum(np.maximum(after, floor_s) - tau0, 0.0)


def _add_upstream(state: ClusterState, base: dict[Role, dict], horizon: float) -> None:
    """Work each role will receive within H from upstream, at the current allocation (pipeline order),
    and the prefill each generating role owes for it and its queue (`_fold_prefill`): a role's
    completions, which feed the next role, are taken at its throughput with that prefill."""
    for v in base.values():
        v["arriving_seqs"] = 0.0
        v["arriving_work"] = 0.0
    plan = state.plan
    if plan is None or not all(r in base for r in PIPELINE):
        for v in base.values():
            _fold_prefill(state, v, 0.0)
        return
    ro, rw, tr = (base[r] for r in PIPELINE)
    unsubmitted = max(plan.rollout_seqs - state.submitted[Role.ROLLOUT], 0)
    ro["arriving_seqs"] = float(unsubmitted)
    ro["arriving_work"] = unsubmitted * plan.rollout_tokens_per_seq
    _fold_prefill(state, ro, plan.rollout_prompt_tokens)

    def completions(v: dict) -> float:
        view = RoleView(**v)
        total_work = view.work + view.arriving_work
        total_seqs = view.seqs + view.arriving_seqs
        if total_work <= 0 or total_seqs <= 0:
            return 0.0
        frac = min(1.0, view.throughput(view.replicas) * horizon / total_work)
        return frac * total_seqs

    done_rollouts = completions(ro)
    rw["arriving_seqs"] = done_rollouts
    rw["arriving_work"] = done_rollouts * plan.reward_tokens_per_rollout
    _fold_prefill(state, rw, plan.reward_prompt_tokens)
    groups = completions(rw) / max(plan.group_size, 1)
    tr_tokens = groups * plan.train_tokens_per_group
    per_item = (tr["work"] / tr["seqs"]) if tr["seqs"] > 0 else plan.train_tokens_per_item
    tr["arriving_work"] = tr_tokens
    tr["arriving_seqs"] = tr_tokens / per_item if per_item > 0 else 0.0


def _fold_prefill(state: ClusterState, v: dict, prompt_tokens: float) -> None:
    """Spread the prompt prefill that `v`'s role still owes over its work, as step seconds per token.

    A prompt's prefill pauses its replica (the engines and the simulator alike), so a role whose queued
    and arriving items still need `P` seconds of prefill over `W` tokens of work decodes as if each token
    in the batch cost `P / W` seconds more: the step line's slope grows from b to b + P/W, and throughput,
    drain times and the work's device-seconds (`weight`, at the full batch) all follow. Queued items owe
    their context (prompt, and what an aborted one generated); arriving ones `prompt_tokens` each (the
    plan's; without one, the mean prompt of the role's items so far). Running items have prefilled.
    Measured on the 2-device cluster: the judge's prefill was about 0.43 s of its ~1 s drain per
    iteration, which the planner's drain times left out (docs/decisions.md)."""
    role = v["role"]
    spec = state.config.spec(role)
    rate = state.role_models[role].prefill_tokens_per_s or spec.prefill_tokens_per_s
    if rate <= 0 or role not in state.queues:
        return
    if prompt_tokens <= 0 and state.submitted[role] > 0:
        prompt_tokens = state.prompt_sum[role] / state.submitted[role]
    owed = (state.queues[role].context_tokens + v["arriving_seqs"] * prompt_tokens) / rate
    total = v["work"] + v["arriving_work"]
    if owed <= 0 or total <= 0:
        return
    v["b"] += owed / total
    x = spec.max_seqs * v["k"]
    v["weight"] = v["g"] * (v["a"] + v["b"] * x) / x if x > 0 else v["weight"]


def tau(views: dict[Role, RoleView]) -> dict[Role, float]:
    out = {}
    for r, v in views.items():
        if v.work <= 0:
            out[r] = 0.0
        elif v.rate <= 0:
            out[r] = math.inf
        else:
            out[r] = v.work / v.rate
    return out


def keep_limit(views: dict[Role, RoleView], role: Role | None, to_role: Role | None = None,
               slack: float = 0.1, rate: float = 1.0, floor: float = 0.0, ahead_factor: float = 0.0) -> int:
    """How many replicas role `role` may give up to `to_role`.

    * All but one while it has (or is about to get) work, so a plan never strands sequences.
    * Upstream first: a role upstream of the receiver (rollout for reward or train, reward for train) gives
      up only spare capacity: replicas whose loss leaves room for all its sequences (nothing queues) and
      costs it at most `slack` of its throughput and of its step time (idle replicas, a tail spread
      thinly). Everything
      downstream waits on upstream output, so while rollout can keep its devices busy, taking them only
      delays the whole iteration; its tail's spare capacity is what flows downstream.
      Or, for a role of fewer than 1/`slack` replicas (where no busy replica is ever spare), replicas
      whose loss leaves it still holding all its sequences and draining within `ahead_factor` × the
      receiver's drain time with the gift (the receiver stays busy longer than the slower upstream runs).
    * Within one cooldown a role two stages upstream (rollout for train) gives up at most
      max(`rate` × the replicas it had, `floor`) replicas it could keep busy (a bound that does not trust
      the fit; see ControllerConfig.upstream_rate).
    * A downstream donor gives up no more than keeps it from becoming the new bottleneck: its drain time
      τ_d(m_d − k) may only grow up to the receiver's with one more replica, τ_u(m_u + 1).
    """
    if role is None:
        return 1 << 30
    v = views[role]
    limit = v.replicas - 1 if v.seqs + v.arriving_seqs > 0 else v.replicas
    if to_role is None or limit <= 0:
        return max(limit, 0)
    work_d = v.work + v.arriving_work
    if work_d <= 0:
        return limit
    ms = np.arange(v.replicas, v.replicas - limit - 1, -1)
    thr = v.throughput_many(ms)
    # Spare: the remaining replicas still hold every sequence (nothing queues), at ≤ `slack` cost in
    # throughput and in step time (each sequence's speed: a long-tailed stage ends with its longest one),
    # both against the current allocation's own step time, not an unloaded one, so the tail's spare capacity
    # flows downstream while rollout runs (see docs/decisions.md#spare-is-judged-against-the-current-step).
    step = v.step_many(ms)
    # The slack compounds per tick (judged against the current allocation); the count bound below is what
    # stops it at scale (see docs/decisions.md#the-slack-compounds-per-tick).
    spare = ((ms * v.cap >= v.seqs + v.arriving_seqs) & (thr >= thr[0] * (1 - slack))
             & (step <= step[0] * (1 + slack)))
    ref_m = v.replicas + v.donated
    upstream = role in PIPELINE and to_role in PIPELINE and PIPELINE.index(role) < PIPELINE.index(to_role)
    if upstream:
        # ... or the upstream role stays ahead: after giving k replicas its drain time is still well within
        # the receiver's (with those k replicas' devices), so the receiver has queued work for as long as
        # the slower upstream runs and the iteration's critical path does not move. (2 devices, 3 roles:
        # once rollout's tail fits on one device the other judges the finished rollouts.)
        vu = views[to_role]
        gained = (v.replicas - ms) * v.g // max(vu.g, 1)
        tau_d = work_d / np.maximum(thr, 1e-300)
        tau_u = (vu.work + vu.arriving_work) / np.maximum(vu.throughput_many(vu.replicas + gained), 1e-300)
        ahead = (ms * v.cap >= v.seqs + v.arriving_seqs) & (tau_d <= ahead_factor * tau_u) & (ms > 0)
        # Only where one replica is more than `slack` of the role: there no busy replica can ever be spare;
        # with many replicas the slack rule resolves (see docs/decisions.md#upstream-ahead).
        ok = spare | ahead if v.replicas * slack < 1.0 else spare
        # Rate limit, independent of the throughput fit: within a cooldown a role two stages upstream
        # (rollout for train) gives up at most `rate` of the replicas it had (at least `floor`), beyond
        # replicas it cannot keep busy; not rollout -> reward, which it would slow
        # (see docs/decisions.md#upstream-rate).
        if PIPELINE.index(to_role) - PIPELINE.index(role) >= 2:
            ok = ok & ((ref_m - ms <= max(rate * ref_m, floor)) | (ms >= v.seqs + v.arriving_seqs))
    else:
        vu = views[to_role]
        tau_u = (vu.work + vu.arriving_work) / max(vu.throughput(vu.replicas + 1), 1e-300)
        ok = (thr >= thr[0] * (1 - 1e-12)) | (work_d <= tau_u * thr)
    ok[0] = True  # giving nothing is always allowed
    bad = np.flatnonzero(~ok)
    return int(bad[0] - 1) if bad.size else limit


def critical_delay(views: dict[Role, RoleView], role: Role, to_role: Role, ks: np.ndarray) -> np.ndarray:
    """Seconds by which giving `ks` replicas of `role` to `to_role` delays the end of the iteration through
    `role`'s longest live items (issue #14: an on-policy iteration ends when its longest sequence does).

    With fewer replicas each keeps more items, so every decode step — and so every token of the longest
    item — takes longer: its remaining time is L × step(m − k), L the longest item's tokens left
    (`RoleView.longest_left`, at least the live items' mean left). It delays the iteration only where it
    outlasts both the current allocation's and the receiver's own drain (downstream is busy until then
    anyway). The item reaches the receiver only after the roles between them have processed it (rollout
    → train: its judgement, `RoleView.item_s`), so that time is added to both of its ends before they are
    compared with the receiver's drain; the receiver's own last item would be on both sides and is left
    out (docs/decisions.md, "the longest rollout is judged before train sees it"). Only an upstream role
    with live work delays what follows it; 0 for every other donor.
    Multiply by the cluster's devices for device-seconds: on-policy the whole cluster waits at the
    barrier."""
    v = views[role]
    upstream = role in PIPELINE and to_role in PIPELINE and PIPELINE.index(role) < PIPELINE.index(to_role)
    items = v.seqs + v.arriving_seqs
    if not upstream or items <= 0 or v.k != 1.0:
        return np.zeros(ks.shape)
    left = max((v.work + v.arriving_work) / items, v.longest_left)
    ms = np.maximum(v.replicas - ks, 0)
    t_now = left * float(v.step_many(np.asarray([v.replicas]))[0])
    t_after = np.where(ms > 0, left * v.step_many(ms), math.inf)
    vu = views[to_role]
    gift = ks * v.g // max(vu.g, 1)
    tau_u = (vu.work + vu.arriving_work) / np.maximum(vu.throughput_many(vu.replicas + gift), 1e-300)
    chain = sum(views[r].item_s for r in PIPELINE[PIPELINE.index(role) + 1: PIPELINE.index(to_role)])
    return np.maximum(t_after + chain - np.maximum(t_now + chain, tau_u), 0.0)
