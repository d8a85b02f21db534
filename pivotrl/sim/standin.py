"""A stand-in controller (queues, dispatcher, the three paradigms, a §4-style planner) for the simulator.

It exists so the simulator runs end to end before / without `pivotrl.core`; `control.make_controller`
prefers core's Controller whenever it is importable. It sees only what the runtime would see: queue
contents, generated-token counts, finished lengths (online means) and the cost profile's nominal rates
(the runtime fits those online).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass

from pivotrl.sim.config import ROLES, SimConfig
from pivotrl.sim.control import Decision, ReplicaView, Shift, WorkItem
from pivotrl.sim.costs import dp_efficiency, peak_decode_tps_per_device, shift_time, step_time
from pivotrl.sim.workload import mean_length


@dataclass
class _Rep:
    view: ReplicaView
    load: int = 0
    since: float = 0.0  # joined its role at


class _Lengths:
    """Length model of one role: the previous complete iteration's lengths (unbiased), else a prior.

    Finished lengths of the *current* iteration are not used directly: short sequences finish first, so
    their running mean badly underestimates the work left (survivorship bias). Remaining work of a
    sequence that has generated g tokens is E[L - g | L > g] over the previous iteration's lengths.
    """

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.sorted: list[int] = []
        self.suffix: list[float] = []  # suffix[i] = sum(sorted[i:])
        self.cur_iter = -1
        self.cur: list[int] = []

    def add(self, iteration: int, length: int) -> None:
        if iteration > self.cur_iter:
            if self.cur and self.cur_iter >= 0:
                self.sorted = sorted(self.cur)
                acc, suf = 0.0, [0.0] * (len(self.sorted) + 1)
                for i in range(len(self.sorted) - 1, -1, -1):
                    acc += self.sorted[i]
                    suf[i] = acc
                self.suffix = suf
            self.cur, self.cur_iter = [], iteration
        self.cur.append(length)

    @property
    def value(self) -> float:
        return self.suffix[0] / len(self.sorted) if self.sorted else self.prior

    def remaining(self, g: float) -> float:
        if not self.sorted:
            return max(self.prior - g, 0.5 * g + 1.0)
        i = bisect.bisect_right(self.sorted, g)
        n = len(self.sorted) - i
        if n == 0:
            return 0.5 * g + 1.0  # longer than anything seen: assume it is half done
        return self.suffix[i] / n - g


class StandinController:
    def __init__(self, cfg: SimConfig, mode: str, split: dict[str, int] | None = None) -> None:
        if mode not in ("colocated", "disaggregated", "shiftable"):
            raise ValueError(f"unknown mode {mode!r}")
        self.cfg, self.mode, self.split = cfg, mode, split
        c, wl = cfg.cost, cfg.workload
        self.g = {r: getattr(c, r).devices_per_replica for r in ROLES}
        self.prompt_mean = mean_length(wl.prompt_len)
        self.len_mean = {"rollout": _Lengths(mean_length(wl.response_len)),
                         "reward": _Lengths(mean_length(wl.critique_len))}
        judge_ctx = self.prompt_mean + self.len_mean["rollout"].value + wl.judge_template_tokens
        ctx = {"rollout": self.prompt_mean + 0.5 * self.len_mean["rollout"].value,
               "reward": judge_ctx + 0.5 * self.len_mean["reward"].value}
        self.ctx = ctx
        self.peak = {r: peak_decode_tps_per_device(getattr(c, r), ctx[r]) for r in ("rollout", "reward")}
        self.peak["train"] = c.train.tokens_per_s_per_device
        self.cap = {r: max(1, min(getattr(c, r).max_batch, int(getattr(c, r).kv_tokens // ctx[r])))
                    for r in ("rollout", "reward")}
        self.cap["train"] = 2 * c.train.micro_batch_seqs
        self.shift_s = {r: shift_time(c, r)[0] for r in ROLES}
        self.queues: dict[str, deque[str]] = {r: deque() for r in ROLES}
        self.items: dict[str, WorkItem] = {}
        self.where: dict[str, str] = {}  # item -> replica
        self.reps: dict[str, _Rep] = {}
        self.incoming: dict[str, int] = dict.fromkeys(ROLES, 0)  # devices shifting into a role
        # incremental aggregates so a planner tick is O(replicas), not O(sequences)
        self.n_items: dict[str, int] = dict.fromkeys(ROLES, 0)
        self.known_gen: dict[str, float] = dict.fromkeys(ROLES, 0.0)  # generated tokens of waiting items
        self.train_tokens = 0.0
        self.progress: dict[str, float] = {}
        self.next_id = 0
        self.log: list[Decision] = []

    # ---- events in ------------------------------------------------------------------------------
    def initial_allocation(self, devices: int) -> dict[str, int]:
        if self.mode == "colocated":
            return {"rollout": devices, "reward": 0, "train": 0}
        if self.mode == "disaggregated":
            assert self.split is not None, "disaggregated needs a split"
            return dict(self.split)
        # shiftable: an iteration starts with rollout work only; the planner moves devices from there
        g = self.g["rollout"]
        return {"rollout": devices // g * g, "reward": 0, "train": 0}

    def add_replica(self, view: ReplicaView, now: float) -> None:
        self.reps[view.replica_id] = _Rep(view, since=now if now > 0 else -math.inf)
        self.incoming[view.role] = max(0, self.incoming[view.role] - len(view.devices))

    def remove_replica(self, replica_id: str, now: float) -> None:
        self.reps.pop(replica_id, None)
        self.progress.pop(replica_id, None)

    def _enqueue(self, it: WorkItem, front: bool) -> None:
        self.items[it.item_id] = it
        self.where.pop(it.item_id, None)
        (self.queues[it.role].appendleft if front else self.queues[it.role].append)(it.item_id)
        self.known_gen[it.role] += it.generated

    def submit(self, items: list[WorkItem], now: float) -> None:
        for it in items:
            self._enqueue(it, front=False)
            self.n_items[it.role] += 1
            if it.role == "train":
                self.train_tokens += it.train_tokens

    def on_finished(self, replica_id: str, item_id: str, tokens: int, now: float) -> None:
        it = self.items.pop(item_id, None)
        self.where.pop(item_id, None)
        rep = self.reps.get(replica_id)
        if rep is not None:
            rep.load -= 1
        if it is None:
            return
        self.n_items[it.role] -= 1
        if it.role == "train":
            self.train_tokens -= it.train_tokens
        else:
            self.len_mean[it.role].add(it.iteration, tokens)
            self.progress[replica_id] = max(0.0, self.progress.get(replica_id, 0.0) - tokens)

    def on_aborted(self, replica_id: str, items: list[WorkItem], now: float) -> None:
        for it in reversed(items):
            self._enqueue(it, front=True)

    def on_step(self, replica_id: str, concurrency: int, step_time_s: float, now: float) -> None:
        pass  # the stand-in uses the nominal cost model; core fits f(n) online from these samples

    def on_progress(self, replica_id: str, generated_tokens: int, now: float) -> None:
        self.progress[replica_id] = float(generated_tokens)

    def on_shift_done(self, replica_id: str, role: str, phases: dict[str, float], now: float) -> None:
        pass

    # ---- decisions out --------------------------------------------------------------------------
    def dispatch(self, now: float) -> list[tuple[str, str]]:
        """Each waiting item to the least-loaded replica of its role (largest marginal gain for concave
        f(n) on identical replicas), never beyond a replica's batch capacity."""
        out: list[tuple[str, str]] = []
        for role in ROLES:
            q = self.queues[role]
            if not q:
                continue
            cap = self.cap[role]
            heap = [(r.load, rid) for rid, r in self.reps.items() if r.view.role == role and r.load < cap]
            heapq.heapify(heap)
            while q and heap:
                load, rid = heapq.heappop(heap)
                iid = q.popleft()
                self.known_gen[role] -= self.items[iid].generated
                self.where[iid] = rid
                self.reps[rid].load += 1
                out.append((iid, rid))
                if load + 1 < cap:
                    heapq.heappush(heap, (load + 1, rid))
        return out

    def tick(self, now: float) -> Decision | None:
        if self.mode == "disaggregated":
            return None
        if self.mode == "colocated":
            return self._colocated_tick(now)
        return self._shiftable_tick(now)

    # ---- paradigms ------------------------------------------------------------------------------
    def _colocated_tick(self, now: float) -> Decision | None:
        """All devices do one stage at a time; move them all when the current stage has run dry."""
        roles_now = {r.view.role for r in self.reps.values()}
        if len(roles_now) != 1 or any(self.incoming.values()):
            return None
        cur = roles_now.pop()
        if self.n_items[cur] > 0:
            return None
        for nxt in ROLES:
            if nxt != cur and self.queues[nxt]:
                return self._decide([Shift(rid, nxt) for rid in self.reps], f"colocated: {cur} -> {nxt}")
        return None

    def _decide(self, shifts: list[Shift], reason: str, gain: float = 0.0, penalty: float = 0.0) -> Decision:
        self.next_id += 1
        for sh in shifts:
            self.incoming[sh.to_role] += len(self.reps[sh.replica_id].view.devices)
        d = Decision(self.next_id, shifts, reason, gain, penalty)
        self.log.append(d)
        return d

    def _work(self) -> dict[str, dict[str, float]]:
        """Per role, in device-seconds at peak rate: work available now, work still to come from upstream
        stages, and how fast upstream devices feed it; plus item counts."""
        lm = {r: m.value for r, m in self.len_mean.items()}
        out: dict[str, dict[str, float]] = {}
        for role in ("rollout", "reward"):
            model = self.len_mean[role]
            waiting = len(self.queues[role])
            # waiting items: mostly fresh; aborted ones carry their generated tokens (use their mean)
            g_wait = self.known_gen[role] / waiting if waiting else 0.0
            remaining = waiting * model.remaining(g_wait)
            for rep in self.reps.values():
                if rep.view.role == role and rep.load > 0:
                    g = self.progress.get(rep.view.replica_id, 0.0) / rep.load
                    remaining += rep.load * model.remaining(g)
            out[role] = {"avail": remaining / self.peak[role], "n": self.n_items[role]}
        out["train"] = {"avail": self.train_tokens / self.peak["train"], "n": self.n_items["train"]}
        train_tok = self.prompt_mean + lm["rollout"]
        n_roll, n_rew = self.n_items["rollout"], self.n_items["reward"]
        out["rollout"]["upstream"] = 0.0
        out["reward"]["upstream"] = n_roll * lm["reward"] / self.peak["reward"]
        out["train"]["upstream"] = (n_roll + n_rew) * train_tok / self.peak["train"]
        # device-seconds of downstream work produced per second by one busy upstream device
        out["rollout"]["feed"] = 0.0
        out["reward"]["feed"] = self.peak["rollout"] / max(lm["rollout"], 1.0) * lm["reward"] / self.peak["reward"]
        out["train"]["feed"] = self.peak["reward"] / max(lm["reward"], 1.0) * train_tok / self.peak["train"]
        return out

    def _rate(self, role: str, devices: float, n_items: float) -> float:
        """Throughput model T_r in device-seconds of peak work per second: replicas x f(batch), where
        f(B) = B / step_time(B) (concave: consolidating a tail onto fewer replicas slows every sequence)."""
        if devices <= 0 or n_items <= 0:
            return 0.0
        g = self.g[role]
        replicas = devices / g
        if role == "train":
            useful = min(replicas, math.ceil(n_items / self.cfg.cost.train.micro_batch_seqs))
            return useful * g * dp_efficiency(self.cfg.cost.train, max(replicas, 1))
        batch = min(self.cap[role], max(n_items / replicas, 1.0))
        rc = getattr(self.cfg.cost, role)
        f = batch / step_time(rc, int(batch), batch * self.ctx[role])
        return min(replicas, n_items) * f / self.peak[role]

    def _shiftable_tick(self, now: float) -> Decision | None:
        """DESIGN §4: price donor replicas, evaluate moving k of them to each role over the horizon H with
        the throughput model (each role's output capped by the work it has and will receive from
        upstream), and take the largest positive B = G - phi above the hysteresis margin."""
        H = self.cfg.scheduler.horizon_s
        work = self._work()
        ndev = dict(self.incoming)
        for rep in self.reps.values():
            ndev[rep.view.role] += len(rep.view.devices)
        lm = {r: m.value for r, m in self.len_mean.items()}

        def processed(role: str, n_old: float, n_new: float, feed_rate: float) -> float:
            w = work[role]
            inflow = min(w["upstream"], w["feed"] * feed_rate * H)
            cap = w["avail"] + inflow
            # items the role will hold on average over the horizon (upstream work arrives as items too)
            per_item = w["avail"] / w["n"] if w["n"] else (lm.get(role, 1.0) / self.peak[role])
            items = w["n"] + 0.5 * inflow / max(per_item, 1e-9)
            r_old = self._rate(role, n_old, items)
            r_new = self._rate(role, n_old + n_new, items)
            return min(r_old * H + (r_new - r_old) * max(H - self.shift_s[role], 0.0), cap)

        def total(alloc: dict[str, float], to: str | None, m: float) -> float:
            feed = {"rollout": 0.0,
                    "reward": self._rate("rollout", alloc["rollout"], work["rollout"]["n"]),
                    "train": self._rate("reward", alloc["reward"], work["reward"]["n"])}
            return sum(processed(r, alloc[r] - (m if r == to else 0.0), m if r == to else 0.0, feed[r])
                       for r in ROLES)

        base_alloc = {r: float(ndev[r]) for r in ROLES}
        base = total(base_alloc, None, 0.0)
        best: tuple[float, str, str, list[str], float, float] | None = None
        cooldown = self.cfg.scheduler.cooldown_s
        for u in ROLES:
            if work[u]["avail"] <= 0 and work[u]["upstream"] <= 0:
                continue
            for d in ROLES:
                if d == u:
                    continue
                donors = sorted((rep for rep in self.reps.values()
                                 if rep.view.role == d and now - rep.since >= cooldown),
                                key=lambda rep: rep.load)
                chosen: list[str] = []
                moved, reprefill = 0, 0.0
                for rep in donors:
                    chosen.append(rep.view.replica_id)
                    moved += len(rep.view.devices)
                    reprefill += rep.load * self._reprefill_s(d)
                    if moved % self.g[u]:
                        continue
                    alloc = dict(base_alloc)
                    alloc[d] -= moved
                    alloc[u] += moved
                    gain = total(alloc, u, moved) - base
                    b = gain - reprefill
                    if b > self.cfg.scheduler.hysteresis * moved * H and (best is None or b > best[0]):
                        best = (b, u, d, list(chosen), gain, reprefill)
        if best is None:
            return None
        b, u, d, chosen, gain, pen = best
        reason = (f"{len(chosen)} {d} replica(s) -> {u}: G={gain:.1f} dev*s, phi={pen:.1f} dev*s, B={b:.1f}")
        return self._decide([Shift(rid, u) for rid in chosen], reason, gain, pen)

    def _reprefill_s(self, role: str) -> float:
        """Device-seconds to re-prefill one migrated sequence elsewhere (train: a lost micro-batch share)."""
        c = self.cfg.cost
        ctx = self.prompt_mean + self.len_mean["rollout"].value
        if role == "train":
            return ctx / c.train.tokens_per_s_per_device
        rc = getattr(c, role)
        return ctx / rc.prefill_tokens_per_s * rc.devices_per_replica


def proportional_split(cfg: SimConfig, devices: int) -> dict[str, int]:
    """Devices per role in proportion to each role's expected work at peak rates (the fluid optimum),
    rounded to whole replicas with at least one replica per role."""
    from pivotrl.sim.fluid import work_per_iteration

    w = work_per_iteration(cfg)
    g = {r: getattr(cfg.cost, r).devices_per_replica for r in ROLES}
    tot = sum(w[r] for r in ROLES)
    alloc = {r: max(g[r], round(devices * w[r] / tot / g[r]) * g[r]) for r in ROLES}
    while sum(alloc.values()) > devices:
        r = max(alloc, key=lambda k: alloc[k] - devices * w[k] / tot if alloc[k] > g[k] else -1e18)
        alloc[r] -= g[r]
    while sum(alloc.values()) < devices:
        short = {r: devices * w[r] / tot - alloc[r] for r in ROLES if sum(alloc.values()) + g[r] <= devices}
        if not short:
            break
        r = max(short, key=lambda k: short[k])
        alloc[r] += g[r]
    return alloc
