"""A stand-in controller (queues, dispatcher, the three paradigms, a §4-style planner) for the simulator.

It exists so the simulator runs end to end before / without `pivotrl.core`; `control.make_controller`
prefers core's Controller whenever it is importable. It sees only what the runtime would see: queue
contents, generated-token counts, finished lengths (online means) and the cost profile's nominal rates
(the runtime fits those online).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from pivotrl.sim.config import ROLES, SimConfig
from pivotrl.sim.control import Decision, ReplicaView, Shift, WorkItem
from pivotrl.sim.costs import peak_decode_tps_per_device, shift_time
from pivotrl.sim.workload import mean_length


@dataclass
class _Rep:
    view: ReplicaView
    load: int = 0
    since: float = 0.0  # joined its role at


class _Mean:
    """Online mean with a prior worth `weight` observations."""

    def __init__(self, prior: float, weight: float = 20.0) -> None:
        self.total, self.n = prior * weight, weight

    def add(self, x: float) -> None:
        self.total += x
        self.n += 1

    @property
    def value(self) -> float:
        return self.total / self.n


class StandinController:
    def __init__(self, cfg: SimConfig, mode: str, split: dict[str, int] | None = None) -> None:
        if mode not in ("colocated", "disaggregated", "shiftable"):
            raise ValueError(f"unknown mode {mode!r}")
        self.cfg, self.mode, self.split = cfg, mode, split
        c, wl = cfg.cost, cfg.workload
        self.g = {"rollout": c.rollout.devices_per_replica, "reward": c.reward.devices_per_replica,
                  "train": c.train.devices_per_replica}
        self.prompt_mean = mean_length(wl.prompt_len)
        self.len_mean = {"rollout": _Mean(mean_length(wl.response_len)),
                         "reward": _Mean(mean_length(wl.critique_len))}
        judge_ctx = self.prompt_mean + self.len_mean["rollout"].value + wl.judge_template_tokens
        ctx = {"rollout": self.prompt_mean + 0.5 * self.len_mean["rollout"].value,
               "reward": judge_ctx + 0.5 * self.len_mean["reward"].value}
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
        self.next_id = 0
        self.log: list[Decision] = []
        self.last_shift: dict[int, float] = {}

    # ---- events in ------------------------------------------------------------------------------
    def initial_allocation(self, devices: int) -> dict[str, int]:
        if self.mode == "colocated":
            return {"rollout": devices, "reward": 0, "train": 0}
        if self.mode == "disaggregated":
            assert self.split is not None, "disaggregated needs a split"
            return dict(self.split)
        return proportional_split(self.cfg, devices)

    def add_replica(self, view: ReplicaView, now: float) -> None:
        self.reps[view.replica_id] = _Rep(view, since=now)
        n = len(view.devices)
        self.incoming[view.role] = max(0, self.incoming[view.role] - n)

    def remove_replica(self, replica_id: str, now: float) -> None:
        self.reps.pop(replica_id, None)

    def submit(self, items: list[WorkItem], now: float) -> None:
        for it in items:
            self.items[it.item_id] = it
            self.queues[it.role].append(it.item_id)

    def on_finished(self, replica_id: str, item_id: str, tokens: int, now: float) -> None:
        it = self.items.pop(item_id, None)
        self.where.pop(item_id, None)
        rep = self.reps.get(replica_id)
        if rep is not None:
            rep.load -= 1
        if it is not None and it.role in self.len_mean:
            self.len_mean[it.role].add(tokens)

    def on_aborted(self, replica_id: str, items: list[WorkItem], now: float) -> None:
        for it in reversed(items):
            self.items[it.item_id] = it
            self.where.pop(it.item_id, None)
            self.queues[it.role].appendleft(it.item_id)

    def on_step(self, replica_id: str, concurrency: int, step_time_s: float, now: float) -> None:
        pass  # the stand-in uses the nominal cost model; core fits f(n) online from these samples

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
            heap = [(r.load, rid) for rid, r in self.reps.items() if r.view.role == role and r.load < self.cap[role]]
            heapq.heapify(heap)
            while q and heap:
                load, rid = heapq.heappop(heap)
                iid = q.popleft()
                self.where[iid] = rid
                self.reps[rid].load += 1
                out.append((iid, rid))
                if load + 1 < self.cap[role]:
                    heapq.heappush(heap, (load + 1, rid))
        return out

    def tick(self, now: float) -> Decision | None:
        if self.mode == "disaggregated":
            return None
        if self.mode == "colocated":
            return self._colocated_tick(now)
        return self._shiftable_tick(now)

    # ---- paradigms ------------------------------------------------------------------------------
    def _role_items(self, role: str) -> int:
        return len(self.queues[role]) + sum(r.load for r in self.reps.values() if r.view.role == role)

    def _colocated_tick(self, now: float) -> Decision | None:
        """All devices do one stage at a time; move them all when the current stage has run dry."""
        roles_now = {r.view.role for r in self.reps.values()}
        if len(roles_now) != 1 or any(self.incoming.values()):
            return None
        cur = roles_now.pop()
        if self._role_items(cur) > 0:
            return None
        for nxt in ROLES:
            if nxt != cur and self.queues[nxt]:
                return self._decide([Shift(rid, nxt) for rid in self.reps], f"colocated: {cur} -> {nxt}")
        return None

    def _decide(self, shifts: list[Shift], reason: str, gain: float = 0.0, penalty: float = 0.0) -> Decision:
        self.next_id += 1
        for s in shifts:
            rep = self.reps[s.replica_id]
            self.incoming[s.to_role] += len(rep.view.devices)
        d = Decision(self.next_id, shifts, reason, gain, penalty)
        self.log.append(d)
        return d

    def _work(self) -> dict[str, dict[str, float]]:
        """Per role: available work now (device-seconds at peak), items, and inflow from upstream."""
        lm = {r: m.value for r, m in self.len_mean.items()}
        out: dict[str, dict[str, float]] = {}
        for role in ROLES:
            toks, n = 0.0, 0
            for iid in self.queues[role]:
                toks += self._remaining(self.items[iid], lm)
                n += 1
            for iid, _rid in self.where.items():
                it = self.items.get(iid)
                if it is not None and it.role == role:
                    toks += self._remaining(it, lm)
                    n += 1
            out[role] = {"avail": toks / self.peak[role], "n": n}
        train_tok = self.prompt_mean + lm["rollout"]
        n_roll, n_rew = out["rollout"]["n"], out["reward"]["n"]
        out["reward"]["upstream"] = n_roll * lm["reward"] / self.peak["reward"]
        out["train"]["upstream"] = (n_roll + n_rew) * train_tok / self.peak["train"]
        out["rollout"]["upstream"] = 0.0
        # upstream output rates in downstream device-seconds per second
        out["reward"]["rate_per_dev_in"] = (self.peak["rollout"] / max(lm["rollout"], 1)) * lm["reward"] / self.peak["reward"]
        out["train"]["rate_per_dev_in"] = (self.peak["reward"] / max(lm["reward"], 1)) * train_tok / self.peak["train"]
        out["rollout"]["rate_per_dev_in"] = 0.0
        return out

    @staticmethod
    def _remaining(it: WorkItem, lm: dict[str, float]) -> float:
        if it.role == "train":
            return float(it.train_tokens)
        mean = lm[it.role]
        return max(mean - it.generated, 0.5 * it.generated + 1.0)

    def _shiftable_tick(self, now: float) -> Decision | None:
        """DESIGN §4: pick the most-behind role, price donor replicas, evaluate moving k of them over the
        horizon H (output capped by the work each role has and will receive), take the best positive B."""
        H = self.cfg.scheduler.horizon_s
        work = self._work()
        ndev = {r: 0 for r in ROLES}
        for rep in self.reps.values():
            ndev[rep.view.role] += len(rep.view.devices)
        for r in ROLES:
            ndev[r] += self.incoming[r]

        def useful(role: str, extra_items: float = 0.0) -> float:
            n_items = work[role]["n"] + extra_items
            return max(self.g[role], math.ceil(n_items / self.cap[role]) * self.g[role])

        def processed(role: str, n_old: float, n_new_dev: float, n_upstream_dev: float, shift_s: float) -> float:
            w = work[role]
            cap = w["avail"] + min(w["upstream"], w["rate_per_dev_in"] * n_upstream_dev * H)
            inflow_items = 0.0 if role == "rollout" else cap / max(w["avail"], 1e-9) * 0
            u = useful(role, inflow_items)
            if role != "rollout" and w["upstream"] > 0:
                u = max(u, n_old + n_new_dev)  # incoming work can use them (capped by `cap` below)
            base = min(n_old, u) * H
            new = min(n_new_dev, max(u - n_old, 0.0)) * max(H - shift_s, 0.0)
            return min(base + new, cap)

        def total(alloc: dict[str, float], moved_to: str | None, m: float) -> float:
            upstream_dev = {"rollout": 0.0, "reward": alloc["rollout"], "train": alloc["reward"]}
            s = 0.0
            for r in ROLES:
                n_new = m if r == moved_to else 0.0
                n_old = alloc[r] - n_new
                s += processed(r, n_old, n_new, upstream_dev[r], self.shift_s[r])
            return s

        tau = {}
        for r in ROLES:
            if work[r]["avail"] > 0:
                tau[r] = work[r]["avail"] / max(min(ndev[r], useful(r)), 1e-9) if ndev[r] else math.inf
        if not tau:
            return None
        base_alloc = {r: float(ndev[r]) for r in ROLES}
        base = total(base_alloc, None, 0.0)
        best: tuple[float, str, str, list[str], float, float] | None = None
        for u in sorted(tau, key=lambda r: -tau[r]):
            for d in ROLES:
                if d == u:
                    continue
                donors = sorted(
                    (rep for rep in self.reps.values()
                     if rep.view.role == d and now - rep.since >= self.cfg.scheduler.cooldown_s),
                    key=lambda rep: rep.load,
                )
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
            if best is not None:
                break
        if best is None:
            return None
        b, u, d, chosen, gain, pen = best
        reason = (f"shift {len(chosen)} {d} replica(s) -> {u}: tau={tau.get(u, 0):.1f}s, "
                  f"G={gain:.1f} dev*s, phi={pen:.1f} dev*s, B={b:.1f}")
        return self._decide([Shift(rid, u) for rid in chosen], reason, gain, pen)

    def _reprefill_s(self, role: str) -> float:
        """Device-seconds to re-prefill one migrated sequence elsewhere (train: a lost micro-batch share)."""
        c = self.cfg.cost
        if role == "train":
            return (self.prompt_mean + self.len_mean["rollout"].value) / c.train.tokens_per_s_per_device
        rc = getattr(c, role)
        ctx = self.prompt_mean + self.len_mean["rollout"].value
        return ctx / rc.prefill_tokens_per_s * rc.devices_per_replica


def proportional_split(cfg: SimConfig, devices: int) -> dict[str, int]:
    """Devices per role in proportion to each role's expected work at peak rates (the fluid optimum),
    rounded to whole replicas with at least one replica per role."""
    from pivotrl.sim.fluid import work_per_iteration

    w = work_per_iteration(cfg)
    g = {r: getattr(cfg.cost, r).devices_per_replica for r in ROLES}
    tot = sum(w[r] for r in ROLES)
    alloc = {r: max(g[r], int(round(devices * w[r] / tot / g[r])) * g[r]) for r in ROLES}
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
