"""Shift-aware dispatch: throughput-maximising placement, and Abort/Dispatch migration around a shift.

Dispatch: the head of a role's shared queue goes to the active replica whose throughput grows most by taking
one more sequence, f_i(n_i+1) − f_i(n_i), among those with room (sequence slots and KV tokens). Because every
f_i is concave, a max-heap keyed by that marginal gain gives the greedy optimum at O(log I) per sequence.
A role whose replicas run whole micro-batches (`RoleSpec.whole_batches`, train) is dispatched late: an item
goes only to an idle replica, which takes at most its share of the queue: ceil(queued / replicas) items,
and it stops once it holds its share of the queue's work (items are not equal: a train item's work is its
tokens). A busy replica would hold the item until its batch ends while another may free sooner, and a
replica taking a full batch of the iteration's last items, or of its longest, ends the iteration alone
(docs/decisions.md#train-items-are-dispatched-late-and-shared).

Shift-down (a replica leaves its role): Abort every sequence it runs → they re-enter the shared queue ahead
of fresh work, keeping their tokens → Dispatch onto the role's remaining replicas. O(I·NSeq) in the worst
case (every sequence of the role re-placed), O(NSeq_j · log I) typically.

Shift-up (replicas join a role): Dispatch waiting work first (the newcomers have the largest marginal gain,
f(1) − f(0)); if the queue runs dry while they sit below their share, move sequences one at a time from the
replica that loses least (the most loaded) to the newcomer that gains most, while that pays — Abort on the
donor, Dispatch to the newcomer; each moved sequence is the shortest-context one among the donor's most
recently started (cheap to prefill again). O(I log I) to build the heaps and O(log I) per moved sequence:
within the paper's O(I·NSeq + I log I).
"""

from __future__ import annotations

import heapq
import math

from pivotrl.core.decision import Assignment
from pivotrl.core.state import ClusterState
from pivotrl.core.types import Replica, Role, Sequence


def dispatch_role(state: ClusterState, role: Role) -> list[Assignment]:
    """Place waiting sequences of `role` until the queue is empty or no active replica has room.

    Strict queue order: if the head does not fit anywhere (KV), nothing behind it jumps ahead, so resumed
    sequences are never starved by smaller fresh ones. A `whole_batches` role: idle replicas only, each
    up to its share of the queue (the module docstring says why).
    """
    queue = state.queues[role]
    if not len(queue) or state.blocked[role]:
        return []  # nothing waits, or nothing changed since the head last found no room
    heap: list[tuple[float, int, Replica]] = []
    whole = state.config.spec(role).whole_batches
    active = state.active(role)
    share = -(-len(queue) // max(len(active), 1)) if whole else 1 << 30
    # a whole-batch replica is given work only while idle, so its `remaining` is what this call gave it
    work_share = queue.work / max(len(active), 1) if whole else math.inf
    for idx, rep in enumerate(active):
        if rep.n < min(rep.max_seqs, share) and not (whole and rep.n > 0):
            heap.append((-rep.model.marginal_gain(rep.n), idx, rep))
    heapq.heapify(heap)
    out: list[Assignment] = []
    while heap:
        seq = queue.peek()
        if seq is None:
            break
        need = state.kv_need(seq)
        skipped: list[tuple[float, int, Replica]] = []
        chosen: tuple[float, int, Replica] | None = None
        while heap:
            item = heapq.heappop(heap)
            if item[2].fits(need):
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
        if rep.n < min(rep.max_seqs, share) and rep.remaining < work_share:
            heapq.heappush(heap, (-rep.model.marginal_gain(rep.n), chosen[1], rep))
    if len(queue):
        state.blocked[role] = True
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
    move O(log I); each moved sequence is the shortest-context one among the donor's most recently started
    (cheap to prefill again; `cheapest_recent`).
    """
    assignments = dispatch_role(state, role)
    fresh = {a.seq_id: i for i, a in enumerate(assignments)}  # placed by this call: started nowhere yet
    if len(state.queues[role]):
        return {}, assignments  # still work waiting: the newcomers are full, nothing to rebalance
    reps = state.active(role)
    new_ids = {r for r in newcomers if r in state.replicas}
    news = [r for r in reps if r.replica_id in new_ids]
    if not news:
        return {}, assignments
    takers = [(-r.model.marginal_gain(r.n), i, r) for i, r in enumerate(news) if r.n < r.max_seqs]
    givers = [(r.model.marginal_gain(r.n - 1), i, r) for i, r in enumerate(reps)
              if r.replica_id not in new_ids and r.n > 0]
    heapq.heapify(takers)
    heapq.heapify(givers)
    aborts: dict[str, list[str]] = {}
    while takers and givers:
        neg_gain, ti, taker = takers[0]
        loss, gi, giver = givers[0]
        if -neg_gain <= loss + 1e-12:
            break
        victim = cheapest_recent(giver)
        heapq.heappop(takers)
        if not taker.fits(state.kv_need(victim)):
            continue  # this newcomer cannot hold it: it stops taking
        heapq.heappop(givers)
        sid = victim.seq_id
        state.move(victim, taker, started=sid not in fresh)
        if sid in fresh:  # placed on the donor a moment ago: placed on the newcomer instead, no abort
            assignments[fresh[sid]] = Assignment(sid, taker.replica_id)
        else:  # Abort on the donor + Dispatch to the newcomer, without a queue trip
            aborts.setdefault(giver.replica_id, []).append(sid)
            fresh[sid] = len(assignments)
            assignments.append(Assignment(sid, taker.replica_id))
        if taker.n < taker.max_seqs:
            heapq.heappush(takers, (-taker.model.marginal_gain(taker.n), ti, taker))
        if giver.n > 0:
            heapq.heappush(givers, (giver.model.marginal_gain(giver.n - 1), gi, giver))
    return aborts, assignments


#: How many of a donor's most recently started sequences are considered when choosing one to move.
RECENT_WINDOW = 8


def cheapest_recent(rep: Replica) -> Sequence:
    """The shortest-context sequence among the `RECENT_WINDOW` most recently started on `rep`.

    Recently started sequences have generated least since, so they are the cheap ones to prefill again;
    looking at a fixed window keeps each move O(1) instead of scanning (or sorting) the whole replica.
    """
    best: Sequence | None = None
    for i, sid in enumerate(reversed(rep.running)):
        if i >= RECENT_WINDOW:
            break
        s = rep.running[sid]
        if best is None or (s.context_tokens, s.seq_id) < (best.context_tokens, best.seq_id):
            best = s
    assert best is not None
    return best
