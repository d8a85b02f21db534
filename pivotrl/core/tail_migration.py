"""Tail migration: an idle replica takes a long-running sequence from a replica that runs several.

Why: dispatch places queued work for throughput, before anyone knows how long each item will be. Once a
generation role's queue is empty, its last items decode where they were placed, and on a heavy-tailed
workload two or three of the iteration's longest can share one replica to the end, each step slowed by
the others' rows and context, while replicas of the same role stand idle. An on-policy iteration ends
with its longest item, so its step time is the iteration's critical path (random draw 31: three
32,768-token rollouts on one replica, 8.8 ms steps against 7.4 ms alone, ending 19 s after the longest
that ran alone). Shift-up rebalancing moves work only onto a replica that just joined the role; this is
the same Abort/Dispatch onto a replica that has just gone idle.

Only in a role's tail: its queue is empty and nothing more is coming to it this iteration (no rollout
left to submit, no upstream item live); before that an idle replica waits for work on its way, and the
planner may want it in another role. A move is taken only where it is expected to pay: the sequence's
expected remaining tokens (from the role's length profile, `Residual`) times the step it saves (its
replica's step at its rows' context against a step alone at its own context), less what resuming costs
(prefilling its context again) and one more step. Each idle replica takes at most one sequence a tick,
the best move first.

Only `Shiftable` migrates (`Policy.tail_residuals`): the static split and colocated baselines stand for
systems that place work once, as they did before.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from pivotrl.core.dispatcher import cheapest_recent
from pivotrl.core.stage import length_at_fraction
from pivotrl.core.state import ClusterState
from pivotrl.core.types import PIPELINE, Replica, ReplicaState, Role, Sequence

#: Points of the quantile function averaged for a conditional mean (`Residual.expected_left`).
_GRID = (np.arange(64) + 0.5) / 64


@dataclass(frozen=True)
class Residual:
    """A role's item lengths as survival points: a fraction `fs[i]` of the items is at least `ls[i]` tokens
    long (`fs` decreasing to the longest's 1/n, `ls` non-decreasing), log-interpolated in between as
    `pivotrl.core.stage.Stage.length_at` reads them (`length_at_fraction`)."""

    fs: tuple[float, ...]
    ls: tuple[float, ...]

    @classmethod
    def from_points(cls, fs: np.ndarray, ls: np.ndarray) -> Residual:
        pts = sorted(zip((float(f) for f in fs), (float(x) for x in ls), strict=True), key=lambda p: -p[0])
        if not pts or pts[0][0] < 1.0:
            pts.insert(0, (1.0, 0.0))  # every item is at least 0 tokens long
        f = np.asarray([p[0] for p in pts])
        x = np.maximum.accumulate(np.asarray([max(p[1], 0.0) for p in pts]))
        return cls(tuple(f), tuple(x))

    def length_at(self, f: np.ndarray) -> np.ndarray:
        """The length exceeded by a fraction `f` of the items."""
        return length_at_fraction(np.asarray(self.fs), np.asarray(self.ls), f)

    def survival(self, length: float) -> float:
        """The fraction of items longer than `length` (0 past the longest point)."""
        fs, ls = np.asarray(self.fs), np.asarray(self.ls)
        if length >= ls[-1]:
            return 0.0
        # the largest fraction whose length exceeds `length`: invert the interpolation on its segment
        i = int(np.searchsorted(ls, length, side="right"))
        if i == 0:
            return 1.0
        lo, hi = ls[i - 1], ls[i]
        t = 0.0 if hi <= lo else (length - lo) / (hi - lo)
        return float(math.exp(math.log(fs[i - 1]) + t * (math.log(fs[i]) - math.log(fs[i - 1]))))

    def expected_left(self, generated: float) -> float | None:
        """E[L − generated | L > generated]: the tokens an item that has generated `generated` is expected
        still to write. None past the longest point (the profile does not know such items)."""
        s = self.survival(generated)
        if s <= 0.0:
            return None
        mean_longer = float(self.length_at(_GRID * s).mean())
        return max(mean_longer - generated, 1.0)


def step_s(rep: Replica, rows: int, context: float) -> float:
    """A step of `rep`'s line with `rows` rows holding `context` tokens in all."""
    m = rep.model
    x = rows * m.tokens_per_seq_step
    return m.a + m.b_at(context / max(rows, 1)) * x


@dataclass(frozen=True)
class Move:
    """Abort `seq_id` on `donor`, resume it on `taker` (both replicas of its role)."""

    seq_id: str
    donor: str
    taker: str
    gain_s: float  # seconds the sequence is expected to finish sooner


def left_tokens(seq: Sequence, residual: Residual | None) -> float:
    """Tokens `seq` is expected still to write: the role's length profile where it knows the item's age,
    else the sequence's own estimate; never above its budget."""
    budget = max(seq.max_new_tokens - seq.generated, 0)
    est = None if residual is None else residual.expected_left(seq.generated)
    if est is None:
        est = seq.remaining_estimate()
    return float(min(est, budget))


def best_from(rep: Replica, residual: Residual | None,
              prefill_tokens_per_s: float) -> tuple[float, Sequence] | None:
    """The paying move of one of `rep`'s sequences onto an idle replica of its role, with its gain in
    seconds: its furthest sequence (on a heavy tail the one expected to run longest) or the cheapest to
    resume of its most recently started (`dispatcher.cheapest_recent`: O(1) a replica). None when `rep`
    runs fewer than two or neither pays."""
    if rep.n < 2:
        return None
    here = step_s(rep, rep.n, rep.context)
    best: tuple[float, Sequence] | None = None
    candidates = {s.seq_id: s for s in (rep.furthest(), cheapest_recent(rep)) if s is not None}
    for seq in candidates.values():
        alone = step_s(rep, 1, seq.context_tokens)
        resume = seq.context_tokens / max(prefill_tokens_per_s, 1e-9)
        gain = left_tokens(seq, residual) * (here - alone) - resume - alone
        if gain > 0.0 and (best is None or gain > best[0]):
            best = (gain, seq)
    return best


def nothing_to_come(state: ClusterState, role: Role) -> bool:
    """Is `role` in its tail: every item it will get this iteration already submitted to it (no rollout
    left to submit, no upstream item live)? Before that an idle replica is waiting for work that is on its
    way, and the planner may want it elsewhere."""
    if state.rollouts_unsubmitted():
        return False
    return not any(state.has_work(r) for r in PIPELINE[: PIPELINE.index(role)])


def tail_moves(state: ClusterState, role: Role, residual: Residual | None) -> list[Move]:
    """Moves for `role` this tick: while an idle active replica of the role exists and its queue is empty,
    the best paying move across the replicas running two or more goes to one of them (each taker one
    move). Applied to `state` as they are chosen (`ClusterState.move`), so the caller only reports them."""
    if len(state.queues[role]) or state.config.spec(role).whole_batches or not nothing_to_come(state, role):
        return []
    reps = sorted(state.by_role[role].values(), key=lambda r: r.replica_id)
    takers = [r for r in reps if r.state is ReplicaState.ACTIVE and r.n == 0]
    if not takers:
        return []
    role_prefill = state.config.spec(role).prefill_tokens_per_s

    def best(rep: Replica) -> tuple[float, Sequence] | None:
        return best_from(rep, residual, rep.model.prefill_tokens_per_s or role_prefill)

    heap: list[tuple[float, str, Replica, Sequence]] = []
    for rep in reps:
        if rep.state is not ReplicaState.ACTIVE:
            continue
        found = best(rep)
        if found is not None:
            heap.append((-found[0], rep.replica_id, rep, found[1]))
    heapq.heapify(heap)
    out: list[Move] = []
    while heap and takers:
        neg, _, donor, seq = heapq.heappop(heap)
        need = state.kv_need(seq)
        taker = next((t for t in takers if t.fits(need)), None)
        if taker is None:
            continue
        takers.remove(taker)
        state.move(seq, taker)
        out.append(Move(seq.seq_id, donor.replica_id, taker.replica_id, -neg))
        again = best(donor)
        if again is not None:
            heapq.heappush(heap, (-again[0], donor.replica_id, donor, again[1]))
    return out
