"""Random interleavings of every event and decision: the controller never loses, duplicates or double-runs a
sequence, never drops generated tokens, never overfills a replica, and never takes a plan with B ≤ 0."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core import Controller, ControllerConfig, IterationPlan, Role, RoleSpec, Sequence, ShiftTimings
from pivotrl.core.decision import Decision
from pivotrl.core.types import ReplicaState, SeqState

from ._hyp import CI

ROLES = (Role.ROLLOUT, Role.REWARD, Role.TRAIN)
OPS = ("add_device", "submit", "submit", "dispatch", "dispatch", "dispatch", "step", "step", "step", "finish",
       "finish", "abort", "tick", "tick", "tick", "shift_done", "shift_done", "shift_done", "device_lost",
       "late_progress")


def _check_decision(ctl: Controller, dec: Decision | None) -> None:
    if dec is None:
        return
    st_ = ctl.state
    if dec.reasoning is not None and dec.reasoning.chosen is not None:
        assert dec.reasoning.chosen.benefit > 0
        assert dec.reasoning.chosen.benefit > dec.reasoning.threshold
    for rid in dec.dissolved:
        assert rid not in st_.replicas
    for ids in dec.aborts.values():
        for sid in ids:
            s = st_.seqs.get(sid)
            assert s is not None and s.state in (SeqState.WAITING, SeqState.RUNNING)
            assert s.replica_id not in dec.dissolved
    for sh in dec.shifts:
        rep = st_.replicas.get(sh.replica_id)
        if rep is not None and dec.kind == "shift":
            assert rep.state is ReplicaState.SHIFTING and rep.role is sh.to_role
            assert len(sh.devices) == ctl.config.devices_per_replica(sh.to_role)
    _check_assignments(ctl, dec.dispatch)


def _check_assignments(ctl: Controller, assignments) -> None:
    seen = set()
    for a in assignments:
        assert a.seq_id not in seen
        seen.add(a.seq_id)
        rep = ctl.state.replicas[a.replica_id]
        assert rep.state is ReplicaState.ACTIVE
        s = ctl.state.seqs[a.seq_id]
        assert s.state is SeqState.RUNNING and s.replica_id == a.replica_id


def run_interleaving(seed: int) -> None:
    rng = random.Random(seed)
    mode = rng.choice(["shiftable", "shiftable", "colocated", "disaggregated"])
    specs = {
        Role.ROLLOUT: RoleSpec(1, rng.randint(1, 4), rng.choice([300, 1000])),
        Role.REWARD: RoleSpec(rng.choice([1, 2]), rng.randint(1, 4), rng.choice([300, 1000])),
        Role.TRAIN: RoleSpec(1, rng.randint(1, 3), 2000, tokens_per_seq_step=50.0),
    }
    cfg = ControllerConfig(roles=specs, horizon_s=rng.choice([1.0, 10.0]), hysteresis=rng.choice([0.0, 0.05]),
                           cooldown_s=rng.choice([0.0, 1.0]), shift_prior_s=rng.choice([0.0, 1.0, 5.0]),
                           kv_reserve=rng.choice(["budget", "expected"]))
    ctl = Controller(mode, devices=[f"d{i}" for i in range(rng.randint(0, 6))], config=cfg)
    if rng.random() < 0.5:
        plan = IterationPlan(0, rollout_seqs=rng.randint(0, 20), group_size=rng.choice([1, 2]))
        ctl.begin_iteration(plan, 0.0)
    n_dev = len(ctl.state.device_role)
    submitted: set[str] = set()
    finished: set[str] = set()
    reported: dict[str, int] = {}
    now = 0.0
    n_seq = 0
    for _ in range(rng.randint(10, 50)):
        now += rng.choice([0.0, 0.1, 0.5, 2.0])
        op = rng.choice(OPS)
        live = list(ctl.state.seqs.values())
        running = [s for s in live if s.state is SeqState.RUNNING]
        if op == "add_device":
            ctl.add_device(f"d{n_dev}", now)
            n_dev += 1
        elif op == "submit":
            batch = []
            for _ in range(rng.randint(1, 6)):
                role = rng.choice(ROLES)
                max_new = rng.randint(1, 200)
                batch.append(Sequence(f"s{n_seq}", role, rng.randint(0, 50), max_new,
                                      expected_new_tokens=rng.choice([None, float(rng.randint(1, max_new))])))
                n_seq += 1
            ctl.submit(batch, now)
            submitted.update(s.seq_id for s in batch)
        elif op == "dispatch":
            _check_assignments(ctl, ctl.dispatch(now))
            for role, q in ctl.state.queues.items():  # whatever still waits fits on no active replica
                head = q.peek()
                if head is not None:
                    need = ctl.state.kv_need(head)
                    assert not any(r.fits(need) for r in ctl.state.active(role)), "dispatch left work behind"
        elif op == "step" and running:
            rep = ctl.state.replicas[rng.choice(running).replica_id]
            ctl.on_step(rep.replica_id, rep.n, rng.uniform(0.001, 0.5), now)
            for s in list(rep.running.values()):
                if rng.random() < 0.7:
                    g = min(s.max_new_tokens, s.generated + rng.randint(0, 30))
                    ctl.on_progress(s.seq_id, g, now, payload=("tokens", g))
                    reported[s.seq_id] = max(reported.get(s.seq_id, 0), g)
        elif op == "late_progress" and live:
            s = rng.choice(live)
            g = rng.randint(0, s.max_new_tokens)  # may be stale (lower): must not lower the count
            ctl.on_progress(s.seq_id, g, now)
            reported[s.seq_id] = max(reported.get(s.seq_id, 0), g)
        elif op == "finish" and live:
            s = rng.choice(running if running and rng.random() < 0.8 else live)
            done = ctl.on_finished(s.seq_id, now)
            assert done is s and s.state is SeqState.FINISHED
            assert done.generated >= reported.get(s.seq_id, 0)
            finished.add(s.seq_id)
        elif op == "abort" and running:
            ctl.state.abort(rng.choice(running))
        elif op == "tick":
            _check_decision(ctl, ctl.tick(now))
        elif op == "shift_done":
            shifting = [r for r in ctl.state.replicas.values() if r.state is ReplicaState.SHIFTING]
            if shifting:
                rep = rng.choice(shifting)
                dec = ctl.on_shift_done(rep.replica_id, now, ShiftTimings(fetch=rng.uniform(0, 2), load=0.5))
                _check_decision(ctl, dec)
        elif op == "device_lost" and ctl.state.device_role:
            dev = rng.choice(sorted(ctl.state.device_role))
            back = ctl.on_device_lost(dev, now)
            assert all(s.state is SeqState.WAITING for s in back)
        ctl.check_invariants()
        assert set(ctl.state.seqs) == submitted - finished, "a sequence was lost or resurrected"
        for sid, s in ctl.state.seqs.items():
            assert s.generated >= reported.get(sid, 0), "generated tokens dropped"
        ids = [e["decision_id"] for e in ctl.log]
        assert ids == sorted(set(ids)) and all(e["stimulus"] for e in ctl.log)


@CI
@given(seed=st.integers(0, 2**32 - 1))
def test_random_interleavings_preserve_every_sequence(seed: int) -> None:
    run_interleaving(seed)
