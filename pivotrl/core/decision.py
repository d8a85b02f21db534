"""What core tells its driver to do: a `Decision` (aborts, shifts, dispatches, in that order) and the
planner's reasoning behind it, typed outputs the Dask scheduler plugin and the simulator both execute.

Plain data, as `pivotrl.core.types`: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pivotrl.core.types import Role


@dataclass(frozen=True)
class Assignment:
    """Start (or resume, when `seq.generated > 0`) sequence `seq_id` on replica `replica_id`."""

    seq_id: str
    replica_id: str


@dataclass(frozen=True)
class DeviceMove:
    """One device leaving `from_role` (None = a free device) for `to_role`."""

    device: str
    from_role: Role | None
    to_role: Role
    from_replica: str | None


@dataclass(frozen=True)
class ReplicaShift:
    """A replica of `to_role` formed from `devices`; it is `shifting` until the driver reports it ready
    through `Controller.on_shift_done(replica_id, ...)`. `moves` says where each device came from."""

    replica_id: str
    to_role: Role
    devices: tuple[str, ...]
    moves: tuple[DeviceMove, ...]


@dataclass(frozen=True)
class Candidate:
    """One plan the planner weighed: free `devices` devices by dissolving `donors` (replica ids), to form
    `new_replicas` replicas of the shift-up role. G, φ, B in device-seconds of work over the horizon."""

    devices: int
    donors: tuple[str, ...]
    donors_per_role: dict[str, int]
    new_replicas: int
    gain: float
    penalty: float

    @property
    def benefit(self) -> float:
        return self.gain - self.penalty


@dataclass(frozen=True)
class PlanReasoning:
    """Why the planner did (or did not) shift: inputs and every candidate, for the log and the dashboard."""

    now: float
    tau: dict[str, float]
    throughput: dict[str, float]
    work_tokens: dict[str, float]
    shift_up_role: str | None
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    threshold: float   # margin per device moved; a candidate needs B > threshold × devices
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "tau": dict(self.tau),
            "throughput": dict(self.throughput),
            "work_tokens": dict(self.work_tokens),
            "shift_up_role": self.shift_up_role,
            "threshold": self.threshold,
            "note": self.note,
            "candidates": [
                {"devices": c.devices, "donors": list(c.donors), "donors_per_role": dict(c.donors_per_role),
                 "new_replicas": c.new_replicas, "G": c.gain, "phi": c.penalty, "B": c.benefit}
                for c in self.candidates
            ],
            "chosen": None if self.chosen is None else {
                "devices": self.chosen.devices, "donors": list(self.chosen.donors),
                "G": self.chosen.gain, "phi": self.chosen.penalty, "B": self.chosen.benefit},
        }


@dataclass
class Decision:
    """What the driver must execute, in this order:

    1. `aborts`: abort these sequences on these replicas and report each partial through
       `Controller.on_progress(seq_id, generated, now, payload=...)` (the controller already re-queued them);
    2. `shifts`: replicas to dissolve are already gone from the controller; start loading each new
       replica's role context on its devices and call `on_shift_done(replica_id, ...)` when it is ready;
    3. `dispatch`: start these (possibly resumed) sequences on these replicas.
    """

    decision_id: int
    now: float
    stimulus: str
    kind: str
    aborts: dict[str, list[str]] = field(default_factory=dict)
    dissolved: list[str] = field(default_factory=list)
    shifts: list[ReplicaShift] = field(default_factory=list)
    dispatch: list[Assignment] = field(default_factory=list)
    reasoning: PlanReasoning | None = None

    @property
    def device_moves(self) -> list[tuple[str, Role | None, Role]]:
        """Every (device, from_role, to_role) this decision moves."""
        return [(m.device, m.from_role, m.to_role) for s in self.shifts for m in s.moves]

    def as_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "now": self.now,
            "stimulus": self.stimulus,
            "kind": self.kind,
            "aborts": {k: list(v) for k, v in self.aborts.items()},
            "dissolved": list(self.dissolved),
            "shifts": [
                {"replica_id": s.replica_id, "to_role": str(s.to_role), "devices": list(s.devices),
                 "from": [[m.device, None if m.from_role is None else str(m.from_role), m.from_replica]
                          for m in s.moves]}
                for s in self.shifts
            ],
            "dispatch": [[a.seq_id, a.replica_id] for a in self.dispatch],
            "reasoning": None if self.reasoning is None else self.reasoning.as_dict(),
        }
