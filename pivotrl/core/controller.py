"""`Controller`: the one object a driver (Dask scheduler plugin, simulator, test) talks to.

Events in, decisions out, time always passed in. The driver reports what happened (`submit`, `on_progress`,
`on_finished`, `on_step`, `on_shift_done`, `on_device_lost`) and asks what to do (`dispatch` for
placements, `tick` for shifts). Every state-changing decision gets an id and a stimulus in `log`, the same
way distributed's P2P shuffle stamps its state transitions, so a run can be replayed and explained.
See docs/core-api.md for the driver's loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pivotrl.core import dispatcher, tail_migration
from pivotrl.core.decision import Assignment, Decision, DeviceMove, PlanReasoning, ReplicaShift
from pivotrl.core.iteration import IterationMeter, IterationProfile
from pivotrl.core.modes import make_policy
from pivotrl.core.policies import Policy, ShiftPlan
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.throughput import StepTotals
from pivotrl.core.types import (
    PIPELINE,
    ControllerConfig,
    IterationPlan,
    Replica,
    ReplicaState,
    Role,
    RoleSpec,
    SeqState,
    Sequence,
    ShiftTimings,
)


class Controller:
    """Owns the shared queues, replicas, throughput and shift-cost models, and the policy.

    Parameters: `policy` (a `Policy` or a mode name for `make_policy`), `devices` (device ids known at start;
    more can join with `add_device`), `devices_per_replica` (overrides `config.roles[r].devices_per_replica`),
    `config`. Nothing here blocks, sleeps, reads a clock or does I/O.
    """

    def __init__(self, policy: Policy | str = "shiftable", devices: Iterable[str] = (),
                 devices_per_replica: Mapping[Role | str, int] | None = None,
                 config: ControllerConfig | None = None, now: float = 0.0) -> None:
        config = config or ControllerConfig()
        if devices_per_replica:
            roles = dict(config.roles)
            for r, g in devices_per_replica.items():
                if int(g) < 1:
                    raise ValueError(f"devices_per_replica[{r}] must be >= 1")
                base = roles.get(Role(r), RoleSpec())
                roles[Role(r)] = RoleSpec(**{**base.__dict__, "devices_per_replica": int(g)})
            config = ControllerConfig(**{**config.__dict__, "roles": roles})
        self.config = config
        self.policy: Policy = make_policy(policy) if isinstance(policy, str) else policy
        self.state = ClusterState(config, tuple(r for r in PIPELINE if r in config.roles) or PIPELINE)
        self.shift_costs = ShiftCostModel(config.shift_prior_s, config.shift_cost_alpha)
        self.log: list[dict[str, Any]] = []
        self.last_reasoning: PlanReasoning | None = None
        self._next_id = 0
        self._pending: dict[str, tuple[float, tuple[DeviceMove, ...]]] = {}
        # The iteration in progress, measured (finished lengths per role) so the policy can start the next
        # one from what this one would have needed; `profiles` keeps every finished iteration's profile.
        self.meter = IterationMeter()
        # every step per role since this controller started, unweighted (a whole run's profile, not a fit
        # any decision reads: `StepTotals`)
        self.step_totals: dict[Role, StepTotals] = {}
        self.profiles: list[IterationProfile] = []
        # a resumed run's last finished iteration (`pivotrl.core.learned.restore_learned`): handed to the
        # policy by the first `begin_iteration`, which has no iteration of its own that just ended
        self.resumed_profile: IterationProfile | None = None
        for d in devices:
            self.add_device(d, now)

    # ==================================================================================================
    # Events in
    # ==================================================================================================
    def add_device(self, device: str, now: float) -> None:
        """A device (Dask worker) joined. It is free until a `tick` places it."""
        self.state.add_device(device, now)
        self._record(now, f"device_added:{device}", "device_added", extra={"device": device})

    def begin_iteration(self, plan: IterationPlan, now: float) -> None:
        """Tell the planner the iteration's structure (so future work counts), and reset its counters. The
        policy gets the measured profile of the iteration that just ended (`IterationProfile`), to choose
        how to run this one."""
        mode, predicted = self.policy.iteration_mode()
        last = self.meter.profile(now, mode, predicted, self.shift_costs)
        if last is not None:
            self.profiles.append(last)
        elif self.resumed_profile is not None:
            last = self.resumed_profile
        self.resumed_profile = None
        self.state.plan = plan
        self.state.iteration_started_at = now
        for r in self.state.roles:
            self.state.submitted[r] = 0
            self.state.finished[r] = 0
        self.state.forget_unreleased(plan.iteration - self.state.config.max_staleness)
        self.policy.on_iteration(self.state, self.shift_costs, last, now)
        self.meter.begin(plan.iteration, now)
        choice = getattr(self.policy, "choice", None)
        extra: dict[str, Any] = {"plan": plan.__dict__}
        if choice is not None:
            extra["iteration_choice"] = choice.as_dict()
        self._record(now, f"iteration:{plan.iteration}", "iteration", extra=extra)

    def submit(self, seqs: Iterable[Sequence], now: float) -> None:
        """New work: each sequence enters its role's shared queue (behind resumed work)."""
        for s in seqs:
            self.state.admit(s, now)

    def on_progress(self, seq_id: str, generated: int, now: float, payload: Any = None) -> None:
        """`generated` tokens are done for `seq_id` (counts only grow; an abort's partial reports here too).
        `payload`, when given, replaces the opaque payload (the runtime keeps generated token ids there)."""
        seq = self.state.seqs.get(seq_id)
        if seq is None:
            return  # finished or unknown: a late report, nothing to update
        self.state.update_progress(seq, generated)
        if payload is not None:
            seq.payload = payload

    def on_finished(self, seq_id: str, now: float, generated: int | None = None,
                    payload: Any = None) -> Sequence:
        """`seq_id` is done; returns it (with its payload) so the driver can feed the next stage."""
        seq = self.state.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not live (never submitted, or already finished)")
        if generated is not None:
            self.state.update_progress(seq, generated)
        if payload is not None:
            seq.payload = payload
        self.meter.observe(seq.role, float(seq.generated), float(seq.prompt_tokens), now,
                           len(self.state.by_role.get(seq.role, {})))
        self.state.finish(seq, now)
        return seq

    def on_step(self, replica_id: str, concurrency: int, step_time_s: float, now: float,
                tokens: float | None = None, prefill_tokens: int = 0,
                context_tokens: float | None = None) -> None:
        """One engine step took `step_time_s` with `concurrency` sequences (`tokens` work, default one per
        sequence), `prefill_tokens` of them newcomers' prompts, `context_tokens` of context held by its rows
        (where the engine knows it). Feeds the replica's and its role's throughput fit: a pure decode step
        its line, a step that prefilled its prefill rate (where the role prices context, at the line's
        reference context: `ThroughputModel`)."""
        rep = self.state.replicas.get(replica_id)
        if rep is None:
            return
        totals = self.step_totals.get(rep.role)
        if totals is None:
            totals = self.step_totals[rep.role] = StepTotals()
        totals.add(float(tokens) if tokens is not None else float(concurrency), step_time_s, prefill_tokens)
        for m in (rep.model, self.state.role_models[rep.role]):
            if prefill_tokens > 0:
                m.observe_prefill(concurrency, step_time_s, prefill_tokens, tokens, context_tokens)
            else:
                m.observe(concurrency, step_time_s, tokens, context_tokens)

    def on_shift_done(self, replica_id: str, now: float, timings: ShiftTimings | None = None) -> Decision:
        """Replica `replica_id` finished loading its role; it becomes active and gets work (shift-up
        migration: queue first, then rebalance from the most loaded replicas). `timings`, the phases the
        driver measured, teach the shift-cost model; without them the time since the shift was decided is
        used."""
        rep = self.state.replicas.get(replica_id)
        if rep is None or rep.state is not ReplicaState.SHIFTING:
            raise KeyError(f"replica {replica_id} is not shifting")
        started, moves = self._pending.pop(replica_id, (now, ()))
        if timings is None:
            timings = ShiftTimings.elapsed(now - started)
        for from_role in {m.from_role for m in moves} or {None}:
            self.shift_costs.observe(from_role, rep.role, timings)
        self.state.activate(rep)
        placed = all(m.from_role is None for m in moves)  # from free devices: a first placement
        for d in rep.devices:
            self.state.lock_after_shift(d, now, None if placed else timings.total)
        aborts, assignments = dispatcher.shift_up(self.state, rep.role, [replica_id])
        return self._record(now, f"shift_done:{replica_id}", "shift_up", aborts=aborts, dispatch=assignments,
                            extra={"phase_timings": timings.phases(), "warm": timings.warm})

    def on_device_lost(self, device: str, now: float) -> list[Sequence]:
        """A device died. Its replica is dissolved, its sequences re-queued (keeping their tokens) and its
        partner devices freed. Returns the re-queued sequences; call `dispatch` to place them."""
        st = self.state
        if device not in st.device_role:
            return []
        rid = st.device_replica[device]
        requeued: list[Sequence] = []
        aborts: dict[str, list[str]] = {}
        if rid is not None:
            rep = st.replicas[rid]
            ids = dispatcher.abort_all(st, rep)
            requeued = [st.seqs[i] for i in ids]
            if ids:
                aborts[rid] = ids
            st.remove_replica(rid)
            self._pending.pop(rid, None)
        del st.device_role[device]
        del st.device_replica[device]
        st.device_shifted_at.pop(device, None)
        st.device_lock_s.pop(device, None)
        self._record(now, f"device_lost:{device}", "device_lost", aborts=aborts,
                     dissolved=[rid] if rid else [], extra={"device": device})
        return requeued

    # ==================================================================================================
    # Decisions out
    # ==================================================================================================
    def dispatch(self, now: float) -> list[Assignment]:
        """Place waiting sequences on active replicas (largest marginal throughput gain first)."""
        return dispatcher.dispatch_all(self.state)

    def tick(self, now: float) -> Decision | None:
        """Ask the policy whether to shift; if so, execute its shift-down migration and return the
        decision (aborts to run, replicas to form, the re-dispatch of the aborted work, the reasoning)."""
        plan = self.policy.plan(self.state, self.shift_costs, now)
        last = getattr(self.policy, "last", None)
        if last is not None:
            self.last_reasoning = last.reasoning
        if plan is None or (not plan.dissolve and not plan.form):
            return self._migrate_tail(now)
        return self._execute(plan, now)

    def _migrate_tail(self, now: float) -> Decision | None:
        """With no shift this tick: the policy's tail migration (`pivotrl.core.tail_migration`), as one
        decision of aborts and dispatches."""
        residuals = self.policy.tail_residuals()
        if residuals is None:
            return None
        aborts: dict[str, list[str]] = {}
        assignments: list[Assignment] = []
        for role in self.state.roles:
            for m in tail_migration.tail_moves(self.state, role, residuals.get(role)):
                aborts.setdefault(m.donor, []).append(m.seq_id)
                assignments.append(Assignment(m.seq_id, m.taker))
        if not assignments:
            return None
        return self._record(now, "tail:idle-replica", "migrate", aborts=aborts, dispatch=assignments)

    def abort(self, seq_ids: Iterable[str], now: float) -> Decision:
        """An operator's (or a test's) abort: these running sequences wait again at the head of their
        queue, keeping their tokens, and are re-dispatched by the next `dispatch`."""
        st = self.state
        aborts: dict[str, list[str]] = {}
        for sid in seq_ids:
            seq = st.seqs.get(sid)
            if seq is None or seq.state is not SeqState.RUNNING or seq.replica_id is None:
                continue
            aborts.setdefault(seq.replica_id, []).append(sid)
            st.abort(seq)
        return self._record(now, "request:abort", "abort", aborts=aborts)

    def request_shift(self, device: str, role: Role | str | None, now: float) -> Decision:
        """An operator's (or a test's) shift, whatever the policy: dissolve `device`'s replica (its work is
        aborted and re-dispatched, as for any shift-down) and form a `role` replica on it, with free devices
        to make up the role's devices per replica; `role` None only frees it. Raises ValueError (and changes
        nothing) when the device is unknown or too few devices are free."""
        st = self.state
        if device not in st.device_role:
            raise ValueError(f"unknown device {device!r}")
        to = None if role is None else Role(role)
        rid = st.device_replica[device]
        freed = [device] if rid is None else list(st.replicas[rid].devices)
        form: tuple[tuple[Role, tuple[str, ...]], ...] = ()
        if to is not None:
            g = st.config.devices_per_replica(to)
            others = [d for d in freed if d != device] + [d for d in st.free_devices() if d != device]
            if len(others) < g - 1:
                raise ValueError(f"a {to} replica needs {g} devices; {len(others) + 1} available")
            form = ((to, (device, *others[:g - 1])),)
        plan = ShiftPlan(() if rid is None else (rid,), form, f"request:{device}->{to}")
        return self._execute(plan, now)

    def _execute(self, plan: ShiftPlan, now: float) -> Decision:
        st = self.state
        origin: dict[str, tuple[Role | None, str | None]] = {}
        for rid in plan.dissolve:
            rep = st.replicas[rid]
            for d in rep.devices:
                origin[d] = (rep.role, rid)
            st.record_donation(rep.role, now, 1)
        aborts, assignments = dispatcher.shift_down(st, list(plan.dissolve))
        shifts: list[ReplicaShift] = []
        for role, devices in plan.form:
            moves = tuple(DeviceMove(d, origin.get(d, (None, None))[0], role, origin.get(d, (None, None))[1])
                          for d in devices)
            rep = st.new_replica(role, tuple(devices), now, ReplicaState.SHIFTING)
            self._pending[rep.replica_id] = (now, moves)
            shifts.append(ReplicaShift(rep.replica_id, role, tuple(devices), moves))
        return self._record(now, plan.stimulus, "shift", aborts=aborts, dissolved=list(plan.dissolve),
                            shifts=shifts, dispatch=assignments, reasoning=plan.reasoning)

    def _record(self, now: float, stimulus: str, kind: str, *, aborts: dict[str, list[str]] | None = None,
                dissolved: list[str] | None = None, shifts: list[ReplicaShift] | None = None,
                dispatch: list[Assignment] | None = None, reasoning: PlanReasoning | None = None,
                extra: dict[str, Any] | None = None) -> Decision:
        self._next_id += 1
        dec = Decision(self._next_id, now, stimulus, kind, aborts or {}, dissolved or [], shifts or [],
                       dispatch or [], reasoning)
        entry = dec.as_dict()
        if extra:
            entry.update(extra)
        self.log.append(entry)
        return dec

    # ==================================================================================================
    # Inspection (read-only)
    # ==================================================================================================
    def replicas(self, role: Role | None = None) -> list[Replica]:
        reps = self.state.replicas.values()
        return [r for r in reps if role is None or r.role is role]

    def role_of(self, device: str) -> Role | None:
        return self.state.device_role.get(device)

    def sequence(self, seq_id: str) -> Sequence | None:
        return self.state.seqs.get(seq_id)

    def waiting(self, role: Role) -> list[str]:
        return self.state.queues[role].ids()

    def has_work(self, role: Role | None = None) -> bool:
        roles = self.state.roles if role is None else (role,)
        return any(self.state.has_work(r) for r in roles)

    def snapshot(self) -> dict[str, Any]:
        """Per-role counts and rates, per-device role: what a dashboard or metrics exporter shows."""
        st = self.state
        roles = {}
        for r in st.roles:
            reps = list(st.by_role[r].values())
            roles[str(r)] = {
                "replicas": len(reps),
                "active": sum(1 for x in reps if x.state is ReplicaState.ACTIVE),
                "devices": sum(len(x.devices) for x in reps),
                "waiting": len(st.queues[r]),
                "running": sum(x.n for x in reps),
                "remaining_tokens": st.remaining[r],
                "tokens_per_s": sum(x.rate() for x in reps if x.state is ReplicaState.ACTIVE),
            }
        fits = {str(r): {"a_s": m.a, "b_s": m.b, "tokens_per_seq_step": m.tokens_per_seq_step,
                         "samples": m.samples, "prefill_tokens_per_s": m.prefill_tokens_per_s}
                for r, m in st.role_models.items()}
        return {"roles": roles, "step_fits": fits,
                "step_totals": {str(r): t.as_dict() for r, t in self.step_totals.items()},
                "devices": {d: (None if r is None else str(r)) for d, r in st.device_role.items()},
                "free_devices": len(st.free_devices()),
                "decisions": self._next_id}

    def check_invariants(self) -> None:
        self.state.check()
        for rid in self._pending:
            assert rid in self.state.replicas, rid


__all__ = ["Controller"]
