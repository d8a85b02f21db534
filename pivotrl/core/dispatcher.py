"""Shift-aware dispatch: throughput-maximising placement, and Abort/Dispatch migration around a shift.

Dispatch: the head of a role's shared queue goes to the active replica whose throughput grows most by taking
one more sequence, f_i(n_i+1) − f_i(n_i), among those with room (sequence slots and KV tokens). Because every
f_i is concave, a max-heap keyed by that marginal gain gives the greedy optimum at O(log I) per sequence.

Shift-down (a replica leaves its role): Abort every sequence it runs → they re-enter the shared queue ahead
of fresh work, keeping their tokens → Dispatch onto the role's remaining replicas. O(I·NSeq) in the worst
case (every sequence of the role re-placed), O(NSeq_j · log I) typically.

Shift-up (replicas join a role): Dispatch waiting work first (the newcomers have the largest marginal gain,
f(1) − f(0)); if the queue runs dry while they sit below their share, move sequences one at a time from the
replica that loses least (the most loaded) to the newcomer that gains most, while that pays — Abort on the
donor, Dispatch to the newcomer; the moved sequences are the donors' shortest-context ones, cheapest to
prefill again. O(I log I) to build the heaps, O(log I) per moved sequence, plus sorting the touched donors'
sequences: within the paper's O(I·NSeq + I log I).
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


def shift_up(state: ClusterState, role: Role, newcomers: list[str]) -> tuple[dict[str, list[str]],
                                                                            list[Assignment]]:
    """Give newly active replicas of `role` work: queue first, then rebalance from the most loaded.

    Rebalancing is the exchange argument for separable concave throughput: move one sequence from the
    replica that loses least by giving it up (f_d(n_d) − f_d(n_d − 1), smallest = most loaded) to the
    newcomer that gains most (f_u(n_u + 1) − f_u(n_u)), while the gain exceeds the loss. Two heaps make each
    move O(log I); the moved sequences are the donor's shortest-context ones (cheapest to prefill again).
    """
    assignments = dispatch_role(state, role)
    if len(state.queues[role]):
        return {}, assignments  # still work waiting: the newcomers are full, nothing to rebalance
    reps = state.active(role)
    new_ids = {r for r in newcomers if r in state.replicas}
    news = [r for r in reps if r.replica_id in new_ids]
    if not news:
        return {}, assignments
    # Plan on counts first; sequences are aborted and re-placed once the plan is known.
    count = {r.replica_id: r.n for r in reps}
    takers = [(-r.model.marginal_gain(r.n), i, r) for i, r in enumerate(news) if r.n < r.max_seqs]
    givers = [(r.model.marginal_gain(r.n - 1), i, r) for i, r in enumerate(reps)
              if r.replica_id not in new_ids and r.n > 0]
    heapq.heapify(takers)
    heapq.heapify(givers)
    kv_room = {r.replica_id: r.kv_capacity - r.kv_used for r in news}
    victims_of: dict[str, list[Sequence]] = {}
    pairs: list[tuple[Sequence, Replica]] = []
    aborts: dict[str, list[str]] = {}
    while takers and givers:
        neg_gain, ti, taker = takers[0]
        loss, gi, giver = givers[0]
        if -neg_gain <= loss + 1e-12:
            break
        stack = victims_of.get(giver.replica_id)
        if stack is None:
            stack = sorted(giver.running.values(), key=lambda s: (-s.context_tokens, s.seq_id))
            victims_of[giver.replica_id] = stack
        victim = stack[-1]
        heapq.heappop(takers)
        if victim.kv_tokens > kv_room[taker.replica_id]:
            continue  # this newcomer cannot hold it: it stops taking
        stack.pop()
        heapq.heappop(givers)
        aborts.setdefault(giver.replica_id, []).append(victim.seq_id)
        pairs.append((victim, taker))
        kv_room[taker.replica_id] -= victim.kv_tokens
        count[giver.replica_id] -= 1
        count[taker.replica_id] += 1
        ct, cg = count[taker.replica_id], count[giver.replica_id]
        if ct < taker.max_seqs:
            heapq.heappush(takers, (-taker.model.marginal_gain(ct), ti, taker))
        if cg > 0:
            heapq.heappush(givers, (giver.model.marginal_gain(cg - 1), gi, giver))
    queue = state.queues[role]
    for victim, taker in pairs:
        state.abort(victim)
        queue.remove(victim.seq_id)
        state.start(victim, taker)
        assignments.append(Assignment(victim.seq_id, taker.replica_id))
    return aborts, assignments
