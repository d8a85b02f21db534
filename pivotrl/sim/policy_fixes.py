"""Work-arounds for defects found in `pivotrl.core` policies, kept here until core fixes them.

Each is reported precisely in docs/sim-needs-from-core.md; drop the override when core has the fix.

`Colocated`: core keeps the cluster on its current stage while `future_work(current)` is true. At an
iteration boundary the cluster sits in `train` (the last stage), the new rollouts are live, and
`future_work(train)` is true *because* rollout (upstream) has work - but no device serves rollout, so the
cluster waits forever. Here: when the current stage has no live work and another stage does, switch.
"""

from __future__ import annotations

from pivotrl.core.policies import Colocated as CoreColocated
from pivotrl.core.policies import ShiftPlan, role_has_work
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.types import ReplicaState


class Colocated(CoreColocated):
    def plan(self, state: ClusterState, costs: ShiftCostModel, now: float) -> ShiftPlan | None:
        if any(r.state is ReplicaState.SHIFTING for r in state.replicas.values()):
            return None
        current = next((r for r in state.roles if state.by_role[r]), None)
        if current is None or role_has_work(state, current):
            return super().plan(state, costs, now)
        start = state.roles.index(current) + 1
        order = [state.roles[(start + i) % len(state.roles)] for i in range(len(state.roles))]
        target = next((r for r in order if role_has_work(state, r)), None)
        if target is None or target is current:
            return super().plan(state, costs, now)
        dissolve = tuple(r for role in state.roles for r in state.by_role[role])
        devices = sorted(state.free_devices() + [d for rid in dissolve for d in state.replicas[rid].devices])
        g = state.config.devices_per_replica(target)
        form = tuple((target, tuple(devices[i:i + g])) for i in range(0, len(devices) - g + 1, g))
        return ShiftPlan(dissolve, form, f"colocated:{current}->{target}")
