"""The discrete-event simulator: devices, replicas and the GRPO iteration flow, driven by a controller.

Time is the event clock. The simulator is pure mechanism: it tells the controller what happened (work
submitted, sequences finished or aborted, step-time samples, shifts completed) and executes what the
controller decides (dispatch assignments, shifts with their aborts). One iteration is on-policy: its
rollouts start only after the previous iteration's optimizer step and publish.

Flow of one sequence: rollout (prefill prompt, decode response) -> reward (prefill task prompt + response +
judge template, decode critique) -> when its whole group is judged, the group's sequences become train
items -> when all train items of the iteration are done: optimizer step + gradient reduce + publish.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

from pivotrl.sim.config import ROLES, SimConfig
from pivotrl.sim.control import Controller, Decision, ReplicaView, WorkItem
from pivotrl.sim.costs import barrier_time, shift_time, step_time, train_rate
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

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens / self.makespan_s / self.devices if self.makespan_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "split": self.split,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "makespan_s": self.makespan_s,
            "num_shifts": len(self.shifts),
            "utilization": self.utilization,
            "iterations": self.iterations,
            "conservation": self.conservation,
            "finished": self.finished,
        }


@dataclass
class _Item:
    spec: SeqSpec
    role: str
    generated: int = 0
    replica: str | None = None


@dataclass
class _Device:
    role: str | None = None  # role or "shift:<role>" or None (pool)
    since: float = 0.0


class Simulator:
    def __init__(self, cfg: SimConfig, controller: Controller, mode: str, split: dict[str, int] | None = None,
                 iterations: int | None = None, record: bool = True) -> None:
        self.cfg, self.ctl, self.mode, self.split = cfg, controller, mode, split
        self.iterations = iterations or cfg.workload.iterations
        self.record = record
        self.N = cfg.cluster.devices
        self.devices = [_Device() for _ in range(self.N)]
        self.reps: dict[str, Replica] = {}
        self.pool: dict[str, list[int]] = {r: [] for r in ROLES}
        self.items: dict[str, _Item] = {}
        self.events: list[tuple[float, int, str, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        self.rep_counter = 0
        self.local_wait: dict[str, list[str]] = {}
        self.segments: list[tuple[int, float, float, str]] = []
        self.shift_log: list[dict[str, Any]] = []
        self.iter_stats: list[IterStats] = []
        self.iter_specs: list[list[SeqSpec]] = []
        self.cur_iter = -1
        self.group_left: dict[str, int] = {}
        self.train_left = 0
        self.reward_left = 0
        self.rollout_left = 0
        self.in_barrier = False
        self.done = False
        self.tick_pending_at = math.inf
        self.counts = {"rollout_submitted": 0, "rollout_finished": 0, "reward_submitted": 0,
                       "reward_finished": 0, "train_submitted": 0, "train_finished": 0, "aborted": 0}
        self.train_tokens_done = 0.0
        self.gen_tokens_expected = {"rollout": 0, "reward": 0}
        self.gen_tokens_done = {"rollout": 0.0, "reward": 0.0}
        self._group_members: dict[str, list[str]] = {}

    # ---- event plumbing -------------------------------------------------------------------------
    def _push(self, t: float, kind: str, key: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, key, version))

    def _schedule_rep(self, rep: Replica) -> None:
        t = rep.next_finish_time() if isinstance(rep, GenReplica) else rep.batch_end
        if t < math.inf:
            self._push(t, "rep", rep.replica_id, rep.version)

    def _request_tick(self, t: float) -> None:
        if t < self.tick_pending_at - 1e-9:
            self.tick_pending_at = t
            self._push(t, "tick", None, 0)

    # ---- devices and replicas -------------------------------------------------------------------
    def _set_device(self, dev: int, state: str | None) -> None:
        d = self.devices[dev]
        if self.record and d.role is not None and self.now > d.since:
            self.segments.append((dev, d.since, self.now, d.role))
        d.role, d.since = state, self.now

    def _form_replicas(self, role: str) -> None:
        g = getattr(self.cfg.cost, role).devices_per_replica
        while len(self.pool[role]) >= g:
            devs = tuple(self.pool[role][:g])
            self.pool[role] = self.pool[role][g:]
            self.rep_counter += 1
            rid = f"{role[:3]}{self.rep_counter}"
            if role == "train":
                rep: Replica = TrainReplica(rid, role, devs, self.cfg.cost.train, t=self.now)
                view = ReplicaView(rid, role, devs, self.cfg.cost.train.micro_batch_seqs, 0)
            else:
                rc = getattr(self.cfg.cost, role)
                rep = GenReplica(rid, role, devs, rc, t=self.now, paused_until=self.now)
                view = ReplicaView(rid, role, devs, rc.max_batch, rc.kv_tokens)
            self.reps[rid] = rep
            self.local_wait[rid] = []
            for dv in devs:
                self._set_device(dv, role)
            self.ctl.add_replica(view, self.now)

    def _train_replicas(self) -> int:
        return sum(1 for r in self.reps.values() if isinstance(r, TrainReplica))

    # ---- iteration flow -------------------------------------------------------------------------
    def _start_iteration(self, k: int) -> None:
        self.cur_iter = k
        specs = iteration_sequences(self.cfg.workload, k, self.cfg.seed)
        self.iter_specs.append(specs)
        self.iter_stats.append(IterStats(k, self.now))
        self.rollout_left = self.reward_left = len(specs)
        self.train_left = len(specs)
        self.group_left = {}
        sync = self.cfg.cost.iteration.weight_sync_s
        if k > 0 and sync > 0:
            for rep in self.reps.values():
                if isinstance(rep, GenReplica) and rep.role == "rollout":
                    rep.pause(self.now, sync)
                    self._schedule_rep(rep)
        items = []
        for s in specs:
            self.group_left[s.group_id] = self.group_left.get(s.group_id, 0) + 1
            self._group_members.setdefault(s.group_id, []).append(s.seq_id)
            self.items[s.seq_id] = _Item(s, "rollout")
            items.append(WorkItem(s.seq_id, "rollout", s.prompt_len, 0, s.group_id, k))
            self.gen_tokens_expected["rollout"] += s.response_len
        self.counts["rollout_submitted"] += len(items)
        self.ctl.submit(items, self.now)
        self._request_tick(self.now)

    def _reward_item(self, it: _Item) -> WorkItem:
        s = it.spec
        judge = s.prompt_len + s.response_len + self.cfg.workload.judge_template_tokens
        return WorkItem(s.seq_id, "reward", judge, it.generated, s.group_id, s.iteration)

    def _finish_item(self, rep: Replica, iid: str, tokens: int) -> list[WorkItem]:
        """Book-keep a finished unit of work; returns the follow-up items it unlocks."""
        it = self.items[iid]
        st = self.iter_stats[-1]
        self.ctl.on_finished(rep.replica_id, iid, tokens, self.now)
        it.replica = None
        if it.role == "rollout":
            self.counts["rollout_finished"] += 1
            self.rollout_left -= 1
            if self.rollout_left == 0:
                st.rollout_end = self.now
                self._request_tick(self.now)
            it.role, it.generated = "reward", 0
            if math.isnan(st.reward_start):
                st.reward_start = self.now
            self.counts["reward_submitted"] += 1
            self.gen_tokens_expected["reward"] += it.spec.critique_len
            return [self._reward_item(it)]
        if it.role == "reward":
            self.counts["reward_finished"] += 1
            self.reward_left -= 1
            if self.reward_left == 0:
                st.reward_end = self.now
                self._request_tick(self.now)
            it.role = "train"
            g = it.spec.group_id
            self.group_left[g] -= 1
            if self.group_left[g] == 0:
                del self.group_left[g]
                return self._group_train_items(g)
            return []
        # train
        self.counts["train_finished"] += 1
        self.train_left -= 1
        del self.items[iid]
        if self.train_left == 0:
            st.train_end = self.now
            self._begin_barrier()
        return []

    def _group_train_items(self, gid: str) -> list[WorkItem]:
        st = self.iter_stats[-1]
        if math.isnan(st.train_start):
            st.train_start = self.now
        out = []
        for iid in self._group_members.pop(gid):
            s = self.items[iid].spec
            out.append(WorkItem(iid, "train", 0, 0, gid, s.iteration, s.prompt_len + s.response_len))
        self.counts["train_submitted"] += len(out)
        return out

    def _begin_barrier(self) -> None:
        self.in_barrier = True
        dur = barrier_time(self.cfg, self._train_replicas())
        self._push(self.now + dur, "barrier", self.cur_iter, 0)

    def _end_barrier(self) -> None:
        self.in_barrier = False
        self.iter_stats[-1].end = self.now
        if self.cur_iter + 1 < self.iterations:
            self._start_iteration(self.cur_iter + 1)
        else:
            self.done = True

    # ---- controller interaction -----------------------------------------------------------------
    def _dispatch(self) -> None:
        touched: set[str] = set()
        for iid, rid in self.ctl.dispatch(self.now):
            rep = self.reps.get(rid)
            it = self.items.get(iid)
            if rep is None or it is None:
                raise RuntimeError(f"controller dispatched {iid!r} to unknown replica {rid!r}")
            it.replica = rid
            self.local_wait[rid].append(iid)
            touched.add(rid)
        for rid in touched:
            self._admit_waiting(self.reps[rid])

    def _admit_waiting(self, rep: Replica) -> None:
        wait = self.local_wait[rep.replica_id]
        if not wait:
            return
        if isinstance(rep, TrainReplica):
            for iid in wait:
                s = self.items[iid].spec
                rep.pending.append((iid, s.prompt_len + s.response_len))
            wait.clear()
            rep.start_next(self.now, train_rate(self.cfg.cost.train, self._train_replicas()))
            self._schedule_rep(rep)
            return
        admitted = 0
        tmpl = self.cfg.workload.judge_template_tokens
        while wait:
            it = self.items[wait[0]]
            s = it.spec
            if rep.role == "rollout":
                prompt, target = s.prompt_len, s.response_len
            else:
                prompt, target = s.prompt_len + s.response_len + tmpl, s.critique_len
            if rep.load and not rep.can_admit(prompt + it.generated):
                break  # KV cache full: wait here (like vLLM's own waiting queue) until a sequence ends
            wait.pop(0)
            rep.admit(self.now, s.seq_id, prompt, it.generated, target)
            admitted += 1
        if admitted:
            self._schedule_rep(rep)

    def _execute(self, dec: Decision) -> None:
        for sh in dec.shifts:
            rep = self.reps.pop(sh.replica_id, None)
            if rep is None:
                raise RuntimeError(f"decision {dec.decision_id} shifts unknown replica {sh.replica_id!r}")
            if isinstance(rep, GenReplica):
                rep.advance(self.now)
                self.gen_tokens_done[rep.role] += rep.tokens
                rep.tokens = 0.0
            partials = rep.abort_all(self.now)
            back: list[WorkItem] = []
            for entry in partials:
                iid, gen = entry
                it = self.items[iid]
                if isinstance(rep, GenReplica):
                    it.generated = gen
                it.replica = None
                back.append(self._as_work(it))
            for iid in self.local_wait.pop(sh.replica_id, []):
                it = self.items[iid]
                it.replica = None
                back.append(self._as_work(it))
            self.counts["aborted"] += len(partials)
            self.ctl.remove_replica(sh.replica_id, self.now)
            if back:
                self.ctl.on_aborted(sh.replica_id, back, self.now)
            dur, phases = shift_time(self.cfg.cost, sh.to_role)
            dur += self.cfg.cost.abort_s if partials else 0.0
            for dv in rep.devices:
                self._set_device(dv, "shift")
            self._push(self.now + dur, "shifted", (rep.devices, sh.to_role, phases, rep.replica_id), 0)
            self.shift_log.append({"t": self.now, "decision": dec.decision_id, "from": rep.role,
                                   "to": sh.to_role, "devices": list(rep.devices), "duration_s": dur,
                                   "aborted": len(partials), "reason": dec.reason})

    def _as_work(self, it: _Item) -> WorkItem:
        s = it.spec
        if it.role == "rollout":
            return WorkItem(s.seq_id, "rollout", s.prompt_len, it.generated, s.group_id, s.iteration)
        if it.role == "reward":
            return self._reward_item(it)
        return WorkItem(s.seq_id, "train", 0, 0, s.group_id, s.iteration, s.prompt_len + s.response_len)

    # ---- main loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        alloc = self.ctl.initial_allocation(self.N)
        if sum(alloc.values()) > self.N:
            raise ValueError(f"initial allocation {alloc} exceeds {self.N} devices")
        dev = 0
        for role in ROLES:
            for _ in range(alloc.get(role, 0)):
                self.pool[role].append(dev)
                dev += 1
            self._form_replicas(role)
        self._start_iteration(0)
        tick_s = self.cfg.scheduler.tick_s
        self._push(tick_s, "periodic", None, 0)
        while self.events and not self.done:
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
                self._push(t + tick_s, "periodic", None, 0)
                continue
            elif kind == "shifted":
                devs, role, phases, _old = key
                for dv in devs:
                    self._set_device(dv, None)
                    self.pool[role].append(dv)
                before = set(self.reps)
                self._form_replicas(role)
                for rid in set(self.reps) - before:
                    self.ctl.on_shift_done(rid, role, phases, self.now)
            elif kind == "barrier":
                self._end_barrier()
            self._dispatch()
        return self._result()

    def _tick(self) -> None:
        for rep in self.reps.values():
            if isinstance(rep, GenReplica) and rep.running:
                rep.advance(self.now)
                self.ctl.on_progress(rep.replica_id, int(rep.generated_tokens()), self.now)
        dec = self.ctl.tick(self.now)
        if dec is not None and dec.shifts:
            self._execute(dec)
        self._dispatch()

    def _on_replica(self, rep: Replica) -> None:
        follow: list[WorkItem] = []
        if isinstance(rep, GenReplica):
            rep.advance(self.now)
            conc = rep.load
            done = rep.pop_finished()
            self.ctl.on_step(rep.replica_id, conc, step_time(rep.cost, conc, rep.context_tokens()), self.now)
            for r in done:
                follow += self._finish_item(rep, r.item_id, r.target)
        else:
            for iid, _n in rep.finish(self.now):
                self.train_tokens_done += _n
                follow += self._finish_item(rep, iid, _n)
            rep.start_next(self.now, train_rate(self.cfg.cost.train, self._train_replicas()))
        if follow:
            self.ctl.submit(follow, self.now)
        if rep.replica_id in self.reps:
            self._admit_waiting(rep)
            self._schedule_rep(rep)

    def _result(self) -> SimResult:
        for dv in range(self.N):
            self._set_device(dv, None)
        for rep in self.reps.values():
            if isinstance(rep, GenReplica):
                self.gen_tokens_done[rep.role] += rep.tokens
        specs = [s for it in self.iter_specs for s in it]
        tokens = float(sum(s.prompt_len + s.response_len for s in specs))
        held: dict[str, float] = dict.fromkeys(ROLES, 0.0)
        for _dv, t0, t1, role in self.segments:
            if role in held:
                held[role] += t1 - t0
        total = self.now * self.N
        util = {f"{r}_device_share": held[r] / total if total else 0.0 for r in ROLES}
        shifting = sum(t1 - t0 for _, t0, t1, r in self.segments if r == "shift")
        util["shifting_device_share"] = shifting / max(total, 1e-9)
        cons = dict(self.counts)
        cons["sequences"] = len(specs)
        cons["train_tokens_expected"] = float(sum(s.prompt_len + s.response_len for s in specs))
        cons["train_tokens_done"] = self.train_tokens_done
        for role in ("rollout", "reward"):
            cons[f"{role}_tokens_expected"] = float(self.gen_tokens_expected[role])
            cons[f"{role}_tokens_decoded"] = round(self.gen_tokens_done[role], 3)
        # an abort keeps whole generated tokens, so at most one token per abort is decoded twice
        slack = cons["aborted"] + 1e-6 * cons["rollout_tokens_expected"] + 1.0
        cons["conserved"] = bool(
            self.done
            and cons["rollout_finished"] == cons["reward_finished"] == cons["train_finished"] == len(specs)
            and abs(cons["train_tokens_done"] - cons["train_tokens_expected"]) < 0.5
            and all(abs(cons[f"{r}_tokens_decoded"] - cons[f"{r}_tokens_expected"]) <= slack
                    for r in ("rollout", "reward"))
        )
        return SimResult(self.mode, self.split, self.N, self.now, tokens,
                         [s.as_dict() for s in self.iter_stats], cons, self.shift_log, self.segments, util,
                         self.done)
