"""The controller's bookkeeping: every live sequence, every replica, every device, and per-role aggregates.

All mutations of sequence placement go through the few methods here (`enqueue`, `start`, `abort`,
`finish`, `update_progress`, replica add/remove), so the aggregates the planner reads (sequence counts,
remaining-work sums, per-role running totals) are always exact and cost O(1) to read — the planner never walks
sequences. `check()` re-derives everything from scratch; tests call it after every step.
"""

from __future__ import annotations

from collections.abc import Iterable

from pivotrl.core.queues import WaitingQueue
from pivotrl.core.throughput import ThroughputModel
from pivotrl.core.types import (
    PIPELINE,
    ControllerConfig,
    IterationPlan,
    Replica,
    ReplicaState,
    Role,
    SeqState,
    Sequence,
)


class ClusterState:
    def __init__(self, config: ControllerConfig, roles: Iterable[Role] = PIPELINE) -> None:
        self.config = config
        self.roles: tuple[Role, ...] = tuple(roles)
        self.seqs: dict[str, Sequence] = {}
        self.queues: dict[Role, WaitingQueue] = {r: WaitingQueue() for r in self.roles}
        self.replicas: dict[str, Replica] = {}
        self.by_role: dict[Role, dict[str, Replica]] = {r: {} for r in self.roles}
        # Devices: role (None = free), the replica holding it, when it last changed role.
        self.device_role: dict[str, Role | None] = {}
        self.device_replica: dict[str, str | None] = {}
        self.device_shifted_at: dict[str, float] = {}
        self.device_lock_s: dict[str, float] = {}  # a lock shorter than cooldown_s (`lock_after_shift`)
        # (time, replicas) each role gave up in shifts: the planner bounds an upstream role's *cumulative*
        # donation over a horizon, so a per-decision slack cannot compound across consecutive ticks.
        self.donations: dict[Role, list[tuple[float, int]]] = {r: [] for r in self.roles}
        # Aggregates per role over live (waiting + running) sequences.
        self.n_seqs: dict[Role, int] = dict.fromkeys(self.roles, 0)
        self.remaining: dict[Role, float] = dict.fromkeys(self.roles, 0.0)
        self.iteration_started_at = 0.0  # when the current iteration's plan arrived (`begin_iteration`)
        self.kv_sum: dict[Role, int] = dict.fromkeys(self.roles, 0)
        # Dispatch found no room for the queue head; cleared by anything that could change that.
        self.blocked: dict[Role, bool] = dict.fromkeys(self.roles, False)
        self.role_models: dict[Role, ThroughputModel] = {}
        for r in self.roles:
            spec = config.spec(r)
            self.role_models[r] = ThroughputModel(
                spec.prior_step_a_s, spec.prior_step_b_s, spec.tokens_per_seq_step, config.decay,
                config.prior_weight, spec.step_context_s, spec.context_ref_tokens)
        self._order = 0
        self._replica_counter = 0
        # Iteration structure, for the work each role will still receive from upstream.
        self.plan: IterationPlan | None = None
        self.submitted: dict[Role, int] = dict.fromkeys(self.roles, 0)
        self.finished: dict[Role, int] = dict.fromkeys(self.roles, 0)
        self.prompt_sum: dict[Role, int] = dict.fromkeys(self.roles, 0)  # Σ prompt tokens ever submitted
        # judged items whose group has not reached train yet: group id -> (iteration, items judged)
        self.unreleased: dict[str, tuple[int, int]] = {}
        self.unreleased_items = 0

    def forget_unreleased(self, before_iteration: int) -> None:
        """Drop the judged items of groups from iterations before `before_iteration`: those groups can
        no longer reach train (a group the driver filtered out, e.g. one whose rewards are all equal, never
        does), and counted as held they would keep train looking behind forever."""
        for gid, (it, n) in list(self.unreleased.items()):
            if it < before_iteration:
                del self.unreleased[gid]
                self.unreleased_items -= n

    def rollouts_unsubmitted(self) -> bool:
        """Has the iteration plan announced rollouts that the driver has not submitted yet?"""
        return self.plan is not None and self.plan.rollout_seqs > self.submitted[PIPELINE[0]]

    def has_work(self, role: Role) -> bool:
        """Does `role` hold live (waiting or running) sequences?"""
        return self.n_seqs.get(role, 0) > 0

    def downstream_live(self) -> bool:
        """Does a role after the first stage hold live sequences? At an on-policy iteration's start never
        (the barrier drained them); with staleness, an older iteration's judgements and training still
        running beside the new iteration's rollouts."""
        return any(self.has_work(r) for r in PIPELINE[1:])

    def first_stage_started(self) -> bool:
        """Has every sequence the iteration plan announced (none without a plan) for the first stage been
        submitted and taken from its queue? Then that stage gets no more work this iteration: a replica of
        it that is idle now stays idle until the next iteration starts."""
        first = PIPELINE[0]
        return first in self.queues and not self.queues[first] and not self.rollouts_unsubmitted()

    # -- devices and replicas -----------------------------------------------------------------------
    def add_device(self, device: str, now: float) -> None:
        if device in self.device_role:
            raise ValueError(f"device {device!r} already known")
        self.device_role[device] = None
        self.device_replica[device] = None
        self.device_shifted_at[device] = float("-inf")

    def locked(self, device: str, now: float) -> bool:
        """Is `device` still held where it last moved (`ControllerConfig.cooldown_s`, or the shorter lock its
        last shift earned: `lock_after_shift`)?"""
        lock = self.device_lock_s.get(device, self.config.cooldown_s)
        return self.device_shifted_at.get(device, float("-inf")) > now - lock

    def lock_after_shift(self, device: str, now: float, shift_s: float | None) -> None:
        """`device` finished a shift of `shift_s` seconds at `now`: it is held for the shorter of the cooldown
        and `cooldown_shift_multiple` × `shift_s`; after a first placement (`shift_s` None) for the whole
        cooldown, which keeps the first decisions off a throughput fit with no samples yet."""
        self.device_shifted_at[device] = now
        if shift_s is None:
            self.device_lock_s.pop(device, None)
        else:
            self.device_lock_s[device] = self.config.lock_after(shift_s)

    def free_devices(self) -> list[str]:
        return [d for d, r in self.device_replica.items() if r is None]

    def new_replica(self, role: Role, devices: tuple[str, ...], now: float,
                    state: ReplicaState = ReplicaState.SHIFTING) -> Replica:
        spec = self.config.spec(role)
        if len(devices) != spec.devices_per_replica:
            raise ValueError(f"a {role} replica needs {spec.devices_per_replica} device(s), "
                             f"got {len(devices)}")
        for d in devices:
            if self.device_replica.get(d, "missing") is not None:
                raise ValueError(f"device {d!r} is not free")
        self._replica_counter += 1
        rid = f"{role}-{self._replica_counter}"
        rep = Replica(rid, role, tuple(devices), spec.max_seqs, spec.kv_tokens,
                      self.role_models[role].spawn(), state=state, created_at=now)
        self.replicas[rid] = rep
        self.by_role[role][rid] = rep
        if state is ReplicaState.ACTIVE:
            self.blocked[role] = False
        for d in devices:
            if self.device_role[d] != role:
                self.device_shifted_at[d] = now
                self.device_lock_s.pop(d, None)
            self.device_role[d] = role
            self.device_replica[d] = rid
        return rep

    def record_donation(self, role: Role, now: float, replicas: int) -> None:
        self.donations.setdefault(role, []).append((now, replicas))

    def donated_since(self, role: Role, since: float) -> int:
        """Replicas `role` gave up in shifts after `since` (older records are dropped)."""
        recs = self.donations.get(role)
        if not recs:
            return 0
        while recs and recs[0][0] <= since:
            recs.pop(0)
        return sum(k for _, k in recs)

    def remove_replica(self, rid: str) -> Replica:
        """Dissolve an (empty) replica; its devices become free (and keep their last role for the record)."""
        rep = self.replicas[rid]
        if rep.running:
            raise ValueError(f"replica {rid} still runs {len(rep.running)} sequence(s)")
        del self.replicas[rid]
        del self.by_role[rep.role][rid]
        for d in rep.devices:
            if d in self.device_replica:
                self.device_replica[d] = None
                self.device_role[d] = None
        return rep

    def activate(self, rep: Replica) -> None:
        """A shifting replica finished loading: it may now receive work."""
        rep.state = ReplicaState.ACTIVE
        self.blocked[rep.role] = False

    def kv_need(self, seq: Sequence) -> int:
        return seq.kv_need(self.config.kv_reserve)

    def active(self, role: Role) -> list[Replica]:
        return [r for r in self.by_role[role].values() if r.state is ReplicaState.ACTIVE]

    # -- sequences ----------------------------------------------------------------------------------
    def admit(self, seq: Sequence, now: float) -> None:
        if seq.role not in self.queues:
            raise ValueError(f"sequence {seq.seq_id}: unknown role {seq.role!r}")
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id} already submitted")
        spec = self.config.spec(seq.role)
        if seq.kv_tokens > spec.kv_tokens:
            raise ValueError(f"sequence {seq.seq_id} needs {seq.kv_tokens} KV tokens; a {seq.role} replica "
                             f"holds {spec.kv_tokens}")
        seq.state = SeqState.WAITING
        seq.replica_id = None
        seq.order = -1
        seq.submitted_at = now
        self.seqs[seq.seq_id] = seq
        r = seq.role
        self.n_seqs[r] += 1
        self.remaining[r] += seq.remaining_estimate()
        self.kv_sum[r] += self.kv_need(seq)
        self.submitted[r] += 1
        self.prompt_sum[r] += seq.prompt_tokens
        if r is PIPELINE[-1] and seq.group_id is not None and seq.group_id in self.unreleased:
            self.unreleased_items -= self.unreleased.pop(seq.group_id)[1]
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        # Keep the first submission number: an aborted sequence is ordered by when it was first submitted.
        if seq.order < 0:
            self._order += 1
            seq.order = self._order
        self.queues[seq.role].push(seq, seq.order)

    def start(self, seq: Sequence, rep: Replica) -> None:
        """Waiting → running on `rep` (the caller has popped it from the queue and checked capacity)."""
        seq.state = SeqState.RUNNING
        seq.replica_id = rep.replica_id
        rep.running[seq.seq_id] = seq
        seq.kv_reserved = self.kv_need(seq)
        rep.kv_used += seq.kv_reserved
        rep.remaining += seq.remaining_estimate()
        rep.context += seq.context_tokens
        rep.grew(seq)

    def _detach(self, seq: Sequence) -> Replica | None:
        self.blocked[seq.role] = False  # room freed, or the queue head may change
        if seq.state is SeqState.RUNNING:
            rep = self.replicas[seq.replica_id]  # type: ignore[index]
            del rep.running[seq.seq_id]
            rep.kv_used -= seq.kv_reserved
            seq.kv_reserved = 0
            rep.remaining -= seq.remaining_estimate()
            rep.context -= seq.context_tokens
            if not rep.running:
                rep.remaining = 0.0  # drop float drift
            rep.left(seq)
            seq.replica_id = None
            return rep
        if seq.state is SeqState.WAITING:
            self.queues[seq.role].remove(seq.seq_id)
        return None

    def abort(self, seq: Sequence) -> None:
        """Running → waiting, ahead of every never-started sequence; generated tokens are kept."""
        if seq.state is not SeqState.RUNNING:
            raise ValueError(f"sequence {seq.seq_id} is {seq.state}, not running")
        self._detach(seq)
        seq.aborts += 1
        seq.state = SeqState.WAITING
        self._enqueue(seq)

    def move(self, seq: Sequence, dst: Replica, started: bool = True) -> None:
        """Abort `seq` on its replica and resume it on `dst` at once (a migration that skips the queue;
        the caller has checked `dst` has room). Same bookkeeping as `abort` then `start`, done once.
        `started=False`: it was placed on its replica by the same decision and never ran there, so it
        is moved, not aborted (its abort count stays)."""
        src = self.replicas[seq.replica_id]  # type: ignore[index]
        rem, ctx, need = seq.remaining_estimate(), seq.context_tokens, self.kv_need(seq)
        del src.running[seq.seq_id]
        src.kv_used -= seq.kv_reserved
        src.remaining -= rem
        src.context -= ctx
        if not src.running:
            src.remaining = 0.0
        src.left(seq)
        self.blocked[seq.role] = False
        seq.aborts += int(started)
        seq.replica_id = dst.replica_id
        seq.kv_reserved = need
        dst.running[seq.seq_id] = seq
        dst.kv_used += need
        dst.remaining += rem
        dst.context += ctx
        dst.grew(seq)

    def finish(self, seq: Sequence, now: float) -> None:
        self._detach(seq)
        r = seq.role
        self.n_seqs[r] -= 1
        self.remaining[r] -= seq.remaining_estimate()
        self.kv_sum[r] -= self.kv_need(seq)
        if self.n_seqs[r] == 0:
            self.remaining[r] = 0.0
        self.finished[r] += 1
        if r is PIPELINE[-2] and seq.group_id is not None and PIPELINE[-1] in self.roles:
            _, held = self.unreleased.get(seq.group_id, (seq.iteration, 0))
            self.unreleased[seq.group_id] = (seq.iteration, held + 1)
            self.unreleased_items += 1
        seq.state = SeqState.FINISHED
        seq.finished_at = now
        del self.seqs[seq.seq_id]

    def update_progress(self, seq: Sequence, generated: int) -> None:
        """Raise `generated` (never lower it: tokens once generated are kept across aborts)."""
        generated = min(int(generated), seq.max_new_tokens)
        if generated <= seq.generated:
            return
        before = seq.remaining_estimate()
        need_before = self.kv_need(seq)
        grown = generated - seq.generated
        seq.generated = generated
        self.kv_sum[seq.role] += self.kv_need(seq) - need_before
        delta = seq.remaining_estimate() - before
        self.remaining[seq.role] += delta
        if seq.state is SeqState.RUNNING:
            rep = self.replicas[seq.replica_id]  # type: ignore[index]
            rep.remaining += delta
            rep.context += grown
            rep.grew(seq)
        elif seq.state is SeqState.WAITING:
            self.queues[seq.role].rework(seq)

    # -- invariants ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Re-derive every aggregate and placement from scratch and compare; raise AssertionError if off."""
        seen: dict[str, str] = {}
        for rid, rep in self.replicas.items():
            assert rep.role in self.by_role and rid in self.by_role[rep.role], rid
            assert len(rep.running) <= rep.max_seqs, f"{rid} over seq capacity"
            assert rep.kv_used == sum(s.kv_reserved for s in rep.running.values()), rid
            assert rep.kv_used <= rep.kv_capacity, f"{rid} over KV capacity"
            assert rep.context == sum(s.context_tokens for s in rep.running.values()), rid
            if not rep._furthest_stale:
                most = max((s.generated for s in rep.running.values()), default=None)
                far = rep._furthest
                assert (far is None) == (most is None), f"{rid} furthest sequence {far} of {most}"
                assert far is None or (rep.running.get(far.seq_id) is far and far.generated == most), rid
            assert abs(rep.remaining - sum(s.remaining_estimate() for s in rep.running.values())) < 1e-6 * (
                1 + abs(rep.remaining)), rid
            for sid, s in rep.running.items():
                assert sid not in seen, f"{sid} on two replicas"
                seen[sid] = rid
                assert s.state is SeqState.RUNNING and s.replica_id == rid, sid
                assert self.seqs.get(sid) is s, sid
            for d in rep.devices:
                assert self.device_replica.get(d) == rid and self.device_role.get(d) == rep.role, d
            if rep.state is ReplicaState.SHIFTING:
                assert not rep.running, f"{rid} runs work while shifting"
        for role, q in self.queues.items():
            for s in q.values():
                assert s.seq_id not in seen, f"{s.seq_id} both waiting and running"
                assert s.state is SeqState.WAITING and s.role is role and s.replica_id is None, s.seq_id
                seen[s.seq_id] = "queue"
            # Counted at push; a waiting sequence's context only grows (late progress reports).
            assert 0 <= q.context_tokens <= sum(s.context_tokens for s in q.values()), role
            want = sum(s.remaining_estimate() for s in q.values())
            assert abs(q.work - want) <= 1e-6 * (1.0 + want), role
        assert set(seen) == set(self.seqs), "a live sequence is neither waiting nor running"
        for role in self.roles:
            live = [s for s in self.seqs.values() if s.role is role]
            assert self.n_seqs[role] == len(live), role
            assert self.kv_sum[role] == sum(self.kv_need(s) for s in live), role
            want = sum(s.remaining_estimate() for s in live)
            assert abs(self.remaining[role] - want) < 1e-6 * (1 + want), role
        assert self.unreleased_items == sum(n for _, n in self.unreleased.values()), "held judged items"
