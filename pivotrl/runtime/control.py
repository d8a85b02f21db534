"""The decision interface the scheduler plugin drives, and a manual implementation of it.

The scheduler plugin is *mechanism*: it stores work items, talks to workers, applies decisions. Every
*decision* — which worker runs which item, which devices change role and when — comes from a `Control`.
`CoreControl` (in `core_control.py`) adapts pivotrl.core's Controller (the planner and the three deployment
paradigms); `ManualControl` here is the plain mechanism-level baseline: FIFO queues per role, roles changed
only when asked (`request_shift`), used by tests that must steer shifts explicitly and by anything that wants
a fixed allocation with no planner at all.

Time is always passed in (`now`, seconds on a monotonic clock), as in core.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

ROLES: tuple[str, ...] = ("rollout", "reward", "train")


@dataclass
class Decision:
    """What the controller wants done now: aborts to run, devices to shift, and why."""

    id: str
    aborts: list[str] = field(default_factory=list)
    shifts: list[tuple[str, str | None]] = field(default_factory=list)  # (device, new role; None = idle)
    dispatch: list[tuple[str, str]] = field(default_factory=list)  # (item, device), after the aborts
    reasoning: dict[str, Any] = field(default_factory=dict)


class Control(Protocol):
    """Events in, decisions out. Implementations hold no Dask object and never read the clock."""

    def add_device(self, dev: str, now: float) -> str | None:
        """A device joined; return the role it should load first (None = stay idle)."""

    def remove_device(self, dev: str, now: float) -> None: ...

    def begin_iteration(self, plan: dict[str, Any], now: float) -> None:
        """The iteration's structure (core's IterationPlan fields), so future work counts."""

    def submit(self, item: Any, now: float) -> None:
        """New work. `item` has id, role, iteration, group_id, prompt_tokens, max_new_tokens, est_tokens,
        generated (a list)."""

    def requeue(self, item_id: str, generated: int, now: float) -> None:
        """An item came back (aborted, or its device was lost): it waits again, ahead of new ones."""

    def on_progress(self, item_id: str, generated: int, now: float) -> None: ...

    def on_finished(self, item_id: str, generated: int, now: float) -> None: ...

    def on_step(self, dev: str, concurrency: int, step_time_s: float, tokens: int, now: float) -> None: ...

    def on_shift_started(self, dev: str, role: str, now: float) -> None: ...

    def on_shift_done(self, dev: str, role: str, timings: dict[str, float], now: float) -> Decision | None:
        """The device finished loading `role`; may return a shift-up migration to apply."""

    def dispatch(self, now: float, free: dict[str, int]) -> list[tuple[str, str]]:
        """Assign waiting items to ready devices with free slots: [(item_id, dev)]."""

    def tick(self, now: float) -> Decision | None: ...

    def snapshot(self) -> dict[str, Any]:
        """Plain data for logs and the dashboard (queue depths, allocation, model state)."""


class ManualControl:
    """FIFO per role; a device keeps its role until `request_shift`. No planner, no guesswork.

    `initial_roles` is cycled over devices in the order they join (e.g. ["rollout", "reward"] puts the first
    device on rollout and the second on reward).
    """

    def __init__(self, initial_roles: list[str] | None = None) -> None:
        self.initial_roles = list(initial_roles or ["rollout"])
        self._joined = 0
        self.role_of: dict[str, str | None] = {}
        self.ready: dict[str, bool] = {}
        self.queues: dict[str, deque[str]] = {}
        self.item_role: dict[str, str] = {}
        self.running_on: dict[str, str] = {}
        self._pending: list[tuple[str, str]] = []
        self._ids = itertools.count()

    # -- events ---------------------------------------------------------------------------------------
    def add_device(self, dev: str, now: float) -> str | None:
        role = self.initial_roles[self._joined % len(self.initial_roles)] if self.initial_roles else None
        self._joined += 1
        self.role_of[dev] = None
        self.ready[dev] = False
        return role

    def remove_device(self, dev: str, now: float) -> None:
        self.role_of.pop(dev, None)
        self.ready.pop(dev, None)
        for item, d in list(self.running_on.items()):
            if d == dev:
                del self.running_on[item]

    def begin_iteration(self, plan: dict[str, Any], now: float) -> None:
        return None

    def submit(self, item: Any, now: float) -> None:
        self.item_role[item.id] = item.role
        self.queues.setdefault(item.role, deque()).append(item.id)

    def requeue(self, item_id: str, generated: int, now: float) -> None:
        self.running_on.pop(item_id, None)
        self.queues.setdefault(self.item_role[item_id], deque()).appendleft(item_id)

    def on_progress(self, item_id: str, generated: int, now: float) -> None:
        return None

    def on_finished(self, item_id: str, generated: int, now: float) -> None:
        self.running_on.pop(item_id, None)

    def on_step(self, dev: str, concurrency: int, step_time_s: float, tokens: int, now: float) -> None:
        return None

    def on_shift_started(self, dev: str, role: str, now: float) -> None:
        self.ready[dev] = False  # its running items are aborted by the plugin and come back via requeue

    def on_shift_done(self, dev: str, role: str, timings: dict[str, float], now: float) -> Decision | None:
        self.role_of[dev] = role
        self.ready[dev] = role is not None
        return None

    # -- decisions ------------------------------------------------------------------------------------
    def request_shift(self, dev: str, role: str) -> None:
        self._pending.append((dev, role))

    def dispatch(self, now: float, free: dict[str, int]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for dev, slots in sorted(free.items(), key=lambda kv: -kv[1]):
            role = self.role_of.get(dev)
            if not self.ready.get(dev) or role is None:
                continue
            queue = self.queues.get(role)
            while queue and slots > 0:
                item = queue.popleft()
                self.running_on[item] = dev
                out.append((item, dev))
                slots -= 1
        return out

    def tick(self, now: float) -> Decision | None:
        if not self._pending:
            return None
        shifts, self._pending = self._pending, []
        return Decision(id=f"manual-{next(self._ids)}", shifts=shifts, reasoning={"stimulus": "request"})

    def snapshot(self) -> dict[str, Any]:
        return {
            "queue_depth": {r: len(q) for r, q in self.queues.items()},
            "roles": dict(self.role_of),
        }


class StaticGroupsControl(ManualControl):
    """Disaggregated deployment for clusters with fewer devices than roles: a *fixed* group of roles per
    device (e.g. device 0: rollout+train, device 1: reward). A device serves one role of its group at a time
    and switches, colocated-style, only when that role has nothing waiting or running on it and another role
    of its group has work waiting. With one role per device this is the plain static split; devices never
    leave their group, so this is the static baseline the shiftable planner is compared against.
    (Kept here, next to the manual mechanism, until core grows grouped static splits.)
    """

    def __init__(self, groups: list[list[str]]) -> None:
        if not groups or any(not g for g in groups):
            raise ValueError("every device group needs at least one role")
        super().__init__([g[0] for g in groups])
        self.groups = [list(g) for g in groups]
        self.group_of: dict[str, list[str]] = {}
        self.shifting: set[str] = set()

    def add_device(self, dev: str, now: float) -> str | None:
        self.group_of[dev] = self.groups[self._joined % len(self.groups)]
        return super().add_device(dev, now)

    def on_shift_started(self, dev: str, role: str, now: float) -> None:
        super().on_shift_started(dev, role, now)
        self.shifting.add(dev)

    def on_shift_done(self, dev: str, role: str, timings: dict[str, float], now: float) -> Decision | None:
        self.shifting.discard(dev)
        return super().on_shift_done(dev, role, timings, now)

    def tick(self, now: float) -> Decision | None:
        shifts = []
        for dev, group in self.group_of.items():
            role = self.role_of.get(dev)
            if dev in self.shifting or not self.ready.get(dev) or len(group) < 2:
                continue
            busy = self.queues.get(role) or any(d == dev for d in self.running_on.values())
            if busy:
                continue
            nxt = [r for r in group if r != role and self.queues.get(r)]
            if nxt:
                shifts.append((dev, nxt[0]))
        if not shifts:
            return super().tick(now)
        return Decision(
            id=f"groups-{next(self._ids)}",
            shifts=shifts,
            reasoning={"stimulus": "role idle, other role of the group waiting"},
        )
