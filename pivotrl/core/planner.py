"""The five-step shift planner (DESIGN §4): when to shift, which devices, to which role.

Units. Roles produce different tokens (a train token is far cheaper than a decoded one), so G and φ are
counted in *device-seconds of work at peak*: tokens of role r × w_r, where w_r = g_r / f̄_r(max_seqs) is the
device time one token costs on a saturated replica. A shift then pays exactly when it moves devices from
where they would idle or run inefficiently (a long tail at low concurrency, a stage starved of upstream
work) to where they would be busy.

1. Shift-up role u = argmax τ_r, τ_r = W_r / T_r (remaining tokens over current tokens/s; ∞ for a role
   with work and no active replica). If u cannot use a device (a tail of fewer sequences than replicas:
   no candidate clears step 5), the next role in τ order is tried.
2. Donors: every active, out-of-cooldown replica j of every other role d (and every free device, φ = 0),
   with penalty φ_j = shift_duration(d→u)·f_j(n_j)·w_d (work it stops doing while it shifts) +
   g_d · context_j / prefill_rate_d (re-prefill of the sequences it hands back). Idle replicas are cheap.
3. Candidates by dynamic programming over donor roles, state = devices freed so far: for each x, the best
   mix of k_d donors per role, each role's k_d taken cheapest-φ first, scoring −(work role d loses over H)
   − Σφ. One candidate per x that is a multiple of g_u.
4. G(x) = work the roles do over H after the shift minus before. Each role's output is its replicas' rate
   (role-shared fit, sequences spread evenly, capped by slots) × H, capped by the work it has plus what
   its upstream will hand it within H at the current allocation. Because each role's term depends only on
   its own replica count, the DP in step 3 is exact (tests compare it with brute force over subsets).
5. Select the candidate with the largest B = G − φ, if B > max(0, hysteresis × baseline work over H).

Cost: O(I log I) for the snapshot and sorting, O(K·D) numpy work for the DP; nothing walks sequences (the
state keeps per-role and per-replica aggregates), so planning time does not grow with NSeq.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.types import PIPELINE, Candidate, PlanReasoning, Replica, ReplicaState, Role


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

    def throughput(self, m: float) -> float:
        """Tokens/s of `m` replicas holding this role's sequences, spread evenly (role-shared fit)."""
        n = self.seqs + self.arriving_seqs
        if m <= 0 or n <= 0:
            return 0.0
        busy = min(m, n)
        conc = min(self.cap, n / busy)
        x = conc * self.k
        return busy * x / (self.a + self.b * x)

    def processed(self, m: float) -> float:
        """Device-seconds of work done over H by `m` replicas, capped by the work available."""
        return min(self.throughput(m) * self.horizon, self.work + self.arriving_work) * self.weight

    def processed_many(self, ms: np.ndarray) -> np.ndarray:
        n = self.seqs + self.arriving_seqs
        ms = ms.astype(float)
        if n <= 0:
            return np.zeros_like(ms)
        busy = np.minimum(ms, n)
        conc = np.minimum(self.cap, n / np.maximum(busy, 1e-12))
        x = conc * self.k
        thr = np.where(ms > 0, busy * x / (self.a + self.b * x), 0.0)
        return np.minimum(thr * self.horizon, self.work + self.arriving_work) * self.weight


def role_views(state: ClusterState, horizon: float) -> dict[Role, RoleView]:
    cfg = state.config
    base: dict[Role, dict] = {}
    for role in state.roles:
        spec = cfg.spec(role)
        model = state.role_models[role]
        reps = state.by_role[role]
        rate = 0.0
        for rep in reps.values():
            if rep.state is ReplicaState.ACTIVE and rep.running:
                rate += rep.model.rate(rep.n)
        n = state.n_seqs[role]
        mean_kv = state.kv_sum[role] / n if n else 0.0
        cap = float(spec.max_seqs)
        if mean_kv > 0:
            cap = max(1.0, min(cap, spec.kv_tokens / mean_kv))
        peak = model.rate(spec.max_seqs)
        base[role] = dict(role=role, g=spec.devices_per_replica, replicas=len(reps), rate=rate, seqs=float(n),
                          work=max(state.remaining[role], 0.0), a=model.a, b=model.b,
                          k=model.tokens_per_seq_step, cap=cap,
                          weight=spec.devices_per_replica / peak if peak > 0 else 0.0, horizon=horizon)
    _add_upstream(state, base, horizon)
    return {r: RoleView(**v) for r, v in base.items()}


def _add_upstream(state: ClusterState, base: dict[Role, dict], horizon: float) -> None:
    """Work each role will receive within H from upstream, at the current allocation (pipeline order)."""
    for v in base.values():
        v["arriving_seqs"] = 0.0
        v["arriving_work"] = 0.0
    plan = state.plan
    if plan is None or not all(r in base for r in PIPELINE):
        return
    ro, rw, tr = (base[r] for r in PIPELINE)
    unsubmitted = max(plan.rollout_seqs - state.submitted[Role.ROLLOUT], 0)
    ro["arriving_seqs"] = float(unsubmitted)
    ro["arriving_work"] = unsubmitted * plan.rollout_tokens_per_seq

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
    groups = completions(rw) / max(plan.group_size, 1)
    tr_tokens = groups * plan.train_tokens_per_group
    per_item = (tr["work"] / tr["seqs"]) if tr["seqs"] > 0 else plan.train_tokens_per_group / max(
        plan.group_size, 1)
    tr["arriving_work"] = tr_tokens
    tr["arriving_seqs"] = tr_tokens / per_item if per_item > 0 else 0.0


@dataclass(frozen=True)
class Donor:
    replica_id: str | None   # None for a free device
    device: str | None       # set for a free device
    role: Role | None
    devices: int
    penalty: float


@dataclass(frozen=True)
class PlanResult:
    reasoning: PlanReasoning
    chosen: Candidate | None
    donors: tuple[Donor, ...]   # of the chosen candidate
    to_role: Role | None


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


def donor_penalty(rep: Replica, view: RoleView, costs: ShiftCostModel, to_role: Role,
                  prefill_rate: float) -> float:
    dur = costs.duration(rep.role, to_role)
    lost = dur * rep.model.rate(rep.n) * view.weight
    reprefill = view.g * rep.context / prefill_rate if prefill_rate > 0 else 0.0
    return lost + reprefill


def plan(state: ClusterState, costs: ShiftCostModel, now: float) -> PlanResult:
    """Run the five steps. Roles are tried as shift-up role in decreasing τ; the first whose best candidate
    clears the margin wins. (A role can be furthest behind yet unable to use a device — a tail of fewer
    sequences than replicas — in which case the next role in τ order gets the devices.)"""
    cfg = state.config
    views = role_views(state, cfg.horizon_s)
    taus = tau(views)
    work = {str(r): v.work for r, v in views.items()}
    thr = {str(r): v.rate for r, v in views.items()}
    tau_s = {str(r): t for r, t in taus.items()}
    baseline = sum(v.processed(v.replicas) for v in views.values())
    threshold = cfg.hysteresis * baseline

    # Step 1: roles with work, furthest behind first.
    order = sorted((r for r in views if views[r].work > 0), key=lambda r: (-taus[r], -views[r].work,
                                                                            state.roles.index(r)))
    if not order:
        return PlanResult(PlanReasoning(now, tau_s, thr, work, None, (), None, threshold, "no role has work"),
                          None, (), None)
    first: PlanResult | None = None
    tried: list[str] = []
    for u in order:
        res = plan_for(state, costs, now, views, u, threshold)
        tried.append(f"{u}: {res.reasoning.note}")
        if first is None:
            first = res
        if res.chosen is not None:
            first = res
            break
    assert first is not None
    r = first.reasoning
    note = "; ".join(tried)
    return PlanResult(PlanReasoning(now, tau_s, thr, work, r.shift_up_role, r.candidates, r.chosen,
                                    threshold, note), first.chosen, first.donors, first.to_role)


def plan_for(state: ClusterState, costs: ShiftCostModel, now: float, views: dict[Role, RoleView], u: Role,
             threshold: float) -> PlanResult:
    """Steps 2-5 for shift-up role `u`."""
    cfg = state.config
    vu = views[u]

    def result(note: str, cands: tuple[Candidate, ...] = (), chosen: Candidate | None = None,
               donors: tuple[Donor, ...] = ()) -> PlanResult:
        return PlanResult(PlanReasoning(now, {}, {}, {}, str(u), cands, chosen, threshold, note), chosen,
                          donors, u)

    # Step 2: donors with their penalties, cheapest first per donor role.
    layers: list[tuple[Role | None, int, list[Donor]]] = []
    free = state.free_devices()
    if free:
        layers.append((None, 1, [Donor(None, d, None, 1, 0.0) for d in sorted(free)]))
    for d in state.roles:
        if d is u:
            continue
        vd = views[d]
        prefill = cfg.spec(d).prefill_tokens_per_s
        donors = []
        for rep in state.by_role[d].values():
            if rep.state is not ReplicaState.ACTIVE:
                continue
            if any(now - state.device_shifted_at.get(dev, -math.inf) < cfg.cooldown_s for dev in rep.devices):
                continue
            donors.append(Donor(rep.replica_id, None, d, vd.g, donor_penalty(rep, vd, costs, u, prefill)))
        if donors:
            donors.sort(key=lambda x: (x.penalty, x.replica_id))
            layers.append((d, vd.g, donors))
    if not layers:
        return result("no donor available")
    total_devices = len(state.device_role)
    max_x = sum(len(ds) * g for _, g, ds in layers)
    max_x = min(max_x, math.floor(cfg.max_shift_fraction * total_devices + 1e-9))
    if max_x < vu.g:
        return result("not enough movable devices")

    # Step 3: DP over donor roles; state = devices freed so far.
    neg = -math.inf
    dp = np.full(max_x + 1, neg)
    dp[0] = 0.0
    picks: list[np.ndarray] = []
    layer_loss: list[np.ndarray] = []
    layer_phi: list[np.ndarray] = []
    for role, g, donors in layers:
        kmax = min(len(donors), max_x // g)
        phi = np.concatenate([[0.0], np.cumsum([x.penalty for x in donors[:kmax]])])
        if role is None:
            loss = np.zeros(kmax + 1)
        else:
            vd = views[role]
            ks = np.arange(kmax + 1)
            loss = vd.processed(vd.replicas) - vd.processed_many(vd.replicas - ks)
        val = -loss - phi
        new = np.full(max_x + 1, neg)
        pick = np.zeros(max_x + 1, dtype=np.int64)
        for k in range(kmax + 1):
            s = k * g
            cand = dp[: max_x + 1 - s] + val[k]
            seg = new[s:]
            better = cand > seg
            if better.any():
                seg[better] = cand[better]
                pick[s:][better] = k
        dp = new
        picks.append(pick)
        layer_loss.append(loss)
        layer_phi.append(phi)

    def backtrack(x: int) -> list[int]:
        ks = [0] * len(layers)
        for li in range(len(layers) - 1, -1, -1):
            k = int(picks[li][x])
            ks[li] = k
            x -= k * layers[li][1]
        return ks

    # Steps 4-5: G, φ, B per feasible x; pick the best.
    xs = np.arange(vu.g, max_x + 1, vu.g)
    xs = xs[np.isfinite(dp[xs])]
    if xs.size == 0:
        return result("no feasible candidate")
    gain_u = vu.processed_many(vu.replicas + xs // vu.g) - vu.processed(vu.replicas)
    benefit = gain_u + dp[xs]
    cands: list[Candidate] = []
    best_i = -1
    for i, x in enumerate(xs.tolist()):
        ks = backtrack(x)
        lost = sum(float(layer_loss[li][k]) for li, k in enumerate(ks))
        phi = sum(float(layer_phi[li][k]) for li, k in enumerate(ks))
        per_role = {("free" if layers[li][0] is None else str(layers[li][0])): k
                    for li, k in enumerate(ks) if k}
        cands.append(Candidate(x, (), per_role, x // vu.g, float(gain_u[i]) - lost, phi))
        if best_i < 0 or benefit[i] > benefit[best_i]:
            best_i = i
    best = cands[best_i]
    if not best.benefit > max(threshold, 1e-12):
        return result("no candidate beats the hysteresis margin", tuple(cands))
    ks = backtrack(int(xs[best_i]))
    chosen_donors: list[Donor] = []
    for li, k in enumerate(ks):
        chosen_donors.extend(layers[li][2][:k])
    chosen = Candidate(best.devices, tuple(d.replica_id or d.device or "" for d in chosen_donors),
                       best.donors_per_role, best.new_replicas, best.gain, best.penalty)
    cands[best_i] = chosen
    return result("shift", tuple(cands), chosen, tuple(chosen_donors))
