"""How planning and migration time scale with replicas (I) and sequences (NSeq).

`python -m benchmarks.planner --quick --json OUT.json`

For every I ∈ {32, 128, 512, 1024} × NSeq ∈ {1k, 8k, 32k, 128k} it builds a loaded cluster (replicas of all
three roles, every sequence placed by the real dispatcher), then times
* one planning decision (`planner.plan`: the five steps, DP included), median of repeats;
* one shift-down plus shift-up migration (the most loaded rollout replica leaves — Abort, requeue, Dispatch
  to the other rollout replicas — and its device joins reward as a new replica — the queue is empty, so
  it is fed by aborting from the most loaded reward replicas), median of repeats (each moves another
  device of the same cluster).
Garbage collection is paused inside the timed sections (as `timeit` does).
It fits log t = α·log NSeq + β·log I + c by least squares for each, and reports the worse (larger) slope
of the two as `exp_nseq` / `exp_replicas` (targets ≤ 1.15 / ≤ 1.3) and `plan_ms_I1024_N128k` (≤ 50 ms).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import time
from pathlib import Path

import numpy as np

from pivotrl.core import ControllerConfig, IterationPlan, Role, RoleSpec, Sequence
from pivotrl.core.dispatcher import dispatch_all, shift_down, shift_up
from pivotrl.core.planner import plan
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.types import ReplicaState, ShiftTimings

REPLICAS = (32, 128, 512, 1024)
NSEQS = (1_000, 8_000, 32_000, 128_000)
SHARE = {Role.ROLLOUT: 0.5, Role.REWARD: 0.3, Role.TRAIN: 0.2}     # replicas per role
WORK = {Role.ROLLOUT: 0.6, Role.REWARD: 0.35, Role.TRAIN: 0.05}    # sequences per role


def _label(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


def build(n_replicas: int, n_seqs: int, seed: int = 0, reward_room: float = 0.5) -> tuple[ClusterState,
                                                                                         ShiftCostModel]:
    """A cluster with `n_replicas` active replicas and `n_seqs` placed sequences (long-tailed lengths)."""
    rng = random.Random(seed)
    counts = {r: max(1, round(n_replicas * s)) for r, s in SHARE.items()}
    counts[Role.ROLLOUT] += n_replicas - sum(counts.values())
    seqs = {r: max(1, round(n_seqs * w)) for r, w in WORK.items()}
    # Planning: rollout and train have room for all their sequences; reward is the bottleneck (half of its
    # work waits), so the planner runs its DP in full for reward. Migration: every role has room, so the
    # shift-up finds no queue and must rebalance by aborting from the most loaded replicas.
    room = {Role.ROLLOUT: 1.5, Role.REWARD: reward_room, Role.TRAIN: 1.5}
    specs = {r: RoleSpec(devices_per_replica=1, max_seqs=max(4, math.ceil(room[r] * seqs[r] / counts[r])),
                         kv_tokens=1 << 40, tokens_per_seq_step=1.0 if r is not Role.TRAIN else 256.0)
             for r in SHARE}
    cfg = ControllerConfig(roles=specs, horizon_s=10.0, hysteresis=0.05, cooldown_s=1.0)
    st = ClusterState(cfg)
    for role, k in counts.items():
        for i in range(k):
            dev = f"{role}-{i}"
            st.add_device(dev, 0.0)
            st.new_replica(role, (dev,), 0.0, ReplicaState.ACTIVE)
    for rep in st.replicas.values():  # heterogeneous fits, as after some measurements
        rep.model.a *= rng.uniform(0.8, 1.25)
        rep.model.b *= rng.uniform(0.8, 1.25)
    i = 0
    for role, k in seqs.items():
        for _ in range(k):
            max_new = 4096 if role is not Role.TRAIN else 2048
            expected = min(max_new, rng.lognormvariate(5.5, 1.0))
            s = Sequence(f"s{i}", role, rng.randint(16, 256), max_new, expected_new_tokens=expected)
            st.admit(s, 0.0)
            i += 1
    dispatch_all(st)
    for s in st.seqs.values():
        if rng.random() < 0.5:
            st.update_progress(s, rng.randint(0, int(s.expected_new_tokens or 1)))
    st.plan = IterationPlan(0, rollout_seqs=seqs[Role.ROLLOUT] + seqs[Role.ROLLOUT] // 4, group_size=8)
    costs = ShiftCostModel(prior_s=3.0)
    costs.observe(Role.ROLLOUT, Role.REWARD, ShiftTimings(offload=0.5, fetch=1.5, load=1.0))
    return st, costs


def time_plan(st: ClusterState, costs: ShiftCostModel, repeats: int) -> tuple[float, dict]:
    times = []
    res = None
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        res = plan(st, costs, 100.0)
        times.append(time.perf_counter() - t0)
        gc.enable()
    assert res is not None
    chosen = res.chosen
    info = {"candidates": len(res.reasoning.candidates),
            "to_role": None if res.to_role is None else str(res.to_role),
            "B": None if chosen is None else chosen.benefit}
    return statistics.median(times) * 1e3, info


def time_migration(n_replicas: int, n_seqs: int, repeats: int) -> tuple[float, dict]:
    """Each repeat migrates a different device of the same cluster (the most loaded rollout replica
    leaves, its device joins reward), so one build serves every repeat."""
    times = []
    info: dict = {}
    st, _ = build(n_replicas, n_seqs, seed=1, reward_room=1.5)
    for _ in range(repeats):
        donor = max(st.active(Role.ROLLOUT), key=lambda r: (r.n, r.replica_id))
        device = donor.devices[0]
        gc.collect()
        gc.disable()  # a collection of the whole cluster's objects would land in one repeat at random
        t0 = time.perf_counter()
        aborts_down, placed_down = shift_down(st, [donor.replica_id])            # Abort → requeue → Dispatch
        new = st.new_replica(Role.REWARD, (device,), 100.0, ReplicaState.ACTIVE)
        aborts_up, _ = shift_up(st, Role.REWARD, [new.replica_id])               # Dispatch, then rebalance
        times.append(time.perf_counter() - t0)
        gc.enable()
        info = {"aborted_down": sum(map(len, aborts_down.values())), "placed_down": len(placed_down),
                "aborted_up": sum(map(len, aborts_up.values())), "newcomer_load": new.n}
    return statistics.median(times) * 1e3, info


def fit_slopes(rows: list[dict], key: str) -> tuple[float, float]:
    """Least-squares fit of log t = α log NSeq + β log I + c; returns (α, β)."""
    a = np.array([[math.log(r["nseq"]), math.log(r["replicas"]), 1.0] for r in rows])
    y = np.array([math.log(max(r[key], 1e-6)) for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(coef[0]), float(coef[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (same sizes)")
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    args = ap.parse_args(argv)
    plan_repeats, mig_repeats = (5, 3) if args.quick else (15, 5)
    rows = []
    out: dict = {"quick": bool(args.quick), "plan_repeats": plan_repeats, "migrate_repeats": mig_repeats}
    t_start = time.perf_counter()
    for n_rep in REPLICAS:
        for n_seq in NSEQS:
            st, costs = build(n_rep, n_seq)
            plan_ms, pinfo = time_plan(st, costs, plan_repeats)
            mig_ms, minfo = time_migration(n_rep, n_seq, mig_repeats)
            tag = f"I{n_rep}_N{_label(n_seq)}"
            out[f"plan_ms_{tag}"] = plan_ms
            out[f"migrate_ms_{tag}"] = mig_ms
            rows.append({"replicas": n_rep, "nseq": n_seq, "plan_ms": plan_ms, "migrate_ms": mig_ms, **pinfo,
                         **minfo})
            print(f"I={n_rep:5d} NSeq={n_seq:7d}  plan {plan_ms:8.2f} ms ({pinfo['candidates']} candidates)"
                  f"  migrate {mig_ms:8.2f} ms (down {minfo['aborted_down']} aborted, "
                  f"up {minfo['aborted_up']} rebalanced)", flush=True)
    pn, pi = fit_slopes(rows, "plan_ms")
    mn, mi = fit_slopes(rows, "migrate_ms")
    out.update({"rows": rows, "exp_nseq_plan": pn, "exp_replicas_plan": pi, "exp_nseq_migrate": mn,
                "exp_replicas_migrate": mi, "exp_nseq": max(pn, mn), "exp_replicas": max(pi, mi),
                "wall_s": time.perf_counter() - t_start})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    print(f"slopes: plan NSeq {pn:.3f}, I {pi:.3f}; migrate NSeq {mn:.3f}, I {mi:.3f}")
    print(f"plan_ms_I1024_N128k = {out['plan_ms_I1024_N128k']:.2f} (target <= 50)")
    print(f"migrate_ms_I1024_N128k = {out['migrate_ms_I1024_N128k']:.2f}")
    print(f"exp_nseq = {out['exp_nseq']:.3f} (target <= 1.15)  exp_replicas = {out['exp_replicas']:.3f} "
          f"(target <= 1.3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
