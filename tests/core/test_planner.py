from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core import IterationPlan, Role, RoleSpec
from pivotrl.core.dispatcher import dispatch_all
from pivotrl.core.planner import (
    RoleView,
    arrival_s,
    critical_delay,
    donor_penalty,
    drain_floor,
    drain_loss,
    drain_value,
    plan,
    role_views,
    tau,
)
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.throughput import ThroughputModel
from pivotrl.core.types import PIPELINE, ControllerConfig, ReplicaState, ShiftTimings
from pivotrl.core.views import keeps_up

from ._hyp import CI
from .helpers import active_state, config, seq

ROLES = (Role.ROLLOUT, Role.REWARD, Role.TRAIN)


def donation_allowed(views, d: Role, u: Role, k: int, slack: float, ahead: float = 0.25) -> bool:
    """The donor rule, restated directly: keep a replica while there is work; upstream donors give only
    spare capacity (≤ slack of their throughput), or stay `ahead` (their drain time after giving ≤ ahead ×
    u's with the gift); downstream ones let τ_d grow up to τ_u(m_u + 1)."""
    v, vu = views[d], views[u]
    if v.seqs + v.arriving_seqs > 0 and k >= v.replicas:
        return False
    work_d = v.work + v.arriving_work
    if work_d <= 0:
        return True
    base = v.throughput(v.replicas)
    tau_u = (vu.work + vu.arriving_work) / max(vu.throughput(vu.replicas + 1), 1e-300)
    for j in range(1, k + 1):
        t_new = v.throughput(v.replicas - j)
        if ROLES.index(d) < ROLES.index(u):
            m = v.replicas - j
            n = v.seqs + v.arriving_seqs

            def step(mm: int, n: float = n) -> float:
                busy = min(mm, n)
                return v.a + v.b * v.k * (min(v.cap, n / busy) if busy > 0 else 0.0)

            tau_after = work_d / max(t_new, 1e-300)
            gift = (j * v.g) // vu.g
            tau_u_gift = (vu.work + vu.arriving_work) / max(vu.throughput(vu.replicas + gift), 1e-300)
            stays_ahead = (m > 0 and m * v.cap >= n and tau_after <= ahead * tau_u_gift
                           and v.replicas * slack < 1.0)
            if not (t_new >= base * (1 - slack) and m * v.cap >= n
                    and step(m) <= step(v.replicas) * (1 + slack)) and not stays_ahead:
                return False
        elif not (t_new >= base * (1 - 1e-12) or work_d <= tau_u * t_new):
            return False
    return True


def random_state(seed: int) -> tuple[ClusterState, ShiftCostModel, float]:
    """A small random cluster (≤ 8 replicas, a few free devices) with random load, fits and shift costs."""
    rng = random.Random(seed)
    specs = {
        Role.ROLLOUT: RoleSpec(1, rng.choice([2, 4, 8]), 10**6, rng.uniform(0.005, 0.05),
                               rng.uniform(1e-4, 5e-3)),
        Role.REWARD: RoleSpec(rng.choice([1, 2]), rng.choice([2, 4, 8]), 10**6, rng.uniform(0.005, 0.05),
                              rng.uniform(1e-4, 5e-3)),
        Role.TRAIN: RoleSpec(rng.choice([1, 2]), 4, 10**6, rng.uniform(0.01, 0.1), rng.uniform(1e-6, 1e-4),
                             tokens_per_seq_step=200.0),
    }
    cfg = ControllerConfig(roles=specs, horizon_s=rng.choice([1.0, 5.0, 20.0]),
                           hysteresis=rng.choice([0.0, 0.0, 0.05, 0.2]), cooldown_s=rng.choice([0.0, 3.0]),
                           max_shift_fraction=rng.choice([1.0, 1.0, 0.5]))
    stt = ClusterState(cfg)
    now = 10.0
    total = rng.randint(1, 8)
    dev = 0
    for _ in range(total):
        role = rng.choice(ROLES)
        g = specs[role].devices_per_replica
        devs = tuple(f"d{dev + j}" for j in range(g))
        dev += g
        for d in devs:
            stt.add_device(d, 0.0)
        state = ReplicaState.SHIFTING if rng.random() < 0.1 else ReplicaState.ACTIVE
        rep = stt.new_replica(role, devs, rng.choice([0.0, 9.0]), state)
        rep.model = ThroughputModel(rng.uniform(0.005, 0.1), rng.uniform(1e-5, 5e-3),
                                    specs[role].tokens_per_seq_step)
    for _ in range(rng.randint(0, 2)):
        stt.add_device(f"free{dev}", 0.0)
        dev += 1
    for i in range(rng.randint(0, 40)):
        role = rng.choice(ROLES)
        max_new = rng.choice([16, 64, 256, 1024])
        s = seq(i, role, prompt=rng.randint(1, 50), max_new=max_new,
                expected_new_tokens=rng.choice([None, rng.uniform(1, max_new)]))
        stt.admit(s, 0.0)
    dispatch_all(stt)
    for s in list(stt.seqs.values()):
        stt.update_progress(s, rng.randint(0, s.max_new_tokens - 1))
    if rng.random() < 0.7:
        stt.plan = IterationPlan(0, rollout_seqs=rng.randint(0, 60), group_size=rng.choice([1, 4]),
                                 rollout_tokens_per_seq=rng.uniform(10, 500),
                                 reward_tokens_per_rollout=rng.uniform(10, 300),
                                 train_tokens_per_group=rng.uniform(100, 3000))
    costs = ShiftCostModel(prior_s=rng.uniform(0.0, 10.0))
    for _ in range(rng.randint(0, 3)):
        costs.observe(rng.choice([None, *ROLES]), rng.choice(ROLES), ShiftTimings(
            fetch=rng.uniform(0, 5), load=rng.uniform(0, 5)))
    return stt, costs, now


def random_return_after(seed: int) -> dict[Role, float] | None:
    """None (no opening to return to), or when half of each later role's items reach it next iteration."""
    rng = random.Random(f"return:{seed}")
    if rng.random() < 0.4:
        return None
    return {Role.REWARD: rng.choice([0.0, rng.uniform(0.0, 12.0)]), Role.TRAIN: rng.uniform(0.0, 12.0)}


def random_first_share(seed: int) -> float:
    """The share of the devices the next opening gives the first stage: all of them, or a random share."""
    rng = random.Random(f"first-share:{seed}")
    return 1.0 if rng.random() < 0.4 else rng.uniform(0.05, 1.0)


def brute_force_best(stt: ClusterState, costs: ShiftCostModel, now: float, u: Role,
                     clearing: bool = False, return_after: dict[Role, float] | None = None,
                     first_share: float = 1.0) -> float | None:
    """Best B over every subset of donors (free devices and eligible replicas), by direct evaluation;
    with `clearing`, only over subsets whose B clears the margin (hysteresis × H × devices moved, or 0
    for a role with work and no replica)."""
    # holding the state keeps its id from being reused
    if (_BF_CACHE.get("state") is not stt or _BF_CACHE.get("return_after") is not return_after
            or _BF_CACHE.get("first_share") != first_share):
        _BF_CACHE.clear()
        _BF_CACHE["state"] = stt
        _BF_CACHE["return_after"] = return_after
        _BF_CACHE["first_share"] = first_share
    if u not in _BF_CACHE:
        _BF_CACHE[u] = _brute_force(stt, costs, now, u, return_after, first_share)
    return _BF_CACHE[u][1 if clearing else 0]


_BF_CACHE: dict = {}


def _brute_force(stt: ClusterState, costs: ShiftCostModel, now: float, u: Role,
                 return_after: dict[Role, float] | None = None,
                 first_share: float = 1.0) -> tuple[float | None, float | None]:
    cfg = stt.config
    views = role_views(stt, cfg.horizon_s, now)
    donors: list[tuple[Role | None, int, float]] = [(None, 1, 0.0) for _ in stt.free_devices()]
    # the first stage has nothing left to start this iteration: its idle replicas are out of their cooldown
    first_done = (stt.plan is not None and not stt.queues[Role.ROLLOUT]
                  and stt.submitted[Role.ROLLOUT] >= stt.plan.rollout_seqs)
    for d in stt.roles:
        if d is u:
            continue
        for rep in stt.by_role[d].values():
            if rep.state is not ReplicaState.ACTIVE:
                continue
            exempt = d is Role.ROLLOUT and first_done and not rep.running
            if not exempt and any(now - stt.device_shifted_at[x] < cfg.cooldown_s for x in rep.devices):
                continue
            prefill = cfg.spec(d).prefill_tokens_per_s
            phi = donor_penalty(rep, views[d], costs, u, prefill, views, return_after, first_share)
            donors.append((d, views[d].g, phi))
    vu = views[u]
    max_x = math.floor(cfg.max_shift_fraction * len(stt.device_role) + 1e-9)
    per_device = 0.0 if vu.replicas == 0 else cfg.hysteresis * cfg.horizon_s
    if vu.replicas > 0:  # a shift outlasting the horizon its benefit is counted over is never a candidate
        donors = [dn for dn in donors if costs.duration(dn[0], u) <= cfg.horizon_s]
    best = best_clearing = None
    memo: dict = {}
    # u holding the rest of the iteration up: its gain is at least the barrier value above the floor (the
    # slowest donor pool's shift lands last), as `planner.drain_value` states it.
    floor = drain_floor(views, u) if donors else None
    last = floor is not None
    shift_s = max((costs.duration(d, u) for d in {d for d, _, _ in donors}), default=0.0)

    def processed(r: Role, m: int) -> float:  # the scalar objective, memoised
        if (r, m) not in memo:
            memo[r, m] = views[r].processed(m)
        return memo[r, m]

    def u_gain(k: int) -> float:
        g = processed(u, vu.replicas + k) - processed(u, vu.replicas)
        if last:
            total, before = vu.work + vu.arriving_work, vu.throughput(vu.replicas)
            if total > 0 and before > 0 and total / before > shift_s:
                after = shift_s + (total - before * shift_s) / max(vu.throughput(vu.replicas + k), 1e-300)
                lock = max(shift_s + cfg.lock_after(shift_s) - after, 0.0) * k * vu.g
                saving = max(total / before, floor) - max(after, floor)
                g = max(g, len(stt.device_role) * max(saving, 0.0) - lock)
        return g

    for bits in itertools.product((0, 1), repeat=len(donors)):
        chosen = [d for d, b in zip(donors, bits) if b]
        x = sum(g for _, g, _ in chosen)
        if x == 0 or x % vu.g or x > max_x:
            continue
        ks = {r: sum(1 for d, _, _ in chosen if d is r) for r in stt.roles}
        if any(k and not donation_allowed(views, r, u, k, cfg.upstream_slack, cfg.upstream_ahead)
               for r, k in ks.items()):
            continue  # would strand that role's work, or make it a worse bottleneck than u
        gain = u_gain(x // vu.g)
        for r, k in ks.items():
            if r is not u and k:
                vr, n_dev = views[r], len(stt.device_role)
                loss = processed(r, vr.replicas) - processed(r, vr.replicas - k)
                loss += float(critical_delay(views, r, u, np.asarray([k]))[0]) * n_dev
                held = drain_floor(views, r)  # a donor holding the iteration up: its drain lengthens
                total, before = vr.work + vr.arriving_work, vr.throughput(vr.replicas)
                if held is not None and total > 0 and before > 0:
                    after = total / max(vr.throughput(vr.replicas - k), 1e-300)
                    loss = max(loss, n_dev * max(max(after, held) - max(total / before, held), 0.0))
                gain -= loss
        b = gain - sum(p for _, _, p in chosen)
        best = b if best is None else max(best, b)
        if b > max(per_device * x, 1e-12):
            best_clearing = b if best_clearing is None else max(best_clearing, b)
    return best, best_clearing


@CI
@given(seed=st.integers(0, 2**32 - 1))
def test_dp_matches_brute_force_and_never_returns_nonpositive_benefit(seed: int) -> None:
    stt, costs, now = random_state(seed)
    ra = random_return_after(seed)
    fs = random_first_share(seed)
    res = plan(stt, costs, now, False, ra, None, fs)

    def best_of(u: Role, clearing: bool = False) -> float | None:
        return brute_force_best(stt, costs, now, u, clearing, ra, fs)
    if res.to_role is None:
        assert res.chosen is None
        return
    views = role_views(stt, stt.config.horizon_s)
    taus = tau(views)
    # the role holding the iteration up first (`drain_floor`), then the furthest behind
    order = sorted((r for r in stt.roles if views[r].work > 0),
                   key=lambda r: (drain_floor(views, r) is None, -taus[r], -views[r].work,
                                  stt.roles.index(r)))
    # Every role tried before the returned one had no subset that clears its margin (by brute force), or
    # drains before the tail upstream of it ends (`keeps_up`: skipped, whatever its candidates).
    def skipped(r: Role) -> bool:
        return keeps_up(stt, views, r, arrival_s(costs, r))

    for r in order[: order.index(res.to_role)]:
        assert skipped(r) or best_of(r, clearing=True) is None
    assert not skipped(res.to_role)
    if res.chosen is None:  # nothing clears the margin for any role
        for r in order:
            assert skipped(r) or best_of(r, clearing=True) is None
    bf = best_of(res.to_role)
    if not res.reasoning.candidates:
        # Either no feasible subset, or the DP was skipped because even u's raw gain cannot clear the margin.
        assert best_of(res.to_role, clearing=True) is None
    else:
        assert bf is not None
        dp = max(c.benefit for c in res.reasoning.candidates)
        assert dp == pytest.approx(bf, rel=1e-9, abs=1e-9)
    if res.chosen is not None:
        margin = res.reasoning.threshold * res.chosen.devices
        assert res.chosen.benefit > 0
        assert res.chosen.benefit > margin
        best_clearing = best_of(res.to_role, clearing=True)
        assert res.chosen.benefit == pytest.approx(best_clearing, rel=1e-9, abs=1e-9)
        assert res.chosen.devices % stt.config.devices_per_replica(res.to_role) == 0
        assert len(res.donors) == len(res.chosen.donors)


def test_processed_many_matches_scalar() -> None:
    for seed in range(50):
        stt, _, _ = random_state(seed)
        for v in role_views(stt, stt.config.horizon_s).values():
            ms = np.arange(0, 12)
            assert np.allclose(v.processed_many(ms), [v.processed(m) for m in ms])


def _tail_state(now: float = 100.0) -> ClusterState:
    """Rollout: 4 replicas with a 2-sequence tail. Reward: 1 replica with a deep queue."""
    cfg = config(horizon_s=10.0, cooldown_s=1.0)
    stt = active_state(cfg, {Role.ROLLOUT: 4, Role.REWARD: 1})
    for i in range(2):
        stt.admit(seq(f"r{i}", Role.ROLLOUT, max_new=2000, expected_new_tokens=1500), 0.0)
    for i in range(40):
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=200, expected_new_tokens=150), 0.0)
    dispatch_all(stt)
    return stt


def test_tail_shifts_idle_rollout_replicas_to_reward() -> None:
    stt = _tail_state()
    res = plan(stt, ShiftCostModel(prior_s=1.0), 100.0)
    assert res.to_role is Role.REWARD  # rollout is further behind (τ) but cannot use more replicas
    assert res.chosen is not None and res.chosen.benefit > 0
    donors = [stt.replicas[d.replica_id] for d in res.donors]
    assert all(r.role is Role.ROLLOUT for r in donors)
    idle = {r.replica_id for r in stt.active(Role.ROLLOUT) if r.n == 0}
    if any(r.n for r in donors):  # the idle ones are the cheap ones: all go before any busy one
        assert idle <= {r.replica_id for r in donors}
    assert len(donors) <= 3  # rollout keeps a replica for its tail
    assert res.reasoning.tau["rollout"] > res.reasoning.tau["reward"]


def test_idle_donor_is_cheaper_than_busy_one() -> None:
    stt = _tail_state()
    views = role_views(stt, 10.0)
    costs = ShiftCostModel(prior_s=2.0)
    reps = sorted(stt.active(Role.ROLLOUT), key=lambda r: r.n)
    idle, busy = reps[0], reps[-1]
    assert idle.n == 0 and busy.n == 1
    p_idle = donor_penalty(idle, views[Role.ROLLOUT], costs, Role.REWARD, 20000.0)
    p_busy = donor_penalty(busy, views[Role.ROLLOUT], costs, Role.REWARD, 20000.0)
    assert p_idle == 0.0 < p_busy


def test_no_shift_when_everyone_is_saturated() -> None:
    cfg = config(horizon_s=10.0, cooldown_s=0.0)
    stt = active_state(cfg, {Role.ROLLOUT: 2, Role.REWARD: 2})
    for i in range(200):
        stt.admit(seq(f"r{i}", Role.ROLLOUT, max_new=400, expected_new_tokens=300), 0.0)
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=400, expected_new_tokens=300), 0.0)
    dispatch_all(stt)
    res = plan(stt, ShiftCostModel(prior_s=5.0), 50.0)
    assert res.chosen is None
    assert all(c.benefit <= 0 for c in res.reasoning.candidates)


def test_no_shift_to_a_role_without_work_even_if_upstream_is_slow() -> None:
    cfg = config(horizon_s=10.0, cooldown_s=0.0)
    stt = active_state(cfg, {Role.ROLLOUT: 2, Role.TRAIN: 2})
    res = plan(stt, ShiftCostModel(), 50.0)
    assert res.to_role is None and res.chosen is None


def test_cooldown_protects_recently_shifted_devices() -> None:
    stt = _tail_state(now=0.5)
    res = plan(stt, ShiftCostModel(prior_s=1.0), 0.5)  # replicas were formed at t=0, cooldown 1 s
    assert res.chosen is None
    res = plan(stt, ShiftCostModel(prior_s=1.0), 1.5)
    assert res.chosen is not None


@pytest.mark.parametrize("announced", [2, 3])
def test_an_idle_first_stage_replica_leaves_its_cooldown_once_every_rollout_started(announced: int) -> None:
    """Within the cooldown of their placement: with every rollout of the plan started (2 of 2), the idle
    rollout replicas may move, the two still decoding may not; with one rollout still to come (2 of 3),
    the cooldown holds for all."""
    stt = _tail_state(now=0.5)
    stt.plan = IterationPlan(0, rollout_seqs=announced, group_size=1, rollout_tokens_per_seq=1500)
    stt.submitted[Role.ROLLOUT] = 2
    res = plan(stt, ShiftCostModel(prior_s=1.0), 0.5)
    if announced == 3:
        assert res.chosen is None
        return
    assert res.chosen is not None and res.to_role is Role.REWARD
    donors = [stt.replicas[d.replica_id] for d in res.donors]
    assert donors and all(r.role is Role.ROLLOUT and r.n == 0 for r in donors)


def test_the_planner_reads_a_roles_line_at_the_context_its_rows_hold() -> None:
    """Where a role prices context, its view steps at the context its running rows hold now: a tail of
    long rows is slower than the line's reference, a fresh batch of short ones faster; a role that prices
    none keeps its line."""
    c, ref = 1e-7, 500.0
    roles = dict(config().roles)
    roles[Role.ROLLOUT] = replace(roles[Role.ROLLOUT], kv_tokens=1 << 30, step_context_s=c,
                                  context_ref_tokens=ref)
    for prompt, per_row in ((10, 10.0), (5000, 5000.0)):
        stt = active_state(config(roles=roles), {Role.ROLLOUT: 2, Role.REWARD: 1})
        for i in range(6):
            stt.admit(seq(f"r{i}", Role.ROLLOUT, prompt=prompt, max_new=100), 0.0)
        dispatch_all(stt)
        views = role_views(stt, 10.0)
        model = stt.role_models[Role.ROLLOUT]
        assert views[Role.ROLLOUT].b == pytest.approx(model.b + c * (per_row - ref))
        assert views[Role.REWARD].b == stt.role_models[Role.REWARD].b
        reps = stt.active(Role.ROLLOUT)
        at_ref = sum(r.model.rate(r.n) for r in reps)
        assert (views[Role.ROLLOUT].rate < at_ref) == (per_row > ref)


def test_hysteresis_blocks_marginal_shifts() -> None:
    stt = _tail_state()
    loose = plan(stt, ShiftCostModel(prior_s=1.0), 100.0)
    assert loose.chosen is not None
    strict_cfg = ControllerConfig(**{**stt.config.__dict__, "hysteresis": 1e6})
    stt.config = strict_cfg
    strict = plan(stt, ShiftCostModel(prior_s=1.0), 100.0)
    assert strict.chosen is None and "margin" in strict.reasoning.note


def test_two_device_reward_replicas_take_pairs() -> None:
    stt = _tail_state()
    cfg = ControllerConfig(**{**stt.config.__dict__, "roles": {
        **stt.config.roles, Role.REWARD: RoleSpec(devices_per_replica=2, max_seqs=8, kv_tokens=4000)}})
    stt.config = cfg
    res = plan(stt, ShiftCostModel(prior_s=1.0), 100.0)
    assert res.chosen is not None
    assert all(c.devices % 2 == 0 for c in res.reasoning.candidates)
    assert res.chosen.new_replicas * 2 == res.chosen.devices


def test_shift_cost_model_learns_per_pair() -> None:
    m = ShiftCostModel(prior_s=5.0, alpha=0.5)
    assert m.duration(Role.ROLLOUT, Role.REWARD) == 5.0
    m.observe(Role.ROLLOUT, Role.REWARD, ShiftTimings(offload=1.0, fetch=2.0, load=1.0))
    assert m.duration(Role.ROLLOUT, Role.REWARD) == 4.0
    assert m.duration(Role.TRAIN, Role.REWARD) == 4.0  # borrows the target role's mean
    assert m.duration(Role.REWARD, Role.TRAIN) == 5.0
    m.observe(Role.ROLLOUT, Role.REWARD, ShiftTimings(offload=1.0, fetch=0.0, load=1.0))
    assert m.duration(Role.ROLLOUT, Role.REWARD) == 3.0
    assert m.phases[(Role.ROLLOUT, Role.REWARD)]["fetch"] == 1.0


@given(load=st.floats(0.0, 100.0), shift=st.floats(0.0, 100.0), role=st.sampled_from(list(Role)))
def test_a_first_placement_teaches_only_its_own_pair(load: float, shift: float, role: Role) -> None:
    """Placing a free device is no shift: whatever it took (the simulator's placements at t = 0 take
    nothing), shifts into that role from another keep the prior until one is measured, then that."""
    m = ShiftCostModel(prior_s=5.0, alpha=0.5)
    m.observe(None, role, ShiftTimings(load=load))
    assert m.duration(None, role) == pytest.approx(load)
    other = next(r for r in Role if r is not role)
    assert m.duration(other, role) == 5.0
    m.observe(other, role, ShiftTimings(fetch=shift))
    assert m.duration(next(r for r in Role if r not in (role, other)), role) == pytest.approx(shift)


def test_reasoning_is_json_ready() -> None:
    import json

    res = plan(_tail_state(), ShiftCostModel(prior_s=1.0), 100.0)
    d = res.reasoning.as_dict()
    json.dumps(d)
    assert d["chosen"]["B"] > 0 and {"G", "phi", "B"} <= set(d["candidates"][0])


def test_upstream_gives_only_spare_capacity() -> None:
    """A saturated rollout stage (work queued) keeps its devices even for a starving reward stage; once its
    sequences fit on fewer replicas, the spare ones go."""
    cfg = config(horizon_s=10.0, cooldown_s=0.0)
    stt = active_state(cfg, {Role.ROLLOUT: 4})
    for i in range(40):  # 4 replicas × 8 slots = 32 < 40: a queue
        stt.admit(seq(f"r{i}", Role.ROLLOUT, max_new=300, expected_new_tokens=200), 0.0)
    for i in range(20):
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=300, expected_new_tokens=200), 0.0)
    dispatch_all(stt)
    res = plan(stt, ShiftCostModel(prior_s=1.0), 10.0)
    assert res.chosen is None or all(d.role is not Role.ROLLOUT for d in res.donors)
    for s in [s for s in stt.seqs.values() if s.role is Role.ROLLOUT][:30]:
        stt.finish(s, 11.0)  # 10 left: they fit on 2 replicas
    dispatch_all(stt)
    res = plan(stt, ShiftCostModel(prior_s=1.0), 12.0)
    assert res.to_role is Role.REWARD and res.chosen is not None
    assert 1 <= sum(1 for d in res.donors if d.role is Role.ROLLOUT) <= 3


def test_tau_and_upstream_work_in_views() -> None:
    """Step 1's τ and step 4's upstream arrivals: unsubmitted rollouts count as rollout work; reward and
    train see what their upstream will finish within H at the current allocation."""
    cfg = config(horizon_s=10.0)
    stt = active_state(cfg, {Role.ROLLOUT: 2, Role.REWARD: 1})
    for i in range(8):
        stt.admit(seq(f"r{i}", Role.ROLLOUT, max_new=200, expected_new_tokens=100), 0.0)
    dispatch_all(stt)
    stt.plan = IterationPlan(0, rollout_seqs=12, group_size=4, rollout_tokens_per_seq=100,
                             reward_tokens_per_rollout=50, train_tokens_per_group=400)
    views = role_views(stt, 10.0)
    ro, rw, tr = views[Role.ROLLOUT], views[Role.REWARD], views[Role.TRAIN]
    assert ro.arriving_seqs == 4 and ro.arriving_work == pytest.approx(400)
    assert ro.work == pytest.approx(800)
    done = min(1.0, ro.throughput(2) * 10.0 / 1200) * 12
    assert rw.arriving_seqs == pytest.approx(done) and rw.arriving_work == pytest.approx(done * 50)
    assert tr.arriving_work > 0  # judged groups will become train work
    t = tau(views)
    assert t[Role.ROLLOUT] == pytest.approx(800 / ro.rate)
    assert t[Role.REWARD] == 0.0 and t[Role.TRAIN] == 0.0  # no work of their own yet
    stt.by_role[Role.ROLLOUT].clear()  # work and no replica: infinitely behind
    assert tau(role_views(stt, 10.0))[Role.ROLLOUT] == math.inf


def test_upstream_donations_are_rate_limited_per_cooldown() -> None:
    """However flat the fit looks, rollout (two stages upstream of train) gives train at most
    max(rate × its replicas, floor) busy replicas per cooldown (of the replicas it had: donations made
    count), but every replica it cannot keep busy."""
    from pivotrl.core.planner import RoleView, keep_limit

    def view(seqs: float, donated: int) -> RoleView:
        return RoleView(Role.ROLLOUT, 1, 100, 1.0, seqs, seqs * 100, 0.0, 0.0, a=1.0, b=1e-9, k=1.0,
                        cap=256.0, weight=1.0, horizon=10.0, donated=donated)

    train = RoleView(Role.TRAIN, 1, 1, 1.0, 10.0, 1000.0, 0.0, 0.0, a=1.0, b=1e-3, k=1.0, cap=256.0,
                     weight=1.0, horizon=10.0)
    for seqs, donated, want in ((6400.0, 0, 20), (6400.0, 15, 8), (6400.0, 30, 0), (30.0, 30, 70)):
        views = {Role.ROLLOUT: view(seqs, donated), Role.TRAIN: train}
        assert keep_limit(views, Role.ROLLOUT, Role.TRAIN, 0.1, 0.2, 16) == want
    views = {Role.ROLLOUT: view(6400.0, 0), Role.TRAIN: train, Role.REWARD: train}
    assert keep_limit(views, Role.ROLLOUT, Role.TRAIN, 0.1) == 75   # no rate limit: 25 replicas hold all
    # to the next stage (reward) only the slack applies
    assert keep_limit(views, Role.ROLLOUT, Role.REWARD, 0.1, 0.2, 16) == 75


@CI
@given(seed=st.integers(0, 2**32 - 1))
def test_no_shift_outlasts_the_horizon_unless_the_receiver_is_starving(seed: int) -> None:
    """G is counted over H: a shift longer than H is never taken, except to give a role with work and no
    replica its first one (it would wait forever otherwise)."""
    stt, costs, now = random_state(seed)
    res = plan(stt, costs, now)
    if res.chosen is None or res.to_role is None:
        return
    if role_views(stt, stt.config.horizon_s, now)[res.to_role].replicas == 0:
        return
    for d in res.donors:
        assert costs.duration(d.role, res.to_role) <= stt.config.horizon_s


def _long_rollout_state(longest: float, now: float) -> tuple[ClusterState, dict]:
    """4 rollout replicas with 64 live rollouts expected ~50 tokens more each; the plan says the
    iteration's longest rollout runs `longest` tokens, and the iteration began at t = 0."""
    roles = {r: RoleSpec(max_seqs=64, kv_tokens=10**6) for r in Role}
    stt = active_state(config(horizon_s=20.0, roles=roles), {Role.ROLLOUT: 4, Role.REWARD: 1, Role.TRAIN: 1})
    for i in range(64):
        stt.admit(seq(f"r{i}", Role.ROLLOUT, prompt=10, max_new=3000, expected_new_tokens=50), 0.0)
    dispatch_all(stt)
    stt.plan = IterationPlan(0, rollout_seqs=64, group_size=4, rollout_tokens_per_seq=50,
                             reward_tokens_per_rollout=20, train_tokens_per_group=400,
                             rollout_tokens_longest=longest)
    stt.iteration_started_at = 0.0
    return stt, role_views(stt, 20.0, now)


def test_the_critical_delay_prices_the_iterations_longest_item() -> None:
    """Taking a rollout replica slows every step, and so the longest rollout's remaining tokens: those are
    the plan's longest less what any item could have decoded since the iteration began, not the live
    items' mean left (50 here)."""
    ks = np.asarray([1])
    _, views = _long_rollout_state(5000.0, now=0.5)
    v = views[Role.ROLLOUT]
    assert v.longest_left == pytest.approx(5000.0 - 0.5 / v.a)
    long_delay = float(critical_delay(views, Role.ROLLOUT, Role.TRAIN, ks)[0])
    _, short_views = _long_rollout_state(60.0, now=0.5)   # the longest about the mean: the mean counts
    short_delay = float(critical_delay(short_views, Role.ROLLOUT, Role.TRAIN, ks)[0])
    assert long_delay > 10 * max(short_delay, 1e-9)
    _, late = _long_rollout_state(5000.0, now=1e6)   # long past: any item could have decoded the longest
    assert late[Role.ROLLOUT].longest_left == 0.0
    late_delay = float(critical_delay(late, Role.ROLLOUT, Role.TRAIN, ks)[0])
    assert late_delay == pytest.approx(short_delay, abs=1e-9)


def test_the_critical_delay_counts_the_judgement_between_the_longest_rollout_and_train() -> None:
    """Train gets the longest rollout only after it has been judged: a train drain that outlasts rollout's
    own remaining time hides a slower rollout only if it also outlasts that judgement. The receiver's own
    last item is on both sides of the comparison, so a gift to reward is priced as before."""
    ks = np.asarray([1])
    _, views = _long_rollout_state(5000.0, now=0.5)
    ro = views[Role.ROLLOUT]
    t_now = ro.longest_left * float(ro.step_many(np.asarray([ro.replicas]))[0])
    t_after = ro.longest_left * float(ro.step_many(np.asarray([ro.replicas - 1]))[0])
    for role in (Role.REWARD, Role.TRAIN):   # each drains just after the slower rollout, with the gift
        v = replace(views[role], seqs=10.0, arriving_seqs=0.0, arriving_work=0.0)
        thr = float(v.throughput_many(np.asarray([v.replicas + 1]))[0])
        views[role] = replace(v, work=1.01 * t_after * thr)

    def delay(judge_s: float, to_role: Role) -> float:
        judged = {**views, Role.REWARD: replace(views[Role.REWARD], item_s=judge_s)}
        return float(critical_delay(judged, Role.ROLLOUT, to_role, ks)[0])

    assert delay(0.0, Role.TRAIN) == 0.0
    judge_s = 0.5 * t_now
    assert t_after > 1.001 * t_now
    assert delay(judge_s, Role.TRAIN) == pytest.approx(t_after - t_now)   # the whole slowdown
    assert delay(judge_s, Role.REWARD) == delay(0.0, Role.REWARD) == 0.0


def _judge_drains_state(train_replicas: int, train_items: int) -> ClusterState:
    """Every rollout finished; one judge replica with 16 judgements (8 running, 8 waiting); train holds
    `train_items` items on `train_replicas` replicas; the first stage's replica idle."""
    cfg = config(horizon_s=10.0, cooldown_s=0.0)
    stt = active_state(cfg, {Role.ROLLOUT: 1, Role.REWARD: 1, Role.TRAIN: train_replicas})
    stt.plan = IterationPlan(0, rollout_seqs=8, group_size=4, rollout_tokens_per_seq=50,
                             reward_tokens_per_rollout=150, train_tokens_per_group=400)
    rollouts = [seq(f"r{i}", Role.ROLLOUT, max_new=100, expected_new_tokens=50) for i in range(8)]
    for s in rollouts:
        stt.admit(s, 0.0)
    dispatch_all(stt)
    for s in rollouts:
        stt.finish(s, 1.0)
    for i in range(16):
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=200, expected_new_tokens=150), 1.0)
    for i in range(train_items):
        stt.admit(seq(f"t{i}", Role.TRAIN, max_new=100, expected_new_tokens=100), 1.0)
    dispatch_all(stt)
    return stt


def test_a_free_device_joins_the_judge_that_holds_the_iteration_up() -> None:
    """Rollout is done, so the judge holds up everything after it: nothing reaches train but what it
    releases. The free device joins it rather than taking train's one group: train has no replica, so
    its τ is ∞, yet it can only finish after the judge anyway (on the 2-device cluster, sending the
    device to train left the judge to drain alone, 0.14 s slower an iteration than colocated)."""
    stt = _judge_drains_state(train_replicas=0, train_items=4)
    views = role_views(stt, 10.0, 5.0)
    assert views[Role.ROLLOUT].done and not views[Role.REWARD].done
    assert drain_floor(views, Role.REWARD) == 0.0
    assert drain_floor(views, Role.TRAIN) is None   # the judge, upstream of it, still has work
    res = plan(stt, ShiftCostModel(prior_s=0.01), 5.0)
    assert res.reasoning.tau["train"] == math.inf
    assert res.to_role is Role.REWARD
    assert [stt.replicas[d.replica_id].role for d in res.donors] == [Role.ROLLOUT]


def test_a_downstream_role_that_drains_later_anyway_is_the_floor() -> None:
    """A train role with replicas and more work than the judge has: its own drain is the floor, and a
    judge drain that ends below it saves the iteration nothing."""
    stt = _judge_drains_state(train_replicas=1, train_items=800)
    views = role_views(stt, 10.0, 5.0)
    tr, rw = views[Role.TRAIN], views[Role.REWARD]
    floor = drain_floor(views, Role.REWARD)
    assert floor == pytest.approx((tr.work + tr.arriving_work) / tr.throughput(tr.replicas))
    ks = np.asarray([1, 2])
    free = drain_value(rw, ks, 3, 0.01, 0.0)
    assert np.all(free > 0)
    assert rw.work / rw.throughput(rw.replicas) < floor   # the judge drains first even alone
    assert np.all(drain_value(rw, ks, 3, 0.01, 0.0, floor) <= 0)


@CI
@given(work=st.floats(1.0, 1e7), seqs=st.floats(1.0, 5000.0), replicas=st.integers(2, 64),
       floor=st.floats(0.0, 1e4), n_devices=st.integers(2, 1024))
def test_a_donor_that_holds_the_iteration_up_loses_its_longer_drain_above_the_floor(
        work: float, seqs: float, replicas: int, floor: float, n_devices: int) -> None:
    """`drain_loss`, the donor's mirror of `drain_value`: giving up k replicas lengthens the donor's
    drain (work over throughput at m − k), and every device waits on it above the floor. Exact where
    both drains clear the floor, nothing where the longer one is still below it, never negative, and
    never smaller for a larger gift."""
    v = RoleView(Role.ROLLOUT, 1, replicas, 0.0, seqs, work, 0.0, 0.0, 0.02, 2e-4, 1.0, 64.0, 1e-3, 10.0)
    ks = np.arange(replicas)
    loss = drain_loss(v, ks, n_devices, floor)
    tau = work / np.asarray([v.throughput(replicas - k) for k in ks])
    assert loss[0] == 0.0 and np.all(loss >= 0.0) and np.all(np.diff(loss) >= -1e-9 * (1 + loss[:-1]))
    above = tau[0] >= floor
    want = np.where(tau <= floor, 0.0, n_devices * (tau - (tau[0] if above else floor)))
    assert np.allclose(loss, want, rtol=1e-9, atol=1e-9)


@CI
@given(n=st.integers(1, 60), prompt=st.integers(1, 2900), new=st.integers(2, 900), m=st.integers(1, 12))
def test_a_queued_items_prefill_lengthens_its_roles_drain(n: int, prompt: int, new: int, m: int) -> None:
    """The views charge the prompt prefill a role's queued items still owe: with it, draining the role's
    work on `m` replicas takes exactly the decode time plus the owed prefill seconds spread over the busy
    replicas (a prompt's prefill pauses its replica). Dispatched items have prefilled and owe nothing."""
    cfg = config(horizon_s=10.0)
    stt = active_state(cfg, {Role.ROLLOUT: 1, Role.REWARD: 1, Role.TRAIN: 1})
    for i in range(n):
        stt.admit(seq(f"j{i}", Role.REWARD, prompt=prompt, max_new=1000, expected_new_tokens=new), 0.0)
    dispatch_all(stt)
    queued = len(stt.queues[Role.REWARD])
    v = role_views(stt, cfg.horizon_s)[Role.REWARD]
    model = stt.role_models[Role.REWARD]
    bare = replace(v, b=model.b)
    owed = queued * prompt / cfg.spec(Role.REWARD).prefill_tokens_per_s
    busy = min(m, v.seqs + v.arriving_seqs)
    assert v.work / v.throughput(m) == pytest.approx(v.work / bare.throughput(m) + owed / busy, rel=1e-9)
    assert (v.b > model.b) == (queued > 0)


@CI
@given(seed=st.integers(0, 2**32 - 1), share=st.floats(0.0, 1.5))
def test_a_kept_share_never_goes_to_the_judge(seed: int, share: float) -> None:
    """`keep`: a role gives a later stage upstream of it (train to the judge) only what leaves it its kept
    replicas; a plan for the first stage is the same with the limit as without it."""
    stt, costs, now = random_state(seed)
    views = role_views(stt, stt.config.horizon_s)
    keep = {r: round(share * views[r].replicas) for r in PIPELINE[1:]}
    res = plan(stt, costs, now, False, random_return_after(seed), keep)
    stt, costs, now = random_state(seed)
    free = plan(stt, costs, now, False, random_return_after(seed))
    if free.to_role is PIPELINE[0]:   # the roles before it found nothing without the limit, nor with it
        assert res.to_role is free.to_role and res.chosen == free.chosen
    if res.chosen is None or res.to_role is None:
        return
    for r in PIPELINE[1:]:
        given_up = res.chosen.donors_per_role.get(str(r), 0)
        if res.to_role is not PIPELINE[0] and PIPELINE.index(r) > PIPELINE.index(res.to_role):
            assert views[r].replicas - given_up >= min(keep[r], views[r].replicas)


@CI
@given(seed=st.integers(0, 2**32 - 1), share=st.floats(0.0, 1.5))
def test_a_share_kept_from_the_first_stage_stays_where_it_is(seed: int, share: float) -> None:
    """`keep_first`: a plan for the first stage leaves every downstream role its kept replicas; a plan for
    any other role is the one made without it."""
    stt, costs, now = random_state(seed)
    views = role_views(stt, stt.config.horizon_s)
    keep = {r: round(share * views[r].replicas) for r in PIPELINE[1:]}
    res = plan(stt, costs, now, False, random_return_after(seed), keep_first=keep)
    stt, costs, now = random_state(seed)
    free = plan(stt, costs, now, False, random_return_after(seed))
    if free.to_role is not PIPELINE[0]:
        assert res.to_role is free.to_role and res.chosen == free.chosen
    if res.chosen is None or res.to_role is not PIPELINE[0]:
        return
    for r in PIPELINE[1:]:
        given_up = res.chosen.donors_per_role.get(str(r), 0)
        assert views[r].replicas - given_up >= min(keep[r], views[r].replicas)


def test_without_a_kept_share_the_first_stage_takes_downstream_replicas_it_leaves_with_one() -> None:
    """The limit above binds: over the random clusters the first stage takes replicas of a downstream role,
    and with every downstream replica kept it takes none of them."""
    bound = 0
    for seed in range(400):
        stt, costs, now = random_state(seed)
        ra = random_return_after(seed)
        free = plan(stt, costs, now, False, ra)
        if free.chosen is None or free.to_role is not PIPELINE[0]:
            continue
        if not any(free.chosen.donors_per_role.get(str(r), 0) for r in PIPELINE[1:]):
            continue
        bound += 1
        stt, costs, now = random_state(seed)
        views = role_views(stt, stt.config.horizon_s)
        kept = plan(stt, costs, now, False, ra, keep_first={r: views[r].replicas for r in PIPELINE[1:]})
        assert kept.chosen is None or kept.to_role is not PIPELINE[0] or not any(
            kept.chosen.donors_per_role.get(str(r), 0) for r in PIPELINE[1:])
    assert bound >= 10


def test_without_a_kept_share_train_gives_the_judge_replicas_it_keeps_with_one() -> None:
    """The limit above binds: over the random clusters train gives the judge replicas, and with all its
    replicas kept it gives the judge none."""
    bound = 0
    for seed in range(400):
        stt, costs, now = random_state(seed)
        ra = random_return_after(seed)
        free = plan(stt, costs, now, False, ra)
        if free.chosen is None or free.to_role is not Role.REWARD:
            continue
        if not free.chosen.donors_per_role.get("train", 0):
            continue
        bound += 1
        stt, costs, now = random_state(seed)
        views = role_views(stt, stt.config.horizon_s)
        kept = plan(stt, costs, now, False, ra, {Role.TRAIN: views[Role.TRAIN].replicas})
        assert kept.chosen is None or kept.chosen.donors_per_role.get("train", 0) == 0
    assert bound >= 10
