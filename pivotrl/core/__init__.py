"""pivotrl.core: pure policy (no Dask, torch, I/O or wall clock).

Drivers use `Controller`; see docs/core-api.md.
"""

from pivotrl.core.controller import Controller
from pivotrl.core.decision import Assignment, Candidate, Decision, DeviceMove, PlanReasoning, ReplicaShift
from pivotrl.core.modes import make_policy
from pivotrl.core.policies import (
    Colocated,
    Disaggregated,
    Grouped,
    Manual,
    Policy,
    ShiftPlan,
    best_static_split,
    bottleneck_cost,
    static_splits,
)
from pivotrl.core.shiftable import Shiftable
from pivotrl.core.throughput import ThroughputModel
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

__all__ = [
    "PIPELINE", "Assignment", "Candidate", "Colocated", "Controller", "ControllerConfig", "Decision",
    "DeviceMove", "Disaggregated", "Grouped", "IterationPlan", "Manual", "PlanReasoning", "Policy", "Replica",
    "ReplicaShift", "ReplicaState", "Role", "RoleSpec", "SeqState", "Sequence", "ShiftPlan", "ShiftTimings",
    "Shiftable", "ThroughputModel", "best_static_split", "bottleneck_cost", "make_policy", "static_splits",
]
