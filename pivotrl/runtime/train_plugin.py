"""The train group's rendezvous on the scheduler: the `pivotrl_train_*` handlers.

Why on the scheduler: it is the one process every device already talks to, and it knows which devices are
in the train role (the pivotrl orchestrator's workers), so ranks and group ids come from one place
(`pivotrl.core.train_group.decide_group`) and no side channel is needed. The data plane does not pass
through it: rank 0 of a group hosts the group's `torch.distributed` key-value store and posts only its
address here; the other ranks look it up (waiting for it on the scheduler's event loop, with a timeout).

`TrainRendezvous` is Dask-free (unit-tested alone); `TrainGroupPlugin` is its thin Dask wrapper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from pivotrl.core.train_group import TrainGroupPlan, decide_group

PLUGIN_NAME = "pivotrl-train"


class TrainRendezvous:
    """The current group per policy, and the key-value store address of each formation's rank 0.

    A formation is one (re)building of a group's process group, named by a token the driver makes: the
    same members may form again (a new run, a failed step) and must never find the last formation's
    store."""

    def __init__(self) -> None:
        self.plans: dict[str, TrainGroupPlan] = {}
        self.addresses: dict[tuple[str, str], str] = {}
        self._posted: dict[tuple[str, str], asyncio.Event] = {}

    def plan(self, policy: str, step: int, devices: Iterable[str]) -> TrainGroupPlan:
        plan = decide_group(self.plans.get(policy), devices, step)
        self.plans[policy] = plan
        return plan

    def _event(self, key: tuple[str, str]) -> asyncio.Event:
        return self._posted.setdefault(key, asyncio.Event())

    def post(self, policy: str, token: str, address: str) -> None:
        for old in [k for k in self.addresses if k[0] == policy]:  # one live formation per policy
            self.addresses.pop(old, None)
            self._posted.pop(old, None)
        key = (policy, str(token))
        self.addresses[key] = address
        self._event(key).set()

    async def lookup(self, policy: str, token: str, timeout_s: float) -> str | None:
        key = (policy, str(token))
        if key not in self.addresses:
            try:
                await asyncio.wait_for(self._event(key).wait(), timeout_s)
            except TimeoutError:
                return None
        return self.addresses.get(key)


def plan_to_wire(plan: TrainGroupPlan) -> dict[str, Any]:
    return {"group_id": plan.group_id, "members": list(plan.members), "step": plan.step}


def plan_from_wire(d: dict[str, Any]) -> TrainGroupPlan:
    return TrainGroupPlan(int(d["group_id"]), tuple(d["members"]), int(d["step"]))


class TrainGroupPlugin(SchedulerPlugin):
    """Adds `pivotrl_train_plan`, `pivotrl_train_post` and `pivotrl_train_lookup` to the scheduler."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.rv = TrainRendezvous()

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "pivotrl_train_plan": self.handle_plan,
            "pivotrl_train_post": self.handle_post,
            "pivotrl_train_lookup": self.handle_lookup,
        })

    def train_devices(self) -> list[str] | None:
        """The workers in the train role now, from the pivotrl orchestrator when one runs here."""
        main = getattr(self, "scheduler", None) and self.scheduler.plugins.get("pivotrl")
        if main is None:
            return None
        return [a for a, w in main.orch.workers.items() if w.role == "train"]

    def handle_plan(self, policy: str, step: int, devices: list[str]) -> dict[str, Any]:
        """The group for `step`: the train-role devices that are alive, else the given `devices` (the
        workers whose flushed sums the step reduces)."""
        alive = set(self.scheduler.workers)
        train = self.train_devices()
        chosen = [d for d in (train if train else devices) if d in alive]
        return plan_to_wire(self.rv.plan(policy, int(step), chosen or [d for d in devices if d in alive]))

    def handle_post(self, policy: str, token: str, address: str) -> None:
        self.rv.post(policy, token, address)

    async def handle_lookup(self, policy: str, token: str, timeout_s: float) -> str | None:
        return await self.rv.lookup(policy, token, float(timeout_s))
