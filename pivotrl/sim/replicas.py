"""Simulated replicas: a continuous-batching generation replica and a data-parallel train replica.

A `GenReplica` keeps its batch as a heap of finish steps on a shared (continuous) step counter, so
admitting, finishing or aborting a sequence is O(log n) and advancing time is O(1) (see `costs`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from pivotrl.sim.config import GenRoleCost, TrainRoleCost
from pivotrl.sim.costs import decode_steps, decode_time, prefill_time

EPS = 1e-6


@dataclass(slots=True)
class Running:
    """A sequence decoding on a replica: `target` tokens in all, `gen0` already generated at admission."""

    item_id: str
    prompt: int
    gen0: int
    target: int
    s0: float  # replica step counter at admission

    def finish_step(self) -> float:
        return self.s0 + (self.target - self.gen0)


@dataclass
class GenReplica:
    replica_id: str
    role: str
    devices: tuple[int, ...]
    cost: GenRoleCost
    t: float = 0.0  # state valid up to this time
    paused_until: float = 0.0  # prefill / weight sync in progress until then
    step: float = 0.0
    running: dict[str, Running] = field(default_factory=dict)
    heap: list[tuple[float, str]] = field(default_factory=list)
    k_sum: float = 0.0  # sum over running of (prompt + gen0 - s0): context = k_sum + B*step
    g_sum: float = 0.0  # sum over running of (gen0 - s0): generated so far = g_sum + B*step
    version: int = 0  # bumps invalidate queued events
    busy_time: float = 0.0
    tokens: float = 0.0
    prefill_tokens: float = 0.0
    slow: float = 1.0  # step and prefill time multiplier: the host's cores shared (`set_slow`)
    prefills: dict[str, tuple[float, float]] = field(default_factory=dict)  # item -> its prefill's span

    # -- analytic decode --------------------------------------------------------------------------
    def _coeffs(self) -> tuple[float, float]:
        d, b, f = self.cost.decode, len(self.running), self.slow
        return f * (d.a_s + d.b_s * b + d.c_s * self.k_sum), f * d.c_s * b

    def generated_tokens(self) -> float:
        """Tokens generated so far by the running sequences (what a progress report carries)."""
        return self.g_sum + len(self.running) * self.step

    def context_tokens(self) -> float:
        return self.k_sum + len(self.running) * self.step

    def advance(self, now: float) -> None:
        """Bring the state forward to `now` (decode only runs outside prefill pauses)."""
        start = max(self.t, self.paused_until)
        if now > start and self.running:
            alpha, beta = self._coeffs()
            x = decode_steps(alpha, beta, self.step, now - start)
            self.step += x
            self.tokens += x * len(self.running)
            self.busy_time += now - start
        if now > self.t:
            self.t = now

    def next_finish_time(self) -> float:
        while self.heap and self.heap[0][1] not in self.running:
            heapq.heappop(self.heap)
        if not self.heap:
            return math.inf
        alpha, beta = self._coeffs()
        x = max(self.heap[0][0] - self.step, 0.0)
        return max(self.t, self.paused_until) + decode_time(alpha, beta, self.step, x)

    def pop_finished(self) -> list[Running]:
        done = []
        while self.heap and self.heap[0][0] <= self.step + EPS:
            _, iid = heapq.heappop(self.heap)
            r = self.running.pop(iid, None)
            if r is not None:
                self.prefills.pop(iid, None)
                self.k_sum -= r.prompt + r.gen0 - r.s0
                self.g_sum -= r.gen0 - r.s0
                done.append(r)
        if not self.running:  # as in `abort_one`: no rounding residue left to refuse an item that fits
            self.k_sum = self.g_sum = 0.0
        return done

    # -- admission / abort ------------------------------------------------------------------------
    def can_admit(self, context: int) -> bool:
        if len(self.running) >= self.cost.max_batch:
            return False
        return self.context_tokens() + context <= self.cost.kv_tokens

    def admit(self, now: float, item_id: str, prompt: int, generated: int, target: int) -> None:
        """Start a sequence: prefill its prompt (+ already generated tokens when it resumes)."""
        self.advance(now)
        ctx = prompt + generated
        pre = prefill_time(self.cost, ctx) * self.slow
        begin = max(now, self.paused_until)
        self.paused_until = begin + pre
        self.prefills[item_id] = (begin, begin + pre)
        self.busy_time += pre
        self.prefill_tokens += ctx
        r = Running(item_id, prompt, generated, max(target, generated + 1), self.step)
        self.running[item_id] = r
        self.k_sum += prompt + generated - self.step
        self.g_sum += generated - self.step
        heapq.heappush(self.heap, (r.finish_step(), item_id))
        self.version += 1

    def busy(self, now: float) -> bool:
        """Decoding, or prefilling / loading a version (a pause)."""
        return bool(self.running) or self.paused_until > now

    def set_slow(self, now: float, slow: float) -> None:
        """Work at `slow` times the profile's step time from `now` on (what is left of a pause too)."""
        self.advance(now)
        if self.paused_until > now:
            left = self.paused_until - now
            self.paused_until = now + left * slow / self.slow
            self.busy_time += left * (slow / self.slow - 1.0)
            k = slow / self.slow
            self.prefills = {i: (now + max(b - now, 0.0) * k, now + (e - now) * k) if e > now else (b, e)
                             for i, (b, e) in self.prefills.items()}
        self.slow = slow
        self.version += 1

    def pause(self, now: float, seconds: float) -> None:
        self.advance(now)
        self.paused_until = max(now, self.paused_until) + seconds
        self.version += 1

    def abort_all(self, now: float) -> list[tuple[str, int]]:
        """Stop every running sequence; returns (item_id, tokens generated so far) to resume elsewhere."""
        self.advance(now)
        out = []
        for r in self.running.values():
            gen = min(r.target - 1, r.gen0 + int(self.step - r.s0 + EPS))
            out.append((r.item_id, max(gen, r.gen0)))
        self.running.clear()
        self.prefills.clear()
        self.heap.clear()
        self.k_sum = 0.0
        self.g_sum = 0.0
        self.version += 1
        return out

    def generated_of(self, item_id: str) -> int:
        """Whole tokens generated so far by a running sequence (what a progress report carries)."""
        r = self.running[item_id]
        return min(r.target - 1, r.gen0 + int(self.step - r.s0 + EPS))

    def abort_one(self, now: float, item_id: str) -> int:
        """Stop one sequence; returns the whole tokens it keeps (a fractional step in flight is lost)."""
        self.advance(now)
        gen = max(self.generated_of(item_id), self.running[item_id].gen0)
        r = self.running.pop(item_id)
        self._drop_prefill(now, item_id)
        self.k_sum -= r.prompt + r.gen0 - r.s0
        self.g_sum -= r.gen0 - r.s0
        if not self.running:
            self.k_sum = self.g_sum = 0.0
        self.version += 1
        return gen

    def _drop_prefill(self, now: float, item_id: str) -> None:
        """An aborted sequence's prefill not yet done is not done: the replica's pause shrinks by it and the
        prefills queued behind it move up. Why: an engine prefills a waiting request when it admits it, so a
        request aborted while it waits costs nothing; charging it held a replica handed a whole queue at an
        iteration's start, then relieved of most of it by new replicas, ~2.6 s in prefills of prompts it
        never ran (random draw 324, docs/decisions.md)."""
        begin, end = self.prefills.pop(item_id, (0.0, 0.0))
        left = end - max(begin, now)
        if left <= 0.0:
            return
        self.paused_until -= left
        self.busy_time -= left
        for i, (b, e) in self.prefills.items():
            if b >= end - EPS:
                self.prefills[i] = (b - left, e - left)

    @property
    def load(self) -> int:
        return len(self.running)

    def idle(self) -> bool:
        return not self.running


@dataclass
class TrainReplica:
    """Processes micro-batches of train items (token counts) one after another at a DP-scaled rate."""

    replica_id: str
    role: str
    devices: tuple[int, ...]
    cost: TrainRoleCost
    t: float = 0.0
    batch: list[tuple[str, int]] = field(default_factory=list)
    pending: list[tuple[str, int]] = field(default_factory=list)
    batch_end: float = math.inf
    batch_start: float = 0.0
    version: int = 0
    busy_time: float = 0.0
    tokens: float = 0.0
    slow: float = 1.0  # micro-batch time multiplier: the host's cores shared (`set_slow`)

    def start_next(self, now: float, rate: float) -> None:
        """Begin the next micro-batch from `pending` if idle."""
        if self.batch or not self.pending:
            return
        take = self.cost.micro_batch_seqs
        self.batch, self.pending = self.pending[:take], self.pending[take:]
        toks = sum(n for _, n in self.batch)
        self.batch_start = now
        self.batch_end = now + toks / rate * self.slow
        self.version += 1

    def finish(self, now: float) -> list[tuple[str, int]]:
        done, self.batch = self.batch, []
        self.busy_time += now - self.batch_start
        self.tokens += sum(n for _, n in done)
        self.batch_end = math.inf
        self.version += 1
        return done

    def abort_one(self, now: float, item_id: str, rate: float) -> None:
        """Drop one item. If it was in the micro-batch in flight, that batch's partial work is lost and the
        rest of the batch starts over (gradients of a micro-batch are all-or-nothing)."""
        if any(i == item_id for i, _ in self.pending):
            self.pending = [(i, n) for i, n in self.pending if i != item_id]
            return
        if any(i == item_id for i, _ in self.batch):
            self.busy_time += now - self.batch_start
            rest = [(i, n) for i, n in self.batch if i != item_id]
            self.batch = []
            self.batch_end = math.inf
            self.pending = rest + self.pending
            self.version += 1
            self.start_next(now, rate)

    def busy(self, now: float) -> bool:
        return bool(self.batch)

    def set_slow(self, now: float, slow: float) -> None:
        """Work at `slow` times the profile's time from `now` on: what is left of the batch stretches."""
        if self.batch:
            self.batch_end = now + (self.batch_end - now) * slow / self.slow
        self.slow = slow
        self.version += 1

    @property
    def load(self) -> int:
        return len(self.batch) + len(self.pending)

    def idle(self) -> bool:
        return not self.batch and not self.pending
