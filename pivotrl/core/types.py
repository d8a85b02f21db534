"""The vocabulary every part of pivotrl shares: roles, sequences, replicas, the controller's configuration.

These are plain data; what the controller tells its driver to do is `pivotrl.core.decision`. Behaviour
lives elsewhere in `pivotrl.core` (queues, throughput, dispatcher, planner, policies, controller). Nothing
here reads a clock or touches I/O: every time stamp is passed in by the driver (the Dask scheduler plugin
or the simulator), which is what lets both drive the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from pivotrl.core.throughput import ThroughputModel


class Role(StrEnum):
    """What a device does. The order of `PIPELINE` is the order work flows in one GRPO iteration."""

    ROLLOUT = "rollout"
    REWARD = "reward"
    TRAIN = "train"


#: Upstream-to-downstream order: rollout output feeds reward, reward output (whole groups) feeds train.
PIPELINE: tuple[Role, ...] = (Role.ROLLOUT, Role.REWARD, Role.TRAIN)


#: Expected remaining length of a sequence that outlived its expected length, as a fraction of what it has
#: generated (mean residual life of a heavy-tailed length distribution grows with age; ~0.5 for lognormal
#: lengths with p99 ≈ 10× median).
TAIL_RESIDUAL = 0.5


class SeqState(StrEnum):
    """A sequence's life: waiting → running (on one replica) → finished; an abort sends it back to waiting."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class ReplicaState(StrEnum):
    """`shifting`: formed by a decision, loading its role context, not yet dispatchable.
    `active`: serving its role. There is no idle state: free devices have no replica."""

    ACTIVE = "active"
    SHIFTING = "shifting"


@dataclass(eq=False)
class Sequence:
    """One unit of work for a role: a rollout response, a GenRM judgement, or a train item.

    `generated` counts work done so far (tokens decoded, or train tokens processed) and survives aborts: an
    aborted sequence resumes from it. `payload` is opaque to core (the runtime keeps token ids there, the
    simulator the true length). For a train item, `prompt_tokens` is 0 and `max_new_tokens` is the item's
    token count (the work), so the planner treats all roles alike.
    """

    seq_id: str
    role: Role
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0
    expected_new_tokens: float | None = None
    iteration: int = 0
    group_id: str | None = None
    payload: Any = None
    # Bookkeeping owned by the controller (read-only for drivers).
    state: SeqState = SeqState.WAITING
    replica_id: str | None = None
    aborts: int = 0
    order: int = -1
    kv_reserved: int = 0
    submitted_at: float = 0.0
    finished_at: float | None = None

    def remaining_estimate(self) -> float:
        """Expected work still to do, in tokens. Never below 1 while not done, never above the budget left.

        Without an estimate we assume half the remaining budget (long-tailed lengths make the mean a poor
        guide, the budget an upper bound). With one, a sequence that has outlived it is not assumed to be
        about to stop: with long-tailed lengths the expected remaining life grows with age, so we take
        `TAIL_RESIDUAL × generated` when that is larger (this is what makes a rollout tail's remaining work
        visible to the planner).
        """
        budget = max(self.max_new_tokens - self.generated, 0)
        if budget == 0:
            return 0.0
        if self.expected_new_tokens is None:
            return max(budget / 2.0, 1.0)
        left = max(self.expected_new_tokens - self.generated, TAIL_RESIDUAL * self.generated, 1.0)
        return float(min(left, budget))

    @property
    def kv_tokens(self) -> int:
        """KV tokens at most: prompt plus the whole generation budget (what `kv_reserve="budget"` reserves).

        Reserving the budget (rather than growing) means an admitted sequence can never push a replica over
        its KV capacity later, so admission is the only place capacity must be checked.
        """
        return self.prompt_tokens + self.max_new_tokens

    def kv_need(self, reserve: str = "budget") -> int:
        """KV tokens to reserve when placing this sequence now. `budget`: the whole budget (never
        overflows). `expected`: prompt + the expected length (at least what is generated so far + 1) — the
        engine admits by current use and preempts on overflow, as vLLM does, so more sequences run."""
        if reserve == "budget":
            return self.prompt_tokens + self.max_new_tokens
        expected = self.expected_new_tokens
        if expected is None:
            expected = self.max_new_tokens / 2
        return self.prompt_tokens + min(self.max_new_tokens, max(self.generated + 1, math.ceil(expected)))

    @property
    def context_tokens(self) -> int:
        """Tokens that must be prefilled again if this sequence is aborted and resumed elsewhere."""
        return self.prompt_tokens + self.generated


@dataclass(frozen=True)
class RoleSpec:
    """How replicas of one role are built and what a new one is assumed to do before it is measured.

    `prior_step_a_s` / `prior_step_b_s` are the prior of step_time(x) = a + b·x seconds where x is work per
    step (tokens decoded per step = concurrency for generation; tokens per micro-batch for train).
    `tokens_per_seq_step` is x per running sequence per step (1 for decoding; an item's tokens for train).
    `sync_fixed_s` / `sync_shared_s` are the prior of the synchronisation after a role's last item of an
    iteration (train: gradient reduction, optimizer step, publish), sync(m) = fixed + shared / m seconds
    with m replicas: a sharded optimizer steps and writes 1/m of the model per rank. 0 / 0 (the default)
    means unknown; the first measured iteration replaces it (`pivotrl.core.iteration.stages`).
    `whole_batches`: the role's replicas run their items in whole micro-batches, and an item given to a
    replica whose batch is in flight waits for that batch to end (no continuous batching). Such a replica
    is given work only when idle, and then only its share of the queue (`pivotrl.core.dispatcher`).
    `step_context_s` (generation): seconds a decode step spends per token of context its running rows hold
    (attention reads every cached token), so a batch of long sequences steps slower than one of short ones
    with as many rows. The step line holds at `context_ref_tokens` of context per row: a measured step is
    moved to that context before the line learns from it (`ThroughputModel`); the planner reads the line
    at the context the role's running rows hold (`pivotrl.core.views`), the iteration model at the context
    each iteration's own lengths give (`pivotrl.core.iteration.at_context`). 0 (the default): the line
    alone, whatever the context.
    `dp_efficiency_per_doubling` (train): data-parallel replicas slow each other down (their gradient
    collectives), each doubling of the role's replicas keeping this fraction of a replica's speed; 1.0 is
    perfect scaling. The step-time prior is one replica's line; a fitted line holds at the replica count it
    was measured at, and the iteration model rescales it to another count (`pivotrl.core.stage.Stage`).
    """

    devices_per_replica: int = 1
    max_seqs: int = 256
    kv_tokens: int = 1 << 22
    prior_step_a_s: float = 0.02
    prior_step_b_s: float = 0.0002
    tokens_per_seq_step: float = 1.0
    prefill_tokens_per_s: float = 20000.0
    sync_fixed_s: float = 0.0
    sync_shared_s: float = 0.0
    whole_batches: bool = False
    dp_efficiency_per_doubling: float = 1.0
    step_context_s: float = 0.0
    context_ref_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.step_context_s < 0.0 or self.context_ref_tokens < 0.0:
            raise ValueError("step_context_s and context_ref_tokens must be >= 0, got "
                             f"{self.step_context_s} and {self.context_ref_tokens}")
        if not 0.0 < self.dp_efficiency_per_doubling <= 1.0:
            raise ValueError(
                f"dp_efficiency_per_doubling must be in (0, 1], got {self.dp_efficiency_per_doubling}")


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the controller. Defaults are sane for the CPU quickstart and the simulator alike.

    horizon_s: H, the look-ahead over which the planner counts expected work (step 4).
    hysteresis: a plan must beat `hysteresis × H × devices moved` (device-seconds) to be taken, so the
        planner does not flap between near-equal allocations (waived for a role with work and no replica).
    cooldown_s: a device that just shifted may not shift again for this long, first placements and both
        directions included: it keeps iteration 0's first decisions off a throughput fit with no samples
        yet, and stops churn (see docs/decisions.md#cooldown-applies-to-every-shift).
    cooldown_shift_multiple: after a *shift* (not a first placement), the lock is the shorter of
        `cooldown_s` and this multiple of the shift's measured duration: the lock is there so that a move
        pays for itself before the device moves again, and a move of under a second pays for itself within
        seconds (see docs/decisions.md#a-lock-amortises-its-own-shift). 0: `cooldown_s` after every shift.
    decay: per-sample recency weight of the throughput fit (older samples weigh decay**age).
    prior_weight: weighted samples needed (with spread in concurrency) before the fitted slope replaces
        the prior's.
    shift_prior_s: assumed shift duration for a (from, to) pair never measured yet.
    max_shift_fraction: at most this fraction of the devices move in one decision.
    upstream_slack: a role upstream of the shift-up role gives up only replicas costing it at most this
        fraction of its throughput (its spare capacity): upstream output gates everything downstream.
    upstream_ahead: an upstream role may also give up busy replicas it could keep busy when, after giving
        them, its drain time is at most this fraction of the receiver's (with them): the receiver has queued
        work for longer than the slower upstream runs (2 devices: once rollout's tail fits on one device,
        the other judges finished rollouts). A fraction, not 1, because a long tail's remaining work is
        uncertain. Only for roles with fewer than 1 / `upstream_slack` replicas (where no busy replica can
        ever be spare; with more the slack rule resolves). 0 turns it off (see
        docs/decisions.md#upstream-ahead).
    upstream_rate, upstream_rate_floor: within one `cooldown_s` rollout gives train at most
        max(upstream_rate × the replicas it had, upstream_rate_floor) replicas it could keep busy. The slack
        is judged by the throughput fit, which in a stage's first minute has not seen step time grow with
        context: this bound does not trust it. The floor keeps small clusters (where a replica is a large
        fraction) free (see docs/decisions.md#upstream-rate).
    kv_reserve: "budget" reserves prompt + max_new_tokens per sequence (a replica can never overflow);
        "expected" reserves prompt + expected length (more concurrency; the engine must preempt on overflow,
        as vLLM/SGLang do).
    max_staleness: the run's bound k (`run.max_staleness`, 0 = on-policy). With k ≥ 1 the next
        iteration's rollouts start when this iteration's rollouts end, on the devices they hold then, not
        at an opening that moves the whole allocation (`Shiftable.plan`).
    """

    roles: dict[Role, RoleSpec] = field(default_factory=lambda: {r: RoleSpec() for r in PIPELINE})
    horizon_s: float = 10.0
    hysteresis: float = 0.05
    cooldown_s: float = 2.0
    cooldown_shift_multiple: float = 3.0
    decay: float = 0.95
    prior_weight: float = 2.0
    shift_prior_s: float = 5.0
    shift_cost_alpha: float = 0.3
    max_shift_fraction: float = 1.0
    kv_reserve: str = "budget"
    upstream_slack: float = 0.1
    upstream_rate: float = 0.2
    upstream_rate_floor: int = 16
    upstream_ahead: float = 0.25
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.kv_reserve not in ("budget", "expected"):
            raise ValueError(f"kv_reserve must be 'budget' or 'expected', got {self.kv_reserve!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def lock_after(self, shift_s: float) -> float:
        """Seconds a device stays where a shift of `shift_s` seconds took it (`cooldown_shift_multiple`)."""
        if self.cooldown_shift_multiple <= 0:
            return self.cooldown_s
        return min(self.cooldown_s, self.cooldown_shift_multiple * max(shift_s, 0.0))

    def spec(self, role: Role) -> RoleSpec:
        return self.roles.get(role) or RoleSpec()

    def devices_per_replica(self, role: Role) -> int:
        return self.spec(role).devices_per_replica


@dataclass(frozen=True)
class ShiftTimings:
    """How long one device took to take up a role, phase by phase (seconds), as its driver measured it.

    Phases only: the total is derived, never reported, so no consumer can count a duration twice. `warm`
    says the role's context was still resident (parked) and only its weights, if any, were refreshed; it is
    a flag about the shift, not a phase. `other` holds time a driver could not attribute to a phase (a
    driver that only knows when the shift was decided and when it finished reports it all there).
    """

    abort: float = 0.0
    offload: float = 0.0
    fetch: float = 0.0
    load: float = 0.0
    other: float = 0.0
    warm: bool = False

    PHASES: ClassVar[tuple[str, ...]] = ("abort", "offload", "fetch", "load", "other")

    def __post_init__(self) -> None:
        for name in self.PHASES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"shift phase {name!r} must be a finite number of seconds >= 0, got {v!r}")

    @property
    def total(self) -> float:
        return float(sum(getattr(self, name) for name in self.PHASES))

    def phases(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in self.PHASES}

    @classmethod
    def elapsed(cls, seconds: float) -> ShiftTimings:
        """A shift known only by its duration."""
        return cls(other=max(float(seconds), 0.0))


@dataclass(frozen=True)
class IterationPlan:
    """What the driver tells the controller about one iteration, so each role's *future* work is known.

    rollout_seqs: rollout sequences this iteration (P prompts × group size).
    rollout_tokens_per_seq: expected response length, for rollouts not submitted yet.
    reward_tokens_per_rollout: expected GenRM tokens (judge output) per finished rollout.
    train_tokens_per_group: expected train tokens per finished group.
    rollout_prompt_tokens / reward_prompt_tokens: expected prompt tokens a rollout / a judgement prefills
        (0 = unknown); core's iteration model prices prefill with them (`iteration.stages`).
    rollout_tokens_tail / reward_tokens_tail: expected lengths at `stage.TAIL_FRACTIONS` (the length
        exceeded by that fraction of items), and rollout_tokens_longest / reward_tokens_longest the
        expected longest of the iteration; empty / 0 = unknown (a prior multiple of the mean is assumed
        until an iteration is measured). What a runtime knows of its length distribution beforehand, e.g.
        from the last run; the measured profile replaces them after one iteration.
    last_iteration: no iteration follows this one in the run (as far as the driver knows), so nothing
        moved in its tail is wanted back at a next opening (`planner.return_trip_s`).
    """

    iteration: int
    rollout_seqs: int
    group_size: int = 1
    rollout_tokens_per_seq: float = 128.0
    reward_tokens_per_rollout: float = 64.0
    train_tokens_per_group: float = 512.0
    rollout_prompt_tokens: float = 0.0
    reward_prompt_tokens: float = 0.0
    rollout_tokens_tail: tuple[float, ...] = ()
    reward_tokens_tail: tuple[float, ...] = ()
    rollout_tokens_longest: float = 0.0
    reward_tokens_longest: float = 0.0
    last_iteration: bool = False

    def __post_init__(self) -> None:  # a plan that crossed a wire may carry lists: keep it hashable
        for name in ("rollout_tokens_tail", "reward_tokens_tail"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

    @property
    def train_tokens_per_item(self) -> float:
        """Expected train tokens of one item (a group's tokens over its members)."""
        return self.train_tokens_per_group / max(self.group_size, 1)


@dataclass(eq=False)
class Replica:
    """One engine instance of a role on `devices` (len == the role's devices_per_replica).

    `running` holds the sequences it serves (insertion ordered); `kv_used` the KV tokens they reserve;
    `remaining` the sum of their remaining-work estimates and `context` of their context tokens (what an
    abort would have to prefill again), kept incrementally so the planner never walks sequences.
    `model` is its own throughput fit (spawned from the role's shared fit). `furthest()` is the running
    sequence that has generated the most, cached between the changes that can take it away.
    """

    replica_id: str
    role: Role
    devices: tuple[str, ...]
    max_seqs: int
    kv_capacity: int
    model: ThroughputModel
    state: ReplicaState = ReplicaState.SHIFTING
    created_at: float = 0.0
    running: dict[str, Sequence] = field(default_factory=dict)
    kv_used: int = 0
    remaining: float = 0.0
    context: int = 0
    _furthest: Sequence | None = None  # the running sequence that has generated the most
    _furthest_stale: bool = False  # it left: found again by the next `furthest()`

    @property
    def n(self) -> int:
        return len(self.running)

    def furthest(self) -> Sequence | None:
        """The running sequence that has generated the most (None with none running). A walk of `running`
        only after the one holding the most left; otherwise the cached one."""
        if self._furthest_stale:
            self._furthest = max(self.running.values(), key=lambda s: s.generated, default=None)
            self._furthest_stale = False
        return self._furthest

    def grew(self, seq: Sequence) -> None:
        """`seq` runs here and has just joined or generated more."""
        if not self._furthest_stale and (self._furthest is None or seq.generated > self._furthest.generated):
            self._furthest = seq

    def left(self, seq: Sequence) -> None:
        """`seq` stopped running here."""
        if seq is self._furthest:
            self._furthest = None
            self._furthest_stale = bool(self.running)

    def fits(self, need: int) -> bool:
        """Room for one more sequence reserving `need` KV tokens?"""
        return len(self.running) < self.max_seqs and self.kv_used + need <= self.kv_capacity

    def rate(self) -> float:
        return self.model.rate(len(self.running))
