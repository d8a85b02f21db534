"""The five-step shift planner (DESIGN §4): when to shift, which devices, to which role.

Units. Roles produce different tokens (a train token is far cheaper than a decoded one), so G and φ are
counted in *device-seconds of work at peak*: tokens of role r × w_r, where w_r = g_r / f̄_r(max_seqs) is the
device time one token costs on a saturated replica. A shift then pays exactly when it moves devices from
where they would idle or run inefficiently (a long tail at low concurrency, a stage starved of upstream
work) to where they would be busy.

1. Shift-up role u = argmax τ_r, τ_r = W_r / T_r (remaining tokens over current tokens/s; ∞ for a role
   with work and no active replica). If u cannot use a device (a tail of fewer sequences than replicas:
   no candidate clears step 5), the next role in τ order is tried.
2. Donors: every active, out-of-cooldown replica j of every other role d (an idle replica of a first stage
   with nothing left to start is out of its cooldown: it cannot get work before the next iteration, so
   moving it is no churn), and every free device (φ = 0;
   a role with work keeps at least one replica, so no sequence is stranded; a role upstream of u gives
   up only spare capacity; a downstream one no more than keeps its drain time within u's — `keep_limit`),
   with penalty φ_j = shift_duration(d→u)·f_j(n_j)·w_d (work it stops doing while it shifts) +
   g_d · context_j / prefill_rate_d (re-prefill of the sequences it hands back). Idle replicas are cheap.
3. Candidates by dynamic programming over donor roles, state = devices freed so far: for each x, the best
   mix of k_d donors per role, each role's k_d taken cheapest-φ first, scoring −(work role d loses over H)
   − Σφ. One candidate per x that is a multiple of g_u.
4. G(x) = work the roles do over H after the shift minus before. Each role's output is its replicas' rate
   (role-shared fit, sequences spread evenly, capped by slots) × H, softly capped (W·(1 − e^{−T·H/W})) by
   the work W it has plus what its upstream will hand it within H at the current allocation. Because each
   role's term depends only on its own replica count, the DP in step 3 is exact (tests compare it with brute
   force over subsets).
   When u is all that is left of the iteration (every other role *done*: no live work and none can reach
   it before the next iteration, known from the `IterationPlan`), u's gain is at least `drain_value`: the
   whole cluster waits on u's drain at the on-policy barrier, so ending it sooner is worth every device's
   time, less the part of a moved device's cooldown that outlasts the drain. (Work over H alone misses this:
   with the whole drain inside H, one more replica adds almost no work, yet ends the iteration sooner.)
5. Select, among candidates whose B = G − φ clears the margin B > hysteresis × H × (devices moved), the one
   with the largest B. The margin is per device moved, so a small critical move is as easy as a large one;
   a role with work and no replica at all needs only B > 0.

Issue #14 additions (docs/decisions.md#shifting-that-always-pays-issue-14-what-was-built-and-measured):
a donor pool whose shift lasts longer than H is no candidate (unless u has no replica); a device the done
first stage lends downstream adds its return shift to φ (`return_trip_s`); an upstream donor's loss adds
the whole cluster's wait for its longest live items, slowed by the batch the plan leaves them
(`views.critical_delay`). On-policy, where no next opening wants devices back, a last stage that would
drain after the judge's tail (counting the judged items its groups still hold) is priced like a stage
whose upstream is done, above that tail (`views.behind_tail`), and first offered only idle devices
(`idle_only`). Role aggregates and donor rules live in `views`.

Cost: O(I log I) for the snapshot and sorting, O(K·D) vectorised numpy work for the DP; nothing walks
sequences (the state keeps per-role and per-replica aggregates), so planning time does not grow with NSeq.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pivotrl.core.decision import Candidate, PlanReasoning
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.tail_migration import Residual
from pivotrl.core.types import PIPELINE, Replica, ReplicaState, Role
from pivotrl.core.views import (
    RoleView,
    behind_tail,
    critical_delay,
    drain_floor,
    drain_loss,
    drain_value,
    keep_limit,
    keeps_up,
    role_views,
    tau,
    with_held,
)

__all__ = ["Donor", "DonorPool", "PlanResult", "RoleView", "arrival_s", "critical_delay", "donor_penalty",
           "donor_pools", "drain_floor", "drain_value", "keep_limit", "plan", "plan_for", "return_trip_s",
           "role_views", "tau"]


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


@dataclass(frozen=True)
class DonorPool:
    """The eligible donors of one role (None: free devices), sorted by id, with the two parts of φ:
    `lost` = work per second of shift it stops doing (rate × w, device-seconds/s) and `reprefill`."""

    role: Role | None
    g: int
    ids: tuple[str, ...]
    lost: np.ndarray
    reprefill: np.ndarray


def donor_penalty(rep: Replica, view: RoleView, costs: ShiftCostModel, to_role: Role,
                  prefill_rate: float, views: dict[Role, RoleView] | None = None,
                  return_after: Mapping[Role, float] | None = None, first_share: float = 1.0) -> float:
    """φ of one replica (the scalar form of what `plan_for` computes in bulk); with `views`, its trip back
    (`return_trip_s`)."""
    dur = costs.duration(rep.role, to_role) + costs.fetch_delta(rep.devices, to_role)
    lost = dur * rep.model.rate(rep.n) * view.weight
    reprefill = view.g * rep.context / prefill_rate if prefill_rate > 0 else 0.0
    back = (0.0 if views is None
            else return_trip_s(views, rep.role, to_role, costs, return_after, first_share) * view.g)
    return lost + reprefill + back


def fetch_extra(state: ClusterState, pool: DonorPool, to_role: Role, costs: ShiftCostModel) -> np.ndarray:
    """Per donor of `pool`: seconds its fetch of `to_role`'s weights takes beyond the role's mean, from
    where the weights are (`ShiftCostModel.fetch_delta`); zeros without a locality model."""
    if costs.locality is None:
        return np.zeros(len(pool.ids))
    if pool.role is None:  # free devices: ids are device addresses
        return np.asarray([costs.fetch_delta((d,), to_role) for d in pool.ids], dtype=float)
    reps = state.by_role[pool.role]
    return np.asarray([costs.fetch_delta(reps[r].devices, to_role) for r in pool.ids], dtype=float)


def return_trip_s(views: dict[Role, RoleView], role: Role | None, to_role: Role,
                  costs: ShiftCostModel, return_after: Mapping[Role, float] | None = None,
                  first_share: float = 1.0) -> float:
    """Seconds per device that a donor of `role` moved to `to_role` will be missed on its way back.

    The first stage, while it is done for this iteration, is idle only until the next one starts with all
    of its work, so a device it lends downstream for this iteration's tail must return: its whole trip
    (docs/decisions.md#a-lent-rollout-device-pays-its-way-back). Where the next iteration opens on a split
    (`return_after` given) it returns there even if lent before the first stage is done: random draw 145
    moved 10 of 24 rollout devices to a train stage that was barely behind, with the rollouts still
    running, and took them back cold at the next opening (docs/decisions.md, "Every trip is paid both
    ways"). There the first stage opens short of it for its trip, and it, with every stage waiting on it,
    ends later by the trip over the first stage's devices, which the whole cluster pays: the trip is
    charged over `first_share`, the share of the devices that the opening gives the first stage (1 when
    it gets them all). Charged as the one device's own trip, random draw 233 lent the only rollout device
    of 10 to train's tail for 40 device-seconds and the next iteration's rollouts then waited 9.3 s for it
    (docs/decisions.md, "A lent rollout device delays the whole next opening").

    A later role's device moved downstream (a judge device to train) returns at the next iteration's
    opening too, where that opening restores a split (`return_after`: seconds into the next iteration when
    half of each role's items have reached it, on the split). It is missed there only for the part of its
    trip after that: before it, its role is still filling (docs/decisions.md, "A judge device lent to
    train pays for its trip back"). 0 for any other donor, and for a later role without `return_after`."""
    first = PIPELINE[0]
    if role is first:
        if first not in views or (not views[first].done and return_after is None):
            return 0.0
        return costs.duration(to_role, first) / first_share
    if return_after is None or role not in PIPELINE or PIPELINE.index(to_role) <= PIPELINE.index(role):
        return 0.0
    return max(costs.duration(to_role, role) - return_after.get(role, 0.0), 0.0)


def donor_pools(state: ClusterState, views: dict[Role, RoleView], now: float) -> list[DonorPool]:
    """Step 2's inputs, once per planning call: active, out-of-cooldown replicas per role, free devices."""
    cfg = state.config
    pools: list[DonorPool] = []
    free = sorted(state.free_devices())
    if free:
        pools.append(DonorPool(None, 1, tuple(free), np.zeros(len(free)), np.zeros(len(free))))
    first_done = state.plan is not None and state.first_stage_started()
    for role in state.roles:
        view = views[role]
        prefill = cfg.spec(role).prefill_tokens_per_s
        ids: list[str] = []
        lost: list[float] = []
        ctx: list[float] = []
        for rid in sorted(state.by_role[role]):
            rep = state.by_role[role][rid]
            if rep.state is not ReplicaState.ACTIVE:
                continue
            done = role is PIPELINE[0] and first_done and rep.n == 0
            if not done and any(state.locked(dev, now) for dev in rep.devices):
                continue
            ids.append(rid)
            lost.append(rep.model.rate(rep.n) * view.weight if rep.running else 0.0)
            ctx.append(rep.context)
        if ids:
            re = np.asarray(ctx, dtype=float) * (view.g / prefill if prefill > 0 else 0.0)
            pools.append(DonorPool(role, view.g, tuple(ids), np.asarray(lost), re))
    return pools


def idle_only(pools: list[DonorPool]) -> list[DonorPool]:
    """`pools` less every donor at work (one that would stop work or hand back sequences to move).

    For the last stage behind the judge's tail (`views.behind_tail`): a judge replica it took would hand
    its judgements to the others, which then decode at a larger batch, and lengthen the very tail that
    sets its floor. Random draw 18: train took 97 of the judge's 115 devices with its tail 5 s from the
    end, and the judge ended 2 s later than without the move."""
    out = []
    for p in pools:
        keep = (p.lost <= 0.0) & (p.reprefill <= 0.0)
        if keep.all():
            out.append(p)
        elif keep.any():
            out.append(DonorPool(p.role, p.g, tuple(i for i, k in zip(p.ids, keep, strict=True) if k),
                                 p.lost[keep], p.reprefill[keep]))
    return out


def arrival_s(costs: ShiftCostModel, u: Role) -> float:
    """The soonest a device shifted to the last stage `u` now could serve there (the shortest expected
    shift into it from another role); 0 for any other role. `keeps_up` asks whether `u` would still be
    waiting out the tail upstream of it by then."""
    if u is not PIPELINE[-1]:
        return 0.0
    return min(costs.duration(r, u) for r in PIPELINE if r is not u)


def plan(state: ClusterState, costs: ShiftCostModel, now: float, opens_colocated: bool = False,
         return_after: Mapping[Role, float] | None = None,
         keep: Mapping[Role, int] | None = None, first_share: float = 1.0,
         residuals: Mapping[Role, Residual] | None = None,
         keep_first: Mapping[Role, int] | None = None) -> PlanResult:
    """Run the five steps. Roles are tried as shift-up role in decreasing τ, after the role that holds the
    iteration up if one does (`drain_floor`); the first whose best candidate clears the margin wins. (A
    role can be furthest behind yet unable to use a device — a tail of fewer sequences than replicas — in
    which case the next role in that order gets the devices.)

    ``opens_colocated``: the next iteration opens with every device on the first stage, so a device moved
    to train in the rollouts' tail makes no trip back of its own, and `keeps_up` is asked only once the
    rollouts are done (asked earlier, the paper reconstruction, which opens colocated, lost 0.8 %).
    ``return_after``: where the next iteration opens on a split, when half of each role's items reach it
    there; a device moved downstream then pays for its trip back (`return_trip_s`).
    ``keep``: replicas per role that the role keeps when it gives devices to a later stage upstream of
    it (`Shiftable` passes the iteration's static split for train). Not to the first stage: at an
    iteration's start train's devices serve the rollouts, which end before train has work again.
    ``first_share``: the share of the devices the first stage opens the next iteration with, which a
    lent first-stage device's trip back is charged over (`return_trip_s`).
    ``residuals``: the generation roles' length profiles (`tail_migration.Residual`), which price the
    judge's tail where train is behind it (`behind_tail`).
    ``keep_first``: replicas per role that the role keeps when it gives devices to the first stage
    (`Shiftable` passes the opening split where the iteration opened on it because the split beats the
    planner: the whole-iteration model chose that split, and the planner's horizon does not see what a
    judge device lent to the rollouts costs the judge's tail when it does not come back in time)."""
    cfg = state.config
    views = role_views(state, cfg.horizon_s, now)
    taus = tau(views)
    work = {str(r): v.work for r, v in views.items()}
    thr = {str(r): v.rate for r, v in views.items()}
    tau_s = {str(r): t for r, t in taus.items()}
    threshold = cfg.hysteresis * cfg.horizon_s   # margin per device moved (device-seconds)

    # Step 1: roles with work, furthest behind first; but first the role that holds the iteration up, if one
    # does (`drain_floor`): a role downstream of it is furthest behind only until it releases its work.
    floors = {r: drain_floor(views, r) for r in views}
    last = PIPELINE[-1]
    # the last stage holding the iteration up behind the judge's tail (`behind_tail`): where no next
    # opening wants its devices back, it first tries the idle devices, priced against that floor
    behind = None
    if (last in floors and floors[last] is None and return_after is None
            and state.config.max_staleness == 0):
        behind = behind_tail(state, views, (residuals or {}).get(PIPELINE[-2]))
    ranked = floors if behind is None else {**floors, last: behind}
    order = sorted((r for r in views if views[r].work > 0),
                   key=lambda r: (ranked[r] is None, -taus[r], -views[r].work, state.roles.index(r)))
    if not order:
        return PlanResult(PlanReasoning(now, tau_s, thr, work, None, (), None, threshold, "no role has work"),
                          None, (), None)
    pools = donor_pools(state, views, now)
    shown: _Evaluation | None = None
    tried: list[str] = []
    for u in order:
        ev = None
        if behind is not None and u is last:
            ev = plan_for(state, costs, {**views, u: with_held(state, views[u])}, idle_only(pools), u,
                          threshold, ranked, return_after, keep, first_share)
        if ev is None or not ev.donors:
            if keeps_up(state, views, u, 0.0 if opens_colocated else arrival_s(costs, u)):
                tried.append(f"{u}: drains before the tail upstream of it ends")
                continue
            ev = plan_for(state, costs, views, pools, u, threshold, floors, return_after,
                          keep_first if u is PIPELINE[0] else keep, first_share)
        tried.append(f"{u}: {ev.note}")
        if shown is None or (shown.xs.size == 0 and ev.xs.size > 0):
            shown = ev  # with nothing chosen, show the most-behind role that had candidates
        if ev.donors:
            shown = ev
            break
    assert shown is not None
    cands, chosen = shown.candidates()
    reasoning = PlanReasoning(now, tau_s, thr, work, str(shown.role), cands, chosen, shown.margin,
                              "; ".join(tried))
    return PlanResult(reasoning, chosen, shown.donors, shown.role)


@dataclass
class _Evaluation:
    """Steps 2-5 for one shift-up role, kept as arrays; Candidate objects are built only for the one shown."""

    role: Role
    g: int
    note: str
    margin: float = 0.0   # per device moved
    xs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    k_of: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    names: tuple[str, ...] = ()
    gain: np.ndarray = field(default_factory=lambda: np.zeros(0))
    phi: np.ndarray = field(default_factory=lambda: np.zeros(0))
    best: int = -1
    donors: tuple[Donor, ...] = ()

    def candidates(self) -> tuple[tuple[Candidate, ...], Candidate | None]:
        cands = [Candidate(x, (), {n: k for n, k in zip(self.names, kk) if k}, x // self.g, gv, pv)
                 for x, kk, gv, pv in zip(self.xs.tolist(), self.k_of.T.tolist(), self.gain.tolist(),
                                          self.phi.tolist())]
        chosen = None
        if self.donors:
            b = cands[self.best]
            chosen = Candidate(b.devices, tuple(d.replica_id or d.device or "" for d in self.donors),
                               b.donors_per_role, b.new_replicas, b.gain, b.penalty)
            cands[self.best] = chosen
        return tuple(cands), chosen


def plan_for(state: ClusterState, costs: ShiftCostModel, views: dict[Role, RoleView],
             pools: list[DonorPool], u: Role, threshold: float,
             floors: dict[Role, float | None],
             return_after: Mapping[Role, float] | None = None,
             keep: Mapping[Role, int] | None = None, first_share: float = 1.0) -> _Evaluation:
    """Steps 2-5 for shift-up role `u`; `floors` is `drain_floor` of every role, which `plan` has
    already: u's own prices its gain, a donor's its loss."""
    cfg = state.config
    vu = views[u]
    floor = floors[u]
    # A role with work and no replica at all is starving: any positive B will do (no margin).
    per_device = 0.0 if vu.replicas == 0 else threshold

    # Step 2: penalties for moving to u, cheapest first per donor role (ties by id).
    layers: list[tuple[DonorPool, np.ndarray, np.ndarray]] = []   # pool, order, sorted φ
    for pool in pools:
        if pool.role is u:
            continue
        dur = costs.duration(pool.role, u)
        if vu.replicas > 0 and dur > cfg.horizon_s:
            # G counts work over H: a shift that lasts longer than H has its benefit counted over a window
            # its devices spend mostly shifting (see docs/decisions.md#a-shift-never-outlasts-its-horizon).
            continue
        extra = fetch_extra(state, pool, u, costs)
        back = return_trip_s(views, pool.role, u, costs, return_after, first_share)
        phi = (dur + extra) * pool.lost + pool.reprefill + back * pool.g
        order = np.lexsort((extra, phi))  # equal φ (idle donors): the one holding the weights first
        layers.append((pool, order, phi[order]))
    if not layers:
        return _Evaluation(u, vu.g, "no donor available", per_device)
    total_devices = len(state.device_role)
    max_x = sum(len(p.ids) * p.g for p, _, _ in layers)
    max_x = min(max_x, math.floor(cfg.max_shift_fraction * total_devices + 1e-9))
    if max_x < vu.g:
        return _Evaluation(u, vu.g, "not enough movable devices", per_device)
    # u's own gain: its work over H, or, when u holds the rest of the iteration up (every role upstream of it
    # done), the iteration ending sooner (`drain_value`, above `drain_floor`) if that is worth more.
    shift_s = max(costs.duration(p.role, u) for p, _, _ in layers) if floor is not None else 0.0

    def u_gain(x: np.ndarray) -> np.ndarray:
        g = vu.processed_many(vu.replicas + x // vu.g) - vu.processed(vu.replicas)
        if floor is not None:
            g = np.maximum(g, drain_value(vu, x // vu.g, total_devices, shift_s, cfg.lock_after(shift_s),
                                          floor))
        return g

    # G can only shrink below u's own gain (donor losses and φ are never negative): skip hopeless roles.
    xg = np.arange(vu.g, max_x + 1, vu.g)
    raw = u_gain(xg)
    if not np.any(raw > np.maximum(per_device * xg, 1e-12)):
        return _Evaluation(u, vu.g, "more devices cannot gain more than the margin", per_device)

    # Step 3: DP over donor roles; state = devices freed so far. One vectorised (max, +) step per role.
    neg = -math.inf
    dp = np.full(max_x + 1, neg)
    dp[0] = 0.0
    xs_all = np.arange(max_x + 1)
    picks: list[np.ndarray] = []
    layer_loss: list[np.ndarray] = []
    layer_phi: list[np.ndarray] = []
    for pool, _, phi_sorted in layers:
        g = pool.g
        kmax = min(len(pool.ids), max_x // g, keep_limit(views, pool.role, u, cfg.upstream_slack,
                                                                cfg.upstream_rate, cfg.upstream_rate_floor,
                                                                cfg.upstream_ahead))
        if (keep and pool.role in keep
                and PIPELINE.index(pool.role) > PIPELINE.index(u)):
            kmax = min(kmax, max(views[pool.role].replicas - keep[pool.role], 0))
        phi = np.concatenate([[0.0], np.cumsum(phi_sorted[:kmax])])
        ks = np.arange(kmax + 1)
        if pool.role is None:
            loss = np.zeros(kmax + 1)
        else:
            vd = views[pool.role]
            loss = vd.processed(vd.replicas) - vd.processed_many(vd.replicas - ks)
            loss = loss + critical_delay(views, pool.role, u, ks) * total_devices
            held = floors[pool.role]
            if held is not None:
                loss = np.maximum(loss, drain_loss(vd, ks, total_devices, held))
        val = -loss - phi
        # Row k of the table is dp shifted right by k·g (−∞ where x < k·g) plus val[k]: strided views of a
        # left-padded dp, so no index arrays are built.
        padded = np.concatenate([np.full(kmax * g, neg), dp])
        windows = sliding_window_view(padded, max_x + 1)[::g][kmax::-1]
        table = windows + val[:, None]
        pick = table.argmax(axis=0)   # first maximum: the fewest donors of this role on ties
        dp = table[pick, xs_all]
        picks.append(pick)
        layer_loss.append(loss)
        layer_phi.append(phi)

    # Steps 4-5: G, φ, B per feasible x (backtracking all x at once); pick the best.
    xs = np.arange(vu.g, max_x + 1, vu.g)
    xs = xs[np.isfinite(dp[xs])]
    if xs.size == 0:
        return _Evaluation(u, vu.g, "no feasible candidate", per_device)
    k_of = np.zeros((len(layers), xs.size), dtype=np.int64)
    rest = xs.copy()
    for li in range(len(layers) - 1, -1, -1):
        k = picks[li][rest]
        k_of[li] = k
        rest = rest - k * layers[li][0].g
    lost = np.zeros(xs.size)
    phi_tot = np.zeros(xs.size)
    for li in range(len(layers)):
        lost += layer_loss[li][k_of[li]]
        phi_tot += layer_phi[li][k_of[li]]
    gain = u_gain(xs) - lost
    benefit = gain - phi_tot
    names = tuple("free" if p.role is None else str(p.role) for p, _, _ in layers)
    clears = benefit > np.maximum(per_device * xs, 1e-12)
    if not clears.any():
        return _Evaluation(u, vu.g, "no candidate beats the hysteresis margin", per_device, xs, k_of, names,
                           gain, phi_tot, int(np.argmax(benefit)))
    best_i = int(np.argmax(np.where(clears, benefit, -math.inf)))
    ev = _Evaluation(u, vu.g, "", per_device, xs, k_of, names, gain, phi_tot, best_i)
    chosen_donors: list[Donor] = []
    for li in range(len(layers)):
        pool, order, phi_sorted = layers[li]
        for j in range(int(k_of[li, best_i])):
            idx = int(order[j])
            rid = None if pool.role is None else pool.ids[idx]
            dev = pool.ids[idx] if pool.role is None else None
            chosen_donors.append(Donor(rid, dev, pool.role, pool.g, float(phi_sorted[j])))
    ev.note = "shift"
    ev.donors = tuple(chosen_donors)
    return ev
