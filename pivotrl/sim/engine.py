"""The discrete-event simulator: devices, replicas and the GRPO iteration flow, driven by `pivotrl.core`.

Time is the event clock. The simulator is pure mechanism and talks to core's `Controller` exactly as the
Dask runtime does (docs/core-api.md): it reports what happened (`submit`, `on_progress`, `on_finished`,
`on_step`, `on_shift_done`) and executes what core decides (`dispatch` assignments; `tick` decisions:
aborts, then replica shifts, then dispatch). Iterations are on-policy by default: an iteration's rollouts
start only after the previous iteration's optimizer step and publish. With `workload.max_staleness` k ≥ 1
core's `StalenessBound` decides when the next iteration may start (once the newest one has finished
generating, and at most k iterations ahead of the last trained one), exactly as the runtime's driver asks it;
train items of an iteration wait until every earlier iteration has trained, so each gradient is taken at the
version it is applied to.

Flow of one sequence: rollout (prefill prompt, decode response) -> reward (prefill task prompt + response +
judge template, decode critique) -> when its whole group is judged, the group's sequences become train
items -> when all train items of the iteration are done: optimizer step + gradient reduce + publish.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from pivotrl.core import Decision, Role, Sequence, ShiftTimings
from pivotrl.core.staleness import InFlight, StalenessBound
from pivotrl.sim.config import ROLES, SimConfig
from pivotrl.sim.costs import barrier_time, shared_core_slowdown, shift_time, step_time, train_rate
from pivotrl.sim.driver import build_controller, expected, iteration_plan
from pivotrl.sim.replicas import GenReplica, TrainReplica
from pivotrl.sim.workload import SeqSpec, iteration_sequences

Replica = GenReplica | TrainReplica


@dataclass
class IterStats:
    iteration: int
    start: float
    rollout_end: float = math.nan
    reward_start: float = math.nan
    reward_end: float = math.nan
    train_start: float = math.nan
    train_end: float = math.nan
    end: float = math.nan

    def as_dict(self) -> dict[str, float]:
        """Stage times of one iteration. Stages overlap when streaming, so each has a *span* (first work
        available -> last finished) and a *tail* (how long it ran on after its upstream stage ended)."""
        return {
            "iteration": self.iteration,
            "start_s": self.start,
            "rollout_s": self.rollout_end - self.start,
            "reward_span_s": self.reward_end - self.reward_start,
            "reward_tail_s": self.reward_end - self.rollout_end,
            "train_span_s": self.train_end - self.train_start,
            "train_tail_s": self.train_end - self.reward_end,
            "barrier_s": self.end - self.train_end,
            "total_s": self.end - self.start,
        }


@dataclass
class SimResult:
    mode: str
    split: dict[str, int] | None
    devices: int
    makespan_s: float
    tokens: float
    iterations: list[dict[str, float]]
    conservation: dict[str, Any]
    shifts: list[dict[str, Any]]
    segments: list[tuple[int, float, float, str]]
    utilization: dict[str, float]
    finished: bool
    decisions: int = 0
    busy_device_s: dict[str, float] = field(default_factory=dict)  # per role: replicas at work, in all

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens / self.makespan_s / self.devices if self.makespan_s > 0 and self.finished else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "split": self.split,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "makespan_s": self.makespan_s,
            "shift_decisions": len({s["decision"] for s in self.shifts}),
            "replica_shifts": len(self.shifts),
            "utilization": self.utilization,
            "iterations": self.iterations,
            "conservation": self.conservation,
            "finished": self.finished,
        }


class Simulator:
    def __init__(self, cfg: SimConfig, mode: str, split: dict[str, int] | None = None,
                 iterations: int | None = None, record: bool = True) -> None:
        self.cfg, self.mode, self.split = cfg, mode, split
        self.ctl = build_controller(cfg, mode, split)
        # what a runtime knows of lengths before measuring them: the workload's expected values
        self.expected = expected(cfg)
        self.tell_expected = cfg.scheduler.expected_lengths == "mean"
        self.iterations = iterations or cfg.workload.iterations
        self.record = record
        self.N = cfg.cluster.devices
        # every device is always in a role, "shift" (loading a role) or "free" (never placed by core)
        self.dev_state: dict[str, tuple[str | None, float]] = {f"d{i}": ("free", 0.0) for i in range(self.N)}
        self.reps: dict[str, Replica] = {}
        self.specs: dict[str, SeqSpec] = {}
        self.events: list[tuple[float, int, str, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        self.segments: list[tuple[int, float, float, str]] = []
        self.shift_log: list[dict[str, Any]] = []
        self.iter_stats: list[IterStats] = []
        self.n_specs = 0
        self.cur_iter = -1  # the newest started iteration
        self.bound = StalenessBound(cfg.workload.max_staleness)
        self.trained_through = 0  # iterations 0..trained_through-1 have taken their optimizer step
        self.held_train: dict[int, list[Sequence]] = {}  # train items waiting for an earlier iteration
        self.group_left: dict[str, int] = {}
        self.group_members: dict[str, list[str]] = {}
        self.left: dict[int, dict[str, int]] = {}  # per started iteration: items left per role
        self.done = False
        self.tick_pending_at = math.inf
        self.dispatch_pending = False
        self.counts = {"rollout_submitted": 0, "rollout_finished": 0, "reward_submitted": 0,
                       "reward_finished": 0, "train_submitted": 0, "train_finished": 0, "aborted": 0}
        self.train_tokens_done = 0.0
        self.tokens_expected = {"rollout": 0.0, "reward": 0.0, "train": 0.0}
        self.decoded = {"rollout": 0.0, "reward": 0.0}
        self.busy = dict.fromkeys(ROLES, 0.0)  # device-seconds of replicas at work (steps, prefill, batches)

    # ---- event plumbing -------------------------------------------------------------------------
    def _push(self, t: float, kind: str, key: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, key, version))

    def _schedule(self, rep: Replica) -> None:
        t = rep.next_finish_time() if isinstance(rep, GenReplica) else rep.batch_end
        if t < math.inf:
            self._push(t, "rep", rep.replica_id, rep.version)

    def _request_tick(self) -> None:
        if self.now < self.tick_pending_at - 1e-12:
            self.tick_pending_at = self.now
            self._push(self.now, "tick", None)

    def _set_device(self, dev: str, state: str | None) -> None:
        old, since = self.dev_state[dev]
        if self.record and old is not None and self.now > since:
            self.segments.append((int(dev[1:]), since, self.now, old))
        self.dev_state[dev] = (state, self.now)

    def _train_replicas(self) -> int:
        return sum(1 for r in self.reps.values() if isinstance(r, TrainReplica))

    # ---- iteration flow -------------------------------------------------------------------------
    def _maybe_start_next(self) -> None:
        """Start the next iteration when core's staleness bound allows it (on-policy: after the barrier)."""
        nxt = self.cur_iter + 1
        if nxt >= self.iterations:
            return
        newest_done = self.left[self.cur_iter]["rollout"] == 0
        if self.bound.may_start(InFlight(nxt, self.trained_through, newest_done)):
            self._start_iteration(nxt)

    def _on_barrier(self, it: int) -> None:
        """Iteration `it` has stepped and published: rollout replicas pick up the new version, the next
        iteration's held train items may go, and the window may admit another iteration."""
        self.iter_stats[it].end = self.now
        self.trained_through = it + 1
        if self.trained_through >= self.iterations:
            self.done = True
            return
        sync = self.cfg.cost.iteration.weight_sync_s
        if sync > 0:
            for rep in self.reps.values():
                if isinstance(rep, GenReplica) and rep.role == "rollout":
                    rep.pause(self.now, sync)
                    self._schedule(rep)
        held = self.held_train.pop(it + 1, [])
        if held:
            self.ctl.submit(held, self.now)
        self._maybe_start_next()
        self._push_barrier_if_trained(it + 1)

    def _push_barrier_if_trained(self, it: int) -> None:
        left = self.left.get(it)
        if left is not None and left["train"] == 0 and self.trained_through == it:
            self._push(self.now + barrier_time(self.cfg, self._train_replicas()), "barrier", it)

    def _start_iteration(self, k: int) -> None:
        self.cur_iter = k
        specs = iteration_sequences(self.cfg.workload, k, self.cfg.seed)
        self.n_specs += len(specs)
        self.iter_stats.append(IterStats(k, self.now))
        self.left[k] = dict.fromkeys(ROLES, len(specs))
        self.ctl.begin_iteration(iteration_plan(self.cfg, k, self.iterations), self.now)
        seqs = []
        max_resp = self.cfg.workload.response_len.max
        for s in specs:
            self.specs[s.seq_id] = s
            self.group_left[s.group_id] = self.group_left.get(s.group_id, 0) + 1
            self.group_members.setdefault(s.group_id, []).append(s.seq_id)
            seqs.append(Sequence(s.seq_id, Role.ROLLOUT, s.prompt_len, max_resp, iteration=k,
                                 group_id=s.group_id, payload=s.response_len,
                                 expected_new_tokens=self._expect("response")))
            self.tokens_expected["rollout"] += s.response_len
        self.counts["rollout_submitted"] += len(seqs)
        self.ctl.submit(seqs, self.now)
        self._request_tick()

    def _expect(self, what: str) -> float | None:
        return self.expected[what] if self.tell_expected else None

    def _judge_prompt(self, s: SeqSpec) -> int:
        return s.prompt_len + s.response_len + self.cfg.workload.judge_template_tokens

    def _finished(self, rep: Replica, sid: str, tokens: int) -> list[Sequence]:
        """Report a finished unit of work; returns the next-stage work it unlocks."""
        seq = self.ctl.on_finished(sid, self.now, generated=tokens)
        s = self.specs[sid]
        st = self.iter_stats[s.iteration]
        role = str(seq.role)
        left = self.left[s.iteration]
        left[role] -= 1
        self.counts[f"{role}_finished"] += 1
        if left[role] == 0:
            setattr(st, f"{role}_end", self.now)
            self._request_tick()
            if role == "rollout" and s.iteration == self.cur_iter:
                self._maybe_start_next()
        if role == "rollout":
            if math.isnan(st.reward_start):
                st.reward_start = self.now
            self.counts["reward_submitted"] += 1
            self.tokens_expected["reward"] += s.critique_len
            return [Sequence(sid, Role.REWARD, self._judge_prompt(s), self.cfg.workload.critique_len.max,
                             iteration=s.iteration, group_id=s.group_id, payload=s.critique_len,
                             expected_new_tokens=self._expect("critique"))]
        if role == "reward":
            g = s.group_id
            self.group_left[g] -= 1
            if self.group_left[g]:
                return []
            del self.group_left[g]
            if math.isnan(st.train_start):
                st.train_start = self.now
            out = []
            for mid in self.group_members.pop(g):
                m = self.specs[mid]
                n = m.prompt_len + m.response_len
                self.tokens_expected["train"] += n
                out.append(Sequence(mid, Role.TRAIN, 0, n, iteration=m.iteration, group_id=g, payload=n,
                                    expected_new_tokens=float(n)))
            self.counts["train_submitted"] += len(out)
            if not self.bound.may_train(s.iteration, self.trained_through):
                self.held_train.setdefault(s.iteration, []).extend(out)
                return []
            return out
        del self.specs[sid]
        self._push_barrier_if_trained(s.iteration)
        return []

    # ---- executing core's decisions -------------------------------------------------------------
    def _assign(self, assignments: list[Any]) -> None:
        touched: dict[str, Replica] = {}
        for a in assignments:
            rep = self.reps.get(a.replica_id)
            seq = self.ctl.sequence(a.seq_id)
            if rep is None or seq is None:
                raise RuntimeError(f"core dispatched {a.seq_id!r} to {a.replica_id!r}, not active here")
            if isinstance(rep, TrainReplica):
                rep.pending.append((seq.seq_id, int(seq.payload)))
            else:
                rep.admit(self.now, seq.seq_id, seq.prompt_tokens, seq.generated, int(seq.payload))
            touched[rep.replica_id] = rep
        for rep in touched.values():
            if isinstance(rep, TrainReplica):
                rep.start_next(self.now, train_rate(self.cfg.cost.train, self._train_replicas()))
            self._schedule(rep)

    def _execute(self, dec: Decision | None) -> None:
        if dec is None:
            return
        rate = train_rate(self.cfg.cost.train, self._train_replicas())
        for rid, sids in dec.aborts.items():
            rep = self.reps[rid]
            for sid in sids:
                if isinstance(rep, GenReplica):
                    gen = rep.abort_one(self.now, sid)
                    self.ctl.on_progress(sid, gen, self.now)
                else:
                    rep.abort_one(self.now, sid, rate)
            self.counts["aborted"] += len(sids)
            self._schedule(rep)
        for rid in dec.dissolved:
            rep = self.reps.pop(rid)
            if isinstance(rep, GenReplica):
                rep.advance(self.now)
                self.decoded[rep.role] += rep.tokens
                if rep.running:
                    raise RuntimeError(f"core dissolved {rid} with {len(rep.running)} sequence(s) running")
            self.busy[rep.role] += rep.busy_time * len(rep.devices)
        for sh in dec.shifts:
            role = str(sh.to_role)
            warm_start = self.now == 0.0 and all(m.from_role is None for m in sh.moves)
            timings = ShiftTimings() if warm_start else shift_time(self.cfg.cost, role, bool(dec.aborts))
            dur = timings.total
            for d in sh.devices:
                self._set_device(d, "shift")
            self._push(self.now + dur, "shifted", (sh.replica_id, role, tuple(sh.devices), timings))
            if not warm_start:
                self.shift_log.append({
                    "t": self.now, "decision": dec.decision_id, "to": role,
                    "from": sorted({str(m.from_role) for m in sh.moves}),
                    "devices": [int(d[1:]) for d in sh.devices],
                    "duration_s": dur, "aborted": sum(len(v) for v in dec.aborts.values()),
                    "stimulus": dec.stimulus,
                    "B": None if dec.reasoning is None or dec.reasoning.chosen is None
                    else dec.reasoning.chosen.benefit})
        self._assign(dec.dispatch)

    def _shift_done(self, rid: str, role: str, devices: tuple[str, ...], timings: ShiftTimings) -> None:
        c = self.cfg.cost
        if role == "train":
            rep: Replica = TrainReplica(rid, role, devices, c.train, t=self.now)
        else:
            rep = GenReplica(rid, role, devices, getattr(c, role), t=self.now, paused_until=self.now)
        self.reps[rid] = rep
        for d in devices:
            self._set_device(d, role)
        self._execute(self.ctl.on_shift_done(rid, self.now, timings))

    def _tick(self) -> None:
        self._execute(self.ctl.tick(self.now))
        self._assign(self.ctl.dispatch(self.now))

    def _report_progress(self) -> None:
        """Per-sequence progress, as the runtime's engines report it in batches every `progress_s`."""
        for rep in self.reps.values():
            if isinstance(rep, GenReplica) and rep.running:
                rep.advance(self.now)
                for sid in rep.running:
                    self.ctl.on_progress(sid, rep.generated_of(sid), self.now)

    # ---- main loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._start_iteration(0)
        s = self.cfg.scheduler
        self._push(s.tick_s, "periodic", None)
        self._push(s.progress_s, "progress", None)
        while self.events and not self.done:
            if self.cfg.cost.control_cores > 0.0:
                self._share_cores()
            t, _, kind, key, ver = heapq.heappop(self.events)
            if t > self.cfg.max_sim_time_s:
                break
            self.now = t
            if kind == "rep":
                rep = self.reps.get(key)
                if rep is None or rep.version != ver:
                    continue
                self._on_replica(rep)
            elif kind == "tick":
                if abs(t - self.tick_pending_at) < 1e-12:
                    self.tick_pending_at = math.inf
                self._tick()
                continue
            elif kind == "periodic":
                self._tick()
                self._push(t + s.tick_s, "periodic", None)
                continue
            elif kind == "progress":
                self._report_progress()
                self._push(t + s.progress_s, "progress", None)
                continue
            elif kind == "shifted":
                self._shift_done(*key)
            elif kind == "barrier":
                self._on_barrier(key)
            elif kind == "dispatch":
                self.dispatch_pending = False
                self._assign(self.ctl.dispatch(self.now))
                continue
            self._request_dispatch()
        return self._result()

    def _share_cores(self) -> None:
        """Every busy replica at the step time the host's shared cores give it now
        (`costs.shared_core_slowdown`; the cluster is one host); each change re-times its next event."""
        busy = [rep for rep in self.reps.values() if rep.busy(self.now)]
        slow = shared_core_slowdown(sum(len(r.devices) for r in busy), self.N, self.cfg.cost.control_cores)
        for rep in busy:
            if rep.slow != slow:
                rep.set_slow(self.now, slow)
                self._schedule(rep)

    def _request_dispatch(self) -> None:
        """Coalesce dispatch calls: a runtime reports finished work in batches, not one by one."""
        window = self.cfg.scheduler.dispatch_batch_s
        if window <= 0:
            self._assign(self.ctl.dispatch(self.now))
        elif not self.dispatch_pending:
            self.dispatch_pending = True
            self._push(self.now + window, "dispatch", None)

    def _on_replica(self, rep: Replica) -> None:
        follow: list[Sequence] = []
        if isinstance(rep, GenReplica):
            rep.advance(self.now)
            conc = rep.load
            done = rep.pop_finished()
            ctx = rep.context_tokens()
            self.ctl.on_step(rep.replica_id, conc, step_time(rep.cost, conc, ctx) * rep.slow, self.now,
                             context_tokens=ctx)
            for r in done:
                follow += self._finished(rep, r.item_id, r.target)
        else:
            took = self.now - rep.batch_start
            batch = rep.finish(self.now)
            toks = sum(n for _, n in batch)
            self.ctl.on_step(rep.replica_id, len(batch), took, self.now, tokens=toks)
            for sid, n in batch:
                self.train_tokens_done += n
                follow += self._finished(rep, sid, n)
            rep.start_next(self.now, train_rate(self.cfg.cost.train, self._train_replicas()))
        if follow:
            self.ctl.submit(follow, self.now)
        self._schedule(rep)

    def _result(self) -> SimResult:
        for d in self.dev_state:
            self._set_device(d, None)
        for rep in self.reps.values():
            if isinstance(rep, GenReplica):
                self.decoded[rep.role] += rep.tokens
            self.busy[rep.role] += rep.busy_time * len(rep.devices)
        tokens = 0.0
        for it in range(len(self.iter_stats)):
            specs = iteration_sequences(self.cfg.workload, it, self.cfg.seed)
            tokens += sum(s.prompt_len + s.response_len for s in specs)
        held = dict.fromkeys([*ROLES, "shift", "free"], 0.0)
        for _d, t0, t1, role in self.segments:
            held[role] += t1 - t0
        total = self.now * self.N
        util = {f"{r}_device_share": held[r] / total if total else 0.0 for r in held}
        cons: dict[str, Any] = dict(self.counts)
        cons["sequences"] = self.n_specs
        cons["train_tokens_expected"] = self.tokens_expected["train"]
        cons["train_tokens_done"] = self.train_tokens_done
        for role in ("rollout", "reward"):
            cons[f"{role}_tokens_expected"] = self.tokens_expected[role]
            cons[f"{role}_tokens_decoded"] = round(self.decoded[role], 3)
        # an abort keeps whole generated tokens, so at most one token per abort is decoded twice
        slack = cons["aborted"] + 1.0 + 1e-6 * cons["rollout_tokens_expected"]
        n = self.n_specs
        cons["conserved"] = bool(
            self.done
            and cons["rollout_finished"] == cons["reward_finished"] == cons["train_finished"] == n
            and cons["rollout_submitted"] == cons["reward_submitted"] == cons["train_submitted"] == n
            and abs(cons["train_tokens_done"] - cons["train_tokens_expected"]) < 0.5
            and all(abs(cons[f"{r}_tokens_decoded"] - cons[f"{r}_tokens_expected"]) <= slack
                    for r in ("rollout", "reward")))
        return SimResult(self.mode, self.split, self.N, self.now, tokens,
                         [s.as_dict() for s in self.iter_stats], cons, self.shift_log, self.segments, util,
                         self.done, len(self.ctl.log), dict(self.busy))
