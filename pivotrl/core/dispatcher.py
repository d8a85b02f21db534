"""Shift-aware dispatch: throughput-maximising placement, and Abort/Dispatch migration around a shift.

Dispatch: the head of a role's shared queue goes to the active replica whose throughput grows most by taking
one more sequence, f_i(n_i+1) − f_i(n_i), among those with room (sequence slots and KV tokens). Because every
f_i is concave, a max-heap keyed by that marginal gain gives the greedy optimum at O(log I) per sequence.

Shift-down (a replica leaves its role): Abort every sequence it runs → they re-enter the shared queue ahead
of fresh work, keeping their tokens → Dispatch onto the role's remaining replicas. O(I·NSeq) in the worst
case (every sequence of the role re-placed), O(NSeq_j · log I) typically.

Shift-up (replicas join a role): Dispatch waiting work first (the newcomers have the largest marginal gain,
f(1) − f(0)); if the queue runs dry while they sit below their share, compute the throughput-maximising
share of every replica (greedy on marginal gains over the role's running count, O(NSeq log I)), Abort the
excess from the most loaded replicas — the sequences with the shortest context, cheapest to prefill again —
and Dispatch them. O(I·NSeq + I log I).
"""

from __future__ import annotations

import heapq

from pivotrl.core.state import ClusterState
from pivotrl.core.types import Assignment, Replica, Role, Sequence


def dispatch_role(state: ClusterState, role: Role) -> list[Assignment]:
    """Place waiting sequences of `role` until the queue is empty or no active replica has room.

    Strict queue order: if the head does not fit anywhere (KV), nothing behind it jumps ahead, so resumed
    sequences are never starved by smaller fresh ones.
    """
    queue = state.queues[role]
    if not len(queue):
        return []
    heap: list[tuple[float, int, Replica]] = []
    for idx, rep in enumerate(state.active(role)):
        if rep.n < rep.max_seqs:
            heap.append((-rep.model.marginal_gain(rep.n), idx, rep))
    heapq.heapify(heap)
    out: list[Assignment] = []
    while heap:
        seq = queue.peek()
        if seq is None:
            break
        skipped: list[tuple[float, int, Replica]] = []
        chosen: tuple[float, int, Replica] | None = None
        while heap:
            item = heapq.heappop(heap)
            if item[2].fits(seq):
                chosen = item
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(heap, item)
        if chosen is None:
            break
        queue.pop()
        rep = chosen[2]
        state.start(seq, rep)
        out.append(Assignment(seq.seq_id, rep.replica_id))
        if rep.n < rep.max_seqs:
            heapq.heappush(heap, (-rep.model.marginal_gain(rep.n), chosen[1], rep))
    return out


def dispatch_all(state: ClusterState) -> list[Assignment]:
    out: list[Assignment] = []
    for role in state.roles:
        out.extend(dispatch_role(state, role))
    return out


def abort_all(state: ClusterState, rep: Replica) -> list[str]:
    """Abort every sequence on `rep` (they re-enter the shared queue keeping their tokens)."""
    ids = list(rep.running)
    for sid in ids:
        state.abort(state.seqs[sid])
    return ids


def shift_down(state: ClusterState, replica_ids: list[str]) -> tuple[dict[str, list[str]], list[Assignment]]:
    """Abort the donors' sequences, dissolve the donors, dispatch the work to their roles' other replicas."""
    aborts: dict[str, list[str]] = {}
    roles: list[Role] = []
    for rid in replica_ids:
        rep = state.replicas[rid]
        ids = abort_all(state, rep)
        if ids:
            aborts[rid] = ids
        if rep.role not in roles:
            roles.append(rep.role)
        state.remove_replica(rid)
    assignments: list[Assignment] = []
    for role in roles:
        assignments.extend(dispatch_role(state, role))
    return aborts, assignments


def balanced_targets(replicas: list[Replica], total: int) -> dict[str, int]:
    """The throughput-maximising split of `total` running sequences over `replicas` (greedy on marginal
    gain, respecting sequence slots). O(total · log I)."""
    counts = {r.replica_id: 0 for r in replicas}
    heap = [(-r.model.marginal_gain(0), i, r) for i, r in enumerate(replicas) if r.max_seqs > 0]
    heapq.heapify(heap)
    left = total
    while left > 0 and heap:
        _, i, r = heapq.heappop(heap)
        c = counts[r.replica_id] + 1
        counts[r.replica_id] = c
        left -= 1
        if c < r.max_seqs:
            heapq.heappush(heap, (-r.model.marginal_gain(c), i, r))
    return counts


def shift_up(state: ClusterState, role: Role, newcomers: list[str]) -> tuple[dict[str, list[str]],
                                                                            list[Assignment]]:
    """Give newly active replicas of `role` work: queue first, then rebalance from the most loaded."""
    assignments = dispatch_role(state, role)
    if len(state.queues[role]):
        return {}, assignments  # still work waiting: the newcomers are full, nothing to rebalance
    reps = state.active(role)
    news = [state.replicas[r] for r in newcomers if r in state.replicas and state.replicas[r] in reps]
    if not news or len(reps) < 2:
        return {}, assignments
    total = sum(r.n for r in reps)
    targets = balanced_targets(reps, total)
    deficit = sum(max(targets[r.replica_id] - r.n, 0) for r in news)
    if deficit <= 0:
        return {}, assignments
    new_ids = {r.replica_id for r in news}
    donors = sorted((r for r in reps if r.replica_id not in new_ids and r.n > targets[r.replica_id]),
                    key=lambda r: (targets[r.replica_id] - r.n, r.replica_id))
    aborts: dict[str, list[str]] = {}
    for rep in donors:
        if deficit <= 0:
            break
        excess = min(rep.n - targets[rep.replica_id], deficit)
        victims: list[Sequence] = sorted(rep.running.values(), key=lambda s: (s.context_tokens, s.seq_id))
        victims = victims[:excess]
        for s in victims:
            state.abort(s)
        aborts[rep.replica_id] = [s.seq_id for s in victims]
        deficit -= excess
    assignments.extend(dispatch_role(state, role))
    return aborts, assignments
